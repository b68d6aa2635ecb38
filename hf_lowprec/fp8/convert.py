"""The FP8 conversion of a model: `convert_to_fp8` swaps linear layers for `FP8Linear` and gives
transformers' fused Mixture-of-Experts modules FP8 grouped GEMMs (`fp8/experts.py`).

One generic swap with keyword-only options and a `module_filter(module, fqn) -> bool`; the layers
FP8 cannot help or cannot run are kept in high precision, each logged with the reason and listed
for the startup report (`model.fp8_skipped_layers`).
"""

from __future__ import annotations

import collections
import logging
import sys
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils import parametrize

from .experts import FP8Experts, convert_experts
from .gemm import GEMM_MULTIPLE
from .linear import FP8Linear
from .payoff import PayoffReason, PayoffRule
from .scaling_recipes import FP8LinearConfig, ScalingRecipe, fp8_config

__all__ = [
    "ModuleFilter",
    "attention_gemms",
    "conv1d_class",
    "convert_to_fp8",
    "DimensionReason",
    "default_skips",
    "fp8_layer_configs",
    "dimension_problem",
    "is_gemm_layer",
    "output_heads",
    "peft_adapter_layers",
]

logger = logging.getLogger(__name__)

ModuleFilter = Callable[[nn.Module, str], bool]


def conv1d_class() -> type | None:
    """transformers' GPT-2 `Conv1D`, if transformers has loaded it (None otherwise)."""
    # A model built from GPT-2's Conv1D has imported its module already; looking it up instead
    # of importing keeps conversion of plain torch models free of the transformers import.
    module = sys.modules.get("transformers.pytorch_utils")
    return getattr(module, "Conv1D", None)


def is_gemm_layer(module: nn.Module) -> bool:
    """Whether `module` runs a GEMM layer's forward: `nn.Linear`, `FP8Linear` or GPT-2's `Conv1D`
    (subclasses included), as COAT's activation compression recognises them."""
    conv1d = conv1d_class()
    return isinstance(module, (nn.Linear, FP8Linear)) or (conv1d is not None and isinstance(module, conv1d))


def output_heads(model: nn.Module) -> list[nn.Module]:
    """The output heads of the transformers task model in `model` (PEFT-wrapped or not): what it
    holds beside its backbone, the submodule its `base_model_prefix` names (the `score` or
    `classifier` of a sequence classifier, `qa_outputs`, `lm_head`, BERT's `cls`), as transformers
    builds every task model: one backbone and the head(s) reading its hidden states. Empty when
    transformers is not loaded, or the model has no such backbone (the LM head is then still
    found through `get_output_embeddings`)."""
    pretrained = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    if pretrained is None:
        return []
    task = next((m for m in model.modules() if isinstance(m, pretrained)), None)  # the outermost
    prefix = getattr(task, "base_model_prefix", None)
    backbone = getattr(task, prefix, None) if isinstance(prefix, str) and prefix else None
    if task is None or not isinstance(backbone, nn.Module) or backbone is task:
        return []
    return [child for child in task.children() if child is not backbone]


def default_skips(model: nn.Module, min_gemm_features: int = 0, rule: PayoffRule | None = None) -> dict[int, str]:
    """id(module) → reason, for the output heads (the LM head, a task model's head: `output_heads`),
    every layer in a PEFT `modules_to_save` module (a head trained whole), layers whose weight is
    an embedding's, GEMMs with both dimensions below `min_gemm_features`, and (with a `rule`)
    layers FP8 would not speed up."""
    skips: dict[int, str] = {}
    conv1d = conv1d_class()
    for module in model.modules():
        if parametrize.is_parametrized(module):  # its `weight` computed at each read (spectral_norm iterates)
            continue  # (an nn.Linear subclass: kept high precision by the conversion)
        weight = getattr(module, "weight", None)  # a parametrization's `weight` is a module
        if isinstance(module, nn.Embedding) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        if max(weight.shape) < min_gemm_features:
            rows, cols = weight.shape
            skips[id(module)] = (
                f"its GEMM is too small to gain from FP8 ({rows}×{cols} weight, both dimensions "
                f"below min_gemm_features={min_gemm_features})"
            )
        elif rule is not None and is_gemm_layer(module):
            k, n = weight.shape if conv1d is not None and isinstance(module, conv1d) else weight.shape[::-1]
            payoff = rule.linear(k, n)
            if not payoff.pays:
                skips[id(module)] = rule.reason(payoff)
    for head in output_heads(model):  # as the LM head: the logits FP8 would degrade most
        for module in head.modules():
            skips[id(module)] = "it is the task model's output head, kept high precision as the LM head is"
    saved = getattr(sys.modules.get("peft.utils.other"), "ModulesToSaveWrapper", None)
    for wrapper in (m for m in model.modules() if saved is not None and isinstance(m, saved)):
        for module in wrapper.modules():  # the original and every adapter's copy
            skips[id(module)] = "it is in PEFT's modules_to_save (trained whole, as a head is: kept high precision)"
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for module in model.modules():
        weight = None if parametrize.is_parametrized(module) else getattr(module, "weight", None)
        if (
            isinstance(weight, torch.Tensor)
            and id(weight) in embedding_weights
            and not isinstance(module, nn.Embedding)
        ):
            skips[id(module)] = "its weight is tied to an embedding"
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if isinstance(head, nn.Module):  # every layer in it: PEFT's modules_to_save wraps the head
        for module in head.modules():
            skips[id(module)] = "it is the LM head (output embeddings), which FP8 degrades most"
    for module in peft_adapter_layers(model):
        skips[id(module)] = AdapterReason(
            "it is a PEFT adapter layer (a rank-r GEMM FP8 would not speed up, whose weight PEFT's merge reads)"
        )
    return skips


