"""What the FP16 strategies share: a loss scaler with `torch.amp.GradScaler`'s API driven through the hooks.

`scaler` is a `torch.amp.GradScaler` (fp16-mixed) or a `hf_lowprec.scaling.AutomaticLossScaler`
(fp16-als); a subclass builds it and, where it differs from the base check, says in
`process_gradients` which gradients it refuses to step on (a device flag, as everywhere).
"""

from __future__ import annotations

from typing import Any

import torch

from ..memory import unwrap_optimizer
from ..scaling import clip_grad_norm_, step_unless
from .interface import PrecisionStrategy
from .support import EngineSupport

__all__ = ["LossScaledStrategy"]


class LossScaledStrategy(PrecisionStrategy):
    """FP16 compute with a loss scaler; its state rides in the checkpoint under "loss_scaler"."""

    compute_dtype = torch.float16
    support = EngineSupport(
        zero_refusal=(
            "DeepSpeed's FP16 engine brings its own loss scaler and FP32 masters, and its CPU accelerator "
            "has no FP16 at all; for ZeRO pick a BF16 strategy (bf16-mixed, collage-plus)"
        )
    )
    scaler: Any

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        # The Trainer passes Accelerate's wrapper before clipping, the step passes the inner
        # optimizer: one optimizer, unscaled once. Its fused kernel leaves the gradients' version
        # counters as they were: a norm noted before no longer decides the step (`seen_norm`).
        self.scaler.unscale_(unwrap_optimizer(optimizer))
        self._clip_seen = None

    def clip_own_grad_norm(self, parameters: Any, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_(parameters, max_norm)  # torch's FP16 norm overflows to inf

    def optimizer_step(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> Any:
        # A skipped step still closes the scaler's step (and lowers the scale), on the device.
        result = step_unless(optimizer, found_inf)
        self.end_step()
        return result

    def end_step(self) -> None:
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "loss_scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])

    def metrics(self) -> dict[str, float]:
        return {**super().metrics(), "precision/loss_scale": float(self.scaler.get_scale())}  # a sync: logging only
