"""PEFT (LoRA, …) under a precision strategy: the strategy converts the model as usual, and the
frozen base PEFT adds is kept in the strategy's compute dtype (`prepare_model`). `peft` is never
imported here: a model can only be a `PeftModel` if the caller imported it.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any

import torch

from ..checkpoints.fp8_published import restore_published_fp8
from ..fp8.blocks import FrozenBlockFP8Linear
from ..fp8.linear import FP8Linear
from ..strategies.interface import PrecisionStrategy

__all__ = ["is_peft_model", "prepare_model"]

logger = logging.getLogger(__name__)

# Dtypes a weight can be stored in and computed with directly; a strategy whose compute
# dtype is something else (e.g. FP8 with scales) converts its layers in `prepare_model`.
_STORAGE_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_peft_model(model: torch.nn.Module) -> bool:
    """True when `model` is a `peft.PeftModel` (without importing peft)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def _forget_fp8_weights_at_merges(model: torch.nn.Module) -> None:
    """Make PEFT's `merge`/`unmerge` of the tuner layers in `model` drop their FP8 layers' weight
    cast: a merge writes `weight.data` in place, which no version counter sees, and the next
    forward would use the cast of the weight before it (`merge_and_unload` ignoring the adapter)."""
    for layer in model.modules():
        if not callable(getattr(layer, "get_base_layer", None)):
            continue
        for method in ("merge", "unmerge"):
            owner = next((k for k in type(layer).__mro__ if method in vars(k)), None)
            if owner is None or getattr(vars(owner)[method], "hf_lowprec_forgets", False):
                continue
            setattr(owner, method, _forgetting(vars(owner)[method]))


def _forgetting(method: Any) -> Any:
    @functools.wraps(method)
    def forgetting(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        finally:
            for module in self.modules():
                if isinstance(module, FP8Linear):
                    module.forget_weight_cast()

    forgetting.hf_lowprec_forgets = True  # type: ignore[attr-defined]
    return forgetting


def prepare_model(strategy: PrecisionStrategy, model: torch.nn.Module) -> torch.nn.Module:
    """A published FP8 checkpoint's layers from their stored values (`checkpoints.fp8_published`), then
    `strategy.prepare_model(model)`, then, for a PEFT model, the frozen base in the compute dtype.

    A frozen weight never receives an update, so it needs no master copy and no optimizer state:
    it is kept in the strategy's compute dtype (e.g. BF16 under `bf16-mixed`, where the autocast
    would round it to BF16 at every matmul anyway). Trainable adapter weights keep the strategy's
    parameter dtype, and only they reach the strategy's optimizer (the integrations build it from
    `requires_grad` parameters)."""
    restore_published_fp8(model, keep_frozen_fp8=strategy.uses_fp8_gemm)
    model = strategy.prepare_model(model)
    if is_peft_model(model) and any(isinstance(m, FP8Linear) for m in model.modules()):
        _forget_fp8_weights_at_merges(model)
    compute = strategy.compute_dtype
    if not is_peft_model(model) or compute not in _STORAGE_COMPUTE_DTYPES:
        return model
    cast = 0
    # A frozen layer kept as its FP8 checkpoint published it stays so (checkpoints/fp8_published.py).
    published = {id(p) for m in model.modules() if isinstance(m, FrozenBlockFP8Linear) for p in m.parameters()}
    for param in model.parameters():
        if (
            not param.requires_grad
            and param.is_floating_point()
            and param.dtype != compute
            and id(param) not in published
        ):
            param.data = param.data.to(compute)
            cast += 1
    if cast:
        logger.info("%s: %d frozen PEFT base tensors stored in %s", strategy.name, cast, compute)
    return model
