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
    """Sums of |Δ log p| and of the ratio r = exp(train − rollout) over the completion tokens,
    on the device, until `read` (a logging step): one device vector per logging interval, read
    where the Trainer logs."""

    def __init__(self, device: Any = None) -> None:
        self._sums: torch.Tensor | None = None  # Σ|Δ|, n, Σ(r−1), Σ(r−1)², max|Δ|, max r, −min r
        self._device = device

    def add(self, train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> None:
        """Folds one micro-batch in: `train`, `rollout` (batch, tokens) log-probs, `mask` the
        completion tokens to count."""
        width = min(train.shape[1], rollout.shape[1])
        train, rollout, mask = train[:, :width].detach().float(), rollout[:, :width].float(), mask[:, :width].bool()
        # A token the sampler could not score (NaN) counts as no difference.
        delta = torch.nan_to_num(train - rollout, nan=0.0).masked_fill(~mask, 0.0)
        ratio = torch.exp(delta)
        excess = torch.expm1(delta)  # r − 1, summed instead of r: no cancellation in the spread
        n = mask.sum().float()
        floor = torch.finfo(torch.float32).min
        stats = torch.stack(
            [
                delta.abs().sum(),
                n,
                excess.sum(),
                excess.square().sum(),
                delta.abs().amax() if delta.numel() else n * 0,
                ratio.masked_fill(~mask, floor).amax() if delta.numel() else n * 0 + floor,
                (-ratio).masked_fill(~mask, floor).amax() if delta.numel() else n * 0 + floor,
            ]
        )
        self._device = stats.device
        if self._sums is None:
            self._sums = stats
        else:
            self._sums = torch.cat([self._sums[:4] + stats[:4], torch.maximum(self._sums[4:], stats[4:])])

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
        if gather is not None:
            rows = gather(sums).reshape(-1, 7)
            sums = torch.cat([rows[:, :4].sum(0), rows[:, 4:].amax(0)])
        abs_sum, n, excess_sum, excess_sq_sum, abs_max, r_max, neg_r_min = sums.tolist()
        if n == 0:
            return {}
        excess = excess_sum / n
        spread = math.sqrt(max(excess_sq_sum / n - excess * excess, 0.0))
        return dict(zip(MISMATCH_METRICS, (abs_sum / n, abs_max, 1.0 + excess, spread, -neg_r_min, r_max)))


def fit_width(logps: torch.Tensor, width: int) -> torch.Tensor:
    """(batch, n) rollout log-probs laid out as TRL's completions, (batch, width): cut after
    `width` columns, or zeros after the n (its padding, masked out)."""
    logps = logps[:, :width]
    return torch.nn.functional.pad(logps, (0, width - logps.shape[1])) if logps.shape[1] < width else logps
