"""Docstrings that match the code: short module docstrings, and no stale backticked names.

Read by ast only (nothing is imported): each module of hf_lowprec opens with at most
MODULE_DOCSTRING_MAX_LINES lines, and a docstring (module, class or function) names a top-level
def or class of the package in backticks only where its module defines or imports it, or
qualified by a module path that resolves within the package and defines it (`fsdp2.shard_model`,
`hf_lowprec.engines.fsdp2.shard_model`); a backticked `hf_lowprec.…` path must resolve.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "hf_lowprec"

# A module docstring says what the module is for; the details sit beside the code they describe.
MODULE_DOCSTRING_MAX_LINES = 8
# A module whose docstring must be longer says why, in a comment line of its own:
#     # long docstring: <the reason>
_LONG_DOCSTRING_REASON = re.compile(r"^# long docstring: *(\S.*)$", re.MULTILINE)

# `name`, `name()`, `name(x)`, ``name``, `a.b.c`: a backticked identifier or dotted path.
_BACKTICKED = re.compile(r"(?<!`)(`{1,2})([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\([^`()]*\))?\1(?!`)")

_FILE_SUFFIXES = {"py", "md", "png", "json", "txt", "yaml", "yml", "toml", "cfg", "csv", "cpp", "h", "so"}


@dataclass
class Module:
    name: str  # dotted: hf_lowprec.fp8.linear
    path: Path
    tree: ast.Module
    is_package: bool
    top: dict[str, ast.AST] = field(default_factory=dict)  # top-level bindings: defs, classes, assignments
    imported: set[str] = field(default_factory=set)  # names imported anywhere in the module
    defined: set[str] = field(default_factory=set)  # every def/class name anywhere, and top-level bindings
    # Names that are not this package's modules here: imports from outside it, parameters, variables.
    shadowing: set[str] = field(default_factory=set)
    # Names the code uses as attributes or string keys: `step` of `optimizer.step()` or state["step"].
    used: set[str] = field(default_factory=set)


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [n for elt in node.elts for n in _targets(elt)]
    if isinstance(node, ast.Starred):
        return _targets(node.value)
    return []


def _bindings(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """The names a module or class body binds at its own level (descending into if/try blocks)."""
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                out.update(dict.fromkeys(_targets(target), node))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            out.update(dict.fromkeys(_targets(node.target), node))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                out[alias.asname or alias.name.split(".")[0]] = node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            nested = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            for handler in getattr(node, "handlers", []):
                nested.extend(handler.body)
            out.update(_bindings(nested))
    return out


def load_package(root: Path, package: str) -> dict[str, Module]:
    """Every module of the package under root, parsed, by dotted name."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        module = Module(name, path, tree, is_package, top=_bindings(tree.body))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                bound = {alias.asname or alias.name.split(".")[0] for alias in node.names}
                module.imported.update(bound)
                outside = isinstance(node, ast.Import) or (node.level == 0 and node.module.split(".")[0] != package)
                if outside and not any(alias.name.split(".")[0] == package for alias in node.names):
                    module.shadowing.update(bound)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                module.defined.add(node.name)
            elif isinstance(node, ast.arg):
                module.shadowing.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                module.shadowing.add(node.id)
            elif isinstance(node, ast.Attribute):
                module.used.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                module.used.add(node.value)
        modules[name] = module
    for module in modules.values():  # names a module exports lazily (__all__ with a module __getattr__)
        module.top.update(dict.fromkeys(_exported(modules, module), module.tree))
        module.defined.update(module.top)
    return modules


def _exported(modules: dict[str, Module], module: Module, depth: int = 0) -> list[str]:
    """The names of the module's __all__: a literal list, or list(other.__all__) of a module it imports."""
    node = module.top.get("__all__")
    if not isinstance(node, ast.Assign) or depth > 3:
        return []
    value = node.value
    if isinstance(value, ast.Call) and len(value.args) == 1:  # list(_trl.__all__)
        value = value.args[0]
    if isinstance(value, (ast.List, ast.Tuple)):
        return [elt.value for elt in value.elts if isinstance(elt, ast.Constant) and isinstance(elt.value, str)]
    if isinstance(value, ast.Attribute) and value.attr == "__all__" and isinstance(value.value, ast.Name):
        source = module.top.get(value.value.id)
        if isinstance(source, ast.ImportFrom):
            base = module.name if module.is_package else module.name.rpartition(".")[0]
            for _ in range(source.level - 1):
                base = base.rpartition(".")[0]
            prefix = f"{base}.{source.module}" if source.level else source.module
            for alias in source.names:
                if (alias.asname or alias.name) == value.value.id and f"{prefix}.{alias.name}" in modules:
                    return _exported(modules, modules[f"{prefix}.{alias.name}"], depth + 1)
    return []


def package_definitions(modules: dict[str, Module]) -> dict[str, set[str]]:
    """Every top-level def/class name of the package -> the modules that define it."""
    defs: dict[str, set[str]] = {}
    for module in modules.values():
        for node in module.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defs.setdefault(node.name, set()).add(module.name)
    return defs


