"""The AdamW baselines: PlainAdamW, KahanAdamW, StochasticRoundingAdamW, FP32StatesAdamW."""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest
import torch

from hf_lowprec.metrics import imprecision_percentage
from hf_lowprec.optim import (
    CollageAdamW,
    FP32StatesAdamW,
    KahanAdamW,
    MasterWeightAdamW,
    PlainAdamW,
    StochasticRoundingAdamW,
)
from tests.helpers import bits_equal, snapshot

Factory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]

FACTORIES: dict[str, Factory] = {
    "plain": lambda ps: PlainAdamW(ps, lr=1e-3, weight_decay=0.01),
    "kahan": lambda ps: KahanAdamW(ps, lr=1e-3, weight_decay=0.01),
    "stochastic-rounding": lambda ps: StochasticRoundingAdamW(ps, lr=1e-3, weight_decay=0.01, seed=7),
    "fp32-states": lambda ps: FP32StatesAdamW(ps, lr=1e-3, weight_decay=0.01),
}
STATE_DTYPES = {
    "plain": torch.bfloat16,
    "kahan": torch.bfloat16,
    "stochastic-rounding": torch.bfloat16,
    "fp32-states": torch.float32,
}


def make_problem(steps: int, seed: int = 0) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    generator = torch.Generator().manual_seed(seed)
    theta0 = [torch.randn(s, generator=generator).bfloat16() for s in ((16, 8), (33,))]
    grads = [[torch.randn(t.shape, generator=generator).bfloat16() for t in theta0] for _ in range(steps)]
    return theta0, grads


