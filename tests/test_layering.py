"""The package's import graph: no cycles, and every import goes down the layers.

numerics → fp8 / coat → optim → report → strategies → integrations → command line
→ testing (what the tests and benchmarks share: on a floor of its own, so nothing else imports it).
The startup report reads a strategy's attributes through a protocol of its own
(`report.ReportedStrategy`), so it imports no strategy and the strategies may call it. The graph
is read from the source: every `import` and `from … import`, at module level, inside a function
or under `if TYPE_CHECKING:`, so neither an import hidden in a function nor one kept for type
checkers can hold a cycle apart. The device check's modules in bench/ form a graph of their
own, also without cycles. Besides: no two modules share a file name, and no module imports
another's private (underscore) names.
"""

from __future__ import annotations

import ast
import collections
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "hf_lowprec"
BENCH = ROOT.parent / "bench"

# Lower number = lower layer. A module's layer is that of its longest matching prefix.
LAYERS = {
    "hf_lowprec.numerics": 0,
    "hf_lowprec.version": 0,  # the version and commit checkpoints record
    "hf_lowprec.compiling": 0,
    "hf_lowprec.metrics": 0,
    "hf_lowprec.scaling": 0,
    "hf_lowprec.memory": 0,
    "hf_lowprec.partition": 0,
    "hf_lowprec.data": 0,
    "hf_lowprec.distributed": 0,
    "hf_lowprec.hardware": 0,
    "hf_lowprec.processes": 0,  # child processes that can run autograd (a fork, or a fork server)
    "hf_lowprec.grouped_experts": 0,  # the grouped experts forward (16-bit, and the routing the FP8 experts share)
    "hf_lowprec.fp8": 1,
    "hf_lowprec.coat": 1,
    "hf_lowprec.optim": 2,
    "hf_lowprec.checkpoints": 2,  # over memory and fp8: what is written, checked and read back
    "hf_lowprec.report": 3,
    "hf_lowprec.report_rows": 3,  # the report's module rows and gradients, read from the live objects
    "hf_lowprec.guard": 3,  # over fp8 and distributed: watches a run, raises FP8 layers
    "hf_lowprec.strategies": 4,
    "hf_lowprec.integrations": 5,
    "hf_lowprec.engines": 5,
    "hf_lowprec.trl": 5,  # the short import path of integrations.trl_trainers
    "hf_lowprec.compare": 6,
    "hf_lowprec.demo": 6,
    "hf_lowprec.runner": 6,
    "hf_lowprec.planning": 6,  # the step ledger and `hf-lowprec plan`: counts a strategy's step
    "hf_lowprec.cli": 6,
    "hf_lowprec.__main__": 6,
    "hf_lowprec": 6,
    "hf_lowprec.testing": 7,  # the GPU rules checked on CPU, for tests and benchmarks only
}

# Modules allowed over ~450 lines, each with the reason stated at its top.
LONG_MODULES = {"hf_lowprec.fp8.linear", "hf_lowprec.checkpoints.resume"}
MAX_LINES = 450


def _name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_name(p): p for p in ROOT.rglob("*.py")}


def _resolve(target: str) -> str:
    while target not in MODULES and "." in target:
        target = target.rsplit(".", 1)[0]
    return target


def _package(name: str, path: pathlib.Path) -> str:
    return name if path.name == "__init__.py" else name.rsplit(".", 1)[0]


def _module_target(package: str, node: ast.ImportFrom) -> str:
    """The module a `from … import` names, relative ones resolved against `package`."""
    if node.level:
        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))
    return node.module or ""


