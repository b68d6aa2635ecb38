"""FP8 grouped GEMMs: per-expert x·W[e]ᵀ over token rows sorted by expert, with the scaling
recipes of the dense layers applied per expert (the GEMMs and their hand-written backward; the
casts are `fp8/grouped_casts.py`). docs/algorithms.md §3, "FP8 for Mixture-of-Experts", gives the rules; `fp8/experts.py`
runs these GEMMs in transformers' experts modules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .gemm import GEMM_OUT_DTYPE, ScaledMMGemm, gemm_for
from .grouped_casts import (  # the casts' names, importable from here too, as before
    dequantize_expert_weight,
    dequantize_rows,
    quantize_expert_weight,
    quantize_rows,
    real_expert_weight,
    real_rows,
    requantize_rows,
    transposed_weight,
)
from .linear import deliver_weight_grad, get_grad_sink, output_dtype, quantize_weight
from .scaling_recipes import FP8LinearConfig, ScalingRecipe, fp8_config
from .second_order import fp8_gemm_refusal, refuses_double_backward

__all__ = [
    "dequantize_expert_weight",
    "dequantize_rows",
    "fp8_grouped_linear",
    "native_grouped",
    "padded_layout",
    "quantize_expert_weight",
    "quantize_rows",
    "token_groups",
]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


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


def _act_grouping(recipe: ScalingRecipe, rows: torch.Tensor, experts: int) -> tuple[torch.Tensor | None, int]:
    # Tensorwise: one scale per expert's tokens; the finer recipes scale along each token row.
    return (rows, experts) if recipe.whole_tensor else (None, 0)


# --- the native kernel: torch._scaled_grouped_mm (SM90) ------------------------------------------
# Its FP8 grouped GEMM takes E4M3 operands with one FP32 scale per row of the left operand and
# per output column of each expert (rowwise; a tensorwise scale is such a vector, repeated), A
# row-major, B column-major, and groups whose token counts are multiples of 16: each expert's
# rows are copied into a padded layout (zero payloads, unit scales), of a static size.
_NATIVE_CAPABILITY = ((9, 0), (10, 0))  # Hopper; Blackwell's kernel takes MX-blocked scales
_ALIGN = 16


@torch.compiler.assume_constant_result
def native_grouped(recipe: ScalingRecipe, device: torch.device) -> bool:
    """Whether `torch._scaled_grouped_mm` on `device` takes `recipe`'s scales (a constant of a
    compiled graph: a device's capability does not change)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm") or not recipe.native_grouped:
        return False
    low, high = _NATIVE_CAPABILITY
    return low <= torch.cuda.get_device_capability(device) < high


def _use_native(config: FP8LinearConfig, device: torch.device) -> bool:
    # The dense layers' path choice decides (`set_fp8_gemm_path("upcast")` forces the emulation).
    return isinstance(gemm_for(device, config.gemm_path), ScaledMMGemm) and native_grouped(config.recipe, device)


