"""The tensorwise FP8 GEMM, `(a / s_a) @ (b / s_b)`, one numerics on every device: the exact
products of the FP8 payloads summed in FP32, times the exact 1/(s_a·s_b), rounded once to BF16.
Two paths compute it (`ScaledMMGemm` on FP8 tensor cores, `UpcastGemm` elsewhere), chosen once
per device (`gemm_for`) unless forced (`set_fp8_gemm_path`) or preferred by a layer's config.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
import torch.nn.functional as F

from .cast import widen

__all__ = [
    "forced_fp8_gemm_path",
    "GEMM_MULTIPLE",
    "GEMM_OUT_DTYPE",
    "GemmPath",
    "ScaledMMGemm",
    "UpcastGemm",
    "check_gemm_path",
    "fp8_gemm_path",
    "fp8_mm",
    "gemm_for",
    "inverse_scales",
    "set_fp8_gemm_path",
]

logger = logging.getLogger(__name__)

# Dimensions _scaled_mm's CUDA kernels need to be multiples of.
GEMM_MULTIPLE = 16
# The dtype every FP8 GEMM's FP32 accumulator is rounded to: BF16's relative rounding (2^-9)
# is 16 times finer than E4M3's (2^-4), so it costs nothing measurable and every device's fast
# GEMM can produce it.
GEMM_OUT_DTYPE = torch.bfloat16
# First CUDA compute capability with FP8 tensor cores (Ada, Hopper and later).
_FP8_TENSOR_CORE_CAPABILITY = (8, 9)

GemmPath = Literal["scaled_mm", "upcast"]


def _pad_2d(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    if rows == t.shape[0] and cols == t.shape[1]:
        return t
    # F.pad has no FP8 kernel; zero bytes are +0.0 in both FP8 formats.
    padded = F.pad(t.contiguous().view(torch.uint8), (0, cols - t.shape[1], 0, rows - t.shape[0]))
    return padded.view(t.dtype)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def inverse_scales(*scales: torch.Tensor) -> list[torch.Tensor]:
    """1/s of each scale, exact for powers of two, in one multi-tensor launch (one each would be
    one launch each): what an FP8 GEMM multiplies by, worked out once for the GEMMs that share it."""
    return list(torch._foreach_reciprocal(list(scales)))


def _inverse_scale(scale_a: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    # Each reciprocal of a power of two in [2^-126, 2^126] is exact.
    return scale_a.reciprocal() * scale_b.reciprocal()


class UpcastGemm:
    """FP8 payloads → BF16 (exact: BF16 holds every E4M3 and E5M2 value) → BF16 matmul with FP32
    accumulation (oneDNN/AMX, cuBLAS); any operand layout. The default off FP8 tensor cores: on
    CPU `torch._scaled_mm` is a reference loop (~1000× a BF16 matmul on GPT-2's GEMMs)."""

    name: GemmPath = "upcast"

    def operand(self, t: torch.Tensor) -> torch.Tensor:
        return widen(t, GEMM_OUT_DTYPE)

    def mm(self, a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor, inverses=None):
        """(a / scale_a) @ (b / scale_b) for prepared operands a (M×K) and b (K×N), in BF16;
        `inverses`: (1/scale_a, 1/scale_b) where the caller has them (`inverse_scales`)."""
        factor = _inverse_scale(scale_a, scale_b) if inverses is None else inverses[0] * inverses[1]
        return torch.mm(a, b).mul_(factor.to(GEMM_OUT_DTYPE))


class ScaledMMGemm:
    """`torch._scaled_mm`, handed cuBLASLt's layout: a row-major, b column-major, dims padded to 16
    (copies, zero padding, whatever layout it is handed). Differs from `UpcastGemm` only in FP32
    summation order.

    Args:
        pad: zero-pad M, K, N to multiples of 16 (what the CUDA kernels need).
    """

    name: GemmPath = "scaled_mm"

    def __init__(self, pad: bool) -> None:
        self.pad = pad

    def operand(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def layout(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(a row-major M'×K', b column-major K'×N'): what `torch._scaled_mm` receives."""
        m, k = a.shape
        n = b.shape[1]
        mp, kp, np_ = (_round_up(d, GEMM_MULTIPLE) for d in (m, k, n)) if self.pad else (m, k, n)
        a_rows = _pad_2d(a.contiguous(), mp, kp)
        b_cols = _pad_2d(b.t().contiguous(), np_, kp).t()
        return a_rows, b_cols

    def mm(self, a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor, inverses=None):
        m, n = a.shape[0], b.shape[1]
        a_rows, b_cols = self.layout(a, b)
        # _scaled_mm's scales are dequantization multipliers: 1/s, exact for powers of two.
        inv_a, inv_b = inverse_scales(scale_a, scale_b) if inverses is None else inverses
        out = torch._scaled_mm(a_rows, b_cols, scale_a=inv_a, scale_b=inv_b, out_dtype=GEMM_OUT_DTYPE)
        return out[:m, :n]


_forced_path: GemmPath | None = None
_chosen: dict[tuple[str, int | None], UpcastGemm | ScaledMMGemm] = {}


def check_gemm_path(path: GemmPath | None) -> None:
    """Raise a clear error unless `path` is "scaled_mm", "upcast" or None."""
    if path not in ("scaled_mm", "upcast", None):
        raise ValueError(f"FP8 GEMM path must be 'scaled_mm', 'upcast' or None, got {path!r}")


def set_fp8_gemm_path(path: GemmPath | None) -> None:
    """Force the FP8 GEMM path on every device ("scaled_mm" or "upcast"), or None for the default."""
    global _forced_path
    check_gemm_path(path)
    _forced_path = path
    _chosen.clear()


def forced_fp8_gemm_path() -> GemmPath | None:
    """The path `set_fp8_gemm_path` forced, or None (to restore it after forcing another)."""
    return _forced_path


def gemm_for(device: torch.device, preferred: GemmPath | None = None) -> UpcastGemm | ScaledMMGemm:
    """The GEMM path on `device`: forced (`set_fp8_gemm_path`), else the layer's preferred one,
    else the device's default ("scaled_mm" from CUDA capability 8.9, else "upcast")."""
    if preferred is not None and _forced_path is None:
        return _new_gemm(preferred, device)
    if torch.compiler.is_compiling():
        # Inside a compiled graph the choice is recomputed while tracing, never looked up:
        # reading `_chosen` would make its contents a guard of the graph, and the first eager
        # call that fills it would recompile the model.
        return _new_gemm(_forced_path or _default_path(device), device)
    key = (device.type, device.index)
    gemm = _chosen.get(key)
    if gemm is None:
        gemm = _new_gemm(_forced_path or _default_path(device), device)
        _chosen[key] = gemm
        reason = "forced" if _forced_path else "default for this device"
        logger.info("FP8 GEMM path on %s: %s (%s)", device, gemm.name, reason)
    return gemm


def _new_gemm(path: GemmPath, device: torch.device) -> UpcastGemm | ScaledMMGemm:
    if path == "scaled_mm" and not hasattr(torch, "_scaled_mm"):
        raise RuntimeError("the 'scaled_mm' FP8 GEMM path needs torch._scaled_mm (torch >= 2.4)")
    return ScaledMMGemm(pad=device.type == "cuda") if path == "scaled_mm" else UpcastGemm()


@torch.compiler.assume_constant_result
def _default_path(device: torch.device) -> GemmPath:
    # A constant of the compiled graph (a device's capability does not change): no guard.
    if device.type == "cuda" and hasattr(torch, "_scaled_mm"):
        if torch.cuda.get_device_capability(device) >= _FP8_TENSOR_CORE_CAPABILITY:
            return "scaled_mm"
    return "upcast"


def fp8_gemm_path(device: torch.device | str) -> GemmPath:
    """The FP8 GEMM path used on `device` by default: "scaled_mm" or "upcast"."""
    return gemm_for(torch.device(device)).name


def fp8_mm(
    a: torch.Tensor,
    scale_a: torch.Tensor,
    b: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    gemm: UpcastGemm | ScaledMMGemm | None = None,
    inverses: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """(a / scale_a) @ (b / scale_b) for FP8 `a` (M×K) and `b` (K×N) in any layout, FP32 accumulation
    (`inverses`: the scales' reciprocals, where the caller has them)."""
    gemm = gemm or gemm_for(a.device)
    out = gemm.mm(gemm.operand(a), scale_a, gemm.operand(b), scale_b, inverses)
    return out.to(out_dtype)
