"""Block-scaled FP8 weights in the format FP8 checkpoints are published in (docs/checkpoints.md).

DeepSeek-V3, Qwen3-FP8 and transformers' `FineGrainedFP8Config` store each linear weight as an
E4M3 payload with one FP32 scale per 128×128 block. This module quantizes to that format,
dequantizes from it as transformers does, and runs a frozen layer on it (`FrozenBlockFP8Linear`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .cast import widen
from .scaling_recipes import blocked, unblocked  # the block view the scaling recipes use

__all__ = ["BLOCK", "FrozenBlockFP8Linear", "block_scales_fp32", "dequantize_published", "quantize_published"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
# The published block: 128 output rows × 128 input columns. A weight W (out × in) is stored as
#     weight            E4M3 payload, out × in (1 byte per element)
#     weight_scale_inv  FP32, ceil(out/128) × ceil(in/128): one number per block
# with real = payload · weight_scale_inv of its block (some releases store the scales as E8M0
# powers of two: `scale_fmt: "ue8m0"`).
BLOCK = (128, 128)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)


def block_scales_fp32(scale_inv: torch.Tensor) -> torch.Tensor:
    """The per-block multipliers in FP32, whatever their stored form: FP32/BF16 numbers, or
    E8M0 exponents (`float8_e8m0fnu`, or its bytes as uint8: 2^(byte − 127))."""
    if scale_inv.dtype == torch.uint8 or (_E8M0 is not None and scale_inv.dtype == _E8M0):
        return torch.exp2(scale_inv.view(torch.uint8).float() - 127.0)
    return scale_inv.float()


def _check_grid(payload: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
    if payload.dim() != 2:
        raise ValueError(f"a block-scaled weight is 2-D (out × in), got shape {tuple(payload.shape)}")
    grid = tuple(-(-n // b) for n, b in zip(payload.shape, block))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(
            f"weight_scale_inv has shape {tuple(scale_inv.shape)}, but a {tuple(payload.shape)} weight in "
            f"{block[0]}×{block[1]} blocks needs {grid}: the checkpoint's weight_block_size does not match its scales"
        )


def dequantize_published(
    payload: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, block: tuple[int, int] = BLOCK
) -> torch.Tensor:
    """The published weight in `dtype`: payload · its block's scale in FP32, rounded once to `dtype`.

    FP32 is the precision transformers dequantizes in before it rounds to the model's dtype, so
    `dequantize_published(q, s, torch.bfloat16)` is bit for bit the BF16 weight `from_pretrained`
    makes of the checkpoint on a machine without FP8 GEMMs.
    """
    _check_grid(payload, scale_inv, block)
    rows, cols = payload.shape
    real = blocked(widen(payload, torch.float32), block) * block_scales_fp32(scale_inv)[:, None, :, None]
    return unblocked(real)[:rows, :cols].to(dtype)


def quantize_published(
    weight: torch.Tensor, block: tuple[int, int] = BLOCK, *, scale_fmt: str = "float"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 payload, weight_scale_inv) of `weight` in the published format.

    Each block's scale maps its largest magnitude onto E4M3's largest value (amax / 448, FP32; an
    all-zero block gets 1); with `scale_fmt="ue8m0"` the scale is rounded up to a power of two
    and stored as E8M0. A non-finite element makes its block's scale non-finite, so the block
    dequantizes to NaN: an overflow stays visible instead of being clamped into the checkpoint.
    """
    if scale_fmt not in ("float", "ue8m0"):
        raise ValueError(f"scale_fmt must be 'float' or 'ue8m0', got {scale_fmt!r}")
    if weight.dim() != 2:
        raise ValueError(f"a block-scaled weight is 2-D (out × in), got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    blocks = blocked(weight.detach().float(), block)
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    if scale_fmt == "ue8m0":
        scale_inv = torch.exp2(torch.ceil(torch.log2(scale_inv)))
    scaled = (blocks / scale_inv[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    payload = unblocked(scaled)[:rows, :cols].to(E4M3)
    if scale_fmt == "ue8m0":
        if _E8M0 is None:
            raise RuntimeError("scale_fmt='ue8m0' needs torch.float8_e8m0fnu (torch >= 2.7)")
        exponents = (torch.log2(scale_inv) + 127).clamp(0, 254).to(torch.uint8)
        return payload, exponents.view(_E8M0)
    return payload, scale_inv


class _FrozenBlockFP8Function(torch.autograd.Function):
    """y = x·Wᵀ + b with W widened from its blocks in forward and again in backward (never saved)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        payload: torch.Tensor,
        scale_inv: torch.Tensor,
        bias: torch.Tensor | None,
        block: tuple[int, int],
    ) -> torch.Tensor:
        weight = dequantize_published(payload, scale_inv, x.dtype, block)
        ctx.save_for_backward(payload, scale_inv)
        ctx.block = block
        ctx.bias_grad = bias is not None and bias.requires_grad
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        payload, scale_inv = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out @ dequantize_published(payload, scale_inv, grad_out.dtype, ctx.block)
        grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.bias_grad else None
        return grad_x, None, None, grad_bias, None


class FrozenBlockFP8Linear(nn.Module):
    """A linear layer whose frozen weight stays as published: E4M3 payload + per-block scales.

    For a layer nothing trains (the base of a LoRA run): about 1 byte per parameter. `weight`
    (E4M3) and `weight_scale_inv` keep the checkpoint's names, so its state dict is the published
    one. The GEMM runs in the activations' dtype (the autocast dtype under autocast) on the weight
    widened from its blocks, the numerics of the dequantized checkpoint. Forward widens the weight
    one layer at a time and backward widens it again for the input gradient: autograd never saves
    the widened weight, so a step holds one layer's 16-bit weight at a time, never the model's.
    """

    def __init__(
        self,
        payload: torch.Tensor,
        scale_inv: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        block: tuple[int, int] = BLOCK,
    ) -> None:
        super().__init__()
        if payload.dtype != E4M3:
            raise ValueError(f"the published payload is float8_e4m3fn, got {payload.dtype}")
        _check_grid(payload, scale_inv, block)
        self.out_features, self.in_features = payload.shape
        self.block = tuple(block)
        self.weight = nn.Parameter(payload.detach(), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale_inv.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if torch.is_autocast_enabled(device):
            x = x.to(torch.get_autocast_dtype(device))
        return _FrozenBlockFP8Function.apply(x, self.weight, self.weight_scale_inv, self.bias, self.block)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> FrozenBlockFP8Linear:
        # `.to(device)` moves the published bytes; a dtype conversion (`model.float()`, `.half()`,
        # `.to(torch.bfloat16)`) leaves them as published: a cast would widen the payload to 2-4
        # bytes and round the FP32 scales.
        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            return out if out.dtype == t.dtype or t is self.bias else t.to(out.device)

        return super()._apply(keep_dtype, recurse)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as the checkpoint's dequantized load holds it in `dtype`."""
        return dequantize_published(self.weight, self.weight_scale_inv, dtype, self.block)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"block={self.block[0]}x{self.block[1]}, frozen_fp8"
        )
