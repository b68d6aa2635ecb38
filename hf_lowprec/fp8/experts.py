"""FP8 expert GEMMs for the fused Mixture-of-Experts modules of transformers 5.

transformers keeps a MoE block's experts as fused 3-D parameters in one `...Experts` module and
runs them through whichever implementation its config names. `convert_experts` gives such a module
one forward of FP8 grouped GEMMs (`fp8/grouped.py`) instead, so the numerics do not depend on the
implementation; the rules are docs/algorithms.md §3 ("FP8 for Mixture-of-Experts").
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..distributed import local_shard, sharded_like
from ..grouped_experts import (  # the names of experts modules, importable from here too, as before
    GroupedExperts,
    expert_gemm_shapes,
    expert_weight_names,
    is_experts_module,
    routed_experts,
)
from .grouped import (  # noqa: F401  (the grouped GEMM's names, importable from here too)
    dequantize_expert_weight,
    dequantize_rows,
    fp8_grouped_linear,
    quantize_expert_weight,
    quantize_rows,
    token_groups,
)
from .payoff import PayoffReason, PayoffRule
from .scaled import dequantize, fp32_scale, get_master_scale, pow2_scale, quantize, set_master_scale, tensor_amax
from .scaling_recipes import FP8LinearConfig, ScalingRecipe, fp8_config

__all__ = [
    "FP8Experts",
    "convert_experts",
    "expert_gemm_shapes",
    "expert_weight_names",
    "experts_modules",
    "fp8_grouped_linear",
    "is_experts_module",
    "weight_gemm_share",
]

logger = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn


# --- the module --------------------------------------------------------------------------------


class FP8Experts(GroupedExperts):
    """What `convert_experts` mixes into a transformers experts class: its forward with FP8
    grouped GEMMs. Never built directly: the converted module keeps its own class's attributes
    and methods (`_apply_gate`, `act_fn`, ...) and parameters.

    O2 (scaled FP16 masters) and O3 (FP8-stored weights with gradient sinks) work as in
    `linear.FP8Linear`: one master scale per 3-D weight (`<name>_master_scale` buffers, linked
    with `set_master_scale`), real values in the state dict.
    """

    fp8_layer_config: FP8LinearConfig = fp8_config()
    # One weight scale for all experts (set by fp8-lm-o3: what its non-owning ranks compute with).
    fp8_tensor_scale: bool = False

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """One forward for every experts implementation transformers could have picked: the
        routing of `grouped_experts.routed_experts`, with FP8 grouped GEMMs as its projections. The
        router (a plain weight and a top-k) runs before this and is not touched: it stays in
        high precision, as in torchtitan and DeepSeek-V3.
        """
        if getattr(self, "_is_expert_parallel", False):
            raise NotImplementedError("FP8 experts do not run under expert parallelism; shard with FSDP2 or ZeRO")
        self._link_master_scales()
        return routed_experts(self, hidden_states, top_k_index, top_k_weights)

    def _project(self, name: str, x: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        weight = getattr(self, name)
        out = fp8_grouped_linear(
            x,
            weight,
            offsets,
            rows,
            transposed=self.is_transposed,
            config=self.fp8_layer_config,
            master_scale=self._master_scales.get(name),
            tensor_scale=self.fp8_tensor_scale,
        )
        bias = getattr(self, name + "_bias", None) if self.has_bias else None
        if bias is not None:
            # As in the dense layers: the bias joins the BF16 GEMM result in FP32, rounded once.
            out = torch.add(out, bias[rows]).to(out.dtype)
        return out

    @property
    def fp8_recipe(self) -> str:
        """The name of the experts' scaling recipe."""
        return self.fp8_layer_config.name

    @property
    def fp8_margin(self) -> int:
        """Scale margin in binades of the experts' FP8 casts."""
        return self.fp8_layer_config.margin

    # --- O2 / O3: scaled masters, FP8-stored weights ------------------------------------------

    @property
    def _master_scales(self) -> dict[str, torch.Tensor]:
        # A plain loop: dynamo cannot trace an assignment expression inside a comprehension
        # (its variable is a cell of the enclosing frame: "Read uninitialized cell"), which
        # broke every experts forward out of the compiled graph.
        scales = {}
        for name in expert_weight_names(self):
            buf = getattr(self, name + "_master_scale", None)
            if buf is not None:
                scales[name] = buf
        return scales

    def _link_master_scales(self) -> None:
        for name, scale in self._master_scales.items():
            param = getattr(self, name)
            if get_master_scale(param) is not scale:
                set_master_scale(param, scale)

    def scale_master_weights(self, margin: int = 0) -> None:
        """Turn the trainable expert weights into scaled masters (FP16 payload = real·s_m, one s_m per
        weight, chosen from its own values); a frozen one stays as it is."""
        for name in expert_weight_names(self):
            weight = getattr(self, name)
            if getattr(self, name + "_master_scale", None) is not None or not weight.requires_grad:
                continue
            if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(
                    f"scaled master weights are made from a 16- or 32-bit weight; {name} is {weight.dtype}"
                )
            with torch.no_grad():
                scale = pow2_scale(tensor_amax(weight), torch.float16, margin)
                weight.data = quantize(weight.data, scale, torch.float16)
            self.register_buffer(name + "_master_scale", scale, persistent=False)
            set_master_scale(weight, scale)
        self.fp8_master_margin = margin

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> FP8Experts:
        before = self._master_scales
        out = super()._apply(fn, recurse)
        for name, scale in before.items():  # kept FP32 through `.half()` (`linear.FP8Linear._apply`)
            setattr(self, name + "_master_scale", fp32_scale(scale, getattr(self, name + "_master_scale")))
        self._link_master_scales()  # `.to()` replaced the buffers
        return out

    def extra_repr(self) -> str:
        base = super().extra_repr()
        master = ", scaled_fp16_master" if self._master_scales else ""
        return (base + ", " if base else "") + f"fp8_recipe={self.fp8_recipe}, margin={self.fp8_margin}{master}"


