"""An LR scheduler moved to the optimizer that took its optimizer's place (the Accelerate plugin's
`prepare` replaces a `torch.optim.AdamW` with the strategy's): found among the live objects,
rebound, its per-group lists following a group the strategy split, torch's step-order check kept.
"""

from __future__ import annotations

import functools
import gc
from typing import Any

import torch

from ..strategies.interface import StrategyOptimizer

__all__ = ["rebind_scheduler", "schedulers_over"]

_NOT_PER_GROUP = ("optimizer", "_schedulers", "_milestones")


def schedulers_over(optimizer: torch.optim.Optimizer) -> list[torch.optim.lr_scheduler.LRScheduler]:
    """The LR schedulers alive now that hold `optimizer` (the garbage collector's referrers, and theirs)."""
    holders = gc.get_referrers(optimizer)
    found = [h for h in holders if isinstance(h, torch.optim.lr_scheduler.LRScheduler)]
    dicts = [h for h in holders if isinstance(h, dict)]
    if dicts:
        ids = {id(d) for d in dicts}
        found += [
            o
            for o in gc.get_referrers(*dicts)
            if isinstance(o, torch.optim.lr_scheduler.LRScheduler) and id(getattr(o, "__dict__", None)) in ids
        ]
    return list({id(s): s for s in found if s.optimizer is optimizer}.values())


def _follow_split_groups(scheduler: Any, optimizer: StrategyOptimizer, old: torch.optim.Optimizer) -> None:
    """A strategy may split a group in two (fp8-lm-o2 once did: FP8 GEMM weights and the rest,
    same settings): each per-group list the scheduler keeps (`base_lrs`, `_last_lr`,
    `lr_lambdas`, …, one entry per old group) gets one entry per new group, that of its origin."""
    if len(optimizer.param_groups) == len(old.param_groups):
        return
    source = {id(p): i for i, group in enumerate(old.param_groups) for p in group["params"]}
    origin = [source[id(group["params"][0])] for group in optimizer.param_groups]
    for name, value in list(vars(scheduler).items()):
        # (SequentialLR's `_schedulers` and `_milestones` are not per group; its children follow on their own.)
        if isinstance(value, list) and len(value) == len(old.param_groups) and name not in _NOT_PER_GROUP:
            setattr(scheduler, name, [value[i] for i in origin])


def rebind_scheduler(
    scheduler: torch.optim.lr_scheduler.LRScheduler, optimizer: StrategyOptimizer, old: torch.optim.Optimizer
) -> None:
    """Move `scheduler` from `old` to `optimizer`, which took its place with the same groups.

    The copied groups carry the scheduler's `initial_lr` and current `lr`, so the schedule
    continues on the new optimizer. torch checks at the first `scheduler.step()` that
    `optimizer.step()` ran before it, through a marked wrapper its __init__ puts on
    `optimizer.step`; the new optimizer gets the same marker so that check still holds."""
    scheduler.optimizer = optimizer
    _follow_split_groups(scheduler, optimizer, old)
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = optimizer.step

    @functools.wraps(step)
    def tracked_step(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True
        return step(*args, **kwargs)

    tracked_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked_step  # type: ignore[method-assign]
