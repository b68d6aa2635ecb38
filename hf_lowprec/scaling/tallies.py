"""The tallies of Graphcore automatic loss scaling (`als.AutomaticLossScaler`): a gradient's
counts, and the functions that count, clamp, unscale and decide the scale, written for compiled
graphs (one per activation hook, one over every FP16 weight gradient, one for the step's end: a
GPU's form) and for autograd; run eagerly, they are the CPU's form."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..compiling import in_torch_func
from .loss_scale import FP16_MAX

__all__ = [
    "A_TOTAL",
    "A_UPPER",
    "W_TOTAL",
    "W_UPPER",
    "P_STEPS",
    "P_TOTAL",
    "P_UPPER",
    "ActivationTally",
    "clamp_fp16_",
    "decide_scale",
    "gradient_counts",
    "sum_over_ranks",
    "tally_activation",
    "unscale_half_together",
]

# This step's tallies (the scaler's, int64): upper-bin and total counts of the weight gradients,
# then of the activation gradients (this rank's samples).
W_UPPER, W_TOTAL, A_UPPER, A_TOTAL = range(4)
# Across the period (the scaler's, int64): upper-bin count, total count, steps.
P_UPPER, P_TOTAL, P_STEPS = range(3)


def gradient_counts(grad: torch.Tensor, bin_edge: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(elements of `grad` in the upper bin |g| ≥ bin_edge, elements beyond ±65504 when FP16 else None), int64
    tensors on the gradient's device: the tallies of the eager hooks and of `ActivationTally` alike.
    `bin_edge` is a value of grad's dtype (the scaler rounds it), so eager and compiled agree."""
    magnitude = grad.detach().abs()
    clipped = (magnitude > FP16_MAX).sum() if grad.dtype == torch.float16 else None
    return (magnitude >= bin_edge).sum(), clipped


class ActivationTally(torch.autograd.Function):
    """Identity in forward; in backward, the gradient's counts (upper bin, total, beyond ±65504) as the gradient
    of row `row` of the FP64 `probe`, and the gradient clamped to ±65504 when FP16. The forward returns a copy,
    not a view: a later in-place op on a view of a custom Function's output is refused by autograd (an in-place
    ReLU after a Linear); Inductor fuses the copy into the kernels that produce or consume it."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, probe: torch.Tensor, row: int, bin_edge: float) -> torch.Tensor:
        ctx.row, ctx.rows, ctx.bin_edge = row, probe.shape[0], bin_edge
        return out.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        upper, clipped = gradient_counts(grad, ctx.bin_edge)
        total = torch.full((), grad.numel(), dtype=torch.float64, device=grad.device)
        counts = torch.stack([upper.double(), total, total.new_zeros(()) if clipped is None else clipped.double()])
        rows = torch.nn.functional.pad(counts[None], (0, 0, ctx.row, ctx.rows - ctx.row - 1))
        if grad.dtype == torch.float16:
            grad = grad.clamp(-FP16_MAX, FP16_MAX)  # NaN stays NaN, ±inf becomes ±65504
        return grad, rows, None, None


def tally_activation(
    grad: torch.Tensor, step: torch.Tensor, clipped: torch.Tensor, row: int, bin_edge: float
) -> torch.Tensor | None:
    """What the scaler's eager activation hook does, run as it is on CPU and as one compiled graph on a
    GPU: the counts into `step` and row `row` of `clipped`; the clamped gradient when FP16. A torch.func
    transform's gradient (`grad` over `functional_call`) is clamped alike but not counted: it is no
    training step's, and the transform refuses writes into tensors captured from outside it."""
    if in_torch_func():
        return grad.clamp(-FP16_MAX, FP16_MAX) if grad.dtype == torch.float16 else None
    counted, beyond = gradient_counts(grad, bin_edge)
    step[A_UPPER].add_(counted)
    step[A_TOTAL].add_(grad.numel())
    if beyond is None:
        return None
    clipped[row].add_(beyond)
    return grad.clamp(-FP16_MAX, FP16_MAX)  # NaN stays NaN (a lost value still surfaces), ±inf becomes ±65504


