"""The package's import graph: no cycles, and every import goes down the layers.

numerics → fp8 / coat → optim → report → strategies → integrations → command line
→ testing (what the tests and benchmarks share: on a floor of its own, so nothing else imports it).
The startup report reads a strategy's attributes without importing the strategies (it names
them for type checkers only), so the strategies may call it. The graph
is read from the source (every `import` and `from … import`, at module level or inside a
function, except under `if TYPE_CHECKING:`), so an import hidden in a function to dodge a
cycle still counts.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "hf_lowprec"

# Lower number = lower layer. A module's layer is that of its longest matching prefix.
LAYERS = {
    "hf_lowprec.numerics": 0,
    "hf_lowprec.compiling": 0,
    "hf_lowprec.metrics": 0,
    "hf_lowprec.scaling": 0,
    "hf_lowprec.memory": 0,
    "hf_lowprec.partition": 0,
    "hf_lowprec.data": 0,
    "hf_lowprec.distributed": 0,
    "hf_lowprec.hardware": 0,
    "hf_lowprec.fp8": 1,
    "hf_lowprec.coat": 1,
    "hf_lowprec.optim": 2,
    "hf_lowprec.checkpoints": 2,  # over memory and fp8: what is written, checked and read back
    "hf_lowprec.report": 3,
    "hf_lowprec.guard": 3,  # over fp8 and distributed: watches a run, raises FP8 layers
    "hf_lowprec.strategies": 4,
    "hf_lowprec.integrations": 5,
    "hf_lowprec.engines": 5,
    "hf_lowprec.trl": 5,  # the short import path of integrations.trl_trainers
    "hf_lowprec.compare": 6,
    "hf_lowprec.demo": 6,
    "hf_lowprec.runner": 6,
    "hf_lowprec.cli": 6,
    "hf_lowprec.__main__": 6,
    "hf_lowprec": 6,
    "hf_lowprec.testing": 7,  # the GPU rules checked on CPU, for tests and benchmarks only
}

# Modules allowed over ~450 lines, each with the reason stated at its top.
LONG_MODULES = {"hf_lowprec.fp8.linear"}
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


def _imports(name: str, path: pathlib.Path) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            test = node.test
            if getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING":
                for child in node.orelse:
                    self.visit(child)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.update(a.name for a in node.names if a.name.startswith("hf_lowprec"))

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("hf_lowprec"):
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    found.add(full if full in MODULES else target)

    Visitor().visit(ast.parse(path.read_text()))
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


def _cycles() -> list[list[str]]:
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
        for w in GRAPH.get(v, ()):
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

    for v in GRAPH:
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_function_local_imports(tmp_path) -> None:
    # An import inside a function must be an edge, or the checks below could pass on a cycle
    # held apart by a local import; one under `if TYPE_CHECKING:` is not (it never runs).
    path = tmp_path / "probe.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from hf_lowprec.cli import main\n"
        "def f():\n    from ..optim import adamw\n    import hf_lowprec.report\n"
    )
    # The package's __init__ runs too when a module of it is imported from outside: an edge.
    expected = {"hf_lowprec.optim.adamw", "hf_lowprec.optim", "hf_lowprec.report"}
    assert _imports("hf_lowprec.strategies.probe", path) == expected
    assert len(GRAPH) > 40


def test_report_does_not_import_the_strategies() -> None:
    assert not [t for t in GRAPH["hf_lowprec.report"] if t.startswith("hf_lowprec.strategies")]


def test_no_import_cycles() -> None:
    assert _cycles() == []


def test_a_planted_cycle_is_found() -> None:
    GRAPH["hf_lowprec.numerics"].add("hf_lowprec.optim.adamw")
    try:
        assert _cycles(), "the cycle finder missed numerics → optim.adamw → … → numerics"
    finally:
        GRAPH["hf_lowprec.numerics"].discard("hf_lowprec.optim.adamw")


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
