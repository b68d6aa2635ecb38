"""FP8 AdamW: the low-bit optimizer of FP8-LM / MS-AMP O2 (FP8-LM §2.2; ALGORITHMS.md §3).

Per parameter θ with gradient g, step t, all arithmetic in FP32:

    m ← β1·m + (1 − β1)·g                stored as E4M3 payload + FP32 per-tensor scale
    v ← β2·v + (1 − β2)·g²               stored as FP16 payload + FP32 per-tensor scale
    θ ← θ − lr·( m̂ / (√v̂ + ε) + λ·θ )    m̂ = m/(1 − β1ᵗ), v̂ = v/(1 − β2ᵗ)

Every scale is the power of two of `hf_lowprec.fp8.scaled` (real = payload / s), recomputed
from the new amax at each step. The first moment tolerates FP8 ("the direction of the
gradient matters more than its magnitude"); the second moment does not — squares of small
gradients underflow, and FP8 v makes training diverge (FP8-LM Fig. 8, #4). The
`exp_avg_sq_format="e4m3"` option exists to reproduce that ablation.

Master weights are the parameters themselves, in their own dtype: for the FP8 GEMM weights
of FP8-LM O2, an FP16 payload with a per-tensor scale (`get_master_scale`, set by
`FP8Linear.scale_master_weight()`), updated here in place. Memory for those, with FP8
gradients kept in this optimizer (`set_fp8_grad`): 2 (master) + 1 (gradient) + 1 (m) + 2 (v)
= 6 bytes per parameter, plus a few scalars per tensor. The storage formats are per
parameter group, so the parameters that are not FP8 GEMM weights (LayerNorm gains, biases,
embeddings) can sit in the same optimizer with FP32 masters and FP32 moments (stored
unscaled), as MS-AMP keeps them.

The lost-arithmetic metrics see the master in real units (`held_value`), in FP64.
"""

from __future__ import annotations

import math

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch

from ..fp8.scaled import FORMATS, dequantize, format_dtype, get_master_scale, pow2_scale, quantize, tensor_amax
from ..numerics import sqrt_rn
from .base import LowPrecisionOptimizer
from .kernels import FusedMode, check_fused_mode, compiled_fp8_adamw_step

__all__ = ["FP8AdamW", "adamw_update", "fp8_adamw_param_step"]


