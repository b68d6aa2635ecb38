"""FP8 expert GEMMs for the fused Mixture-of-Experts modules of transformers 5 (docs/algorithms.md §3.6).

transformers keeps a MoE block's experts as fused 3-D parameters in one `...Experts` module
(`gate_up_proj` or `up_proj`, `down_proj`, biases for gpt-oss; stored `[experts, out, in]`, or
`[experts, in, out]` where the class says `is_transposed`) and runs them through whichever
implementation `config._experts_implementation` names (an `eager` loop of `F.linear`,
`batched_mm`, `grouped_mm`). None of them is an `nn.Linear`, so `convert_to_fp8` swaps the
module's class instead (`convert_experts`): the parameters, their names and the module's own
gate (`_apply_gate`: SwiGLU, gpt-oss's clamped GLU), activation and post-expert norm stay as
they are, and one forward replaces every implementation, so the numerics do not depend on which
one transformers picked:

    sort the (token, expert) pairs by expert → offsets (cumulative tokens per expert, on device)
    h  = x_g · W_gate_upᵀ[e]   (+ bias[e])     FP8 grouped GEMM
    a  = gate(h)                               the module's own, in high precision
    y  = a · W_downᵀ[e]        (+ bias[e])     FP8 grouped GEMM
    out[t] = Σ_k routing_weight[t, k] · y[(t, k)]

The router (a plain weight and a top-k) is not touched: it stays in high precision, as in
torchtitan and DeepSeek-V3.

Each grouped GEMM has the three GEMMs of a linear layer, per expert e over its tokens S_e:

    forward       y_e  = x_e·W_eᵀ        contraction over K (input features)
    input grad    dx_e = dy_e·W_e        contraction over N (output features)
    weight grad   dW_e = dy_eᵀ·x_e       contraction over the expert's tokens

with the scaling recipes of the dense layers (`fp8/recipes.py`), applied per expert:

| recipe | x, dy (forward, input grad) | W | x, dy (weight grad: blocks along tokens) |
|---|---|---|---|
| tensorwise | one scale per expert's tokens | one per expert | the same scales (no re-quantization) |
| rowwise | one per token | one per (expert, output channel) | one per (expert, column) |
| blockwise | 1 × 128 | 128 × 128 per expert | 128 tokens × 1 column, blocks starting at each expert's first token |
| mxfp8 | 1 × 32, E8M0 | 1 × 32 per expert, E8M0 | 32 tokens × 1 column, E8M0 |

An expert that gets no token has an amax of 0, hence a scale of 1 and a zero weight gradient
(never NaN or inf); an inf or NaN in an operand makes the payload of its scale group NaN, so the
non-finite step check sees it, as in the dense layers. Rows of the weight-gradient operands are
re-quantized from the exact real values of the saved FP8 activations where the scale must vary
along the other axis, as the dense recipes do.

GEMM path: the FP8 operands, dequantized exactly to BF16 (payload × power of two), multiplied by
`torch._grouped_mm` with FP32 accumulation and one rounding to BF16: the exact products of the
FP8 values summed in FP32, what a scaled FP8 grouped GEMM computes. Offsets stay on the device
and every shape is static (tokens × top-k), so a step needs no host sync and a compiled graph
does not depend on the routing.

O2 (scaled FP16 masters) and O3 (FP8-stored weights with gradient sinks) work as in `FP8Linear`:
one master scale per 3-D weight (`master_scale` buffers, linked with `set_master_scale`), real
values in the state dict.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import local_shard, sharded_like
from .cast import widen
from .linear import get_grad_sink
from .recipes import GEMM_OUT_DTYPE, Recipe, get_recipe, mx_scale
from .scaled import dequantize, format_max, get_master_scale, pow2_scale, quantize, set_master_scale, tensor_amax

__all__ = [
    "FP8Experts",
    "convert_experts",
    "expert_gemm_shapes",
    "expert_weight_names",
    "fp8_grouped_linear",
    "is_experts_module",
]

logger = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# The dtypes the FP8 grouped GEMM accepts as activations (its output keeps the input's, or autocast's).
_ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --- which modules are experts -----------------------------------------------------------------


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


# --- quantization ------------------------------------------------------------------------------


def _scale(recipe: Recipe, amax: torch.Tensor, dtype: torch.dtype, margin: int) -> torch.Tensor:
    return mx_scale(amax, dtype, margin) if recipe.e8m0 else pow2_scale(amax, dtype, margin)


def quantize_rows(
    recipe: Recipe,
    t: torch.Tensor,
    dtype: torch.dtype,
    margin: int,
    col_block: int | None,
    groups: torch.Tensor | None = None,
    n_groups: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, scale) of a 2-D R × C tensor with one scale per (row group, block of columns).

    `groups`: the group of each row (int64, R), `n_groups` their number (a static bound; groups
    without rows get scale 1); None: every row is its own group. `col_block`: columns per block
    (None: the whole row). The scale tensor is (groups or R) × ⌈C / col_block⌉.
    """
    rows, cols = t.shape
    bc = max(cols, 1) if col_block is None else col_block
    wide = t.detach().float()
    if cols % bc:
        wide = F.pad(wide, (0, -cols % bc))
    blocks = wide.reshape(rows, -1, bc)
    amax = blocks.abs().amax(dim=-1)  # (R, Cb); NaN propagates
    if groups is not None:
        index = groups[:, None].expand_as(amax)
        amax = amax.new_zeros(n_groups, amax.shape[1]).scatter_reduce_(0, index, amax, "amax")
    scale = _scale(recipe, amax, dtype, margin)
    factor = scale + (amax - amax)  # NaN where the group's amax is inf or NaN
    per_row = factor if groups is None else factor[groups]
    limit = format_max(dtype)
    y = (blocks * per_row[..., None]).clamp_(-limit, limit).reshape(rows, -1)[:, :cols]
    return y.to(dtype), scale


