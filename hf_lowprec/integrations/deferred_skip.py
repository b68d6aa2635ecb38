"""A skipped step's LR schedule, held one step late so that the step never waits for the device.

The Trainer and Accelerate hold their LR scheduler on a skipped step by reading the skip flag
right after the optimizer step: a host sync every step. Here the flag is copied to the host
without waiting, the scheduler steps, and before the next optimizer step (or a checkpoint) the
flag is read: a skipped step puts the scheduler and the groups' hyperparameters back as they were.
"""

from __future__ import annotations

import copy
import functools
import weakref
from typing import Any

import numpy as np
import torch

from ..strategies.interface import StrategyOptimizer
from .optimizer_arguments import find_strategy_optimizer

__all__ = [
    "DeferredSkip",
    "deferred_skip",
    "hold_accelerated_scheduler",
    "note_accelerate_skip",
    "note_trainer_skip",
    "resolve_before_reads",
    "resolve_skip",
]

_DEFERRALS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class DeferredSkip:
    """One strategy optimizer's skip flag, read a step late (see the module docstring).

    `defer(schedulers)` after a step keeps the flag and what the schedulers and the param groups
    hold before the schedulers step; `resolve()` reads the flag (no wait once the step has run on
    the device) and, where the step was skipped, puts them back: the schedule held, as when the
    flag is read at once. The optimizer resolves before its next step and before its `state_dict()`.
    """

    def __init__(self, optimizer: StrategyOptimizer) -> None:
        self._optimizer = weakref.ref(optimizer)  # the optimizer's hooks hold this, not the other way
        self.skipped = False  # the last resolved step's flag
        self._saved: tuple[list[tuple[Any, dict]], list[dict]] | None = None
        self._host: torch.Tensor | None = None
        self._value: np.ndarray | None = None  # a view of `_host`: read without a dispatcher operation
        self._event: torch.cuda.Event | None = None
        self._kept: torch.Tensor | None = None  # a flag on another device: read there when resolved
        optimizer.register_step_pre_hook(self._before)
        optimizer.register_state_dict_pre_hook(self._before)

    @property
    def pending(self) -> bool:
        """Whether a step's flag waits to be read."""
        return self._saved is not None

    def defer(self, schedulers: list[Any]) -> None:
        """After an optimizer step, before its schedulers step: keep its flag and their state."""
        self.resolve()
        optimizer = self._optimizer()
        flag = optimizer.skip_flag if optimizer is not None else None
        if flag is None:
            return
        self._keep(flag.detach())
        states = [(s, _state_copy(s)) for s in schedulers]
        groups = [{k: _copied(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self._saved = (states, groups)

    def resolve(self) -> bool:
        """Read the pending flag (if any) and hold the schedule where it was skipped; the last flag."""
        if self._saved is None:
            return self.skipped
        states, groups = self._saved
        self._saved = None
        if self._event is not None:
            self._event.synchronize()  # recorded a step ago: long complete
        self.skipped = bool(self._kept) if self._kept is not None else bool(self._value != 0)
        self._kept = None
        if self.skipped:
            for scheduler, state in states:
                scheduler.load_state_dict(_held_state(state, scheduler.state_dict()))
            optimizer = self._optimizer()
            for group, saved in zip(optimizer.param_groups if optimizer is not None else [], groups, strict=False):
                for key, value in saved.items():
                    if isinstance(group.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
                        group[key].copy_(value)
                    else:
                        group[key] = value
        return self.skipped

    def _before(self, *args: Any) -> None:  # a hook's: its result would replace the step's arguments
        self.resolve()

    def _keep(self, flag: torch.Tensor) -> None:
        # A pinned host buffer the device writes without a wait (CUDA) or a host copy (CPU), read
        # through a NumPy view made once; any other device keeps its own copy.
        cuda = flag.device.type == "cuda" and torch.cuda.is_available() and type(flag) is torch.Tensor
        if not cuda and (flag.device.type != "cpu" or type(flag) is not torch.Tensor):
            self._kept = flag.clone()
            return
        if self._host is None or self._host.dtype != flag.dtype or self._host.is_pinned() != cuda:
            self._host = torch.empty((), dtype=flag.dtype, pin_memory=cuda)
            self._value = self._host.numpy()
        self._host.copy_(flag, non_blocking=cuda)
        self._event = None
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(flag.device))


def _state_copy(scheduler: Any) -> dict[str, Any]:
    """A copy of `scheduler.state_dict()` its next step cannot change. A state that cannot be deep-copied
    (a schedule function holding a lock or a file) is copied a level down: torch's schedulers rebind
    their counters and lists as they step, and leave the function's state alone."""
    state = scheduler.state_dict()
    try:
        return copy.deepcopy(state)
    except Exception:
        return {k: copy.copy(v) for k, v in state.items()}


def _copied(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _held_state(saved: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """The state saved before a skipped step's scheduler step, less that step: torch's `_step_count`
    also counts what Accelerate adds on the micro-steps since (OneCycleLR reads it), which stay."""
    counts = [saved.get("_step_count"), now.get("_step_count"), saved.get("last_epoch"), now.get("last_epoch")]
    if all(isinstance(c, int) for c in counts):
        saved = dict(saved, _step_count=now["_step_count"] - (now["last_epoch"] - saved["last_epoch"]))
    return saved


def deferred_skip(optimizer: StrategyOptimizer) -> DeferredSkip:
    """The optimizer's `DeferredSkip`, made on first use."""
    if optimizer not in _DEFERRALS:
        _DEFERRALS[optimizer] = DeferredSkip(optimizer)
    return _DEFERRALS[optimizer]


def resolve_skip(optimizer: StrategyOptimizer | None) -> None:
    """Hold the schedule for a pending skipped step of `optimizer` now (a checkpoint, the end of training)."""
    if optimizer is not None and optimizer in _DEFERRALS:
        _DEFERRALS[optimizer].resolve()


def resolve_before_reads(control: Any, optimizer: Any) -> None:
    """At a step's or an epoch's end (`optimizer`: the Trainer's): an evaluation (where a plateau schedule
    steps on its metric) or a checkpoint to come reads the schedule as it stands, held for a skip now."""
    if control.should_evaluate or control.should_save:
        resolve_skip(find_strategy_optimizer(optimizer))


def note_trainer_skip(optimizer: Any, trainer: Any) -> None:
    """After the Trainer's optimizer step (`optimizer`: Accelerate's wrapper): Accelerate reports no skip,
    so the Trainer steps its LR scheduler, held before the next step where this one was skipped. Without
    a scheduler, or under DeepSpeed (whose engine steps its own), the flag is read at once."""
    scheduler = getattr(trainer, "lr_scheduler", None)
    inner = find_strategy_optimizer(optimizer)
    if inner is None or not hasattr(optimizer, "_is_overflow"):
        return
    if scheduler is None or getattr(trainer, "is_deepspeed_enabled", False):
        optimizer._is_overflow = inner.step_was_skipped
        return
    deferred_skip(inner).defer([scheduler])
    optimizer._is_overflow = False


class _PendingFlag:
    """Accelerate's `_is_overflow` while the flag waits: read (`accelerator.optimizer_step_was_skipped`)
    it resolves, a sync as reading GradScaler's is. `AcceleratedScheduler.step` sees False (held below)."""

    def __init__(self, deferral: DeferredSkip) -> None:
        self.deferral = deferral

    def __bool__(self) -> bool:
        return self.deferral.resolve()


def note_accelerate_skip(wrapper: Any, schedulers: list[Any], optimizer: StrategyOptimizer, *args: Any) -> None:
    """An optimizer post-hook: Accelerate's schedulers bound to `wrapper` step now, held later on a skip.

    With none of `schedulers` (the AcceleratedSchedulers prepared) bound to it, the flag is read
    at once, as before: a loop that reads `step_was_skipped` itself gets this step's."""
    bound = [s.scheduler for s in schedulers if s.step_with_optimizer and any(o is wrapper for o in s.optimizers)]
    if not bound:
        wrapper._is_overflow = optimizer.step_was_skipped
        return
    deferral = deferred_skip(optimizer)
    deferral.defer(bound)
    wrapper._is_overflow = _PendingFlag(deferral) if deferral.pending else False


def _unheld_step(scheduler: Any, step: Any, *args: Any, **kwargs: Any) -> Any:
    # The flags still waiting read False here: the scheduler steps, to be put back if they say skipped.
    waiting = [o for o in scheduler.optimizers if isinstance(getattr(o, "_is_overflow", None), _PendingFlag)]
    waiting = [(o, o._is_overflow) for o in waiting if o._is_overflow.deferral.pending]
    for o, _ in waiting:
        o._is_overflow = False
    try:
        return step(*args, **kwargs)
    finally:
        for o, flag in waiting:
            o._is_overflow = flag


def _resolving(scheduler: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
    for o in scheduler.optimizers:
        inner = getattr(o, "optimizer", None)
        if isinstance(inner, StrategyOptimizer):
            resolve_skip(inner)
    return method(*args, **kwargs)


def hold_accelerated_scheduler(scheduler: Any) -> None:
    """An AcceleratedScheduler steps past a waiting flag; read through it (`get_last_lr`, `state_dict`:
    Accelerate's `save_state`), the schedule is first held for a skipped step."""
    if getattr(scheduler, "_hf_lowprec_held", False) or not hasattr(scheduler, "optimizers"):
        return
    scheduler._hf_lowprec_held = True
    scheduler.step = functools.partial(_unheld_step, scheduler, scheduler.step)
    for name in ("get_last_lr", "get_lr", "state_dict"):
        setattr(scheduler, name, functools.partial(_resolving, scheduler, getattr(scheduler, name)))
