"""COAT's FP8 optimizer-state format as a standalone tensor: per-group FP8 with dynamic range expansion (docs/algorithms.md §4)."""

import io
import math

import pytest
import torch

from hf_lowprec.optim.coat_adamw import FP8GroupState, dequantize_state, quantize_state
from hf_lowprec.optim.formats import expansion_exponent
from tests.helpers import batches, bits_equal, tiny_gpt2

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Unit roundoff of the formats (round to nearest, 3 and 2 mantissa bits).
U = {E4M3: 2.0**-4, E5M2: 2.0**-3}


def moment_like(n=128 * 64, spread=3.0, seed=0):
    """Values whose magnitudes span ~e^±(2·spread) within a group, like AdamW's first moment."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=torch.float64) * torch.exp(
        spread * torch.rand(n, generator=g, dtype=torch.float64)
    )


def test_expansion_exponent_formula_and_guards():
    amax = torch.tensor([1e3, 1.0, 0.0, 2.0, 1e30, 1.0])
    amin = torch.tensor([1.0, 1.0, math.inf, 2.0, 1e-30, 1.0 - 2**-23])
    k = expansion_exponent(amax, amin, E4M3)
    target = math.log2(448.0**2 / 2)
    assert k[0].item() == math.floor(target / math.log2(1e3) * 16) / 16  # 1.6625… → 1.625
    assert k[1].item() == 1.0 and k[2].item() == 1.0 and k[3].item() == 1.0  # R = 1, all-zero
    assert k[4].item() == 1.0  # R = 1e60 is wider than F²/2: never below 1
    assert k[5].item() > 1e5 and (k[5] * 16).item() == int(k[5].item() * 16)  # a multiple of 1/16
    # The stretched range never exceeds the target: R^k ≤ F²/2.
    assert (k[0].double() * math.log2(1e3)).item() <= target


# Half the spacing of the subnormals: the absolute rounding error of a code below the normal range.
HALF_SUBNORMAL = {E4M3: 2.0**-10, E5M2: 2.0**-17}


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("expand", [True, False])
def test_round_trip_error_bound_against_fp64(dtype, expand):
    # Derived bound per element: the code of y·s (y = (|x|/c)^k, taken in FP64 from the stored
    # c, k, s) rounds with absolute error e ≤ max(u·|y·s|, half a subnormal spacing); decoding
    # takes the k-th root, so with δ = e/|y·s| the relative error of x is at most
    # max(|(1 ± δ)^(1/k) − 1|) = 1 − (1 − δ)^(1/k) (≈ δ/k; the downward side is the larger).
    # The FP32 arithmetic of encode/decode (pow, division, product with c) adds < 1e-5.
    x = moment_like()
    state = quantize_state(x, 128, dtype, expand)
    decoded = dequantize_state(state).double()
    k = state.exponent.double().repeat_interleave(128)
    c = state.center.double().repeat_interleave(128)
    s = state.scale.double().repeat_interleave(128)
    code = (x.abs() / c).pow(k) * s
    e = torch.maximum(code * U[dtype], torch.full_like(code, HALF_SUBNORMAL[dtype]))
    bound = 1 - (1 - (e / code).clamp(max=1.0)).pow(1 / k) + 1e-5
    relative = (decoded - x).abs() / x.abs()
    assert (relative <= bound).all(), (relative / bound).max().item()
    assert decoded.shape == x.shape


def expected_mean_error(states: list[torch.Tensor], expand: bool, group: int = 128) -> tuple[float, float]:
    """FP64 model of the mean relative error of E4M3 group states over their non-zero elements,
    and its standard deviation: k, c, s from the FP64 group extremes (COAT's formulas); a
    normal code's rounding error uniform in ±spacing/2 (relative ±d, d ≤ 2^-4), decoded through
    the k-th root: E|(1 + δ)^(1/k) − 1| in closed form, variance d²/(3k²) − E² to first order;
    a subnormal code (spacing 2^-9, as coarse as the value) rounded in FP64, no variance."""
    total, variance, count = 0.0, 0.0, 0
    for x in states:
        flat = x.double().abs().flatten()
        g = torch.cat([flat, flat.new_zeros(-flat.numel() % group)]).view(-1, group)
        nonzero = g > 0
        amax, amin = g.amax(1, keepdim=True), torch.where(nonzero, g, math.inf).amin(1, keepdim=True)
        k, c = torch.ones_like(amax), torch.ones_like(amax)
        if expand:
            span = torch.log2(amax / amin)
            k = torch.where(span > 0, torch.floor(math.log2(448.0**2 / 2) / span * 16).clamp(min=16) / 16, 1.0)
            c = torch.where(k > 1, amax.sqrt() * amin.sqrt(), 1.0)
        y = torch.where(nonzero, (g / c) ** k, 0.0)
        q = torch.where(nonzero, y * 448.0 / y.amax(1, keepdim=True), 1.0)
        normal = q >= 2.0**-6
        d = torch.exp2(torch.floor(torch.log2(q)) - 3) / 2 / q
        r = (k + 1) / k
        up = k / (k + 1) * ((1 + d) ** r - 1) - d
        down = d - k / (k + 1) * (1 - (1 - d).clamp(min=0) ** r)
        subnormal = ((torch.round(q / 2.0**-9) * 2.0**-9 / q) ** (1 / k) - 1).abs()
        mean = torch.where(normal, (up + down) / (2 * d), subnormal)
        spread = torch.where(normal, (d**2 / (3 * k**2) - mean**2).clamp(min=0), 0.0)
        total += mean[nonzero].sum().item()
        variance += spread[nonzero].sum().item()
        count += int(nonzero.sum())
    return total / count, math.sqrt(variance) / count


def ratio_bound(states: list[torch.Tensor]) -> float:
    """The largest mean-error ratio expanded/plain the model allows: expanded at most its mean
    + 5σ, plain at least its mean − 5σ, each mean also off by the terms the first-order model
    drops, O(d²) ≤ (2^-4)² = 2^-8 relative."""
    (mean_expanded, sigma_expanded), (mean_plain, sigma_plain) = (expected_mean_error(states, e) for e in (True, False))
    return (mean_expanded * (1 + 2.0**-8) + 5 * sigma_expanded) / (mean_plain * (1 - 2.0**-8) - 5 * sigma_plain)


def test_expansion_cuts_the_error_of_narrow_groups():
    # Second moments span ~1e1 per group (COAT): plain E4M3 uses the codes in [44.8, 448] only
    # (mean relative error ≈ u/2·(mean spacing ratio) ≈ 0.022), the expansion the whole range.
    x = 10 ** torch.rand(128 * 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    errors = {}
    for expand in (True, False):
        decoded = dequantize_state(quantize_state(x, expand=expand)).double()
        errors[expand] = ((decoded - x).abs() / x).mean().item()
    # The bound is the FP64 rounding model's (`ratio_bound`): 0.259. Measured 0.00544 / 0.02205
    # = 0.247 (the model's means: 0.00532, 0.02218, σ ≈ 0.7 % of each). Skipping the expansion
    # (ratio 1) or the k-th root's division of the error fails it.
    bound = ratio_bound([x])
    assert errors[True] <= bound * errors[False], (errors, bound)


def test_expansion_cuts_the_error_on_real_adamw_states():
    # m1/m2 of a tiny GPT-2 after 30 AdamW steps: COAT's claim, on states this code produces.
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for ids in batches(30):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    ratios = {}
    for key in ("exp_avg", "exp_avg_sq"):
        states = [s[key] for s in optimizer.state.values()]
        x = torch.cat([t.flatten() for t in states])
        nz = x != 0
        errors = []
        for expand in (True, False):
            # Each parameter's state on its own, as COATAdamW stores it.
            decoded = torch.cat([dequantize_state(quantize_state(t, expand=expand)).flatten() for t in states])
            errors.append(((decoded - x)[nz].double().abs() / x[nz].double().abs()).mean().item())
        ratios[key] = errors[0] / errors[1]
        # The FP64 rounding model's bound on these states (`ratio_bound`): 0.653 and 0.392;
        # measured 0.637 and 0.382 (bench/coat_evidence.py: 0.61× and 0.35× after 200 steps).
        assert ratios[key] <= ratio_bound(states), (key, ratios[key])


def test_expanded_range_reaches_down_to_two_over_f_and_no_further():
    # k > 1: the group's range is stretched to R^k ≤ F²/2, so the smallest element's code is
    # F/R^k ≥ 2/F (≈ 0.0045, above E4M3's smallest subnormal 2^-9): nothing flushes to zero.
    x = torch.logspace(-8, -4.5, 128, dtype=torch.float64)
    state = quantize_state(x)
    assert state.exponent.item() > 1
    codes = state.payload.float().abs()
    assert codes.min().item() >= 2 / 448 * (1 - 2**-2)  # subnormal rounding: ≤ 2^-10 absolute
    assert codes.max().item() == 448
    assert (dequantize_state(state) != 0).all()
    # A group wider than F²/2 keeps k = 1 (plain scaling): elements below F·2^-10/R flush to 0.
    wide = torch.logspace(-12, -4, 128, dtype=torch.float64)
    state = quantize_state(wide)
    assert state.exponent.item() == 1.0 and (dequantize_state(state) == 0).any()


def test_all_zero_constant_and_single_element_groups_are_exact():
    x = torch.cat([torch.zeros(128), torch.full((128,), -3.25), torch.zeros(127), torch.tensor([7.0])])
    state = quantize_state(x)
    decoded = dequantize_state(state)
    # Zeros are exact; a group's maximum maps to the code F exactly, and s = F/amax (not a power
    # of two) costs two FP32 roundings: F/s = amax·(1 ± 2^-23)².
    assert bits_equal(decoded[:128], x[:128]) and bits_equal(decoded[256:383], x[256:383])
    torch.testing.assert_close(decoded, x, rtol=2**-22, atol=0.0)
    assert bits_equal(state.exponent, torch.ones(3)) and bits_equal(state.center, torch.ones(3))


def test_padding_shape_and_metadata_dtypes():
    x = torch.randn(3, 50, dtype=torch.bfloat16)  # 150 elements: two groups, the last padded
    state = quantize_state(x, group_size=128, fp8_dtype=E5M2)
    assert state.payload.dtype == E5M2 and state.payload.numel() == 256
    assert all(t.dtype == torch.float32 and t.shape == (2,) for t in (state.scale, state.exponent, state.center))
    out = dequantize_state(state)
    assert out.shape == (3, 50) and out.dtype == torch.float32
    assert state.nbytes() == 256 + 3 * 2 * 4


def test_tiny_and_huge_magnitudes_stay_finite():
    # c = √mx·√mn: mx·mn = 1e-50 would underflow FP32, the product of roots does not.
    x = torch.tensor([1e-25, 3e-25, 1e-24, 2e-25] * 32)
    assert torch.isfinite(dequantize_state(quantize_state(x))).all()
    x = torch.tensor([3e38, 1e-45] * 64)  # range beyond FP32's own span: k = 1, c = 1
    decoded = dequantize_state(quantize_state(x))
    assert torch.isfinite(decoded).all() and decoded[0] == pytest.approx(3e38, rel=U[E4M3])


def test_non_finite_groups_decode_to_nan_and_others_are_untouched():
    x = torch.ones(256)
    x[5] = math.nan
    x[200] = 2.0
    decoded = dequantize_state(quantize_state(x))
    assert decoded[:128].isnan().all()
    # The other group {1, 2} expands with k = 16.6: the 1s become the code 2/F ≈ 2.3·2^-9, a
    # subnormal off by ≤ 2^-10 (δ ≤ 0.22), hence relative error ≤ 1 − (1 − δ)^(1/k) < 0.016.
    torch.testing.assert_close(decoded[128:], x[128:], rtol=0.016, atol=0.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"group_size": 0}, "group_size"),
        ({"group_size": 1.5}, "group_size"),
        ({"fp8_dtype": torch.float16}, "fp8_dtype"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        quantize_state(torch.ones(4), **kwargs)
    with pytest.raises(ValueError, match="floating"):
        quantize_state(torch.ones(4, dtype=torch.int32))


def test_zeros_and_safe_checkpoint_loading():
    state = FP8GroupState.zeros((10, 20), group_size=64, fp8_dtype=E5M2)
    assert bits_equal(state.dequantize(), torch.zeros(10, 20))
    filled = quantize_state(moment_like(200).float(), group_size=64)
    buffer = io.BytesIO()
    torch.save({"zeros": state, "filled": filled}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert bits_equal(loaded["filled"].payload.view(torch.uint8), filled.payload.view(torch.uint8))
    assert bits_equal(loaded["filled"].dequantize(), filled.dequantize())
    assert loaded["zeros"].shape == (10, 20)
