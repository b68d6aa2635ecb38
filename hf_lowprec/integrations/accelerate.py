"""A precision strategy in a hand-written Accelerate loop, in three changed lines (`PrecisionPlugin`;
docs/distributed.md, "A custom Accelerate loop"). The plugin wraps Accelerate's calls rather than
registering with the Accelerator: the strategy owns mixed precision, so the Accelerator must have
`mixed_precision="no"`.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import logging
import math
import weakref
from typing import Any

import torch

from ..engines.ddp import prepare_ddp
from ..memory import unwrap_optimizer
from ..optim.torch_options import TORCH_ONLY_KEYS
from ..report import check_promises, describe, format_report, warn_slow_fp16_once
from ..scaling import narrow_grad_norm
from ..strategies.fp16_base import LossScaledStrategy
from ..strategies.interface import PrecisionStrategy, StrategyOptimizer
from ..strategies.registry import get_strategy
from ..strategies.seen_norm import reveals_nonfinite
from .accelerate_state import load_state, save_state
from .accelerator_state import refuse_mixed_precision
from .autocasting import autocast_disabled, casts_outside_forward, outside_forward
from .deferred_skip import hold_accelerated_scheduler, note_accelerate_skip
from .outputs import narrow_inputs, owned_wrappers, widen_outputs
from .peft import prepare_model as _prepare_model
from .scheduler_rebinding import rebind_scheduler, schedulers_over

__all__ = ["PrecisionPlugin"]

logger = logging.getLogger(__name__)


class PrecisionPlugin:
    """Applies a precision strategy to a custom Accelerate training loop.

        accelerator = Accelerator()
        plugin = PrecisionPlugin("collage-plus")                                   # 1: new
        model, optimizer, loader, scheduler = plugin.prepare(                      # 2: was accelerator.prepare(
            accelerator, model, optimizer, loader, scheduler)
        for batch in loader:
            loss = model(**batch).loss          # runs in the strategy's forward context
            plugin.backward(accelerator, loss)                                     # 3: was accelerator.backward(loss)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

    Args:
        strategy: a registered strategy name (see `hf_lowprec.available_strategies()`) or a
            strategy object.
        **options: the strategy's options, when `strategy` is a name.
    """

    def __init__(self, strategy: str | PrecisionStrategy, **options: Any) -> None:
        if isinstance(strategy, PrecisionStrategy):
            if options:
                raise ValueError("pass options either to get_strategy(...) or here, not both")
            self.strategy = strategy
        else:
            self.strategy = get_strategy(strategy, **options)
        # Weak: what the loop drops (after `accelerator.free_memory`) is freed, and not taken for a later object.
        self._optimizers: weakref.WeakSet = weakref.WeakSet()  # the strategy's optimizers
        # Each replaced torch optimizer → the strategy's optimizer that took its place.
        self._replaced: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._skips_noted: weakref.WeakSet = weakref.WeakSet()  # Accelerate's optimizer wrappers told of skips
        self._schedulers: weakref.WeakSet = weakref.WeakSet()  # the AcceleratedSchedulers: held a step late on a skip
        self.report: dict[str, Any] | None = None  # the startup report of the last prepared model
        self._outside = 0  # `autocast()` contexts open

    def __repr__(self) -> str:
        return f"PrecisionPlugin({self.strategy!r})"

    # --- the three-line path ---------------------------------------------------------
    def prepare(self, accelerator: Any, *objects: Any, **prepare_kwargs: Any) -> Any:
        """`accelerator.prepare(*objects)` with the strategy applied to models and optimizers.

        Models are converted and get the forward context. A `torch.optim.AdamW` (or `Adam`
        without weight decay) is replaced by the strategy's optimizer with the same groups;
        an optimizer from `create_optimizer` passes through. LR schedulers built on a replaced
        optimizer (and those nested in `SequentialLR` / `ChainedScheduler`) are moved to the new
        one, here or in a later `accelerator.prepare`. Returns what `accelerator.prepare` returns.
        """
        refuse_mixed_precision(self.strategy.name, accelerator)  # from this Accelerator, the launch, or an earlier one
        objects = list(objects)
        self._refuse_second_optimizer(objects)
        unconverted = {id(p) for obj in objects if isinstance(obj, torch.nn.Module) for p in obj.parameters()}
        for obj in objects:  # every optimizer refusal before a model is converted: a refused prepare leaves it stock
            stock = isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, StrategyOptimizer)
            if stock and obj not in self._replaced:
                self._check_optimizer(obj, unconverted)
        model_params: set[int] = set()
        for i, obj in enumerate(objects):
            if isinstance(obj, torch.nn.Module):
                objects[i] = self.prepare_model(obj)
                model_params.update(id(p) for p in objects[i].parameters())
        for i, obj in enumerate(objects):
            if isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, StrategyOptimizer):
                if obj not in self._replaced:
                    self._replaced[obj] = self._convert_optimizer(obj, model_params)
                    # A scheduler built on it that never reaches prepare moves too (Accelerate's wrapper
                    # steps the user's optimizer itself, so such a scheduler works there).
                    for scheduler in schedulers_over(obj):
                        self._follow(scheduler)
                objects[i] = self._replaced[obj]
            if isinstance(objects[i], StrategyOptimizer):
                self._optimizers.add(objects[i])
        for obj in objects:
            self._follow(obj)
        if getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None) is not None:
            from ..engines.zero import configure_accelerator

            configure_accelerator(self.strategy, accelerator)  # before prepare starts DeepSpeed
        fsdp = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None) is not None
        if not fsdp:
            from ..engines.fsdp2 import warn_if_fsdp_fell_back

            warn_if_fsdp_fell_back(accelerator)
        before: dict[int, list[torch.Tensor]] = {}
        if fsdp:
            from ..engines.fsdp2 import before_sharding
            from ..engines.fsdp2 import configure_accelerator as configure_fsdp

            configure_fsdp(self.strategy, accelerator)  # before prepare runs fully_shard
            for model in (o for o in objects if isinstance(o, torch.nn.Module)):  # FP8-LM: FP8 all-gather
                before_sharding(self.strategy, model, [o for o in objects if isinstance(o, StrategyOptimizer)])
            before = {
                id(o): [p for g in o.param_groups for p in g["params"]]
                for o in objects
                if isinstance(o, StrategyOptimizer)
            }
        self._report(accelerator, objects)
        self._route(accelerator)  # (after every check: a refused prepare leaves it stock)
        prepared = accelerator.prepare(*objects, **prepare_kwargs)
        self._note_skips(prepared if isinstance(prepared, (tuple, list)) else (prepared,))
        if fsdp:
            from ..engines.fsdp2 import adopt_shards, move_state_to_shards

            # Accelerate's FSDP2 prepare returns a list, the others a tuple.
            for obj in prepared if isinstance(prepared, (tuple, list)) else (prepared,):
                inner = getattr(obj, "optimizer", None)  # AcceleratedOptimizer → StrategyOptimizer
                if id(inner) in before:
                    move_state_to_shards(inner, before[id(inner)])
                if isinstance(obj, torch.nn.Module):
                    adopt_shards(self.strategy, obj, {})  # the optimizer's seeded state moved above
        self._register_comm_hooks(prepared if isinstance(prepared, tuple) else (prepared,))
        if getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None) is not None:
            from ..engines.zero import attach_zero_optimizer

            for obj in prepared if isinstance(prepared, tuple) else (prepared,):
                attach_zero_optimizer(getattr(obj, "optimizer", None))  # the engine's ZeRO optimizer
        return prepared

    def _report(self, accelerator: Any, objects: list[Any]) -> None:
        # Once per model, before Accelerate wraps anything: log what is active, stop on a broken promise.
        optimizers = [o for o in objects if isinstance(o, StrategyOptimizer)]
        for model in (o for o in objects if isinstance(o, torch.nn.Module)):
            # The optimizer over this model's parameters (a policy's, a value model's), else the first.
            owned = {id(p) for p in model.parameters()}
            holders = [o for o in optimizers if any(id(p) in owned for g in o.param_groups for p in g["params"])]
            optimizer = (holders or optimizers or [None])[0]
            self.report = describe(self.strategy, model, optimizer, ddp=getattr(accelerator, "num_processes", 1) > 1)
            if getattr(accelerator, "is_main_process", True):
                logger.info("%s", format_report(self.report))
                warn_slow_fp16_once(self.strategy, model)
            check_promises(self.strategy, model)

    def backward(self, accelerator: Any, loss: torch.Tensor, **kwargs: Any) -> None:
        """`accelerator.backward(loss)` on the strategy's scaled loss."""
        # Accelerate's backward divides by it; the loop expects the micro-batches' sum, as stock gives it.
        self.strategy.set_gradient_accumulation(accelerator.gradient_accumulation_steps, sums=True)
        accelerator.backward(self.strategy.scale_loss(loss), **kwargs)

    # --- finer-grained pieces ----------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Convert `model`, every forward in the strategy's context, 16-bit outputs in FP32 (as Accelerate's)."""
        model = _prepare_model(self.strategy, model)
        # The strategy's own (`owned_wrappers`): another strategy preparing the model removes them.
        record = owned_wrappers(self.strategy, model)
        if "context" not in record.kinds:
            record.kinds.add("context")
            contexts: list[contextlib.AbstractContextManager] = []

            def enter(module: torch.nn.Module, args: Any) -> None:
                # Within `autocast()` too, a 16-bit-weight strategy's forward computes as its own.
                inside = self._outside and casts_outside_forward(self.strategy)
                ctx = autocast_disabled() if inside else self.strategy.forward_context()
                ctx.__enter__()
                contexts.append(ctx)

            def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
                if contexts:
                    contexts.pop().__exit__(None, None, None)

            # Run as Python, not traced: under Accelerate's `dynamo_backend` dynamo inlines the hooks and cannot
            # enter a context in one and leave it in another; the forward is traced under the pre-hook's context.
            record.handles.append(model.register_forward_pre_hook(torch.compiler.disable(enter)))
            # always_call: leave the context even when the forward raises.
            record.handles.append(model.register_forward_hook(torch.compiler.disable(leave), always_call=True))
            widen_outputs(self.strategy, narrow_inputs(self.strategy, model))  # float inputs narrowed, outputs FP32
        return model

    def shard(self, model: torch.nn.Module, mesh: Any = None, **fully_shard_kwargs: Any) -> torch.nn.Module:
        """FSDP2 in a custom loop: `prepare_model` (conversion, forward context), then
        `fully_shard` per transformer block and on the root with the strategy's mixed-precision
        policy (`hf_lowprec.engines.fsdp2.shard_model`). Every rank calls it; build the optimizer afterwards with
        `create_optimizer(model.parameters(), ...)`. Refused strategies raise before any work."""
        from ..engines.fsdp2 import check_fsdp2_support

        check_fsdp2_support(self.strategy)
        from ..engines.fsdp2 import shard_model

        return shard_model(self.strategy, self.prepare_model(model), mesh, prepared=True, **fully_shard_kwargs)

    def create_optimizer(self, params_or_groups: Any, **hyper: Any) -> StrategyOptimizer:
        """The strategy's AdamW (`lr`, `betas`, `eps`, `weight_decay`, this one 0.0 unless given), built directly."""
        self._refuse_second_optimizer([None])
        optimizer = self.strategy.create_optimizer(params_or_groups, **hyper)
        self._optimizers.add(optimizer)
        return optimizer

    @contextlib.contextmanager
    def autocast(self, autocast_handler: Any = None) -> Any:
        """For computation outside the model's forward (a custom loss, a head on its hidden states):
        the forward context, or an autocast to the compute dtype where the weights are 16-bit and that
        context is none; a forward run inside computes as without it. `prepare` makes
        `accelerator.autocast` this (`AutocastKwargs(enabled=False)` turns autocast off)."""
        self._outside += 1
        try:
            with outside_forward(self.strategy, autocast_handler):
                yield
        finally:
            self._outside -= 1

    def clip_grad_norm_(
        self, accelerator: Any, parameters: Any, max_norm: float, norm_type: float = 2.0, **kwargs: Any
    ) -> torch.Tensor:
        """`accelerator.clip_grad_norm_(parameters, max_norm, norm_type)` on the gradients the strategy trains:
        unscaled (loss-scaling strategies), O2's FP8 ones included. `prepare` makes `accelerator.clip_grad_norm_`
        this. A strategy's own clipping (FP16, O2) takes norm_type 2 or inf, and refuses others.

        On a micro-step that does not sync under gradient accumulation (`accelerator.sync_gradients`
        False), a loss-scaling strategy clips nothing and returns the norm the gradients so far would
        have unscaled: their scale is removed once, at the step, after the last micro-batch."""
        _refuse_unknown_keywords(accelerator, "clip_grad_norm_", kwargs)  # as stock's, before any work
        if self._accumulating(accelerator):
            parameters = list(parameters)
            scaled = self.strategy.clip_own_grad_norm(parameters, math.inf, norm_type)  # measures only
            scaled = scaled.full_tensor() if hasattr(scaled, "full_tensor") else scaled  # FSDP2's DTensor norm
            return scaled / self.strategy.scaler.scale(torch.ones((), device=scaled.device))  # a power of two
        self.unscale_gradients(accelerator)
        parameters = list(parameters)
        # FP16 strategies: an FP32 norm (norm_type passed only where it is not the default a hook may lack).
        extra = {} if float(norm_type) == 2.0 else {"norm_type": norm_type}
        norm = self.strategy.clip_own_grad_norm(parameters, max_norm, **extra)
        if norm is None and accelerator.distributed_type not in ("DEEPSPEED", "FSDP"):  # (their own clipping)
            norm = narrow_grad_norm(parameters, max_norm, norm_type)  # 16-bit gradients: an FP32 norm
        if norm is None:
            norm = type(accelerator).clip_grad_norm_(accelerator, parameters, max_norm, norm_type=norm_type, **kwargs)
        # The guard reads this pre-clip norm; the step's skip flag too, for a norm that sees inf/NaN.
        covered = parameters if reveals_nonfinite(norm_type) else None
        return self.strategy.note_grad_norm(norm, covered)

    def clip_grad_value_(self, accelerator: Any, parameters: Any, clip_value: float) -> None:
        """`accelerator.clip_grad_value_(parameters, clip_value)` on the gradients the strategy trains:
        unscaled first (loss-scaling strategies), O2's FP8 ones clamped too. `prepare` makes
        `accelerator.clip_grad_value_` this. On a micro-step that does not sync, a loss-scaling
        strategy clamps nothing (see `clip_grad_norm_`)."""
        if self._accumulating(accelerator):
            return
        self.unscale_gradients(accelerator)
        parameters = list(parameters)
        # p.grad (it refuses ZeRO/FSDP) by dtype: a bound past the dtype's largest value (1e5 on FP16) clamps nothing.
        for dtype in {p.grad.dtype for p in parameters if p.grad is not None}:
            group = [p for p in parameters if p.grad is not None and p.grad.dtype == dtype]
            type(accelerator).clip_grad_value_(accelerator, group, min(clip_value, torch.finfo(dtype).max))
        self.strategy.clip_own_grad_value(parameters, clip_value)

    def unscale_gradients(self, accelerator: Any, optimizer: Any = None) -> None:
        """`accelerator.unscale_gradients(optimizer)`: the strategy's unscaling of its optimizer's
        gradients (of those among `optimizer`, one or a list, where given), so that `p.grad` holds
        the true gradients for the loop's own clipping (`torch.nn.utils.clip_grad_norm_`) or logging,
        as under stock fp16; the step does not unscale them again. `prepare` makes
        `accelerator.unscale_gradients` this. On a micro-step that does not sync, a loss-scaling
        strategy unscales nothing (see `clip_grad_norm_`)."""
        if self._accumulating(accelerator):
            return
        given = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
        chosen = {id(unwrap_optimizer(o)) for o in given}
        for ours in self._optimizers:
            if optimizer is None or id(unwrap_optimizer(ours)) in chosen:
                self.strategy.unscale_gradients(ours.optimizer)

    def prepare_scheduler(self, accelerator: Any, scheduler: Any) -> Any:
        """`accelerator.prepare_scheduler(scheduler)`, the scheduler first moved to the strategy's
        optimizer where it was built on one `prepare` replaced. `prepare` routes Accelerate's to this."""
        self._follow(scheduler)
        prepared = type(accelerator).prepare_scheduler(accelerator, scheduler)
        hold_accelerated_scheduler(prepared)
        self._schedulers.add(prepared)
        return prepared

    def metrics(self) -> dict[str, float]:
        """The strategy's metrics (`precision/...`), for the loop's logger."""
        return self.strategy.metrics()

    # --- internals ---------------------------------------------------------------------
    def _accumulating(self, accelerator: Any) -> bool:
        # Under gradient accumulation a loss-scaling strategy unscales once, at the step: unscaled on an
        # earlier micro-step, the gradients would take the later micro-batches' scaled ones on top.
        return isinstance(self.strategy, LossScaledStrategy) and not getattr(accelerator, "sync_gradients", True)

    def _refuse_second_optimizer(self, objects: list[Any]) -> None:
        # A loss-scaling strategy's one scaler unscales and updates once per optimizer step: a second
        # optimizer's gradients would be unscaled by a scale already moved on, or clipped still scaled.
        if not isinstance(self.strategy, LossScaledStrategy):
            return
        known = (self._optimizers, self._replaced)  # counted: the strategy's optimizers the loop still holds
        new = {id(o) for o in objects if isinstance(o, torch.optim.Optimizer) and all(o not in k for k in known)}
        new |= {id(o) for o in objects if o is None}  # one create_optimizer is about to build
        if new and len(self._optimizers) + len(new) > 1:
            gc.collect()  # one the loop dropped (after `accelerator.free_memory`) may wait in a reference cycle
        if new and len(self._optimizers) + len(new) > 1:
            raise ValueError(
                f"precision strategy {self.strategy.name!r} scales the loss with one loss scaler, which unscales "
                "and updates once per optimizer step: it trains one optimizer per PrecisionPlugin, and this would "
                f"be optimizer {len(self._optimizers) + len(new)} (two models, a GAN's generator and "
                "discriminator): its gradients would be unscaled by the wrong scale. Put the parameters in one "
                "optimizer (param groups for separate settings), or pick a BF16 strategy (bf16-mixed, "
                "collage-plus), which scales nothing. A retry (`accelerator.free_memory()`, then a new model and "
                "optimizer) is no second one once the earlier optimizer is dropped"
            )

    def _route(self, accelerator: Any) -> None:
        # A loop written for Accelerate clips with `accelerator.clip_grad_norm_` / `clip_grad_value_`,
        # which see only `p.grad`: scaled gradients (loss-scaling strategies) and not O2's FP8 ones
        # held beside it, or unscales with `unscale_gradients` (stock's finds no scaler: mixed_precision
        # is "no") before clipping or reading them itself. On this Accelerator they are the plugin's (the
        # last one to prepare), as is `prepare_scheduler`, which moves a scheduler prepared in a later
        # call to the strategy's optimizer, and `autocast`, for computation outside the forward.
        accelerator.unscale_gradients = functools.partial(self.unscale_gradients, accelerator)
        accelerator.clip_grad_norm_ = functools.partial(self.clip_grad_norm_, accelerator)
        accelerator.clip_grad_value_ = functools.partial(self.clip_grad_value_, accelerator)
        accelerator.prepare_scheduler = functools.partial(self.prepare_scheduler, accelerator)
        accelerator.autocast = self.autocast  # stock's autocast is off (mixed_precision="no")
        # A save is complete with its manifest, FSDP2's keeps the strategy's entry; a load checks both first.
        accelerator.save_state = functools.partial(save_state, self, accelerator)
        accelerator.load_state = functools.partial(load_state, self, accelerator)

    def _follow(self, scheduler: Any) -> None:
        # A scheduler (or one nested in SequentialLR / ChainedScheduler) on a replaced optimizer moves to its successor.
        if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            return
        for child in getattr(scheduler, "_schedulers", ()):
            self._follow(child)
        old = getattr(scheduler, "optimizer", None)
        if isinstance(old, torch.optim.Optimizer) and old in self._replaced:
            rebind_scheduler(scheduler, self._replaced[old], old)

    def _note_skips(self, prepared: Any) -> None:
        # Accelerate's scheduler holds, and `accelerator.optimizer_step_was_skipped` is True, only where its wrapper
        # says so, which it knows only of its GradScaler: the strategy's skip, read a step late (`deferred_skip`).
        for wrapper in prepared:
            inner = getattr(wrapper, "optimizer", None)
            if isinstance(inner, StrategyOptimizer) and hasattr(wrapper, "_is_overflow"):
                if wrapper not in self._skips_noted:
                    self._skips_noted.add(wrapper)
                    inner.register_step_post_hook(functools.partial(note_accelerate_skip, wrapper, self._schedulers))

    def _register_comm_hooks(self, prepared: tuple) -> None:
        # A strategy with its own gradient all-reduce (FP8-LM's FP8 all-reduce) offers
        # `ddp_comm_hook() -> (state, hook)`; DDP models get it (a refused strategy stops here).
        for obj in prepared:
            prepare_ddp(self.strategy, obj)

    def _check_optimizer(self, optimizer: torch.optim.Optimizer, model_params: set[int]) -> None:
        name = type(optimizer).__name__
        if not isinstance(optimizer, torch.optim.Adam):
            raise TypeError(
                f"precision strategy {self.strategy.name!r} builds its own AdamW and can only take the place of "
                f"torch.optim.AdamW/Adam, got {name}; build the optimizer with plugin.create_optimizer(...)"
            )
        if optimizer.state:
            raise ValueError("the optimizer has already stepped; call plugin.prepare(...) before training")
        for group in optimizer.param_groups:
            if group.get("amsgrad") or group.get("maximize") or group.get("differentiable"):
                raise ValueError(
                    f"{name}(amsgrad=True / maximize=True / differentiable=True) has no counterpart in the "
                    "strategy's AdamW; drop the argument"
                )
            decoupled = isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay", False)
            if group["weight_decay"] and not decoupled:
                raise ValueError(
                    f"{name} with weight_decay adds L2 to the gradient; the strategy's AdamW decays decoupled. "
                    "Use torch.optim.AdamW"
                )
            self._refuse_stale(group, model_params)

    def _convert_optimizer(self, optimizer: torch.optim.Optimizer, model_params: set[int]) -> StrategyOptimizer:
        for group in optimizer.param_groups:  # `_check_optimizer` passed; the parameters again, converted
            self._refuse_stale(group, model_params)
        # All but torch's switches (`_check_optimizer` refused those that matter): a scheduler's keys, the user's.
        groups = [{k: v for k, v in group.items() if k not in TORCH_ONLY_KEYS} for group in optimizer.param_groups]
        return self.strategy.create_optimizer(
            groups, **{k: optimizer.defaults[k] for k in ("lr", "betas", "eps", "weight_decay")}
        )

    @staticmethod
    def _refuse_stale(group: dict[str, Any], model_params: set[int]) -> None:
        stale = [p for p in group["params"] if id(p) not in model_params]
        if model_params and stale:
            raise ValueError(
                f"{len(stale)} optimizer parameters are not in the model passed beside it: an optimizer over another "
                "model's parameters, or one built before the strategy replaced layers (prepare the model and its "
                "optimizer in one plugin.prepare call, or build the optimizer after plugin.prepare_model(model))"
            )


def _refuse_unknown_keywords(accelerator: Any, name: str, kwargs: dict[str, Any]) -> None:
    """Stock's TypeError for a keyword that stock Accelerate's `name` does not take (torch's
    `error_if_nonfinite`, `foreach`), under every strategy: not dropped where the strategy clips itself."""
    stock = inspect.signature(getattr(type(accelerator), name)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in stock.values()):
        return
    unknown = [key for key in kwargs if key not in stock]
    if unknown:
        raise TypeError(
            f"accelerator.{name}() got an unexpected keyword argument {unknown[0]!r}: stock Accelerate's takes "
            f"({', '.join(k for k in stock if k != 'self')}) only, and so does the plugin's; drop it (for "
            "error_if_nonfinite, test the returned norm: `torch.isfinite(norm)`, a host sync)"
        )