def step_all(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optimizer.step()


def test_plain_adamw_matches_torch_adamw_in_fp32() -> None:
    generator = torch.Generator().manual_seed(0)
    shapes = ((64, 32), (32,), (8, 4, 4))
    ours = [torch.randn(s, generator=generator, requires_grad=True) for s in shapes]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    optimizers = (PlainAdamW(ours, **hyper), torch.optim.AdamW(theirs, foreach=True, **hyper))
    for _ in range(20):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad = a.grad.clone()
        for optimizer in optimizers:
            optimizer.step()
    # Same maths, different FP32 rounding order (ε·√c2 folded in, decay inside Δθ): the
    # trajectories agree to a few FP32 ulps.
    for a, b in zip(ours, theirs):
        relative = ((a - b).norm() / b.norm()).item()
        assert relative < 1e-6, relative
    # The moments: torch's lerp / addcmul fuse a multiply-add, ours round (1 − β1)·(g − m) and
    # ((1 − β2)·g)·g on their own: at most two extra FP32 roundings per step, each below
    # 2^-24 of a term ≤ 1 in magnitude here (|1 − β1|·|g − m| ≤ 0.1·10), and β ≤ 1 does not
    # amplify old errors, so after 20 steps |Δ| ≤ 20·2·2^-24 ≈ 2.4e-6 absolute.
    for a, b in zip(ours, theirs):
        for key in ("exp_avg", "exp_avg_sq"):
            ours_state, theirs_state = optimizers[0].state[a][key], optimizers[1].state[b][key]
            torch.testing.assert_close(ours_state, theirs_state, rtol=1e-6, atol=20 * 2 * 2**-24)


@pytest.mark.parametrize(
    "factory", [PlainAdamW, lambda ps, **kw: CollageAdamW(ps, variant="light", **kw)], ids=["plain", "light"]
)
def test_beta2_is_applied_exactly_in_bf16(factory: Callable[..., torch.optim.Optimizer]) -> None:
    # Regression: in-place `_foreach_mul_` rounds a Python scalar to BF16 on CPU, which
    # would run β2 = 0.95 as 0.94921875. After a step with g = 0, v must be fl(0.95·v).
    param = torch.zeros(4096, dtype=torch.bfloat16, requires_grad=True)
    optimizer = factory([param], betas=(0.9, 0.95))
    param.grad = torch.randn(4096).bfloat16()
    optimizer.step()
    before = optimizer.state[param]["exp_avg_sq"].clone()
    param.grad = torch.zeros_like(param)
    optimizer.step()
    expected = (before.float() * 0.95).bfloat16()
    assert bits_equal(optimizer.state[param]["exp_avg_sq"], expected)


@pytest.mark.parametrize("name", list(FACTORIES))
@pytest.mark.parametrize("through_bytes", [False, True])
def test_state_dict_round_trip_continues_bit_for_bit(name: str, through_bytes: bool) -> None:
    theta0, grads = make_problem(steps=10)
    params = [t.clone().requires_grad_() for t in theta0]
    optimizer = FACTORIES[name](params)
    step_all(optimizer, params, grads[:4])
    state_dict = optimizer.state_dict()
    if through_bytes:
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        buffer.seek(0)
        state_dict = torch.load(buffer, weights_only=True)
    resumed_params = [p.detach().clone().requires_grad_() for p in params]
    # A different seed: the resumed stream must come from the state dict, not the constructor.
    resumed = FACTORIES[name](resumed_params)
    if isinstance(resumed, StochasticRoundingAdamW):
        resumed.seed = 12345
    resumed.load_state_dict(state_dict)
    for p in resumed_params:
        for key in ("exp_avg", "exp_avg_sq"):
            assert resumed.state[p][key].dtype == STATE_DTYPES[name]
    step_all(optimizer, params, grads[4:])
    step_all(resumed, resumed_params, grads[4:])
    for a, b in zip(snapshot(optimizer, params), snapshot(resumed, resumed_params)):
        assert a.dtype == b.dtype and bits_equal(a, b)


def test_stochastic_rounding_needs_the_saved_generator() -> None:
    theta0, grads = make_problem(steps=6)
    params = [t.clone().requires_grad_() for t in theta0]
    optimizer = StochasticRoundingAdamW(params, lr=1e-2, seed=1, weight_decay=0.0)
    step_all(optimizer, params, grads[:3])
    state_dict = optimizer.state_dict()
    assert state_dict["generator_states"]["cpu"].dtype == torch.uint8
    without_rng = {k: v for k, v in state_dict.items() if k != "generator_states"}
    resumed_params = [p.detach().clone().requires_grad_() for p in params]
    resumed = StochasticRoundingAdamW(resumed_params, lr=1e-2, seed=1, weight_decay=0.0)
    resumed.load_state_dict(without_rng)
    step_all(optimizer, params, grads[3:])
    step_all(resumed, resumed_params, grads[3:])
    # Restarting the stream from the seed repeats the first steps' noise: a different run.
    assert not all(bits_equal(a, b) for a, b in zip(params, resumed_params))


def test_stochastic_rounding_moves_bf16_parameters_on_average() -> None:
    # Constant gradient: Adam's Δθ = −lr every step. lr = 1e-4 is 1/40 of ulp(θ)/2 at
    # θ ∈ [1, 2): plain BF16 never moves, SR moves by −100·lr in expectation.
    theta0 = torch.ones(1 << 14, dtype=torch.bfloat16) * 1.5
    results = {}
    for name, cls, kwargs in (("plain", PlainAdamW, {}), ("sr", StochasticRoundingAdamW, {"seed": 0})):
        param = theta0.clone().requires_grad_()
        optimizer = cls([param], lr=1e-4, **kwargs)
        for _ in range(100):
            param.grad = torch.ones_like(param)
            optimizer.step()
        results[name] = (param.detach().double() - 1.5).mean().item()
    assert results["plain"] == 0.0
    # Per element the SR noise after 100 steps has a std below ulp/2·√100 = 0.039; the mean
    # of 16384 elements is within 5σ = 0.0016 of −0.01.
    assert results["sr"] == pytest.approx(-0.01, abs=1.6e-3)


def test_kahan_compensation_keeps_what_the_parameter_loses() -> None:
    param = torch.full((4096,), 1.5, dtype=torch.bfloat16, requires_grad=True)
    optimizer = KahanAdamW([param], lr=1e-4, weight_decay=0.0)
    for _ in range(100):
        param.grad = torch.ones_like(param)
        optimizer.step()
    total = param.detach().double() + optimizer.state[param]["compensation"].double()
    # Each step rounds y = Δθ + k (|k| ≤ ulp(θ)/2 = 2^-8) by ≤ 2^-17, 100 steps ≤ 7.7e-4.
    assert torch.allclose(total, torch.full_like(total, 1.5 - 0.01), atol=8e-4, rtol=0)
    assert param.detach().double().mean().item() != 1.5  # the carried part reached θ


@pytest.mark.parametrize("name", list(FACTORIES))
def test_tracking_does_not_change_the_trajectory(name: str) -> None:
    theta0, grads = make_problem(steps=5)
    runs = []
    for track in (False, True):
        params = [t.clone().requires_grad_() for t in theta0]
        optimizer = FACTORIES[name](params)
        optimizer.track_updates = track
        step_all(optimizer, params, grads)
        runs.append(snapshot(optimizer, params))
        if track:
            assert len(optimizer.tracked) == 5 * len(params)
            assert all(r.update.dtype == torch.float32 for r in optimizer.tracked)
    for a, b in zip(*runs):
        assert bits_equal(a, b)


def test_plain_bf16_loses_tiny_updates_fp32_does_not() -> None:
    generator = torch.Generator().manual_seed(0)
    theta0 = 1.0 + torch.rand(4096, generator=generator)
    for dtype, expected in ((torch.bfloat16, 100.0), (torch.float32, 0.0)):
        param = theta0.to(dtype).requires_grad_()
        optimizer = PlainAdamW([param], lr=1e-4, weight_decay=0.0)
        optimizer.track_updates = True
        param.grad = torch.randn(4096, generator=generator).to(dtype)
        optimizer.step()
        record = optimizer.tracked[-1]
        assert imprecision_percentage(record.before, record.param, record.update) == expected


@pytest.mark.parametrize("cls", [KahanAdamW, StochasticRoundingAdamW, FP32StatesAdamW])
def test_low_precision_baselines_reject_fp64_parameters(cls: type) -> None:
    """FP32 parameters (those a model keeps in FP32) step as plain AdamW: tests/optim/test_kept_fp32.py."""
    message = f"{cls.__name__} needs torch.bfloat16 or torch.float16 or torch.float32.*got torch.float64"
    with pytest.raises(ValueError, match=message):
        cls([torch.zeros(3, dtype=torch.float64, requires_grad=True)])


@pytest.mark.parametrize("cls", [KahanAdamW, StochasticRoundingAdamW, FP32StatesAdamW, MasterWeightAdamW, CollageAdamW])
def test_a_16_bit_family_refuses_a_model_with_no_16_bit_parameter(cls: type) -> None:
    """An FP32 parameter steps as plain AdamW beside 16-bit ones; an all-FP32 model is one not cast
    (it would train as plain AdamW, the family's arithmetic never used): refused, naming the fix."""
    fp32 = [torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)]
    with pytest.raises(
        ValueError, match=f"{cls.__name__} steps BF16 or FP16.*every parameter here is FP32.*cast_model"
    ):
        cls(fp32)
    cls([*fp32, torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)])  # beside a 16-bit one: taken


@pytest.mark.parametrize("cls", [PlainAdamW, KahanAdamW, StochasticRoundingAdamW, FP32StatesAdamW])
def test_bad_hyperparameters_raise(cls: type) -> None:
    param = [torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)]
    with pytest.raises(ValueError, match="lr=-1"):
        cls(param, lr=-1.0)
    with pytest.raises(ValueError, match=r"betas=\(0.9, 1.5\)"):
        cls(param, betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="eps=-1"):
        cls(param, eps=-1.0)


def test_plain_adamw_accepts_any_float_dtype() -> None:
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        param = torch.ones(3, dtype=dtype, requires_grad=True)
        optimizer = PlainAdamW([param], lr=0.1, weight_decay=0.0)
        param.grad = torch.ones_like(param)
        optimizer.step()
        assert param.dtype == dtype and bool((param < 1).all())
        assert optimizer.state[param]["exp_avg_sq"].dtype == dtype
