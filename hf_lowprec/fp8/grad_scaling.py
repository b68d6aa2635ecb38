"""FP8 gradients with automatic scaling μ (FP8-LM §2.1, eq. 3; docs/algorithms.md §3).

A gradient g is stored as the scaled FP8 tensor (payload, s) with

    s = μ · 2^(floor(log2(fp8_max / amax(g))) − margin),   payload = FP8(s·g),

so g' = μ·g is what FP8 holds, measured in units of the per-tensor power-of-two scale. With
μ ≤ 1 a single tensor never saturates; μ matters where FP8 values are *summed*, above all
in the all-reduce (`hf_lowprec.fp8.comm`), where N ranks' payloads add up and may exceed
the FP8 maximum. After each step the share of elements that saturated decides μ for the
next step:

    share > threshold (1e-5, i.e. 0.001 %)            → μ ← μ / 2
    share ≤ threshold for `interval` (1000) steps     → μ ← 2·μ

μ and the count of clean steps are checkpointed (`state_dict`), so a resumed run continues
with the same scales bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .cast import has_nan, scale_to_fp8, widen
from .scaled import dequantize, pow2_scale, quantize, quantize_counting, tensor_amax

__all__ = ["BackwardFP8Gradients", "GradientAutoScaler", "quantize_gradient", "requantize_gradient"]


def quantize_gradient(
    grad: torch.Tensor, mu: float, dtype: torch.dtype, margin: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP8 gradient with scale s = μ·2^(floor(log2(fp8_max/amax)) − margin).

    Returns:
        (payload, scale, saturated): the FP8 payload, its FP32 scale (real = payload / scale)
        and the number of clipped elements as an int64 tensor (no host sync).
    """
    amax = tensor_amax(grad)
    scale = pow2_scale(amax, dtype, margin) * mu
    if mu <= 1.0 and bool(torch.isfinite(amax)):
        # amax·2^e ≤ max(dtype) for pow2_scale's exponent e, so |g·s| ≤ μ·max ≤ max: nothing
        # can saturate, the count is 0 and the plain cast gives quantize's payload.
        return scale_to_fp8(grad, scale, dtype), scale, torch.zeros((), dtype=torch.int64, device=grad.device)
    payload, saturated = quantize_counting(grad, scale, dtype)
    return payload, scale, saturated


