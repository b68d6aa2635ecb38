"""A skipped step's LR schedule, held one step late so that the step never waits for the device.

The Trainer and Accelerate hold their LR scheduler on a skipped step by reading the skip flag
right after the optimizer step: a host sync every step. Here the flag is copied to the host
without waiting, the scheduler steps, and before the next optimizer step (or a checkpoint) the
flag is read: a skipped step takes back what the scheduler's step wrote, and keeps what else changed.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Iterable
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
    hold before the schedulers step, `stepped()` what they hold after it; `resolve()` reads the flag
    (no wait once the step has run on the device) and, where the step was skipped, takes back each
    value the schedulers' step wrote that nothing changed since: the schedule held, as when the flag is
    read at once, and a change made meanwhile (a callback's LR, the scheduler's `base_lrs`) kept, as
    when the scheduler never stepped. The optimizer resolves before its next step and its `state_dict()`.
    """

    def __init__(self, optimizer: StrategyOptimizer) -> None:
        self._optimizer = weakref.ref(optimizer)  # the optimizer's hooks hold this, not the other way
        self.skipped = False  # the last resolved step's flag
        # Weak, as the optimizer: a scheduler holds it, and this (a value of `_DEFERRALS`) would keep both alive.
        self._schedulers: list[weakref.ref] = []
        self._saved: tuple[list[dict], list[dict]] | None = None  # the schedulers' states, the groups: before
        self._stepped: tuple[list[dict], list[dict]] | None = None  # after the schedulers' step
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
        self._schedulers = [weakref.ref(s) for s in schedulers]
        self._saved, self._stepped = self._held(), None

    def stepped(self) -> None:
        """Right after the schedulers' step, before other code runs: what it wrote, taken back on a skip."""
        if self._saved is not None and self._stepped is None:
            self._stepped = self._held()

    def _held(self) -> tuple[list[dict], list[dict]]:
        optimizer = self._optimizer()
        groups = optimizer.param_groups if optimizer is not None else []
        schedulers = [ref() for ref in self._schedulers]
        return [_state_copy(s) if s is not None else {} for s in schedulers], [_group_copy(g) for g in groups]

    def resolve(self) -> bool:
        """Read the pending flag (if any) and hold the schedule where it was skipped; the last flag."""
        if self._saved is None:
            return self.skipped
        before, after = self._saved, self._stepped
        self._saved = self._stepped = None
        if self._event is not None:
            self._event.synchronize()  # recorded a step ago: long complete
        self.skipped = bool(self._kept) if self._kept is not None else bool(self._value != 0)
        self._kept = None
        if self.skipped:
            self._take_back(before, after if after is not None else self._held())  # none since: all the step's
        self._schedulers = []
        return self.skipped

    def _take_back(self, before: tuple[list[dict], list[dict]], after: tuple[list[dict], list[dict]]) -> None:
        for ref, was, wrote in zip(self._schedulers, before[0], after[0], strict=True):
            if (scheduler := ref()) is not None:
                scheduler.load_state_dict(_taken_back(was, wrote, scheduler.state_dict()))
        optimizer = self._optimizer()
        groups = optimizer.param_groups if optimizer is not None else []
        for group, was, wrote in zip(groups, before[1], after[1], strict=False):
            for key in [k for k in was if k in wrote and k in group]:
                value = _taken_back(was[key], wrote[key], group[key])
                if isinstance(group[key], torch.Tensor) and isinstance(value, torch.Tensor):
                    group[key].copy_(value)
                else:
                    group[key] = value

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


