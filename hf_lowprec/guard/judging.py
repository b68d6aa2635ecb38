"""The guard's arithmetic on the device, as compiled graphs (`run_fused`): per forward,
`gather` collects every watched FP8 layer's flush counts at once (each layer counts in its input
cast's own graph); per step, `weigh` sets this step's loss and gradient norm against the window
(z-scores) and asks whether a layer flushed more than `max_flushed` of its inputs, and `settle`
gives the skip flag and moves the window, counters and reasons where the step lands in the ring,
with the ranks' agreement between them. Eagerly this was about forty small kernels a step and
forty per FP8 layer (issue #68).
"""

from __future__ import annotations

import torch

from ..compiling import own_graphs, run_fused

__all__ = ["REASONS", "fresh_window", "gather", "settle", "step_ranges", "weigh"]

# Why a step was skipped, as the device ring `why` holds it (read at a check, for the log).
NOT, NONFINITE, OUTLIER, FLUSHING = 0.0, 1.0, 2.0, 3.0
REASONS = {
    int(
        OUTLIER
    ): "its loss or gradient norm lay more than z_threshold ({0.z_threshold}) spreads above the window's mean",
    int(FLUSHING): "an FP8 layer's input casts flushed more than max_flushed ({0.max_flushed:.1%}) of its non-zero "
    "inputs to zero in that step",
}


