"""Which strategy prepared a model (`mark_prepared`, called by `strategies.interface` as it converts one):
a model prepared again under an equal strategy is left as it is (the strategy takes over what the
conversion set up); one whose conversion left layers or hooks bound to the model (FP8 layers, fp16-als's
hooks) is refused by another strategy or other options, while a plain cast (fp32, bf16-mixed, the BF16
weights) may be prepared again by any strategy.
"""

from __future__ import annotations

from typing import Any

import torch

from ..memory import kept_in_fp32
from .adopt import adopt_loaded_dtypes, widen_unfrozen

__all__ = [
    "PREPARED_ATTR",
    "UNCONVERTED_OPTIONS",
    "check_added_dtypes",
    "convert_added",
    "mark_prepared",
    "prepared_already",
    "refuse_without_strategy",
]

# Options that leave a model's conversion as it is (metrics, saving, the guard, frozen models): they
# may differ when a model is prepared again, as on a resume.
UNCONVERTED_OPTIONS = frozenset(
    {"lost_arithmetic_metrics", "save_full_precision", "fused", "frozen_models", "rollout", "guard"}
)

PREPARED_ATTR = "hf_lowprec_prepared"


# What a conversion keeps for the optimizer, not in the model (Collage's seeded residuals).
_OPTIMIZER_SIDE = frozenset({"_residuals"})


class _Mark:
    """Who prepared a model, and whether the conversion bound layers or hooks to it (`binds`). A copy
    (`copy.deepcopy`) or a pickled model keeps the name, options and `binds` only: the strategy object,
    with its hooks and scalers on the original's parameters, is not the copy's."""

    def __init__(self, name: str, options: Any, strategy: Any, binds: bool) -> None:
        self.name, self.options, self.strategy, self.binds = name, options, strategy, binds

    def __deepcopy__(self, memo: dict) -> _Mark:
        return _Mark(self.name, self.options, None, self.binds)

    def __reduce__(self) -> tuple:
        return (_Mark, (self.name, self.options, None, self.binds))


def mark_prepared(strategy: Any, model: torch.nn.Module) -> None:
    """Record on `model` (its `__dict__`, so neither a parameter nor a buffer) that `strategy` prepared it."""
    binds = bool(set(strategy.prepared_state) - _OPTIMIZER_SIDE)
    model.__dict__[PREPARED_ATTR] = _Mark(strategy.name, strategy.options, strategy, binds)


def _marks(model: torch.nn.Module) -> list[tuple[str, _Mark]]:
    return [(name, m.__dict__[PREPARED_ATTR]) for name, m in model.named_modules() if PREPARED_ATTR in m.__dict__]


def prepared_already(strategy: Any, model: torch.nn.Module) -> bool:
    """Whether `model` was prepared under `strategy`'s name and options (True: prepare nothing again).

    A model `strategy` prepared is returned as it is; one an equal strategy object prepared (a second
    Trainer over the same model) too, with that object's conversion state handed to `strategy`
    (the attributes named by its `prepared_state`; its guard watches the model instead). A model,
    or a module of it, whose conversion bound layers or hooks to it (FP8 layers with scaled FP16
    masters, fp16-als's hooks) is refused by another strategy or other options before any work: it
    would train wrongly, or not at all. A cast (fp32, bf16-mixed, the BF16 weights) is prepared again."""
    for where, mark in _marks(model):
        name, options, earlier = mark.name, mark.options, mark.strategy
        fields = [
            f
            for f in vars(options)
            if f not in UNCONVERTED_OPTIONS and getattr(options, f) != getattr(strategy.options, f, None)
        ]
        same = name == strategy.name and not fields
        if where == "" and same:
            if earlier is None and mark.binds:
                raise ValueError(
                    f"this model was prepared under precision strategy {name!r} and then copied or pickled, "
                    f"which does not carry what its conversion bound to it ({', '.join(strategy.prepared_state)}); "
                    "pass a fresh model (build or load it again, or save_pretrained it and load it with from_pretrained)"
                )
            if earlier is not None and earlier is not strategy:
                _take_over(strategy, earlier, model)
            return True
        if same or not mark.binds:  # prepared again, as any model: a cast leaves nothing bound to it
            continue
        what = "this model" if where == "" else f"this model's module {where!r}"
        now = repr(strategy.name)
        if name == strategy.name:  # the options that differ
            name = f"{name} with " + ", ".join(f"{f}={getattr(options, f)!r}" for f in fields)
            now = "the same strategy with " + ", ".join(f"{f}={getattr(strategy.options, f, None)!r}" for f in fields)
        raise ValueError(
            f"{what} was prepared already under precision strategy {name!r}: its layers and hooks are that "
            f"strategy's conversion (FP8 layers with scaled weights, loss-scaling hooks), which {now} cannot "
            "train. Pass a fresh model (build or load it again, or save_pretrained the prepared one and load it "
            "with from_pretrained), or keep the first strategy and its options"
        )
    return False


