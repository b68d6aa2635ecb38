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

__all__ = ["LossScaledStrategy", "refuse_unscaled_backward"]


def refuse_unscaled_backward(name: str, optimizer: torch.optim.Optimizer) -> None:
    """Raise where gradients reach the step with no backward through the loss scale since the last
    step: unscaling them would divide true gradients by the scale (and FP16 ones underflowed).
    None or zero gradients (`zero_grad(set_to_none=False)` and no backward) came from no backward;
    telling zeros apart reads them on the host, on such a step only."""
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if not any(bool((g.to_local() if hasattr(g, "to_local") else g).any()) for g in grads):
        return
    raise RuntimeError(
        f"{name} scales the loss, but these gradients came from a backward that did not go through "
        "the loss scale (a `loss.backward()` of its own): in a Trainer subclass's training_step call "
        "`self.accelerator.backward(loss)`; with Accelerate, `plugin.backward(accelerator, loss)`; "
        "in a custom loop, `strategy.scale_loss(loss).backward()` (or `strategy.train_step`)"
    )


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

    # Backwards through the loss scale so far, and that count at each optimizer's last step: an
    # optimizer stepping again with no scaled backward since got its gradients elsewhere.
    _scaled_backwards = 0
    _stepped_at: dict[int, int]

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        self._scaled_backwards += 1
        return self.scaler.scale(loss)

    def idle(self, optimizer: torch.optim.Optimizer) -> bool:
        """No backward through the loss scale since `optimizer`'s last step: its None or zero gradients
        step as they are, as stock's (weight decay, momentum), the scaler neither unscales nor updates
        (any other gradients are refused, `refuse_unscaled_backward`)."""
        stepped = getattr(self, "_stepped_at", {}).get(id(unwrap_optimizer(optimizer)), 0)
        if stepped != self._scaled_backwards:
            return False
        refuse_unscaled_backward(self.name, optimizer)
        return True

    def idle_flag(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """`process_gradients`' flag for an idle step: 0.0 (step), on the parameters' device."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return torch.zeros((), dtype=torch.float32, device=params[0].device if params else None)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        if self.idle(optimizer):
            return
        # The Trainer passes Accelerate's wrapper before clipping, the step passes the inner
        # optimizer: one optimizer, unscaled once. Its fused kernel leaves the gradients' version
        # counters as they were: a norm noted before no longer decides the step (`seen_norm`).
        self.scaler.unscale_(unwrap_optimizer(optimizer))
        self._clip_seen = None

    def clip_own_grad_norm(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return clip_grad_norm_(parameters, max_norm, norm_type)  # torch's FP16 norm overflows to inf

    def optimizer_step(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> Any:
        # A skipped step still closes the scaler's step (and lowers the scale), on the device; an idle one
        # (no scaled backward) leaves the scaler as it was.
        idle = self.idle(optimizer)
        result = step_unless(optimizer, found_inf)
        self.__dict__.setdefault("_stepped_at", {})[id(unwrap_optimizer(optimizer))] = self._scaled_backwards
        if not idle:
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
