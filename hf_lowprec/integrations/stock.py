"""What the Trainer glue keeps from the stock `transformers.Trainer`, and what it changes.

- Stock signatures. A class built with `PrecisionTrainerMixin` (or one of `hf_lowprec.trl`'s
  mixins) takes its arguments exactly as the stock class it extends, positionally and by
  keyword: a mixin's `__init__` forwards them untouched, and `forwarding_init` gives the
  composed class an `__init__` whose `inspect.signature` is the stock one. A mixin that reads
  an argument finds it with `bind_stock_arguments`, wherever the caller put it.
- `stock_differences(name)`: what a strategy changes in the Trainer's behaviour, files and
  refusals, from the strategy's declarations; the README's table is generated from it
  (`scripts/readme_tables.py`). With no strategy, nothing.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from ..strategies.interface import PrecisionStrategy, StrategyOptimizer

__all__ = [
    "stock_class",
    "forwarding_init",
    "bind_stock_arguments",
    "reconcile_mixed_precision_flags",
    "accept_optimizer",
    "users_optimizer_named",
    "refuse_strategy_checkpoint",
    "stock_differences",
    "differences_markdown",
]

logger = logging.getLogger(__name__)

# Trainer `optim` values whose algorithm every strategy's AdamW reproduces.
ADAMW_OPTIMS = {"adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_torch_xla", "adamw_torch_npu_fused"}


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


# --- the stock arguments a strategy takes over or refuses ---------------------------------------


def reconcile_mixed_precision_flags(args: Any, strategy: PrecisionStrategy) -> None:
    """`bf16`/`fp16` that agree with the strategy's compute dtype are cleared (the strategy owns
    mixed precision); contradicting ones, and an `optim` for a strategy with its own AdamW, refused."""
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


def refuse_strategy_checkpoint(output_dir: str, resume: Any) -> None:
    """Without a strategy: refuse the checkpoint a strategy saved (its manifest names the strategy);
    a stock checkpoint (no manifest) goes untouched to the stock resume, its checks and errors."""
    from transformers.trainer_utils import get_last_checkpoint

    from ..checkpoints.manifest import MANIFEST

    if resume is True:
        resume = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if not isinstance(resume, (str, os.PathLike)) or not os.path.isfile(os.path.join(resume, MANIFEST)):
        return
    try:
        with open(os.path.join(resume, MANIFEST), encoding="utf-8") as f:
            saved = json.load(f).get("strategy")
    except (ValueError, UnicodeDecodeError, AttributeError, OSError):
        return  # not a manifest the package can read: the stock resume decides
    if saved is not None:
        raise ValueError(
            f"{os.path.join(resume, MANIFEST)} was saved by precision strategy {saved!r}, but this run uses no "
            f"precision strategy; resume with --precision_strategy {saved}, or start a new run from the weights "
            f"in {resume} without resume_from_checkpoint"
        )


# --- what a strategy changes ------------------------------------------------------------------

_EVERY_STRATEGY = (
    "`precision_report.json` in the output directory",
    "`hf_lowprec_manifest.json` in each checkpoint, checked before a resume (missing or damaged files, "
    "another strategy's checkpoint are refused; `resume_reset`)",
    "the strategy's state under `hf_lowprec` in `optimizer.pt`",
    "`precision/…` metrics in the training logs",
    "`bf16`/`fp16` flags: refused unless they match the compute dtype",
)


def stock_differences(name: str | None) -> list[str]:
    """What `hf_lowprec.Trainer` with `precision_strategy=name` does that the stock Trainer does not."""
    if name is None:
        return []
    return [*_EVERY_STRATEGY, _optimizer_difference(name), *_own_differences(name)]


def _optimizer_difference(name: str) -> str:
    from ..strategies.registry import get_strategy

    if get_strategy(name).takes_user_optimizer:
        return (
            "yours: `optimizers=`, `optimizer_cls_and_kwargs`, `optim`, scheduler objects as with `bf16=True`/"
            "`fp16=True` (the AdamW `optim` names run the strategy's AdamW)"
        )
    return (
        "its own AdamW: `optimizers=`, `optimizer_cls_and_kwargs`, a non-AdamW `optim` refused "
        "(a scheduler over `trainer.create_optimizer()` works)"
    )


def _own_differences(name: str) -> list[str]:
    from ..strategies.registry import get_strategy

    strategy = get_strategy(name)
    found = []
    if strategy.skips_nonfinite:
        found.append("a step with inf/NaN gradients is skipped and counted")
    if type(strategy).scale_loss is not PrecisionStrategy.scale_loss:
        found.append("the strategy scales the loss (`precision/loss_scale` logged)")
    if strategy.param_dtype != PrecisionStrategy.param_dtype:
        dtype = str(strategy.param_dtype).removeprefix("torch.")
        found.append(f"weights trained and saved in {dtype} (`save_full_precision` saves FP32)")
    converts = type(strategy).convert_model is not PrecisionStrategy.convert_model
    if strategy.uses_fp8_gemm or (converts and strategy.param_dtype == PrecisionStrategy.param_dtype):
        found.append("linear layers swapped for FP8 ones")
    return found


def differences_markdown() -> str:
    """The README table: strategies with the same differences from the stock Trainer on one row."""
    from ..strategies.registry import available_strategies

    rows: dict[tuple[str, ...], list[str]] = {}
    for name in available_strategies():
        rows.setdefault((_optimizer_difference(name), *_own_differences(name)), []).append(f"`{name}`")
    lines = [
        "| `precision_strategy` | optimizer | also differs from the stock `transformers.Trainer` |",
        "|---|---|---|",
        "| unset (also under `hf-lowprec launch`) | stock | nothing: stock files, resume and errors (but a "
        "checkpoint a strategy saved is refused; a `SilentPrecisionWarning` when BF16/FP16 weights meet a plain AdamW) |",
        f"| every strategy | — | {'; '.join(_EVERY_STRATEGY)} |",
    ]
    for (optimizer, *extra), names in rows.items():
        lines.append(f"| {', '.join(names)} | {optimizer} | {'; '.join(extra) or '—'} |")
    return "\n".join(lines) + "\n"
