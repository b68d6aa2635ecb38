"""One registry of precision-strategy names: list them, look one up, build it.

Importing this module imports the built-in strategies (`hf_lowprec.strategies`), which
register themselves in `strategies.registry`; user strategies register with `register`.
"""

from __future__ import annotations

import difflib
from typing import Any

from . import strategies as _builtin  # noqa: F401  (registers the built-in strategies)
from .strategies.base import PrecisionStrategy
from .strategies.registry import REGISTRY, SUMMARIES, register

__all__ = ["available_strategies", "get_strategy", "register", "strategy_class", "strategy_summary"]


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