def _group_copy(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's hyperparameters (all but `params`), copied: tensors (a capturable `lr`) cloned."""
    return {
        k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
        for k, v in group.items()
        if k != "params"
    }


def _taken_back(was: Any, wrote: Any, now: Any, key: Any = None) -> Any:
    """`now` less a scheduler step that turned `was` into `wrote`: a value still as the step wrote it goes
    back to `was`, one changed since stays, containers compared item by item. torch's `_step_count` also
    counts what Accelerate adds on the micro-steps since (OneCycleLR reads it): only the step's one comes off."""
    if key == "_step_count" and all(type(c) is int for c in (was, wrote, now)):
        return now - (wrote - was)
    if _same(now, wrote):
        return was
    if isinstance(now, dict) and isinstance(was, dict) and isinstance(wrote, dict):
        return {k: _taken_back(was[k], wrote[k], v, k) if k in was and k in wrote else v for k, v in now.items()}
    if (
        type(now) in (list, tuple)
        and type(was) is type(now)
        and type(wrote) is type(now)
        and len(now) == len(was) == len(wrote)
    ):
        return type(now)(_taken_back(*values) for values in zip(was, wrote, now))
    return now


def _same(a: Any, b: Any) -> bool:
    """Equal values, read on a skipped step only (a tensor's comparison waits for the device)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        tensors = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        return tensors and (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device) and bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if type(a) in (list, tuple) and type(b) is type(a):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # a value without a truth to its ==: the same object or not
        return a is b


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
    handler = getattr(trainer, "callback_handler", None)
    if handler is not None and not getattr(handler, "_hf_lowprec_held", False):
        handler._hf_lowprec_held = True
        handler.on_step_end = functools.partial(_stepped_then, handler, handler.on_step_end)


def _stepped_then(handler: Any, on_step_end: Any, args: Any, state: Any, control: Any) -> Any:
    # The Trainer steps its scheduler between the optimizer step's callbacks and the step's end: what
    # the step wrote, recorded before any callback's `on_step_end` may change the LR. (`on_step_end`
    # may be another wrapper's function: the handler is passed as itself.)
    inner = find_strategy_optimizer(handler.optimizer)
    if inner is not None and inner in _DEFERRALS:
        _DEFERRALS[inner].stepped()
    return on_step_end(args, state, control)


class _PendingFlag:
    """Accelerate's `_is_overflow` while the flag waits: read (`accelerator.optimizer_step_was_skipped`)
    it resolves, a sync as reading GradScaler's is. `AcceleratedScheduler.step` sees False (held below)."""

    def __init__(self, deferral: DeferredSkip) -> None:
        self.deferral = deferral

    def __bool__(self) -> bool:
        return self.deferral.resolve()


class _AskedFlag:
    """Accelerate's `_is_overflow` with no scheduler to hold: the step's flag, read (a sync, as
    reading GradScaler's) only when the loop asks; the next step replaces this."""

    def __init__(self, optimizer: StrategyOptimizer) -> None:
        self.flag = optimizer.skip_flag  # this step's: each step makes its own

    def __bool__(self) -> bool:
        return self.flag is not None and bool(self.flag)


def note_accelerate_skip(wrapper: Any, schedulers: Iterable[Any], optimizer: StrategyOptimizer, *args: Any) -> None:
    """An optimizer post-hook: Accelerate's schedulers bound to `wrapper` step now, held later on a skip.

    With none of `schedulers` (the AcceleratedSchedulers prepared) bound to it, nothing is held: the
    flag is read only where the loop asks (`accelerator.optimizer_step_was_skipped`), this step's."""
    bound = [s.scheduler for s in schedulers if s.step_with_optimizer and any(o is wrapper for o in s.optimizers)]
    if not bound:
        wrapper._is_overflow = _AskedFlag(optimizer)
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
            flag.deferral.stepped()


def _resolving(scheduler: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
    for o in scheduler.optimizers:
        inner = getattr(o, "optimizer", None)
        if isinstance(inner, StrategyOptimizer):
            resolve_skip(inner)
    return method(*args, **kwargs)


def hold_accelerated_scheduler(scheduler: Any) -> None:
    """An AcceleratedScheduler steps past a waiting flag; read through it (`get_last_lr`, `state_dict`:
    `accelerator.save_state`), the schedule is first held for a skipped step."""
    if getattr(scheduler, "_hf_lowprec_held", False) or not hasattr(scheduler, "optimizers"):
        return
    scheduler._hf_lowprec_held = True
    scheduler.step = functools.partial(_unheld_step, scheduler, scheduler.step)
    for name in ("get_last_lr", "get_lr", "state_dict"):
        setattr(scheduler, name, functools.partial(_resolving, scheduler, getattr(scheduler, name)))