def unscale_half_together(
    rows: list[tuple[torch.Tensor, torch.Tensor]],
    step: torch.Tensor,
    clipped: torch.Tensor,
    nan: torch.Tensor,
    inverse: torch.Tensor,
    bin_edge: float,
) -> None:
    """What the scaler's unscaling does to FP16 weight gradients, written for compiled graphs over
    chunks of them (`compiling.run_fused_rows`; each row a gradient and its slot of `clipped` as a
    one-element index, data to the graph, so one graph serves every chunk): each gradient's counts
    (`gradient_counts`) into `step` and its slot of `clipped` (exact integers, in any order), then
    clamped to ±65504, multiplied by `inverse` in FP32 and rounded once to FP16 (as
    `torch._amp_foreach_non_finite_check_and_unscale_` does, which sets `nan` for a non-finite
    product: a NaN, or an inf when 65504 · inverse overflows FP32), and clamped again."""
    upper = step.new_zeros(())
    total = 0
    for grad, slot in rows:
        counted, beyond = gradient_counts(grad, bin_edge)
        upper = upper + counted
        total += grad.numel()
        clipped.index_add_(0, slot, beyond.view(1))
        unscaled = grad.clamp(-FP16_MAX, FP16_MAX).float() * inverse
        nan.copy_(torch.maximum(nan, (~torch.isfinite(unscaled)).any().to(nan.dtype)))
        grad.copy_(unscaled.to(torch.float16).clamp(-FP16_MAX, FP16_MAX))
    step[W_UPPER].add_(upper)
    step[W_TOTAL].add_(total)


def clamp_fp16_(grads: list[torch.Tensor]) -> None:
    """Clamp FP16 tensors to ±65504 in place (NaN stays NaN, ±inf becomes ±65504)."""
    torch._foreach_clamp_min_(grads, -FP16_MAX)
    torch._foreach_clamp_max_(grads, FP16_MAX)


def decide_scale(
    scale: torch.Tensor,
    period: torch.Tensor,
    last_share: torch.Tensor,
    last_clipped: torch.Tensor,
    total_clipped: torch.Tensor,
    step: torch.Tensor,
    clipped: torch.Tensor,
    nan: torch.Tensor,
    overflowing: torch.Tensor,
    new_episodes: torch.Tensor,
    steps_per_period: int,
    threshold: float,
    min_scale: float,
    max_scale: float,
) -> None:
    """The end of a step, in place on the scaler's buffers: the clipped counts folded into the
    totals and overflow episodes, the step's tallies into the period's, and at the end of a
    period (or at once on a NaN) the ALS rule: halve the scale when the upper-bin share exceeds
    `threshold` (or on a NaN), double it otherwise, within [min_scale, max_scale]; then the step's
    tallies zeroed. Written for one compiled graph (a GPU's form); eagerly, the CPU's."""
    # Every value is formed first, then the buffers are written.
    step_clipped = clipped.sum()
    now = clipped > 0
    upper = period[P_UPPER] + step[W_UPPER] + step[A_UPPER]
    total = period[P_TOTAL] + step[W_TOTAL] + step[A_TOTAL]
    steps = period[P_STEPS] + 1
    found_nan = nan > 0
    decide = found_nan | (steps >= steps_per_period)
    # Counts below 2^53 are exact in FP64: the share is the correctly rounded quotient.
    share = torch.where(total > 0, upper.double() / total.double().clamp(min=1), 0.0)
    halved = (scale / 2.0).clamp(min=min_scale)
    doubled = (scale * 2.0).clamp(max=max_scale)
    new_scale = torch.where(found_nan | (share > threshold), halved, doubled)
    last_clipped.copy_(step_clipped)
    total_clipped.add_(step_clipped)
    new_episodes.add_(now & ~overflowing)
    overflowing.copy_(now)
    period.copy_(torch.stack([upper, total, steps]) * ~decide)  # a decision starts a new period
    scale.copy_(torch.where(decide, new_scale, scale))
    # Through a 1-element view: Inductor's CPU kernels (torch 2.13) lose an in-place write to a
    # 0-dim FP64 input (tests/test_scaling.py holds the compiled path to the eager bits).
    last_share.view(1).copy_(torch.where(decide, share, last_share).view(1))
    step.zero_()
    clipped.zero_()
    nan.zero_()


def sum_over_ranks(group: Any, tallies: list[torch.Tensor]) -> None:
    """Sum `tallies` over the ranks of `group` in place, by one all-reduce in FP64 (counts below
    2^53: exact); the second is the NaN flag, 1.0 where some rank found one."""
    flat = torch.cat([t.reshape(-1).double() for t in tallies])
    dist.all_reduce(flat, group=group)
    for tally, summed in zip(tallies, flat.split([t.numel() for t in tallies])):
        tally.copy_(summed.reshape(tally.shape))
    tallies[1].clamp_(max=1.0)
