"""Work over a list of stored FP8 gradients (payload, scale) for FP8-LM O3's ZeRO clipping and
skip masking, and O2's clipping on a GPU (`clip_on_device`): per-tensor loops on CPU; on a GPU,
compiled calls over consecutive chunks of them (`compiling.run_fused_rows`), the loops' operations
in the loops' order, where the loops were a few eager launches per FP8 weight (issue #66)."""

from __future__ import annotations

import math

import torch

from ..compiling import own_graphs, run_fused, run_fused_rows, takes_gpu_path
from .cast import widen

__all__ = [
    "add_in_order",
    "clip_on_device",
    "mask_skipped_stored",
    "squares_of_stored",
    "sum_of_stored_squares",
    "zero_skipped_stored",
]

Stored = list[tuple[torch.Tensor, torch.Tensor]]


def squares_of_stored(rows: Stored) -> list[torch.Tensor]:
    """(‖payload‖ / scale)² of each row, in FP32."""
    return [(torch.linalg.vector_norm(widen(payload, torch.float32)) / scale).square() for payload, scale in rows]


def add_in_order(total: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
    """total + terms[0] + terms[1] + …, one rounding per addition in that order (the loop's)."""
    for term in terms.unbind(0):
        total = total + term
    return total


def zero_skipped_stored(rows: Stored, skip: torch.Tensor) -> None:
    """Where the 0-dim bool `skip` is set, each payload zeroed (bytes) and its scale set to 1."""
    for payload, scale in rows:
        payload.view(torch.uint8).masked_fill_(skip, 0)
        scale.masked_fill_(skip, 1.0)


def sum_of_stored_squares(stored: Stored, device: torch.device) -> torch.Tensor:
    """Σ (‖payload‖ / scale)² over `stored` from an FP32 zero on `device`, added in the list's order:
    eagerly on CPU; on a GPU the squares in compiled calls over chunks (`run_fused_rows`) and their
    sum in one graph (run eagerly, the loop's bits; compiled, each norm may add in another order)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    if not stored or not takes_gpu_path(stored[0][0].device):
        return add_in_order(total, torch.stack(squares_of_stored(stored))) if stored else total
    terms = torch.stack(run_fused_rows(squares_of_stored, stored, like=stored[0][0]))
    return run_fused(own_graphs(add_in_order, len(stored)), total, terms, like=terms)


def mask_skipped_stored(stored: Stored, unless: torch.Tensor) -> None:
    """Where the step's flag `unless` is nonzero, the stored FP8 gradients zeroed (scales 1) on the
    device: eagerly on CPU, one compiled call per chunk on a GPU."""
    skip = unless != 0
    if not stored or not takes_gpu_path(stored[0][0].device):
        zero_skipped_stored(stored, skip)
        return
    run_fused_rows(zero_skipped_stored, stored, skip, like=stored[0][0])


def clamp_stored(stored: Stored, clip_value: float) -> None:
    """Each payload clamped to the largest FP8 value v with v / scale <= clip_value (NaN stays NaN)."""
    for payload, scale in stored:
        bound = (clip_value * scale.float()).clamp(max=torch.finfo(payload.dtype).max)
        code = bound.to(payload.dtype)
        below = (code.view(torch.uint8) - 1).view(payload.dtype)  # the next FP8 value towards 0
        limit = torch.where(widen(code, torch.float32) > bound, widen(below, torch.float32), widen(code, torch.float32))
        wide = widen(payload, torch.float32)
        payload.copy_(torch.minimum(torch.maximum(wide, -limit), limit).to(payload.dtype))


def clip_on_device(
    dense: list[torch.Tensor], stored: list[tuple[torch.Tensor, torch.Tensor]], max_norm: float
) -> torch.Tensor:
    """`gradients.BackwardFP8Gradients.clip_grad_norm` on a GPU: each gradient's square in compiled calls
    over chunks of gradients (`run_fused_rows`: a graph over every gradient took minutes to build
    there), the norm and c = min(1, max_norm / (norm + 1e-6)) in one small graph, then c applied
    by two multi-tensor operations. The eager loop's operations, so run eagerly it gives the
    loop's bits; compiled, the reductions may add in another order."""
    like = stored[0][0]
    squares = run_fused_rows(_squares_of_dense, dense, like=like) if dense else []
    squares += run_fused_rows(_squares_of_stored, stored, like=like)
    stacked = torch.stack(squares)
    if not math.isfinite(max_norm):
        return run_fused(_norm_of, stacked, like=stacked)
    norm, coefficient = run_fused(_norm_and_coefficient, stacked, max_norm, like=stacked)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in dense:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for dtype, grads in by_dtype.items():
        torch._foreach_mul_(grads, coefficient.to(dtype))
    torch._foreach_div_([scale for _, scale in stored], coefficient)
    return norm


def _squares_of_dense(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.linalg.vector_norm(g.float()).square() for g in grads]


def _squares_of_stored(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    return [(torch.linalg.vector_norm(payload.float()) / scale).square() for payload, scale in rows]


def _norm_of(squares: torch.Tensor) -> torch.Tensor:
    return squares.sum().sqrt()


def _norm_and_coefficient(squares: torch.Tensor, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    norm = squares.sum().sqrt()
    return norm, (max_norm / (norm + 1e-6)).clamp(max=1.0)
