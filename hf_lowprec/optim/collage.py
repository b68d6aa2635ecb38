"""Collage: AdamW with every stored tensor in BF16/FP16, made precise by MCF expansions.

Collage (Yu et al., ICML 2024) §4, Algorithm 2; ALGORITHMS.md §2. The parameter is kept as a
length-2 expansion (θ, δθ) and, in the "plus" variant, the second moment as (v, δv), so that
updates far below ulp(θ)/2 and the slow decay of v under β2 = 0.999 are not lost.

Layering: `CollageAdamW` (state, hyper-parameters, tracking) → `collage_adamw` (functional
over lists of tensors) → `_foreach_collage_adamw` (the `torch._foreach_*` reference, whose
rounding sequence the `collage_adamw` docstring spells out). By default the optimizer runs
the same sequence as one compiled kernel (`kernels.collage_kernel`, option `fused`).

Only the storage is 16-bit: the moments and Δθ are computed in FP32 registers and rounded
once when stored, as any element-wise kernel does. That keeps FP16's (1 − β2)·g² from
underflowing inside the step and rounds each stored value once (ALGORITHMS.md §2).

This module also holds what every AdamW variant of `hf_lowprec.optim` shares:
`AdamWBase` (validation, bucketing by device and dtype, step counting, tracking),
`adamw_moments_` (the moment update) and `adamw_delta` (the update Δθ from the moments).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import torch
try:  # FSDP2 parameters; a torch built without distributed support has none
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = type("DTensor", (), {})  # matches no tensor

from hf_lowprec.numerics import LOW_PRECISION_DTYPES, abs_max, foreach_grow_, sqrt_rn

from .base import LowPrecisionOptimizer
from .kernels import FusedMode, check_fused_mode, compiled_collage_adamw

__all__ = [
    "AdamWBase",
    "CollageAdamW",
    "adamw_delta",
    "adamw_moments_",
    "collage_adamw",
    "compute_dtype",
    "second_moment_scales",
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


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the update is computed in: FP32 for 16-bit storage, else the storage dtype."""
    return torch.promote_types(dtype, torch.float32)


def _as_dtype(tensors: Tensors, dtype: torch.dtype, copy: bool = False) -> Tensors:
    return [t.to(dtype, copy=copy) for t in tensors]


def _store_(targets: Tensors, values: Tensors) -> None:
    """Round `values` to the targets' dtype (to nearest, once) and write them in place."""
    pairs = [(t, v) for t, v in zip(targets, values) if t is not v]
    if pairs:
        torch._foreach_copy_([t for t, _ in pairs], [v for _, v in pairs])