def refuse_without_strategy(args: Any, model: Any, trainer: str) -> None:
    """Refuse `model` for a `trainer` whose `args` name no precision strategy where a conversion bound FP8 layers
    or hooks to it (or to a module of it): a plain optimizer would not train it as it trains a model
    (fp8-lm-o2's FP8 layers hold FP16 masters scaled by 2^k, and their gradients go to the first
    strategy's optimizer: its GEMM weights never moved), and that strategy's hooks stay on it."""
    if getattr(args, "precision_strategy", None) is not None or not isinstance(model, torch.nn.Module):
        return  # (a model name the trainer loads, or None: `model_init`)
    for where, mark in _marks(model):
        if not mark.binds:
            continue  # a cast: a model as any other
        what = "this model" if where == "" else f"this model's module {where!r}"
        raise ValueError(
            f"{what} was prepared under precision strategy {mark.name!r}, and this {trainer} has no "
            "precision_strategy: its layers and hooks are that strategy's conversion (FP8 layers holding scaled "
            "FP16 master weights whose gradients go to that strategy's optimizer, loss-scaling hooks), which a "
            f"plain optimizer does not train. Pass precision_strategy={mark.name!r} (and the same precision_options) "
            "to this trainer, or save_pretrained the model and load it with from_pretrained into a fresh model"
        )


def _take_over(strategy: Any, earlier: Any, model: torch.nn.Module) -> None:
    # What a strategy binds anew for a new run (fp16-als's loss scaler: a fresh run's initial scale).
    rebind = getattr(strategy, "rebind_prepared", None)
    rebound = rebind(earlier, model) if rebind is not None else ()
    for attr in strategy.prepared_state:
        if attr not in rebound and hasattr(earlier, attr):  # (fp8_layout: only where layers were converted)
            setattr(strategy, attr, getattr(earlier, attr))
    if earlier.guard is not None:
        earlier.guard.detach()
    if strategy.guard is not None:
        strategy.guard.attach(model)
    mark_prepared(strategy, model)


def _not_cast(strategy: Any, param: torch.Tensor) -> bool:
    cast = param.dtype == strategy.param_dtype or kept_in_fp32(param)
    return param.requires_grad and param.is_floating_point() and not cast


def convert_added(strategy: Any, model: torch.nn.Module) -> torch.nn.Module:
    """`model`, which `strategy` prepared already, with what was added since (a LoRA adapter, a new head)
    converted: 16-bit parameters adopted where the strategy promises FP32 (`adopt`) and, where its
    conversion is a cast (`recasts`: the BF16 weights, fp16-als), the cast run again, which converts
    only the trainable parameters not yet in its dtype (and keeps their residuals for the optimizer,
    where they still hold more than the 16-bit value: PEFT casts a new adapter to its base layer's dtype)."""
    adopt_loaded_dtypes(strategy, model)
    if strategy.recasts and any(_not_cast(strategy, p) for p in model.parameters()):
        model = strategy.convert_model(model)
    return model


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_added_dtypes(strategy: Any, groups: list[dict[str, Any]], first_index: int = 0) -> None:
    """Refuse, before the optimizer is built or a group added, a trainable parameter that a strategy whose
    conversion is a cast (`recasts`) has not cast: one added after prepare_model. Under a strategy with
    FP32 parameters, a 16-bit one frozen at prepare_model and unfrozen since is made FP32 (`widen_unfrozen`).
    `first_index`: the index of the first of `groups` in the optimizer."""
    if not strategy.recasts:
        widen_unfrozen(strategy, groups, first_index)
        return
    wrong = [
        (g, i, p) for g, group in enumerate(groups) for i, p in enumerate(group["params"]) if _not_cast(strategy, p)
    ]
    if wrong:
        from ..report import PrecisionPromiseError

        group, index, param = wrong[0]
        raise PrecisionPromiseError(
            f"{sum(p.numel() for _, _, p in wrong):,} trainable parameter elements handed to the optimizer are not "
            f"{_name(strategy.param_dtype)} (e.g. parameter {index} of group {first_index + group}: {_name(param.dtype)}, "
            f"shape {tuple(param.shape)}), but precision strategy {strategy.name!r} promises "
            f"{_name(strategy.param_dtype)}: parameters added after prepare_model (a LoRA adapter, a new head) are "
            "not converted yet. Call strategy.prepare_model(model) again, which converts only what is new, or add "
            "the adapter/head before prepare_model / Trainer(...)"
        )