def attention_gemms(model: nn.Module) -> dict[str, str]:
    """fqn → reason for the GEMMs of every `nn.MultiheadAttention` (torch's encoder layers, SigLIP's
    pooling head): its forward hands `in_proj_weight` (or q/k/v_proj_weight) and `out_proj.weight`
    to `F.multi_head_attention_forward` directly, so they stay high precision, whatever a filter says."""
    out: dict[str, str] = {}
    for fqn, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            why = "F.multi_head_attention_forward, which no FP8 layer swap reaches: kept high precision"
            weights = "in_proj_weight" if module.in_proj_weight is not None else "q/k/v_proj_weight"
            out[fqn or "<root>"] = f"nn.MultiheadAttention passes its {weights} (the q/k/v GEMM) to {why}"
            out[f"{fqn}.out_proj" if fqn else "out_proj"] = f"nn.MultiheadAttention passes out_proj.weight to {why}"
    return out


class DimensionReason(str):
    """Why FP8 GEMMs cannot take a layer: its dimensions (`dimension_problem`)."""


def dimension_problem(module: nn.Module, multiple: int = GEMM_MULTIPLE, blocks: str = "") -> DimensionReason | None:
    """Why FP8 GEMMs cannot take GEMM layer `module`'s dimensions (None: they can): both must be
    multiples of `multiple` (16 for `_scaled_mm`; a block recipe's, named `blocks`, for its blocks)."""
    conv1d = conv1d_class()
    weight = module.weight
    k, n = weight.shape if conv1d is not None and isinstance(module, conv1d) else weight.shape[::-1]
    bad = [f"{label}={d}" for label, d in (("in_features", k), ("out_features", n)) if d % multiple]
    if k == 0 or n == 0:  # no amax to scale from, no GEMM to run
        return DimensionReason(f"it has no elements (in_features={k}, out_features={n})")
    if bad:
        need = "FP8 GEMM requirement" if multiple == GEMM_MULTIPLE else f"FP8 GEMM and {blocks} blocks"
        return DimensionReason(f"{', '.join(bad)} not a multiple of {multiple} ({need})")
    return None


class AdapterReason(str):
    """Why a PEFT adapter layer keeps high precision: by design, logged as information."""


def peft_adapter_layers(model: nn.Module) -> list[nn.Module]:
    """The modules PEFT's tuner layers add beside their base layer (LoRA's `lora_A`, `lora_B`, …),
    if PEFT is loaded (a model holds tuner layers only then)."""
    tuners = getattr(sys.modules.get("peft.tuners.tuners_utils"), "BaseTunerLayer", None)
    if tuners is None:
        return []
    out: list[nn.Module] = []
    for layer in model.modules():
        if isinstance(layer, tuners):
            base = {id(m) for m in layer.get_base_layer().modules()}
            out += [m for m in layer.modules() if m is not layer and id(m) not in base]
    return out


def fp8_layer_configs(model: nn.Module) -> dict[str, int]:
    """ "recipe R, margin M" → how many FP8 layers of `model` (`FP8Linear`, FP8 experts modules) hold
    that scaling recipe and margin, the most held first (the guard's raising to BF16 left out)."""
    configs = [m.config for m in model.modules() if isinstance(m, FP8Linear)]
    configs += [m.fp8_layer_config for m in model.modules() if isinstance(m, FP8Experts)]
    counts = collections.Counter(f"recipe {c.recipe.name}, margin {c.margin}" for c in configs)
    return dict(counts.most_common())


