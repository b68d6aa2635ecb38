"""The strategy's loss scale in a Trainer: applied where the Trainer's `training_step` runs the
backward, `accelerator.backward(loss)`, as the stock Trainer applies its GradScaler's. Whatever
computed the loss (the base class's `compute_loss`, a subclass's own, TRL's), the logged loss stays
the true loss, and each backward is scaled once.
"""

from __future__ import annotations

from typing import Any

import torch

from ..strategies.interface import PrecisionStrategy

__all__ = ["scale_at_backward", "scales_loss"]


def scales_loss(strategy: Any) -> bool:
    """Whether `strategy` (None: no strategy) scales the loss."""
    return strategy is not None and type(strategy).scale_loss is not PrecisionStrategy.scale_loss


def scale_at_backward(trainer: Any) -> None:
    """Make `trainer.accelerator.backward` scale the loss by `trainer.precision` (once per Accelerator:
    hyperparameter search builds a new one; a wrapper already marked, PPO's, is kept).

    A 16-bit loss (an FP16 model without autocast) is widened first: its scaled gradient is an FP32
    tensor. The gradient-accumulation count the strategy divides by is the Trainer's current one."""
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is None or getattr(accelerator.backward, "hf_lowprec_scaling", False):
        return
    backward = accelerator.backward

    def scaled_backward(loss: torch.Tensor, **kwargs: Any) -> Any:
        precision = getattr(trainer, "precision", None)
        if not scales_loss(precision) or not (torch.is_tensor(loss) and loss.requires_grad):
            return backward(loss, **kwargs)
        steps = getattr(trainer, "current_gradient_accumulation_steps", trainer.args.gradient_accumulation_steps)
        precision.set_gradient_accumulation(int(steps))
        widened = loss.float() if loss.dtype in (torch.float16, torch.bfloat16) else loss
        return backward(precision.scale_loss(widened), **kwargs)

    scaled_backward.hf_lowprec_scaling = True  # type: ignore[attr-defined]
    accelerator.backward = scaled_backward
