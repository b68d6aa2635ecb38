"""Code that will meet NCCL: no tensor without an explicit device in distributed modules.

NCCL takes CUDA tensors only (gloo CPU ones), so a tensor made on the default device (CPU)
and handed to a collective works on these CPU machines and fails on GPUs. This test reads
the source (ast) of every `hf_lowprec` module that calls `torch.distributed` and fails on
every tensor factory call there without a `device=` argument (or with `device=None`). The
`*_like` factories, `new_*` methods and operations on existing tensors inherit their device
and are not factories here. A call that must stay on the host goes in ALLOWED with the
reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_lowprec"
FACTORIES = {
    "tensor",
    "as_tensor",
    "scalar_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "range",
    "linspace",
    "logspace",
    "eye",
    "rand",
    "randn",
    "randint",
    "randperm",
    "empty_strided",
    "from_numpy",
    "frombuffer",
}
# (module path relative to hf_lowprec, enclosing function, factory) → why it may use the default device.
ALLOWED: dict[tuple[str, str, str], str] = {}


def _calls_distributed(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
                return True
    return False


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def deviceless_factories(source: str) -> list[tuple[str, str, int]]:
    """(enclosing function, factory, line) of each torch factory call without a device."""
    tree = ast.parse(source)
    found = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, f"{where}.{child.name}" if where else child.name)
                continue
            if isinstance(child, ast.Call):
                name = _dotted(child.func)
                factory = name.rsplit(".", 1)[-1]
                if name.startswith("torch.") and name.count(".") == 1 and factory in FACTORIES:
                    device = next((k.value for k in child.keywords if k.arg == "device"), None)
                    explicit = device is not None and not (isinstance(device, ast.Constant) and device.value is None)
                    if not explicit:
                        found.append((where or "<module>", factory, child.lineno))
            visit(child, where)

    visit(tree, "")
    return found


def distributed_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if _calls_distributed(ast.parse(p.read_text())))


def test_the_audit_sees_the_distributed_modules():
    names = {p.relative_to(PACKAGE).as_posix() for p in distributed_modules()}
    # The modules with collectives today; a new one joins the audit by importing torch.distributed.
    assert {"fp8/comm.py", "optim/zero_fp8.py", "strategies/fp8_lm_o3.py", "engines/zero.py"} <= names


@pytest.mark.parametrize("path", distributed_modules(), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_every_tensor_has_an_explicit_device(path):
    rel = path.relative_to(PACKAGE).as_posix()
    bad = [
        f"{rel}:{line} torch.{factory}(...) in {where} has no device=; pass the device of the tensors it meets"
        for where, factory, line in deviceless_factories(path.read_text())
        if (rel, where, factory) not in ALLOWED
    ]
    assert not bad, "\n".join(bad)


def test_allow_list_entries_still_exist_and_give_a_reason():
    for (rel, where, factory), reason in ALLOWED.items():
        assert reason.strip(), (rel, where, factory)
        found = {(w, f) for w, f, _ in deviceless_factories((PACKAGE / rel).read_text())}
        assert (where, factory) in found, f"stale allow-list entry {(rel, where, factory)}"


def test_the_audit_flags_what_it_should():
    # The shapes of the defects it exists for (the FP8 ZeRO all-gather built its buffers this way).
    source = """
import torch
import torch.distributed as dist

class Z:
    def gather(self, size, world, mine):
        send = torch.zeros(size, dtype=torch.uint8)
        received = torch.empty(size * world, dtype=torch.uint8, device=mine.device)
        ok = torch.tensor(1.0, device=None)
        scales = torch.zeros_like(mine)
        dist.all_gather_into_tensor(received, send)
"""
    assert deviceless_factories(source) == [("Z.gather", "zeros", 7), ("Z.gather", "tensor", 9)]
