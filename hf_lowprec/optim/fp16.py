"""AdamW for FP16 (or BF16) weights with FP32 moments, as Graphcore trains in FP16 (ALGORITHMS.md §5).

| optimizer                    | states | weight written as                        | bytes/param (FP16) |
|------------------------------|--------|------------------------------------------|--------------------|
| `MasterWeightAdamW`          | FP32   | copy of an FP32 master θ₃₂ ← θ₃₂ + Δθ    | 16                 |
| `FP32StatesSRAdamW`          | FP32   | θ ← SR(θ + Δθ), no master                | 12                 |

Both reuse the other AdamW variants' arithmetic: the master update is `FP32StatesAdamW`'s step
applied to the master, the stochastic rounding is `StochasticRoundingAdamW`'s.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from .bf16 import FP32StatesAdamW, StochasticRoundingAdamW

__all__ = ["FP32StatesSRAdamW", "MasterWeightAdamW"]


class MasterWeightAdamW(FP32StatesAdamW):
    """Low-precision weights with an FP32 master copy and FP32 moments (classic mixed precision).

    `FP32StatesAdamW`'s step applied to the FP32 master θ₃₂ (so Δθ, its weight decay and the
    sum θ₃₂ + Δθ are FP32), after which the model's weight is θ₃₂ rounded to nearest. Nothing
    is lost at the weight: the master keeps what FP16 cannot hold.

    State: `exp_avg`, `exp_avg_sq`, `master` (FP32); `step` (int).
    """

    state_roles: ClassVar[dict[str, str]] = {"exp_avg": "optimizer", "exp_avg_sq": "optimizer", "master": "extra"}

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        return {**super()._init_state(param, group), "master": param.detach().to(torch.float32, copy=True)}

    def _update_bucket(self, group, params, grads, states, steps, updates_out) -> None:
        masters = [s["master"] for s in states]
        super()._update_bucket(group, masters, grads, states, steps, updates_out)
        torch._foreach_copy_(params, masters)


class FP32StatesSRAdamW(StochasticRoundingAdamW):
    """`StochasticRoundingAdamW` with FP32 moments: θ ← SR(θ + Δθ), m and v in FP32.

    In FP16, v ≈ g² of gradients near 1e-3 sits at FP16's subnormal floor; FP32 moments keep
    it (the ALS post keeps optimizer states in FP32). 12 bytes/param for FP16 weights.

    State: `exp_avg`, `exp_avg_sq` (FP32); `step` (int); the generator state in `state_dict()`.
    """

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        return FP32StatesAdamW._init_state(self, param, group)
