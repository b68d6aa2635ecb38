"""The grouped-GEMM forward of transformers' fused MoE experts, in BF16 for 16-bit training.

Autocast has no rule for `torch._grouped_mm`, so under bf16-mixed the experts got FP32 weights
and tokens: FP32 GEMMs, and on a GPU torch's per-group fallback, which reads the offsets on the
host. `GroupedExperts` gives them the rule autocast would have (BF16 operands, gradients to the
masters through the casts), under a 16-bit autocast and for FP16 weights without one; otherwise
the module's own forward runs. The FP8 experts (`fp8/experts.py`) share its routing. The rule:
docs/algorithms.md §6.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "GroupedExperts",
    "expert_gemm_shapes",
    "expert_weight_names",
    "install_grouped_experts",
    "is_experts_module",
    "routed_experts",
]

_SIXTEEN_BITS = (torch.bfloat16, torch.float16)


def is_experts_module(module: nn.Module) -> bool:
    """A transformers experts module with fused 3-D weights (`@use_experts_implementation`)."""
    if not all(hasattr(module, a) for a in ("has_gate", "is_transposed", "has_bias")):
        return False
    down = getattr(module, "down_proj", None)
    first = getattr(module, "gate_up_proj" if module.has_gate else "up_proj", None)
    return all(isinstance(p, nn.Parameter) and p.dim() == 3 for p in (first, down))


def expert_weight_names(module: nn.Module) -> tuple[str, str]:
    """(first projection, down projection) parameter names of an experts module."""
    return ("gate_up_proj" if module.has_gate else "up_proj"), "down_proj"


def expert_gemm_shapes(module: nn.Module) -> list[tuple[str, int, int, int]]:
    """(name, experts, out_features N, in_features K) of each expert weight, in logical N × K."""
    shapes = []
    for name in expert_weight_names(module):
        e, a, b = getattr(module, name).shape
        n, k = (b, a) if module.is_transposed else (a, b)
        shapes.append((name, e, n, k))
    return shapes


def routed_experts(
    module: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The experts' output for every token, with `module._project` as the grouped GEMM:

        sort the (token, expert) pairs by expert → offsets (cumulative tokens per expert, on device)
        h  = x_g · W_gate_upᵀ[e]   (+ bias[e])     grouped GEMM
        a  = gate(h)                               the module's own (`_apply_gate` or `act_fn`)
        y  = a · W_downᵀ[e]        (+ bias[e])     grouped GEMM
        out[t] = Σ_k routing_weight[t, k] · y[(t, k)]   summed in FP32, then the input's dtype

    `dtype`: the gathered tokens are cast to it (as transformers' own grouped forward does). Nothing
    is read on the host: the offsets are a `searchsorted` of the sorted ids on the device.
    """
    num_top_k = top_k_index.shape[-1]
    num_tokens, hidden = hidden_states.shape
    sorted_ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)
    x = hidden_states[perm // num_top_k]  # gathered, then cast: the gather's backward adds in FP32
    x = x if dtype is None else x.to(dtype)
    weights = top_k_weights.reshape(-1)[perm]
    # Expert e's group ends where the sorted ids first exceed e: two launches, no counts to sum.
    ends = torch.arange(1, module.num_experts + 1, device=x.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, ends, out_int32=True)
    rows = sorted_ids.long()
    first, down = expert_weight_names(module)
    h = module._project(first, x, offsets, rows)
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    y = module._project(down, h, offsets, rows)
    if getattr(module, "has_post_expert_norm", False):
        y = module.post_expert_norm(y)
    weighted = y * weights.unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.shape[0], device=perm.device)
    out = weighted[inverse].view(num_tokens, num_top_k, hidden).sum(dim=1)
    return out.to(hidden_states.dtype)


@torch.compiler.assume_constant_result
def _has_bf16_gemms(device: torch.device) -> bool:
    """Whether `device` multiplies BF16 (every CPU; a CUDA GPU from Ampere on)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 0)


def _grouped_dtype(device: torch.device, tokens: torch.dtype) -> torch.dtype | None:
    """BF16 for the grouped GEMMs of 16-bit training on `device` (where it has BF16 GEMMs), else None.

    Inside a 16-bit autocast (bf16-mixed, fp16-mixed), and for FP16 tokens outside one (fp16-als's
    FP16 weights): torch's one grouped GEMM kernel on a GPU takes BF16 (any other dtype runs group
    by group from offsets read on the host), and under `torch.compile` it refuses FP16 operands
    outright. BF16 keeps FP32's range, so a loss-scaled gradient fits it as it fits FP16; its 8
    significant bits are bf16-mixed's, in the experts' GEMMs only.
    """
    if not _has_bf16_gemms(device):
        return None
    if torch.is_autocast_enabled(device.type):
        sixteen = torch.get_autocast_dtype(device.type) in _SIXTEEN_BITS
    else:
        sixteen = tokens == torch.float16
    return torch.bfloat16 if sixteen else None


class GroupedExperts(nn.Module):
    """What `install_grouped_experts` mixes into a transformers experts class (never built
    directly): inside a 16-bit autocast, and for FP16 tokens outside one, the grouped GEMMs take
    BF16 weights and tokens (`_grouped_dtype`), as autocast gives `nn.Linear` 16-bit ones;
    otherwise the class's own forward (its configured implementation) runs as before. The
    parameters, their dtypes and names do not change; the gradients keep the weights' dtype."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Any:
        dtype = _grouped_dtype(hidden_states.device, hidden_states.dtype)
        if dtype is None or getattr(self, "_is_expert_parallel", False):
            return super().forward(hidden_states, top_k_index, top_k_weights)
        return routed_experts(self, hidden_states, top_k_index, top_k_weights, dtype)

    def _project(self, name: str, x: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """x · W[e]ᵀ per group in the tokens' dtype (FP32 accumulation, one rounding), + bias[e]."""
        weight = getattr(self, name).to(x.dtype)
        out = torch._grouped_mm(x, weight if self.is_transposed else weight.transpose(-2, -1), offs=offsets)
        bias = getattr(self, name + "_bias", None) if self.has_bias else None
        if bias is not None:
            # The grouped GEMM's BF16 result plus the bias in FP32, rounded again (torch's fast
            # grouped kernel returns BF16 only): two roundings where autocast's linear has one.
            out = torch.add(out, bias[rows]).to(out.dtype)
        return out


_GROUPED_CLASSES: dict[type, type] = {}


def _grouped_class(cls: type) -> type:
    if cls not in _GROUPED_CLASSES:
        _GROUPED_CLASSES[cls] = type(f"Grouped{cls.__name__}", (GroupedExperts, cls), {"__module__": __name__})
    return _GROUPED_CLASSES[cls]


def install_grouped_experts(model: nn.Module) -> list[str]:
    """Give every experts module of `model` the 16-bit grouped forward (`GroupedExperts`), in
    place; one already converted (FP8 experts included) is left as it is. Returns their names.

    Only the `grouped_mm` implementation (transformers' default) is taken over: `eager` and
    `batched_mm` run `F.linear` and `torch.bmm`, which autocast already casts.
    """
    names = []
    for fqn, module in model.named_modules():
        if not is_experts_module(module) or isinstance(module, GroupedExperts):
            continue
        implementation = getattr(getattr(module, "config", None), "_experts_implementation", "grouped_mm")
        if implementation not in (None, "grouped_mm"):
            continue
        module.__class__ = _grouped_class(type(module))
        names.append(fqn or "<root>")
    return names
