"""Work over a list of stored FP8 gradients (payload, scale) for FP8-LM O3's ZeRO clipping and
skip masking: per-tensor loops on CPU; on a GPU, compiled calls over consecutive chunks of them
(`compiling.run_fused_rows`), the loops' operations in the loops' order, where the loops were a few eager
launches per FP8 weight (issue #66)."""

from __future__ import annotations

import torch

from ..compiling import own_graphs, run_fused, run_fused_rows, takes_gpu_path
from .cast import widen

__all__ = ["add_in_order", "mask_skipped_stored", "squares_of_stored", "sum_of_stored_squares", "zero_skipped_stored"]

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
