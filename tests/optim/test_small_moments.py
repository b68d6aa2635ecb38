"""Small moments in the quantized state formats: a decaying m never becomes NaN (COAT's group
scale is capped at 2^126), and a positive v never decodes to 0 beside an m that does not (the
update would be m/ε): FP8AdamW's scaled v and collage-8bit's unsigned map keep the smallest code.
Each run is checked against an FP64 AdamW, and the native and compiled paths against the reference."""

from __future__ import annotations

import pytest
import torch

from hf_lowprec.optim import COATAdamW, Collage8bitAdamW, FP8AdamW
from hf_lowprec.optim.formats import GroupFP8

BF16, FP32 = torch.bfloat16, torch.float32
LR = 1e-3
OPTIMIZERS = {
    "coat": (COATAdamW, FP32),
    "fp8-adamw": (FP8AdamW, FP32),
    "collage-8bit": (Collage8bitAdamW, BF16),
}
# Per step, the update m̂/(√v̂ + ε) is off by at most e_m + e_v/2 (relative) where m and v decode
# with relative errors e_m, e_v. E4M3 (COAT's and FP8AdamW's m, COAT's v): 2^-4; FP16 v: 2^-11. The
# 8-bit dynamic maps at the ratios used here (m: 0.5, v: 0.25 of the block's absmax): signed 0.066,
# unsigned 0.034 (half the gap between neighbouring map values over the value). A geometric decay
# scales a whole group alike, so the codes repeat and the errors do not compound.
UPDATE_ERROR = {"coat": 2**-4 + 2**-5, "fp8-adamw": 2**-4 + 2**-12, "collage-8bit": 0.066 + 0.017}


def adamw64(theta: torch.Tensor, grads: list[torch.Tensor], eps: float = 1e-8):
    """FP64 AdamW (β = 0.9, 0.999, no weight decay): the final θ and Σ|Δθ| per element."""
    theta = theta.double().clone()
    m, v, path = torch.zeros_like(theta), torch.zeros_like(theta), torch.zeros_like(theta)
    for t, g in enumerate(grads, 1):
        g = g.double()
        m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
        step = -LR * (m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt() + eps)
        theta, path = theta + step, path + step.abs()
    return theta, path


def run(name: str, theta: torch.Tensor, grads: list[torch.Tensor], fused: str):
    """The optimizer `name` over `grads` from `theta`: (θ as FP64 (θ + δθ for collage-8bit), optimizer)."""
    cls, dtype = OPTIMIZERS[name]
    param = torch.nn.Parameter(theta.to(dtype, copy=True))
    optimizer = cls([param], lr=LR, weight_decay=0.0, fused=fused)
    for g in grads:
        param.grad = g.to(dtype, copy=True)
        optimizer.step()
    assert dict(optimizer.paths_taken) == {fused: len(grads)}, "the path named did not run"
    value = param.detach().double()
    if "param_error" in optimizer.state[param]:
        value = value + optimizer.state[param]["param_error"].double()
    return value, optimizer.state[param]


def assert_states_equal(a: dict, b: dict) -> None:
    for key, value in a.items():
        if torch.is_tensor(value):
            bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[value.element_size()]
            assert torch.equal(value.view(bits), b[key].view(bits)), f"{key} differs between the paths"


def decay_grads(pattern: str, n: int = 128, steps: int = 1000) -> list[torch.Tensor]:
    """One gradient, then zeros: m decays as 0.9^t (an unused embedding row, a dead unit)."""
    if pattern == "constant":  # one COAT group with max = min: k = 1, s = F/amax
        first = torch.full((n,), 1e-3)
    elif pattern == "two-valued":  # ratio 2: the range expansion with k > 1
        first = torch.where(torch.arange(n) % 2 == 0, 1e-3, -2e-3)
    else:  # randn with a 1e4 outlier: k falls to 1 once m is FP32-subnormal
        first = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-3
        first[0] = 10.0
    return [first] + [torch.zeros(n)] * (steps - 1)


