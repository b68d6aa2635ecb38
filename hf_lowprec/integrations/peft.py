"""PEFT (LoRA, …) under a precision strategy: the strategy converts the model as usual, and the
frozen base PEFT wraps is kept in the strategy's compute dtype (`prepare_model`), but for what
transformers keeps FP32 in that dtype (`strategies.casting.kept_parameters`); every adapter, the
inactive ones too, keeps its dtype. `peft` is never imported here: a model can only be a
`PeftModel` if the caller imported it.
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
from ..strategies.casting import kept_parameters
from ..strategies.interface import PrecisionStrategy

__all__ = ["adapter_parameters", "is_peft_model", "prepare_model"]

logger = logging.getLogger(__name__)

# Dtypes a weight can be stored in and computed with directly; a strategy whose compute
# dtype is something else (e.g. FP8 with scales) converts its layers in `prepare_model`.
_STORAGE_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_peft_model(model: torch.nn.Module) -> bool:
    """True when `model` is a `peft.PeftModel` (without importing peft)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def adapter_parameters(model: torch.nn.Module) -> set[int]:
    """ids of the parameters PEFT adds to `model`, of every adapter, active or not: what PEFT's
    structure holds beside the base it wraps. A tuner layer (`BaseTunerLayer`) holds all but its
    `get_base_layer()`, an auxiliary wrapper (`ModulesToSaveWrapper`, `TrainableTokensWrapper`)
    all but its `original_module`, the tuner (`BaseTuner`) all but its `model` (VeRA's shared
    `vera_A`/`vera_B`), and a prompt-learning model its `prompt_encoder`. Empty without peft."""
    tuners_utils = sys.modules.get("peft.tuners.tuners_utils")
    other = sys.modules.get("peft.utils.other")
    wraps = (
        (getattr(tuners_utils, "BaseTunerLayer", None), lambda m: m.get_base_layer()),
        (getattr(other, "AuxiliaryTrainingWrapper", getattr(other, "ModulesToSaveWrapper", None)), "original_module"),
        (getattr(tuners_utils, "BaseTuner", None), "model"),
    )
    out: set[int] = set()
    for module in model.modules():
        for cls, base in wraps:
            if cls is not None and isinstance(module, cls):
                kept = base(module) if callable(base) else getattr(module, base, None)
                held = {id(p) for p in kept.parameters()} if isinstance(kept, torch.nn.Module) else set()
                out.update(id(p) for p in module.parameters() if id(p) not in held)
                break
    prompts = getattr(model, "prompt_encoder", None) if is_peft_model(model) else None
    if isinstance(prompts, torch.nn.Module):
        out.update(id(p) for p in prompts.parameters())
    return out


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

    A frozen base weight never receives an update, so it needs no master copy and no optimizer
    state: it is kept in the strategy's compute dtype (e.g. BF16 under `bf16-mixed`, where the
    autocast would round it to BF16 at every matmul anyway), but for the parameters
    `from_pretrained(dtype=<compute dtype>)` keeps FP32 (`strategies.casting.kept_parameters`: T5's
    `wo` in FP16, DeepSeek-V3's router `gate.weight`), which stay FP32. Trainable adapter weights keep the
    strategy's parameter dtype, and only they reach the strategy's optimizer (the integrations
    build it from `requires_grad` parameters). The adapters that are not trained (an inactive
    adapter, the other copies of a `modules_to_save` module) are no base: they keep their dtype,
    to be saved, or trained later, as they were (`adapter_parameters`)."""
    restore_published_fp8(model, keep_frozen_fp8=strategy.uses_fp8_gemm)
    # The adapters not trained keep their tensors through the strategy's casts too (collage-plus
    # stores the model in BF16): no update is to be made to them, nor any rounding.
    adapters = adapter_parameters(model) if is_peft_model(model) else set()
    idle = {id(p): p.data for p in model.parameters() if id(p) in adapters and not p.requires_grad}
    model = strategy.prepare_model(model)
    for param in model.parameters():
        if id(param) in idle:
            param.data = idle[id(param)]
    if is_peft_model(model) and any(isinstance(m, FP8Linear) for m in model.modules()):
        _forget_fp8_weights_at_merges(model)
    compute = strategy.compute_dtype
    if not is_peft_model(model) or compute not in _STORAGE_COMPUTE_DTYPES:
        return model
    cast = 0
    # A frozen layer kept as its FP8 checkpoint published it stays so (checkpoints/fp8_published.py).
    kept = {id(p) for m in model.modules() if isinstance(m, FrozenBlockFP8Linear) for p in m.parameters()}
    kept |= adapter_parameters(model)  # every adapter, trained or not, is no frozen base
    # What `from_pretrained(dtype=compute)` keeps FP32 stays FP32 (T5's `wo` in FP16, whose output
    # passes 65504; DeepSeek-V3's router `gate.weight`), as the strategy's own cast keeps it.
    wide = {id(p) for p in kept_parameters(model, compute) if not p.requires_grad} - kept
    for param in model.parameters():
        if param.requires_grad or not param.is_floating_point() or id(param) in kept:
            continue
        dtype = torch.float32 if id(param) in wide else compute
        if param.dtype != dtype:
            param.data = param.data.to(dtype)
            cast += dtype == compute
    if cast or wide:
        logger.info(
            "%s: %d frozen PEFT base tensors stored in %s (%d kept FP32, as transformers loads them)",
            strategy.name,
            cast,
            compute,
            len(wide),
        )
    return model
