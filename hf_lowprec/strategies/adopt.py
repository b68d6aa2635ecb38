"""Adopting a model as it was loaded: FP32 parameters made from 16-bit checkpoints.

`from_pretrained` keeps the dtype a checkpoint was stored in (transformers 5), and nearly every
checkpoint on the Hub is stored in BF16. A strategy that promises FP32 parameters (FP32 master
weights: fp32, bf16-mixed, fp16-mixed, fp8-lm-o1, coat; the non-FP8 parameters of fp8-lm-o2/o3)
makes them from the loaded values before its own conversion: every BF16 and FP16 value is an
FP32 value, so the FP32 parameter holds exactly what was stored, and training continues as from
an FP32 load of the same checkpoint. Strategies that store 16-bit parameters convert the model
themselves (one rounding from whatever was loaded).

Only trainable floating-point parameters change: frozen ones (a LoRA base, a frozen embedding)
stay as loaded, and parameters are converted in place (`p.data`), so ties and references hold.
What was made is recorded on the model for the startup report: dtype → elements.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

import torch

from ..memory import ADOPTED_ATTR

if TYPE_CHECKING:
    from .protocol import Strategy

__all__ = ["adopt_loaded_dtypes"]

_WIDENED = (torch.bfloat16, torch.float16)


def adopt_loaded_dtypes(strategy: Strategy, model: torch.nn.Module) -> dict[str, int]:
    """Make FP32 every trainable BF16/FP16 parameter of `model` where `strategy` promises FP32
    parameters and not the loaded dtype; returns (and records on the model) {dtype: elements}."""
    promised = strategy.promised_param_dtypes()
    made: collections.Counter[str] = collections.Counter()
    if torch.float32 in promised:
        for p in model.parameters():  # each shared (tied) parameter once
            if not p.requires_grad or p.dtype not in _WIDENED or p.dtype in promised:
                continue
            made[str(p.dtype).removeprefix("torch.")] += p.numel()
            p.data = p.data.float()
    if made:
        record = model.__dict__.setdefault(ADOPTED_ATTR, {})
        for dtype, count in made.items():
            record[dtype] = record.get(dtype, 0) + count
    return dict(made)
