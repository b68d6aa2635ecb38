"""FP32 outputs from a model that computes in 16 bits under a strategy, as the stock mixed-precision
flags give them: Accelerate wraps the forward in `convert_outputs_to_fp32` under `bf16=True` or
`fp16=True` (whatever the weights' dtype), and a strategy turns those flags off. `widen_outputs` does
the same with a forward hook, so a loss the trainer computes from the outputs (label smoothing,
`compute_loss_func`, RewardTrainer's, TRL's log-probabilities) and the predictions handed to
`compute_metrics` are FP32, as stock. A loss the model computes itself is the model's, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate.utils import convert_to_fp32

from ..strategies.interface import PrecisionStrategy
from .peft import prepare_model

__all__ = ["computes_in_16_bits", "prepared_model", "widen_outputs"]


def computes_in_16_bits(strategy: PrecisionStrategy) -> bool:
    """Whether `strategy` computes in BF16 or FP16, under autocast (bf16-mixed, fp16-mixed, the FP8
    strategies, COAT) or in 16-bit weights (Collage, bf16-pure, fp16-als, …): the strategies standing
    in for `bf16=True`/`fp16=True`, whose model outputs the stock flags hand on in FP32."""
    return strategy.compute_dtype in (torch.bfloat16, torch.float16)


def _fp32_outputs(module: torch.nn.Module, args: Any, output: Any) -> Any:
    return convert_to_fp32(output)  # 16-bit float tensors, nested in tuples, lists, dicts and ModelOutputs


def widen_outputs(strategy: PrecisionStrategy | None, model: Any) -> Any:
    """`model`, its 16-bit outputs made FP32 after each forward where `strategy` computes in 16 bits
    (once per model; a module only: a name or a function is returned as it is)."""
    if strategy is None or not isinstance(model, torch.nn.Module) or not computes_in_16_bits(strategy):
        return model
    if _fp32_outputs not in model._forward_hooks.values():
        model.register_forward_hook(_fp32_outputs)
    return model


def prepared_model(strategy: PrecisionStrategy, model: torch.nn.Module) -> torch.nn.Module:
    """The Trainer's model: `prepare_model`, then `widen_outputs`."""
    return widen_outputs(strategy, prepare_model(strategy, model))
