"""AdamW baselines for low-precision parameters, to compare Collage against (ALGORITHMS.md §2).

| optimizer                  | states    | update applied as                  | bytes/param |
|----------------------------|-----------|------------------------------------|-------------|
| `PlainAdamW` (option A)    | param's   | θ ← fl(θ + Δθ)                     | 8 (BF16)    |
| `KahanAdamW`               | BF16      | Kahan-compensated θ + Δθ           | 10          |
| `StochasticRoundingAdamW`  | BF16      | θ ← SR(θ + Δθ), Δθ in FP32         | 8           |
| `FP32StatesAdamW` (D−MW)   | FP32      | θ ← fl(θ + Δθ), Δθ in FP32         | 12          |

All share `AdamWBase` (validation, bucketing, tracking), `adamw_moments_` and `adamw_delta`
with `CollageAdamW`: the moments and Δθ are computed in FP32 registers and each stored
value is rounded once, so the four differ only in where they round the update into θ.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from hf_lowprec.numerics import foreach_two_sum_, stochastic_round

from .collage import AdamWBase, Tensors, adamw_delta, adamw_moments_, second_moment_scales
from .kernels import FusedMode, compiled_adamw, compiled_kahan_adamw, compiled_stochastic_rounding_adamw

__all__ = ["FP32StatesAdamW", "KahanAdamW", "PlainAdamW", "StochasticRoundingAdamW"]

ParamsT = Iterable[torch.Tensor] | Iterable[dict[str, Any]]


def _zeros(param: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)


def _moments_and_delta(
    group: dict[str, Any], params: Tensors, states: list[dict[str, Any]], grads: Tensors, steps: list[int]
) -> Tensors:
    """Update the stored moments (FP32 registers, one rounding each) and return Δθ in FP32."""
    beta1, beta2 = group["betas"]
    exp_avgs32, exp_avg_sqs32 = adamw_moments_(
        [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], grads,
        beta1=beta1, beta2=beta2, exp_avg_sq_scales=second_moment_scales(states),
    )  # fmt: skip
    return adamw_delta(
        params, exp_avgs32, exp_avg_sqs32, steps,
        lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
    )  # fmt: skip


def _moments(states: list[dict[str, Any]]) -> tuple[Tensors, Tensors]:
    return [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]


def _hyper(group: dict[str, Any], fused: str) -> dict[str, Any]:
    """The keyword arguments of the `kernels.compiled_*` steps for one group."""
    beta1, beta2 = group["betas"]
    return dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], fused=fused)


def _add_rounded_once_(params: Tensors, delta: Tensors) -> None:
    """θ ← r(θ + Δθ): the sum is formed in Δθ's (wider) dtype and rounded once."""
    for param, update in zip(params, delta):
        param.add_(update)


class PlainAdamW(AdamWBase):
    """AdamW computed and stored entirely in the parameter's dtype.

    For BF16 parameters this is option A (pure BF16, updates below ulp(θ)/2 are lost); for
    FP32 parameters it is ordinary AdamW, equal to `torch.optim.AdamW` up to rounding. It
    exists so that the `fp32`, `bf16-mixed` and `bf16-pure` strategies share the tracking
    of lost arithmetic with the low-precision optimizers.

    State: `exp_avg`, `exp_avg_sq` (parameter's dtype), `step` (int).
    """

    state_roles: ClassVar[dict[str, str]] = {"exp_avg": "optimizer", "exp_avg_sq": "optimizer"}
    param_dtypes: ClassVar[tuple[torch.dtype, ...] | None] = None

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        return {"step": 0, "exp_avg": _zeros(param), "exp_avg_sq": _zeros(param)}

    def _update_bucket(self, group, params, grads, states, steps, updates_out) -> None:
        delta = _moments_and_delta(group, params, states, grads, steps)
        if updates_out is not None:
            updates_out.extend(delta)
        _add_rounded_once_(params, delta)

    def _fused_update(self, group, params, grads, states, steps) -> bool:
        return compiled_adamw(params, grads, *_moments(states), steps, **_hyper(group, self.fused))


class KahanAdamW(AdamWBase):
    """BF16/FP16 AdamW whose update is added with Kahan compensated summation.

    Kahan (1965): y = Δθ + k; θ' = fl(θ + y); k ← y − (θ' − θ). The compensation k holds
    what the parameter should still receive, so θ + k tracks the exact sum; it is the
    classic compensation c with the opposite sign, which makes the update one Fast2Sum
    of (θ, Δθ + k). A special case of Collage-light (ALGORITHMS.md §2). 10 bytes/param.

    State (parameter's dtype): `exp_avg`, `exp_avg_sq`, `compensation` k; `step` (int).
    """

    state_roles: ClassVar[dict[str, str]] = {
        "exp_avg": "optimizer",
        "exp_avg_sq": "optimizer",
        "compensation": "extra",
    }
    compensation_key: ClassVar[str | None] = "compensation"

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        return {
            "step": 0,
            "exp_avg": _zeros(param),
            "exp_avg_sq": _zeros(param),
            "compensation": _zeros(param),
        }

    def _update_bucket(self, group, params, grads, states, steps, updates_out) -> None:
        compensations = [s["compensation"] for s in states]
        delta = _moments_and_delta(group, params, states, grads, steps)
        if updates_out is not None:
            updates_out.extend(delta)
        _add_rounded_once_(compensations, delta)  # y = r(Δθ₃₂ + k)
        # TwoSum, not Fast2Sum: near-zero parameters have |y| > |θ| (ALGORITHMS.md §2).
        foreach_two_sum_(params, compensations)  # θ ← fl(θ + y), k ← θ + y − θ'

    def _fused_update(self, group, params, grads, states, steps) -> bool:
        compensations = [s["compensation"] for s in states]
        return compiled_kahan_adamw(params, compensations, grads, *_moments(states), steps, **_hyper(group, self.fused))