def requantize_gradient(
    grad: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, margin: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-encode a gradient that held FP8 values at `scale` and may have changed since.

    The FP8 all-reduce leaves values that are exact at its scale; gradient clipping then
    multiplies them by c ≤ 1, and re-encoding at the old scale would push log2(1/c) binades
    of small values under the FP8 minimum. The new scale is scale·2^k with the largest
    k ≥ 0 that keeps amax in the top binade below the margin: k = 0 or an exact shift when
    nothing changed (FP8 values times a power of two stay FP8 values), and one fresh rounding
    at about scale/c after clipping.

    Returns:
        (payload, scale): real = payload / scale.
    """
    step = pow2_scale(tensor_amax(grad) * scale, dtype, margin).clamp_(min=1.0)
    new_scale = scale.float() * step
    return quantize(grad, new_scale, dtype), new_scale


class GradientAutoScaler:
    """The auto-scaling factor μ and its update rule.

    Callers `record(saturated, total)` for every quantization of a step (counts may be
    tensors, so no host sync happens until `update`), then call `update()` once per step.

    Args:
        init_mu: starting μ (a power of two keeps every scale a power of two).
        interval: consecutive clean steps before μ doubles (paper: 1000).
        threshold: saturated share above which μ halves (paper: 0.001 % = 1e-5).
        min_mu, max_mu: bounds that keep μ finite when gradients vanish or explode for long.
    """

    def __init__(
        self,
        init_mu: float = 1.0,
        interval: int = 1000,
        threshold: float = 1e-5,
        min_mu: float = 2.0**-32,
        max_mu: float = 2.0**32,
    ) -> None:
        if not (math.isfinite(init_mu) and init_mu > 0):
            raise ValueError(f"init_mu must be a positive finite number, got {init_mu}")
        if not (isinstance(interval, int) and interval >= 1):
            raise ValueError(f"interval must be an integer >= 1, got {interval!r}")
        if not (0.0 <= threshold < 1.0):
            raise ValueError(f"threshold must lie in [0, 1), got {threshold}")
        if not (0 < min_mu <= init_mu <= max_mu):
            raise ValueError(f"need 0 < min_mu <= init_mu <= max_mu, got {min_mu}, {init_mu}, {max_mu}")
        self.mu = float(init_mu)
        self.interval = interval
        self.threshold = threshold
        self.min_mu = min_mu
        self.max_mu = max_mu
        self.clean_steps = 0
        self.last_saturated_share = 0.0
        self._saturated: torch.Tensor | int = 0
        self._total = 0

    def record(self, saturated: torch.Tensor | int, total: int) -> None:
        """Add one quantization's clipped-element count and its size to this step's tally."""
        self._saturated = self._saturated + saturated
        self._total += int(total)

    @property
    def pending(self) -> bool:
        """True when counts were recorded since the last `update`."""
        return self._total > 0

    def update(self) -> float:
        """Apply the halving/doubling rule to this step's tally, reset it, and return μ."""
        saturated = int(self._saturated.item()) if torch.is_tensor(self._saturated) else int(self._saturated)
        share = saturated / self._total if self._total else 0.0
        self._saturated, self._total = 0, 0
        self.last_saturated_share = share
        if share > self.threshold:
            self.mu = max(self.mu / 2.0, self.min_mu)
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.interval:
                self.mu = min(self.mu * 2.0, self.max_mu)
                self.clean_steps = 0
        return self.mu

    def state_dict(self) -> dict[str, Any]:
        """μ and the clean-step counter (plain Python numbers: safe for weights_only loading)."""
        return {"mu": self.mu, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mu = float(state["mu"])
        if not (math.isfinite(mu) and mu > 0):
            raise ValueError(f"saved gradient scale mu must be positive and finite, got {mu}")
        self.mu = mu
        self.clean_steps = int(state["clean_steps"])

    def __repr__(self) -> str:
        return f"GradientAutoScaler(mu={self.mu}, clean_steps={self.clean_steps}, interval={self.interval})"


class FP8GradientOwner(Protocol):
    """An optimizer that keeps this step's gradients as FP8 (e.g. `hf_lowprec.optim.FP8AdamW`)."""

    def set_fp8_grad(self, param: torch.Tensor, payload: torch.Tensor, scale: torch.Tensor) -> None: ...

    def fp8_grad(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None: ...


class BackwardFP8Gradients:
    """Quantize each gradient to FP8 as soon as backward has accumulated it (FP8-LM O2).

    A `register_post_accumulate_grad_hook` on each parameter hands `p.grad` to the owner
    optimizer as (payload, scale) and frees it, so no full-model FP16/FP32 gradient exists
    between backward and the step: the gradient costs 1 byte per element at every moment.
    Gradient accumulation: the next micro-batch's gradient is added to the stored one in
    FP32 and re-quantized with a fresh scale, one E4M3 rounding (2^-4 relative) per
    micro-batch. Clipping goes through `clip_grad_norm`, which multiplies an FP8 gradient
    by c by dividing its scale (no rounding of the payload).

    Under torch.distributed with more than one rank the hook does nothing: DDP's reducer
    owns `p.grad` until its (FP8) all-reduce has run, and its buckets hold the full
    gradient anyway; the strategy then quantizes in `process_gradients`.

    Args:
        scaler: the automatic gradient scale μ; every quantization is recorded in it.
        dtype: FP8 format of the stored gradients.
        margin: scale margin in binades.
    """

    def __init__(self, scaler: GradientAutoScaler, dtype: torch.dtype, margin: int = 0) -> None:
        self.scaler = scaler
        self.dtype = dtype
        self.margin = margin
        self.owner: FP8GradientOwner | None = None
        self._handles: list[Any] = []

    def attach(self, params: Iterable[torch.Tensor]) -> None:
        """Quantize the gradients of `params` in backward (once an owner is set)."""
        for param in params:
            if param.requires_grad:  # frozen weights (a PEFT base) have no gradient to store
                self._handles.append(param.register_post_accumulate_grad_hook(self._store))

    def _store(self, param: torch.Tensor) -> None:
        owner = self.owner
        if owner is None or param.grad is None or (dist.is_initialized() and dist.get_world_size() > 1):
            return
        grad = param.grad
        pending = owner.fp8_grad(param)
        if pending is not None:  # gradient accumulation: add to this step's stored gradient
            grad = dequantize(*pending).add_(grad)
        payload, scale, saturated = quantize_gradient(grad, self.scaler.mu, self.dtype, self.margin)
        self.scaler.record(saturated, grad.numel())
        owner.set_fp8_grad(param, payload, scale)
        param.grad = None

    def stored(self, params: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(payload, scale) of this step's FP8 gradients among `params`."""
        if self.owner is None:
            return []
        return [g for g in (self.owner.fp8_grad(p) for p in params) if g is not None]

    def all_finite(self, params: Iterable[torch.Tensor]) -> bool:
        """False when a stored gradient holds NaN (the saturating cast turns inf into NaN)."""
        return not any(has_nan(payload) for payload, _ in self.stored(params))

    def clip_grad_norm(self, parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor | None:
        """Clip stored FP8 and ordinary `p.grad` gradients together; the pre-clip L2 norm.

        None when no gradient is stored as FP8 (the caller's own clipping then applies).
        As `torch.nn.utils.clip_grad_norm_`: c = min(1, max_norm / (norm + 1e-6)).
        """
        params = list(parameters)
        stored = self.stored(params)
        if not stored:
            return None
        dense = [p.grad for p in params if p.grad is not None]
        squares = [torch.linalg.vector_norm(g.float()).square() for g in dense]
        squares += [
            (torch.linalg.vector_norm(widen(payload, torch.float32)) / scale).square() for payload, scale in stored
        ]
        norm = torch.stack(squares).sum().sqrt()
        if math.isfinite(max_norm):
            coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for grad in dense:
                grad.mul_(coefficient.to(grad.dtype))
            for _, scale in stored:
                scale.div_(coefficient)
        return norm