def _imports(name: str, path: pathlib.Path) -> set[str]:
    package = _package(name, path)
    found: set[str] = set()
    # Every import node: at module level, in a function, under `if TYPE_CHECKING:` alike.
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("hf_lowprec"))
        elif isinstance(node, ast.ImportFrom):
            target = _module_target(package, node)
            if target.startswith("hf_lowprec"):
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    found.add(full if full in MODULES else target)
    edges = {_resolve(t) for t in found}
    # Importing a.b.c from outside package a.b also runs a.b's __init__.
    for target in list(edges):
        parts = target.split(".")
        for depth in range(2, len(parts)):
            parent = ".".join(parts[:depth])
            if parent in MODULES and not (name == parent or name.startswith(parent + ".")):
                edges.add(parent)
    return edges - {name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name: str) -> int:
    prefix = max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len)
    return LAYERS[prefix]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def _private_uses(name: str, path: pathlib.Path) -> tuple[list[str], list[str]]:
    """Another package module's private names that `name` imports (`from .x import _y`), and those
    it reads through an imported module (`from . import x` … `x._y`)."""
    package = _package(name, path)
    tree = ast.parse(path.read_text())
    imported, read = [], []
    modules: dict[str, str] = {}  # local name → package module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _module_target(package, node)
            if not target.startswith("hf_lowprec"):
                continue
            for alias in node.names:
                if f"{target}.{alias.name}" in MODULES:
                    modules[alias.asname or alias.name] = f"{target}.{alias.name}"
                if _private(alias.name) and _resolve(target) != name:
                    imported.append(f"{name} imports {alias.name} from {target}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("hf_lowprec"):
                    modules[alias.asname or "hf_lowprec"] = alias.name if alias.asname else "hf_lowprec"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in modules:
                owner = ".".join([modules[value.id], *reversed(chain)])
                if owner in MODULES and owner != name:
                    read.append(f"{name} reads {owner}.{node.attr}")
    return imported, read


PRIVATE = {name: _private_uses(name, path) for name, path in MODULES.items()}


def _bench_imports(path: pathlib.Path, stems: set[str]) -> set[str]:
    """The bench modules `path` imports, in any form: `import device_check_e2e`, `from device_common
    import Report`, `from bench.x import y`, `from bench import x`, in a function or not."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            dotted = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            dotted = [base] + [f"{base}.{alias.name}".lstrip(".") for alias in node.names]
        else:
            continue
        for full in dotted:
            parts = full.split(".")
            if parts[0] == "bench":
                parts = parts[1:]
            if parts and parts[0] in stems:
                found.add(parts[0])
    return found - {path.stem}


BENCH_MODULES = {p.stem: p for p in BENCH.glob("*.py")}
BENCH_GRAPH = {stem: _bench_imports(path, set(BENCH_MODULES)) for stem, path in BENCH_MODULES.items()}


def _shared_file_names(paths: list[pathlib.Path]) -> dict[str, list[str]]:
    """File names (`__init__.py` aside) that more than one module has, with their paths."""
    by_name: dict[str, list[str]] = collections.defaultdict(list)
    for path in paths:
        if path.name != "__init__.py":
            by_name[path.name].append(str(path.relative_to(ROOT.parent)))
    return {n: sorted(where) for n, where in by_name.items() if len(where) > 1}


def test_the_graph_sees_function_local_imports(tmp_path) -> None:
    # An import inside a function or under `if TYPE_CHECKING:` must be an edge, or the checks
    # below could pass on a cycle held apart by a local import or named for type checkers only.
    path = tmp_path / "probe.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from hf_lowprec.cli import main\n"
        "def f():\n    from ..optim import adamw\n    import hf_lowprec.report\n"
    )
    # The package's __init__ runs too when a module of it is imported from outside: an edge.
    expected = {"hf_lowprec.cli", "hf_lowprec.optim.adamw", "hf_lowprec.optim", "hf_lowprec.report"}
    assert _imports("hf_lowprec.strategies.probe", path) == expected
    assert len(GRAPH) > 40
    # The package's own imports for type checkers are in the graph.
    assert "hf_lowprec.strategies.interface" in GRAPH["hf_lowprec.engines.ddp"]


def test_report_does_not_import_the_strategies() -> None:
    assert not [t for t in GRAPH["hf_lowprec.report"] if t.startswith("hf_lowprec.strategies")]


def test_no_import_cycles() -> None:
    assert _cycles(GRAPH) == []


def test_a_planted_cycle_is_found() -> None:
    planted = {name: set(targets) for name, targets in GRAPH.items()}
    planted["hf_lowprec.numerics"].add("hf_lowprec.optim.adamw")
    assert _cycles(planted), "the cycle finder missed numerics → optim.adamw → … → numerics"
    # The one the type hints used to hide: the report naming the strategies that call it.
    planted = {name: set(targets) for name, targets in GRAPH.items()}
    planted["hf_lowprec.report"].add("hf_lowprec.strategies.interface")
    assert any("hf_lowprec.report" in cycle for cycle in _cycles(planted))


def test_the_bench_graph_sees_every_form_of_import(tmp_path) -> None:
    path = tmp_path / "probe.py"
    path.write_text(
        "import device_check_e2e\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from bench.gpu_check import optimizer_times\n"
        "def f():\n    from device_common import Report\n    from bench import device_check_rl\n"
        "    import bench.device_check_moe as moe\n    import torch, os.path\n"
    )
    stems = set(BENCH_MODULES) | {"probe"}
    expected = {"device_check_e2e", "gpu_check", "device_common", "device_check_rl", "device_check_moe"}
    assert _bench_imports(path, stems) == expected
    # The device check's entry point imports its sections; they share device_common.
    assert {"device_check_steps", "device_check_e2e", "device_common"} <= BENCH_GRAPH["device_check"]
    assert "device_common" in BENCH_GRAPH["device_check_steps"]


def test_no_import_cycles_in_bench() -> None:
    assert _cycles(BENCH_GRAPH) == []
    # A cycle planted there is found: the shared module importing the entry point.
    planted = {name: set(targets) for name, targets in BENCH_GRAPH.items()}
    planted["device_common"].add("device_check")
    assert _cycles(planted), "the cycle finder missed device_common → device_check → device_common"


def test_no_two_modules_share_a_file_name() -> None:
    assert _shared_file_names(list(MODULES.values())) == {}
    planted = [*MODULES.values(), ROOT / "optim" / "report.py"]
    assert _shared_file_names(planted) == {"report.py": ["hf_lowprec/optim/report.py", "hf_lowprec/report.py"]}


def test_the_private_name_check_sees_imports_and_reads(tmp_path) -> None:
    path = tmp_path / "probe.py"
    path.write_text(
        "from .. import memory\n"
        "from ..memory import _Coverage, __all__\n"
        "from .support import _Declaring\n"
        "def f():\n    from hf_lowprec.fp8.scaled import _saturated\n    return memory._BUCKETS\n"
        "def g(self):\n    return self._x, _own\n"
    )
    imported, read = _private_uses("hf_lowprec.strategies.probe", path)
    assert imported == [
        "hf_lowprec.strategies.probe imports _Coverage from hf_lowprec.memory",
        "hf_lowprec.strategies.probe imports _Declaring from hf_lowprec.strategies.support",
        "hf_lowprec.strategies.probe imports _saturated from hf_lowprec.fp8.scaled",
    ]
    assert read == ["hf_lowprec.strategies.probe reads hf_lowprec.memory._BUCKETS"]


def test_no_module_imports_another_modules_private_names() -> None:
    assert [line for imported, _ in PRIVATE.values() for line in imported] == []


def test_no_module_reads_another_modules_private_names() -> None:
    assert [line for _, read in PRIVATE.values() for line in read] == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_go_down_the_layers(name: str) -> None:
    upward = sorted(t for t in GRAPH[name] if _layer(t) > _layer(name))
    assert not upward, f"{name} (layer {_layer(name)}) imports higher layers: {upward}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_short_or_say_why(name: str) -> None:
    lines = MODULES[name].read_text().count("\n")
    if name in LONG_MODULES:
        head = MODULES[name].read_text()[:3000].lower()
        assert "long" in head and "because" in head, f"{name} must say at its top why it is long"
    else:
        assert lines <= MAX_LINES, f"{name} has {lines} lines; split it or state why it must be long"


def test_the_architecture_page_lists_the_floors_of_this_table() -> None:
    # docs/architecture.md shows a newcomer where things are; it must be this table, floor by floor.
    page = (ROOT.parent / "docs" / "architecture.md").read_text()
    documented: dict[str, int] = {}
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].isdigit():
            for module in cells[1].split(","):
                documented[module.strip().strip("`")] = int(cells[0])
    assert documented == LAYERS
    folders = {f"hf_lowprec.{p.name}" for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert folders <= set(LAYERS), f"folders without a floor: {sorted(folders - set(LAYERS))}"
