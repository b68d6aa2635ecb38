"""Fast conversions between FP8 payloads and wider floats, with the values of PyTorch's casts.

PyTorch's CPU kernels convert to and from float8 one element at a time (2–5 ns per element
measured here: more than the BF16 GEMM that consumes the tensor). `widen` (a table lookup) and
`scale_to_fp8` (one compiled loop) give exactly what the plain casts give, faster.
"""

from __future__ import annotations

import sys

import torch

from ..compiling import constant, run_fused, takes_gpu_path

__all__ = [
    "has_nan",
    "nan_flag",
    "nan_flags",
    "saturate_to_fp8_eager",
    "scale_to_fp8",
    "unscale_into",
    "widen",
]


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@constant
def _table(fp8: torch.dtype, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.arange(256, dtype=torch.uint8, device=device).view(fp8).to(dtype)


@constant
def _pair_table(fp8: torch.dtype, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """65536 entries: the 2-byte values of both codes of a little-endian byte pair, as one int32."""
    pair = torch.arange(65536, dtype=torch.int32, device=device)
    single = _table(fp8, dtype, device)
    return torch.stack([single[pair & 0xFF], single[pair >> 8]], dim=1).view(torch.int32).reshape(-1)


def widen(payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`payload.to(dtype)` for an FP8 payload, by table lookup on CPU (same values, bit for bit).

    An FP8 payload has only 256 codes, so widening is a lookup of the byte in a 256-entry table
    of the exact values (1.2 ms for a 512×3072 tensor, against 5–8 ms for the cast); for 16-bit
    results, two bytes at a time in a 65536-entry table of value pairs (0.6 ms). The tables are
    made by PyTorch's own conversion of the 256 codes, so every value, ±0, subnormals and NaN
    included, is the one `payload.to(dtype)` gives. Other devices convert natively (fast
    there), and non-FP8 tensors are converted by `.to`.
    """
    if payload.dtype not in FP8_DTYPES or takes_gpu_path(payload.device) or torch.compiler.is_compiling():
        # Inductor's own conversion is exact and vectorised; the tables would be graph constants.
        return payload.to(dtype)
    if payload.dim() == 2 and not payload.is_contiguous() and payload.t().is_contiguous():
        return widen(payload.t(), dtype).t()  # a transposed operand keeps its layout, no copy
    codes = payload.view(torch.uint8).reshape(-1)
    if dtype.itemsize == 2 and codes.numel() % 2 == 0 and sys.byteorder == "little":
        # Two codes per lookup: half the index conversions and gathers (1.9× faster here).
        pairs = codes.contiguous().view(torch.uint16).int()
        return (
            torch.index_select(_pair_table(payload.dtype, dtype, payload.device), 0, pairs)
            .view(dtype)
            .view(payload.shape)
        )
    # index_select takes int32 indices on CPU: a quarter of the int64 index tensor's traffic.
    out = torch.index_select(_table(payload.dtype, dtype, payload.device), 0, codes.int())
    return out.view(payload.shape)


@constant
def _first_nan_code(fp8: torch.dtype) -> int:
    """The smallest code in 0..127 whose value is NaN: E4M3 0x7F, E5M2 0x7D.

    Both formats order the codes of one sign by magnitude and put their NaNs at the top, so a
    positive NaN is a code ≥ this one and a negative NaN a code ≥ 0x80 plus it.
    """
    values = _table(fp8, torch.float32, torch.device("cpu"))[:128]
    return int(values.isnan().nonzero()[0])


def nan_flag(payload: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on the payload's device: True when an FP8 payload holds a NaN code,
    read from its bytes (no conversion, no host sync).

    Two integer maxima decide: as int8 the negative codes sort below every positive one, so
    the int8 maximum is the largest positive code; as uint8 the largest code overall, which
    is negative when any negative code exceeds every positive one. 2.6 ms per 85M codes on
    CPU, against 250 ms for widening and testing each value.
    """
    if payload.dtype not in FP8_DTYPES:
        return payload.isnan().any()
    if not payload.numel():
        return torch.zeros((), dtype=torch.bool, device=payload.device)
    first = _first_nan_code(payload.dtype)
    return (payload.view(torch.int8).amax() >= first) | (payload.view(torch.uint8).amax() >= 0x80 + first)


def nan_flags(payloads: list[torch.Tensor]) -> torch.Tensor:
    """`nan_flag` of any of `payloads` (FP8, one device) in a few multi-tensor launches whatever
    their number: the same two integer maxima, taken over each format's list at once."""
    by_format: dict[torch.dtype, list[torch.Tensor]] = {}
    for payload in payloads:
        if payload.numel():
            by_format.setdefault(payload.dtype, []).append(payload)
    flag = torch.zeros((), dtype=torch.bool, device=payloads[0].device)
    for fp8, group in by_format.items():
        first = _first_nan_code(fp8)
        signed = torch.stack(torch._foreach_max([p.view(torch.int8) for p in group])).amax()
        unsigned = torch.stack(torch._foreach_max([p.view(torch.uint8) for p in group])).amax()
        flag = flag | (signed >= first) | (unsigned >= 0x80 + first)
    return flag


def has_nan(payload: torch.Tensor) -> bool:
    """`nan_flag` read on the host (one sync: for checks outside the training step)."""
    return bool(nan_flag(payload))


def _scale_to_fp8_eager(x: torch.Tensor, factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # x.float() aliases an FP32 input: the product is out of place.
    return (x.float() * factor).to(dtype)


def saturate_to_fp8_eager(
    x: torch.Tensor, factor: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, saturated): x·factor formed in FP32, clamped to ±max(dtype) and cast (nearest
    even), ±inf and NaN made NaN; and the number of finite elements it clipped (an int64 tensor,
    no host sync). The eager ops, traced into `fused.gradient_cast`'s graph."""
    y = x.float() * factor
    limit = torch.finfo(dtype).max
    magnitude = y.abs()
    saturated = ((magnitude > limit) & (magnitude != float("inf"))).sum()
    # The clamp keeps every finite |y| ≤ limit and the sign of zero; the factor y − y + 1 is 1
    # for finite y and NaN for ±inf and NaN (exact: a product by one), so inf becomes NaN.
    return (y.clamp(-limit, limit) * (y - y + 1)).to(dtype), saturated


def _unscale_into_compiled(out: torch.Tensor, payload: torch.Tensor, scale: torch.Tensor) -> None:
    # Inductor's FP8 → FP32 conversion is exact and vectorised (unlike the eager cast).
    out.copy_(payload.to(torch.float32) / scale)


def scale_to_fp8(x: torch.Tensor, factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 payload of x·factor: the product formed in FP32, then cast to `dtype` (nearest even).

    On CPU, Inductor compiles the product and the cast into one vectorised loop (0.6 ms for a
    512×3072 tensor) where a C++ compiler is available; the eager ops run otherwise. Both round
    to nearest even (tests/fp8/test_cast.py compares them bit for bit). The caller picks `factor` so that |x·factor| ≤ max(dtype) (or makes it NaN to mark an
    overflow): the cast does not saturate.
    """
    if dtype not in FP8_DTYPES:
        return _scale_to_fp8_eager(x, factor, dtype)
    return run_fused(_scale_to_fp8_eager, x.reshape(-1), factor, dtype, like=x).view(x.shape)


def unscale_into(out: torch.Tensor, payload: torch.Tensor, scale: torch.Tensor) -> None:
    """out ← payload / scale in place (FP32 division, then rounded to out's dtype): the values of
    `scaled.dequantize(payload, scale, out.dtype)` without its FP32 temporary, in one compiled
    pass on CPU (O1 writes every FP8 gradient back into its `p.grad` this way: the lookup,
    division and copy took 7.6 ns per element, more than the rest of the step).
    """
    if payload.dtype not in FP8_DTYPES or not (out.is_contiguous() and payload.is_contiguous()):
        out.copy_(widen(payload, torch.float32) / scale.float())
        return
    run_fused(_unscale_into_compiled, out.view(-1), payload.view(-1), scale.float(), like=out)
