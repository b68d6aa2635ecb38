"""Signal-to-noise ratios of a low-precision result against its FP64 reference, in dB.

SNR = 10·log10(Σ ref² / Σ (ref − value)²): the FP8 GEMM checks bound it from below by the
rounding of the operands (each rounded once to its format; the tests write the floor).
"""

from __future__ import annotations

import math

import torch

__all__ = ["row_snr_db", "snr_db"]


def snr_db(reference: torch.Tensor, value: torch.Tensor) -> float:
    """The SNR of `value` against `reference` over all elements, in FP64 on the CPU."""
    reference, value = reference.detach().cpu().double(), value.detach().cpu().double()
    return 10 * math.log10(reference.pow(2).sum().item() / (reference - value).pow(2).sum().item())


def row_snr_db(reference: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """10·log10(Σ ref² / Σ (ref − value)²) per row, in FP64 (`reference` is FP64)."""
    err = (reference - value.double()).pow(2).sum(1)
    return 10 * torch.log10(reference.pow(2).sum(1) / err)
