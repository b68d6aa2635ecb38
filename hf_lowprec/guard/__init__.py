"""The guard: a run that watches itself for low-precision failures and acts (docs/guard.md).

`precision_options={"guard": True}` (or a dict of `GuardConfig`'s fields) on any strategy: `Guard`
(`watch`) watches the loss, the gradient norm, non-finite gradients and each FP8 layer's flushed
inputs on the device (`judging`), skips outlier and flushing steps, rolls back to a snapshot
(`snapshots`) after repeated faults and raises flushing FP8 layers. With no fault, a guarded run
computes the same bits as an unguarded one. Thresholds: `thresholds`.
"""

from __future__ import annotations

import logging
from typing import Any

from .thresholds import GuardConfig, guard_config
from .watch import Guard

logger = logging.getLogger("hf_lowprec")

__all__ = ["Guard", "GuardConfig", "guard_config", "guard_metrics", "guard_state", "load_guard_state"]


def guard_state(guard: Guard | None) -> dict[str, Any]:
    """The strategy state's "guard" entry (none without a guard)."""
    return {"guard": guard.state_dict()} if guard is not None else {}


def load_guard_state(guard: Guard | None, saved: dict[str, Any] | None) -> None:
    """Restore a saved guard; a run without one is told which layers the saved one had raised."""
    if not saved:
        return
    if guard is not None:
        guard.load_state_dict(saved)
    elif saved.get("raised"):
        logger.warning(
            "the checkpoint's guard had raised layers %s; this run has no guard: they run as the strategy converts them",
            saved["raised"],
        )


def guard_metrics(guard: Guard | None) -> dict[str, float]:
    """At a logging step: the guard checks (and acts), then its metrics."""
    if guard is None:
        return {}
    guard.check()
    return guard.metrics()