def adamw_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One AdamW step on real FP32 values, out of place: the update rule of FP8AdamW.

    A pure function of its tensors (nothing is stored or scaled here), so it can be compiled
    into one fused kernel; `fp8_adamw_param_step` wraps it with the dequantize / requantize
    of the scaled storage.

    Returns:
        (param, exp_avg, exp_avg_sq, update): the new values and the intended update Δθ.
    """
    # Each operation rounded on its own (no lerp / addcmul, which fuse a multiply-add on CPU):
    # the compiled kernel then reproduces these values with plain vector arithmetic.
    exp_avg = exp_avg + (1.0 - beta1) * (grad - exp_avg)
    exp_avg_sq = exp_avg_sq * beta2 + (1.0 - beta2) * grad * grad
    # m̂/(√v̂ + ε) with the bias corrections folded into two host scalars (FP64, rounded once),
    # as `collage.adamw_delta` does: (s·m)/(√v + ε·√c2), s = −α·√c2/c1: one root and one
    # division per element; `tiny` keeps v = 0 with ε = 0 from giving 0/0.
    sqrt_c2 = math.sqrt(1.0 - beta2**step)
    step_size = -lr * sqrt_c2 / (1.0 - beta1**step)
    denom = sqrt_rn(exp_avg_sq) + max(eps * sqrt_c2, torch.finfo(torch.float32).smallest_normal)
    update = step_size * exp_avg / denom
    if weight_decay:
        update = update - (lr * weight_decay) * param
    return param + update, exp_avg, exp_avg_sq, update


def _requantize_(payload: torch.Tensor, scale: torch.Tensor, real: torch.Tensor, margin: int) -> None:
    """Store `real` into (payload, scale) in place, with a fresh power-of-two scale.

    FP32 storage (the high-precision parameters of FP8-LM O2) has the range of the values
    themselves: it is stored unscaled, with scale 1.
    """
    if payload.dtype == torch.float32:
        payload.copy_(real)
        scale.fill_(1.0)
        return
    new_scale = pow2_scale(tensor_amax(real), payload.dtype, margin)
    payload.copy_(quantize(real, new_scale, payload.dtype))
    scale.copy_(new_scale)


def fp8_adamw_param_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    margin: int,
) -> torch.Tensor:
    """One AdamW step for one parameter with scaled low-precision moments, in place.

    Args:
        param: the master weight (real values, or an FP16 payload with `get_master_scale`).
        grad: the gradient with respect to the real weight, FP32.
        state: "step", "exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale".

    Returns:
        The intended update Δθ in real units (FP32), for the lost-arithmetic metrics.
    """
    state["step"] += 1
    master_scale = get_master_scale(param)
    real = param.float() if master_scale is None else dequantize(param, master_scale)
    new, m, v, update = adamw_update(
        real, grad, dequantize(state["exp_avg"], state["exp_avg_scale"]),
        dequantize(state["exp_avg_sq"], state["exp_avg_sq_scale"]), step=state["step"],
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
    )  # fmt: skip
    _requantize_(state["exp_avg"], state["exp_avg_scale"], m, margin)
    _requantize_(state["exp_avg_sq"], state["exp_avg_sq_scale"], v, margin)
    if master_scale is None:
        param.copy_(new)
    else:
        _requantize_(param, master_scale, new, margin)
    return update


class FP8AdamW(LowPrecisionOptimizer):
    """AdamW with an E4M3 first moment and a scaled FP16 second moment (MS-AMP O2 "LBAdamW").

    Args:
        params: parameters or parameter groups (any floating dtype; FP16 for O2 masters).
        lr, betas, eps, weight_decay: as in `torch.optim.AdamW` (decoupled weight decay).
        exp_avg_format: storage of m: "e4m3" (paper), "e5m2", "fp16", "bf16" or "fp32".
        exp_avg_sq_format: storage of v: "fp16" (paper), or "e4m3"/"e5m2" for the
            FP8-second-moment ablation (FP8-LM Fig. 8 #4), "bf16", "fp32".
        margin: scale margin in binades for moments and scaled masters.
        fused: "auto" (the step of each parameter as two compiled passes of `kernels`, amax
            then update and store, where torch.compile can build them), "compiled" (require
            them) or "foreach" (`fp8_adamw_param_step`); bit-identical results on CPU.

    State per parameter: `step` (int), `exp_avg` + `exp_avg_scale`, `exp_avg_sq` +
    `exp_avg_sq_scale` (payloads + FP32 scalars), and, once `set_fp8_grad` was used, `grad` +
    `grad_scale`: the FP8 gradient buffer, reused every step. It is saved with the state (one
    byte per element) so that a loaded state has the same keys and dtypes; a loaded gradient
    is never applied, since only `set_fp8_grad` marks a gradient as this step's.

    Gradients: `p.grad` (any dtype), or an FP8 gradient handed over with `set_fp8_grad`,
    which takes precedence and lets the caller free `p.grad` (1 byte per element instead of 2–4).
    """

    state_roles: ClassVar[dict[str, str]] = {
        "exp_avg": "optimizer",
        "exp_avg_sq": "optimizer",
        "exp_avg_scale": "extra",
        "exp_avg_sq_scale": "extra",
        "grad": "gradient",
        "grad_scale": "extra",
    }

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        exp_avg_format: str = "e4m3",
        exp_avg_sq_format: str = "fp16",
        margin: int = 0,
        fused: FusedMode = "auto",
    ) -> None:
        self.fused = check_fused_mode("FP8AdamW", fused)
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
            exp_avg_format=exp_avg_format, exp_avg_sq_format=exp_avg_sq_format, margin=margin,
        )  # fmt: skip
        _check_group(defaults)
        self._pending_grads: set[int] = set()
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _check_group({**self.defaults, **param_group})
        params = param_group["params"]
        params = [params] if torch.is_tensor(params) else list(params)
        for param in params:
            if not param.is_floating_point():
                raise ValueError(f"FP8AdamW optimizes floating-point parameters, got {param.dtype}")
        param_group["params"] = params
        super().add_param_group(param_group)

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        m_dtype = format_dtype(group["exp_avg_format"])
        v_dtype = format_dtype(group["exp_avg_sq_format"])
        device = param.device
        return {
            "step": 0,
            "exp_avg": torch.zeros_like(param, dtype=m_dtype),
            "exp_avg_scale": torch.ones((), device=device),
            "exp_avg_sq": torch.zeros_like(param, dtype=v_dtype),
            "exp_avg_sq_scale": torch.ones((), device=device),
        }

    def planned_grad_dtype(self, param: torch.Tensor) -> torch.dtype:
        """The dtype `param`'s gradient is held in between steps (memory plans): FP8 for a scaled
        FP16 master, whose gradient the strategy hands over with `set_fp8_grad`; else `param`'s."""
        return torch.float8_e4m3fn if get_master_scale(param) is not None else param.dtype

    def set_fp8_grad(self, param: torch.Tensor, payload: torch.Tensor, scale: torch.Tensor) -> None:
        """Hand over this step's gradient of `param` as FP8 payload / scale (real = payload / scale).

        The payload is copied into a buffer kept in the optimizer state (role "gradient"), so
        the caller can free `p.grad`. It is used by the next `step()` and then discarded.
        """
        if payload.shape != param.shape:
            raise ValueError(f"FP8 gradient shape {tuple(payload.shape)} != parameter shape {tuple(param.shape)}")
        state = self.state[param]
        buffer = state.get("grad")
        if buffer is None or buffer.dtype != payload.dtype:
            state["grad"] = payload.detach().clone()
            state["grad_scale"] = scale.detach().float().clone()
        else:
            buffer.copy_(payload)
            state["grad_scale"].copy_(scale)
        self._pending_grads.add(id(param))

    def fp8_grad(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This step's FP8 gradient of `param` as the stored (payload, scale), or None.

        The tensors are the optimizer's own: dividing the scale by c in place multiplies the
        gradient by c without touching the payload (how FP8-LM O2 clips).
        """
        if id(param) not in self._pending_grads:
            return None
        state = self.state[param]
        return state["grad"], state["grad_scale"]

    def _gradient(self, param: torch.Tensor) -> torch.Tensor | None:
        if id(param) in self._pending_grads:
            state = self.state[param]
            return dequantize(state["grad"], state["grad_scale"])
        if param.grad is None:
            return None
        if param.grad.is_sparse:
            raise ValueError("FP8AdamW does not support sparse gradients")
        return param.grad.float()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One optimization step; `closure` re-evaluates the loss, as in torch.optim."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if not self.track_updates and self._fused_param_step(param, group):
                    continue
                grad = self._gradient(param)
                if grad is None:
                    continue
                state = self.state[param]
                if "exp_avg" not in state:
                    state.update(self._init_state(param, group))
                before = self.held_value(param) if self.track_updates else None
                update = fp8_adamw_param_step(
                    param, grad, state, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], margin=group["margin"],
                )  # fmt: skip
                if before is not None:
                    self._track(index, param, before, update)
        self._pending_grads.clear()
        return loss

    def _fused_param_step(self, param: torch.Tensor, group: dict[str, Any]) -> bool:
        """The step of `param` through `kernels.compiled_fp8_adamw_step`; False = not done.

        The FP8 gradient goes in as payload and scale, never widened to an FP32 copy."""
        if self.fused == "foreach":
            return False
        state = self.state[param]
        if id(param) in self._pending_grads:
            grad, grad_scale = state["grad"], state["grad_scale"]
        elif param.grad is None or param.grad.is_sparse:
            return False
        else:
            grad, grad_scale = param.grad, None
        if "exp_avg" not in state:
            state.update(self._init_state(param, group))
        beta1, beta2 = group["betas"]
        return compiled_fp8_adamw_step(
            param, get_master_scale(param), grad, grad_scale, state, lr=group["lr"], beta1=beta1,
            beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], margin=group["margin"],
            fused=self.fused,
        )  # fmt: skip

    def held_value(self, param: torch.Tensor) -> torch.Tensor:
        """The master in real units (payload / scale for a scaled FP16 master), FP64."""
        scale = get_master_scale(param)
        return param.detach().double() if scale is None else dequantize(param.detach(), scale, torch.float64)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._pending_grads.clear()
        super().zero_grad(set_to_none=set_to_none)

    def discard_fp8_grads(self) -> None:
        """Drop this step's FP8 gradients (a skipped step): the kept buffers are zeroed, so no
        inf/NaN handed over in backward stays in the state or reaches a checkpoint."""
        for state in self.state.values():
            if "grad" in state:
                state["grad"].zero_()
                state["grad_scale"].fill_(1.0)
        self._pending_grads.clear()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending_grads.clear()
        super().load_state_dict(state_dict)


def _check_group(group: dict[str, Any]) -> None:
    lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    if not lr >= 0:
        raise ValueError(f"FP8AdamW: learning rate must be >= 0, got {lr}")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"FP8AdamW: betas must lie in [0, 1), got {group['betas']}")
    if not eps >= 0:
        raise ValueError(f"FP8AdamW: eps must be >= 0, got {eps}")
    if not wd >= 0:
        raise ValueError(f"FP8AdamW: weight_decay must be >= 0, got {wd}")
    for key in ("exp_avg_format", "exp_avg_sq_format"):
        if group[key] not in FORMATS:
            raise ValueError(f"FP8AdamW: {key} must be one of {sorted(FORMATS)}, got {group[key]!r}")
    margin = group["margin"]
    if not (isinstance(margin, int) and margin >= 0):
        raise ValueError(f"FP8AdamW: margin must be an integer >= 0, got {margin!r}")
