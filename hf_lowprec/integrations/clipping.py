"""Gradient norms under a strategy: the strategy's own clipping, else an FP32 norm of 16-bit gradients.

torch's `clip_grad_norm_` (what the Trainer's Accelerator calls) forms the norm in the gradients'
dtype: BF16 gradients (collage-plus, bf16-pure) gave a BF16 norm, 1.406250 where the FP32 one is
1.404943, and a BF16 clip coefficient. `scaling.clip_grad_norm_` accumulates the per-tensor norms
in FP32 in one multi-tensor launch. DeepSpeed and FSDP keep their own clipping.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..distributed import DTensor
from ..scaling import clip_grad_norm_

__all__ = ["narrow_grad_norm", "strategy_grad_norm"]


def narrow_grad_norm(parameters: list[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
    """Clip to `max_norm` with an FP32 norm (`scaling.clip_grad_norm_`) where some gradient is FP16
    or BF16 and none is a shard (DTensor), norm_type 2 or inf; the pre-clip norm, else None."""
    grads = [p.grad for p in parameters if p.grad is not None]
    narrow = any(g.dtype in (torch.float16, torch.bfloat16) for g in grads)
    if not narrow or any(isinstance(g, DTensor) for g in grads) or float(norm_type) not in (2.0, math.inf):
        return None
    return clip_grad_norm_(parameters, max_norm, norm_type)


def strategy_grad_norm(trainer: Any, model: torch.nn.Module, max_norm: float) -> torch.Tensor | None:
    """The Trainer's: unscale the gradients and clip them to `max_norm` (inf: only measure); the
    pre-clip norm, or None to leave clipping to the Trainer's own (FP32 gradients, DeepSpeed, FSDP)."""
    strategy = trainer.precision
    strategy.unscale_gradients(trainer.optimizer)
    norm = strategy.clip_own_grad_norm(model.parameters(), max_norm)
    if (
        norm is not None
        or getattr(trainer, "is_deepspeed_enabled", False)
        or getattr(trainer, "is_fsdp_enabled", False)
    ):
        return norm
    return narrow_grad_norm(list(model.parameters()), max_norm)
