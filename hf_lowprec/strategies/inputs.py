"""Float model inputs in a 16-bit-weight strategy's dtype: with no autocast, its forward takes them as its weights'.

An audio batch (`input_values`, `input_features`) comes from its feature extractor in FP32, and a
model that feeds it straight into a Conv or Linear (Wav2Vec2, HuBERT, Whisper) needs the weights'
dtype, as the stock Trainer casts it under DeepSpeed. What the loss takes keeps its dtype (`LOSS_INPUTS`):
FP32 regression labels, the Trainer's `num_items_in_batch` (a float count that BF16 rounds above 256
and FP16 makes inf above 65504). A 0-d feature (a diffusion timestep) is cast as any other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Mapping
from typing import Any

import torch

__all__ = ["LOSS_INPUTS", "cast_float_inputs", "computes_without_autocast"]

# The keyword inputs transformers' losses take beside the logits (`loss.loss_utils`): the labels
# (a regression loss compares 16-bit predictions with FP32 targets in FP32, by type promotion), the
# causal-LM loss's `shift_labels`, and the Trainer's `num_items_in_batch`, the divisor of the summed
# loss (a float tensor: 357 in BF16 is 356, 100001 in FP16 is inf and zeroes the step's gradients).
LOSS_INPUTS = ("labels", "shift_labels", "num_items_in_batch")


def computes_without_autocast(strategy: Any) -> bool:
    """Whether `strategy` computes in 16-bit weights with no autocast of its own (collage-plus,
    bf16-pure, fp16-als): FP32 tensors meet its 16-bit weights as they are."""
    dtype = strategy.compute_dtype
    if dtype not in (torch.float16, torch.bfloat16) or strategy.param_dtype != dtype:
        return False
    return isinstance(strategy.forward_context(), contextlib.nullcontext)


def cast_float_inputs(strategy: Any, batch: Any, keep: Collection[str] = LOSS_INPUTS) -> Any:
    """`batch` (a mapping of the model's inputs, a tuple or list of them, or a tensor) with every
    floating-point tensor in the strategy's parameter dtype where `computes_without_autocast`, the
    entries named in `keep` (what the loss takes) as they are; else `batch` itself. Below the top, plain dicts, tuples and lists only: a model's own
    outputs fed back (`encoder_outputs`, a cache) are its."""
    if not computes_without_autocast(strategy):
        return batch
    return _cast(batch, strategy.param_dtype, frozenset(keep), top=True)


def _cast(data: Any, dtype: torch.dtype, keep: frozenset[str], top: bool = False, mask: bool = False) -> Any:
    if isinstance(data, Mapping) and (top or type(data) is dict):
        return type(data)(
            {k: v if k in keep else _cast(v, dtype, keep, mask="mask" in str(k)) for k, v in data.items()}
        )
    if type(data) in (tuple, list):
        return type(data)(_cast(v, dtype, keep) for v in data)
    if isinstance(data, torch.Tensor) and data.is_floating_point() and data.dtype != dtype:
        if mask:  # an additive mask's FP32 minimum would round to -inf: a fully masked row's softmax NaN
            data = data.clamp(min=torch.finfo(dtype).min)
        return data.to(dtype)
    return data
