"""Graphcore automatic loss scaling (ALS) and running-mean gradient accumulation for FP16.

docs/algorithms.md §5 (ALS post, seed 002). Plain torch: no Trainer, Accelerate or DeepSpeed import.

**ALS.** After each backward, |g| of the weight gradients and (optionally) of the activation
gradients is counted in two bins over FP16's range, split at `bin_edge` (2^13). Every `period`
steps, with share = upper-bin count / total count:

    share > threshold (1e-7)  → scale ← max(scale / 2, min_scale)
    otherwise                 → scale ← min(scale · 2, max_scale)

**Clip, don't skip.** Overflowing FP16 gradients are clamped to ±65504 (activation gradients as
they flow through backward, weight gradients in `unscale_`), so no step is lost to an inf and
the histogram sees the clipped values in its upper bin. A NaN cannot be clipped: it is not an
overflowing magnitude but a lost value (inf − inf, 0·inf upstream, or a NaN loss). A step whose
weight gradients hold a NaN is therefore skipped, counted in `skipped_steps`, and the scale is
halved at once (whatever the period), as for a saturated step. This is the only skip.

**Running mean.** Over micro-batches k = 1..N, M_k = ((k−1)/k)·M_{k−1} + g_k/k (M_0 = 0), so the
FP16 accumulator never exceeds the largest micro-batch gradient, where a plain sum grows N-fold
and overflows.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from .distributed import DTensor

__all__ = [
    "FP16_MAX",
    "AgreeingGradScaler",
    "check_loss_scale",
    "AutomaticLossScaler",
    "RunningMeanGradients",
    "check_loss_scaler_settings",
    "clip_grad_norm_",
    "running_mean_",
]

logger = logging.getLogger(__name__)

FP16_MAX = torch.finfo(torch.float16).max  # 65504


def check_loss_scale(name: str, value: float, high: float | None = None) -> None:
    """Raise ValueError unless the loss scale `value` is a positive power of two (at most `high`)."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    if math.frexp(value)[0] != 0.5:
        raise ValueError(f"{name} must be a power of two so that scaling is exact, got {value!r}")
    if high is not None and value > high:
        raise ValueError(
            f"{name} must be at most 2**{math.frexp(high)[1] - 1}, got {value!r}: a larger scale overflows FP16 (65504) for "
            "gradients of any useful size, so every step would be skipped"
        )


def check_loss_scaler_settings(
    bin_edge: float, threshold: float, period: int, init_scale: float, max_scale: float, min_scale: float
) -> None:
    """Raise ValueError naming the bad ALS setting and what to pass instead."""
    if not (isinstance(period, int) and not isinstance(period, bool) and period >= 1):
        raise ValueError(f"period must be an integer >= 1 (steps between scale updates), got {period!r}")
    if not (0.0 < bin_edge <= FP16_MAX):
        raise ValueError(f"bin_edge must lie in (0, 65504] (FP16's range; seed: 2**13), got {bin_edge!r}")
    if not (0.0 <= threshold < 1.0):
        raise ValueError(f"threshold must lie in [0, 1) (a share of elements; seed: 1e-7), got {threshold!r}")
    for name, value in (("init_scale", init_scale), ("max_scale", max_scale), ("min_scale", min_scale)):
        check_loss_scale(name, value)
    if not (min_scale <= init_scale <= max_scale):
        raise ValueError(f"need min_scale <= init_scale <= max_scale, got {min_scale!r}, {init_scale!r}, {max_scale!r}")