def adamw_moments_(
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    grads: Tensors,
    *,
    beta1: float,
    beta2: float,
    exp_avg_sq_errors: Tensors | None = None,
    exp_avg_sq_scales: Tensors | None = None,
) -> tuple[Tensors, Tensors]:
    """Update the AdamW moments in FP32 registers, store them, return the unrounded values.

    With c = `compute_dtype` (FP32 for BF16/FP16 storage) and r(·) the round-to-nearest
    conversion to the storage dtype, per element:

        m₃₂ = c(m) + (1 − β1)·(c(g) − c(m))                 m ← r(m₃₂)
        v₃₂ = min(β2·c(v) + ((1 − β2)·c(g))·c(g), max_v)     v ← r(v₃₂)

    every FP32 operation rounded on its own (no fused multiply-add), so that a compiled kernel
    reproduces the values bit for bit with plain vector arithmetic.

    With `exp_avg_sq_errors` (Collage-plus) the second moment is the expansion (v, δv):
    v₃₂ = min(β2·(c(v) + c(δv)) + (1 − β2)·c(g)², max_v); v ← r(v₃₂); δv ← r(v₃₂ − c(v)),
    the subtraction exact in FP32. This is Collage's Mul((β̂2, δβ2), (v, δv)) followed by
    Grow with (1 − β2)·g², done in registers: the FP32 sum v + δv is exact while the pair
    spans at most 24 bits (else off by < 2^-24 relative), β2 is applied to 2^-24 instead of
    as a BF16 pair, and the split keeps the pair's ~2p bits (ALGORITHMS.md §2). β2·v then
    decays under β2 = 0.999 as it must (in plain BF16, r(0.999·v) == v).

    Why registers: the step is computed from m₃₂ and v₃₂, never from their rounded copies,
    and each stored value is rounded once.

    FP16 storage (`exp_avg_sq_scales`, one FP32 0-dim power of two s per tensor): FP16
    cannot hold a second moment below its smallest subnormal 2^-24, and (1 − β2)·g²
    underflows for |g| ≲ 1e-2 (a zero v then turns m/(√v + ε) into a huge step, and it stays
    zero from step to step). So FP16 stores v·s (and δv·s), with s re-chosen after each
    update as the largest power of two with amax(v₃₂)·s ≤ 65504: v₃₂ = (stored)/s on read,
    stored = r(v₃₂·s) on write (exact scalings, as in the FP8 optimizer's scaled states).
    The tensor's largest v then sits at the top of FP16's range and elements down to
    2^-40 of it keep a value. BF16 has FP32's range and needs no scale.

    max_v is the storage dtype's largest finite value: a finite gradient whose square
    overflows (BF16 g = 1e30) saturates v instead of storing inf (and inf − inf = NaN in
    the split), so no state becomes non-finite from a finite gradient.

    Returns:
        (m₃₂, v₃₂) in the compute dtype; they are the stored tensors themselves when the
        storage dtype already is the compute dtype (FP32 states).
    """
    dtype = compute_dtype(exp_avg_sqs[0].dtype)
    grads32 = _as_dtype(grads, dtype)
    exp_avgs32 = _as_dtype(exp_avgs, dtype)
    # m + (1 − β1)·(g − m) and β2·v + ((1 − β2)·g)·g, each operation rounded on its own (no
    # lerp or addcmul: their CPU kernels fuse a multiply-add, which a compiled kernel could
    # only reproduce with an exact FMA emulation costing more than the whole step).
    scratch = torch._foreach_sub(grads32, exp_avgs32)
    torch._foreach_mul_(scratch, 1.0 - beta1)
    torch._foreach_add_(exp_avgs32, scratch)
    if exp_avg_sq_errors is None and exp_avg_sq_scales is None:
        exp_avg_sqs32 = _as_dtype(exp_avg_sqs, dtype)
    else:
        exp_avg_sqs32 = _as_dtype(exp_avg_sqs, dtype, copy=True)
    if exp_avg_sq_errors is not None:
        torch._foreach_add_(exp_avg_sqs32, _as_dtype(exp_avg_sq_errors, dtype))
    if exp_avg_sq_scales is not None:
        torch._foreach_div_(exp_avg_sqs32, exp_avg_sq_scales)
    torch._foreach_mul_(exp_avg_sqs32, beta2)
    torch._foreach_copy_(scratch, grads32)
    torch._foreach_mul_(scratch, 1.0 - beta2)
    torch._foreach_mul_(scratch, grads32)
    torch._foreach_add_(exp_avg_sqs32, scratch)
    del scratch
    max_v = torch.finfo(exp_avg_sqs[0].dtype).max
    _store_(exp_avgs, exp_avgs32)
    if exp_avg_sq_scales is None:
        torch._foreach_clamp_max_(exp_avg_sqs32, max_v)
        stored = exp_avg_sqs32
    else:
        _rescale_(exp_avg_sq_scales, exp_avg_sqs32, max_v)
        stored = torch._foreach_mul(exp_avg_sqs32, exp_avg_sq_scales)
        torch._foreach_clamp_max_(stored, max_v)
    _store_(exp_avg_sqs, stored)
    if exp_avg_sq_errors is not None:
        _store_(exp_avg_sq_errors, torch._foreach_sub(stored, _as_dtype(exp_avg_sqs, dtype)))
    return exp_avgs32, exp_avg_sqs32


def second_moment_scales(states: list[dict[str, Any]]) -> Tensors | None:
    """The `exp_avg_sq_scale` of each state of a bucket, or None when v is not scaled."""
    return [s["exp_avg_sq_scale"] for s in states] if "exp_avg_sq_scale" in states[0] else None