def dequantize_rows(
    payload: torch.Tensor, scale: torch.Tensor, col_block: int | None, groups: torch.Tensor | None = None
) -> torch.Tensor:
    """The real values of a `quantize_rows` payload, in FP32 (exact: power-of-two scales)."""
    rows, cols = payload.shape
    bc = max(cols, 1) if col_block is None else col_block
    wide = widen(payload, torch.float32)
    if cols % bc:
        wide = F.pad(wide, (0, -cols % bc))
    per_row = scale if groups is None else scale[groups]
    return (wide.reshape(rows, -1, bc) / per_row[..., None]).reshape(rows, -1)[:, :cols]


def _weight_blocks(recipe: Recipe, n: int, k: int) -> tuple[int, int]:
    br, bc = recipe.weight_block
    return (n if br is None else br), (k if bc is None else bc)


def quantize_expert_weight(
    recipe: Recipe, w: torch.Tensor, margin: int, master_scale: torch.Tensor | None = None, block=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 payload E × N × K, scales E × N/br × K/bc) of a logical expert weight, per expert.

    `master_scale`: w holds real·s_m (a scaled FP16 master). The dimensions are multiples of the
    recipe's blocks (`convert_experts` keeps the others in high precision).
    """
    e, n, k = w.shape
    br, bc = block or _weight_blocks(recipe, n, k)
    blocks = w.detach().float().reshape(e, n // br, br, k // bc, bc)
    amax = blocks.abs().amax(dim=(2, 4))
    if master_scale is not None:
        amax = amax / master_scale
    scale = _scale(recipe, amax, E4M3, margin)
    factor = scale + (amax - amax)
    if master_scale is not None:
        factor = factor / master_scale
    y = (blocks * factor[:, :, None, :, None]).clamp_(-format_max(E4M3), format_max(E4M3))
    return y.reshape(e, n, k).to(E4M3), scale


def dequantize_expert_weight(payload: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Real values (FP32) of an E × N × K payload with E × Nb × Kb block scales."""
    e, n, k = payload.shape
    nb, kb = scale.shape[1], scale.shape[2]
    wide = widen(payload, torch.float32).reshape(e, nb, n // nb, kb, k // kb)
    return (wide / scale[:, :, None, :, None]).reshape(e, n, k)


def _transposed_weight(
    recipe: Recipe, w8: torch.Tensor, sw: torch.Tensor, margin: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Wᵀ (E × K × N) in FP8 with the recipe's blocks along its own rows: the same payload where
    the blocks are whole or square (tensorwise, blockwise), else re-quantized from the exact
    real values (rowwise, mxfp8), as the dense recipes do."""
    br, bc = recipe.weight_block
    whole = sw.shape[1] == 1 and sw.shape[2] == 1
    if whole or (br is not None and br == bc):
        return w8.transpose(1, 2), sw.transpose(1, 2)
    real = dequantize_expert_weight(w8, sw).transpose(1, 2)
    return quantize_expert_weight(recipe, real, margin)


# --- routing groups ----------------------------------------------------------------------------


def token_groups(offsets: torch.Tensor, rows: torch.Tensor, block: int | None) -> tuple[torch.Tensor, int]:
    """(group of each token row, number of groups) for scales along the tokens of each expert:
    blocks of `block` tokens that start at each expert's first token (None: the whole expert).

    `rows`: the expert of each row (sorted). The count is a static bound (⌊S/block⌋ + E), so
    shapes do not depend on the routing.
    """
    experts = offsets.shape[0]
    if block is None:
        return rows, experts
    total = rows.shape[0]
    ends = offsets.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    starts = ends - counts
    per_expert = (counts + block - 1) // block
    base = torch.cumsum(per_expert, 0) - per_expert
    position = torch.arange(total, device=rows.device) - starts[rows]
    return base[rows] + position // block, total // block + experts


# --- the grouped GEMM --------------------------------------------------------------------------


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """BF16 `torch._grouped_mm` (FP32 accumulation, one rounding) of exact real operands."""
    return torch._grouped_mm(a.to(GEMM_OUT_DTYPE), b.to(GEMM_OUT_DTYPE), offs=offsets)


def _act_grouping(recipe: Recipe, rows: torch.Tensor, experts: int) -> tuple[torch.Tensor | None, int]:
    # Tensorwise: one scale per expert's tokens; the finer recipes scale along each token row.
    return (rows, experts) if recipe.name == "tensorwise" else (None, 0)


class _FP8GroupedLinear(torch.autograd.Function):
    """y = x·W[e]ᵀ per expert segment with FP8 GEMMs (module docstring); backward by hand."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        w8: torch.Tensor,
        sw: torch.Tensor,
        offsets: torch.Tensor,
        rows: torch.Tensor,
        recipe_name: str,
        transposed: bool,
        margin: int,
        out_dtype: torch.dtype,
        grad_sink: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        recipe = get_recipe(recipe_name)
        experts = w8.shape[0]
        groups, n_groups = _act_grouping(recipe, rows, experts)
        col = recipe.activation_block[1]
        with torch.autocast(x.device.type, enabled=False):
            x8, sx = quantize_rows(recipe, x, E4M3, margin, col, groups, n_groups)
            w_real = dequantize_expert_weight(w8, sw)  # logical E × N × K
            out = _grouped_mm(dequantize_rows(x8, sx, col, groups), w_real.transpose(1, 2), offsets)
        ctx.save_for_backward(x8, sx, w8, sw, offsets, rows)
        ctx.recipe, ctx.transposed, ctx.margin = recipe_name, transposed, margin
        ctx.x_dtype, ctx.weight_dtype, ctx.grad_sink = x.dtype, weight.dtype, grad_sink
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x8, sx, w8, sw, offsets, rows = ctx.saved_tensors
        recipe = get_recipe(ctx.recipe)
        margin, experts = ctx.margin, w8.shape[0]
        groups, n_groups = _act_grouping(recipe, rows, experts)
        col = recipe.activation_block[1]
        sink = ctx.grad_sink
        need_dw = ctx.needs_input_grad[1] or sink is not None
        grad_x = grad_w = None
        with torch.autocast(grad_out.device.type, enabled=False):
            g = grad_out.detach()
            g8 = sg = None
            if ctx.needs_input_grad[0] or (need_dw and recipe.name == "tensorwise"):
                g8, sg = quantize_rows(recipe, g, recipe.grad_dtype, margin, col, groups, n_groups)
            if ctx.needs_input_grad[0]:
                wt8, swt = _transposed_weight(recipe, w8, sw, margin)  # E × K × N
                g_real = dequantize_rows(g8, sg, col, groups)
                grad_x = _grouped_mm(g_real, dequantize_expert_weight(wt8, swt).transpose(1, 2), offsets)
                grad_x = grad_x.to(ctx.x_dtype)
            if need_dw:
                if recipe.name == "tensorwise":  # the per-expert scales hold along the tokens too
                    g_real, x_real = dequantize_rows(g8, sg, None, rows), dequantize_rows(x8, sx, None, rows)
                else:  # scales along each expert's tokens, one per column (module docstring)
                    tg, n_tg = token_groups(offsets, rows, recipe.activation_block[1])
                    gt8, sgt = quantize_rows(recipe, g, recipe.grad_dtype, margin, 1, tg, n_tg)
                    x_exact = dequantize_rows(x8, sx, col, groups)
                    xt8, sxt = quantize_rows(recipe, x_exact, E4M3, margin, 1, tg, n_tg)
                    g_real, x_real = dequantize_rows(gt8, sgt, 1, tg), dequantize_rows(xt8, sxt, 1, tg)
                grad_w = _grouped_mm(g_real.t(), x_real, offsets)  # logical E × N × K
                if ctx.transposed:
                    grad_w = grad_w.transpose(1, 2)
                if sink is not None:
                    sink(grad_w)
                    grad_w = None
                elif ctx.weight_dtype in (E4M3, E5M2):
                    grad_w = None  # an FP8-stored weight's gradient exists only through a sink
                else:
                    grad_w = grad_w.to(ctx.weight_dtype)
        return grad_x, grad_w, None, None, None, None, None, None, None, None, None


def _output_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        if dtype in _ACTIVATION_DTYPES:
            return dtype
    return x.dtype


def _fp8_weight(
    recipe: Recipe, weight: torch.Tensor, transposed: bool, margin: int, master_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, scales) of the logical E × N × K weight for the forward."""
    if weight.dtype == E4M3:  # FP8-stored (O3): its one scale serves every expert
        if master_scale is None:
            raise ValueError("an FP8-stored expert weight needs its scale in master_scale (real = payload / scale)")
        payload = weight.detach().transpose(1, 2) if transposed else weight.detach()
        return payload, master_scale.float().reshape(1, 1, 1).expand(payload.shape[0], 1, 1)
    logical = weight.transpose(1, 2) if transposed else weight
    return quantize_expert_weight(recipe, logical, margin, master_scale)


def fp8_grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    rows: torch.Tensor,
    *,
    transposed: bool = False,
    margin: int = 0,
    recipe: str = "tensorwise",
    master_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-expert x·W[e]ᵀ in FP8 for token rows sorted by expert (module docstring).

    Args:
        x: S × K activations, sorted by expert.
        weight: E × N × K (E × K × N when `transposed`).
        offsets: int32 (E,), cumulative token counts (the end of each expert's rows).
        rows: int64 (S,), the expert of each row.
        recipe: FP8 scaling recipe (`hf_lowprec.fp8.recipes`).
        master_scale: the weight is a scaled master (payload = real·s_m), or FP8-stored.
    """
    spec = get_recipe(recipe)
    w8, sw = _fp8_weight(spec, weight, transposed, margin, master_scale)
    sink = get_grad_sink(weight)
    args = (offsets, rows, spec.name, transposed, margin, _output_dtype(x), sink)
    return _FP8GroupedLinear.apply(x, weight, w8, sw, *args)


# --- the module --------------------------------------------------------------------------------


class FP8Experts(nn.Module):
    """What `convert_experts` mixes into a transformers experts class: its forward with FP8
    grouped GEMMs (module docstring). Never built directly: the converted module keeps its own
    class's attributes and methods (`_apply_gate`, `act_fn`, ...) and parameters."""

    fp8_recipe: str = "tensorwise"
    fp8_margin: int = 0

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if getattr(self, "_is_expert_parallel", False):
            raise NotImplementedError("FP8 experts do not run under expert parallelism; shard with FSDP2 or ZeRO")
        self._link_master_scales()
        experts = self.num_experts
        num_top_k = top_k_index.shape[-1]
        num_tokens, hidden = hidden_states.shape
        expert_ids = top_k_index.reshape(-1)
        sorted_ids, perm = torch.sort(expert_ids, stable=True)
        x = hidden_states[perm // num_top_k]
        weights = top_k_weights.reshape(-1)[perm]
        counts = torch.zeros(experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, sorted_ids, torch.ones_like(sorted_ids))
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        rows = sorted_ids.long()
        first, down = expert_weight_names(self)
        h = self._project(first, x, offsets, rows)
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        y = self._project(down, h, offsets, rows)
        if getattr(self, "has_post_expert_norm", False):
            y = self.post_expert_norm(y)
        weighted = y * weights.unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.shape[0], device=perm.device)
        out = weighted[inverse].view(num_tokens, num_top_k, hidden).sum(dim=1)
        return out.to(hidden_states.dtype)

    def _project(self, name: str, x: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        weight = getattr(self, name)
        out = fp8_grouped_linear(
            x,
            weight,
            offsets,
            rows,
            transposed=self.is_transposed,
            margin=self.fp8_margin,
            recipe=self.fp8_recipe,
            master_scale=self._master_scales.get(name),
        )
        bias = getattr(self, name + "_bias", None) if self.has_bias else None
        if bias is not None:
            # As in the dense layers: the bias joins the BF16 GEMM result in FP32, rounded once.
            out = torch.add(out, bias[rows]).to(out.dtype)
        return out

    # --- O2 / O3: scaled masters, FP8-stored weights ------------------------------------------

    @property
    def _master_scales(self) -> dict[str, torch.Tensor]:
        return {
            name: buf
            for name in expert_weight_names(self)
            if (buf := getattr(self, name + "_master_scale", None)) is not None
        }

    def _link_master_scales(self) -> None:
        for name, scale in self._master_scales.items():
            param = getattr(self, name)
            if get_master_scale(param) is not scale:
                set_master_scale(param, scale)

    def scale_master_weights(self, margin: int = 0) -> None:
        """Turn the FP16 expert weights into scaled masters (payload = real·s_m, one s_m per weight)."""
        for name in expert_weight_names(self):
            weight = getattr(self, name)
            if weight.dtype != torch.float16:
                raise ValueError(f"scaled master weights are FP16; {name} is {weight.dtype} (cast the model first)")
            if getattr(self, name + "_master_scale", None) is not None:
                continue
            with torch.no_grad():
                scale = pow2_scale(tensor_amax(weight), torch.float16, margin)
                weight.copy_(quantize(weight, scale, torch.float16))
            self.register_buffer(name + "_master_scale", scale, persistent=False)
            set_master_scale(weight, scale)
        self.fp8_master_margin = margin

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> FP8Experts:
        out = super()._apply(fn, recurse)
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
    recipe: str = "tensorwise",
    margin: int = 0,
    module_filter: Callable[[nn.Module, str], bool] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """Give every experts module of `model` FP8 grouped GEMMs, in place (module docstring).

    Returns (converted module names, {skipped name: reason}). A module whose weights are not
    multiples of 16 and of the recipe's blocks keeps its own forward, with the reason logged.
    """
    multiple = get_recipe(recipe).dim_multiple
    converted: list[str] = []
    skipped: dict[str, str] = {}
    for fqn, module in list(model.named_modules()):
        if not is_experts_module(module) or isinstance(module, FP8Experts):
            continue
        name = fqn or "<root>"
        if module_filter is not None and not module_filter(module, fqn):
            skipped[name] = "rejected by module_filter"
            continue
        reason = _refusal(module, multiple, recipe)
        if reason is not None:
            logger.warning("FP8: kept experts %s in high precision: %s", name, reason)
            skipped[name] = reason
            continue
        module.__class__ = _fp8_class(type(module))
        module.fp8_recipe, module.fp8_margin = get_recipe(recipe).name, margin
        module.register_state_dict_post_hook(_export_real_weights)
        module.register_load_state_dict_pre_hook(_import_real_weights)
        converted.append(name)
    if converted:
        logger.info("FP8: %d experts modules run FP8 grouped GEMMs (%s recipe)", len(converted), recipe)
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
    (top-k × Σ out × in over its weights). The LM head (output embeddings) and the routers
    (plain weights and a top-k, never linear layers) are left out, as every FP8 library keeps
    them in high precision. A layer counts as FP8 when its GEMM takes an FP8 payload.
    """
    from .blocks import FrozenBlockFP8Linear
    from .convert import _conv1d_class
    from .linear import FP8Linear

    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    conv1d = _conv1d_class()
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
