"""Update rules: how the AdamW update Δθ (FP32 registers) is applied to the stored parameter
(`Rule` and its subclasses, and the error-free transformations they use: `two_sum`,
`fast_two_sum`, run in the parameter's dtype on FP32 registers; docs/algorithms.md §2).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ..fp8.scaled import get_fp8_weight_copy, get_master_scale, pow2_scale
from .formats import Scaled, round_to, saturate

__all__ = [
    "Grow",
    "Kahan",
    "Master",
    "Nearest",
    "Rule",
    "ScaledMaster",
    "ScaledMasterFP8",
    "StochasticRounding",
    "normalized_residual",
    "uniform_bits",
]

F32 = torch.float32


def two_sum(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """TwoSum in `dtype` arithmetic on FP32 registers: s = fl(a + b), e = a + b − s exactly.

    s = fl(a + b); bb = fl(s − a); e = (b − bb) + (a − (s − bb)). Only the first two operations
    can round; the last four are exact in round to nearest (Knuth, TAOCP vol. 2 §4.2.2 Thm B).
    """
    s = round_to(a + b, dtype)
    bb = round_to(s - a, dtype)
    return s, (b - bb) + (a - (s - bb))


def fast_two_sum(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Fast2Sum in `dtype` arithmetic; needs |a| ≥ |b| or a = 0: s = fl(a + b), e = b + (a − s)."""
    s = round_to(a + b, dtype)
    return s, b + (a - s)


