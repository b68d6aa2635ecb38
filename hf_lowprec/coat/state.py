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

The encoding and decoding are `hf_lowprec.formats.GroupFP8`, the format COATAdamW stores its
states in; this module wraps them as a standalone container.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..formats import GroupFP8, expansion_exponent

__all__ = ["FP8_STATE_DTYPES", "FP8GroupState", "dequantize_state", "expansion_exponent", "quantize_state"]

#: FP8 formats a state can be stored in.
FP8_STATE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


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
        codec = GroupFP8(fp8_dtype, group_size, expand)
        payload, scale, exponent, center = codec.zeros(torch.empty(math.prod(shape), device=device))
        return cls(payload, scale, exponent, center, tuple(shape), group_size, expand)

    def dequantize(self) -> torch.Tensor:
        """The decoded values, FP32, in the original shape."""
        codec = GroupFP8(self.payload.dtype, self.group_size, self.expand)
        y = codec.decode(self.payload, self.scale, self.exponent, self.center).reshape(-1)
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
    codec = GroupFP8(fp8_dtype, group_size, expand)
    if not x.is_floating_point():
        raise ValueError(f"quantize_state takes a floating-point tensor, got {x.dtype}")
    state = FP8GroupState.zeros(
        tuple(x.shape), group_size=group_size, fp8_dtype=fp8_dtype, expand=expand, device=x.device
    )
    flat = torch.zeros(state.payload.numel(), dtype=torch.float32, device=x.device)
    flat[: x.numel()] = x.detach().reshape(-1)
    codec.encode_(flat, state.payload, state.scale, state.exponent, state.center)
    return state


def dequantize_state(state: FP8GroupState) -> torch.Tensor:
    """The FP32 values of `state`, in the shape of the tensor it was made from."""
    return state.dequantize()
