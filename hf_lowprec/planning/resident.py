"""What a counted step starts from: the bytes a model and its optimizer hold between steps
(`resident_bytes`), each storage once."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["resident_bytes"]


def resident_bytes(model: torch.nn.Module, optimizer: Any) -> int:
    """Bytes held between steps by `model` and `optimizer`: parameters, buffers and the
    optimizer's state of the model's parameters (each storage once); gradients set to None are
    not held."""
    from ..memory import unwrap_optimizer

    inner = unwrap_optimizer(getattr(optimizer, "inner", optimizer))
    tensors = [*model.parameters(), *model.buffers()]
    held = {id(p) for p in tensors}
    for param, state in getattr(inner, "state", {}).items():
        if id(param) in held or not isinstance(param, torch.nn.Parameter):
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    seen: dict[int, int] = {}
    for t in tensors:
        if t.layout == torch.strided:
            storage = t.untyped_storage()
            seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())