class StochasticRoundingAdamW(AdamWBase):
    """BF16/FP16 AdamW computing in FP32 and writing θ back with stochastic rounding.

    m and v are stored in the parameter's dtype (rounded to nearest after an FP32 update);
    Δθ is computed in FP32 and θ ← SR(θ + Δθ) (ALGORITHMS.md §5), which is unbiased, so
    updates below ulp(θ)/2 survive on average. 8 bytes/param.

    The random stream is a `torch.Generator` per device seeded with `seed` (drawn from the
    global RNG when None); its state travels in `state_dict()["generator_states"]`, so a
    resumed run continues bit for bit.

    State (parameter's dtype): `exp_avg`, `exp_avg_sq`; `step` (int).
    """

    state_roles: ClassVar[dict[str, str]] = {"exp_avg": "optimizer", "exp_avg_sq": "optimizer"}

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        seed: int | None = None,
        *,
        fused: FusedMode = "auto",
    ):
        super().__init__(params, lr, betas, eps, weight_decay, fused=fused)
        self.seed = int(torch.randint(0, 2**62, ()).item()) if seed is None else seed
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[key]

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        return {"step": 0, "exp_avg": _zeros(param), "exp_avg_sq": _zeros(param)}

    def init_states(self) -> None:
        """Also create the generators, so a sharded checkpoint load has their state to fill in."""
        super().init_states()
        for group in self.param_groups:
            for param in group["params"]:
                if param.device.type != "meta":  # a model of shapes only has no random stream
                    self._generator(param.device)

    def _update_bucket(self, group, params, grads, states, steps, updates_out) -> None:
        if updates_out is not None and self.fused != "foreach":
            # A tracked step keeps the compiled path's random stream, so turning the metrics on
            # does not change the trajectory; Δθ comes from the reference run on copies.
            copies = [{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for s in states]
            delta = _moments_and_delta(group, params, copies, grads, steps)
            if self._fused_update(group, params, grads, states, steps):
                updates_out.extend(delta)
                return
        delta = _moments_and_delta(group, params, states, grads, steps)
        if updates_out is not None:
            updates_out.extend(d.clone() for d in delta)
        params32 = delta
        torch._foreach_add_(params32, [p.float() for p in params])
        generator = self._generator(params[0].device)
        for param, target in zip(params, params32):
            param.copy_(stochastic_round(target, param.dtype, generator))

    def _fused_update(self, group, params, grads, states, steps) -> bool:
        # A different random stream from the reference (per-parameter seeds drawn from the same
        # checkpointed generator), the same distribution.
        generator = self._generator(params[0].device)
        return compiled_stochastic_rounding_adamw(params, grads, *_moments(states), steps, generator, **_hyper(group, self.fused))

    def state_dict(self) -> dict[str, Any]:
        state_dict = super().state_dict()
        state_dict["generator_states"] = {key: g.get_state() for key, g in self._generators.items()}
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        generator_states = state_dict.pop("generator_states", {})
        super().load_state_dict(state_dict)
        self._generators = {}
        for key, rng_state in generator_states.items():
            generator = torch.Generator(device=key)
            generator.set_state(rng_state.to(device="cpu", dtype=torch.uint8))
            self._generators[key] = generator


class FP32StatesAdamW(AdamWBase):
    """Option D−MW: BF16/FP16 parameters, FP32 moments, no master weights.

    m, v and Δθ are FP32; θ ← fl(θ + Δθ) rounds once to the parameter's dtype, so small
    updates are still lost at the parameter (Collage Tables 3–6: worse than Collage-plus
    at the same 12 bytes/param).

    State: `exp_avg`, `exp_avg_sq` (FP32); `step` (int).
    """

    state_roles: ClassVar[dict[str, str]] = {"exp_avg": "optimizer", "exp_avg_sq": "optimizer"}

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        fp32 = torch.float32
        return {"step": 0, "exp_avg": _zeros(param, fp32), "exp_avg_sq": _zeros(param, fp32)}

    def _fused_update(self, group, params, grads, states, steps) -> bool:
        return compiled_adamw(params, grads, *_moments(states), steps, **_hyper(group, self.fused))

    def _update_bucket(self, group, params, grads, states, steps, updates_out) -> None:
        delta = _moments_and_delta(group, params, states, grads, steps)
        if updates_out is not None:
            updates_out.extend(delta)
        _add_rounded_once_(params, delta)
