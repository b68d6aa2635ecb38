"""`StrategyOptimizer`: the optimizer a strategy hands out (`PrecisionStrategy.create_optimizer`).

It wraps any optimizer and runs the strategy's hooks around its step (`process_gradients`, then
`optimizer_step` with the device-side `found_inf`; strategies/interface.py says why the step never
waits for the device).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from ..checkpoints.resume import check_fp8_layout, check_optimizer_state, check_stock_optimizer_state
from ..version import VERSION_KEYS, saving_version, warn_other_version
from .prepared import check_added_dtypes

if TYPE_CHECKING:
    from .protocol import Strategy as PrecisionStrategy

__all__ = ["StrategyOptimizer", "as_param_groups"]


class StrategyOptimizer(torch.optim.Optimizer):
    """The optimizer a strategy hands out: its inner optimizer plus the strategy's step logic.

    It is a `torch.optim.Optimizer` whose `param_groups` and `state` are the inner optimizer's,
    so LR schedulers, gradient clipping and Accelerate's wrapper see an ordinary optimizer.
    `step()` runs the strategy's hooks without a host sync: the inner optimizer takes the
    strategy's `found_inf` tensor and skips on the device where it is set; the strategy counts
    the skip on the device. `skip_flag` is this step's flag on the device; `step_was_skipped` reads
    it (a sync, when read: the Trainer and the Accelerate plugin read it a step late instead, when
    the step has long run, `integrations.deferred_skip`).
    `state_dict()` is the inner state dict plus the strategy's state under the key
    "hf_lowprec", so a Trainer checkpoint carries both; a call is a checkpoint save, which the
    guard takes as a snapshot point (docs/guard.md).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: PrecisionStrategy) -> None:
        # The base __init__ would re-register parameters; this wrapper only delegates.
        self.optimizer = optimizer
        self.strategy = strategy
        self._found_inf: torch.Tensor | None = None  # the last step's flag, on the device
        self._stepped: tuple[list[torch.Tensor], list[torch.dtype]] | None = None  # the last step's parameters, dtypes
        if strategy.guard is not None:  # the guard snapshots and restores this optimizer's state
            strategy.guard.optimizer = optimizer
        # torch's `register_*_hook` methods write these; `step`, `state_dict` and `load_state_dict`
        # run them as torch's do (the global step hooks run once, around the inner optimizer's step).
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Callable] = OrderedDict()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        params = param_group["params"]
        if not isinstance(params, set):  # (a set is the inner optimizer's to refuse)
            param_group = {**param_group, "params": [params] if torch.is_tensor(params) else list(params)}
        check_added_dtypes(self.strategy, [{"params": list(param_group["params"])}], len(self.param_groups))
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def skip_flag(self) -> torch.Tensor | None:
        """The last `step()`'s skip flag, a 0-dim tensor on the device (1.0: skipped); None before a step."""
        return self._found_inf

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last `step()` was skipped. Reading it waits for the device (one sync),
        as reading torch's GradScaler scale does; the step itself never does."""
        return self._found_inf is not None and bool(self._found_inf)

    def step(self, closure: Callable | None = None) -> Any:
        args: tuple[Any, ...] = (self,) if closure is None else (self, closure)
        kwargs: dict[str, Any] = {}
        for pre_hook in self._optimizer_step_pre_hooks.values():
            result = pre_hook(self, args, kwargs)
            if result is not None:
                args, kwargs = result
        loss = self._step(*args[1:], **kwargs)
        for post_hook in self._optimizer_step_post_hooks.values():
            post_hook(self, args, kwargs)
        return loss

    def _check_dtypes(self) -> None:
        """Refuse a parameter cast since the last step (`model.half()` mid-run), as the startup check refuses
        one cast before the first: one host-side compare of the dtypes, no device work."""
        inner = self.optimizer
        # What the step trains: the groups, and fp8-lm-o3's FP8 weights, held outside them.
        params = [p for g in inner.param_groups for p in g["params"]] + list(getattr(inner, "fp8_params", []))
        dtypes = [p.dtype for p in params]
        stepped = getattr(self, "_stepped", None)
        if stepped is not None and dtypes != stepped[1]:  # other parameters (a group added), or a cast
            before = {id(p): dtype for p, dtype in zip(*stepped)}
            changed = [(p, before[id(p)]) for p, dtype in zip(params, dtypes) if before.get(id(p), dtype) != dtype]
            if changed:
                from ..report import stepped_dtype_error

                raise stepped_dtype_error(self.strategy, changed)
        self._stepped = (params, dtypes)

    def _step(self, closure: Callable | None = None) -> Any:
        self._check_dtypes()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        strategy = self.strategy
        strategy.unscale_gradients(self.optimizer)
        kept = strategy.guard.keep() if strategy.guard is not None else None
        found_inf = strategy.process_gradients(self.optimizer)
        if not isinstance(found_inf, torch.Tensor):
            raise TypeError(
                f"{type(strategy).__name__}.process_gradients returned {type(found_inf).__name__}; it must return "
                "a 0-dim FP32 tensor on the gradients' device (1.0: skip the step), as `numerics.nonfinite_flag` gives"
            )
        if strategy.guard is not None:  # outlier steps are skipped as non-finite ones are (hf_lowprec.guard)
            found_inf = strategy.guard.judge(self.optimizer, found_inf, kept)
        strategy.count_skip(found_inf)
        self._found_inf = found_inf
        measure = strategy.measure_next_step and strategy.options.lost_arithmetic_metrics
        measure = measure and hasattr(self.optimizer, "track_updates")
        strategy.measure_next_step = False
        # A measured step reads the flag on the host (its measurement syncs anyway). A skipped
        # one applied nothing: it reports no lost arithmetic, not the previous measurement's.
        if measure and bool(found_inf):
            strategy._measure_lost_arithmetic(None, len(self.param_groups))
            measure = False
        if measure:
            self.optimizer.track_updates = True
            try:
                strategy.optimizer_step(self.optimizer, found_inf)
            finally:
                self.optimizer.track_updates = False
            strategy._measure_lost_arithmetic(self.optimizer.tracked, len(self.param_groups))
            self.optimizer.tracked = []
        else:
            strategy.optimizer_step(self.optimizer, found_inf)
        return loss

    def state_dict(self) -> dict[str, Any]:
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state = dict(self.optimizer.state_dict())
        if self.strategy.guard is not None:  # a checkpoint save is the guard's snapshot point (docs/guard.md)
            self.strategy.guard.saving()
        state["hf_lowprec"] = {
            "strategy": self.strategy.name,
            "options": dataclasses.asdict(self.strategy.options),
            **saving_version(),  # a resume by another version warns: its update rules may differ
            **self.strategy.state_dict(),
        }
        layout = getattr(self.strategy, "fp8_layout", None)
        if layout is not None:  # which layers the FP8 layer rule kept in BF16
            state["hf_lowprec"]["fp8_layout"] = layout
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state)
            if result is not None:
                state = result
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = dict(result)
        ours = state_dict.pop("hf_lowprec", None)
        if ours is None:
            sharded = any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"][:1])
            check_stock_optimizer_state(self.strategy, sharded)  # saved without a strategy: refused unless stock-like
        else:
            changed = check_optimizer_state(self.strategy, ours)  # another strategy's, changed options: refused
            check_fp8_layout(self.strategy, ours)  # other layers kept in BF16 than when it was saved: refused
            warn_other_version(ours, "this optimizer state")  # before 0.2.0 or another version: once, a warning
            if "seed" in changed:
                # A new stochastic-rounding seed applies for real: the generators start from it.
                state_dict.pop("generator_states", None)
            self.strategy.load_state_dict(
                {k: v for k, v in ours.items() if k not in ("strategy", "options", "fp8_layout", *VERSION_KEYS)}
            )
        self.optimizer.load_state_dict(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def __repr__(self) -> str:
        return f"StrategyOptimizer({self.strategy.name!r}, {self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def as_param_groups(params_or_groups: Any) -> list[dict[str, Any]]:
    """Parameters, `named_parameters()` or parameter groups as a list of groups (`create_optimizer`)."""
    if isinstance(params_or_groups, torch.nn.Module):  # a habit from libraries that take the model
        raise TypeError(
            f"create_optimizer takes parameters or parameter groups, not the model ({type(params_or_groups).__name__}): "
            "pass model.parameters()"
        )
    items = list(params_or_groups)
    if not items:
        return []
    if isinstance(items[0], dict):
        return [dict(g, params=list(g["params"])) for g in items]
    if isinstance(items[0], tuple):  # named_parameters()
        items = [p for _, p in items]
    return [{"params": items}]