def padded_layout(offsets: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(destination row of each token, padded offsets, padded row count) with every expert's
    rows starting at a multiple of 16; the count is a static bound (S + 15·E, rounded up)."""
    ends = offsets.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + _ALIGN - 1) // _ALIGN * _ALIGN
    padded_ends = torch.cumsum(padded, 0)
    position = torch.arange(rows.shape[0], device=rows.device) - (ends - counts)[rows]
    total = -(-(rows.shape[0] + offsets.shape[0] * (_ALIGN - 1)) // _ALIGN) * _ALIGN
    return (padded_ends - padded)[rows] + position, padded_ends.to(torch.int32), total


def _pad_payload(t8: torch.Tensor, dest: torch.Tensor, total: int) -> torch.Tensor:
    # index_copy has no FP8 kernel; zero bytes are +0.0.
    out = torch.zeros(total, t8.shape[1], dtype=torch.uint8, device=t8.device)
    return out.index_copy_(0, dest, t8.contiguous().view(torch.uint8)).view(t8.dtype)


def _pad_scale(inv: torch.Tensor, dest: torch.Tensor, total: int) -> torch.Tensor:
    return torch.ones(total, dtype=torch.float32, device=inv.device).index_copy_(0, dest, inv.float())


def _row_inverse(scale: torch.Tensor, groups: torch.Tensor | None) -> torch.Tensor:
    """1/s per row (S,) of a row-scaled operand (one column block: tensorwise or rowwise)."""
    per_row = scale if groups is None else scale[groups]
    return per_row.reshape(-1).reciprocal()


def _column_inverse(scale: torch.Tensor, columns: int) -> torch.Tensor:
    """1/s per (expert, output column), E × N, of an expert weight's E × Nb × 1 scales."""
    return scale[:, :, 0].expand(-1, columns).reciprocal().contiguous()


def _native_forward(
    a8: torch.Tensor, inv_a: torch.Tensor, w8: torch.Tensor, inv_w: torch.Tensor, offsets: torch.Tensor, rows
) -> torch.Tensor:
    """Σ_k a[s,k]·W[e(s)][n,k] for a (S × K, row scales) and W (E × N × K, per-column scales)."""
    dest, padded_offsets, total = padded_layout(offsets, rows)
    b = w8.contiguous().transpose(1, 2)  # E × K × N, column-major
    out = torch._scaled_grouped_mm(
        _pad_payload(a8, dest, total),
        b,
        _pad_scale(inv_a, dest, total),
        inv_w,
        offs=padded_offsets,
        out_dtype=GEMM_OUT_DTYPE,
    )
    return out[dest]


def _native_weight_grad(
    g8: torch.Tensor, inv_g: torch.Tensor, x8: torch.Tensor, inv_x: torch.Tensor, offsets: torch.Tensor, rows
) -> torch.Tensor:
    """dW[e] = Σ_{s in e} g[s,:]ᵀ·x[s,:] (E × N × K) with scales per (expert, column) of g and x."""
    dest, padded_offsets, total = padded_layout(offsets, rows)
    a = _pad_payload(g8, dest, total).t().contiguous()  # N × S', row-major
    b = _pad_payload(x8, dest, total).t().contiguous().t()  # S' × K, column-major
    return torch._scaled_grouped_mm(
        a,
        b,
        inv_g.reshape(-1).contiguous(),
        inv_x.reshape(-1).contiguous(),
        offs=padded_offsets,
        out_dtype=GEMM_OUT_DTYPE,
    )


class _FP8GroupedLinear(torch.autograd.Function):
    """y = x·W[e]ᵀ per expert segment with FP8 GEMMs (`fp8_grouped_linear`); backward by hand.

    Native (`torch._scaled_grouped_mm`, `native_grouped`): the forward under tensorwise and
    rowwise, the backward under rowwise (the kernel takes E4M3 operands only, and tensorwise's
    output gradients are E5M2). Elsewhere the exact emulation: the FP8 operands dequantized
    exactly to BF16 (payload × power of two) and multiplied by `torch._grouped_mm` with FP32
    accumulation and one rounding to BF16. Both compute the exact products of the FP8 values
    summed in FP32, what a scaled FP8 grouped GEMM computes.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        w8: torch.Tensor,
        sw: torch.Tensor,
        offsets: torch.Tensor,
        rows: torch.Tensor,
        config: FP8LinearConfig,
        transposed: bool,
        out_dtype: torch.dtype,
        grad_sink: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        recipe, margin = config.recipe, config.margin
        experts = w8.shape[0]
        groups, n_groups = _act_grouping(recipe, rows, experts)
        col = recipe.activation_block[1]
        native = _use_native(config, x.device)
        with torch.autocast(x.device.type, enabled=False):
            x8, sx = quantize_rows(recipe, x, E4M3, margin, col, groups, n_groups)
            if native:
                inv_w = _column_inverse(sw, w8.shape[1])
                out = _native_forward(x8, _row_inverse(sx, groups), w8, inv_w, offsets, rows)
            else:
                w_real = real_expert_weight(w8, sw, GEMM_OUT_DTYPE)  # logical E × N × K
                out = _grouped_mm(real_rows(x8, sx, col, groups, GEMM_OUT_DTYPE), w_real.transpose(1, 2), offsets)
        ctx.save_for_backward(x8, sx, w8, sw, offsets, rows)
        ctx.config, ctx.transposed, ctx.native = config, transposed, native
        ctx.x_dtype, ctx.weight_dtype, ctx.grad_sink = x.dtype, weight.dtype, grad_sink
        return out.to(out_dtype)

    @staticmethod
    @refuses_double_backward(lambda ctx: fp8_gemm_refusal("FP8 experts (grouped GEMMs)"))
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x8, sx, w8, sw, offsets, rows = ctx.saved_tensors
        recipe, margin, experts = ctx.config.recipe, ctx.config.margin, w8.shape[0]
        groups, n_groups = _act_grouping(recipe, rows, experts)
        col = recipe.activation_block[1]
        native = ctx.native and recipe.grad_dtype == E4M3
        sink = ctx.grad_sink
        need_dw = ctx.needs_input_grad[1] or sink is not None
        grad_x = grad_w = None
        with torch.autocast(grad_out.device.type, enabled=False):
            g = grad_out.detach()
            g8 = sg = None
            if ctx.needs_input_grad[0] or (need_dw and recipe.whole_tensor):
                g8, sg = quantize_rows(recipe, g, recipe.grad_dtype, margin, col, groups, n_groups)
            if ctx.needs_input_grad[0]:
                wt8, swt = transposed_weight(recipe, w8, sw, margin)  # E × K × N
                if native:
                    inv_wt = _column_inverse(swt, wt8.shape[1])
                    grad_x = _native_forward(g8, _row_inverse(sg, groups), wt8, inv_wt, offsets, rows)
                else:
                    g_real = real_rows(g8, sg, col, groups, GEMM_OUT_DTYPE)
                    wt_real = real_expert_weight(wt8, swt, GEMM_OUT_DTYPE)
                    grad_x = _grouped_mm(g_real, wt_real.transpose(1, 2), offsets)
                grad_x = grad_x.to(ctx.x_dtype)
            if need_dw:
                if recipe.whole_tensor:  # the per-expert scales hold along the tokens too
                    g_real = real_rows(g8, sg, None, rows, GEMM_OUT_DTYPE)
                    x_real = real_rows(x8, sx, None, rows, GEMM_OUT_DTYPE)
                    grad_w = _grouped_mm(g_real.t(), x_real, offsets)  # logical E × N × K
                else:  # scales along each expert's tokens, one per column (`fp8_grouped_linear`)
                    tg, n_tg = token_groups(offsets, rows, recipe.activation_block[1])
                    gt8, sgt = quantize_rows(recipe, g, recipe.grad_dtype, margin, 1, tg, n_tg)
                    xt8, sxt = requantize_rows(recipe, x8, sx, col, groups, margin, tg, n_tg)
                    if native:  # rowwise: token groups are the experts, scales E × N and E × K
                        grad_w = _native_weight_grad(gt8, sgt.reciprocal(), xt8, sxt.reciprocal(), offsets, rows)
                    else:
                        g_real = real_rows(gt8, sgt, 1, tg, GEMM_OUT_DTYPE)
                        x_real = real_rows(xt8, sxt, 1, tg, GEMM_OUT_DTYPE)
                        grad_w = _grouped_mm(g_real.t(), x_real, offsets)
                # An expert without tokens has no gradient: exactly zero, whatever a grouped
                # kernel leaves in an empty group's output (on the device, no sync).
                counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
                grad_w = grad_w.masked_fill((counts == 0)[:, None, None], 0.0)
                if ctx.transposed:
                    grad_w = grad_w.transpose(1, 2)
                grad_w = deliver_weight_grad(grad_w, sink, ctx.weight_dtype)
        return grad_x, grad_w, None, None, None, None, None, None, None, None


def _whole(payload: torch.Tensor, scale: torch.Tensor, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A stored-layout payload with one scale for the whole 3-D weight, as the logical E × N × K
    payload and E × 1 × 1 scales (the one scale serves every expert)."""
    payload = payload.transpose(1, 2) if transposed else payload
    return payload, scale.float().reshape(1, 1, 1).expand(payload.shape[0], 1, 1)


def _fp8_weight(
    config: FP8LinearConfig,
    weight: torch.Tensor,
    transposed: bool,
    master_scale: torch.Tensor | None,
    tensor_scale: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, scales) of the logical E × N × K weight for the forward: per expert under the
    recipe's blocks; one scale for the whole weight where the weight every rank computes with has
    one (FSDP2's FP8 all-gather, FP8-stored O3 weights, and so `tensor_scale` on O3's owners)."""
    gathered = getattr(weight, "fp8", None)  # FSDP2's FP8 all-gather output (fp8/sharded_weight.py)
    if gathered is not None:
        return _whole(*gathered(), transposed)
    if weight.dtype == E4M3:  # FP8-stored (O3)
        if master_scale is None:
            raise ValueError("an FP8-stored expert weight needs its scale in master_scale (real = payload / scale)")
        return _whole(weight.detach(), master_scale, transposed)
    if tensor_scale:  # bit for bit what FP8 ZeRO stores for the ranks that do not own the weight
        return _whole(*quantize_weight(weight.detach(), config.margin, master_scale), transposed)
    logical = weight.transpose(1, 2) if transposed else weight
    return quantize_expert_weight(config.recipe, logical, config.margin, master_scale)


def fp8_grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    rows: torch.Tensor,
    *,
    transposed: bool = False,
    config: FP8LinearConfig | None = None,
    margin: int = 0,
    recipe: str | ScalingRecipe = "tensorwise",
    master_scale: torch.Tensor | None = None,
    tensor_scale: bool = False,
) -> torch.Tensor:
    """Per-expert x·W[e]ᵀ in FP8 for token rows sorted by expert.

    The three GEMMs of a linear layer, per expert e over its tokens S_e:

        forward       y_e  = x_e·W_eᵀ        contraction over K (input features)
        input grad    dx_e = dy_e·W_e        contraction over N (output features)
        weight grad   dW_e = dy_eᵀ·x_e       contraction over the expert's tokens

    with the dense layers' scaling recipes (`fp8/scaling_recipes.py`) applied per expert (the
    table of scales is in docs/algorithms.md §3). The weight-gradient operands need their scales
    along the tokens: where the recipe's scale varies along the other axis, they are
    re-quantized from the exact real values of the saved FP8 activations, as the dense recipes
    do. An expert that gets no token has an amax of 0, hence a scale of 1 and a zero weight
    gradient (never NaN or inf); an inf or NaN in an operand makes the payload of its scale group
    NaN, so the non-finite step check sees it, as in the dense layers. Offsets stay on the device
    and every shape is static (tokens × top-k), so a step needs no host sync and a compiled graph
    does not depend on the routing.

    Args:
        x: S × K activations, sorted by expert.
        weight: E × N × K (E × K × N when `transposed`).
        offsets: int32 (E,), cumulative token counts (the end of each expert's rows).
        rows: int64 (S,), the expert of each row.
        config: the experts' FP8 configuration (`fp8_config`), as the dense layers'; without
            one, `margin` and `recipe` build it.
        master_scale: the weight is a scaled master (payload = real·s_m), or FP8-stored.
        tensor_scale: one weight scale for all experts (fp8-lm-o3, whose ranks that do not own
            the weight compute with such an FP8 weight).
    """
    config = config or fp8_config(recipe, margin)
    w8, sw = _fp8_weight(config, weight, transposed, master_scale, tensor_scale)
    sink = get_grad_sink(weight)
    args = (offsets, rows, config, transposed, output_dtype(x), sink)
    return _FP8GroupedLinear.apply(x, weight, w8, sw, *args)