def convert_to_fp8(
    model: nn.Module,
    *,
    module_filter: ModuleFilter | None = None,
    config: FP8LinearConfig | None = None,
    margin: int = 0,
    recipe: str | ScalingRecipe = "tensorwise",
    min_gemm_features: int = 0,
    rule: PayoffRule | None = None,
) -> nn.Module:
    """Swap `nn.Linear` and GPT-2 `Conv1D` layers for `FP8Linear`, and give every fused experts
    module (transformers' MoE blocks) FP8 grouped GEMMs, in place; returns `model`.

    Args:
        model: any module tree.
        module_filter: `filter(module, fqn) -> bool`, True to convert. It replaces the default
            filter, which skips the output heads (the LM head, a classifier's), PEFT's
            `modules_to_save`, layers tied to embeddings and (with `min_gemm_features`) small GEMMs.
        config: the new layers' configuration (`fp8_config`: recipe, margin, GEMM path), shared
            by every layer and experts module; without one, `margin` and `recipe` build it.
        min_gemm_features: default filter: a layer whose in_features and out_features are both
            below this keeps high precision (its GEMM is too small for FP8 to gain: the casts
            cost more than the faster GEMM saves, as torchtitan's auto filter reasons). 0: off.
        rule: default filter: keep in high precision each layer and experts module whose
            training GEMMs would not run faster in FP8, casts included, on the rule's GPU
            (`payoff.payoff_rule`; docs/strategies/fp8-lm.md, "Where FP8 pays"). None: off.

    Layers whose two dimensions are not multiples of 16 (what `_scaled_mm` needs on CUDA) and of
    the recipe's blocks (128 for blockwise, 32 for mxfp8: no partial block along a weight's
    dimensions), layers with a zero dimension, subclasses of `nn.Linear` (whose own forward a
    swap would drop) and the GEMMs of `nn.MultiheadAttention` (`attention_gemms`) are always
    skipped. Each skip is logged as a warning naming the layer and the reason, and listed in the
    startup report (`model.fp8_skipped_layers`).

    FP8 layers already in the model (a conversion made before a strategy's) keep their own
    recipe and margin; where they differ from `config`'s, one warning says so and how to agree.
    """
    config = config or fp8_config(recipe, margin)
    ours = f"recipe {config.recipe.name}, margin {config.margin}"
    theirs = {c: n for c, n in fp8_layer_configs(model).items() if c != ours}
    if theirs:
        logger.warning(
            "FP8: %d FP8 layers already in the model keep their own configuration (%s), not this conversion's "
            "(%s: a precision strategy's recipe and margin options): their GEMMs scale as they were made. "
            "To train with one configuration, pass the strategy the recipe and margin the model was "
            "converted with, or let the strategy convert (do not call convert_to_fp8 before it)",
            sum(theirs.values()),
            "; ".join(f"{n} with {c}" for c, n in theirs.items()),
            ours,
        )
    multiple = config.recipe.dim_multiple
    if not isinstance(min_gemm_features, int) or min_gemm_features < 0:
        raise ValueError(f"min_gemm_features must be an integer >= 0, got {min_gemm_features!r}")
    if module_filter is not None and not callable(module_filter):
        raise ValueError(f"module_filter must be a callable filter(module, fqn) -> bool, got {module_filter!r}")
    conv1d = conv1d_class()
    skips = default_skips(model, min_gemm_features, rule) if module_filter is None else {}
    swaps: list[tuple[str, nn.Module]] = []
    skipped = attention_gemms(model)
    for name, reason in skipped.items():
        logger.warning("FP8: skipped layer %s: %s", name, reason)
    for fqn, module in model.named_modules():
        is_linear = isinstance(module, nn.Linear)
        is_conv1d = conv1d is not None and type(module) is conv1d
        if not (is_linear or is_conv1d):
            continue
        name = fqn or "<root>"
        if name in skipped:  # an nn.MultiheadAttention's out_proj: no swap reaches it
            continue
        if module_filter is not None and not module_filter(module, fqn):
            logger.info("FP8: kept %s in high precision (rejected by module_filter)", name)
            skipped[name] = "rejected by module_filter"
            continue
        reason = skips.get(id(module))
        if reason is None and is_linear and type(module) is not nn.Linear:
            reason = f"it is a subclass of nn.Linear ({type(module).__name__}) with its own behaviour"
        if reason is None:
            reason = dimension_problem(module, multiple, config.recipe.name)
        if reason is not None:
            log = logger.info if isinstance(reason, (PayoffReason, AdapterReason)) else logger.warning
            log("FP8: skipped layer %s: %s", name, reason)
            skipped[name] = reason
            continue
        swaps.append((fqn, module))
    if any(fqn == "" for fqn, _ in swaps):
        raise ValueError("convert_to_fp8 converts layers inside a model; wrap a bare layer with FP8Linear.from_float")
    for fqn, module in swaps:
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, FP8Linear.from_float(module, config=config))
    logger.info("FP8: converted %d layers to FP8Linear", len(swaps))
    # The experts' fused 3-D weights: the same filter, recipe and margin (the router is no
    # experts module and keeps high precision).
    experts, experts_skipped = convert_experts(
        model, config=config, module_filter=module_filter, rule=rule if module_filter is None else None
    )
    skipped.update(experts_skipped)
    # Read by the startup report (hf_lowprec.report.describe): which layers stayed high precision and why.
    model.__dict__.setdefault("fp8_skipped_layers", {}).update(skipped)
    model.__dict__.setdefault("fp8_experts", []).extend(experts)
    return model
