"""One registry of precision-strategy names: `register` fills it; list them, look one up, build it.

Every strategy module registers itself here when `hf_lowprec.strategies` is imported, and this
module cannot be reached without importing that package first, so the lookups always see the
built-ins. It imports nothing of the package itself (the strategy type only for type checkers),
so the registering modules import it without a cycle; user strategies register with `register`.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .interface import PrecisionStrategy

__all__ = [
    "REGISTRY",
    "SUMMARIES",
    "available_strategies",
    "get_strategy",
    "register",
    "strategy_class",
    "strategy_summary",
]

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
        # The names of the class with the options each fixes (a new dict: a base class keeps its own).
        cls.registered_presets = {**getattr(cls, "registered_presets", {}), name: dict(preset)}
        if summary is not None:
            SUMMARIES[name] = summary
        return cls

    return decorator


def available_strategies() -> list[str]:
    """The registered strategy names, sorted."""
    return sorted(REGISTRY)


def strategy_class(name: str) -> tuple[type, dict[str, Any]]:
    """The class and preset options registered under `name`; ValueError naming close names."""
    if not isinstance(name, str):
        raise ValueError(
            f"precision strategy must be a name (a string), got {name!r} ({type(name).__name__}). "
            f"Valid names: {', '.join(sorted(REGISTRY))}."
        )
    if name not in REGISTRY:
        close = difflib.get_close_matches(name, list(REGISTRY), n=3, cutoff=0.4)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(f"unknown precision strategy {name!r}.{hint} Valid names: {', '.join(sorted(REGISTRY))}.")
    return REGISTRY[name]


def strategy_summary(name: str) -> str:
    """One line saying what the strategy `name` does."""
    cls, _ = strategy_class(name)
    if name in SUMMARIES:
        return SUMMARIES[name]
    return (cls.__doc__ or "").strip().splitlines()[0].rstrip(".") if cls.__doc__ else ""


def get_strategy(name: str, **options: Any) -> PrecisionStrategy:
    """Build the strategy registered as `name` with `options` (validated before any work)."""
    cls, preset = strategy_class(name)
    clash = set(preset) & set(options)
    if clash:
        raise ValueError(
            f"option(s) {sorted(clash)} are fixed by the strategy name {name!r}; "
            f"pick another registered name instead of overriding them"
        )
    return cls(name=name, **preset, **options)
