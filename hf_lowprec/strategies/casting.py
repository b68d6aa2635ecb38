"""A trained model cast to a strategy's 16-bit dtype as transformers loads one in it
(`cast_model`): parameters and buffers take the dtype, a rotary embedding's frequencies stay FP32.
`Module.to` would round them too, and position p's angle in each rotating pair would move by up
to p·f·2⁻⁹ under BF16 (2⁻¹² under FP16): several radians at position 4,095 for the fastest
pairs, angles a pretrained checkpoint never saw (docs/numerics.md, "Rotary frequencies").
"""

from __future__ import annotations

import torch

__all__ = ["cast_model", "kept_buffers"]


def kept_buffers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """(module, name) of each floating buffer a cast leaves as it is: those of a rotary embedding
    (transformers names their classes `…RotaryEmbedding`) and any buffer named `inv_freq`."""
    kept = []
    for module in model.modules():
        rotary = "Rotary" in type(module).__name__
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer.is_floating_point() and (rotary or name == "inv_freq"):
                kept.append((module, name))
    return kept


def cast_model(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model.to(dtype)` but for `kept_buffers`, which keep their tensors (and dtype); in place,
    as `Module.to` is (the parameters stay the same objects)."""
    kept = [(module, name, module._buffers[name]) for module, name in kept_buffers(model)]
    model = model.to(dtype)
    for module, name, buffer in kept:
        module._buffers[name] = buffer
    return model