def fresh_window(window: int, steps: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The guard's state on the device that `weigh` and `settle` read and move, empty; the next
    step lands at slot `steps` of the ring of the last `window` steps."""
    return {
        "loss": torch.zeros(window, device=device),
        "norm": torch.zeros(window, device=device),
        "valid": torch.zeros(window, device=device),
        "faults": torch.zeros((), device=device),
        "outliers": torch.zeros((), device=device),
        "flushing": torch.zeros((), device=device),
        "last_z": torch.zeros(2, device=device),
        # why each of the last `window` steps was skipped: 0 not, 1 non-finite, 2 an
        # outlier loss or gradient norm, 3 FP8 casts that flushed (read at a check, for the log)
        "why": torch.zeros(window, device=device),
        "step": torch.tensor(float(steps), device=device),
    }


def step_ranges(steps: list[int]) -> str:
    """The steps a skip names, as the log writes them: [3, 4, 5, 9] → "3–5, 9"."""
    parts, start = [], steps[0]
    for previous, step in zip(steps, [*steps[1:], None]):
        if step != previous + 1:
            parts.append(f"{start}–{previous}" if previous > start else f"{start}")
            start = step
    return ", ".join(parts)


def gather(flushes: torch.Tensor, counts: list[torch.Tensor]) -> None:
    """flushes[0] += counts and flushes[1] += counts: one forward's [flushed, non-zero] of each
    watched layer (rows in the guard's order) into the step's sums and the sums since the last
    check, in one graph (one per number of layers: `own_graphs`, a list's length is guarded on)."""
    run_fused(own_graphs(_gather, len(counts)), flushes, counts, like=flushes)


def _gather(flushes, counts):
    flushes.add_(torch.stack(counts).unsqueeze(0))


def weigh(
    state: dict[str, torch.Tensor],
    losses: torch.Tensor | None,
    norm: torch.Tensor,
    flushes: torch.Tensor | None,
    *,
    micro_batches: int,
    judged: bool,
    z_threshold: float,
    warmup: int,
    max_flushed: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(reasons, values): reasons = [outlier, flushing] as 0/1 FP32 (to be agreed over the ranks),
    values = [loss, norm]. `losses`: Σ loss over the step's `micro_batches` (None: no loss seen;
    set to 0 for the next step);
    `judged`: past the first `warmup` steps (else no z-score); `flushes[0]`: the step's [flushed,
    non-zero] per watched layer (`gather`; set to 0 for the next step)."""
    return run_fused(
        _weigh,
        norm.float(),
        losses,
        state["loss"],
        state["norm"],
        state["valid"],
        state["last_z"],
        flushes,
        micro_batches,
        judged,
        z_threshold,
        warmup,
        max_flushed,
        like=norm,
    )


def _weigh(
    norm,
    losses,
    loss_hist,
    norm_hist,
    valid,
    last_z,
    flushes,
    micro_batches,
    judged,
    z_threshold,
    warmup,
    max_flushed,
):
    loss = torch.zeros_like(norm)
    if losses is not None:
        loss = losses / micro_batches
        losses.zero_()  # the next step's sum starts here
    values = torch.stack([loss, norm])
    outlier = torch.zeros_like(norm)
    if judged:
        count = valid.sum().clamp(min=1.0)
        history = torch.stack([loss_hist, norm_hist])
        mean = (history * valid).sum(1) / count
        spread = (((history - mean[:, None]) ** 2 * valid).sum(1) / count).sqrt()
        z = (values - mean) / spread.clamp(min=torch.finfo(torch.float32).tiny)
        if losses is None:  # no loss seen (a trainer that computes it outside the model)
            z = torch.stack([torch.zeros_like(z[1]), z[1]])
        last_z.copy_(z)
        outlier = ((z > z_threshold) | ~torch.isfinite(values)).any().float()
        # After `warmup` steps in the window, and two at least: one step has no spread, and every later
        # step a hair above it would be an outlier (the spread is clamped only at FP32's tiniest).
        outlier = outlier * (valid.sum() >= max(warmup, 2)).float()
    flushing = torch.zeros_like(norm)
    if flushes is not None:
        step = flushes[0]
        share = step[:, 0].double() / step[:, 1].clamp(min=1).double()
        flushing = (share > max_flushed).any().float()
        step.zero_()  # the next step's sums start here
    return torch.stack([outlier, flushing]), values


def settle(
    state: dict[str, torch.Tensor],
    found_inf: torch.Tensor,
    reasons: torch.Tensor,
    values: torch.Tensor,
    kept: list[tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """The skip flag: `found_inf`, or either agreed reason. The step's values enter the window
    where they are finite and it was neither non-finite nor flushing (outliers enter), the
    counters and the ring of reasons move, and a step the guard skips puts `kept` back
    (`watch.Guard.keep` says what they are)."""
    return run_fused(
        _settle,
        found_inf.float(),
        reasons,
        values,
        state["step"],
        state["loss"],
        state["norm"],
        state["valid"],
        state["why"],
        state["faults"],
        state["outliers"],
        state["flushing"],
        [t for t, _ in kept],
        [b for _, b in kept],
        like=found_inf,
    )


def _settle(
    found_inf, reasons, values, step, loss_hist, norm_hist, valid, why, faults, outliers, flushing, now, before
):
    outlier, flushed = reasons.max(), reasons[1]
    skip = torch.maximum(found_inf, outlier)
    undo = outlier * (1.0 - found_inf)
    for tensor, saved in zip(now, before):
        tensor.copy_(torch.where(undo > 0, saved, tensor))
    slot = torch.arange(loss_hist.shape[0], device=step.device) == torch.remainder(step, loss_hist.shape[0])
    # An outlier's values enter too (OLMo-core's window takes every step's loss): a loss level that
    # moved (new data, a curriculum stage) becomes the window's after a few skipped steps, where a
    # window of accepted steps only judged every later step against the old level, for good. A
    # non-finite step has nothing to enter; a flushing step's values are a range fault's.
    taken = slot & (found_inf == 0) & (flushed == 0) & torch.isfinite(values).all()
    loss_hist.copy_(torch.where(taken, values[0], loss_hist))
    norm_hist.copy_(torch.where(taken, values[1], norm_hist))
    valid.copy_(torch.where(taken, 1.0, valid))
    reason = torch.where(found_inf > 0, NONFINITE, torch.where(flushed > 0, FLUSHING, OUTLIER * outlier))
    why.copy_(torch.where(slot, reason, why))
    faults.add_(skip)
    outliers.add_(undo * (1.0 - flushed))
    flushing.add_(undo * flushed)
    step.add_(1.0)
    return skip
