"""The strategy's loss scale in a Trainer: hooked on the loss `compute_loss` returns (the logged
loss stays the true loss), or applied at `accelerator.backward` to a loss no hook scaled, for a
subclass whose `compute_loss` does not call the base class's (transformers' own override pattern).
"""

from __future__ import annotations

from typing import Any

import torch

from ..strategies.interface import PrecisionStrategy

__all__ = ["hook_loss_scale", "scale_unhooked_losses"]

_SCALED_FLAG = "_hf_lowprec_loss_hooked"  # set by the hook's registration, taken by the next backward


def _scales_loss(strategy: Any) -> bool:
    return strategy is not None and type(strategy).scale_loss is not PrecisionStrategy.scale_loss


def _accumulation(trainer: Any) -> int:
    return int(getattr(trainer, "current_gradient_accumulation_steps", trainer.args.gradient_accumulation_steps))


def hook_loss_scale(trainer: Any, result: Any) -> Any:
    """`compute_loss`'s `result` with the strategy's scale hooked on its loss (a loss that trains).

    Scaling the gradient that leaves the loss equals scaling the loss; training_step divides it by
    the accumulation steps afterwards. A 16-bit loss (an FP16 model without autocast) is widened
    first: its scaled gradient is an FP32 tensor."""
    loss = result[0] if isinstance(result, tuple) else result
    if not (_scales_loss(trainer.precision) and torch.is_tensor(loss) and loss.requires_grad):
        return result
    if loss.dtype in (torch.float16, torch.bfloat16):
        loss = loss.float()
        result = (loss, *result[1:]) if isinstance(result, tuple) else loss
    trainer.precision.set_gradient_accumulation(_accumulation(trainer))
    loss.register_hook(trainer.precision.scale_loss)
    setattr(trainer, _SCALED_FLAG, True)
    return result


def scale_unhooked_losses(trainer: Any) -> None:
    """Make `trainer.accelerator.backward` scale a loss that `hook_loss_scale` did not see (once per
    Accelerator: hyperparameter search builds a new one)."""
    accelerator = trainer.accelerator
    if not _scales_loss(trainer.precision) or getattr(accelerator.backward, "hf_lowprec_scaling", False):
        return
    backward = accelerator.backward

    def scaled_backward(loss: torch.Tensor, **kwargs: Any) -> Any:
        if trainer.__dict__.pop(_SCALED_FLAG, False) or not _scales_loss(trainer.precision):
            return backward(loss, **kwargs)
        trainer.precision.set_gradient_accumulation(_accumulation(trainer))
        widened = loss.float() if loss.dtype in (torch.float16, torch.bfloat16) else loss
        return backward(trainer.precision.scale_loss(widened), **kwargs)

    scaled_backward.hf_lowprec_scaling = True  # type: ignore[attr-defined]
    accelerator.backward = scaled_backward