def _rescale_(scales: Tensors, values: Tensors, max_value: float) -> None:
    """Set each scale to the largest power of two s with amax·s ≤ max_value (kept if amax = 0).

    The exponent is clamped to FP32's normal range. An amax of inf or NaN keeps the scale.
    """
    for scale, value in zip(scales, values):
        amax = abs_max(value).double()
        exponent = torch.floor(torch.log2(max_value / amax)).clamp_(-126, 126)
        usable = (amax > 0) & torch.isfinite(amax)
        scale.copy_(torch.where(usable, torch.exp2(exponent), scale.double()))


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
    """The AdamW update Δθ = −α·(m̂/(√v̂ + ε) + λ·θ) as new tensors in the moments' dtype.

    Pass the register moments of `adamw_moments_` (FP32 for 16-bit storage); θ is upcast to
    their dtype. m̂ = m/(1 − β1^t), v̂ = v/(1 − β2^t), with the bias corrections computed in
    FP64 on the host and folded into two scalars with the same algebra:
    m̂/(√v̂ + ε) = (m·√c2/c1) / (√v + ε·√c2), c1 = 1 − β1^t, c2 = 1 − β2^t. Per element:

        d = √v + max(ε·√c2, tiny);  Δθ = fl(−α·λ·θ) + fl(s·m/d),  s = −α·√c2/c1

    (one `addcdiv`, the same rounding whatever λ is). Decoupled weight decay is part of Δθ,
    so a compensated update compensates it too; ε sits outside the root as in
    `torch.optim.AdamW`. `tiny` (the smallest normal of the compute dtype) keeps a zero
    second moment with ε = 0 from giving 0/0.
    """
    dtype = exp_avg_sqs[0].dtype
    tiny = torch.finfo(dtype).smallest_normal
    sqrt_c2 = [math.sqrt(1.0 - beta2**t) for t in steps]
    step_sizes = [-lr * c2 / (1.0 - beta1**t) for c2, t in zip(sqrt_c2, steps)]
    # Correctly rounded roots (`sqrt_rn`): the compiled kernels' hardware root gives these bits.
    denominators = [sqrt_rn(v) for v in exp_avg_sqs]
    torch._foreach_add_(denominators, [max(eps * c2, tiny) for c2 in sqrt_c2])
    delta = torch._foreach_mul(_as_dtype(params, dtype), -lr * weight_decay)
    torch._foreach_addcdiv_(delta, exp_avgs, denominators, step_sizes)
    return delta


def _chunks(params: Tensors, limit: int | None) -> list[Tensors]:
    """`params` in order, split into runs of at most `limit` elements (a larger tensor alone)."""
    if limit is None:
        return [params]
    chunks: list[Tensors] = []
    numel = 0
    for param in params:
        if not chunks or numel + param.numel() > limit:
            chunks.append([])
            numel = 0
        chunks[-1].append(param)
        numel += param.numel()
    return chunks


# --- FSDP2: DTensor parameters step on their local shards --------------------------------
# Under `fully_shard` a parameter and its gradient are DTensors sharded on dim 0. The update
# is element-wise, so each rank steps its own shard with the same code as one process; every
# state tensor shaped like the parameter is created from the local shard (same dtype as in one
# process) and kept as a DTensor with the parameter's placements, so that
# torch.distributed.checkpoint saves and reshards it like the parameter. Scalars (step
# counters, per-tensor scales) stay plain.