def _export_real_weights(module: FP8Experts, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for name, scale in module._master_scales.items():
        key = prefix + name
        if key in state_dict:
            weight = getattr(module, name).detach()
            state_dict[key] = sharded_like(dequantize(local_shard(weight), scale, torch.float32), weight)


def _import_real_weights(module: FP8Experts, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    for name, scale in module._master_scales.items():
        key = prefix + name
        if key not in state_dict:
            continue
        loaded = state_dict[key]
        real = local_shard(loaded)
        fp8_stored = getattr(module, name).dtype == E4M3
        dtype, margin = (E4M3, module.fp8_margin) if fp8_stored else (torch.float16, module.fp8_master_margin)
        new = pow2_scale(tensor_amax(real), dtype, margin).to(scale.device)
        state_dict[key] = sharded_like(quantize(real, new, dtype), loaded)
        scale.copy_(new)


_FP8_CLASSES: dict[type, type] = {}


def _fp8_class(cls: type) -> type:
    if issubclass(cls, FP8Experts):
        return cls
    if cls not in _FP8_CLASSES:
        _FP8_CLASSES[cls] = type(f"FP8{cls.__name__}", (FP8Experts, cls), {"__module__": __name__})
    return _FP8_CLASSES[cls]


def _refusal(module: nn.Module, multiple: int, recipe: str) -> str | None:
    for name, e, n, k in expert_gemm_shapes(module):
        if 0 in (e, n, k):
            return f"{name} has no elements ({e} experts, {n}×{k})"
        bad = [f"{label}={d}" for label, d in (("in_features", k), ("out_features", n)) if d % multiple]
        if bad:
            return f"{name}: {', '.join(bad)} not a multiple of {multiple} (FP8 grouped GEMM and {recipe} blocks)"
    if getattr(module, "_is_expert_parallel", False):
        return "it runs under expert parallelism, which the FP8 experts do not support"
    return None


def convert_experts(
    model: nn.Module,
    *,
    config: FP8LinearConfig | None = None,
    recipe: str | ScalingRecipe = "tensorwise",
    margin: int = 0,
    module_filter: Callable[[nn.Module, str], bool] | None = None,
    rule: PayoffRule | None = None,
) -> tuple[list[str], dict[str, str]]:
    """Give every experts module of `model` FP8 grouped GEMMs, in place.

    transformers stores the weights (`gate_up_proj` or `up_proj`, `down_proj`, biases for
    gpt-oss) as `[experts, out, in]`, or `[experts, in, out]` where the class says
    `is_transposed`, and runs them through the implementation `config._experts_implementation`
    names (an `eager` loop of `F.linear`, `batched_mm`, `grouped_mm`). None of them is an
    `nn.Linear`, so `convert.convert_to_fp8` swaps the module's class instead (to a subclass of
    `FP8Experts`): the parameters, their names and the module's own gate (`_apply_gate`: SwiGLU,
    gpt-oss's clamped GLU), activation and post-expert norm stay as they are.

    Returns (converted module names, {skipped name: reason}). A module whose weights are not
    multiples of 16 and of the recipe's blocks keeps its own forward, with the reason logged, as
    does one whose grouped GEMMs FP8 would not speed up on `rule`'s GPU (`payoff.PayoffRule`).
    """
    config = config or fp8_config(recipe, margin)
    multiple = config.recipe.dim_multiple
    converted: list[str] = []
    skipped: dict[str, str] = {}
    for fqn, module in list(model.named_modules()):
        if not is_experts_module(module) or isinstance(module, FP8Experts):
            continue
        name = fqn or "<root>"
        if module_filter is not None and not module_filter(module, fqn):
            skipped[name] = "rejected by module_filter"
            continue
        reason = _refusal(module, multiple, config.recipe.name)
        if reason is None and rule is not None and not (payoff := rule.experts(module)).pays:
            reason = rule.reason(payoff)
        if reason is not None:
            log = logger.info if isinstance(reason, PayoffReason) else logger.warning
            log("FP8: kept experts %s in high precision: %s", name, reason)
            skipped[name] = reason
            continue
        module.__class__ = _fp8_class(type(module))
        module.fp8_layer_config = config
        module.register_state_dict_post_hook(_export_real_weights)
        module.register_load_state_dict_pre_hook(_import_real_weights)
        converted.append(name)
    if converted:
        logger.info("FP8: %d experts modules run FP8 grouped GEMMs (%s recipe)", len(converted), config.recipe.name)
    return converted, skipped


def experts_modules(model: nn.Module) -> Iterator[tuple[str, FP8Experts]]:
    """The converted experts modules of `model`, with their names."""
    for fqn, module in model.named_modules():
        if isinstance(module, FP8Experts):
            yield fqn, module


# --- how much of the model's weight GEMMs run in FP8 --------------------------------------------


def weight_gemm_share(model: nn.Module) -> dict[str, Any]:
    """The share of a token's weight-GEMM multiply-adds that run in FP8, read from the modules.

    Counted per token of the forward: every linear layer (in × out), every experts module
    (top-k × Σ out × in over its weights), every `nn.MultiheadAttention`'s q/k/v projection (never FP8). The LM head (output embeddings) and the routers
    (plain weights and a top-k, never linear layers) are left out, as every FP8 library keeps
    them in high precision. A layer counts as FP8 when its GEMM takes an FP8 payload.
    """
    from .blocks import FrozenBlockFP8Linear
    from .linear import FP8Linear

    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    # GPT-2's Conv1D, looked up (a model built from it has imported it), as convert.py does.
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    dense = (nn.Linear, FP8Linear, FrozenBlockFP8Linear) + ((conv1d,) if conv1d is not None else ())
    total = fp8 = experts_total = experts_fp8 = 0
    for module in model.modules():
        if module is head:
            continue
        if is_experts_module(module):
            config = getattr(module, "config", None)
            top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "top_k", 1)
            macs = top_k * sum(n * k for _, _, n, k in expert_gemm_shapes(module))
            experts_total += macs
            experts_fp8 += macs if isinstance(module, FP8Experts) else 0
        elif isinstance(module, nn.MultiheadAttention):  # its q/k/v GEMM; out_proj is a Linear below
            weights = [module.in_proj_weight, module.q_proj_weight, module.k_proj_weight, module.v_proj_weight]
            total += sum(w.numel() for w in weights if w is not None)
        elif isinstance(module, dense) and getattr(module, "weight", None) is not None:
            macs = module.weight.numel()
            total += macs
            fp8 += macs if isinstance(module, (FP8Linear, FrozenBlockFP8Linear)) else 0
    total += experts_total
    fp8 += experts_fp8
    return {
        "share": fp8 / total if total else 0.0,
        "experts_share": experts_total / total if total else 0.0,
        "experts_fp8": experts_fp8 == experts_total,
    }
