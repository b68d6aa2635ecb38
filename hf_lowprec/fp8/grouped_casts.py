"""The casts of the FP8 grouped GEMM (`fp8/grouped.py`): an operand's scales and payload per
(row group, block of columns), an expert weight's per expert and block, their exact real values,
and the re-quantizations the finer recipes' backward needs (Wᵀ along its own rows, xᵀ along each
expert's tokens). On a GPU each is one compiled graph (`compiling.run_fused`); a CPU runs the
eager operations, which are the reference (the same bits). docs/algorithms.md §3.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..compiling import run_fused, takes_gpu_path
from .cast import widen
from .scaled import format_max, pow2_scale
from .scaling_recipes import ScalingRecipe, mx_scale

__all__ = [
    "dequantize_expert_weight",
    "dequantize_rows",
    "quantize_expert_weight",
    "quantize_rows",
    "real_expert_weight",
    "real_rows",
    "requantize_rows",
    "transposed_weight",
]

E4M3 = torch.float8_e4m3fn


# --- quantization ------------------------------------------------------------------------------


def _scale(recipe: ScalingRecipe, amax: torch.Tensor, dtype: torch.dtype, margin: int) -> torch.Tensor:
    return mx_scale(amax, dtype, margin) if recipe.e8m0 else pow2_scale(amax, dtype, margin)


def quantize_rows(
    recipe: ScalingRecipe,
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

    On a GPU one compiled graph (`run_fused`: the amax and the scaled cast, no FP32 copy of the
    operand in memory); eagerly it is about ten passes over FP32 temporaries. The same bits.
    """
    if takes_gpu_path(t.device):
        return run_fused(_quantize_rows, recipe, t.detach(), dtype, margin, col_block, groups, n_groups, like=t)
    return _quantize_rows(recipe, t, dtype, margin, col_block, groups, n_groups)