class AutomaticLossScaler:
    """Histogram-based loss scaling that clips instead of skipping (Graphcore ALS).

    Used like `torch.amp.GradScaler`:

        scaler = AutomaticLossScaler()
        scaler.track(model)                 # activation-gradient hooks and parameter names
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)          # clamp to ±65504, histogram, divide by the scale
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)              # never skipped for overflow
        scaler.update()

    Args:
        bin_edge: edge between the two bins of |g| (seed 2^13; PopART's default is 2^12).
        threshold: upper-bin share above which the scale halves.
        period: steps between scale updates; the histogram sums over the period.
        init_scale: starting scale (seed: 1).
        max_scale: upper bound (Graphcore's 2^15). Gradients are unscaled in FP16, so a larger
            scale only moves values further from the FP16 maximum.
        min_scale: lower bound (2^-16): below 1 the backward pass itself runs scaled down, which
            keeps activation gradients of models that overflow at scale 1 in range.
        track_activations: count (and clip) activation gradients too, via tensor hooks on the
            outputs of the leaf modules of the model passed to `track`.

    Under data parallelism (`process_group` set, as DDP's `prepare_ddp` does through the
    strategy) every rank must take the same decision from the same histogram: the activation
    gradients (each rank's own half of the batch) and the NaN count are summed over the group
    in `update`, one all-reduce; the weight gradients, already all-reduced, count once.
    """

    def __init__(
        self,
        bin_edge: float = 2.0**13,
        threshold: float = 1e-7,
        period: int = 1,
        init_scale: float = 1.0,
        max_scale: float = 2.0**15,
        min_scale: float = 2.0**-16,
        track_activations: bool = True,
    ) -> None:
        check_loss_scaler_settings(bin_edge, threshold, period, init_scale, max_scale, min_scale)
        self.bin_edge = float(bin_edge)
        self.threshold = float(threshold)
        self.period = period
        self.max_scale = float(max_scale)
        self.min_scale = float(min_scale)
        self.track_activations = bool(track_activations)
        self._scale = float(init_scale)
        self._handles: list[Any] = []
        self._names: dict[int, str] = {}
        # Tallies of the current step (tensors: no host sync until `update`).
        self._upper: torch.Tensor | int = 0
        self._total = 0
        self._clipped: dict[str, torch.Tensor] = {}
        self._nan: torch.Tensor | int = 0
        self._unscaled: set[int] = set()
        # This rank's share of the tallies (activation gradients), summed over `process_group`.
        self.process_group: Any = None
        self._rank_upper: torch.Tensor | int = 0
        self._rank_total = 0
        self._device = torch.device("cpu")
        self._group: Any = None  # the FSDP2 process group, once sharded gradients were seen
        self._reduced = False
        # Across steps (checkpointed).
        self._period_upper = 0
        self._period_total = 0
        self._steps_in_period = 0
        self._overflowing: list[str] = []
        self.last_upper_share = 0.0
        self.last_clipped = 0
        self.total_clipped = 0

    # --- GradScaler API ----------------------------------------------------------------
    def get_scale(self) -> float:
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """loss · scale, formed in FP32 (an FP16 loss times 2^15 could overflow)."""
        if loss.dtype in (torch.float16, torch.bfloat16):
            loss = loss.float()
        return loss * self._scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Count, clamp to ±65504 and divide the weight gradients by the scale, once per step."""
        if id(optimizer) in self._unscaled:
            return
        self._unscaled.add(id(optimizer))
        inverse = 1.0 / self._scale
        for index, param in enumerate(p for g in optimizer.param_groups for p in g["params"]):
            grad = param.grad
            if grad is None:
                continue
            if isinstance(grad, DTensor):  # an FSDP2 shard: count it here, `_reduce` sums over ranks
                self._group = grad.device_mesh.get_group()
                grad = grad.to_local()
            self._device = grad.device
            self._record(self._names.get(id(param), f"param{index}"), grad)
            self._nan = self._nan + grad.isnan().sum()
            if grad.dtype == torch.float16:
                grad.clamp_(-FP16_MAX, FP16_MAX)
            grad.mul_(inverse)
            if grad.dtype == torch.float16 and inverse > 1.0:
                # Below scale 1 a gradient that fitted scaled may not fit unscaled: clip it too.
                grad.clamp_(-FP16_MAX, FP16_MAX)

    def found_nan(self, optimizer: torch.optim.Optimizer) -> bool:
        """True when this step's weight gradients hold a NaN (unscales first if needed; one sync)."""
        self.unscale_(optimizer)
        self._reduce()
        return bool(self._nan.item()) if torch.is_tensor(self._nan) else bool(self._nan)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """`optimizer.step()` after `unscale_`; skipped only when a gradient is NaN (see module doc)."""
        if self.found_nan(optimizer):
            logger.warning("NaN in the weight gradients (not an overflow, cannot be clipped): step skipped")
            return None
        return optimizer.step(*args, **kwargs)

    def update(self) -> float:
        """Close the step: apply the ALS rule at the end of a period, log new overflows; the scale."""
        self._sum_over_ranks()
        self._reduce()
        self._reduced = False
        upper = int(self._upper.item()) if torch.is_tensor(self._upper) else int(self._upper)
        nan = bool(self._nan.item()) if torch.is_tensor(self._nan) else bool(self._nan)
        clipped = {}
        if self._clipped:
            counts = torch.stack([c.reshape(()) for c in self._clipped.values()]).tolist()
            clipped = {name: int(c) for name, c in zip(self._clipped, counts) if c}
        total = self._total
        self._upper, self._total, self._clipped, self._nan = 0, 0, {}, 0
        self._rank_upper, self._rank_total = 0, 0
        self._unscaled.clear()

        self.last_clipped = sum(clipped.values())
        self.total_clipped += self.last_clipped
        new = sorted(set(clipped) - set(self._overflowing))
        if new:
            logger.warning("FP16 overflow clipped to ±65504 at loss scale %g in: %s", self._scale, ", ".join(new))
        self._overflowing = sorted(clipped)

        self._period_upper += upper
        self._period_total += total
        self._steps_in_period += 1
        if nan or self._steps_in_period >= self.period:
            share = self._period_upper / self._period_total if self._period_total else 0.0
            self.last_upper_share = share
            if nan or share > self.threshold:
                self._scale = max(self._scale / 2.0, self.min_scale)
            else:
                self._scale = min(self._scale * 2.0, self.max_scale)
            self._period_upper, self._period_total, self._steps_in_period = 0, 0, 0
        return self._scale

    def state_dict(self) -> dict[str, Any]:
        """Plain Python values (safe for `torch.load(weights_only=True)`)."""
        return {
            "scale": self._scale,
            "period_upper": self._period_upper,
            "period_total": self._period_total,
            "steps_in_period": self._steps_in_period,
            "overflowing": list(self._overflowing),
            "last_upper_share": self.last_upper_share,
            "last_clipped": self.last_clipped,
            "total_clipped": self.total_clipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        scale = float(state["scale"])
        if not (math.isfinite(scale) and self.min_scale <= scale <= self.max_scale):
            raise ValueError(
                f"saved loss scale {scale} lies outside [min_scale, max_scale] = [{self.min_scale}, {self.max_scale}]"
            )
        self._scale = scale
        self._period_upper = int(state["period_upper"])
        self._period_total = int(state["period_total"])
        self._steps_in_period = int(state["steps_in_period"])
        self._overflowing = list(state["overflowing"])
        self.last_upper_share = float(state["last_upper_share"])
        self.last_clipped = int(state["last_clipped"])
        self.total_clipped = int(state["total_clipped"])

    def _reduce(self) -> None:
        """Under FSDP2, sum this step's tallies over the ranks (one all-reduce, once per step).

        Each rank counted its weight-gradient shards and the activation gradients of its own
        samples; the sums are the counts over the whole tensors and the whole batch, so every
        rank takes the same scale decision and skips the same steps."""
        if self._group is None or self._reduced:
            return
        self._reduced = True
        names = list(self._clipped)
        values = [self._upper, self._total, self._nan, *(self._clipped[n] for n in names)]
        tallies = torch.stack(
            [torch.as_tensor(v, dtype=torch.float64, device=self._device).reshape(()) for v in values]
        )
        dist.all_reduce(tallies, group=self._group)  # counts below 2^53: exact in FP64
        self._upper, self._total, self._nan = tallies[0], int(tallies[1].item()), tallies[2]
        self._clipped = dict(zip(names, tallies[3:].unbind()))

    # --- activation gradients ----------------------------------------------------------
    def track(self, model: torch.nn.Module) -> AutomaticLossScaler:
        """Name `model`'s parameters in overflow logs and, with `track_activations`, hook the
        outputs of its leaf modules so that their gradients are counted and clipped."""
        self.untrack()
        self._names = {id(p): name for name, p in model.named_parameters()}
        if self.track_activations:
            for name, module in model.named_modules():
                if next(module.children(), None) is None:
                    self._handles.append(module.register_forward_hook(self._forward_hook(name or "model")))
        return self

    def untrack(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _forward_hook(self, name: str):
        def hook(module, inputs, output):
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            for out in outputs:
                if torch.is_tensor(out) and out.requires_grad and out.is_floating_point():
                    out.register_hook(lambda grad: self._activation_grad(name, grad))

        return hook

    def _sum_over_ranks(self) -> None:
        """Add the other ranks' activation tallies and NaN counts (one all-reduce; no-op alone)."""
        group = self.process_group
        if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
            return
        mine = torch.stack(
            [
                torch.as_tensor(v, dtype=torch.float64, device=self._device).reshape(())
                for v in (self._rank_upper, self._rank_total, self._nan)
            ]
        )
        summed = mine.clone()
        dist.all_reduce(summed, group=group)
        others = (summed - mine).cpu().tolist()
        self._upper = self._upper + int(others[0])
        self._total += int(others[1])
        self._nan = self._nan + int(others[2])

    def _activation_grad(self, name: str, grad: torch.Tensor) -> torch.Tensor | None:
        self._rank_upper = self._rank_upper + self._record(name, grad)
        self._rank_total += grad.numel()
        self._device = grad.device
        if grad.dtype == torch.float16:
            # clamp keeps NaN (so a lost value still surfaces) and turns ±inf into ±65504.
            return grad.clamp(-FP16_MAX, FP16_MAX)
        return None

    def _record(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """Tally `grad` into this step's histogram; its upper-bin count."""
        magnitude = grad.detach().abs()
        upper = (magnitude >= self.bin_edge).sum()
        self._upper = self._upper + upper
        self._total += grad.numel()
        if grad.dtype == torch.float16:
            clipped = (magnitude > FP16_MAX).sum()
            previous = self._clipped.get(name)
            self._clipped[name] = clipped if previous is None else previous + clipped
        return upper

    def __repr__(self) -> str:
        return (
            f"AutomaticLossScaler(scale={self._scale}, bin_edge={self.bin_edge}, threshold={self.threshold}, "
            f"period={self.period}, bounds=[{self.min_scale}, {self.max_scale}])"
        )


class AgreeingGradScaler(torch.amp.GradScaler):
    """`torch.amp.GradScaler` whose found-inf agrees over the ranks when gradients are FSDP2
    shards (DTensors): each rank checks its shards, one all-reduce (MAX) per device of the
    found-inf flag, so every rank skips the same steps and keeps the same scale. Without
    DTensor gradients it is `torch.amp.GradScaler`."""

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        sharded = next(
            (p.grad for g in optimizer.param_groups for p in g["params"] if isinstance(p.grad, DTensor)), None
        )
        if sharded is not None:
            for flag in per_device.values():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=sharded.device_mesh.get_group())
        return per_device


def running_mean_(mean: torch.Tensor, value: torch.Tensor, k: int) -> torch.Tensor:
    """M_k = ((k−1)/k)·M_{k−1} + value/k, in place in `mean`'s dtype.

    Three roundings, the arithmetic of `RunningMeanGradients`' hooks (autograd adds value/k
    as its own tensor). |M_k| ≤ max_j |g_j| up to rounding, so an FP16 accumulator cannot
    overflow from the sum.
    """
    if k < 1:
        raise ValueError(f"the micro-batch index k counts from 1, got {k}")
    if k == 1:
        return mean.copy_(value)
    return mean.mul_((k - 1) / k).add_(value / k)


def clip_grad_norm_(parameters: Any, max_norm: float) -> torch.Tensor:
    """Scale gradients so their global 2-norm is at most `max_norm`; the FP32 pre-clip norm.

    `torch.nn.utils.clip_grad_norm_` forms the norm in the gradients' dtype: for FP16
    gradients a norm above 65504 becomes inf, and the gradients are multiplied by
    max_norm/inf = 0 (or by inf/inf = NaN when max_norm is inf, as the Trainer does to log
    the norm). Here per-tensor norms are accumulated in FP32; `max_norm=inf` only measures.
    """
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0, device=parameters[0].device if parameters else "cpu")
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    total = torch.linalg.vector_norm(torch.stack([n.to(grads[0].device) for n in norms]))
    if math.isfinite(max_norm):
        coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for grad in grads:
            grad.mul_(coefficient.to(grad.device))
    return total


class RunningMeanGradients:
    """Running-mean gradient accumulation over micro-batches, through parameter hooks.

    Each parameter's hook sees the incoming micro-batch gradient g_k before autograd adds it
    to `p.grad`: it rescales `p.grad` by (k−1)/k and hands on g_k/k, so `p.grad` holds M_k.
    k counts the backward passes since `p.grad` was last None (zero_grad) or `reset()`.
    Incoming FP16 gradients are clamped to ±65504 first, so +inf and −inf micro-batch
    gradients cannot meet as NaN.

    The loss must *not* be divided by the number of micro-batches: the mean does that.
    """

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self._handles: list[Any] = []

    def attach(self, model: torch.nn.Module) -> RunningMeanGradients:
        self.detach()
        for param in model.parameters():
            if param.requires_grad:
                self._handles.append(param.register_hook(self._hook(param)))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def reset(self) -> None:
        """Start a new accumulation window (call after the optimizer step)."""
        self._counts.clear()

    def _hook(self, param: torch.Tensor):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            if grad.dtype == torch.float16:
                grad = grad.clamp(-FP16_MAX, FP16_MAX)
            key = id(param)
            k = 1 if param.grad is None else self._counts.get(key, 0) + 1
            self._counts[key] = k
            if param.grad is not None:
                if k == 1:
                    param.grad.zero_()
                else:
                    param.grad.mul_((k - 1) / k)
            return grad if k == 1 else grad / k

        return hook
