"""Regressions for the AdamW variants' rounding (issue 8 #4, #6, #10), against FP64 references."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from hf_lowprec.optim import CollageAdamW, KahanAdamW, PlainAdamW
from tests.helpers import bits_equal

Factory = Callable[..., torch.optim.Optimizer]

VARIANTS: dict[str, Factory] = {
    "plain": PlainAdamW,
    "kahan": KahanAdamW,
    "light": lambda ps, **kw: CollageAdamW(ps, variant="light", **kw),
    "plus": lambda ps, **kw: CollageAdamW(ps, variant="plus", **kw),
}


def held(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> torch.Tensor:
    """θ + δθ (Collage), θ + k (Kahan) or θ (plain), in FP64."""
    state = optimizer.state[param]
    extra = state.get("param_error", state.get("compensation"))
    return param.detach().double() + (0.0 if extra is None else extra.double())


def fp64_adamw(theta: float, grad: float, steps: int, lr: float, beta1=0.9, beta2=0.999, eps=1e-8) -> float:
    m = v = 0.0
    for t in range(1, steps + 1):
        m = beta1 * m + (1 - beta1) * grad
        v = beta2 * v + (1 - beta2) * grad * grad
        theta -= lr * (m / (1 - beta1**t)) / ((v / (1 - beta2**t)) ** 0.5 + eps)
    return theta


@pytest.mark.parametrize("name", list(VARIANTS))
def test_fp16_second_moment_does_not_underflow(name: str) -> None:
    # (1 − β2)·g² = 1e-9 for |g| = 1e-3 is below FP16's smallest subnormal 2^-24 ≈ 6e-8.
    # Before the fix v stayed 0 and the ε floor made every step huge: −2.5 after 3 steps.
    g = torch.tensor(1e-3, dtype=torch.float16).item()  # the FP16 gradient, exactly
    param = torch.full((8,), 0.5, dtype=torch.float16, requires_grad=True)
    optimizer = VARIANTS[name]([param], lr=1e-3, weight_decay=0.0)
    for steps in (3, 300):
        while optimizer.state.get(param, {}).get("step", 0) < steps:
            param.grad = torch.full_like(param, g)
            optimizer.step()
        reference = fp64_adamw(0.5, g, steps, lr=1e-3)
        value = held(optimizer, param)
        state = optimizer.state[param]
        assert all(bool(torch.isfinite(v).all()) for v in state.values() if torch.is_tensor(v))
        assert bool((state["exp_avg_sq"] > 0).all())
        if steps == 3:
            # m and v are stored with 11-bit significands (unit roundoff 2^-11 each, so
            # m̂/√v̂ is within ~1.5·2^-11 of exact) and Δθ is rounded to FP16 (2^-11):
            # ≤ 3·2^-11 = 1.5e-3 of the 3e-3 moved = 4.4e-6, bound 6e-6. Plain FP16 also rounds θ each step:
            # 3·ulp(0.497)/2 = 3·2^-13 = 3.7e-4.
            bound = 6e-6 + (3 * 2.0**-13 if name == "plain" else 0.0)
            assert bool(((value - reference).abs() <= bound).all()), (value - reference).abs().max()
        else:
            # The plain-FP16 first moment stalls within about 5 ulps of g once |g − m|·(1 − β1)
            # falls below ulp(m)/2, i.e. ≤ 5·2^-11 = 0.25 % of the movement, plus FP16 θ
            # rounding for plain (300·ulp(0.25)/2 = 0.018 at most; measured 0.007). Before the fix
            # θ ran to −2.8.
            moved = 0.5 - reference
            bound = 0.01 * moved + (300 * 2.0**-13 if name == "plain" else 0.0)
            assert bool(((value - reference).abs() <= bound).all()), (value - reference).abs().max()


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_update_is_computed_in_fp32_and_rounded_once(name: str, weight_decay: float) -> None:
    # After one step from m = v = 0, Δθ = −α·(g/(|g| + ε) + λθ) exactly (FP64 below). The
    # intended update the optimizer reports is FP32 arithmetic (a few ulps: ≤ 1e-6 relative,
    # or absolute 1e-6·α·λ·|θ|); before the fix the weight_decay = 0 branch rounded Δθ to
    # BF16 twice (99.9th-percentile relative error 0.29). Plain BF16 then rounds θ + Δθ once:
    # within ulp(θ')/2 of the exact sum, up to the FP32 error of Δθ.
    generator = torch.Generator().manual_seed(0)
    theta = (torch.randn(100_000, generator=generator) * 1e-2).bfloat16()
    grad = torch.randn(100_000, generator=generator).bfloat16()
    lr = 1e-2
    param = theta.clone().requires_grad_()
    optimizer = VARIANTS[name]([param], lr=lr, weight_decay=weight_decay)
    optimizer.track_updates = True
    param.grad = grad.clone()
    optimizer.step()
    g = grad.double()
    exact = -lr * (g / (g.abs() + 1e-8) + weight_decay * theta.double())
    intended = optimizer.tracked[-1].update.double()
    scale = exact.abs() + lr * weight_decay * theta.double().abs()
    assert bool(((intended - exact).abs() <= 1e-6 * scale).all())
    if name == "plain":
        after = param.detach().double()
        target = theta.double() + exact
        ulp = torch.nextafter(param.detach(), torch.full_like(param, float("inf"))).double() - after
        ulp = torch.maximum(
            ulp, after - torch.nextafter(param.detach(), torch.full_like(param, -float("inf"))).double()
        )
        assert bool(((after - target).abs() <= ulp / 2 + 1e-6 * scale).all())
    else:
        # The held value θ + δθ (θ + k) keeps Δθ rounded to BF16 once (unit roundoff 2^-8).
        moved = held(optimizer, param) - theta.double()
        assert bool(((moved - exact).abs() <= 2.0**-8 * exact.abs() + 1e-6 * scale).all())


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize(("dtype", "huge"), [(torch.bfloat16, 1e30), (torch.float16, 65504.0)])
def test_finite_gradients_never_make_non_finite_state(name: str, dtype: torch.dtype, huge: float) -> None:
    # (1 − β2)·g² overflows: BF16 g = 1e30 → g² = 1e60 > FP32 max; FP16 g = 65504 →
    # 0.001·g² = 4.3e6 > FP16 max. Before the fix collage-plus formed inf − inf (NaN θ, v, δv)
    # and FP16 stored v = inf. The second moment saturates (BF16) or is rescaled (FP16).
    param = torch.linspace(-1.0, 1.0, 64).to(dtype).requires_grad_()
    optimizer = VARIANTS[name]([param], lr=1e-3, weight_decay=0.01)
    for scale in (huge, 1.0, -huge, 1e-3):
        param.grad = torch.full_like(param, scale)
        param.grad[::2] = 0.5
        optimizer.step()
        assert bool(torch.isfinite(param).all())
        for key, value in optimizer.state[param].items():
            if torch.is_tensor(value):
                assert bool(torch.isfinite(value).all()), key


@pytest.mark.parametrize("name", ["kahan", "light", "plus"])
def test_near_zero_parameters_keep_the_rounding_error(name: str) -> None:
    # Fast2Sum(θ, Δθ) needs |θ| ≥ |Δθ|; near zero it fails: θ = 0.000866, Δθ = 0.001007
    # (both BF16) gave (0.0018768, 0) with the sum's error lost (1 ulp). TwoSum keeps it:
    # after one step θ + δθ = θ₀ + r(Δθ) exactly (|θ₀ + Δθ| spans < 16 bits).
    theta0 = torch.tensor([0.000866, -0.000866, 1e-6, 0.0, 3e-3], dtype=torch.bfloat16)
    param = theta0.clone().requires_grad_()
    optimizer = VARIANTS[name]([param], lr=0.001007, weight_decay=0.0)
    optimizer.track_updates = True
    param.grad = torch.tensor([-1.0, -1.0, -1.0, 1.0, 1.0], dtype=torch.bfloat16)
    optimizer.step()
    update = optimizer.tracked[-1].update.bfloat16().double()
    assert bits_equal(held(optimizer, param), theta0.double() + update)
