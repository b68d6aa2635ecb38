"""The stock Trainer's precision and optimizer arguments under a strategy: `bf16`/`fp16`, the
full-eval flags and `optim` reconciled with the strategy or refused; `optimizers=`, and the optimizer the
Trainer holds when train() builds it (assigned, or from an override of `create_optimizer`), accepted,
wrapped or refused.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from ..strategies.interface import PrecisionStrategy, StrategyOptimizer

__all__ = [
    "ADAMW_OPTIMS",
    "accept_optimizer",
    "adopt_optimizer",
    "checked_create_optimizer",
    "check_engine_arguments",
    "find_strategy_optimizer",
    "reconcile_launched_mixed_precision",
    "reconcile_mixed_precision_flags",
    "refuse_unwrapped",
    "users_optimizer_named",
]

logger = logging.getLogger(__name__)

# Trainer `optim` values whose algorithm every strategy's AdamW reproduces.
ADAMW_OPTIMS = {"adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_torch_xla", "adamw_torch_npu_fused"}


def check_engine_arguments(args: Any, strategy: PrecisionStrategy) -> None:
    """`deepspeed` and `fsdp` arguments the strategy refuses, and a missing DeepSpeed, before any work."""
    if getattr(args, "deepspeed", None):
        from ..engines.zero import precision_config, require_deepspeed

        # A refused combination first (it would not run with DeepSpeed installed either),
        # then a missing DeepSpeed: each an error naming what to do.
        precision_config(strategy, args.deepspeed)
        require_deepspeed()
    if getattr(args, "fsdp", None):
        from ..engines.fsdp2 import check_trainer_fsdp

        check_trainer_fsdp(strategy, args.fsdp, args.fsdp_config, args.save_on_each_node)


_ACCELERATE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def reconcile_launched_mixed_precision(args: Any, strategy: PrecisionStrategy) -> None:
    """Accelerate's `mixed_precision` (`accelerate launch --mixed_precision`, its config file:
    `ACCELERATE_MIXED_PRECISION`), which the stock arguments hand to the Accelerator: one that agrees
    with the strategy's compute dtype is cleared, as `bf16`/`fp16` are; another (an autocast the
    strategy and its report know nothing of) refused."""
    launched = getattr(args, "mixed_precision", "no") or "no"
    if launched == "no":
        return
    if _ACCELERATE_DTYPES.get(launched) != strategy.compute_dtype:
        raise ValueError(
            f"precision_strategy={args.precision_strategy!r} computes in {strategy.compute_dtype}, but Accelerate's "
            f"mixed_precision is {launched!r} (accelerate launch --mixed_precision, or its config file: "
            "ACCELERATE_MIXED_PRECISION), which would autocast the model under the strategy; the strategy owns mixed "
            "precision: set mixed_precision 'no' in the Accelerate config (or drop --mixed_precision)"
        )
    logger.info(
        "precision_strategy %r owns mixed precision; ignoring Accelerate's %r", args.precision_strategy, launched
    )
    args.mixed_precision = "no"  # (DeepSpeed's precision entries: the strategy writes them, engines.zero)


def reconcile_mixed_precision_flags(args: Any, strategy: PrecisionStrategy) -> None:
    """`bf16`/`fp16` and `fp16_full_eval`/`bf16_full_eval` that agree with the strategy's compute
    dtype are cleared (the strategy owns mixed precision); contradicting ones, and an `optim` for a
    strategy with its own AdamW, refused."""
    compute = strategy.compute_dtype
    if args.fp16 and compute != torch.float16:
        raise ValueError(
            f"precision_strategy={args.precision_strategy!r} computes in {compute} but fp16=True was also set; "
            "the strategy owns mixed precision: remove fp16=True (--fp16)"
        )
    if args.bf16 and compute != torch.bfloat16:
        raise ValueError(
            f"precision_strategy={args.precision_strategy!r} computes in {compute} but bf16=True was also set; "
            "the strategy owns mixed precision: remove bf16=True (--bf16)"
        )
    if args.bf16 or args.fp16:
        logger.info("precision_strategy %r owns mixed precision; ignoring bf16/fp16 flags", args.precision_strategy)
        args.bf16 = False
        args.fp16 = False
    # The stock Trainer casts the whole model to the full-eval dtype in place before an evaluation
    # outside train(): FP32 masters, FP8 payloads and the strategy's FP32 buffers with it.
    for flag, dtype in (("fp16_full_eval", torch.float16), ("bf16_full_eval", torch.bfloat16)):
        if getattr(args, flag, False):
            if compute != dtype:
                raise ValueError(
                    f"precision_strategy={args.precision_strategy!r} computes in {compute} but {flag}=True was "
                    f"also set, which casts the model's weights to {dtype} in place; the strategy evaluates in its "
                    f"own precision: remove {flag}=True (--{flag})"
                )
            logger.info(
                "precision_strategy %r evaluates in its own precision; ignoring %s", args.precision_strategy, flag
            )
            setattr(args, flag, False)
    optim = getattr(args.optim, "value", args.optim)
    if optim not in ADAMW_OPTIMS and not strategy.takes_user_optimizer:
        raise ValueError(
            f"precision_strategy={args.precision_strategy!r} builds its own AdamW, but optim={optim!r} was set; "
            "remove --optim (or use adamw_torch)"
        )


def accept_optimizer(strategy: PrecisionStrategy, optimizer: Any, cls_and_kwargs: Any) -> Any:
    """The Trainer's `optimizers=(optimizer, …)` under `strategy`: the user's optimizer wrapped in the
    strategy's step (`takes_user_optimizer`), or a ValueError for a strategy with its own optimizer."""
    foreign = optimizer is not None and not isinstance(optimizer, StrategyOptimizer)
    if strategy.takes_user_optimizer:
        return StrategyOptimizer(optimizer, strategy) if foreign else optimizer
    if foreign:
        raise ValueError(
            f"precision_strategy={strategy.name!r} builds the optimizer, but optimizers=(...) "
            "passed another one; drop `optimizers=` or build it with strategy.create_optimizer(...)"
        )
    if cls_and_kwargs is not None:
        raise ValueError(f"precision_strategy={strategy.name!r} builds the optimizer; drop optimizer_cls_and_kwargs=")
    return optimizer


