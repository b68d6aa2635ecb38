"""Adopting a model as it was loaded: FP32 parameters made from 16-bit checkpoints.

`from_pretrained` keeps the dtype a checkpoint was stored in (transformers 5): BF16 for nearly
every checkpoint on the Hub. Every BF16 and FP16 value is an FP32 value, so a strategy that
promises FP32 parameters makes them from the loaded values and trains as from an FP32 load of the
same checkpoint; strategies that store 16-bit parameters convert the model themselves (one rounding).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

import torch

from ..memory import ADOPTED_ATTR

if TYPE_CHECKING:
    from .protocol import Strategy

__all__ = ["adopt_loaded_dtypes", "exact_embedding_scales"]

_WIDENED = (torch.bfloat16, torch.float16)


def adopt_loaded_dtypes(strategy: Strategy, model: torch.nn.Module) -> dict[str, int]:
    """Make FP32 every trainable BF16/FP16 parameter of `model` where `strategy` promises FP32
    parameters and not the loaded dtype; returns (and records on the model, for the startup
    report) {dtype: elements}. Runs before the strategy's own conversion. FP32 parameters are
    promised by fp32, bf16-mixed, fp16-mixed, fp8-lm-o1 and coat (FP32 masters) and for the non-FP8
    parameters of fp8-lm-o2/o3. Frozen parameters (a LoRA base, a frozen embedding) stay as loaded;
    the others are converted in place (`p.data`), so ties and references hold."""
    promised = strategy.promised_param_dtypes()
    made: collections.Counter[str] = collections.Counter()
    if torch.float32 in promised:
        for p in model.parameters():  # each shared (tied) parameter once
            if not p.requires_grad or p.dtype not in _WIDENED or p.dtype in promised:
                continue
            made[str(p.dtype).removeprefix("torch.")] += p.numel()
            p.data = p.data.float()
    if made:
        exact_embedding_scales(model)
        record = model.__dict__.setdefault(ADOPTED_ATTR, {})
        for dtype, count in made.items():
            record[dtype] = record.get(dtype, 0) + count
    return dict(made)


def exact_embedding_scales(model: torch.nn.Module) -> None:
    """Gemma's embedding scale √hidden is a buffer made at init in the load dtype (8.9375 for 8.9443
    in BF16), not in the checkpoint; the module keeps the float it came from: FP32 from that."""
    for module in model.modules():
        scalar, buffer = getattr(module, "scalar_embed_scale", None), module._buffers.get("embed_scale")
        if isinstance(scalar, (int, float)) and buffer is not None and buffer.dtype in _WIDENED:
            module._buffers["embed_scale"] = torch.tensor(float(scalar), dtype=torch.float32, device=buffer.device)
