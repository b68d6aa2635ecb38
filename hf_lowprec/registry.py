"""One registry of precision-strategy names."""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from .strategies.base import PrecisionStrategy

__all__ = ["register", "available_strategies", "get_strategy", "strategy_class", "strategy_summary"]

_REGISTRY: dict[str, tuple[type, dict[str, Any]]] = {}
_SUMMARIES: dict[str, str] = {}


def register(name: str, *, summary: str | None = None, **preset: Any) -> Callable[[type], type]:
    """Class decorator: register a strategy class under `name`.

    `preset` fixes options for this name (a variant is a config value, not a new class), e.g.
    `@register("collage-light", variant="light")` stacked on `@register("collage-plus", variant="plus")`.
    `summary` is the one line `hf-lowprec list` and the README show (default: the first line
    of the class docstring).
    """

    def decorator(cls: type) -> type:
        if name in _REGISTRY:
            raise ValueError(f"precision strategy {name!r} is registered twice")
        _REGISTRY[name] = (cls, dict(preset))
        if summary is not None:
            _SUMMARIES[name] = summary
        return cls

    return decorator


def available_strategies() -> list[str]:
    """The registered strategy names, sorted."""
    _load_builtin()
    return sorted(_REGISTRY)


def strategy_class(name: str) -> tuple[type, dict[str, Any]]:
    """The class and preset options registered under `name`; ValueError naming close names."""
    _load_builtin()
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=3, cutoff=0.4)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(
            f"unknown precision strategy {name!r}.{hint} Valid names: {', '.join(sorted(_REGISTRY))}."
        )
    return _REGISTRY[name]


def strategy_summary(name: str) -> str:
    """One line saying what the strategy `name` does."""
    cls, _ = strategy_class(name)
    if name in _SUMMARIES:
        return _SUMMARIES[name]
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


def _load_builtin() -> None:
    # Importing the package registers the built-in strategies; done lazily so that the
    # registry module itself stays import-cycle free.
    from . import strategies  # noqa: F401
