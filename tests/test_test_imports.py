"""No file under tests/ imports a test module (`test_*.py`) or a conftest.py: what several test
files share lives once in a support module (tests/helpers.py, tests/launching.py,
tests/fp8_reference.py, a `_launch.py` or `_worker.py`), under a public name."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def is_test_module(path: Path) -> bool:
    """A module pytest collects or loads by itself: test_*.py, or a conftest.py."""
    return path.name.startswith("test_") or path.name == "conftest.py"


def _imported_names(path: Path, root: Path) -> set[str]:
    """The dotted names `path` imports, relative imports resolved against its package under
    `root.parent`; for `from X import Y`, both X and X.Y (Y may be a module)."""
    package = list(path.relative_to(root.parent).parent.parts)
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def _module_file(name: str, root: Path) -> Path | None:
    """The file of module `name` when it lies under `root` (named as `root`'s folder)."""
    parts = name.split(".")
    if parts[0] != root.name:
        return None
    base = root.parent.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imports_of_test_modules(root: Path) -> list[str]:
    """'<file>: imports <module>' for each file under `root` that imports a test module or a conftest."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for name in sorted(_imported_names(path, root)):
            target = _module_file(name, root)
            if target is not None and target != path and is_test_module(target):
                found.append(f"{path.relative_to(root.parent)}: imports {name}")
    return found


def test_no_file_under_tests_imports_a_test_module_or_a_conftest():
    assert imports_of_test_modules(TESTS) == [], "move what is shared to tests/helpers.py or a support module"


def test_the_scan_sees_each_form_of_import(tmp_path):
    root = tmp_path / "tests"
    (root / "sub").mkdir(parents=True)
    for name in ("__init__.py", "helpers.py", "conftest.py", "test_top.py", "sub/test_other.py", "sub/_worker.py"):
        (root / name).write_text("X = 1\n")
    (root / "sub" / "test_probe.py").write_text(
        "import tests.test_top\n"
        "from tests.sub.test_other import X\n"
        "from ..conftest import X\n"
        "from . import test_other\n"
        "from tests import helpers\n"
        "from tests.helpers import X\n"
        "from tests.sub._worker import X\n"
        "from .test_probe import X\n"
    )
    assert imports_of_test_modules(root) == [
        "tests/sub/test_probe.py: imports tests.conftest",
        "tests/sub/test_probe.py: imports tests.sub.test_other",
        "tests/sub/test_probe.py: imports tests.test_top",
    ]
