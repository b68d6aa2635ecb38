"""TR-DPO's reference sync (`sync_ref_model=True`) under a strategy. TRL's callback mixes each of
the policy's parameters, as stored, into the reference: under fp8-lm-o2 that storage is the FP16
master times its power-of-two scale (2¹⁹ and more), under Collage θ without its δθ. The sync here
mixes the weights the strategy's optimizer holds (`full_precision_value`: master ÷ scale, θ + δθ),
one parameter at a time, as `full_precision_state_dict` exports them.
"""

from __future__ import annotations

from typing import Any

import torch
from trl.trainer.callbacks import SyncRefModelCallback

from ..memory import unwrap_optimizer
from ..strategies.interface import PrecisionStrategy
from .frozen import FROZEN_ATTR

__all__ = ["check_sync", "sync_in_full_precision"]


def check_sync(strategy: PrecisionStrategy, reference: Any) -> None:
    """Before any work: a reference the sync can mix into, under a strategy whose weights it can read."""
    if type(strategy).full_precision_state_dict is not PrecisionStrategy.full_precision_state_dict:
        raise ValueError(
            f"sync_ref_model=True with precision_strategy={strategy.name!r}: its weights live with the ranks "
            "that own them (a collective export), and TRL's sync mixes them into the reference on every rank "
            "apart. Use fp8-lm-o2 (or another strategy) for TR-DPO, or drop sync_ref_model"
        )
    facts = getattr(reference, "__dict__", {}).get(FROZEN_ATTR)
    if facts is not None:
        raise ValueError(
            f"sync_ref_model=True mixes the policy's weights into the reference, but the reference passed was "
            f"frozen already by precision_strategy={facts.get('strategy')!r} (storage: {facts['storage']}), "
            "which the mix cannot update. Pass this trainer a fresh copy of the model (load it again, or "
            "copy.deepcopy it before the first trainer)"
        )


@torch.no_grad()
def _mix(policy: torch.nn.Module, optimizer: Any, reference: torch.nn.Module, alpha: float) -> None:
    inner = unwrap_optimizer(optimizer)
    full_value = getattr(inner, "full_precision_value", None)
    updated = {id(p) for g in inner.param_groups for p in g["params"]} if full_value is not None else set()
    policy_params = dict(policy.named_parameters())
    for name, target in reference.named_parameters():
        source = policy_params[name]
        value = full_value(source) if id(source) in updated else source.detach()
        target.data.mul_(1.0 - alpha).add_(value.to(target.dtype), alpha=alpha)


class _FullPrecisionSync(SyncRefModelCallback):
    """TRL's callback, mixing the optimizer's full-precision weights (one process or DDP; under
    DeepSpeed the module's parameters are DeepSpeed's copies, mixed as TRL mixes them)."""

    def on_step_end(self, args, state, control, **kwargs):
        if self.ref_model is None or state.global_step % args.ref_model_sync_steps != 0:
            return
        model = kwargs["model"]
        if self.accelerator is not None:
            model = self.accelerator.unwrap_model(model)
        if getattr(self.accelerator, "deepspeed_plugin", None) is not None:
            return self.sync_target_model(model, self.ref_model, args.ref_model_mixup_alpha)
        _mix(model, kwargs["optimizer"], self.ref_model, args.ref_model_mixup_alpha)


def sync_in_full_precision(trainer: Any) -> None:
    """Swap the trainer's TRL sync callback (added in its `__init__`) for the full-precision one."""
    handler = trainer.callback_handler
    for index, callback in enumerate(handler.callbacks):
        if type(callback) is SyncRefModelCallback:
            handler.callbacks[index] = _FullPrecisionSync(
                ref_model=callback.ref_model, accelerator=callback.accelerator
            )