def users_optimizer_named(strategy: PrecisionStrategy | None, args: Any, cls_and_kwargs: Any) -> bool:
    """The Trainer builds the optimizer its arguments name (`optimizer_cls_and_kwargs`, an `optim`
    other than AdamW) rather than the strategy's AdamW: only for a `takes_user_optimizer` strategy."""
    optim = getattr(args.optim, "value", args.optim)
    named = cls_and_kwargs is not None or optim not in ADAMW_OPTIMS
    return strategy is not None and strategy.takes_user_optimizer and named


def find_strategy_optimizer(optimizer: Any) -> StrategyOptimizer | None:
    """The strategy's optimizer in a chain of wrappers (Accelerate's, DeepSpeed's: each `.optimizer`)."""
    while optimizer is not None and not isinstance(optimizer, StrategyOptimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


_FIX = (
    "build the strategy's optimizer instead: `trainer.precision.create_optimizer(param_groups, lr=...)` "
    "(`self.precision` in an override) takes per-group lr and weight_decay, and the Trainer's own "
    "create_optimizer() returns the strategy's AdamW (docs/recipes.md, 'Your optimizer and scheduler with a strategy')"
)


def _named(optimizer: Any) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def adopt_optimizer(strategy: PrecisionStrategy, optimizer: Any, source: str) -> Any:
    """The optimizer the Trainer holds as train() builds it, before Accelerate wraps it: the strategy's
    (unwrapped from Accelerate's wrapper of an earlier train(), for Accelerate to wrap once), another one
    wrapped in the strategy's step (`takes_user_optimizer`), or a ValueError naming `source`, where it came from."""
    inner = find_strategy_optimizer(optimizer)
    if inner is not None:
        return inner
    if strategy.takes_user_optimizer:
        return StrategyOptimizer(optimizer, strategy)
    raise ValueError(
        f"precision_strategy={strategy.name!r} builds the optimizer, but {source} gave the Trainer a "
        f"{_named(optimizer)}, which would step without the strategy (its master weights, loss scale, skipped "
        f"steps); {_FIX}"
    )


def refuse_unwrapped(strategy: PrecisionStrategy, optimizer: Any) -> None:
    """At train() start, the last resort: an optimizer outside the strategy's step, built where neither
    `optimizers=` nor `create_optimizer` saw it, is refused (too late to wrap: Accelerate holds it)."""
    if optimizer is None or find_strategy_optimizer(optimizer) is not None:
        return
    fix = (
        "pass it as optimizers=(optimizer, scheduler), or build it in a create_optimizer override of a "
        "subclass of the precision Trainer (its optimizer is wrapped in the strategy's step)"
        if strategy.takes_user_optimizer
        else _FIX
    )
    while getattr(optimizer, "optimizer", None) is not None:  # (under Accelerate's wrapper)
        optimizer = optimizer.optimizer
    raise ValueError(
        f"precision_strategy={strategy.name!r} steps the model through its optimizer, but the Trainer's optimizer "
        f"at train() start, {_named(optimizer)}, is outside it, built where the strategy could not wrap or refuse "
        f"it (a create_optimizer of a class before PrecisionTrainerMixin in the MRO?); {fix}"
    )


def checked_create_optimizer(create: Any, owner: str) -> Any:
    """`create`, a Trainer subclass's override of `create_optimizer` (`owner`: its class), with what it
    builds put through `adopt_optimizer` as the Trainer's own `create_optimizer` puts it."""

    @functools.wraps(create)
    def create_optimizer(self: Any, *args: Any, **kwargs: Any) -> Any:
        optimizer = create(self, *args, **kwargs)
        strategy = getattr(self, "precision", None)
        held = self.optimizer if self.optimizer is not None else optimizer
        if strategy is None or held is None:
            return optimizer
        adopted = adopt_optimizer(strategy, held, f"{owner}.create_optimizer (an override)")
        if adopted is not find_strategy_optimizer(held):  # newly wrapped: FSDP2 moves its state onto the shards
            self._params_before_sharding = [p for g in adopted.param_groups for p in g["params"]]
        self.optimizer = adopted
        return adopted

    return create_optimizer
