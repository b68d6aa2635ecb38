"""COAT: FP8 optimizer states and FP8 activations for memory-efficient FP8 training (docs/algorithms.md §4;
docs/strategies/coat.md). The strategy combines FP8-LM's FP8 GEMMs (`convert_to_fp8`), COAT's FP8
saved activations (`compress_activations`) and its optimizer (`COATAdamW`; with states=False,
`PlainAdamW`, or Collage-light's `CollageAdamW` for BF16 weights), under BF16 autocast as COAT's
BF16 baseline runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Literal

import torch

from ..coat.activations import compress_activations
from ..fp8 import convert_to_fp8
from ..optim import COATAdamW, CollageAdamW, PlainAdamW
from .baselines import bf16_autocast
from .casting import cast_model
from .fp8_rule import RULE_OPTIONS, FP8RuleOptions, converted_layout
from .interface import PrecisionStrategy
from .registry import register
from .support import EngineSupport

__all__ = ["COAT", "COATOptions"]

# FP32 (scale, k, c) per group of each of the two moments, in bytes per element: 0.19 per
# parameter with groups of 128 (plus the padding of tensors whose size is not a multiple of the
# group). Model-state bytes/param, weight + gradient + states:
#   master_weights   states=True                        states=False
#   fp32             4 + 4 + 1 + 1 + 0.19 = 10.19       16
#   bf16-collage     2 + 2 + 2 + 1 + 1 + 0.19 = 8.19   10
_METADATA_BYTES = 2 * 12


@dataclasses.dataclass(frozen=True)
class COATOptions(FP8RuleOptions):
    """Options of the `coat` strategy; each piece can be switched on its own.

    Args:
        activations: FP8 linear layers (FP8-LM) and FP8 saved activations (COAT).
        states: FP8 optimizer states (COATAdamW); False keeps AdamW states in the master dtype.
        master_weights: "fp32" (COAT) or "bf16-collage" (BF16 weights + Collage-light δθ).
        exp_avg_sq_format: FP8 format of the second moment, "e4m3" (COAT) or "e5m2".
        expand: dynamic range expansion of the states; False is plain per-group FP8.
        group_size: elements per optimizer-state group (COAT: 128).

    With `fp8_layers`, `fp8_gpu` and `fp8_tokens`: which layers FP8 pays for (`FP8RuleOptions`); a
    layer kept in BF16 keeps its activations in BF16 too, and FP8 states for its weights.
    """

    activations: bool = True
    states: bool = True
    master_weights: Literal["fp32", "bf16-collage"] = "fp32"
    exp_avg_sq_format: Literal["e4m3", "e5m2"] = "e4m3"
    expand: bool = True
    group_size: int = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.master_weights not in ("fp32", "bf16-collage"):
            raise ValueError(f"master_weights must be 'fp32' or 'bf16-collage', got {self.master_weights!r}")
        if self.exp_avg_sq_format not in ("e4m3", "e5m2"):
            raise ValueError(f"exp_avg_sq_format must be 'e4m3' or 'e5m2', got {self.exp_avg_sq_format!r}")
        size = self.group_size
        # Every state tensor is padded to a multiple of the group: beyond 2**16 elements a group
        # only wastes memory (and a huge value would allocate it before the first step).
        if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= 2**16:
            raise ValueError(f"group_size must be an integer in [1, 65536], got {size!r} (COAT uses 128)")
        if not (self.activations or self.states):
            raise ValueError("coat with activations=False and states=False is plain training; enable a piece")

    def unread_options(self) -> dict[str, str]:
        unread = super().unread_options()
        if not self.activations:
            for key in RULE_OPTIONS:
                unread[key] = (
                    f"{key} picks the layers activations=True converts to FP8, and activations=False converts "
                    f"none: drop {key} (or pass activations=True)"
                )
        if not self.states:
            for key in ("exp_avg_sq_format", "expand", "group_size"):
                unread[key] = (
                    f"{key} shapes the FP8 optimizer states of states=True, and states=False keeps AdamW states "
                    f"in the master dtype: drop {key} (or pass states=True)"
                )
        return unread


@register("coat")
class COAT(PrecisionStrategy):
    """FP8 GEMMs and FP8 saved activations (mixed granularity), FP8 AdamW states with dynamic range expansion."""

    Options = COATOptions
    resume_safe_options = PrecisionStrategy.resume_safe_options | RULE_OPTIONS
    prepared_state = ("fp8_layout",)
    support = EngineSupport(
        fsdp2=True,
        fsdp2_note=(
            "FP32 (or BF16 + δθ) shards; per-group FP8 moments laid out per shard (groups padded per "
            "shard: the one-process groups wherever a shard ends on a group boundary); FP8 weight "
            "scales from the gathered weight; FP32 (BF16) all-gather, FP32 reduce-scatter"
        ),
        zero_stages=(1, 2, 3),
        zero_note=(
            "per-group (128) FP8 moments over each rank's flat partition (FP32, or BF16 + δθ): groups follow "
            "the partition, so a group may span two parameters' elements"
        ),
    )

    @property
    def bf16_master(self) -> bool:
        return self.options.master_weights == "bf16-collage"

    @property
    def param_dtype(self) -> torch.dtype:  # type: ignore[override]
        return torch.bfloat16 if self.bf16_master else torch.float32

    @property
    def compute_dtype(self) -> torch.dtype:  # type: ignore[override]
        return torch.bfloat16

    @property
    def bytes_per_param(self) -> float:  # type: ignore[override]
        weight = self.param_dtype.itemsize
        compensation = 2.0 if self.bf16_master else 0.0
        states = 2.0 + _METADATA_BYTES / self.options.group_size if self.options.states else 2.0 * weight
        return 2.0 * weight + compensation + states

    @property
    def frozen_in_fp8(self) -> bool:  # the FP8 GEMMs come with the FP8 activations
        return bool(self.options.activations)

    def convert_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.bf16_master:
            model = cast_model(model, torch.bfloat16)
        if self.options.activations:
            compress_activations(convert_to_fp8(model, rule=self.options.layer_rule(model)))
            self.fp8_layout = converted_layout(self, model)
        return model

    def build_optimizer(self, param_groups: list[dict[str, Any]], **hyper: Any) -> torch.optim.Optimizer:
        if self.options.states:
            o = self.options
            return COATAdamW(
                param_groups,
                **hyper,
                group_size=o.group_size,
                exp_avg_sq_format=o.exp_avg_sq_format,
                expand=o.expand,
                fused=o.fused,
            )
        if self.bf16_master:
            return CollageAdamW(param_groups, **hyper, variant="light", fused=self.options.fused)
        return PlainAdamW(param_groups, **hyper, fused=self.options.fused)

    def forward_context(self) -> contextlib.AbstractContextManager:
        return bf16_autocast()
