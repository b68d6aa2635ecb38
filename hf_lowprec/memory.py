"""Model-state memory, counted from live tensor storage."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["model_state_bytes", "unwrap_optimizer"]

# State keys of optimizers that do not declare `state_roles` (e.g. torch.optim.AdamW).
_DEFAULT_ROLES = {"exp_avg": "optimizer", "exp_avg_sq": "optimizer", "momentum_buffer": "optimizer",
                  "max_exp_avg_sq": "optimizer", "step": "extra"}


def unwrap_optimizer(optimizer: Any) -> Any:
    """The innermost optimizer under Accelerate's and the strategy's wrappers."""
    while hasattr(optimizer, "optimizer") and not isinstance(getattr(optimizer, "optimizer"), str):
        optimizer = optimizer.optimizer
    return optimizer


def model_state_bytes(model: torch.nn.Module, optimizer: Any | None = None) -> dict[str, float]:
    """Bytes per trainable parameter held by parameters, gradients, optimizer states and extras.

    Each storage is counted once (tied weights, views). Gradients are counted from `p.grad`
    when present, otherwise as one element of the parameter's dtype (what backward will
    allocate), plus any optimizer state whose role is "gradient" (e.g. FP8 gradients kept
    by the optimizer instead of `p.grad`). Extras are MCF error components, master weights,
    scales and step counters.

    Returns:
        dict with keys "params", "grads", "optimizer_states", "extra", "total" (bytes per
        parameter) and "num_params".
    """
    seen: set[tuple[str, int]] = set()

    def nbytes(t: torch.Tensor) -> int:
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if storage.data_ptr() != 0 and key in seen:
            return 0
        seen.add(key)
        return storage.nbytes()

    trainable = [p for p in model.parameters() if p.requires_grad]
    unique: dict[int, torch.Tensor] = {}
    for p in trainable:
        unique.setdefault(p.untyped_storage().data_ptr(), p)
    num_params = sum(p.numel() for p in unique.values())
    if num_params == 0:
        raise ValueError("the model has no trainable parameters")

    totals = {"params": 0, "grads": 0, "optimizer_states": 0, "extra": 0}
    for p in unique.values():
        totals["params"] += nbytes(p)
    inner = unwrap_optimizer(optimizer) if optimizer is not None else None
    roles = dict(_DEFAULT_ROLES)
    roles.update(getattr(inner, "state_roles", {}) or {})
    grad_in_state: set[int] = set()
    if inner is not None:
        for param, state in inner.state.items():
            for key, value in state.items():
                if not torch.is_tensor(value):
                    continue
                role = roles.get(key, "extra")
                bucket = {"optimizer": "optimizer_states", "gradient": "grads"}.get(role, "extra")
                totals[bucket] += nbytes(value)
                if role == "gradient":
                    grad_in_state.add(id(param))
    for p in unique.values():
        if p.grad is not None:
            totals["grads"] += nbytes(p.grad)
        elif id(p) not in grad_in_state:
            totals["grads"] += p.numel() * p.element_size()
    out = {k: v / num_params for k, v in totals.items()}
    out["total"] = sum(out.values())
    out["num_params"] = float(num_params)
    return out
