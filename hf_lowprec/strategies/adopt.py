"""Adopting a model as it was loaded: FP32 parameters made from 16-bit checkpoints.

`from_pretrained` keeps the dtype a checkpoint was stored in (transformers 5): BF16 for nearly
every checkpoint on the Hub. Every BF16 and FP16 value is an FP32 value, so a strategy that
promises FP32 parameters makes them from the loaded values and trains as from an FP32 load of the
same checkpoint; strategies that store 16-bit parameters convert the model themselves (one rounding).
"""

from __future__ import annotations

import collections
import logging
import sys
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from ..fp8.blocks import FrozenBlockFP8Linear
from ..fp8.linear import FP8Linear
from ..fp8.scaled import get_master_scale
from ..memory import ADOPTED_ATTR

if TYPE_CHECKING:
    from .protocol import Strategy

__all__ = ["adopt_loaded_dtypes", "adopted_parameters", "exact_embedding_scales", "widen_unfrozen"]

logger = logging.getLogger(__name__)

_WIDENED = (torch.bfloat16, torch.float16)
# On a frozen 16-bit parameter that `prepare_model` kept as loaded under a strategy with FP32
# parameters: (its dtype then, its name), for `widen_unfrozen` when it is unfrozen later.
_KEPT_ATTR = "_hf_lowprec_kept_as_loaded"


def adopt_loaded_dtypes(strategy: Strategy, model: torch.nn.Module) -> dict[str, int]:
    """Make FP32 every BF16/FP16 parameter of `model` that `adopted_parameters` names, where `strategy`
    promises FP32 parameters and not the loaded dtype; returns (and records on the model, for the
    startup report) {dtype: elements}. Runs before the strategy's own conversion. FP32 parameters are
    promised by fp32, bf16-mixed, fp16-mixed, fp8-lm-o1 and coat (FP32 masters) and for the non-FP8
    parameters of fp8-lm-o2/o3. Parameters are converted in place (`p.data`), so ties and references hold.
    A frozen 16-bit parameter left as loaded is marked, for `widen_unfrozen` to make it FP32 if unfrozen."""
    promised = strategy.promised_param_dtypes()
    made: collections.Counter[str] = collections.Counter()
    if torch.float32 in promised:
        for p in adopted_parameters(model, autocast=strategy.compute_dtype != torch.float32):
            if p.dtype not in _WIDENED or p.dtype in promised:
                continue
            made[str(p.dtype).removeprefix("torch.")] += p.numel()
            p.data = p.data.float()
        if strategy.param_dtype == torch.float32 and not strategy.recasts:
            for name, p in model.named_parameters():
                if not p.requires_grad and p.dtype in _WIDENED:  # kept as loaded: widened when unfrozen
                    setattr(p, _KEPT_ATTR, (p.dtype, name))
    if made:
        exact_embedding_scales(model)
        record = model.__dict__.setdefault(ADOPTED_ATTR, {})
        for dtype, count in made.items():
            record[dtype] = record.get(dtype, 0) + count
    return dict(made)


def adopted_parameters(model: torch.nn.Module, autocast: bool = False) -> list[torch.nn.Parameter]:
    """The floating parameters of `model` a strategy with FP32 parameters holds in FP32, each shared
    (tied) one once: the trainable ones, and the frozen 16-bit ones too, as the model's FP32 load has
    them (a frozen block or LayerNorm meets FP32 activations and neighbours; unfrozen later, it trains
    in FP32). Frozen parameters stay as loaded only where the model trains none of its own weights:
    a PEFT-adapted model (the frozen base, which `integrations.peft` holds at forward precision), a
    model with no trainable parameter (a frozen reference), and a published FP8 layer kept frozen.
    Under a 16-bit `autocast`, a frozen GEMM layer's weight and bias stay as loaded too: autocast
    casts them to its dtype either way, the same values (a frozen backbone keeps its 2 bytes a weight)."""
    params = [p for p in model.parameters() if p.is_floating_point()]
    if _peft_adapted(model) or not any(p.requires_grad for p in params):
        return [p for p in params if p.requires_grad]
    kept_kinds = (FrozenBlockFP8Linear, *(_gemm_layers() if autocast else ()))
    kept = {id(p) for m in model.modules() if isinstance(m, kept_kinds) for p in m.parameters(recurse=False)}
    return [p for p in params if p.requires_grad or (p.dtype in _WIDENED and id(p) not in kept)]


