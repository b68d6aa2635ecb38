"""Autocast outside the model's forward under a strategy (the Accelerate plugin's `autocast`, and
`accelerator.autocast` routed to it): a head or loss applied to the model's FP32 outputs computes
in the strategy's 16-bit dtype, as stock `Accelerator(mixed_precision=...)`'s autocast computes it.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ..strategies.baselines import DeviceAutocast, device_autocast
from ..strategies.inputs import computes_without_autocast as casts_outside_forward
from ..strategies.interface import PrecisionStrategy

__all__ = ["autocast_disabled", "casts_outside_forward", "outside_forward"]


def autocast_disabled() -> DeviceAutocast:
    """No autocast on CPU (nor CUDA, when present): the forward computes as the strategy's own."""
    return DeviceAutocast(enabled=False)


def outside_forward(strategy: PrecisionStrategy, handler: Any = None) -> contextlib.AbstractContextManager:
    """The autocast for computation outside the model's forward: the strategy's forward context, or
    an autocast to its compute dtype where that context is none and its weights are 16-bit.
    `handler`: Accelerate's `AutocastKwargs`; `enabled=False` turns autocast off, as stock."""
    if handler is not None and not getattr(handler, "enabled", True):
        return autocast_disabled()
    if casts_outside_forward(strategy):
        return device_autocast(strategy.compute_dtype)
    return strategy.forward_context()
