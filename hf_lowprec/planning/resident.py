"""What a counted step starts from: the bytes a model and its optimizer hold between steps
(`resident_bytes`), each storage once, the FP8 weights an optimizer step wrote included."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["resident_bytes"]


def resident_bytes(model: torch.nn.Module, optimizer: Any) -> int:
    """Bytes held between steps by `model` and `optimizer`: parameters, buffers, the optimizer's
    state of the model's parameters, and the FP8 copy of each weight that FP8-LM O2's step wrote
    for the next forward, which an eagerly run layer on a GPU keeps (1 B a weight; none on a CPU,
    whose forward casts), each storage once. Gradients set to None are not held."""
    from ..fp8.scaled import get_fp8_weight_copy
    from ..memory import unwrap_optimizer

    inner = unwrap_optimizer(getattr(optimizer, "inner", optimizer))
    tensors = [*model.parameters(), *model.buffers()]
    held = {id(p) for p in tensors}
    for param, state in getattr(inner, "state", {}).items():
        if id(param) in held or not isinstance(param, torch.nn.Parameter):
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    copies = [get_fp8_weight_copy(p) for p in model.parameters()]
    tensors += [t for copy in copies if copy is not None for t in (copy.payload, copy.scale)]
    seen: dict[int, int] = {}
    for t in tensors:
        if t.layout == torch.strided:
            storage = t.untyped_storage()
            seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())