def _gemm_layers() -> tuple[type, ...]:
    """The layers autocast runs as one GEMM of 16-bit operands: linear, convolution, GPT-2's Conv1D."""
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    layers = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, FP8Linear)
    return (*layers, conv1d) if conv1d is not None else layers


def _peft_adapted(model: torch.nn.Module) -> bool:
    """A `peft.PeftModel`, or a model PEFT injected tuner layers into (peft is not imported here)."""
    peft = sys.modules.get("peft")
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    if peft is not None and isinstance(model, getattr(peft, "PeftModel", ())):
        return True
    layer = getattr(tuners, "BaseTunerLayer", None)
    return layer is not None and any(isinstance(m, layer) for m in model.modules())


def exact_embedding_scales(model: torch.nn.Module) -> None:
    """Gemma's embedding scale √hidden is a buffer made at init in the load dtype (8.9375 for 8.9443
    in BF16), not in the checkpoint; the module keeps the float it came from: FP32 from that."""
    for module in model.modules():
        scalar, buffer = getattr(module, "scalar_embed_scale", None), module._buffers.get("embed_scale")
        if isinstance(scalar, (int, float)) and buffer is not None and buffer.dtype in _WIDENED:
            module._buffers["embed_scale"] = torch.tensor(float(scalar), dtype=torch.float32, device=buffer.device)


def widen_unfrozen(strategy: Strategy, groups: list[dict[str, Any]], first_index: int = 0) -> None:
    """Before the optimizer is built or a group added: make FP32, in place, each trainable 16-bit
    parameter of `groups` that prepare_model kept as loaded because it was frozen then (gradual
    unfreezing), where `strategy` steps FP32 parameters (no scaled master: fp8-lm-o2's FP16 ones
    are its own). It has no optimizer state yet, so this is exact and it trains as from the FP32
    load. Refused before any work: such a parameter not prepared (a head added or a cast after
    prepare_model), or a sharded one (FSDP2 gathers a block's shards in the dtype it sharded)."""
    if strategy.recasts or strategy.param_dtype != torch.float32:
        return
    low = [
        (g, i, p)
        for g, group in enumerate(groups)
        for i, p in enumerate(group["params"])
        if p.requires_grad and p.dtype in _WIDENED and get_master_scale(p) is None
    ]
    if not low:
        return
    from ..report import PrecisionPromiseError

    for g, i, p in low:
        kept = getattr(p, _KEPT_ATTR, None)
        where = f"parameter {i} of group {first_index + g} ({_name(p.dtype)}, shape {tuple(p.shape)})"
        if isinstance(p, DTensor):
            raise ValueError(
                f"{where} is trainable in {_name(p.dtype)}, but precision strategy {strategy.name!r} trains FP32 "
                "parameters, and FSDP2 cannot widen a shard in place: a layer frozen when the model was prepared "
                "and sharded keeps its loaded dtype; make it FP32 before sharding (`layer.float()`) to unfreeze it later"
            )
        if kept is None or kept[0] != p.dtype:
            raise PrecisionPromiseError(
                f"{where} is trainable in {_name(p.dtype)}, but precision strategy {strategy.name!r} trains "
                "FP32 parameters: it was added or cast after prepare_model (a new head, model.half()). Call "
                "strategy.prepare_model(model) again, which converts only what is new, or remove the cast"
            )
    unique = list({id(p): p for _, _, p in low}.values())  # a tied weight listed twice is widened once
    names = [getattr(p, _KEPT_ATTR)[1] for p in unique]
    with torch.no_grad():
        for p in unique:
            p.data = p.data.float()
            if p.grad is not None:
                p.grad = p.grad.float()
            delattr(p, _KEPT_ATTR)
    logger.info(
        "%s: %d unfrozen parameter(s), frozen at prepare_model and held as loaded, made FP32 (exact) before "
        "their first step, as the FP32 load trains them: %s",
        strategy.name,
        len(names),
        ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else ""),
    )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
