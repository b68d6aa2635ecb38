"""What every FP16 loss scaler shares: setting checks, the FP16 norm, GradScaler agreeing over
FSDP2 ranks, and the step that skips on a device flag (`step_unless`).

Plain torch: no Trainer, Accelerate or DeepSpeed import.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState

from ..distributed import DTensor

__all__ = [
    "FP16_MAX",
    "AgreeingGradScaler",
    "check_loss_scale",
    "check_loss_scaler_settings",
    "clip_grad_norm_",
    "narrow_grad_norm",
    "step_unless",
]

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


def check_norm_type(norm_type: float | str) -> float:
    """`norm_type` as a float, where a strategy's own clipping takes it (2 or inf); ValueError otherwise."""
    p = float(norm_type)
    if p not in (2.0, math.inf):
        raise ValueError(
            f"the precision strategy clips with its own norm, which takes norm_type 2 or inf, got {norm_type!r}; "
            "clip with norm_type=2 (the default) or norm_type=float('inf')"
        )
    return p


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float | str = 2.0) -> torch.Tensor:
    """Scale gradients so their global `norm_type`-norm (2 or inf) is at most `max_norm`; the FP32 pre-clip norm.

    `torch.nn.utils.clip_grad_norm_` forms the norm in the gradients' dtype: for FP16
    gradients a norm above 65504 becomes inf, and the gradients are multiplied by
    max_norm/inf = 0 (or by inf/inf = NaN when max_norm is inf, as the Trainer does to log
    the norm). Here per-tensor norms are accumulated in FP32; `max_norm=inf` only measures.
    """
    norm_type = check_norm_type(norm_type)
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0, device=parameters[0].device if parameters else "cpu")
    plain = [grad for grad in grads if not isinstance(grad, DTensor)]
    norms = list(torch._foreach_norm(plain, norm_type, dtype=torch.float32)) if plain else []
    # FSDP2's shards one at a time: torch 2.14's DTensor rule for `_foreach_norm` reads its dtype as a dim.
    norms += [
        torch.linalg.vector_norm(grad, norm_type, dtype=torch.float32) for grad in grads if isinstance(grad, DTensor)
    ]
    total = torch.linalg.vector_norm(torch.stack([n.to(grads[0].device) for n in norms]), norm_type)
    if math.isfinite(max_norm):
        coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
        # One multi-tensor multiply per device and dtype (a GPU launches one kernel per chunk of
        # tensors, not one per gradient); FSDP2's DTensor shards one at a time, as before.
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for grad in grads:
            if isinstance(grad, DTensor):
                grad.mul_(coefficient.to(grad.device))
            else:
                groups.setdefault((grad.device, grad.dtype), []).append(grad)
        for (device, dtype), same in groups.items():
            # CUDA's multi-tensor multiply takes its fast path only for a scalar of the list's
            # dtype; its eager mul_ rounds a device 0-dim FP32 factor to FP16 too, so the bits
            # are the same. A CPU keeps the FP32 factor, as its mul_ has it.
            factor = coefficient.to(device) if device.type == "cpu" else coefficient.to(device, dtype)
            torch._foreach_mul_(same, factor)
    return total


def narrow_grad_norm(parameters: Any, max_norm: float, norm_type: float | str = 2.0) -> torch.Tensor | None:
    """`clip_grad_norm_` (an FP32 norm) where some gradient is FP16 or BF16 and none is a shard
    (DTensor), norm_type 2 or inf; the pre-clip norm, else None (torch's own is as good). torch's
    forms the norm and the clip coefficient in the gradients' dtype: a BF16 norm has 8 bits."""
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    narrow = any(g.dtype in (torch.float16, torch.bfloat16) for g in grads)
    if not narrow or any(isinstance(g, DTensor) for g in grads) or float(norm_type) not in (2.0, math.inf):
        return None
    return clip_grad_norm_(parameters, max_norm, norm_type)


def step_unless(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """`optimizer.step(*args, found_inf=found_inf)`: the step where the 0-dim tensor `found_inf`
    is 0, nothing where it is set, decided on the device (the optimizers of `hf_lowprec.optim`
    take the flag, as torch's fused AdamW does GradScaler's).

    An optimizer whose `step` takes no `found_inf` (a plain torch optimizer, a wrapper) is
    stepped only when the flag, read on the host (a sync), is 0; it returns None when skipped."""
    if _takes_found_inf(optimizer):
        return optimizer.step(*args, found_inf=found_inf, **kwargs)
    return None if bool(found_inf) else optimizer.step(*args, **kwargs)


_TAKES_FOUND_INF: dict[Any, bool] = {}


def _takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    step = type(optimizer).step
    known = _TAKES_FOUND_INF.get(step)
    if known is None:
        try:
            known = "found_inf" in inspect.signature(step).parameters
        except (TypeError, ValueError):  # a builtin without a signature
            known = False
        _TAKES_FOUND_INF[step] = known
    return known


class AgreeingGradScaler(torch.amp.GradScaler):
    """`torch.amp.GradScaler` whose found-inf agrees over the ranks when gradients are FSDP2
    shards (DTensors): each rank checks its shards, one all-reduce (MAX) per device of the
    found-inf flag, so every rank skips the same steps and keeps the same scale.

    Its unscaling gives GradScaler's bits in four launches fewer a step: 1/scale as one FP32
    reciprocal, the same value as GradScaler's FP64 one rounded to FP32 (IEEE division rounds
    correctly, and rounding the FP64 quotient again cannot differ: 53 ≥ 2·24 + 2 bits; fp16-mixed's
    scales are powers of two besides, whose reciprocals are exact); the flag and 1/scale used on
    the gradients' device as they are, copied once to each other device."""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        inverse = self._scale.reciprocal()
        found_inf = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, inverse, found_inf, False)
        state["stage"] = OptState.UNSCALED

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        sharded = next((grad for grad in grads if isinstance(grad, DTensor)), None)
        if sharded is not None or any(grad.is_sparse for grad in grads):  # torch's own unscaling
            per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
            if sharded is not None:
                for flag in per_device.values():
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=sharded.device_mesh.get_group())
            return per_device
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for grad in grads:
            if not allow_fp16 and grad.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
        per_device: dict[torch.device, torch.Tensor] = {}
        inverses: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for (device, _), same in groups.items():
                if device not in per_device:
                    same_device = found_inf.device == device
                    per_device[device] = (
                        found_inf if same_device else found_inf.to(device, non_blocking=True, copy=True)
                    )
                    inverses[device] = inv_scale if same_device else inv_scale.to(device, non_blocking=True)
                torch._amp_foreach_non_finite_check_and_unscale_(same, per_device[device], inverses[device])
        return per_device

    def share_found_inf(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
        """Fold the step's agreed `found_inf` into the flags `update` reads (MAX, on the device),
        so the scale backs off exactly on the steps that are skipped, on every rank alike."""
        state = self._per_optimizer_states.get(id(optimizer))
        for flag in (state or {}).get("found_inf_per_device", {}).values():
            torch.maximum(flag, found_inf.to(flag.device), out=flag)
