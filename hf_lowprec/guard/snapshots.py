"""The guard's in-memory snapshot: every parameter and buffer of the model, the optimizer's state
and the strategy's scales, copied on the device, and put back by a rollback."""

from __future__ import annotations

from typing import Any

import torch

from ..memory import unwrap_optimizer

__all__ = ["restore_snapshot", "take_snapshot"]


def take_snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, strategy: Any) -> dict[str, Any]:
    """Copies of every parameter and buffer, the optimizer state and the strategy's scales (device
    to device; the host waits only for the strategy's counters). Memory: one more copy of the
    model's trainable state, the strategy's model-state bytes (`hf-lowprec memory`)."""
    tensors = {n: t.detach().clone() for n, t in _named_tensors(model)}
    state = {}
    if optimizer is not None:
        state = {
            id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for p, s in optimizer.state.items()
        }
    scales = {k: v for k, v in strategy.state_dict().items() if k not in ("skipped_steps", "guard")}
    return {"tensors": tensors, "optimizer": state, "strategy": scales}


def restore_snapshot(
    snapshot: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, strategy: Any
) -> None:
    """Put `take_snapshot`'s copies back, in place."""
    with torch.no_grad():
        for name, tensor in _named_tensors(model):
            saved = snapshot["tensors"].get(name)
            if saved is not None and saved.shape == tensor.shape:
                tensor.copy_(saved)
        if optimizer is not None:
            for p, s in optimizer.state.items():
                for k, v in snapshot["optimizer"].get(id(p), {}).items():
                    if torch.is_tensor(v) and torch.is_tensor(s.get(k)):
                        s[k].copy_(v)
                    else:
                        s[k] = v
            # The weights and the state that completes them (δθ, the masters) are back together.
            watch = getattr(unwrap_optimizer(optimizer), "watch_parameter_values", None)
            if watch is not None:
                watch()
    strategy.load_state_dict({**strategy.state_dict(), **snapshot["strategy"]})


def _named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    out = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        out.append((name, t))
    return out
