"""The stock signatures kept: a Trainer class built with the package's mixins takes its arguments
exactly as the stock class it extends, positionally and by keyword.

A mixin's `__init__` forwards them untouched, `forwarding_init` gives the composed class an
`__init__` whose `inspect.signature` is the stock one, and a mixin that reads an argument finds it
with `bind_stock_arguments`, wherever the caller put it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["stock_class", "forwarding_init", "bind_stock_arguments"]


def _ours(cls: type) -> bool:
    return cls.__module__ == "hf_lowprec" or cls.__module__.startswith("hf_lowprec.")


def stock_class(cls: type, after: type | None = None) -> type:
    """The first class of `cls`'s MRO after `after` (default: `cls`) that is not hf_lowprec's."""
    mro = cls.__mro__
    start = mro.index(after if after is not None else cls) + 1
    return next(c for c in mro[start:] if not _ours(c))


def forwarding_init(cls: type) -> Callable[..., None]:
    """An `__init__` for `cls` that passes every argument on to the next `__init__` and shows
    the stock class's signature (IDEs, `inspect.signature`, code that introspects the Trainer)."""
    stock = stock_class(cls).__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        super(cls, self).__init__(*args, **kwargs)

    __init__.__signature__ = inspect.signature(stock)  # type: ignore[attr-defined]
    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    __init__.__doc__ = stock.__doc__
    return __init__


def bind_stock_arguments(obj: Any, mixin: type, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """`args`/`kwargs` of a call to `mixin.__init__` bound to the stock `__init__` it forwards to
    (`self` included): a positional argument is found by its name."""
    return inspect.signature(stock_class(type(obj), after=mixin).__init__).bind(obj, *args, **kwargs)