def normalized_residual(theta: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """δθ = `residual` in θ's dtype, such that θ is the nearest value of θ + δθ.

    r(w − r(w)) rounds up to exactly ulp(θ)/2 where w − θ lies just below it: where θ's last bit
    is odd, θ + δθ is then a tie that rounds to the even neighbour, so TwoSum and Fast2Sum moved
    θ one ulp on the first step, a zero update (lr = 0) included. There δθ moves one ulp of its
    own towards zero (an error ≤ 2^-p·|δθ|, as large as its rounding's), so that every zero update
    leaves the pair (θ, δθ) as it is; any other δθ is kept.
    """
    residual = residual.to(theta.dtype)
    inward = torch.nextafter(residual, torch.zeros_like(residual))
    keeps = [round_to(theta.float() + r.float(), theta.dtype) == theta.float() for r in (residual, inward)]
    return torch.where(keeps[0] | ~keeps[1], residual, inward)


def uniform_bits(shape: torch.Size, seed: torch.Tensor, device: torch.device) -> torch.Tensor:
    """32 uniform random bits per element (int64 in [0, 2^32)) from a hash of (seed, index).

    Two rounds of multiply-xorshift over index + seed·golden ratio, kept to 32 bits in int64
    arithmetic with every product below 2^63: no generator state and no buffer, so a compiled
    loop makes its bits in registers, and the eager reference makes the same ones.
    """
    mask = 0xFFFFFFFF
    numel = 1
    for size in shape:
        numel *= size
    x = (torch.arange(numel, device=device, dtype=torch.int64).view(shape) + seed * 0x9E3779B9) & mask
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & mask
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & mask
    return x ^ (x >> 16)


def _next_fp16(x: torch.Tensor, *, up: bool) -> torch.Tensor:
    """The FP16 value next to `x` towards +inf (`up`) or −inf, widened to FP32.

    From the bit pattern (sign and magnitude): away from zero is magnitude + 1, towards zero
    magnitude − 1, and from ±0 the smallest subnormal of the direction's sign. Integer
    arithmetic, so a compiled loop computes it exactly (`torch.nextafter` on FP16 is evaluated
    in FP32 there, which returns x itself).
    """
    bits = x.view(torch.int16).to(torch.int32) & 0xFFFF
    negative = bits >= 0x8000
    magnitude = bits & 0x7FFF
    away = negative != up  # moving up from a positive value, or down from a negative one
    moved = torch.where(away, bits + 1, bits - 1)
    from_zero = 0x0001 if up else 0x8001
    result = torch.where(magnitude == 0, from_zero, moved)
    return result.to(torch.int16).view(torch.float16).float()


@dataclasses.dataclass(frozen=True)
class Rule:
    """Base: no state; θ read from the parameter.

    A rule owns the state that completes the parameter (a compensation, a master copy) and four
    operations, pure functions of tensors like the formats' (`formats.Format`):

        read(param, *stored)                    θ in FP32 registers (the value the update starts from)
        choose(delta, theta, param, *stored)    what writing θ + Δθ decides first (a scale): as
                                                `Scaled.choose`, () for most rules
        apply_(delta, theta, param, *stored, chosen=...)   write θ + Δθ back, rounding as the rule says
        held_value(param, state)                the value the optimizer really holds, FP64
        restart_(param, state)                  continue from a parameter written outside the step
        seed_(stored, param, residual)          start the compensation (the master) at a residual
        zeros(param)                            its state for a fresh parameter

    Each operation that can round is rounded by `round_to`. The rules, their state, and how
    θ is written:

        Nearest              —               r(θ + Δθ), rounded once
        Kahan                k               y = r(Δθ + k); (θ, k) ← TwoSum(θ, y)
        Grow                 δθ              (θ, δθ) ← Grow((θ, δθ), r(Δθ)) (Collage, MCF)
        StochasticRounding   —               SR(θ + Δθ), unbiased
        Master               FP32 master     master ← master + Δθ; θ ← r(master)
        ScaledMaster         (scale attr.)   FP16 payload·s, s re-chosen from amax (FP8-LM)
        ScaledMasterFP8      (+ FP8 weight)  ScaledMaster, and the forward's E4M3 weight
    """

    suffixes = ()
    #: Per stored tensor: whether it has the parameter's elements (see `formats.Format.like_param`).
    like_param = ()
    #: State key of a compensation that completes the parameter (θ + δθ), if any.
    compensation_key: str | None = dataclasses.field(default=None, init=False)
    #: State key of a master copy holding the parameter's real value, if any.
    master_key: str | None = dataclasses.field(default=None, init=False)
    needs_seed = False
    #: The rule's tag in the native kernels (`optim.native.Declaration`), None: none there.
    native_name: ClassVar[str | None] = None

    def keys(self) -> tuple[str, ...]:
        return self.suffixes

    def native_options(self) -> dict[str, int]:
        """The native kernels' options of this rule."""
        return {}

    def stored_names(self) -> tuple[str, ...]:
        """The names of what `stored` returns, in order: the state keys, unless the rule reads
        a tensor kept elsewhere (`ScaledMaster`'s scale, on the parameter)."""
        return self.keys()

    def zeros(self, param: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return ()

    def stored(self, param: torch.Tensor, state: dict) -> tuple[torch.Tensor, ...]:
        return tuple(state[k] for k in self.keys())

    def read(self, param: torch.Tensor, *stored: torch.Tensor) -> torch.Tensor:
        return param.float()

    def choose(self, delta, theta, param, *stored) -> tuple[torch.Tensor, ...]:
        return ()

    def apply_(self, delta, theta, param, *stored, seed=None, chosen=()) -> None:
        raise NotImplementedError

    def restart_(self, param: torch.Tensor, state: dict) -> None:
        """Continue from `param` as written outside the step (a load, weight clipping, a re-init), as
        FP32 AdamW would: the compensation that completed the old value (δθ, Kahan's k) restarts at zero."""
        key = self.compensation_key
        if key is not None and key in state:
            state[key].zero_()

    def seed_(self, stored: torch.Tensor, param: torch.Tensor, residual: torch.Tensor) -> None:
        """Start the compensation `stored` at `residual`, θ the nearest value of θ + δθ (`normalized_residual`)."""
        stored.copy_(normalized_residual(param, residual))

    def held_value(self, param: torch.Tensor, state: dict) -> torch.Tensor:
        value = param.detach().double()
        key = self.compensation_key
        if key is not None and key in state:
            value = value.add_(state[key].double())
        return value


@dataclasses.dataclass(frozen=True)
class Nearest(Rule):
    """θ ← r(θ + Δθ): the sum formed in FP32 and rounded once (exact FP32 AdamW for FP32 θ)."""

    native_name = "nearest"

    def apply_(self, delta, theta, param, *stored, seed=None, chosen=()) -> None:
        param.copy_(theta + delta)


@dataclasses.dataclass(frozen=True)
class Kahan(Rule):
    """Kahan (1965): y = r(Δθ + k); (θ, k) ← TwoSum(θ, y).

    k holds what the parameter should still receive, so θ + k tracks the exact sum (the
    classic compensation with the opposite sign). TwoSum, not Fast2Sum: near-zero parameters
    have |y| > |θ|. A special case of Collage-light.
    """

    native_name = "kahan"

    suffixes = ("compensation",)
    like_param = (True,)
    compensation_key: str | None = dataclasses.field(default="compensation", init=False)

    def zeros(self, param: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (torch.zeros_like(param, memory_format=torch.preserve_format),)

    def apply_(self, delta, theta, param, compensation, seed=None, chosen=()) -> None:
        dtype = param.dtype
        y = round_to(compensation.float() + delta, dtype)
        new_theta, new_compensation = two_sum(theta, y, dtype)
        param.copy_(new_theta)
        compensation.copy_(new_compensation)


@dataclasses.dataclass(frozen=True)
class Grow(Rule):
    """Collage's MCF update: (θ, δθ) ← Grow((θ, δθ), r(Δθ)) = TwoSum, add, Fast2Sum.

    s, e = TwoSum(θ, r(Δθ)); t = r(δθ + e); (θ, δθ) ← Fast2Sum(s, t), every operation in the
    parameter's dtype. θ + δθ holds ~2p bits, so updates far below ulp(θ)/2 accumulate.
    """

    native_name = "grow"

    suffixes = ("param_error",)
    like_param = (True,)
    compensation_key: str | None = dataclasses.field(default="param_error", init=False)

    def zeros(self, param: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (torch.zeros_like(param, memory_format=torch.preserve_format),)

    def apply_(self, delta, theta, param, param_error, seed=None, chosen=()) -> None:
        dtype = param.dtype
        s, e = two_sum(theta, round_to(delta, dtype), dtype)
        new_theta, new_error = fast_two_sum(s, round_to(param_error.float() + e, dtype), dtype)
        param.copy_(new_theta)
        param_error.copy_(new_error)


@dataclasses.dataclass(frozen=True)
class StochasticRounding(Rule):
    """θ ← SR(θ + Δθ): up with probability (x − lo)/(hi − lo), so E[θ'] = θ + Δθ.

    BF16 shares FP32's exponent: adding 16 uniform bits below BF16's significand and
    truncating is exactly that rounding. FP16 picks between its two neighbours with a 24-bit
    uniform (probabilities resolved to 2^-24). The bits come from `uniform_bits` with one seed
    per parameter and step, drawn by the optimizer from its checkpointed generator: the
    reference and the compiled step make the same bits. ±inf, NaN and finite values beyond
    the dtype's largest round to nearest, as a plain cast does.
    """

    native_name = "stochastic_rounding"

    needs_seed = True

    def apply_(self, delta, theta, param, seed=None, chosen=()) -> None:
        dtype = param.dtype
        target = delta + theta
        bits = uniform_bits(target.shape, seed, target.device)
        if dtype == torch.bfloat16:
            summed = target.view(torch.int32) + (bits >> 16).to(torch.int32)
            # Truncation rounds toward zero in magnitude; with the sign-magnitude layout that
            # is the right direction for negative numbers too.
            rounded = (summed & -65536).view(F32)
        else:
            nearest = target.to(dtype)
            nearest32 = round_to(target, dtype)  # not nearest.float(): see `formats.round_to`
            below = torch.where(nearest32 > target, _next_fp16(nearest, up=False), nearest32)
            above = torch.where(nearest32 < target, _next_fp16(nearest, up=True), nearest32)
            gap = above - below
            probability_up = torch.where(gap > 0, (target - below) / gap, torch.zeros_like(target))
            uniform = (bits >> 8).to(F32) * (1.0 / (1 << 24))
            rounded = torch.where(uniform < probability_up, above, below)
        plain = ~torch.isfinite(target) | (target.abs() > torch.finfo(dtype).max)
        param.copy_(torch.where(plain, target, rounded))


@dataclasses.dataclass(frozen=True)
class Master(Rule):
    """Classic mixed precision: an FP32 master θ₃₂ takes the update; the weight is r(θ₃₂)."""

    native_name = "master"

    suffixes = ("master",)
    like_param = (True,)
    master_key: str | None = dataclasses.field(default="master", init=False)

    def zeros(self, param: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (param.detach().to(F32, copy=True),)

    def read(self, param: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        return master

    def apply_(self, delta, theta, param, master, seed=None, chosen=()) -> None:
        new = theta + delta
        master.copy_(new)
        param.copy_(new)

    def seed_(self, stored: torch.Tensor, param: torch.Tensor, residual: torch.Tensor) -> None:
        """Start the master (the FP32 parameter) at θ + `residual`."""
        stored.add_(residual)

    def restart_(self, param: torch.Tensor, state: dict) -> None:
        """The master restarts at the written parameter, as an FP32 weight would be the written one."""
        master = state.get("master")
        if master is not None and master.shape == param.shape:
            master.copy_(param)

    def held_value(self, param: torch.Tensor, state: dict) -> torch.Tensor:
        master = state.get("master")
        return param.detach().double() if master is None else master.double()


@dataclasses.dataclass(frozen=True)
class ScaledMaster(Rule):
    """FP8-LM O2's master: an FP16 payload with a per-tensor power-of-two scale (real = θ/s).

    The scale is the parameter's own (`fp8.scaled.get_master_scale`, set when the FP8 layer
    scaled its master); θ + Δθ is stored with a fresh scale from its amax, as `Scaled` does.
    """

    native_name = "scaled_master"

    margin: int = 0
    like_param = (False,)

    def stored(self, param: torch.Tensor, state: dict) -> tuple[torch.Tensor, ...]:
        return (get_master_scale(param),)

    def stored_names(self) -> tuple[str, ...]:
        return ("master_scale",)

    def native_options(self) -> dict[str, int]:
        return {"master_scale_margin": self.margin}

    def read(self, param: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return param.float() * (1.0 / scale)

    def choose(self, delta, theta, param, scale) -> tuple[torch.Tensor, ...]:
        return self._format(param).choose(theta + delta, param, scale)

    def apply_(self, delta, theta, param, scale, seed=None, chosen=()) -> None:
        self._format(param).store_(theta + delta, chosen or self.choose(delta, theta, param, scale), param, scale)

    def _format(self, param: torch.Tensor) -> Scaled:
        # Keywords: dynamo in torch 2.11 cannot bind a frozen dataclass built positionally in a graph.
        return Scaled(dtype=param.dtype, margin=self.margin)

    def held_value(self, param: torch.Tensor, state: dict) -> torch.Tensor:
        scale = get_master_scale(param)
        if scale is None:
            return param.detach().double()
        return param.detach().double() / scale.double()


@dataclasses.dataclass(frozen=True)
class ScaledMasterFP8(ScaledMaster):
    """ScaledMaster that also writes the E4M3 weight the FP8 layer's next forward would cast
    from the stored master, in the same loop as the master, where the layer linked one
    (`fp8.scaled.FP8WeightCopy`; rows without one pass None and write the master only).

    The layer's cast takes s_w from amax|P| of the FP16 payload P. Rounding is monotone, so
    amax|P| = r16(amax|θ + Δθ|·s_m), known from the reduction that chose s_m: the FP8 weight
    needs no pass of its own, and it has the cast's bits (`fp8.fused.tensorwise_cast`) for a
    finite master (a non-finite one gives a NaN payload either way, its sign bit may differ).
    `weight_margin` is the layer's margin. No native kernel: the rule of a GPU's compiled step.
    """

    native_name = None

    weight_margin: int = 0
    like_param = (False, True, False)

    def stored(self, param: torch.Tensor, state: dict) -> tuple[torch.Tensor | None, ...]:
        copy = get_fp8_weight_copy(param)
        return (get_master_scale(param), *((None, None) if copy is None else (copy.payload, copy.scale)))

    def stored_names(self) -> tuple[str, ...]:
        return ("master_scale", "fp8_weight", "fp8_weight_scale")

    def read(self, param: torch.Tensor, scale: torch.Tensor, *fp8: torch.Tensor | None) -> torch.Tensor:
        return super().read(param, scale)

    def choose(self, delta, theta, param, scale, w8=None, w8_scale=None) -> tuple[torch.Tensor, ...]:
        values = theta + delta
        chosen = self._format(param).choose(values, param, scale)
        return chosen if w8 is None else (*chosen, values.abs().amax())

    def apply_(self, delta, theta, param, scale, w8=None, w8_scale=None, seed=None, chosen=()) -> None:
        new_scale, *amax = chosen or self.choose(delta, theta, param, scale, w8)
        master = self._format(param).scaled(theta + delta, (new_scale,), param, scale)
        param.copy_(master)
        if w8 is None:
            return
        # The layer's cast, from the payload as stored: amax|P| / s_m is the real amax.
        real_amax = round_to(saturate(amax[0] * new_scale, param.dtype), param.dtype) / new_scale
        w8_scale_new = pow2_scale(real_amax, w8.dtype, self.weight_margin)
        factor = (w8_scale_new + (real_amax - real_amax)) / new_scale
        w8.copy_((round_to(master, param.dtype) * factor).to(w8.dtype))
        w8_scale.copy_(w8_scale_new)
