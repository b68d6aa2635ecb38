"""COAT's FP8 optimizer-state format: per-group FP8 with dynamic range expansion (COAT Part 1; docs/algorithms.md §4).

A tensor x is flattened, zero-padded to a multiple of G (default 128) and cut into groups of
G consecutive elements. Per group, with mx = max|x| and mn = the smallest non-zero |x|:

    c = √mx·√mn,   R = mx/mn,   k = max(1, floor(log2(F²/2) / log2(R) · 16) / 16)
    y = sign(x)·(|x|/c)^k                        (the expand function f)
    q = FP8(y·s),  s = F / max|y|                (real y = q / s, the `hf_lowprec.fp8` convention)
    x̂ = sign(q)·|q / s|^(1/k)·c                  (decode)

F is the FP8 format's maximum (448 for E4M3, 57344 for E5M2). k stretches the group's
dynamic range R to about F²/2, the span E4M3 covers from near its smallest subnormal (2^-9)
to its maximum: a group of first moments spans ~1e3 and of second moments ~1e1, so without
expansion most FP8 codes go unused and the relative error is large. When k > 1 the smallest
non-zero element lands at F/R^k ≥ 2/F, above the smallest subnormal (2^-9 for E4M3, 2^-16
for E5M2), so it does not decode to 0. A group wider than F²/2 (k = 1) is plain per-group
scaling, where elements below F·2^-10/R (E4M3) flush to zero as they would without COAT.

Guards: an all-zero group stores k = 1, c = 1, s = 1 and zero codes; a group whose non-zero
magnitudes are all equal (R = 1) takes k = 1 (nothing to expand); k never drops below 1, and
a group with k = 1 (wider than F²/2, or R = 1) stores c = 1: plain per-group scaling. c is √mx·√mn rather than √(mx·mn) so that
the product cannot underflow for second moments near 1e-30. The scale s is F/max|y|, not a
power of two, so the group's maximum maps exactly to F (COAT does the same; a power of two
could waste up to one binade at the bottom of the range). NaN or ±inf in a group makes the
whole group decode to NaN, so the problem stays visible.

`expand=False` gives plain per-group scaling (k = 1, c = 1), the baseline COAT compares with.
(s, k, c) are FP32, one of each per group: 12 bytes per 128 elements, 0.094 bytes/element.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..fp8.scaled import dequantize, format_max, quantize
from ..numerics import sqrt_rn

__all__ = ["FP8_STATE_DTYPES", "FP8GroupState", "dequantize_state", "expansion_exponent", "quantize_state"]

#: FP8 formats a state can be stored in.
FP8_STATE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# k is a multiple of 1/16 (COAT): the floor keeps R^k at or below the target range.
_K_STEPS = 16


def _check(group_size: int, fp8_dtype: torch.dtype) -> None:
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r} (COAT uses 128)")
    if fp8_dtype not in FP8_STATE_DTYPES:
        raise ValueError(
            f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}"
        )


def expansion_exponent(amax: torch.Tensor, amin: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """k = max(1, floor(log2(F²/2) / log2(amax/amin) · 16) / 16) per group, FP32.

    Args:
        amax: max |x| per group; amin: smallest non-zero |x| per group (any value where amax = 0).
    Groups with amax = 0 or amax/amin ≤ 1 get k = 1.
    """
    target = math.log2(format_max(fp8_dtype) ** 2 / 2)
    log_range = torch.log2(amax.double()) - torch.log2(amin.double())
    usable = (amax > 0) & (log_range > 0)
    raw = torch.floor(target / torch.where(usable, log_range, torch.ones_like(log_range)) * _K_STEPS) / _K_STEPS
    return torch.where(usable, raw.clamp(min=1.0), torch.ones_like(raw)).float()


@dataclasses.dataclass
class FP8GroupState:
    """An FP8 tensor with per-group (scale, k, c): real = sign(q)·|q / scale|^(1/k)·c.

    Attributes:
        payload: FP8 codes, flat, padded to a multiple of `group_size`.
        scale: FP32 per group, payload = y·scale (y the expanded value).
        exponent: FP32 k per group (1 when not expanded).
        center: FP32 c per group (1 when not expanded).
        shape: shape of the original tensor.
        group_size: elements per group.
        expand: whether the dynamic range expansion was applied.
    """

    payload: torch.Tensor
    scale: torch.Tensor
    exponent: torch.Tensor
    center: torch.Tensor
    shape: tuple[int, ...]
    group_size: int = 128
    expand: bool = True

    @classmethod
    def zeros(
        cls,
        shape: torch.Size | tuple[int, ...],
        *,
        group_size: int = 128,
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
        expand: bool = True,
        device: torch.device | str | None = None,
    ) -> FP8GroupState:
        """The state of an all-zero tensor: zero codes, (s, k, c) = (1, 1, 1)."""
        _check(group_size, fp8_dtype)
        groups = -(-math.prod(shape) // group_size)
        ones = torch.ones(groups, device=device)
        payload = torch.zeros(groups * group_size, dtype=fp8_dtype, device=device)
        return cls(payload, ones, ones.clone(), ones.clone(), tuple(shape), group_size, expand)

    def dequantize(self) -> torch.Tensor:
        """The decoded values, FP32, in the original shape."""
        y = dequantize(self.payload, self.scale, torch.float32, self.group_size)
        if self.expand:
            groups = y.view(-1, self.group_size)
            magnitude = groups.abs().pow_(self.exponent.reciprocal()[:, None]).mul_(self.center[:, None])
            y = magnitude.copysign_(groups).view(-1)
        return y[: math.prod(self.shape)].view(self.shape)

    def nbytes(self) -> int:
        """Bytes held by the codes and the per-group metadata."""
        return sum(t.numel() * t.element_size() for t in (self.payload, self.scale, self.exponent, self.center))


torch.serialization.add_safe_globals([FP8GroupState])


def quantize_state(
    x: torch.Tensor,
    group_size: int = 128,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    expand: bool = True,
) -> FP8GroupState:
    """Quantize `x` to per-group FP8, with COAT's dynamic range expansion unless `expand=False`.

    Args:
        x: any floating tensor (the arithmetic is FP32; FP64 inputs are rounded to FP32 first).
        group_size: G, consecutive elements sharing (s, k, c).
        fp8_dtype: torch.float8_e4m3fn (COAT's choice for both moments) or torch.float8_e5m2.
        expand: apply f(x) = sign(x)·(|x|/c)^k before scaling; False is plain per-group scaling.
    """
    _check(group_size, fp8_dtype)
    if not x.is_floating_point():
        raise ValueError(f"quantize_state takes a floating-point tensor, got {x.dtype}")
    numel = x.numel()
    groups = -(-numel // group_size)
    flat = torch.zeros(groups * group_size, dtype=torch.float32, device=x.device)
    flat[:numel] = x.detach().reshape(-1)
    grouped = flat.view(groups, group_size)
    magnitude = grouped.abs()
    amax = magnitude.amax(dim=1)
    ones = torch.ones_like(amax)
    if expand:
        amin = torch.where(magnitude > 0, magnitude, torch.full_like(magnitude, math.inf)).amin(dim=1)
        exponent = expansion_exponent(amax, amin, fp8_dtype)
        # k = 1 needs no centre; c = 1 there also keeps |x|/c finite for ranges beyond FP32's.
        center = torch.where((amax > 0) & (exponent > 1), sqrt_rn(amax) * sqrt_rn(amin), ones)
        magnitude = magnitude.div_(center[:, None]).pow_(exponent[:, None])
        grouped = magnitude.copysign(grouped)
        amax = magnitude.amax(dim=1)
    else:
        exponent, center = ones, ones.clone()
    # amax = 0 (all zero) → scale 1; NaN/inf → the division gives NaN or 0 and the group decodes to NaN.
    finite = torch.isfinite(amax)
    scale = torch.where(amax > 0, format_max(fp8_dtype) / amax, ones)
    scale = torch.where(finite, scale, torch.full_like(scale, math.nan))
    payload = quantize(grouped.view(-1), scale, fp8_dtype, group_size)
    return FP8GroupState(payload, scale, exponent, center, tuple(x.shape), group_size, expand)


def dequantize_state(state: FP8GroupState) -> torch.Tensor:
    """The FP32 values of `state`, in the shape of the tensor it was made from."""
    return state.dequantize()
