"""FP8 gradients with automatic scaling μ (FP8-LM §2.1, eq. 3; docs/algorithms.md §3).

A gradient g is stored as an FP8 payload at scale s = μ · 2^(floor(log2(fp8_max / amax(g))) − margin)
(`quantize_gradient`); `GradientAutoScaler` keeps μ and its halving/doubling rule, and
`BackwardFP8Gradients` quantizes each gradient as soon as backward has accumulated it.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..compiling import run_fused, takes_gpu_path
from ..scaling import check_norm_type
from .cast import nan_flag, nan_flags, widen
from .fused import gradient_cast, gradient_cast_into, mu_update
from .linear import accumulates_into, set_grad_sink
from .scaled import pow2_scale, quantize, tensor_amax
from .stored_sums import clamp_stored, clip_on_device

__all__ = ["BackwardFP8Gradients", "GradientAutoScaler", "quantize_gradient", "requantize_gradient"]


def quantize_gradient(
    grad: torch.Tensor, mu: float | torch.Tensor, dtype: torch.dtype, margin: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP8 gradient with scale s = μ·2^(floor(log2(fp8_max/amax)) − margin).

    With μ ≤ 1 and a finite amax nothing can saturate (amax·2^e ≤ max(dtype) for pow2_scale's
    exponent e, so |g·s| ≤ μ·max); with μ > 1 the cast clamps to ±max and counts what it
    clipped, and inf/NaN become NaN (a non-finite amax gives s = μ). One pass, no host sync:
    μ may be a 0-dim device tensor (`GradientAutoScaler.mu`).

    Returns:
        (payload, scale, saturated): the FP8 payload, its FP32 scale (real = payload / scale)
        and the number of clipped elements as an int64 tensor.
    """
    if not torch.is_tensor(mu):
        mu = torch.tensor(float(mu), dtype=torch.float32, device=grad.device)
    return gradient_cast(grad, mu, dtype, margin)[:3]


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
    """The auto-scaling factor μ and its update rule, kept on the gradients' device.

    FP8 holds g' = μ·g, measured in units of the per-tensor power-of-two scale. With μ ≤ 1 a
    single tensor never saturates; μ matters where FP8 values are *summed*, above all in the
    all-reduce (`hf_lowprec.fp8.comm`), where N ranks' payloads add up and may exceed the FP8
    maximum. After each step the share of elements that saturated decides μ for the next:

        share > threshold (1e-5, i.e. 0.001 %)            → μ ← μ / 2
        share ≤ threshold for `interval` (1000) steps     → μ ← 2·μ

    μ and the count of clean steps are checkpointed (`state_dict`), so a resumed run continues
    with the same scales bit for bit.

    Callers `record(saturated, total)` for every quantization of a step, then call `update()` once per step. μ, the
    clean-step counter and the last saturated share are 0-dim tensors updated in place with `torch.where`, so a step
    never waits for the host; they move to the device of the first counts recorded (`mu_for` moves them to a
    gradient's device). Read them as numbers at logging steps and checkpoints only.

    Args:
        init_mu: starting μ (a power of two keeps every scale a power of two).
        interval: consecutive clean steps before μ doubles (paper: 1000).
        threshold: saturated share above which μ halves (paper: 0.001 % = 1e-5).
        min_mu, max_mu: bounds that keep μ finite when gradients vanish or explode for long.
        device: where the state starts (it follows the gradients if they live elsewhere).
    """

    def __init__(
        self,
        init_mu: float = 1.0,
        interval: int = 1000,
        threshold: float = 1e-5,
        min_mu: float = 2.0**-32,
        max_mu: float = 2.0**32,
        device: torch.device | str = "cpu",
    ) -> None:
        if not (math.isfinite(init_mu) and init_mu > 0):
            raise ValueError(f"init_mu must be a positive finite number, got {init_mu}")
        if not (isinstance(interval, int) and interval >= 1):
            raise ValueError(f"interval must be an integer >= 1, got {interval!r}")
        if not (0.0 <= threshold < 1.0):
            raise ValueError(f"threshold must lie in [0, 1), got {threshold}")
        if not (0 < min_mu <= init_mu <= max_mu):
            raise ValueError(f"need 0 < min_mu <= init_mu <= max_mu, got {min_mu}, {init_mu}, {max_mu}")
        self.interval = interval
        self.threshold = threshold
        self.min_mu = min_mu
        self.max_mu = max_mu
        # FP32 like the scales μ multiplies; the share in FP64 like the Python division it replaces.
        self._mu = torch.tensor(float(init_mu), dtype=torch.float32, device=device)
        self._clean_steps = torch.zeros((), dtype=torch.int64, device=device)
        self._last_share = torch.zeros((), dtype=torch.float64, device=device)
        # This step's tally, summed at `update`: counts kept as a list (no launch per record), per
        # skip flag (`record(unless=...)`) the flag, its counts and their total size.
        self._counts: list[torch.Tensor | int] = []
        self._sizes = 0
        self._flagged: dict[int, tuple[torch.Tensor, list[torch.Tensor | int], int]] = {}
        self._recorded = False

    # --- the device state -------------------------------------------------------------------
    def to(self, device: torch.device | str) -> GradientAutoScaler:
        """Keep μ and the counters on `device` (a copy only when they live elsewhere)."""
        device = torch.device(device)
        if self._mu.device != device:
            self._mu, self._clean_steps, self._last_share = (
                t.to(device) for t in (self._mu, self._clean_steps, self._last_share)
            )
        return self

    def mu_for(self, grad: torch.Tensor) -> torch.Tensor:
        """μ on `grad`'s device."""
        return self.to(grad.device)._mu

    @property
    def mu(self) -> float:
        """μ read on the host (a sync: for logs, checks and tests; a step uses `mu_for`)."""
        return float(self._mu)

    @mu.setter
    def mu(self, value: float) -> None:
        self._mu.fill_(value)

    @property
    def clean_steps(self) -> int:
        """Consecutive clean steps since μ last changed, read on the host."""
        return int(self._clean_steps)

    @clean_steps.setter
    def clean_steps(self, value: int) -> None:
        self._clean_steps.fill_(value)

    @property
    def last_saturated_share(self) -> float:
        """The saturated share of the last `update`, read on the host."""
        return float(self._last_share)

    # --- a step -----------------------------------------------------------------------------
    def record(self, saturated: torch.Tensor | int, total: int, unless: torch.Tensor | None = None) -> None:
        """Add one quantization's clipped-element count and its size to this step's tally.

        `unless`: a 0-dim device flag; where it is nonzero the quantization does not count
        (a step about to be skipped), decided on the device.
        """
        if torch.is_tensor(saturated):
            self.to(saturated.device)
        if unless is None:
            self._counts.append(saturated)
            self._sizes += int(total)
        else:
            flag, counts, sizes = self._flagged.get(id(unless), (unless, [], 0))
            counts.append(saturated)
            self._flagged[id(unless)] = (flag, counts, sizes + int(total))
        self._recorded = True

    @property
    def pending(self) -> bool:
        """True when counts were recorded since the last `update` (known on the host)."""
        return self._recorded

    def update(self, unless: torch.Tensor | None = None) -> torch.Tensor:
        """Apply the halving/doubling rule to this step's tally, reset it, and return the new μ
        (a 0-dim tensor apart from the scaler's own).

        `unless`: a 0-dim device flag; where it is nonzero μ and the counters stay as they are.
        """
        tally = (self._counts, self._sizes, list(self._flagged.values()))
        self._counts, self._sizes, self._flagged, self._recorded = [], 0, {}, False
        state = (self._mu, self._clean_steps, self._last_share)
        limits = (self.threshold, self.interval, self.min_mu, self.max_mu)
        if takes_gpu_path(self._mu.device):  # one compiled graph, where it was a chain of ~25 scalar kernels
            return run_fused(mu_update, *state, *tally, unless, *limits, like=self._mu)
        return mu_update(*state, *tally, unless, *limits)

    # --- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """μ and the clean-step counter as Python numbers (read at the checkpoint: safe for
        weights_only loading and the format older checkpoints have)."""
        return {"mu": float(self._mu), "clean_steps": int(self._clean_steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mu = float(state["mu"])
        if not (math.isfinite(mu) and mu > 0):
            raise ValueError(f"saved gradient scale mu must be positive and finite, got {mu}")
        self._mu.fill_(mu)
        self._clean_steps.fill_(int(state["clean_steps"]))

    def __repr__(self) -> str:
        return (
            f"GradientAutoScaler(mu={float(self._mu)}, clean_steps={int(self._clean_steps)}, interval={self.interval})"
        )


class FP8GradientOwner(Protocol):
    """An optimizer that keeps this step's gradients as FP8 (e.g. `hf_lowprec.optim.FP8AdamW`)."""

    def set_fp8_grad(self, param: torch.Tensor, payload: torch.Tensor, scale: torch.Tensor) -> None: ...

    def set_fp8_grads(self, params: list[torch.Tensor], payloads: list[Any], scales: list[Any]) -> None: ...

    def fp8_grad(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None: ...


class BackwardFP8Gradients:
    """Quantize each gradient to FP8 as soon as backward has made it (FP8-LM O2).

    An FP8 layer's weight gradient comes through its gradient sink (`linear.set_grad_sink`) from its GEMM, in BF16,
    and the per-tensor scale is taken from it: nothing is rounded first to the unscaled FP16 of the scaled master
    (where gradients under 2^-24 vanish). Others go through `p.grad` and a post-accumulate-grad hook. The owner
    optimizer gets (payload, scale): the gradient costs 1 byte per element at every moment. Gradient accumulation:
    each micro-batch's gradient is added to the stored one in FP32 and re-quantized, one E4M3 rounding (2^-4 relative)
    per micro-batch (or per use of a weight one backward uses twice). `clip_grad_norm` multiplies an FP8 gradient by c
    by dividing its scale (no rounding of the payload).

    Over several ranks the gradient goes to `p.grad` (DDP's reducer owns it until its FP8
    all-reduce, which `store_reduced` then stores; else the strategy's `process_gradients` does).

    Args:
        scaler: the automatic gradient scale μ; every quantization is recorded in it.
        dtype: FP8 format of the stored gradients.
        margin: scale margin in binades.
    """

    def __init__(self, scaler: GradientAutoScaler, dtype: torch.dtype, margin: int = 0) -> None:
        self.scaler = scaler
        self.dtype = dtype
        self.margin = margin
        self._owners: dict[int, tuple[weakref.ref, Callable]] = {}  # id(param) → (it, its optimizer's reference)
        self._owner: Callable[[], FP8GradientOwner | None] = lambda: None
        self._handles: list[Any] = []
        self._flags: dict[int, tuple[weakref.ref, torch.Tensor]] = {}  # id(param) → (its payload, NaN flag)
        self.transport: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self._reduced: set[int] = set()  # ids of the parameters `store_reduced` stored this step

    @property
    def owner(self) -> FP8GradientOwner | None:
        """The optimizer set last; each parameter's gradient goes to the one that holds it."""
        return self._owner()

    @owner.setter
    def owner(self, optimizer: FP8GradientOwner | None) -> None:
        """Take `optimizer` (weakly: a deleted Trainer's is freed) as the owner of the parameters in its `param_groups`
        (another keeps its own: a policy and a value model, or one model split over two); None: no owner.
        A parameter no owner holds keeps `p.grad`, which the strategy's step stores instead."""
        self._owner = weakref.ref(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else lambda: optimizer
        if optimizer is None:
            self._owners.clear()
            return
        for group in getattr(optimizer, "param_groups", ()):
            self._owners.update((id(p), (weakref.ref(p), self._owner)) for p in group["params"])

    def _owner_of(self, param: torch.Tensor) -> FP8GradientOwner | None:
        held = self._owners.get(id(param))
        return held[1]() if held is not None and held[0]() is param else None

    def _stored(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        owner = self._owner_of(param)
        return None if owner is None else owner.fp8_grad(param)

    def attach(self, params: Iterable[torch.Tensor]) -> None:
        """Quantize the gradients of `params` in backward (once an owner is set)."""
        for param in params:
            if param.requires_grad:  # frozen weights (a PEFT base) have no gradient to store
                self._handles.append(param.register_post_accumulate_grad_hook(self._store))
                set_grad_sink(param, _Sink(self, param))

    def take(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
        """Store `grad`, an FP8 layer's weight gradient of `param`, as FP8 (None: taken), or give it
        back: where the hook would not store it either (no owner, no `p.grad` to accumulate: `autograd.grad`,
        `backward(inputs=...)`; a `p.grad` there, which it joins), and over several ranks, through `transport`
        when set (DDP's FP8 all-reduce: the gradient times a power of two it keeps, so FP16 does not flush it)."""
        if self._owner_of(param) is None or not accumulates_into(param):
            return grad
        if dist.is_initialized() and dist.get_world_size() > 1:
            return grad if self.transport is None else self.transport(param, grad)
        if param.grad is not None:
            return grad
        self._quantize(param, grad)
        return None

    def store_reduced(self, params: list[torch.Tensor], payloads: list[Any], scales: list[Any]) -> list[bool]:
        """Hand the all-reduced FP8 gradients of `params` to their owners, a share per owner (`set_fp8_grads`: a few
        launches, not two per weight); True for each one stored (its `p.grad` freed by `release_reduced`)."""
        owners = [self._owner_of(p) for p in params]
        for owner in {id(o): o for o in owners if o is not None}.values():
            owner.set_fp8_grads(*([x for x, o in zip(xs, owners) if o is owner] for xs in (params, payloads, scales)))
        self._reduced.update(id(p) for p, o in zip(params, owners) if o is not None)
        return [o is not None for o in owners]

    def release_reduced(self, param: torch.Tensor) -> bool:
        """Whether `store_reduced` stored this step's gradient of `param`; its `p.grad` is freed."""
        if id(param) not in self._reduced:
            return False
        self._reduced.discard(id(param))
        param.grad = None
        return True

    def _store(self, param: torch.Tensor) -> None:
        if param.grad is None or self._owner_of(param) is None or (dist.is_initialized() and dist.get_world_size() > 1):
            return
        self._quantize(param, param.grad)
        param.grad = None

    def _quantize(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        owner = self._owner_of(param)
        # With gradient accumulation, added to this step's stored gradient: one compiled pass,
        # which writes the owner's buffers itself once they exist (no copy launched after it).
        pending = owner.fp8_grad(param)
        buffers = getattr(owner, "fp8_grad_buffers", None)
        into = buffers(param, self.dtype) if buffers is not None else None
        mu = self.scaler.mu_for(grad)
        if into is not None:
            saturated, nonfinite = gradient_cast_into(grad, mu, self.dtype, self.margin, into, pending is not None)
        else:
            payload, scale, saturated, nonfinite = gradient_cast(grad, mu, self.dtype, self.margin, pending)
            owner.set_fp8_grad(param, payload, scale)
        self.scaler.record(saturated, grad.numel())
        # Whether the payload now stored holds NaN, from its own cast: `nonfinite` takes it
        # instead of reading the codes (the owner keeps a copy: the flag is tied to that buffer).
        self._flags[id(param)] = (weakref.ref(owner.fp8_grad(param)[0]), nonfinite)

    def stored(self, params: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(payload, scale) of this step's FP8 gradients among `params`."""
        return [g for g in (self._stored(p) for p in params) if g is not None] if self._owners else []

    def nonfinite(self, params: Iterable[torch.Tensor]) -> torch.Tensor | None:
        """A 0-dim bool device flag: a stored gradient holds NaN (the saturating cast turns inf
        into NaN); None when none is stored. A payload this hook stored brings its flag from its
        cast (one stack for all of them); another is read (`cast.nan_flags`)."""
        if not self._owners:
            return None
        known, unread = [], []  # flags the casts gave; payloads stored otherwise, read here
        for param in params:  # each flag serves the step it was cast in (another optimizer's stay)
            ref, flag = self._flags.pop(id(param), (None, None))
            stored = self._stored(param)
            if stored is None:
                continue
            if ref is not None and ref() is stored[0]:
                known.append(flag)
            else:
                unread.append(stored[0])
        if unread and takes_gpu_path(unread[0].device):
            known.append(nan_flags(unread))
        else:
            known += [nan_flag(payload) for payload in unread]
        return torch.stack(known).any() if known else None

    def discard_where(self, flag: torch.Tensor, params: Iterable[torch.Tensor]) -> None:
        """Zero the stored gradients (payload 0, scale 1) where the device flag is set (a skipped
        step), so no NaN handed over in backward stays in the optimizer state or a checkpoint."""
        stored = self.stored(params)
        if not stored:
            return
        skip = flag != 0
        if not takes_gpu_path(flag.device):
            for payload, scale in stored:
                payload.view(torch.uint8).masked_fill_(skip, 0)
                scale.masked_fill_(skip, 1.0)
            return
        # Multi-tensor on a GPU: the codes times (1 − skip), integers, so 0 or unchanged; the 0-dim
        # scales selected in one stacked `where` (a clipped non-finite step leaves them NaN, which no
        # product could reset) and copied back in one launch.
        torch._foreach_mul_([payload.view(torch.uint8) for payload, _ in stored], (~skip).to(torch.uint8))
        scales = [scale for _, scale in stored]
        chosen = torch.where(skip, 1.0, torch.cat([scale.reshape(-1) for scale in scales]))
        values = chosen.split([scale.numel() for scale in scales])
        torch._foreach_copy_(scales, [value.view(scale.shape) for value, scale in zip(values, scales)])

    def clip_grad_norm(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float | str = 2.0
    ) -> torch.Tensor | None:
        """Clip stored FP8 and ordinary `p.grad` gradients together; the pre-clip norm (L2, or
        the largest magnitude for norm_type inf; no other).

        None when no gradient is stored as FP8 (the caller's own clipping then applies).
        As `torch.nn.utils.clip_grad_norm_`: c = min(1, max_norm / (norm + 1e-6)).
        """
        norm_type = check_norm_type(norm_type)
        params = list(parameters)
        stored = self.stored(params)
        if not stored:
            return None
        dense = [p.grad for p in params if p.grad is not None]
        if norm_type == math.inf:
            peaks = [torch.linalg.vector_norm(g.float(), math.inf) for g in dense]
            peaks += [torch.linalg.vector_norm(widen(p, torch.float32), math.inf) / scale for p, scale in stored]
            norm = torch.stack(peaks).max()
        elif takes_gpu_path(stored[0][0].device):
            return clip_on_device(dense, stored, max_norm)
        else:
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

    def clip_grad_value(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """Clamp the stored FP8 gradients among `parameters` to [-clip_value, clip_value]: each
        payload to the largest FP8 value v with v / scale <= clip_value (NaN stays NaN)."""
        clamp_stored(self.stored(list(parameters)), clip_value)


class _Sink:
    """A weight's sink into `BackwardFP8Gradients.take`: weakly held weight, not pickled, eager only."""

    __slots__ = ("grads", "param")
    eager_only = True

    def __init__(self, grads: BackwardFP8Gradients, param: torch.Tensor) -> None:
        self.grads, self.param = grads, weakref.ref(param)

    def __call__(self, grad: torch.Tensor) -> torch.Tensor | None:
        param = self.param()
        return grad if param is None else self.grads.take(param, grad)

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return type(None), ()