def _docstrings(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                yield getattr(node, "name", "<module>"), getattr(node, "lineno", 1), doc


def _resolve(modules: dict[str, Module], parts: list[str]) -> str | None:
    """Resolve attribute parts against modules by ast; None if they resolve, else what is missing."""
    # The longest prefix that is a module; the rest are attributes of it.
    for cut in range(len(parts), 0, -1):
        if ".".join(parts[:cut]) in modules:
            break
    else:
        return f"no module {parts[0]}"
    module = modules[".".join(parts[:cut])]
    rest = parts[cut:]
    if not rest:
        return None
    head = rest[0]
    if head not in module.top:
        if module.is_package and f"{module.name}.{head}" in modules:
            return None  # a submodule (caught above unless the path went on)
        return f"{module.name} defines no {head}"
    node = module.top[head]
    if len(rest) > 1 and isinstance(node, ast.ClassDef):
        attrs = _bindings(node.body)
        if rest[1] not in attrs and not _class_sets(node, rest[1]):
            # A class whose bases lie outside the module may inherit it: only flag classes with plain bases.
            if all(isinstance(b, ast.Name) and b.id in {"object"} for b in node.bases):
                return f"{module.name}.{head} has no attribute {rest[1]}"
    return None


def _class_sets(node: ast.ClassDef, attr: str) -> bool:
    """Whether a method of the class assigns self.<attr>."""
    for sub in ast.walk(node):
        if (
            isinstance(sub, ast.Attribute)
            and isinstance(sub.ctx, ast.Store)
            and isinstance(sub.value, ast.Name)
            and sub.value.id == "self"
            and sub.attr == attr
        ):
            return True
    return False


def _module_path(modules: dict[str, Module], module: Module, parts: list[str], package: str) -> list[str] | None:
    """Absolute parts if parts[0] names a module of the package: from the module's own package, the
    nearest enclosing one that has it (`formats.Format` in optim/native/ is optim.formats), or the root."""
    if parts[0] == package:
        return parts
    if parts[0] in module.shadowing:
        return None
    base = module.name if module.is_package else module.name.rpartition(".")[0]
    while base:
        if f"{base}.{parts[0]}" in modules:
            return [*base.split("."), *parts]
        base = base.rpartition(".")[0]
    return None


def stale_names(modules: dict[str, Module], package: str, name: str) -> list[str]:
    """The problems of one module's docstrings, as 'path:line (where): message'."""
    module = modules[name]
    defs = package_definitions(modules)
    known = module.defined | module.imported | module.shadowing | module.used
    problems = []
    for where, line, doc in _docstrings(module.tree):
        for _, text in _BACKTICKED.findall(doc):
            parts = text.split(".")
            message = None
            if len(parts) > 1 and parts[-1] in _FILE_SUFFIXES:
                continue  # a file name: `families.py`, `loss.png`
            absolute = _module_path(modules, module, parts, package)
            if absolute is not None:
                missing = _resolve(modules, absolute)
                if missing:
                    message = f"`{text}` does not resolve: {missing}"
            elif parts[0] in defs and parts[0] not in known:
                homes = ", ".join(sorted(defs[parts[0]]))
                message = f"`{text}` names {parts[0]}, which this module neither defines nor imports (see {homes})"
            if message:
                problems.append(f"{module.name}:{line} ({where}): {message}")
    return problems


def long_docstring(module: Module, limit: int = MODULE_DOCSTRING_MAX_LINES) -> str | None:
    doc = ast.get_docstring(module.tree)
    if doc is None or len(doc.splitlines()) <= limit:
        return None
    if _LONG_DOCSTRING_REASON.search(module.path.read_text(encoding="utf-8")):
        return None
    return f"{module.name}: module docstring has {len(doc.splitlines())} lines (limit {limit})"


MODULES = load_package(ROOT, PACKAGE)


@pytest.mark.parametrize("name", list(MODULES))
def test_module_docstring_is_short(name):
    problem = long_docstring(MODULES[name])
    assert problem is None, problem


@pytest.mark.parametrize("name", list(MODULES))
def test_docstrings_name_what_the_module_has(name):
    problems = stale_names(MODULES, PACKAGE, name)
    assert not problems, "\n".join(problems)


# ---- self-checks: the rules above catch what they should, on a probe package ----


def _probe(tmp_path: Path, files: dict[str, str]) -> dict[str, Module]:
    for rel, text in {"probe/__init__.py": '"""Probe."""\n', **files}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return load_package(tmp_path, "probe")


def test_probe_flags_a_stale_name(tmp_path):
    modules = _probe(
        tmp_path,
        {
            "probe/home.py": '"""Home of `helper`."""\n\ndef helper():\n    pass\n\nclass Box:\n    size = 1\n',
            "probe/moved.py": '"""Calls `helper()` here, `home.helper`, `Box` and `probe.home.helper`."""\n',
            "probe/user.py": (
                '"""Uses `helper` and `Box.size` (imported)."""\n\nfrom .home import Box, helper\n'
                "def f():\n"
                '    """`probe.home.gone` and `home.gone`, and `probe.nowhere`."""\n'
            ),
        },
    )
    moved = stale_names(modules, "probe", "probe.moved")
    assert len(moved) == 2, moved
    assert "`helper` names helper" in moved[0] and "probe.home" in moved[0]
    assert "`Box` names Box" in moved[1]
    user = stale_names(modules, "probe", "probe.user")
    assert len(user) == 3, user
    assert all("does not resolve" in p for p in user)


def test_probe_flags_a_long_docstring(tmp_path):
    body = "\n".join(f"line {i}" for i in range(MODULE_DOCSTRING_MAX_LINES + 1))
    modules = _probe(
        tmp_path,
        {
            "probe/long.py": f'"""{body}"""\n',
            "probe/ok.py": f'"""{body}"""\n# long docstring: the format table is read here, beside nothing else\n',
            "probe/short.py": '"""One line."""\n',
        },
    )
    assert long_docstring(modules["probe.long"]) is not None
    assert long_docstring(modules["probe.ok"]) is None
    assert long_docstring(modules["probe.short"]) is None
