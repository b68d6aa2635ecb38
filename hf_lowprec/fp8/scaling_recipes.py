"""The FP8 scaling recipes: which elements of a GEMM operand share a scale, and the GEMMs with
those scales (docs/algorithms.md §3). One row of `SCALING_RECIPES` per recipe; adding a recipe
adds a row here (its blocks, gradient format, scale rule, native kernel layout) and nothing else.
Not the training recipes of `recipes/` (scripts), nor `hf-lowprec compare --recipe`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .cast import widen
from .gemm import GEMM_MULTIPLE, GEMM_OUT_DTYPE, GemmPath, check_gemm_path
from .scaled import format_max, pow2_scale

__all__ = [
    "RAISED",
    "SCALING_RECIPES",
    "Block",
    "FP8LinearConfig",
    "ScalingRecipe",
    "blocked",
    "dequantize_blocks",
    "fp8_config",
    "mx_scale",
    "native_kernel",
    "quantize_blocks",
    "recipe_backward",
    "recipe_forward",
    "recipe_mm",
    "recipe_weight",
    "scaling_recipe",
    "unblocked",
]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# The name a layer raised to BF16 GEMMs by the guard shows (`FP8LinearConfig.name`, `fp8.raised`).
RAISED = "bf16"

# (rows, cols) of an operand sharing one scale; None: the whole dimension. Every GEMM here is
# C = A·Bᵀ with both operands contraction-last (A: M×K, Bᵀ: N×K), so one rule quantizes either.
Block = tuple[int | None, int | None]
# How `torch._scaled_mm` takes a recipe's inverse scales: (inv_a, inv_b, b's block, M', N') →
# (scale_a, scale_b); b's block tells the forward and input-gradient GEMMs (b a weight) from the
# weight-gradient GEMM (b an activation).
NativeScales = Callable[[torch.Tensor, torch.Tensor, Block, int, int], tuple[torch.Tensor, torch.Tensor]]


@dataclasses.dataclass(frozen=True, repr=False)
class ScalingRecipe:
    """How an FP8 layer scales its GEMM operands (real = payload / scale).

    Attributes:
        name: the value of the `recipe` option.
        activation_block: (rows, cols) sharing a scale in x and dy, contraction along cols.
        weight_block: the same for the weight, rows = output channels.
        grad_dtype: FP8 format of the output gradients (the finer recipes use E4M3: a scale per
            row or block covers the gradients' range).
        native_scales: the inverse scales laid out as `torch._scaled_mm`'s CUDA kernel takes them.
        e8m0: scales follow the OCP MX rule (`mx_scale`) instead of `pow2_scale`.
        min_capability, max_capability: CUDA capabilities whose `torch._scaled_mm` takes these
            scales natively (max exclusive, None: no limit).
        min_torch, min_cuda: the (major, minor) versions that kernel needs.
        raise_to: the recipe the guard raises a layer to when this one flushes its inputs (None:
            BF16, `fp8.raised`).
        native_grouped: `torch._scaled_grouped_mm` takes these scales (one per row and per
            expert's output column) for the experts' grouped GEMMs (`fp8.grouped`).
    """

    name: str
    activation_block: Block
    weight_block: Block
    grad_dtype: torch.dtype
    native_scales: NativeScales
    e8m0: bool = False
    min_capability: tuple[int, int] = (8, 9)
    max_capability: tuple[int, int] | None = None
    min_torch: tuple[int, int] = (0, 0)
    min_cuda: tuple[int, int] = (0, 0)
    raise_to: str | None = None
    native_grouped: bool = False

    def __repr__(self) -> str:
        return f"ScalingRecipe({self.name!r})"

    @property
    def whole_tensor(self) -> bool:
        """One scale per tensor (tensorwise): the layer's own fast path, no re-quantization."""
        return self.activation_block == (None, None) and self.weight_block == (None, None)

    @property
    def dim_multiple(self) -> int:
        """What a layer's in/out features must be multiples of: 16 and the recipe's blocks."""
        sizes = [b for b in (*self.activation_block, *self.weight_block) if b not in (None, 1)]
        return functools.reduce(math.lcm, sizes, GEMM_MULTIPLE)


def _pad_rows(t: torch.Tensor, rows: int, value: float = 1.0) -> torch.Tensor:
    return t if t.shape[0] == rows else F.pad(t, (0, 0, 0, rows - t.shape[0]), value=value)


def _row_scales(
    inv_a: torch.Tensor, inv_b: torch.Tensor, b_block: Block, mp: int, np_: int
) -> tuple[torch.Tensor, torch.Tensor]:
    # (M, 1) and (1, N), contiguous FP32; a whole-tensor scale expanded to its rows.
    return _pad_rows(inv_a, mp).contiguous(), _pad_rows(inv_b, np_).reshape(1, np_).contiguous()


def _block_scales(
    inv_a: torch.Tensor, inv_b: torch.Tensor, b_block: Block, mp: int, np_: int
) -> tuple[torch.Tensor, torch.Tensor]:
    # 1×128 scales outer-dim-major (stride 1 along M); 128×128 scales K-major, 16-byte aligned
    # columns (the layouts torch's CUDA kernel names in its argument check). The weight-gradient
    # GEMM has 1×128 blocks on both sides: the second is laid out as the first.
    scale_a = _pad_rows(inv_a, mp).t().contiguous().t()
    if b_block == (128, 128):
        kb = inv_b.shape[1]
        return scale_a, F.pad(inv_b, (0, -kb % 4), value=1.0)[:, :kb].t()
    return scale_a, _pad_rows(inv_b, np_).t().contiguous()


def _mx_blocked_layout(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scales (R × C) in cuBLAS's block-scaling layout: 128 × 4 tiles, row-major over
    tiles; inside a tile, row r and column c at (r mod 32)·16 + ⌊r/32⌋·4 + c. Padding is 1.0."""
    rows, cols = scale.shape
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    padded = F.pad(scale.float(), (0, cp - cols, 0, rp - rows), value=1.0)
    tiles = padded.reshape(rp // 128, 4, 32, cp // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1).to(torch.float8_e8m0fnu)


def _mx_scales(
    inv_a: torch.Tensor, inv_b: torch.Tensor, b_block: Block, mp: int, np_: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return _mx_blocked_layout(_pad_rows(inv_a, mp)), _mx_blocked_layout(_pad_rows(inv_b, np_))


SCALING_RECIPES: dict[str, ScalingRecipe] = {
    # FP8-LM's: one power-of-two scale per tensor, E5M2 gradients.
    "tensorwise": ScalingRecipe(
        "tensorwise", (None, None), (None, None), E5M2, _row_scales, raise_to="rowwise", native_grouped=True
    ),
    # One scale per token row and per output channel.
    "rowwise": ScalingRecipe("rowwise", (1, None), (1, None), E4M3, _row_scales, native_grouped=True),
    # DeepSeek-V3 §3.3: 1×128 activation tiles, 128×128 weight blocks.
    "blockwise": ScalingRecipe(
        "blockwise",
        (1, 128),
        (128, 128),
        E4M3,
        _block_scales,
        min_capability=(9, 0),
        max_capability=(10, 0),
        min_torch=(2, 9),
        min_cuda=(12, 9),
    ),
    # OCP MX v1.0 §6.3: 1×32 blocks, E8M0 scales.
    "mxfp8": ScalingRecipe("mxfp8", (1, 32), (1, 32), E4M3, _mx_scales, e8m0=True, min_capability=(10, 0)),
}


def scaling_recipe(name: str | ScalingRecipe) -> ScalingRecipe:
    """The recipe called `name` (a recipe passes through); an unknown name raises an error listing
    the valid ones."""
    if isinstance(name, ScalingRecipe):
        return name
    if name not in SCALING_RECIPES:
        raise ValueError(f"unknown FP8 recipe {name!r}; valid recipes: {list(SCALING_RECIPES)}")
    return SCALING_RECIPES[name]


@dataclasses.dataclass(frozen=True)
class FP8LinearConfig:
    """Everything an FP8 layer's GEMMs depend on, built once (`fp8_config`) from a strategy's
    options and handed whole to `convert.convert_to_fp8`, `linear.FP8Linear`, its autograd function
    and the GEMMs.

    Attributes:
        recipe: the scaling recipe (blocks, gradient format, scale rule, native layout).
        margin: scale margin in binades for every FP8 cast.
        gemm_path: the GEMM path this layer prefers ("scaled_mm" or "upcast"); None: the device's
            default (`gemm.fp8_gemm_path`).
        raised: the guard raised the layer to BF16 GEMMs (`fp8.raised`).
    """

    recipe: ScalingRecipe
    margin: int = 0
    gemm_path: GemmPath | None = None
    raised: bool = False

    @property
    def name(self) -> str:
        """The recipe's name, or "bf16" once raised: what reports and the guard's log show."""
        return RAISED if self.raised else self.recipe.name


@functools.cache
def _interned(recipe: ScalingRecipe, margin: int, gemm_path: GemmPath | None, raised: bool) -> FP8LinearConfig:
    return FP8LinearConfig(recipe, margin, gemm_path, raised)


def fp8_config(
    recipe: str | ScalingRecipe = "tensorwise", margin: int = 0, gemm_path: GemmPath | None = None, raised: bool = False
) -> FP8LinearConfig:
    """The layer configuration for these values, checked; equal values give the same object, so a
    compiled graph sees one constant for every layer that shares it."""
    if not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
        raise ValueError(f"margin must be an integer >= 0, got {margin!r}")
    check_gemm_path(gemm_path)
    return _interned(scaling_recipe(recipe), margin, gemm_path, bool(raised))


def mx_scale(amax: torch.Tensor, dtype: torch.dtype = E4M3, margin: int = 0) -> torch.Tensor:
    """OCP MX v1.0 §6.3 shared scale in this package's convention (real = payload / s):
    X = 2^(⌊log2 amax⌋ − emax) with emax the element format's largest exponent (8 for E4M3),
    so s = 1/X = 2^(emax − ⌊log2 amax⌋ − margin); amax·s lies in [2^emax, 2^(emax+1)) and the
    cast saturates what exceeds the format's maximum (448 for E4M3). amax = 0 or non-finite
    gives s = 1, as `pow2_scale`; exponents are clamped to ±126 (E8M0 holds ±127)."""
    amax = amax.float()
    usable = (amax > 0) & torch.isfinite(amax)
    _, exponent = torch.frexp(torch.where(usable, amax, torch.ones_like(amax)))
    emax = math.frexp(format_max(dtype))[1] - 1  # ⌊log2 max⌋: 8 for E4M3, 15 for E5M2
    exponent = (emax - (exponent - 1) - margin).clamp(-126, 126).float()
    return torch.where(usable, torch.exp2(exponent), torch.ones_like(amax))


def blocked(t: torch.Tensor, block: Block) -> torch.Tensor:
    """t (R×C) zero-padded to whole blocks and viewed as (R/br, br, C/bc, bc)."""
    rows, cols = t.shape
    br = max(rows, 1) if block[0] is None else block[0]
    bc = max(cols, 1) if block[1] is None else block[1]
    pad_r, pad_c = -rows % br, -cols % bc
    if pad_r or pad_c:
        t = F.pad(t, (0, pad_c, 0, pad_r))
    return t.reshape(t.shape[0] // br, br, t.shape[1] // bc, bc)


def unblocked(blocks: torch.Tensor) -> torch.Tensor:
    """`blocked`'s view back as the padded R×C matrix (sizes explicit: -1 is ambiguous at 0 tokens)."""
    rb, br, cb, bc = blocks.shape
    return blocks.reshape(rb * br, cb * bc)


def quantize_blocks(
    t: torch.Tensor,
    block: Block,
    dtype: torch.dtype,
    margin: int = 0,
    *,
    e8m0: bool = False,
    master_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, scale) of a 2-D tensor with one scale per `block` (rows, cols; None = all).

    The scale tensor has one entry per block, shape (⌈R/br⌉, ⌈C/bc⌉). `master_scale`: t holds
    real·s_m (a scaled FP16 master). A non-finite amax makes its block's payload NaN (the
    overflow stays visible), as the tensorwise quantization does.
    """
    rows, cols = t.shape
    blocks = blocked(t.detach().float(), block)
    amax = blocks.abs().amax(dim=(1, 3))
    if master_scale is not None:
        amax = amax / master_scale
    scale = mx_scale(amax, dtype, margin) if e8m0 else pow2_scale(amax, dtype, margin)
    factor = scale + (amax - amax)  # NaN where amax is inf/NaN
    if master_scale is not None:
        factor = factor / master_scale
    limit = format_max(dtype)
    # Only the MX rule can exceed the maximum (it saturates by design); clamp keeps NaN.
    y = (blocks * factor[:, None, :, None]).clamp_(-limit, limit)
    payload = unblocked(y)[:rows, :cols].to(dtype)
    return payload, scale


def dequantize_blocks(payload: torch.Tensor, scale: torch.Tensor, block: Block) -> torch.Tensor:
    """The real values payload / scale in FP32 (exact: the scales are powers of two); a 0-dim
    scale covers the whole tensor (a tensorwise FP8 weight handed to a finer recipe)."""
    wide = widen(payload, torch.float32)
    if scale.dim() == 0:
        return wide / scale
    rows, cols = payload.shape
    blocks = blocked(wide, block)
    real = blocks / scale[:, None, :, None]
    return unblocked(real)[:rows, :cols]


def _constant_along_k(scale: torch.Tensor, block: Block) -> bool:
    return scale.dim() == 0 or tuple(block) == (1, None)


def _emulated_mm(
    a: torch.Tensor, sa: torch.Tensor, a_block: Block, bt: torch.Tensor, sb: torch.Tensor, b_block: Block
) -> torch.Tensor:
    if _constant_along_k(sa, a_block) and _constant_along_k(sb, b_block):
        # Row and column scales commute with the sum: scale the BF16 product (powers of two, exact).
        out = torch.mm(widen(a, GEMM_OUT_DTYPE), widen(bt, GEMM_OUT_DTYPE).t())
        inv_b = sb.reciprocal() if sb.dim() == 0 else sb.reciprocal().reshape(1, -1)
        return out.mul_((sa.reciprocal() * inv_b).to(GEMM_OUT_DTYPE))
    a_real = dequantize_blocks(a, sa, a_block).to(GEMM_OUT_DTYPE)
    b_real = dequantize_blocks(bt, sb, b_block).to(GEMM_OUT_DTYPE)
    return torch.mm(a_real, b_real.t())


def _scale_grid(scale: torch.Tensor, shape: tuple[int, int], block: Block) -> torch.Tensor:
    """The scale as one entry per block of a `shape` operand (a 0-dim scale repeated)."""
    if scale.dim() == 2:
        return scale
    br = shape[0] if block[0] is None else block[0]
    bc = shape[1] if block[1] is None else block[1]
    return scale.expand(-(-shape[0] // br), -(-shape[1] // bc))


def _pad_fp8(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    if (rows, cols) == tuple(t.shape):
        return t.contiguous()
    # F.pad has no FP8 kernel; zero bytes are +0.0 in both FP8 formats.
    padded = F.pad(t.contiguous().view(torch.uint8), (0, cols - t.shape[1], 0, rows - t.shape[0]))
    return padded.view(t.dtype)


def _native_mm(
    recipe: ScalingRecipe,
    a: torch.Tensor,
    sa: torch.Tensor,
    a_block: Block,
    bt: torch.Tensor,
    sb: torch.Tensor,
    b_block: Block,
) -> torch.Tensor:
    """`torch._scaled_mm` with the recipe's scales as its CUDA kernels take them: a row-major,
    b column-major, dims padded to 16 (zero payloads, unit scales), scales inverted (its
    scales multiply)."""
    (m, k), n = a.shape, bt.shape[0]
    mp, kp, np_ = (-(-d // GEMM_MULTIPLE) * GEMM_MULTIPLE for d in (m, k, n))
    a_rows, b_cols = _pad_fp8(a, mp, kp), _pad_fp8(bt, np_, kp).t()
    inv_a = _scale_grid(sa, (m, k), a_block).reciprocal()
    inv_b = _scale_grid(sb, (n, k), b_block).reciprocal()
    scale_a, scale_b = recipe.native_scales(inv_a, inv_b, b_block, mp, np_)
    out = torch._scaled_mm(a_rows, b_cols, scale_a=scale_a, scale_b=scale_b, out_dtype=GEMM_OUT_DTYPE)
    return out[:m, :n]


@torch.compiler.assume_constant_result
def native_kernel(recipe: ScalingRecipe, device: torch.device) -> bool:
    """Whether `torch._scaled_mm` on `device` takes `recipe`'s scales; a constant of a compiled
    graph (a device's capability does not change)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    capability = torch.cuda.get_device_capability(device)
    if capability < recipe.min_capability or (recipe.max_capability and capability >= recipe.max_capability):
        return False
    if recipe.e8m0 and not hasattr(torch, "float8_e8m0fnu"):
        return False
    torch_version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    cuda_version = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    return torch_version >= recipe.min_torch and cuda_version >= recipe.min_cuda


def recipe_mm(
    recipe: ScalingRecipe,
    a: torch.Tensor,
    sa: torch.Tensor,
    a_block: Block,
    bt: torch.Tensor,
    sb: torch.Tensor,
    b_block: Block,
    native: bool,
) -> torch.Tensor:
    """(a / sa)·(bt / sb)ᵀ in BF16 for contraction-last FP8 operands a (M×K) and bt (N×K)."""
    if a.numel() == 0 or bt.numel() == 0:  # zero tokens: an empty product or sum, not a kernel's shape
        return torch.zeros(a.shape[0], bt.shape[0], dtype=GEMM_OUT_DTYPE, device=a.device)
    if native:
        return _native_mm(recipe, a, sa, a_block, bt, sb, b_block)
    return _emulated_mm(a, sa, a_block, bt, sb, b_block)


def _quantize(
    recipe: ScalingRecipe,
    t: torch.Tensor,
    block: Block,
    dtype: torch.dtype,
    margin: int,
    master_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_blocks(t, block, dtype, margin, e8m0=recipe.e8m0, master_scale=master_scale)


def recipe_weight(
    config: FP8LinearConfig, weight: torch.Tensor, transposed: bool, master_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 payload in the weight's storage layout, scales of the N×K weight) for the forward."""
    recipe, margin = config.recipe, config.margin
    logical = weight.t() if transposed else weight
    w8, sw = _quantize(recipe, logical, recipe.weight_block, E4M3, margin, master_scale)
    return (w8.t() if transposed else w8), sw


def recipe_forward(
    config: FP8LinearConfig, x2: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor, transposed: bool, native: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y = x·Wᵀ in BF16, x8, sx) for x2 (M×K) and the FP8 weight from `recipe_weight`."""
    recipe, margin = config.recipe, config.margin
    x8, sx = _quantize(recipe, x2, recipe.activation_block, E4M3, margin)
    w = w8.t() if transposed else w8
    return recipe_mm(recipe, x8, sx, recipe.activation_block, w, sw, recipe.weight_block, native), x8, sx


def _other_axis(
    recipe: ScalingRecipe, t8: torch.Tensor, scale: torch.Tensor, block: Block, margin: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 operand tᵀ with scales along t's rows: the same payload when the block is square
    (or the scale whole-tensor), else re-quantized from the exact real values."""
    if scale.dim() == 0 or block[0] == block[1]:
        return t8.t(), scale if scale.dim() == 0 else scale.t()
    return _quantize(recipe, dequantize_blocks(t8, scale, block).t(), block, E4M3, margin)


def recipe_backward(
    config: FP8LinearConfig,
    g2: torch.Tensor,
    x8: torch.Tensor,
    sx: torch.Tensor,
    w8: torch.Tensor,
    sw: torch.Tensor,
    transposed: bool,
    native: bool,
    need_dx: bool,
    need_dw: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dx = dy·W (M×K), dW in the weight's storage layout) in BF16, for the output gradient g2 (M×N)."""
    recipe, margin = config.recipe, config.margin
    act, wblock, gdt = recipe.activation_block, recipe.weight_block, recipe.grad_dtype
    grad_x = grad_w = None
    if need_dx:
        g8, sg = _quantize(recipe, g2, act, gdt, margin)
        wt8, swt = _other_axis(recipe, w8.t() if transposed else w8, sw, wblock, margin)  # Wᵀ: K×N
        grad_x = recipe_mm(recipe, g8, sg, act, wt8, swt, wblock, native)
    if need_dw:
        gt8, sgt = _quantize(recipe, g2.t(), act, gdt, margin)  # dyᵀ: N×M
        xt8, sxt = _other_axis(recipe, x8, sx, act, margin)  # xᵀ: K×M
        grad_w = recipe_mm(recipe, gt8, sgt, act, xt8, sxt, act, native)
        grad_w = grad_w.t() if transposed else grad_w
    return grad_x, grad_w
