"""Collage (multi-component float BF16 AdamW) and the BF16 compensation baselines (ALGORITHMS.md §2).

Every strategy here trains a BF16 model with BF16 gradients; they differ only in the update
rule, i.e. in the optimizer they build:

| name | update | bytes/param |
|---|---|---|
| collage-light | Collage Alg. 2, (θ, δθ) via Grow | 10 |
| collage-plus | + β2 as an expansion and (v, δv) | 12 |
| bf16-kahan | Kahan-compensated update | 10 |
| bf16-sr | update stochastically rounded into BF16 | 8 |
| bf16-fp32states | option D−MW: FP32 moments, no master weights | 12 |
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch

from ..optim import CollageAdamW, FP32StatesAdamW, KahanAdamW, StochasticRoundingAdamW
from ..registry import register
from .base import StrategyOptions
from .baselines import BF16Pure

__all__ = ["BF16Update", "BF16UpdateOptions"]

Update = Literal["collage-light", "collage-plus", "kahan", "sr", "fp32-states"]

# update → (optimizer factory, model-state bytes/param)
_UPDATES: dict[str, tuple[Any, float]] = {
    "collage-light": (lambda groups, o, **h: CollageAdamW(groups, variant="light", **h), 10.0),
    "collage-plus": (lambda groups, o, **h: CollageAdamW(groups, variant="plus", **h), 12.0),
    "kahan": (lambda groups, o, **h: KahanAdamW(groups, **h), 10.0),
    "sr": (lambda groups, o, **h: StochasticRoundingAdamW(groups, seed=o.seed, **h), 8.0),
    "fp32-states": (lambda groups, o, **h: FP32StatesAdamW(groups, **h), 12.0),
}


@dataclasses.dataclass(frozen=True)
class BF16UpdateOptions(StrategyOptions):
    """Options of the BF16 update family.

    Args:
        update: the update rule; fixed by the registered name.
        seed: seed of the stochastic-rounding generator (bf16-sr only; its state is checkpointed).
    """

    update: Update = "collage-plus"
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.update not in _UPDATES:
            raise ValueError(f"update must be one of {sorted(_UPDATES)}, got {self.update!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")


@register("bf16-fp32states", update="fp32-states",
          summary="option D−MW: BF16 weights, FP32 AdamW states, no master weights")
@register("bf16-sr", update="sr", summary="BF16 AdamW whose update is stochastically rounded into the BF16 weights")
@register("bf16-kahan", update="kahan", summary="BF16 AdamW with a Kahan-compensated weight update")
@register("collage-plus", update="collage-plus",
          summary="Collage (option C): + second moment as an MCF (v, δv), β2 as an expansion")
@register("collage-light", update="collage-light",
          summary="Collage (option B): BF16 everything, weights as a 2-component MCF (θ, δθ) updated by Grow")
class BF16Update(BF16Pure):
    """A BF16 model whose optimizer compensates (or not) for BF16's lost arithmetic."""

    Options = BF16UpdateOptions

    @property
    def bytes_per_param(self) -> float:  # type: ignore[override]
        return _UPDATES[self.options.update][1]

    def build_optimizer(self, param_groups: list[dict[str, Any]], **hyper: Any) -> torch.optim.Optimizer:
        factory, _ = _UPDATES[self.options.update]
        return factory(param_groups, self.options, **hyper)
