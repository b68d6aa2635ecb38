"""Model-state memory, counted from live tensor storage."""

from __future__ import annotations

import bisect
from typing import Any

import torch

__all__ = ["model_state_bytes", "unwrap_optimizer"]

# State keys of optimizers that do not declare `state_roles` (e.g. torch.optim.AdamW).
_DEFAULT_ROLES = {
    "exp_avg": "optimizer",
    "exp_avg_sq": "optimizer",
    "momentum_buffer": "optimizer",
    "max_exp_avg_sq": "optimizer",
    "step": "extra",
}


def unwrap_optimizer(optimizer: Any) -> Any:
    """The innermost optimizer under Accelerate's and the strategy's wrappers."""
    while hasattr(optimizer, "optimizer") and not isinstance(optimizer.optimizer, str):
        optimizer = optimizer.optimizer
    return optimizer


class _Coverage:
    """Bytes of storage covered by tensors, each byte counted once across all calls.

    A tensor covers the byte range of its storage from its first to its last element
    (views of one flat buffer cover disjoint ranges; a slice covers only its rows; tied
    weights cover the same range once).
    """

    def __init__(self) -> None:
        self._ranges: dict[tuple[str, int], list[tuple[int, int]]] = {}

    def claim(self, t: torch.Tensor) -> int:
        """Bytes of `t` not covered by an earlier call."""
        if t.numel() == 0:
            return 0
        size = t.element_size()
        start = t.storage_offset() * size
        extent = 1 + sum((n - 1) * abs(stride) for n, stride in zip(t.shape, t.stride()))
        end = start + extent * size
        pointer = t.untyped_storage().data_ptr()
        if pointer == 0:  # no storage to share (e.g. a meta tensor)
            return end - start
        ranges = self._ranges.setdefault((str(t.device), pointer), [])
        index = bisect.bisect_left(ranges, (start, start))
        first = index - 1 if index > 0 and ranges[index - 1][1] >= start else index
        last = first
        covered = 0
        new_start, new_end = start, end
        while last < len(ranges) and ranges[last][0] <= end:
            lo, hi = ranges[last]
            covered += max(0, min(hi, end) - max(lo, start))
            new_start, new_end = min(new_start, lo), max(new_end, hi)
            last += 1
        ranges[first:last] = [(new_start, new_end)]
        return (end - start) - covered


def model_state_bytes(model: torch.nn.Module, optimizer: Any | None = None) -> dict[str, float]:
    """Bytes per trainable parameter held by parameters, gradients, optimizer states and extras.

    Parameters are counted by their number of elements; memory by the storage bytes the
    tensors cover, each byte once (tied weights, parameters that are views of one flat
    buffer, ZeRO partitions; a slice counts its own rows, not the whole buffer). Gradients
    are counted from `p.grad` when present, otherwise as one element of the parameter's
    dtype (what backward will allocate), plus any optimizer state whose role is "gradient"
    (e.g. FP8 gradients kept by the optimizer instead of `p.grad`). Extras are MCF error
    components, master weights, scales and step counters.

    Returns:
        dict with keys "params", "grads", "optimizer_states", "extra", "total" (bytes per
        parameter) and "num_params".
    """
    coverage = _Coverage()
    trainable = [p for p in model.parameters() if p.requires_grad]
    totals = {"params": 0, "grads": 0, "optimizer_states": 0, "extra": 0}
    num_params = 0
    for p in trainable:
        covered = coverage.claim(p)
        totals["params"] += covered
        # Two parameter objects over the same elements are one parameter.
        num_params += covered // p.element_size() if covered < p.numel() * p.element_size() else p.numel()
    if num_params == 0:
        raise ValueError("the model has no trainable parameters")

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
                totals[bucket] += coverage.claim(value)
                if role == "gradient":
                    grad_in_state.add(id(param))
    for p in trainable:
        if p.grad is not None:
            totals["grads"] += coverage.claim(p.grad)
        elif id(p) not in grad_in_state:
            totals["grads"] += p.numel() * p.element_size()
    out = {k: v / num_params for k, v in totals.items()}
    out["total"] = sum(out.values())
    out["num_params"] = float(num_params)
    return out
