"""Collage: AdamW with every stored tensor in BF16/FP16, made precise by MCF expansions.

Collage (Yu et al., ICML 2024) §4, Algorithm 2; ALGORITHMS.md §2. The parameter is kept as a
length-2 expansion (θ, δθ) and, in the "plus" variant, the second moment as (v, δv), so that
updates far below ulp(θ)/2 and the slow decay of v under β2 = 0.999 are not lost.

Layering: `CollageAdamW` (state, hyper-parameters, tracking) → `collage_adamw` (functional
over lists of tensors, the single place where a fused kernel could be dispatched) →
`_foreach_collage_adamw` (the `torch._foreach_*` implementation).

This module also holds what every AdamW variant of `hf_lowprec.optim` shares:
`AdamWBase` (validation, bucketing by device and dtype, step counting, tracking) and
`adamw_delta` (the update Δθ from the moments).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import torch

from hf_lowprec.numerics import LOW_PRECISION_DTYPES, expansion, foreach_fast_two_sum_, foreach_grow_

from .base import LowPrecisionOptimizer

__all__ = [
    "AdamWBase",
    "CollageAdamW",
    "adamw_delta",
    "collage_adamw",
    "foreach_second_moment_",
    "scalar_tensor",
]

VARIANTS = ("light", "plus")

Tensors = list[torch.Tensor]


def check_adamw_hyperparameters(
    name: str, lr: float, betas: Sequence[float], eps: float, weight_decay: float
) -> None:
    """Raise ValueError naming the bad value and what to pass instead."""
    if not lr >= 0.0:
        raise ValueError(f"{name}: invalid lr={lr!r}; the learning rate must be >= 0 (e.g. lr=1e-3)")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(
            f"{name}: invalid betas={tuple(betas)!r}; pass two values in [0, 1), e.g. betas=(0.9, 0.999)"
        )
    if not eps >= 0.0:
        raise ValueError(f"{name}: invalid eps={eps!r}; eps must be >= 0 (e.g. eps=1e-8)")
    if not weight_decay >= 0.0:
        raise ValueError(
            f"{name}: invalid weight_decay={weight_decay!r}; it must be >= 0 (0.0 disables decay)"
        )


def adamw_delta(
    params: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    steps: Sequence[int],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> Tensors:
    """The AdamW update Δθ = −α·(m̂/(√v̂ + ε) + λ·θ) as new tensors in the inputs' dtype.

    m̂ = m/(1 − β1^t), v̂ = v/(1 − β2^t), with the bias corrections computed in FP64 on the
    host. Decoupled weight decay is part of Δθ, so a compensated update compensates it too;
    ε sits outside the root as in `torch.optim.AdamW`. The bias corrections are folded into
    two scalars with the same algebra:
    m̂/(√v̂ + ε) = (m·√c2/c1) / (√v + ε·√c2), c1 = 1 − β1^t, c2 = 1 − β2^t.

    The added ε·√c2 is kept at least the dtype's smallest subnormal: in FP16, ε = 1e-8
    underflows to 0 and a zero second moment would otherwise give 0/0.
    """
    finfo = torch.finfo(exp_avg_sqs[0].dtype)
    smallest_subnormal = finfo.smallest_normal * finfo.eps
    sqrt_c2 = [math.sqrt(1.0 - beta2**t) for t in steps]
    step_sizes = [-lr * c2 / (1.0 - beta1**t) for c2, t in zip(sqrt_c2, steps)]
    denominators = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denominators, [max(eps * c2, smallest_subnormal) for c2 in sqrt_c2])
    if weight_decay != 0.0:
        delta = torch._foreach_mul(params, -lr * weight_decay)
        torch._foreach_addcdiv_(delta, exp_avgs, denominators, step_sizes)
    else:
        delta = torch._foreach_mul(exp_avgs, step_sizes)
        torch._foreach_div_(delta, denominators)
    return delta


def scalar_tensor(value: float, like: torch.Tensor) -> torch.Tensor:
    """A 0-dim FP64 tensor on `like`'s device, to pass a scalar to foreach ops exactly.

    On CPU (torch 2.13) in-place `_foreach_mul_` rounds a Python scalar to the tensors'
    dtype first (BF16 β2 = 0.95 would become 0.94921875), and `add(..., alpha=)` is not
    always rounded once; a 0-dim tensor operand is applied in FP32 arithmetic, like
    `Tensor.mul`, `lerp` and `addcmul` with a Python scalar.
    """
    return torch.tensor(value, dtype=torch.float64, device=like.device)


def foreach_second_moment_(exp_avg_sqs: Tensors, grads: Tensors, beta2: float) -> None:
    """v ← β2·v + (1 − β2)·g² in place, in the dtype of v, rounded as `torch.optim.AdamW`
    does it (fl(β2·v), then one rounding of the addcmul)."""
    torch._foreach_mul_(exp_avg_sqs, scalar_tensor(beta2, exp_avg_sqs[0]))
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)


class AdamWBase(LowPrecisionOptimizer):
    """What the AdamW variants share: validation, the step loop and update tracking.

    A subclass sets `param_dtypes` (None accepts any floating dtype), creates its state in
    `_init_state` and updates one bucket of parameters (same device and dtype) in
    `_update_bucket`, which appends the intended updates Δθ (at least FP32) to
    `updates_out` when that is a list (only while `track_updates` is on).
    """

    param_dtypes: ClassVar[tuple[torch.dtype, ...] | None] = LOW_PRECISION_DTYPES
    # Group options beyond the AdamW hyper-parameters that a subclass's constructor passes on.
    extra_options: ClassVar[tuple[str, ...]] = ()
    dtype_advice: ClassVar[str] = (
        "cast the model with model.to(torch.bfloat16), or use PlainAdamW / torch.optim.AdamW "
        "for FP32 parameters"
    )

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        **extra_defaults: Any,
    ):
        unknown = sorted(set(extra_defaults) - set(self.extra_options))
        if unknown:
            raise TypeError(f"{type(self).__name__} got unexpected argument(s) {unknown}")
        check_adamw_hyperparameters(type(self).__name__, lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **extra_defaults)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        merged = {**self.defaults, **param_group}
        self._check_group(merged)
        params = param_group["params"]
        if isinstance(params, set):
            raise TypeError(
                f"{type(self).__name__}: parameters must be an ordered collection, not a set; "
                f"pass a list so that state_dict order is reproducible"
            )
        # Materialise a generator once, so the check and torch see the same parameters.
        params = param_group["params"] = [params] if torch.is_tensor(params) else list(params)
        for index, param in enumerate(params):
            if self.param_dtypes is not None and param.dtype not in self.param_dtypes:
                allowed = " or ".join(str(d) for d in self.param_dtypes)
                raise ValueError(
                    f"{type(self).__name__} needs {allowed} parameters, got {param.dtype} "
                    f"(parameter {index} of group {len(self.param_groups)}); {self.dtype_advice}"
                )
            if not param.is_floating_point():
                raise ValueError(
                    f"{type(self).__name__} optimizes floating-point parameters, got {param.dtype} "
                    f"(parameter {index} of group {len(self.param_groups)})"
                )
        super().add_param_group(param_group)

    def _check_group(self, group: dict[str, Any]) -> None:
        check_adamw_hyperparameters(
            type(self).__name__, group["lr"], group["betas"], group["eps"], group["weight_decay"]
        )

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def _update_bucket(
        self,
        group: dict[str, Any],
        params: Tensors,
        grads: Tensors,
        states: list[dict[str, Any]],
        steps: list[int],
        updates_out: Tensors | None,
    ) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Perform one optimization step; `closure` re-evaluates the loss, as in torch.optim."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group_index, group in enumerate(self.param_groups):
            buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise ValueError(f"{type(self).__name__} does not support sparse gradients")
                buckets.setdefault((param.device, param.dtype), []).append(param)
            for params in buckets.values():
                states = []
                for param in params:
                    if not self.state[param]:
                        self.state[param] = self._init_state(param, group)
                    state = self.state[param]
                    state["step"] += 1
                    states.append(state)
                befores = [p.detach().clone() for p in params] if self.track_updates else None
                updates: Tensors | None = [] if self.track_updates else None
                self._update_bucket(
                    group,
                    params,
                    [p.grad for p in params],
                    states,
                    [s["step"] for s in states],
                    updates,
                )
                if befores is not None:
                    for param, before, update in zip(params, befores, updates):
                        self._track(group_index, param, before, update)
        return loss


def collage_adamw(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    param_errors: Tensors,
    exp_avg_sq_errors: Tensors | None,
    steps: Sequence[int],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    variant: str,
    updates_out: Tensors | None = None,
) -> None:
    """One Collage AdamW step over lists of tensors of one device and dtype, in place.

    Collage Algorithm 2 (ALGORITHMS.md §2), per parameter:
        m ← β1·m + (1 − β1)·g                                        (plain)
        light: v ← β2·v + (1 − β2)·g²                                (plain)
        plus:  (v, δv) ← Grow(Mul((β̂2, δβ2), (v, δv)), (1 − β2)·g²)
        Δθ = −α·(m̂/(√v̂ + ε) + λ·θ)
        (θ, δθ) ← Grow((θ, δθ), Δθ)

    Args:
        exp_avg_sq_errors: δv, required for variant "plus", ignored for "light".
        steps: the step number t of each parameter after this step (1 on the first step).
        updates_out: if given, receives an FP32 copy of each intended update Δθ.
    """
    if variant == "plus" and exp_avg_sq_errors is None:
        raise ValueError("collage_adamw: variant='plus' needs exp_avg_sq_errors (δv)")
    # The single dispatch point: a fused kernel reading g, m, v, δv, θ, δθ once and writing
    # them once (≈22 bytes/param for plus) would be selected here by device.
    _foreach_collage_adamw(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        param_errors,
        exp_avg_sq_errors,
        steps,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        variant=variant,
        updates_out=updates_out,
    )


def _foreach_second_moment_plus_(
    exp_avg_sqs: Tensors, exp_avg_sq_errors: Tensors, grads: Tensors, beta2: float
) -> None:
    """(v, δv) ← Grow(Mul((β̂2, δβ2), (v, δv)), (1 − β2)·g²) in place; same arithmetic as
    `numerics.grow(*numerics.mul_expansion(β̂2, δβ2, v, δv), (1 − β2)·g²)`."""
    v, dv = exp_avg_sqs, exp_avg_sq_errors
    beta_hi, beta_lo = expansion(beta2, v[0].dtype)
    # As 0-dim operands of addcmul, so that every term below is added with exactly one
    # rounding (the products are exact in FP32), the arithmetic of `mul_expansion`.
    hi = [torch.tensor(beta_hi, dtype=v[0].dtype, device=v[0].device)] * len(v)
    lo = [torch.tensor(beta_lo, dtype=v[0].dtype, device=v[0].device)] * len(v)
    if beta_hi == 1.0:
        # TwoProd(1, v) = (v, 0) exactly; only the cross terms δv + δβ2·v remain.
        torch._foreach_addcmul_(dv, v, lo)
        foreach_fast_two_sum_(v, dv)
    else:
        # Carry the error negated, ne = −e, so each step is one in-place addcmul.
        p = torch._foreach_mul(v, beta_hi)  # p = fl(β̂2·v)
        ne = torch._foreach_addcmul(p, v, hi, value=-1.0)  # −e = p − β̂2·v, exact
        torch._foreach_addcmul_(ne, dv, hi, value=-1.0)
        torch._foreach_addcmul_(ne, v, lo, value=-1.0)
        # Fast2Sum(p, e) with e = −ne: s = fl(p − ne), z = fl(s − p), e' = fl(e − z).
        torch._foreach_copy_(v, p)
        torch._foreach_sub_(v, ne)  # v ← s
        torch._foreach_sub_(p, v)  # p ← −z
        torch._foreach_copy_(dv, p)
        torch._foreach_sub_(dv, ne)  # δv ← fl(−z − ne) = e'
    # Out of place: the in-place `_foreach_mul_` would round 1 − β2 to the low dtype first.
    increment = torch._foreach_mul(grads, 1.0 - beta2)
    torch._foreach_mul_(increment, grads)  # (1 − β2)·g²
    foreach_grow_(v, dv, increment)


def _foreach_collage_adamw(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    param_errors: Tensors,
    exp_avg_sq_errors: Tensors | None,
    steps: Sequence[int],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    variant: str,
    updates_out: Tensors | None,
) -> None:
    # m is a weighted average of g: its rounding errors stay relative and do not accumulate
    # the way lost additions to θ and v do (Collage §4.2), so it stays plain.
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    if variant == "plus":
        _foreach_second_moment_plus_(exp_avg_sqs, exp_avg_sq_errors, grads, beta2)
    else:
        foreach_second_moment_(exp_avg_sqs, grads, beta2)
    delta = adamw_delta(
        params, exp_avgs, exp_avg_sqs, steps,
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
    )  # fmt: skip
    if updates_out is not None:
        updates_out.extend(d.float() for d in delta)
    # Parameters are much larger than their updates, so Fast2Sum needs no sort (Collage §4).
    foreach_grow_(params, param_errors, delta)


class CollageAdamW(AdamWBase):
    """AdamW with BF16/FP16 parameters and states and MCF-compensated updates (Collage Alg. 2).

    Args:
        params: BF16 or FP16 parameters (or parameter groups).
        lr: learning rate α.
        betas: (β1, β2).
        eps: ε, added outside the square root.
        weight_decay: decoupled weight decay λ, applied inside the compensated update.
        variant: "light" compensates θ only (option B, 10 bytes/param); "plus" also keeps
            the second moment as an expansion (option C, 12 bytes/param).

    State per parameter (all in the parameter's dtype): `exp_avg` m, `exp_avg_sq` v,
    `param_error` δθ, `exp_avg_sq_error` δv (plus only), and `step` (int).
    """

    extra_options: ClassVar[tuple[str, ...]] = ("variant",)
    state_roles: ClassVar[dict[str, str]] = {
        "exp_avg": "optimizer",
        "exp_avg_sq": "optimizer",
        "param_error": "extra",
        "exp_avg_sq_error": "extra",
    }

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        variant: str = "plus",
    ):
        super().__init__(params, lr, betas, eps, weight_decay, variant=variant)

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        if group["variant"] not in VARIANTS:
            raise ValueError(
                f"CollageAdamW: unknown variant={group['variant']!r}; choose 'light' "
                f"(compensated parameters) or 'plus' (also compensated second moment)"
            )

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state: dict[str, Any] = {
            "step": 0,
            "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
            "param_error": torch.zeros_like(param, memory_format=torch.preserve_format),
        }
        if group["variant"] == "plus":
            state["exp_avg_sq_error"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def _update_bucket(
        self,
        group: dict[str, Any],
        params: Tensors,
        grads: Tensors,
        states: list[dict[str, Any]],
        steps: list[int],
        updates_out: Tensors | None,
    ) -> None:
        plus = group["variant"] == "plus"
        if plus:
            # A group switched from "light" to "plus" mid-run starts δv at zero.
            for param, state in zip(params, states):
                if "exp_avg_sq_error" not in state:
                    state["exp_avg_sq_error"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        collage_adamw(
            params,
            grads,
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["param_error"] for s in states],
            [s["exp_avg_sq_error"] for s in states] if plus else None,
            steps,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            variant=group["variant"],
            updates_out=updates_out,
        )