@pytest.mark.parametrize("fused", ["reference", "native"])
@pytest.mark.parametrize("pattern", ["constant", "two-valued"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_decaying_moment_stays_finite_and_near_fp64_adamw(name, pattern, fused):
    """1000 steps after one gradient: m reaches 0.9^999·1e-4 ≈ 2e-50 (below FP32; COAT's scale
    F/amax overflowed to inf at amax < 1.3e-36, step ~700, and the group decoded to NaN).
    Bound: `UPDATE_ERROR` of each FP64 step's |Δθ|, plus half an FP32 ulp of θ (< 2^-24·4) per step."""
    theta = torch.randn(128, generator=torch.Generator().manual_seed(0))
    grads = decay_grads(pattern)
    value, state = run(name, theta, grads, fused)
    reference, path = adamw64(theta.to(OPTIMIZERS[name][1]), grads)
    assert torch.isfinite(value).all(), f"{int((~torch.isfinite(value)).sum())} non-finite parameters"
    assert all(torch.isfinite(t.float()).all() for t in state.values() if torch.is_tensor(t)), "a non-finite state"
    bound = UPDATE_ERROR[name] * path + len(grads) * 2**-24 * 4
    excess = (value - reference).abs() - bound
    assert excess.max() <= 0, f"off FP64 AdamW by {excess.max().item():.3g} beyond the bound"


@pytest.mark.parametrize("expand", [True, False], ids=["expanded", "plain-groups"])
@pytest.mark.parametrize("fused", ["reference", "native"])
def test_coat_wide_range_moment_decays_without_nan(fused, expand):
    """hb's case: randn·1e-3 with a 10.0 outlier (R > 1e5, k = 1), then zeros: NaN at step 787
    before the cap; now every parameter and state stays finite for 1000 steps."""
    theta = torch.zeros(128)
    param = torch.nn.Parameter(theta.clone())
    optimizer = COATAdamW([param], lr=LR, weight_decay=0.0, expand=expand, fused=fused)
    for g in decay_grads("outlier"):
        param.grad = g
        optimizer.step()
    state = optimizer.state[param]
    assert torch.isfinite(param).all(), f"{int(param.isnan().sum())} NaN parameters"
    for key in ("exp_avg_scale", "exp_avg_sq_scale"):
        assert torch.isfinite(state[key]).all() and state[key].max() <= 2.0**126, key


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_group_fp8_of_a_subnormal_group_has_a_finite_scale(dtype):
    """128 values of 1e-40 (and 128 of 1e-37; R = 1, so k = 1): s = 2^126, not F/amax = inf. x̂ is
    finite and within half an FP8 step of x·s, over s: relative 2^-4 (E4M3) or 2^-3 (E5M2), or
    half the smallest code d (FP8's subnormal spacing) over 2^126."""
    codec = GroupFP8(dtype, 128, expand=True)
    x = torch.cat([torch.full((128,), 1e-40), torch.full((128,), 1e-37)])
    stored = codec.zeros(x)
    codec.encode_(x, *stored)
    decoded = codec.decode(*stored).reshape(-1)
    assert torch.equal(stored[1], torch.full((2,), 2.0**126))
    d, relative = (2.0**-9, 2.0**-4) if dtype == torch.float8_e4m3fn else (2.0**-16, 2.0**-3)
    assert torch.isfinite(decoded).all()
    bound = torch.clamp(relative * x.double(), min=d / 2 / 2**126)
    assert ((decoded.double() - x.double()).abs() <= bound).all()


def overshoot_case(name: str) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """A tensor where one element's v is far below the tensor's (block's) largest: (θ, grads, element).

    FP8AdamW (hb): a spike of 100 at step 1 on element 0, a steady 1e-6 on elements 1-2, 300 steps:
    v₁/v₀ ≈ 1e-13 is below FP16's 2^-24/65504 at the per-tensor scale, and v₁ was stored as 0.
    collage-8bit (ha): one 256-element block with a constant gradient, element 0's 1e4 times
    smaller, 100 steps: v₀/absmax = 1e-8 is below the unsigned map's first midpoint (1.6e-7)."""
    if name == "fp8-adamw":
        spike = torch.tensor([100.0, 1e-6, 1e-6, 0.0])
        steady = torch.tensor([0.0, 1e-6, 1e-6, 0.0])
        return torch.zeros(4), [spike] + [steady] * 299, 1
    grad = torch.full((256,), 1e-2)
    grad[0] = 1e-6
    return torch.zeros(256), [grad] * 100, 0


@pytest.mark.parametrize("fused", ["reference", "native"])
@pytest.mark.parametrize("name", ["fp8-adamw", "collage-8bit"])
def test_a_small_second_moment_never_makes_the_update_m_over_eps(name, fused):
    """The element moved 6.7× (FP8AdamW) and 5.9× (collage-8bit) as far as AdamW, its stored v
    being 0. Now v̂ ≥ v (the smallest code, or the nearest code above half of it): the element
    moves no further than FP64 AdamW's path plus `UPDATE_ERROR` of it, and its v decodes > 0."""
    theta, grads, element = overshoot_case(name)
    value, state = run(name, theta, grads, fused)
    reference, path = adamw64(theta.to(OPTIMIZERS[name][1]), grads)
    moved, moved64 = (value - theta.double()).abs()[element], (reference - theta.double()).abs()[element]
    assert moved <= (1 + UPDATE_ERROR[name]) * path[element], f"moved {moved:.4g}, FP64 AdamW {moved64:.4g}"
    assert moved >= moved64 / 16, f"moved {moved:.4g}: v̂ far above v (FP64 AdamW {moved64:.4g})"
    payload = state["exp_avg_sq"].reshape(-1)[element]
    assert payload.view(torch.uint8 if payload.element_size() == 1 else torch.int16) != 0, "v stored as 0"


@pytest.mark.parametrize("fused", ["native", pytest.param("compiled", marks=pytest.mark.compiles_step)])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_paths_agree_bit_for_bit_where_the_guards_act(name, fused):
    """Native and compiled give the reference's bits in the regimes of the guards (COAT: the
    capped scale; FP8AdamW and collage-8bit: v kept at the smallest code)."""
    if name == "coat":
        theta, grads = torch.zeros(128), [torch.full((128,), 1e-36)] * 3 + decay_grads("outlier", steps=3)
    else:
        theta, grads, _ = overshoot_case(name)
        grads = grads[:20]
    value, state = run(name, theta, grads, fused)
    reference_value, reference_state = run(name, theta, grads, "reference")
    assert torch.equal(value.view(torch.int64), reference_value.view(torch.int64)), "θ differs"
    assert_states_equal(state, reference_state)
