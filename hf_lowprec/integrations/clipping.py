"""The Trainer's gradient norm under a strategy: its own clipping, else an FP32 norm of 16-bit gradients.

torch's clipping (what the Trainer's Accelerator calls) forms the norm in the gradients'
dtype: BF16 gradients (collage-plus, bf16-pure) gave a BF16 norm, 1.406250 where the FP32 one is
1.404943, and a BF16 clip coefficient (`scaling.narrow_grad_norm`). DeepSpeed and FSDP clip their own.
"""

from __future__ import annotations

from typing import Any

import torch

from ..scaling import narrow_grad_norm

__all__ = ["strategy_grad_norm"]


def strategy_grad_norm(trainer: Any, model: torch.nn.Module, max_norm: float) -> torch.Tensor | None:
    """Unscale the gradients and clip them to `max_norm` (inf: only measure); the pre-clip norm, or
    None to leave clipping to the Trainer's own (FP32 gradients, DeepSpeed, FSDP)."""
    strategy = trainer.precision
    strategy.unscale_gradients(trainer.optimizer)
    norm = strategy.clip_own_grad_norm(model.parameters(), max_norm)
    if (
        norm is not None
        or getattr(trainer, "is_deepspeed_enabled", False)
        or getattr(trainer, "is_fsdp_enabled", False)
    ):
        return norm
    return narrow_grad_norm(model.parameters(), max_norm)
