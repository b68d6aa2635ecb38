"""tests/floors.txt (what `make test-floors` installs) pins the lower bounds pyproject.toml declares.

A floor raised in pyproject.toml without the constraints file would leave `make test-floors`
testing releases users can no longer get, and one lowered would promise releases no run has seen.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = Path(__file__).resolve().parents[1]
# The Hugging Face stack the package integrates with, and DeepSpeed: each must have its floor run.
STACK = {"transformers", "accelerate", "peft", "trl", "deepspeed"}


def declared_floors() -> dict[str, list[str]]:
    """Every `>=` bound in pyproject.toml's dependencies and extras, by package name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        lines += extra
    floors: dict[str, list[str]] = {}
    for line in lines:
        req = Requirement(line)
        for spec in req.specifier:
            if spec.operator == ">=":
                floors.setdefault(req.name.lower(), []).append(spec.version)
    return floors


def pinned() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "tests" / "floors.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"tests/floors.txt: {line!r} is not an exact pin (name==version)"
            pins[name.strip().lower()] = version.strip()
    return pins


def test_every_pin_is_the_floor_pyproject_declares():
    floors = declared_floors()
    for name, version in pinned().items():
        assert name in floors, f"tests/floors.txt pins {name}, which pyproject.toml gives no lower bound"
        # The ppo extra's TRL 1.12 line is a separate environment (`make test-ppo`): the main one's floor is the highest.
        declared = max(floors[name], key=Version)
        assert Version(version) == Version(declared), (
            f"tests/floors.txt pins {name}=={version}, pyproject.toml's floor is {declared}: make them one"
        )


def test_the_stack_is_pinned():
    assert set(pinned()) >= STACK, f"tests/floors.txt lacks {sorted(STACK - set(pinned()))}"
