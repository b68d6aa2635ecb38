"""How far a rollout's log-probabilities are from the training forward's, for GRPO and RLOO
(docs/rl.md, "The rollout–training mismatch"): `RolloutLogprobs` records them while `generate`
runs, `MismatchMeter` compares them with the training forward's on the device.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

__all__ = ["MISMATCH_METRICS", "MismatchMeter", "RolloutLogprobs", "fit_width"]

MISMATCH_METRICS = (
    "precision/rollout_logp_diff_mean",
    "precision/rollout_logp_diff_max",
    "precision/rollout_ratio_mean",
    "precision/rollout_ratio_std",
    "precision/rollout_ratio_min",
    "precision/rollout_ratio_max",
)


class RolloutLogprobs:
    """Records the sampled tokens' log-probabilities during one `generate` call of `model`.

    Use as a context manager around the call; `finish(sequences)` returns them as a
    (batch, new tokens) tensor: the token sampled at a step is known at the next forward (its
    input) or, for the last one, from the returned sequences. Each is log_softmax(logits / T) at
    the step that sampled it, with T the trainer's temperature, as the training forward computes
    it. When TRL has the sampler's own log-probs (vLLM's `sampling_per_token_logps`), those are
    compared instead.
    """

    def __init__(self, model: nn.Module, temperature: float) -> None:
        self.model = model
        self.temperature = float(temperature) or 1.0
        self._previous: torch.Tensor | None = None
        self._logps: list[torch.Tensor] = []
        self._handle: Any = None

    def __enter__(self) -> RolloutLogprobs:
        self._handle = self.model.register_forward_hook(self._record, with_kwargs=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.remove()

    def _record(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        logits = getattr(output, "logits", None)
        if logits is None:
            return
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if self._previous is not None and input_ids is not None:
            self._logps.append(self._previous.gather(1, input_ids[:, -1:]).squeeze(1))
        self._previous = torch.log_softmax(logits[:, -1, :].float() / self.temperature, dim=-1)

    def finish(self, sequences: torch.Tensor) -> torch.Tensor | None:
        """(batch, new tokens) log-probs; None when nothing was generated."""
        if self._previous is None:
            return None
        self._logps.append(self._previous.gather(1, sequences[:, -1:]).squeeze(1))
        logps = torch.stack(self._logps, dim=1)
        self._previous, self._logps = None, []
        return logps


class MismatchMeter:
    """Sums of |Δ log p|, the ratio r = exp(train − rollout) and its spread over the completion
    tokens, on the device, until `read` (a logging step): one device vector per logging interval,
    read where the Trainer logs.

    The spread is kept as the sum of squared deviations from the mean (M2), per micro-batch from
    its own mean and merged with Chan's formula: E[(r−1)²] − E[r−1]² in FP32 loses the spread to
    cancellation when every ratio moves together (a uniform shift of 0.05 read as a spread of
    1.7e-5 where it is 3e-7)."""

    def __init__(self, device: Any = None) -> None:
        self._sums: torch.Tensor | None = None  # Σ|Δ|, n, Σ(r−1), M2 of r, max|Δ|, max r, −min r
        self._device = device

    def add(self, train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> None:
        """Folds one micro-batch in: `train`, `rollout` (batch, tokens) log-probs, `mask` the
        completion tokens to count."""
        width = min(train.shape[1], rollout.shape[1])
        train, rollout, mask = train[:, :width].detach().float(), rollout[:, :width].float(), mask[:, :width].bool()
        # A token the sampler could not score (NaN) counts as no difference.
        delta = torch.nan_to_num(train - rollout, nan=0.0).masked_fill(~mask, 0.0)
        ratio = torch.exp(delta)
        excess = torch.expm1(delta)  # r − 1, summed instead of r: no cancellation against 1
        n = mask.sum().float()
        total = excess.sum()
        deviation = (excess - total / n.clamp(min=1.0)).masked_fill(~mask, 0.0)
        floor = torch.finfo(torch.float32).min
        stats = torch.stack(
            [
                delta.abs().sum(),
                n,
                total,
                deviation.square().sum(),
                delta.abs().amax() if delta.numel() else n * 0,
                ratio.masked_fill(~mask, floor).amax() if delta.numel() else n * 0 + floor,
                (-ratio).masked_fill(~mask, floor).amax() if delta.numel() else n * 0 + floor,
            ]
        )
        self._device = stats.device
        self._sums = stats if self._sums is None else _merge(self._sums, stats)

    def read(self, gather: Any = None) -> dict[str, float]:
        """The interval's metrics (one host read), then a fresh interval; `gather` collects the
        ranks' vectors ((ranks·7,) from (7,)), as `accelerator.gather` does."""
        # An interval with nothing measured still takes part in the gather (its peers may have).
        sums, self._sums = self._sums, None
        if sums is None:
            if gather is None:
                return {}
            floor = torch.finfo(torch.float32).min
            sums = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, floor, floor], device=self._device)
        rows = (gather(sums) if gather is not None else sums).reshape(-1, 7).double().tolist()
        merged = rows[0]
        for row in rows[1:]:  # the ranks', merged in FP64 on the host
            merged = _merge(merged, row)
        abs_sum, n, excess_sum, m2, abs_max, r_max, neg_r_min = merged
        if n == 0:
            return {}
        spread = math.sqrt(max(m2 / n, 0.0))
        return dict(zip(MISMATCH_METRICS, (abs_sum / n, abs_max, 1.0 + excess_sum / n, spread, -neg_r_min, r_max)))


def _merge(a: Any, b: Any) -> Any:
    """Two vectors of `MismatchMeter` statistics as one (tensors on the device, or lists of
    numbers on the host): sums add, maxima take the larger, M2 by Chan's formula
    M2 = M2_a + M2_b + (mean_a − mean_b)²·n_a·n_b/(n_a + n_b)."""
    n_a, n_b = a[1], b[1]
    n = n_a + n_b
    if torch.is_tensor(a):
        safe = lambda v: v.clamp(min=1.0)  # noqa: E731 (an empty side has a zero sum: the term is 0)
        joint = (a[2] / safe(n_a) - b[2] / safe(n_b)).square() * n_a * n_b / safe(n)
        return torch.stack([a[0] + b[0], n, a[2] + b[2], a[3] + b[3] + joint, *torch.maximum(a[4:], b[4:])])
    joint = (a[2] / n_a - b[2] / n_b) ** 2 * n_a * n_b / n if n_a and n_b else 0.0
    return [a[0] + b[0], n, a[2] + b[2], a[3] + b[3] + joint, *(max(x, y) for x, y in zip(a[4:], b[4:]))]


def fit_width(logps: torch.Tensor, width: int) -> torch.Tensor:
    """(batch, n) rollout log-probs laid out as TRL's completions, (batch, width): cut after
    `width` columns, or zeros after the n (its padding, masked out)."""
    logps = logps[:, :width]
    return torch.nn.functional.pad(logps, (0, width - logps.shape[1])) if logps.shape[1] < width else logps
