"""FP32 outputs from a model that computes under a strategy's autocast, as the stock mixed-precision
flags give them: Accelerate wraps such a model's forward in `convert_outputs_to_fp32`, and a
strategy turns those flags off. `widen_outputs` does the same with a forward hook (a loss computed
from the outputs, RewardTrainer's, TRL's log-probabilities, is then an FP32 one, as stock).
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate.utils import convert_to_fp32

from ..strategies.interface import PrecisionStrategy
from .peft import prepare_model

__all__ = ["computes_under_autocast", "prepared_model", "widen_outputs"]


def computes_under_autocast(strategy: PrecisionStrategy) -> bool:
    """Whether `strategy`'s forward context turns a 16-bit autocast on (bf16-mixed, fp16-mixed, the
    FP8 strategies, COAT): the strategies whose model outputs `bf16=True`/`fp16=True` hand on in FP32."""
    with strategy.forward_context():
        return torch.is_autocast_enabled("cpu") or (torch.cuda.is_available() and torch.is_autocast_enabled("cuda"))


def _fp32_outputs(module: torch.nn.Module, args: Any, output: Any) -> Any:
    return convert_to_fp32(output)  # 16-bit float tensors, nested in tuples, lists, dicts and ModelOutputs


def widen_outputs(strategy: PrecisionStrategy | None, model: Any) -> Any:
    """`model`, its 16-bit outputs made FP32 after each forward where `strategy` computes under
    autocast (once per model; a module only: a name or a function is returned as it is)."""
    if strategy is None or not isinstance(model, torch.nn.Module) or not computes_under_autocast(strategy):
        return model
    if _fp32_outputs not in model._forward_hooks.values():
        model.register_forward_hook(_fp32_outputs)
    return model


def prepared_model(strategy: PrecisionStrategy, model: torch.nn.Module) -> torch.nn.Module:
    """The Trainer's model: `prepare_model`, then `widen_outputs`."""
    return widen_outputs(strategy, prepare_model(strategy, model))
