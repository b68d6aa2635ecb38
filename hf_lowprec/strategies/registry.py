"""The table of strategy names: `register` fills it; `hf_lowprec.registry` looks names up.

This module imports nothing of the package, so every strategy module can register itself
without an import cycle; the lookups live one layer up, after the built-ins are imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["REGISTRY", "SUMMARIES", "register"]

#: name → (strategy class, preset options)
REGISTRY: dict[str, tuple[type, dict[str, Any]]] = {}
#: name → one-line summary, where given at registration
SUMMARIES: dict[str, str] = {}


def register(name: str, *, summary: str | None = None, **preset: Any) -> Callable[[type], type]:
    """Class decorator: register a strategy class under `name`.

    `preset` fixes options for this name (a variant is a config value, not a new class), e.g.
    `@register("collage-light", update="collage-light")` stacked on another name of the class.
    `summary` is the one line `hf-lowprec list` and the README show (default: the first line
    of the class docstring).
    """

    def decorator(cls: type) -> type:
        if name in REGISTRY:
            raise ValueError(f"precision strategy {name!r} is registered twice")
        REGISTRY[name] = (cls, dict(preset))
        if summary is not None:
            SUMMARIES[name] = summary
        return cls

    return decorator