def _local(tensor: Any) -> Any:
    """The local shard of a DTensor (same storage: in-place updates reach the DTensor); anything else as is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _sharded_like(value: Any, param: torch.Tensor) -> Any:
    """`value` (a tensor shaped like the local shard of the DTensor `param`) as a DTensor sharded like it."""
    if not isinstance(param, DTensor) or not torch.is_tensor(value) or isinstance(value, DTensor):
        return value
    if value.shape != param.to_local().shape:
        return value
    return DTensor.from_local(
        value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _local_state(state: dict[str, Any]) -> dict[str, Any]:
    """A view of `state` with every DTensor replaced by its local shard (`state` itself when none is)."""
    if not any(isinstance(v, DTensor) for v in state.values()):
        return state
    return {key: _local(value) for key, value in state.items()}


def _store_local_state(state: dict[str, Any], local: dict[str, Any], before: dict[str, Any], param: torch.Tensor) -> None:
    """Write back what an update added to or replaced in the local view `local` of `state`."""
    if local is state:
        return
    for key, value in local.items():
        if before.get(key, _MISSING) is not value:
            state[key] = _sharded_like(value, param)


_MISSING = object()
# --- end FSDP2 ----------------------------------------------------------------------------


class AdamWBase(LowPrecisionOptimizer):
    """What the AdamW variants share: validation, the step loop and update tracking.

    A subclass sets `param_dtypes` (None accepts any floating dtype), creates its state in
    `_init_state` and updates one bucket of parameters (same device and dtype) in
    `_update_bucket`, which appends the intended updates Δθ (at least FP32) to
    `updates_out` when that is a list (only while `track_updates` is on). An FP16 second
    moment gets its power-of-two scale `exp_avg_sq_scale` here (see `adamw_moments_`).
    """

    param_dtypes: ClassVar[tuple[torch.dtype, ...] | None] = LOW_PRECISION_DTYPES
    # State key of the compensation that completes the parameter (θ + δθ), if any.
    compensation_key: ClassVar[str | None] = None
    # State key of a master copy that holds the parameter's real value, if any.
    master_key: ClassVar[str | None] = None
    # Most elements one `_update_bucket` call gets (whole tensors; a larger tensor alone), for
    # references whose FP32 working copies would otherwise span the whole model; None = no limit.
    bucket_numel: ClassVar[int | None] = None
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
        *,
        fused: FusedMode = "auto",
        **extra_defaults: Any,
    ):
        unknown = sorted(set(extra_defaults) - set(self.extra_options))
        if unknown:
            raise TypeError(f"{type(self).__name__} got unexpected argument(s) {unknown}")
        check_adamw_hyperparameters(type(self).__name__, lr, betas, eps, weight_decay)
        # Which implementation runs the step ("auto", "compiled", "foreach"; see
        # `kernels`). Not a group option: checkpoints stay the same whichever path wrote them.
        self.fused = check_fused_mode(type(self).__name__, fused)
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

    def held_value(self, param: torch.Tensor) -> torch.Tensor:
        """The master (`master_key`) or θ + its compensation (`compensation_key`), in FP64."""
        state = self.state[param] if param in self.state else {}
        master = _local(state.get(self.master_key))
        if master is not None:
            return _sharded_like(master.double(), param)
        value = _local(param).detach().double()
        compensation = _local(state.get(self.compensation_key))
        return _sharded_like(value if compensation is None else value.add_(compensation.double()), param)

    def full_precision_value(self, param: torch.Tensor) -> torch.Tensor:
        """θ + δθ summed in FP64 and rounded once to FP32, such that casting it back gives θ.

        θ is the round-to-nearest of θ + δθ (Fast2Sum/TwoSum return s = fl(a + b)), but the
        FP32 rounding can land exactly on a tie of the parameter's dtype; there the value is
        moved one FP32 ulp towards θ, so loading the checkpoint into a BF16 model restores θ
        bit for bit (and with δθ from the optimizer state, the run resumes exactly).
        """
        value = super().full_precision_value(param)
        if self.compensation_key is None or param.dtype == value.dtype:
            return value
        value, theta = _local(value), _local(param).detach()  # element-wise: per shard under FSDP2
        astray = value.to(param.dtype) != theta
        if bool(astray.any()):
            towards = torch.nextafter(value, theta.float())
            value = torch.where(astray, towards, value)
        return _sharded_like(value, param)

    def seed_compensation(self, param: torch.Tensor, residual: torch.Tensor) -> None:
        """Start the compensation of `param` at `residual`, so θ + δθ is a wider value.

        For a model converted from FP32: residual = r(θ₃₂ − r(θ₃₂)), and θ + δθ reproduces the
        FP32 weights to about 2p bits (16 for BF16) instead of p. Call before the first step.
        """
        if self.compensation_key is None:
            raise ValueError(f"{type(self).__name__} keeps no compensation to seed")
        if residual.shape != param.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != parameter shape {tuple(param.shape)}")
        group = next((g for g in self.param_groups if any(p is param for p in g["params"])), None)
        if group is None:
            raise ValueError("seed_compensation: the parameter is not one this optimizer updates")
        if not self.state[param]:
            self.state[param] = self.new_state(param, group)
        self.state[param][self.compensation_key].copy_(residual)

    def new_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """`_init_state` of `param`; for a DTensor (FSDP2), made from its local shard and
        wrapped back as DTensors sharded like it (see `_sharded_like`)."""
        state = self._init_state(_local(param), group)
        return {key: _sharded_like(value, param) for key, value in state.items()}

    def init_states(self) -> None:
        """Create the state of every parameter that has none (zeros, step 0), as the first
        step would: what a sharded checkpoint load (torch.distributed.checkpoint) fills in."""
        for group in self.param_groups:
            for param in group["params"]:
                if not self.state[param]:
                    self.state[param] = self.new_state(param, group)

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

    def _fused_update(
        self, group: dict[str, Any], params: Tensors, grads: Tensors, states: list[dict[str, Any]], steps: list[int]
    ) -> bool:
        """Run the bucket's step through the compiled kernel of `kernels`; False = not done,
        the reference `_update_bucket` runs. Tracked steps always take the reference, which
        also returns the intended updates."""
        return False

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
            for params in (chunk for bucket in buckets.values() for chunk in _chunks(bucket, self.bucket_numel)):
                states = []
                for param in params:
                    if not self.state[param]:
                        self.state[param] = self.new_state(param, group)
                    state = self.state[param]
                    if state["exp_avg_sq"].dtype == torch.float16 and "exp_avg_sq_scale" not in state:
                        # v is stored as v·s in FP16 (see `adamw_moments_`); s = 1 reads an
                        # unscaled v saved before scales existed correctly.
                        state["exp_avg_sq_scale"] = torch.ones((), device=param.device)
                    state["step"] += 1
                    states.append(state)
                # FSDP2: the update runs on the local shards (plain tensors) of parameters,
                # gradients and states; what it adds to a state's view goes back sharded.
                sharded, params = params, [_local(p) for p in params]
                grads = [_local(p.grad) for p in sharded]
                saved = [_local_state(s) for s in states]
                views = [dict(v) if v is not s else s for v, s in zip(saved, states)]
                steps = [s["step"] for s in states]
                if not self.track_updates and self._fused_update(group, params, grads, views, steps):
                    for state, view, before, param in zip(states, views, saved, sharded):
                        _store_local_state(state, view, before, param)
                    continue
                befores = [_local(self.held_value(p)) for p in sharded] if self.track_updates else None
                updates: Tensors | None = [] if self.track_updates else None
                self._update_bucket(
                    group,
                    params,
                    grads,
                    views,
                    steps,
                    updates,
                )
                for state, view, before, param in zip(states, views, saved, sharded):
                    _store_local_state(state, view, before, param)
                if befores is not None:
                    for param, before, update in zip(sharded, befores, updates):
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
    exp_avg_sq_scales: Tensors | None = None,
) -> None:
    """One Collage AdamW step over lists of tensors of one device and dtype, in place.

    Collage Algorithm 2 (ALGORITHMS.md §2), per element, with f(·) the exact conversion to
    FP32, r(·) round-to-nearest-even to the storage dtype (BF16 or FP16), and every
    operation in FP32 unless it is marked r:

        g = f(g)
        m₃₂ = f(m) + (1 − β1)·(g − f(m));                         m ← r(m₃₂)
        light: v₃₂ = min(β2·f(v) + ((1 − β2)·g)·g, max)
        plus:  v₃₂ = min(β2·(f(v) + f(δv)) + ((1 − β2)·g)·g, max)
        light: v ← r(v₃₂);   plus: v ← r(v₃₂), δv ← r(v₃₂ − f(v))   (v the new, rounded v)
        d = √v₃₂ + max(ε·√c2, 2^-126)
        Δθ₃₂ = −α·λ·f(θ) + (−α·√c2/c1)·m₃₂/d,    c1 = 1 − β1^t, c2 = 1 − β2^t (FP64 host)
        Δθ = r(Δθ₃₂)
        (θ, δθ) ← Grow((θ, δθ), Δθ) in storage-dtype arithmetic:
            s = θ ⊕ Δθ; b = s ⊖ θ; e = (θ ⊖ (s ⊖ b)) ⊕ (Δθ ⊖ b)      (TwoSum)
            t = δθ ⊕ e; u = s ⊕ t; δθ ← t ⊖ (u ⊖ s); θ ← u          (Fast2Sum)

    max is the storage dtype's largest finite value (see `adamw_moments_`); ⊕, ⊖ are
    storage-dtype operations (FP32 arithmetic rounded once, correctly rounded for BF16 and
    FP16). A fused kernel must reproduce exactly this sequence; `torch.compile` may only
    fuse, not drop the r(·) and ⊕ roundings.

    Args:
        exp_avg_sq_errors: δv, required for variant "plus", ignored for "light".
        steps: the step number t of each parameter after this step (1 on the first step).
        updates_out: if given, receives the intended updates Δθ₃₂ (FP32).
        exp_avg_sq_scales: for FP16 storage, the per-tensor power-of-two scales s of the
            stored v·s and δv·s, updated in place (see `adamw_moments_`); None for BF16.
    """
    if variant == "plus" and exp_avg_sq_errors is None:
        raise ValueError("collage_adamw: variant='plus' needs exp_avg_sq_errors (δv)")
    # The reference; `CollageAdamW._fused_update` runs `kernels.collage_kernel` instead.
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
        exp_avg_sq_scales=exp_avg_sq_scales,
    )


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
    exp_avg_sq_scales: Tensors | None,
) -> None:
    # m is a weighted average of g: its rounding errors stay relative and do not accumulate
    # the way lost additions to θ and v do (Collage §4.2), so it stays plain.
    exp_avgs32, exp_avg_sqs32 = adamw_moments_(
        exp_avgs, exp_avg_sqs, grads, beta1=beta1, beta2=beta2,
        exp_avg_sq_errors=exp_avg_sq_errors if variant == "plus" else None,
        exp_avg_sq_scales=exp_avg_sq_scales,
    )  # fmt: skip
    delta32 = adamw_delta(
        params, exp_avgs32, exp_avg_sqs32, steps,
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
    )  # fmt: skip
    if updates_out is not None:
        updates_out.extend(delta32)
    delta = _as_dtype(delta32, params[0].dtype)
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
        fused: "auto" (the compiled kernel of `kernels` where it can run, else the foreach
            reference), "compiled" (require it) or "foreach"; bit-identical results on CPU.

    State per parameter (all in the parameter's dtype): `exp_avg` m, `exp_avg_sq` v,
    `param_error` δθ, `exp_avg_sq_error` δv (plus only), and `step` (int).
    """

    extra_options: ClassVar[tuple[str, ...]] = ("variant",)
    compensation_key: ClassVar[str | None] = "param_error"
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
        *,
        fused: FusedMode = "auto",
    ):
        super().__init__(params, lr, betas, eps, weight_decay, fused=fused, variant=variant)

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
            exp_avg_sq_scales=second_moment_scales(states),
        )

    def _fused_update(self, group, params, grads, states, steps) -> bool:
        beta1, beta2 = group["betas"]
        plus = group["variant"] == "plus"
        if plus and any("exp_avg_sq_error" not in s for s in states):
            return False
        return compiled_collage_adamw(
            params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
            [s["param_error"] for s in states], [s["exp_avg_sq_error"] for s in states] if plus else None,
            steps, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
            weight_decay=group["weight_decay"], fused=self.fused,
        )  # fmt: skip
