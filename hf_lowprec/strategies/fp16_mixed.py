"""Classic FP16 mixed precision (docs/algorithms.md §6): FP16 autocast, FP32 master weights, GradScaler.

What `transformers.TrainingArguments(fp16=True)` does on a GPU (on a CPU stock `fp16=True` trains in FP32,
where this strategy computes in FP16 autocast: docs/strategies/fp16.md), and the baseline ALS is measured against:
`torch.amp.GradScaler` skips every step whose gradients hold inf/NaN and halves its scale,
and doubles it after `growth_interval` clean steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from ..memory import unwrap_optimizer
from ..scaling import AgreeingGradScaler, check_loss_scale
from .baselines import device_autocast
from .fp16_base import LossScaledStrategy
from .interface import StrategyOptions
from .registry import register

__all__ = ["FP16Mixed", "FP16MixedOptions"]

# Above 2**24 a scaled gradient of 2**-8 already exceeds FP16's 65504: GradScaler would skip
# step after step, halving the scale each time, before training starts.
_MAX_INIT_SCALE = 2.0**24


@dataclasses.dataclass(frozen=True)
class FP16MixedOptions(StrategyOptions):
    """`torch.amp.GradScaler` settings (torch's defaults).

    Args:
        init_scale: starting loss scale.
        growth_interval: clean steps before the scale doubles.
    """

    init_scale: float = 2.0**16
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        super().__post_init__()
        check_loss_scale("init_scale", self.init_scale, high=_MAX_INIT_SCALE)
        if not (isinstance(self.growth_interval, int) and self.growth_interval >= 1):
            raise ValueError(f"growth_interval must be an integer >= 1, got {self.growth_interval!r}")


@register("fp16-mixed")
class FP16Mixed(LossScaledStrategy):
    """FP16 autocast, FP32 weights (masters) and AdamW states, torch's GradScaler — what `fp16=True` does on a GPU."""

    Options = FP16MixedOptions
    takes_user_optimizer = True
    support = dataclasses.replace(
        LossScaledStrategy.support,
        fsdp2=True,
        fsdp2_note=(
            "FP32 shards (the masters) and AdamW states; FP32 all-gather and reduce-scatter; the "
            "scaler's found-inf agreed by one all-reduce"
        ),
    )

    def __init__(self, name: str | None = None, **options: Any) -> None:
        super().__init__(name, **options)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.scaler = AgreeingGradScaler(
            device, init_scale=self.options.init_scale, growth_interval=self.options.growth_interval
        )
        self._unscaled = False

    def forward_context(self) -> contextlib.AbstractContextManager:
        return device_autocast(torch.float16)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        # GradScaler refuses a second unscale_ in one step; an idle step (no backward) has no update to close one.
        if not self._unscaled and not self.idle(optimizer):
            super().unscale_gradients(optimizer)
            self._unscaled = True

    def process_gradients(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        if self.idle(optimizer):
            return self.idle_flag(optimizer)
        found_inf = super().process_gradients(optimizer)
        self.scaler.share_found_inf(unwrap_optimizer(optimizer), found_inf)  # one decision for both
        return found_inf

    def end_step(self) -> None:
        # `process_gradients` already refused inf/NaN, which is all `GradScaler.step` checks,
        # so the step is the optimizer's own; GradScaler's update reads the flag of unscale_,
        # MAX-ed with the step's agreed one: the scale backs off on exactly the skipped steps.
        super().end_step()
        self._unscaled = False
