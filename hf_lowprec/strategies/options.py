"""The options every strategy accepts, and the check of their types.

A strategy's options are a frozen dataclass (`StrategyOptions` or a subclass). They often come
from a JSON string on the command line (`precision_options`), so each value is checked against
its declared type when the options are built: a wrong one fails before any work, naming the
option and what it should have been.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

import torch

from ..guard import guard_config

__all__ = ["StrategyOptions", "build_options"]


@dataclasses.dataclass(frozen=True)
class StrategyOptions:
    """Options every strategy accepts.

    Args:
        lost_arithmetic_metrics: compute imprecision % and EDQ on measured steps (costly: a
            copy of every parameter and its update in FP32 on those steps).
        save_full_precision: the Trainer saves the model as `full_precision_state_dict`, FP32
            weights holding what the optimizer holds (θ + δθ, masters), not the BF16 parameters.
        fused: how the optimizer step runs: "auto" (on CPU the native kernel where it is
            bit-identical, else the compiled step where torch.compile can build it, else the eager
            reference), "native" or "compiled" (require that path: an error names why it cannot
            run) or "reference" ("foreach" is its old name). Same results on CPU; see
            `optim.dispatch`.
        frozen_models: what the frozen models beside the trained one keep (TRL's reference,
            reward and teacher models): "forward" (what their forward computes with: the compute
            dtype, or FP8 blocks under the FP8 strategies; `integrations.frozen`) or "policy"
            (prepared like the trained model).
        rollout: how GRPO/RLOO decode their rollouts: "cached" (TRL's generation, KV cache) or
            "full_forward" (no KV cache: each token from a forward over the whole sequence so
            far, the training forward's numerics where they do not depend on later tokens;
            slower, quadratic in the completion length).
        guard: watch the run for low-precision failures and act: skip outlier steps, roll back,
            raise the precision of FP8 layers that flush their inputs (`hf_lowprec.guard`):
            false, true (defaults) or a dict of `guard.GuardConfig`'s thresholds.
    """

    lost_arithmetic_metrics: bool = False
    save_full_precision: bool = False
    fused: Literal["auto", "native", "compiled", "reference", "foreach"] = "auto"
    frozen_models: Literal["forward", "policy"] = "forward"
    rollout: Literal["cached", "full_forward"] = "cached"
    guard: bool | dict = False

    def __post_init__(self) -> None:
        # Options often come from a JSON string on the command line: check every value against
        # its declared type here, so a wrong one fails before any work with the option's name.
        hints = typing.get_type_hints(type(self))
        for field in dataclasses.fields(self):
            problem = _option_type_problem(getattr(self, field.name), hints.get(field.name))
            if problem is not None:
                got = repr(getattr(self, field.name))
                got = got if len(got) <= 60 else got[:57] + "..."
                raise ValueError(f"option {field.name!r} must be {problem}, got {got}")
        guard_config(self.guard)  # a wrong threshold fails here, naming it

    def unread_options(self) -> dict[str, str]:
        """The options this combination never reads, each with why and the fix: given explicitly
        they are refused (`build_options`); their defaults stay legal."""
        return {}


def build_options(
    name: str, options_cls: type[StrategyOptions], given: dict[str, Any], preset: dict[str, Any]
) -> StrategyOptions:
    """`options_cls` built from `given` (the `preset` of the registered name included) for strategy `name`.

    ValueError before any work for an unknown option (listing those the user may set: not the
    preset ones, not those the combination never reads) and for one the user gave that the
    combination never reads (`StrategyOptions.unread_options`), naming it and why.
    """
    fields = {f.name for f in dataclasses.fields(options_cls)}
    unknown = sorted(set(given) - fields)
    if unknown:
        try:
            unread = options_cls(**{k: v for k, v in given.items() if k in fields}).unread_options()
        except ValueError:  # a bad known value too: list what the name's defaults read
            unread = options_cls(**preset).unread_options()
        settable = sorted(fields - set(preset) - set(unread))
        raise ValueError(f"precision strategy {name!r} has no option(s) {unknown}; valid options: {settable or 'none'}")
    options = options_cls(**given)
    ignored = {k: why for k, why in options.unread_options().items() if k in given and k not in preset}
    if ignored:
        raise ValueError(
            f"precision strategy {name!r} never reads option(s) {sorted(ignored)} as configured: "
            + "; ".join(ignored[k] for k in sorted(ignored))
        )
    return options


# Integer options end up in torch (seeds, counters, intervals): they must fit an int64.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# Number options become scales and thresholds in FP32 tensors: beyond this they overflow.
_FP32_MAX = torch.finfo(torch.float32).max


def _option_type_problem(value: Any, expected: Any) -> str | None:
    """What `value` should have been to match the annotation `expected`, or None when it matches."""
    if typing.get_origin(expected) in (typing.Union, types.UnionType) and type(None) in typing.get_args(expected):
        others = [t for t in typing.get_args(expected) if t is not type(None)]  # `X | None`: None, or an X
        problem = None if value is None or len(others) != 1 else _option_type_problem(value, others[0])
        return problem if problem is None else f"{problem} or null"
    if expected is bool:
        return None if isinstance(value, bool) else "true or false"
    if expected is int:
        if isinstance(value, int) and not isinstance(value, bool) and _INT64_MIN <= value <= _INT64_MAX:
            return None
        return "an integer that fits in 64 bits (-2**63 to 2**63 - 1)"
    if expected is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                if abs(float(value)) <= _FP32_MAX:
                    return None
            except OverflowError:
                pass
        return f"a finite number within the FP32 range (|x| <= {_FP32_MAX:.4g})"
    if expected is str:
        return None if isinstance(value, str) else "a string"
    if typing.get_origin(expected) is typing.Literal:
        choices = typing.get_args(expected)
        return None if isinstance(value, str) and value in choices else f"one of {list(choices)}"
    return None  # other annotations (unions, containers) are the subclass's to check