def _quantize_rows(
    recipe: ScalingRecipe,
    t: torch.Tensor,
    dtype: torch.dtype,
    margin: int,
    col_block: int | None,
    groups: torch.Tensor | None,
    n_groups: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = t.shape
    bc = max(cols, 1) if col_block is None else col_block
    wide = t.detach().float()
    if cols % bc:
        wide = F.pad(wide, (0, -cols % bc))
    blocks = wide.reshape(rows, wide.shape[1] // bc, bc)  # explicit: -1 is ambiguous for zero rows
    amax = blocks.abs().amax(dim=-1)  # (R, Cb); NaN propagates
    if groups is not None:
        index = groups[:, None].expand_as(amax)
        amax = amax.new_zeros(n_groups, amax.shape[1]).scatter_reduce_(0, index, amax, "amax")
    scale = _scale(recipe, amax, dtype, margin)
    factor = scale + (amax - amax)  # NaN where the group's amax is inf or NaN
    per_row = factor if groups is None else factor[groups]
    limit = format_max(dtype)
    y = (blocks * per_row[..., None]).clamp_(-limit, limit).reshape(rows, wide.shape[1])[:, :cols]
    return y.to(dtype), scale


def requantize_rows(
    recipe: ScalingRecipe,
    payload: torch.Tensor,
    scale: torch.Tensor,
    col_block: int | None,
    groups: torch.Tensor | None,
    margin: int,
    new_groups: torch.Tensor,
    n_new: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` (one column per block, `new_groups` of rows) of a payload's exact real
    values: the weight gradient's operands, scaled along each expert's tokens. On a GPU one graph."""
    if takes_gpu_path(payload.device):
        args = (recipe, payload, scale, col_block, groups, margin, new_groups, n_new)
        return run_fused(_requantized_rows, *args, like=payload)
    return _requantized_rows(recipe, payload, scale, col_block, groups, margin, new_groups, n_new)


def _requantized_rows(recipe, payload, scale, col_block, groups, margin, new_groups, n_new):
    exact = dequantize_rows(payload, scale, col_block, groups)
    return _quantize_rows(recipe, exact, E4M3, margin, 1, new_groups, n_new)


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
    padded = wide.shape[1]  # explicit sizes: -1 is ambiguous for zero rows
    return (wide.reshape(rows, padded // bc, bc) / per_row[..., None]).reshape(rows, padded)[:, :cols]


def real_rows(
    payload: torch.Tensor,
    scale: torch.Tensor,
    col_block: int | None,
    groups: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """`dequantize_rows` in `dtype`: the emulated grouped GEMM's operand (an FP8 value over a power
    of two is exact in BF16). On a GPU one compiled graph, no FP32 copy of the operand in memory."""
    if takes_gpu_path(payload.device):
        return run_fused(_real_rows, payload, scale, col_block, groups, dtype, like=payload)
    return _real_rows(payload, scale, col_block, groups, dtype)


def _real_rows(payload, scale, col_block, groups, dtype):
    return dequantize_rows(payload, scale, col_block, groups).to(dtype)


def _weight_blocks(recipe: ScalingRecipe, n: int, k: int) -> tuple[int, int]:
    br, bc = recipe.weight_block
    return (n if br is None else br), (k if bc is None else bc)


def quantize_expert_weight(
    recipe: ScalingRecipe, w: torch.Tensor, margin: int, master_scale: torch.Tensor | None = None, block=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 payload E × N × K, scales E × N/br × K/bc) of a logical expert weight, per expert.

    `master_scale`: w holds real·s_m (a scaled FP16 master). The dimensions are multiples of the
    recipe's blocks (`fp8.experts.convert_experts` keeps the others in high precision). On a GPU
    one compiled graph, as `quantize_rows`.
    """
    _, n, k = w.shape
    br, bc = block or _weight_blocks(recipe, n, k)
    if takes_gpu_path(w.device):
        return run_fused(_quantize_expert_weight, recipe, w.detach(), margin, master_scale, br, bc, like=w)
    return _quantize_expert_weight(recipe, w, margin, master_scale, br, bc)


def _quantize_expert_weight(
    recipe: ScalingRecipe, w: torch.Tensor, margin: int, master_scale: torch.Tensor | None, br: int, bc: int
) -> tuple[torch.Tensor, torch.Tensor]:
    e, n, k = w.shape
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


def real_expert_weight(payload: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`dequantize_expert_weight` in `dtype` (exact, as `real_rows`); on a GPU one compiled graph."""
    if takes_gpu_path(payload.device):
        return run_fused(_real_expert_weight, payload, scale, dtype, like=payload)
    return _real_expert_weight(payload, scale, dtype)


def _real_expert_weight(payload, scale, dtype):
    return dequantize_expert_weight(payload, scale).to(dtype)


def transposed_weight(
    recipe: ScalingRecipe, w8: torch.Tensor, sw: torch.Tensor, margin: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Wᵀ (E × K × N) in FP8 with the recipe's blocks along its own rows: the same payload where
    the blocks are whole or square (tensorwise, blockwise), else re-quantized from the exact
    real values (rowwise, mxfp8), as the dense recipes do."""
    br, bc = recipe.weight_block
    whole = sw.shape[1] == 1 and sw.shape[2] == 1
    if whole or (br is not None and br == bc):
        return w8.transpose(1, 2), sw.transpose(1, 2)
    if takes_gpu_path(w8.device):  # one graph: no FP32 copy of the weight in memory
        return run_fused(_requantized_transpose, recipe, w8, sw, margin, like=w8)
    return _requantized_transpose(recipe, w8, sw, margin)


def _requantized_transpose(
    recipe: ScalingRecipe, w8: torch.Tensor, sw: torch.Tensor, margin: int
) -> tuple[torch.Tensor, torch.Tensor]:
    real = dequantize_expert_weight(w8, sw).transpose(1, 2)
    _, n, k = real.shape
    return _quantize_expert_weight(recipe, real, margin, None, *_weight_blocks(recipe, n, k))
