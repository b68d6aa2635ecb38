"""Frozen models beside the trained one (TRL's reference, reward and teacher models), kept at the
precision their forward computes with: it takes no gradient and no optimizer step, so it needs no
master copy (docs/rl.md, "Frozen models keep what their forward computes with").
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
from torch import nn

from ..checkpoints.fp8_published import restore_published_fp8
from ..fp8.blocks import BLOCK, FrozenBlockFP8Linear, quantize_published
from ..fp8.convert import default_skips
from ..fp8.experts import FP8Experts
from ..fp8.linear import FP8Linear
from ..fp8.scaled import dequantize, set_master_scale
from ..strategies.casting import kept_parameters
from ..strategies.interface import PrecisionStrategy

__all__ = ["FROZEN_ATTR", "check_refreeze", "freeze_all", "freeze_model", "frozen_candidates", "frozen_footprint"]
__all__ += ["is_plain_module"]

logger = logging.getLogger(__name__)

# On a frozen model: what `freeze_model` did ({"role", "storage", bytes...}), for the startup report.
FROZEN_ATTR = "hf_lowprec_frozen"


def is_plain_module(model: Any) -> bool:
    """A module whose parameters can be replaced in place: not a DeepSpeed engine, an FSDP or DDP
    wrapper, nor a model whose parameters are sharded DTensors."""
    if not isinstance(model, nn.Module):
        return False
    wrapped = type(model).__name__ in ("DeepSpeedEngine", "FullyShardedDataParallel", "DistributedDataParallel")
    dtensor = sys.modules.get("torch.distributed.tensor")
    sharded = dtensor is not None and any(isinstance(p, dtensor.DTensor) for p in model.parameters())
    return not (wrapped or sharded)


def _storage(strategy: PrecisionStrategy) -> str:
    if strategy.options.frozen_models == "policy":
        return "as the policy"
    if strategy.frozen_in_fp8 and not _zero3():
        return "fp8-blocks"
    return str(strategy.compute_dtype).removeprefix("torch.")


def _zero3() -> bool:
    # ZeRO-3 partitions a frozen model's parameters too, and its all-gather has no float8 (gloo):
    # FP8 blocks would fail at the first forward ("Invalid scalar type").
    integrations = sys.modules.get("transformers.integrations")
    return integrations is not None and bool(integrations.is_deepspeed_zero3_enabled())


def check_refreeze(strategy: PrecisionStrategy | None, model: Any, role: str) -> bool:
    """Whether `model` is frozen already in the storage `strategy` keeps (True: reuse it as it is).

    Raises ValueError when another strategy froze it to another storage: its FP8 or 16-bit
    weights cannot be widened back losslessly, so a model frozen once is never converted again.
    With no strategy (a stock trainer's run), a frozen model that no longer holds FP32 weights in
    plain layers is refused: the earlier trainer converted the caller's object in place."""
    facts = getattr(model, "__dict__", {}).get(FROZEN_ATTR)
    if facts is None:
        return False
    by = facts.get("strategy")
    if strategy is None:
        if _plain_fp32(model):
            return True
        raise ValueError(
            f"the {role} model passed to this trainer was frozen already, by precision_strategy={by!r}, which "
            f"converted that object in place (storage: {facts['storage']}); this trainer has no precision_strategy "
            "and would compute with those weights, not the FP32 model you built. Pass this trainer a fresh copy "
            "of the model (load it again, or copy.deepcopy it before the first trainer)"
        )
    storage, wanted = facts["storage"], _storage(strategy)
    if storage == wanted and (wanted != "as the policy" or by == strategy.name):
        return True
    raise ValueError(
        f"the {role} model passed to this trainer was frozen already, by precision_strategy={by!r} "
        f"(storage: {storage}); precision_strategy={strategy.name!r} keeps frozen models as {wanted}, and a "
        "frozen model's weights cannot be converted back losslessly. Pass this trainer a fresh copy of "
        "the model (load it again, or copy.deepcopy it before the first trainer)"
    )


def _plain_fp32(model: nn.Module) -> bool:
    """FP32 weights in plain layers (frozen under fp32, or prepared like a policy with FP32 masters)."""
    fp8 = (FP8Linear, FrozenBlockFP8Linear, FP8Experts)
    floating = (p for p in model.parameters() if p.is_floating_point())
    return all(p.dtype == torch.float32 for p in floating) and not any(isinstance(m, fp8) for m in model.modules())


def freeze_model(strategy: PrecisionStrategy, model: nn.Module, role: str, *, head_fp32: bool = False) -> nn.Module:
    """`model`, frozen, holding what its forward under `strategy` computes with.

    - FP32 strategies: FP32.
    - 16-bit strategies: the compute dtype (BF16, or FP16 under the FP16 strategies). Under
      autocast a linear layer's weight is rounded to it at every GEMM anyway, so the linear
      layers compute exactly as an FP32 copy would.
    - FP8 strategies and COAT: each linear layer of the decoder blocks becomes a
      `FrozenBlockFP8Linear` (E4M3 payload, one FP32 scale per 128×128 block: 1.0002 bytes per
      parameter), widened to the compute dtype one layer at a time. The LM head, the
      embeddings, norms and biases stay 16-bit. Under DeepSpeed ZeRO-3, BF16 instead: ZeRO-3
      partitions and all-gathers a frozen model's parameters, and that has no float8.

    Buffers keep their dtype (rotary frequencies lose digits in 16 bits). `frozen_models="policy"`
    in `precision_options` prepares a frozen model like the policy instead (the behaviour before).
    `role` names it in the logs and the startup report ("reference", "reward", "teacher").
    `head_fp32` keeps the output embeddings in FP32 (TRL's `cast_lm_head_to_fp32`); the parameters
    `from_pretrained(dtype=<frozen dtype>)` keeps FP32 are FP32 (`strategies.casting.kept_parameters`:
    `_keep_in_fp32_modules_strict`, `_keep_in_fp32_modules` too in FP16). A model trained here under an FP8
    strategy first (its layers `FP8Linear`) holds its real weights in plain layers again when the
    frozen storage is not FP8. A model frozen already is returned as it is when `strategy` keeps
    the same storage; another storage is refused (`check_refreeze`).
    """
    if check_refreeze(strategy, model, role):
        return model
    if strategy.options.frozen_models == "policy":
        from .peft import prepare_model

        model = prepare_model(strategy, model)
        model.requires_grad_(False)
        facts = {"role": role, "storage": _storage(strategy), "strategy": strategy.name}
        model.__dict__[FROZEN_ATTR] = {**facts, **frozen_footprint(model)}
        return model
    model.requires_grad_(False)
    fp8 = _storage(strategy) == "fp8-blocks"
    if strategy.frozen_in_fp8 and not fp8:
        logger.info(
            "%s: the frozen %s model keeps BF16, not FP8 blocks, under DeepSpeed ZeRO-3 (its parameters are "
            "partitioned and all-gathered, and that has no float8)",
            strategy.name,
            role,
        )
    # A published FP8 checkpoint's layers from their stored values: frozen FP8 ones stay as published.
    restore_published_fp8(model, keep_frozen_fp8=fp8)
    dtype = torch.bfloat16 if fp8 else strategy.compute_dtype
    minimum = getattr(strategy.options, "min_gemm_features", 0)
    converted = _to_block_fp8(model, minimum, {id(p) for p in kept_parameters(model, dtype)}) if fp8 else 0
    if not fp8:  # FP8 layers of a model trained here: plain ones holding the real weights
        _to_plain_layers(model, dtype)
    head = _output_embeddings(model) if head_fp32 else set()
    wide = {id(p) for p in kept_parameters(model, dtype)}  # as `from_pretrained(dtype=dtype)` keeps them
    for module in model.modules():
        if isinstance(module, FrozenBlockFP8Linear):
            if module.bias is not None:
                module.bias.data = module.bias.data.to(dtype)
            continue
        for param in module.parameters(recurse=False):
            target = torch.float32 if id(param) in wide else dtype
            if (
                param.is_floating_point()
                and param.dtype != target
                and param.dtype.itemsize >= 2
                and id(param) not in head
            ):
                param.data = param.data.to(target)
    footprint = frozen_footprint(model)
    facts = {"role": role, "storage": _storage(strategy), "strategy": strategy.name, "fp8_layers": converted}
    model.__dict__[FROZEN_ATTR] = {**facts, **footprint}
    logger.info(
        "%s: the frozen %s model keeps %.2f bytes/param in its decoder blocks (%s), %.1f MB in all",
        strategy.name,
        role,
        footprint["blocks_bytes_per_param"],
        _storage(strategy),
        footprint["bytes"] / 1e6,
    )
    return model


def frozen_candidates(value: Any, trained: Any) -> list[nn.Module]:
    """The modules in `value` (a model, a list of reward functions, a name) but the `trained` one."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, nn.Module) and v is not trained]


def freeze_all(
    strategy: PrecisionStrategy, value: Any, role: str, build: Any, head_fp32: bool = False, *, trained: Any = None
) -> Any:
    """`value` (a model, a list of reward functions, a name) with its plain modules frozen, the
    `trained` model apart (a trainer's own checks decide about it); `build` makes a fresh strategy."""
    if isinstance(value, list):
        return [freeze_all(strategy, v, role, build, head_fp32, trained=trained) for v in value]
    if not isinstance(value, nn.Module):
        return value  # a name TRL loads later, or a reward function
    if value is trained:
        logger.warning("the %s model is the trained model itself: it is not frozen", role)
        return value
    if not is_plain_module(value):
        logger.warning(
            "the frozen %s model is wrapped (%s) by the time it is seen: kept as prepared", role, type(value).__name__
        )
        return value
    fresh = build() if strategy.options.frozen_models == "policy" else strategy
    return freeze_model(fresh, value, role, head_fp32=head_fp32)


def _to_plain_layers(model: nn.Module, dtype: torch.dtype) -> None:
    """Swap each `FP8Linear` for the layer it replaced (`nn.Linear`, or GPT-2's `Conv1D`) and give
    each FP8 experts module its own class back, holding the real weights (a scaled master divided
    by its scale: exact, a power of two) in `dtype`."""
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    for fqn, module in list(model.named_modules()):
        if isinstance(module, FP8Linear):
            real = module.weight.detach()
            scale = module.master_scale
            real = (dequantize(real, scale) if scale is not None else real.float()).to(dtype)
            transposed = module.weight_transposed
            with torch.device("meta"):
                if transposed and conv1d is not None:
                    plain: nn.Module = conv1d(module.out_features, module.in_features)
                else:
                    plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
                    real = real.t() if transposed else real  # Conv1D holds in × out
            plain.weight = nn.Parameter(real.contiguous(), requires_grad=False)
            plain.bias = module.bias
            plain.train(module.training)
            parent, _, child = fqn.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, plain)
        elif isinstance(module, FP8Experts):
            for name, scale in module._master_scales.items():
                real = dequantize(getattr(module, name).detach(), scale).to(dtype)
                set_master_scale(getattr(module, name), None)
                setattr(module, name, nn.Parameter(real, requires_grad=False))
                delattr(module, name + "_master_scale")
            module.__class__ = type(module).__bases__[-1]  # (FP8Experts, its class): `fp8.experts._fp8_class`
            module.__dict__.pop("fp8_layer_config", None)
            for hooks in (module._state_dict_hooks, module._load_state_dict_pre_hooks):
                for key, hook in list(hooks.items()):  # the real-weights export/import of FP8 masters
                    if getattr(getattr(hook, "hook", hook), "__module__", "") == FP8Experts.__module__:
                        del hooks[key]


def _output_embeddings(model: nn.Module) -> set[int]:
    """ids of the output embeddings' parameters (kept in their dtype under TRL's `cast_lm_head_to_fp32`)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    return {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()


def _to_block_fp8(model: nn.Module, min_gemm_features: int = 0, kept: set[int] | frozenset[int] = frozenset()) -> int:
    """Swap the decoder blocks' linear layers (those under a numbered block; not the LM head, a
    classifier head, layers tied to an embedding, nor those whose weight's id is in `kept`) for
    `FrozenBlockFP8Linear`s; returns how many."""
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    skips = default_skips(model, min_gemm_features)  # the policy's own skips: LM head, tied, too small
    swaps = []
    for fqn, module in model.named_modules():
        # FP8Linear: a model trained here first (a reward model), its weight a scaled master.
        linear = type(module) in (nn.Linear, FP8Linear)
        if not (linear or (conv1d is not None and type(module) is conv1d)) or id(module) in skips or not fqn:
            continue
        if not any(part.isdigit() for part in fqn.split(".")):  # outside the blocks: a head (score, classifier)
            continue
        if module.weight.numel() == 0 or id(module.weight) in kept:
            continue
        swaps.append((fqn, module, linear))
    for fqn, module, linear in swaps:
        weight = module.weight.detach().float()
        # Conv1D (and an FP8Linear made of one) holds in × out.
        weight = weight.t() if not linear or getattr(module, "weight_transposed", False) else weight
        master_scale = getattr(module, "master_scale", None)  # payload = real · s_m
        if master_scale is not None:
            weight = weight / master_scale.float()
        payload, scale_inv = quantize_published(weight, BLOCK)
        frozen = FrozenBlockFP8Linear(payload, scale_inv, module.bias, block=BLOCK)
        frozen.requires_grad_(False)
        parent, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, frozen)
    return len(swaps)


def frozen_footprint(model: nn.Module) -> dict[str, float]:
    """Bytes the model keeps (parameters and buffers), and bytes per parameter in its decoder
    blocks: every module but the input and output embeddings, scales counted as bytes, not as
    parameters."""
    edges: set[int] = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        get = getattr(model, getter, None)
        edge = get() if callable(get) else None
        if isinstance(edge, nn.Module):
            edges.update(id(p) for p in edge.parameters())
    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    block_bytes = block_params = 0
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in edges:
                continue
            block_bytes += param.numel() * param.element_size()
            if not (isinstance(module, FrozenBlockFP8Linear) and name == "weight_scale_inv"):
                block_params += param.numel()
    return {
        "bytes": float(total),
        "params": float(block_params),
        "blocks_bytes_per_param": block_bytes / block_params if block_params else float("nan"),
    }
