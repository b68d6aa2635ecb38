"""What an FP8 layer computes once the guard raises its precision (docs/guard.md): the flush
counts of its input cast, the next recipe up (`finer`), and the BF16 path a raised layer takes.
The layer stays a `linear.FP8Linear` (parameters, master or FP8-stored weight, gradient sink unchanged).
"""

from __future__ import annotations

from typing import Any

import torch

from ..compiling import run_fused
from .fused import FLUSH_BELOW
from .scaled import dequantize, get_master_scale, pow2_scale
from .scaling_recipes import RAISED, SCALING_RECIPES, FP8LinearConfig, ScalingRecipe, fp8_config, mx_scale
from .second_order import fp8_gemm_refusal, refuses_double_backward

__all__ = [
    "RAISED",
    "config_named",
    "count_flushes",
    "finer",
    "flush_counts",
    "raised_linear",
    "real_weight",
]

E4M3 = torch.float8_e4m3fn


def _flushed(x2: torch.Tensor, rule: ScalingRecipe, margin: int) -> torch.Tensor:
    """How many non-zero elements of |x| (2-D, groups along its last axis) the rule's cast flushes."""
    cols = rule.activation_block[1]
    if rule.whole_tensor:
        amax = x2.amax().reshape(1, 1)
    elif cols is None or x2.shape[-1] % cols:
        amax = x2.amax(dim=-1, keepdim=True)
    else:
        amax = x2.reshape(x2.shape[0], -1, cols).amax(dim=-1).repeat_interleave(cols, dim=-1)
    scale = mx_scale(amax, E4M3, margin) if rule.e8m0 else pow2_scale(amax, E4M3, margin)
    return ((x2 > 0) & (x2 * scale <= FLUSH_BELOW)).sum()


def flush_counts(x: torch.Tensor, config: FP8LinearConfig) -> torch.Tensor:
    """[inputs the layer's E4M3 casts flush to zero, non-zero inputs cast] as int64 on x's device
    (integers: a `model.half()` after the guard attached leaves them exact). No host sync.

    The scale per group is the one the layer's recipe chooses from the group's amax. Tensorwise casts the
    input once (one scale for the whole tensor). The finer recipes cast it twice: along the
    features for the forward GEMM (rowwise: each token row; blockwise and mxfp8: each 1×block of
    a row) and along the tokens for the weight gradient dW = dyᵀ·x (each feature column, or each
    block of a column): a few huge token rows leave the first cast intact and flush the second,
    so both are counted."""
    return _counts(x.detach().reshape(-1, x.shape[-1]), config.recipe, config.margin)


def count_flushes(x: torch.Tensor, config: FP8LinearConfig) -> torch.Tensor:
    """`flush_counts(x, config)` as one compiled graph on x's device (`run_fused`), for the
    finer recipes, whose casts run inside their GEMM functions; a tensorwise layer counts in its
    input cast's own graph instead (`fused.counted_input_cast`)."""
    return run_fused(_counts, x.detach().reshape(-1, x.shape[-1]), config.recipe, config.margin, like=x)


def _counts(x2: torch.Tensor, rule: ScalingRecipe, margin: int) -> torch.Tensor:
    if x2.numel() == 0:  # zero tokens: nothing cast, nothing flushed (an amax over no elements is undefined)
        return torch.zeros(2, dtype=torch.int64, device=x2.device)
    x2 = x2.float().abs()
    nonzero = (x2 > 0).sum()
    if rule.whole_tensor:
        return torch.stack([_flushed(x2, rule, margin), nonzero])
    both = _flushed(x2, rule, margin) + _flushed(x2.t(), rule, margin)
    return torch.stack([both, 2 * nonzero])


def real_weight(layer: Any) -> torch.Tensor:
    """The layer's weight as real values in BF16: a scaled master divided by its scale, an
    FP8-stored or FSDP2-gathered FP8 weight dequantized, else the parameter itself."""
    weight = layer.weight
    gathered = getattr(weight, "fp8", None)
    if gathered is not None:
        payload, scale = gathered()
        return dequantize(payload, scale, torch.bfloat16)
    scale = layer.master_scale if layer.master_scale is not None else get_master_scale(weight)
    if scale is not None:
        return dequantize(weight.detach(), scale, torch.bfloat16)
    return weight.detach().to(torch.bfloat16)


class _RaisedLinear(torch.autograd.Function):
    """y = x·Wᵀ + b in BF16 (x·W + b for the Conv1D layout); the weight gradient goes where the
    FP8 path sends it (`linear.deliver_weight_grad`: the sink of FP8-LM O2/O3, else the parameter)."""

    @staticmethod
    def forward(ctx, x, weight, bias, w16, transposed, out_dtype, sink, deliver):
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.detach().reshape(-1, x.shape[-1]).to(torch.bfloat16)
            out = x2 @ (w16 if transposed else w16.t())
            out = (out if bias is None else torch.add(out, bias)).to(out_dtype)
        ctx.save_for_backward(x2, w16)
        ctx.transposed, ctx.x_shape, ctx.x_dtype, ctx.sink, ctx.deliver = transposed, x.shape, x.dtype, sink, deliver
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out  # 2-D, reshaped outside (a view made here could not be written in place)

    @staticmethod
    @refuses_double_backward(lambda ctx: fp8_gemm_refusal("an FP8 layer the guard raised to BF16", saved="BF16"))
    def backward(ctx, grad_out):
        x2, w16 = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1]).to(torch.bfloat16)
        grad_x = grad_w = grad_b = None
        with torch.autocast(grad_out.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                grad_x = (g2 @ (w16.t() if ctx.transposed else w16)).to(ctx.x_dtype).reshape(ctx.x_shape)
            if ctx.needs_input_grad[1] or ctx.sink is not None:
                grad_w = x2.t() @ g2 if ctx.transposed else g2.t() @ x2
                grad_w = ctx.deliver(grad_w, ctx.sink, ctx.weight_dtype)
            if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
                grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


def raised_linear(layer: Any, x: torch.Tensor, out_dtype: torch.dtype, sink: Any, deliver: Any) -> torch.Tensor:
    """The forward of an FP8 layer whose precision the guard raised to BF16; `deliver(grad_w,
    sink, weight_dtype)` hands the weight gradient on as the layer's FP8 path does."""
    args = (layer.weight_transposed, out_dtype, sink, deliver)
    out = _RaisedLinear.apply(x, layer.weight, layer.bias, real_weight(layer), *args)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def finer(config: FP8LinearConfig, features: tuple[int, int]) -> FP8LinearConfig:
    """The next step up from `config`: its recipe's `raise_to` (rowwise after tensorwise) where the
    layer's sizes suit it, else BF16."""
    up = None if config.raised or config.recipe.raise_to is None else SCALING_RECIPES[config.recipe.raise_to]
    if up is not None and all(f % up.dim_multiple == 0 for f in features):
        return fp8_config(up, config.margin, config.gemm_path)
    return fp8_config(config.recipe, config.margin, config.gemm_path, raised=True)


def config_named(config: FP8LinearConfig, name: str) -> FP8LinearConfig:
    """`config` with the recipe a saved guard state names (a recipe's name, or `RAISED`)."""
    if name == RAISED:
        return fp8_config(config.recipe, config.margin, config.gemm_path, raised=True)
    return fp8_config(SCALING_RECIPES[name], config.margin, config.gemm_path)
