"""AdamW baselines for low-precision parameters, to compare Collage against (ALGORITHMS.md §2).

| optimizer                  | states    | update applied as                  | bytes/param |
|----------------------------|-----------|------------------------------------|-------------|
| `PlainAdamW` (option A)    | param's   | θ ← fl(θ + Δθ)                     | 8 (BF16)    |
| `KahanAdamW`               | BF16      | Kahan-compensated θ + Δθ           | 10          |
| `StochasticRoundingAdamW`  | BF16      | θ ← SR(θ + Δθ), Δθ in FP32         | 8           |
| `FP32StatesAdamW` (D−MW)   | FP32      | θ ← fl(θ + Δθ), Δθ in FP32         | 12          |

All share `AdamWBase` (validation, bucketing, tracking) and `adamw_delta` with
`CollageAdamW`, so the four differ only in where they round.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from hf_lowprec.numerics import foreach_fast_two_sum_, stochastic_round

from .collage import AdamWBase, Tensors, adamw_delta, foreach_second_moment_

__all__ = ["FP32StatesAdamW", "KahanAdamW", "PlainAdamW", "StochasticRoundingAdamW"]

ParamsT = Iterable[torch.Tensor] | Iterable[dict[str, Any]]


def _zeros(param: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)


def _moments_(
    exp_avgs: Tensors, exp_avg_sqs: Tensors, grads: Tensors, beta1: float, beta2: float
) -> None:
    """m ← β1·m + (1 − β1)·g and v ← β2·v + (1 − β2)·g², in place, in the moments' dtype."""
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    foreach_second_moment_(exp_avg_sqs, grads, beta2)


def _delta(
    group: dict[str, Any], params: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors, steps: list[int]
) -> Tensors:
    beta1, beta2 = group["betas"]
    return adamw_delta(
        params, exp_avgs, exp_avg_sqs, steps,
        lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
    )  # fmt: skip


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
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        _moments_(exp_avgs, exp_avg_sqs, grads, *group["betas"])
        delta = _delta(group, params, exp_avgs, exp_avg_sqs, steps)
        if updates_out is not None:
            updates_out.extend(d.float() for d in delta)
        torch._foreach_add_(params, delta)


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

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        return {
            "step": 0,
            "exp_avg": _zeros(param),
            "exp_avg_sq": _zeros(param),
            "compensation": _zeros(param),
        }

    def _update_bucket(self, group, params, grads, states, steps, updates_out) -> None:
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        compensations = [s["compensation"] for s in states]
        _moments_(exp_avgs, exp_avg_sqs, grads, *group["betas"])
        delta = _delta(group, params, exp_avgs, exp_avg_sqs, steps)
        if updates_out is not None:
            updates_out.extend(d.float() for d in delta)
        torch._foreach_add_(compensations, delta)  # y = fl(Δθ + k)
        foreach_fast_two_sum_(params, compensations)  # θ ← fl(θ + y), k ← y − (θ' − θ)


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
    ):
        super().__init__(params, lr, betas, eps, weight_decay)
        self.seed = int(torch.randint(0, 2**62, ()).item()) if seed is None else seed
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[key]

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        return {"step": 0, "exp_avg": _zeros(param), "exp_avg_sq": _zeros(param)}

    def _update_bucket(self, group, params, grads, states, steps, updates_out) -> None:
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        exp_avgs32 = [m.float() for m in exp_avgs]
        exp_avg_sqs32 = [v.float() for v in exp_avg_sqs]
        _moments_(exp_avgs32, exp_avg_sqs32, [g.float() for g in grads], *group["betas"])
        torch._foreach_copy_(exp_avgs, exp_avgs32)
        torch._foreach_copy_(exp_avg_sqs, exp_avg_sqs32)
        params32 = [p.float() for p in params]
        delta = _delta(group, params32, exp_avgs32, exp_avg_sqs32, steps)
        if updates_out is not None:
            updates_out.extend(delta)
        torch._foreach_add_(params32, delta)
        generator = self._generator(params[0].device)
        for param, target in zip(params, params32):
            param.copy_(stochastic_round(target, param.dtype, generator))

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

    def _update_bucket(self, group, params, grads, states, steps, updates_out) -> None:
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        _moments_(exp_avgs, exp_avg_sqs, [g.float() for g in grads], *group["betas"])
        delta = _delta(group, [p.float() for p in params], exp_avgs, exp_avg_sqs, steps)
        if updates_out is not None:
            updates_out.extend(delta)
        # One rounding: the sum is formed in FP32 and cast back to the parameter's dtype.
        for param, update in zip(params, delta):
            param.add_(update)
