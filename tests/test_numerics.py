"""Error-free transformations against exact FP64 references (docs/algorithms.md §2, §5)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_lowprec import numerics
from hf_lowprec.numerics import (
    expansion,
    fast_two_sum,
    foreach_fast_two_sum_,
    foreach_grow_,
    foreach_two_sum_,
    grow,
    mul_expansion,
    round_by_bits,
    round_to_dtype,
    stochastic_round,
    two_prod,
    two_sum,
)
from tests.helpers import bits_equal, unit_roundoff

DTYPES = [torch.bfloat16, torch.float16]
BITS = {torch.bfloat16: 8, torch.float16: 11}
# Half of the smallest subnormal: the absolute rounding error of a result in the subnormal range.
HALF_SUBNORMAL = {torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25}
# Exponent ranges for which every sum/product of two values is exact in FP64 and finite in
# the dtype; FP16 products keep their low bits above 2^-24 for ea + eb ≥ −4.
SUM_EXPONENTS = {torch.bfloat16: (-20, 20), torch.float16: (-14, 14)}
PROD_EXPONENTS = {torch.bfloat16: (-30, 30), torch.float16: (-2, 6)}

SETTINGS = settings(max_examples=60, deadline=None)


def values(dtype: torch.dtype, min_exp: int, max_exp: int, zero: bool = True) -> st.SearchStrategy:
    """Exactly representable values of `dtype`, uniform over sign, binade and significand."""
    p = BITS[dtype]
    normal = st.builds(
        lambda s, e, m: s * (1.0 + m / 2.0 ** (p - 1)) * 2.0**e,
        st.sampled_from([-1.0, 1.0]),
        st.integers(min_exp, max_exp),
        st.integers(0, 2 ** (p - 1) - 1),
    )
    return st.one_of(normal, st.just(0.0)) if zero else normal


def pairs(dtype: torch.dtype, exponents: tuple[int, int]) -> st.SearchStrategy:
    """Two equally long tensors of `dtype` values with exponents in `exponents`."""
    v = values(dtype, *exponents)

    def tensors(rows: list[tuple[float, float]]) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.tensor(column, dtype=dtype) for column in zip(*rows))

    return st.lists(st.tuples(v, v), min_size=1, max_size=64).map(tensors)


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """ulp(x) in FP64 for values of `dtype` (docs/algorithms.md §0), the subnormal spacing near 0."""
    finfo = torch.finfo(dtype)
    _, exponent = torch.frexp(x.double())
    spacing = torch.pow(2.0, (exponent - BITS[dtype]).double())
    return torch.clamp(spacing, min=finfo.smallest_normal * finfo.eps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_sum_is_exact(dtype: torch.dtype) -> None:
    @SETTINGS
    @given(pairs(dtype, SUM_EXPONENTS[dtype]))
    def check(ab: tuple[torch.Tensor, torch.Tensor]) -> None:
        a, b = ab
        a0, b0 = a.clone(), b.clone()
        s, e = two_sum(a, b)
        assert s.dtype == e.dtype == dtype
        assert bits_equal(s, a + b)
        assert bits_equal(s.double() + e.double(), a.double() + b.double())
        assert bits_equal(a, a0) and bits_equal(b, b0)

    check()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fast_two_sum_is_exact_when_ordered(dtype: torch.dtype) -> None:
    @SETTINGS
    @given(pairs(dtype, SUM_EXPONENTS[dtype]))
    def check(ab: tuple[torch.Tensor, torch.Tensor]) -> None:
        a, b = ab
        swap = a.abs() < b.abs()
        a, b = torch.where(swap, b, a), torch.where(swap, a, b)
        s, e = fast_two_sum(a, b)
        assert s.dtype == e.dtype == dtype
        assert bits_equal(s.double() + e.double(), a.double() + b.double())
        assert bool((e.double().abs() <= ulp(s, dtype) / 2).all())

    check()


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_prod_is_exact(dtype: torch.dtype) -> None:
    @SETTINGS
    @given(pairs(dtype, PROD_EXPONENTS[dtype]))
    def check(ab: tuple[torch.Tensor, torch.Tensor]) -> None:
        a, b = ab
        p, e = two_prod(a, b)
        assert p.dtype == e.dtype == dtype
        assert bits_equal(p, a * b)
        assert torch.equal(
            p.double() + e.double(), a.double() * b.double()
        )  # exact in value (a signed zero may differ)

    check()


GROW_EXPONENTS = {torch.bfloat16: (-40, 40), torch.float16: (-2, 13)}


def expansion_and_addend(
    dtype: torch.dtype, x_exp: torch.Tensor, z_gap: torch.Tensor, a_gap: torch.Tensor, bits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A valid expansion (x, y), |y| ≤ ulp(x)/2, and an addend a with |a| ≤ |x|/2.

    x has exponent `x_exp`; y is the rounding error of x + z with z `z_gap` binades below x;
    a is `a_gap` ≥ 2 binades below x. `bits` supplies signs and significands.
    """
    p = BITS[dtype]
    floor = GROW_EXPONENTS[dtype][0] - 12  # keeps every value a normal number of the dtype

    def build(exponent: torch.Tensor, random: torch.Tensor) -> torch.Tensor:
        significand = 1.0 + (random % 2 ** (p - 1)).double() / 2.0 ** (p - 1)
        sign = 1.0 - 2.0 * ((random >> 20) % 2).double()
        return (sign * significand * torch.pow(2.0, exponent.double())).to(dtype)

    x = build(x_exp, bits[0])
    z = build(torch.clamp(x_exp - z_gap, min=floor), bits[1])
    a = build(torch.clamp(x_exp - a_gap, min=floor), bits[2])
    x, y = two_sum(x, z)
    return x, y, a


def check_grow_bound(dtype: torch.dtype, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor) -> None:
    # With |a| ≤ |x|/2 both Fast2Sums are exact and the only rounding is t = fl(y + e),
    # e = x + a − s the error of s = fl(x + a), |e| ≤ ulp(s)/2. Hence
    #   |(u + v) − (x + y + a)| ≤ 2^-p·(|y| + ulp(s)/2) + (half the smallest subnormal),
    # about 2^-p·ulp(s): the expansion keeps ~2p bits where plain x + a keeps p.
    p = BITS[dtype]
    u, v = grow(x, y, a)
    assert u.dtype == v.dtype == dtype
    exact = x.double() + y.double() + a.double()
    bound = 2.0**-p * (y.double().abs() + ulp(x + a, dtype) / 2) + HALF_SUBNORMAL[dtype]
    error = (u.double() + v.double() - exact).abs()
    assert bool((error <= bound).all()), (error - bound).max()
    assert bool((v.double().abs() <= ulp(u, dtype) / 2).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_grow_error_bound(dtype: torch.dtype) -> None:
    p = BITS[dtype]
    lo, hi = GROW_EXPONENTS[dtype]
    element = st.tuples(st.integers(lo, hi), st.integers(1, 2 * p), st.integers(2, 3 * p), *[st.integers(0, 2**24)] * 3)

    @settings(max_examples=40, deadline=None)
    @given(st.lists(element, min_size=1, max_size=16))
    def check(rows: list[tuple[int, ...]]) -> None:
        columns = torch.tensor(rows, dtype=torch.int64).T
        cases = expansion_and_addend(dtype, columns[0], columns[1], columns[2], columns[3:])
        check_grow_bound(dtype, *cases)

    check()


@pytest.mark.parametrize("dtype", DTYPES)
def test_grow_error_bound_random(dtype: torch.dtype) -> None:
    """The same bound over 200k random cases, to reach corners hypothesis samples rarely."""
    p = BITS[dtype]
    lo, hi = GROW_EXPONENTS[dtype]
    generator = torch.Generator().manual_seed(0)
    n = 200_000

    def integers(low: int, high: int) -> torch.Tensor:
        return torch.randint(low, high + 1, (n,), generator=generator)

    bits = torch.stack([integers(0, 2**24) for _ in range(3)])
    cases = expansion_and_addend(dtype, integers(lo, hi), integers(1, 2 * p), integers(2, 3 * p), bits)
    check_grow_bound(dtype, *cases)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grow_error_bound_when_the_addend_is_larger(dtype: torch.dtype) -> None:
    # Regression (issue 8 #10): near-zero parameters take updates larger than themselves, where
    # Fast2Sum's |x| ≥ |a| fails. Collage's Fast2Sum-first Grow then loses the sum's whole
    # rounding error: BF16 θ = 0.000866, Δθ = 0.001007 gave (0.0018768, 0), 1 ulp off.
    x, a = torch.tensor([0.000866], dtype=torch.bfloat16), torch.tensor([0.001007], dtype=torch.bfloat16)
    u, v = grow(x, torch.zeros_like(x), a)
    assert u.double() + v.double() == x.double() + a.double()
    # Random cases with |a| up to 2^12·|x| (also of opposite sign, and cancelling): the bound of
    # `check_grow_bound`, 2^-p·(|y| + ulp(s)/2), must hold for any ordering.
    p = BITS[dtype]
    generator = torch.Generator().manual_seed(1)
    n = 100_000
    x = (torch.randn(n, generator=generator) * 2.0 ** torch.randint(-6, 0, (n,), generator=generator)).to(dtype)
    y = two_sum(x, (torch.randn(n, generator=generator) * x.float() * 2.0**-p).to(dtype))[1]
    ratio = 2.0 ** torch.randint(0, 13, (n,), generator=generator).double()
    a = (torch.randn(n, generator=generator).double() * x.double().abs() * ratio).to(dtype)
    a[:1000] = -x[:1000]  # exact cancellation: s = 0
    u, v = grow(x, y, a)
    exact = x.double() + y.double() + a.double()
    bound = 2.0**-p * (y.double().abs() + ulp(x + a, dtype) / 2) + HALF_SUBNORMAL[dtype]
    assert bool(((u.double() + v.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_foreach_two_sum_matches_two_sum_bitwise(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, generator=generator).to(dtype) for n in (17, 300)]
    # Addends from 2^-12 to 2^12 times larger: half of them violate Fast2Sum's precondition.
    adds = [(torch.randn(t.shape, generator=generator) * 2.0 ** torch.randint(-12, 13, t.shape)).to(dtype) for t in xs]
    expected = [two_sum(x, a) for x, a in zip(xs, adds)]
    x_, a_ = [x.clone() for x in xs], [a.clone() for a in adds]
    foreach_two_sum_(x_, a_)
    for (s, e), got_s, got_e in zip(expected, x_, a_):
        assert bits_equal(s, got_s) and bits_equal(e, got_e)


@pytest.mark.parametrize("dtype", DTYPES)
def test_foreach_variants_match_elementwise_bitwise(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, generator=generator).to(dtype) for n in (17, 300)]
    adds = [(torch.randn(t.shape, generator=generator) * 1e-3).to(dtype) for t in xs]
    ys = [two_sum(x, (torch.randn(x.shape, generator=generator) * 1e-3).to(dtype))[1] for x in xs]
    expected = [grow(x, y, a) for x, y, a in zip(xs, ys, adds)]
    x_, y_ = [x.clone() for x in xs], [y.clone() for y in ys]
    foreach_grow_(x_, y_, [a.clone() for a in adds])
    for (u, v), got_u, got_v in zip(expected, x_, y_):
        assert bits_equal(u, got_u) and bits_equal(v, got_v)

    expected = [fast_two_sum(x, a) for x, a in zip(xs, adds)]
    x_, a_ = [x.clone() for x in xs], [a.clone() for a in adds]
    foreach_fast_two_sum_(x_, a_)
    for (s, e), got_s, got_e in zip(expected, x_, a_):
        assert bits_equal(s, got_s) and bits_equal(e, got_e)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mul_expansion_keeps_about_twice_the_bits(dtype: torch.dtype) -> None:
    # Dropping a_lo·b_lo and rounding the error term e (|e| ≲ 2·2^-p·|ab|) twice leaves
    # |hi + lo − (a_hi + a_lo)(b_hi + b_lo)| ≤ 2^(3−2p)·|product|; plain products are off
    # by up to 2^-p·|product|.
    p = BITS[dtype]
    generator = torch.Generator().manual_seed(1)
    a = torch.rand(4096, generator=generator).to(dtype) + 0.5
    b = (torch.rand(4096, generator=generator) * 8).to(dtype) + 0.25
    a_hi, a_lo = two_sum(a, (torch.randn(4096, generator=generator) * 2.0**-p).to(dtype))
    b_hi, b_lo = two_sum(b, (torch.randn(4096, generator=generator) * 2.0**-p).to(dtype))
    hi, lo = mul_expansion(a_hi, a_lo, b_hi, b_lo)
    exact = (a_hi.double() + a_lo.double()) * (b_hi.double() + b_lo.double())
    relative = ((hi.double() + lo.double() - exact) / exact).abs().max().item()
    assert relative <= 2.0 ** (3 - 2 * p), relative
    beta_hi, beta_lo = expansion(0.95, dtype)
    hi, lo = mul_expansion(beta_hi, beta_lo, b_hi, b_lo)
    exact = 0.95 * (b_hi.double() + b_lo.double())
    assert ((hi.double() + lo.double() - exact) / exact).abs().max().item() <= 2.0 ** (3 - 2 * p)


def test_expansion_constants_bf16() -> None:
    assert expansion(0.999, torch.bfloat16) == (1.0, -0.00099945068359375)
    assert expansion(0.99, torch.bfloat16) == (0.98828125, 0.00171661376953125)
    assert expansion(0.98, torch.bfloat16) == (0.98046875, -0.000469207763671875)
    assert expansion(0.95, torch.bfloat16) == (0.94921875, 0.000782012939453125)


def test_round_to_dtype_rounds_once() -> None:
    # FP64 → FP32 → BF16 lands on the tie 1 + 2^-8 and rounds to even (1.0); the value is
    # above the tie, so the correct BF16 rounding is 1 + 2^-7.
    value = 1.0 + 2.0**-8 + 2.0**-30
    assert round_to_dtype(value, torch.bfloat16) == 1.0 + 2.0**-7
    assert round_to_dtype(65519.0, torch.float16) == 65504.0
    assert round_to_dtype(65520.0, torch.float16) == math.inf
    assert round_to_dtype(-(2.0**-26), torch.float16) == -0.0
    assert round_to_dtype(3 * 2.0**-25, torch.float16) == 2.0**-23  # tie between subnormals, to even


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_by_bits_is_the_cast_there_and_back(dtype: torch.dtype) -> None:
    # Every class of FP32 value: random bit patterns (subnormals, NaNs, infinities included),
    # random magnitudes across both formats' ranges, and the ties and thresholds at their edges.
    generator = torch.Generator().manual_seed(0)
    patterns = torch.randint(-(2**31), 2**31, (100_000,), generator=generator, dtype=torch.int64)
    edges = [0.0, -0.0, math.inf, -math.inf, math.nan, 65504.0, 65519.99, 65520.0, -65520.0, 2.0**-14]
    edges += [2.0**-14 * (1 - 2.0**-12), 2.0**-25, 3 * 2.0**-25, 1 + 2.0**-8, 1 + 3 * 2.0**-8, 3.4e38, 2.0**-133]
    x = torch.cat(
        [
            patterns.to(torch.int32).view(torch.float32),
            torch.randn(100_000, generator=generator) * 2.0 ** torch.randint(-40, 40, (100_000,), generator=generator),
            torch.tensor(edges),
        ]
    )
    expected, got = x.to(dtype).float(), round_by_bits(x, dtype)
    # A NaN stays a NaN (its payload is the backend's: Triton and C++ casts differ there).
    assert torch.equal(expected.isnan(), got.isnan())
    keep = ~x.isnan()
    assert bits_equal(expected[keep], got[keep])


def test_grow_accumulates_what_plain_bf16_loses() -> None:
    increment = torch.tensor(1e-4, dtype=torch.bfloat16)
    plain = torch.tensor(1.0, dtype=torch.bfloat16)
    hi, lo = torch.tensor(1.0, dtype=torch.bfloat16), torch.tensor(0.0, dtype=torch.bfloat16)
    for _ in range(10_000):
        plain = plain + increment
        hi, lo = grow(hi, lo, increment)
    true_increment = 10_000 * increment.double().item()
    assert plain.item() == 1.0
    error = abs(hi.double().item() + lo.double().item() - 1.0 - true_increment)
    # The only rounding of a step is t = fl(y + e) (`grow`), |t| ≤ |y| + |e| with |y| ≤ ulp(hi)/2
    # ≤ 2^-7 (hi < 4: the FP64 sum ends at 2.0002) and |e| ≤ |a|: N·2^-8·(2^-7 + a) = 0.31 of
    # the increment, against 1.0 lost by plain BF16 (dropping the compensation fails it).
    # Measured 2.5 %: the roundings of t partly cancel.
    bound = 10_000 * unit_roundoff(torch.bfloat16) * (2.0**-7 + increment.double().item())
    assert error <= bound, (error, bound)
    assert abs(plain.double().item() - 1.0 - true_increment) > bound  # the uncompensated sum fails it


@pytest.mark.parametrize("dtype", DTYPES)
def test_stochastic_round_picks_a_neighbour_and_is_unbiased(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    spacing = 2.0 ** (1 - BITS[dtype])  # ulp in [1, 2)
    for x in (1.0 + 0.125 * spacing, -(1.0 + 0.7 * spacing)):
        n = 200_000
        samples = stochastic_round(torch.full((n,), x), dtype, generator).double()
        down = math.floor(abs(x) / spacing) * spacing * math.copysign(1.0, x)
        up = down + math.copysign(spacing, x)
        assert bool(((samples == down) | (samples == up)).all())
        fraction = abs(x - down) / spacing
        sigma = spacing * math.sqrt(fraction * (1 - fraction) / n)
        assert abs(samples.mean().item() - x) < 5 * sigma


@pytest.mark.parametrize("dtype", DTYPES)
def test_stochastic_round_special_values(dtype: torch.dtype) -> None:
    exact = torch.tensor([0.0, -0.0, 1.0, -2.5, 0.0078125])
    assert bits_equal(stochastic_round(exact, dtype), exact.to(dtype))
    special = torch.tensor([math.inf, -math.inf, math.nan])
    out = stochastic_round(special, dtype)
    assert out[0] == math.inf and out[1] == -math.inf and out[2].isnan()
    # Beyond the largest finite value there is no upper neighbour: round to nearest, as a cast.
    big = torch.tensor([3.4e38, -3.4e38] if dtype == torch.bfloat16 else [65510.0, 70000.0, -70000.0])
    assert bits_equal(stochastic_round(big, dtype), big.to(dtype))
    # A NaN whose payload sits in the low 16 bits must not be truncated into an infinity.
    low_payload_nan = torch.tensor([0x7F800001], dtype=torch.int32).view(torch.float32)
    assert stochastic_round(low_payload_nan, dtype).isnan().all()


def test_stochastic_round_is_reproducible() -> None:
    x = torch.randn(1000) * 1e-3 + 1.0
    for dtype in DTYPES:
        a = stochastic_round(x, dtype, torch.Generator().manual_seed(3))
        b = stochastic_round(x, dtype, torch.Generator().manual_seed(3))
        c = stochastic_round(x, dtype, torch.Generator().manual_seed(4))
        assert bits_equal(a, b) and not bits_equal(a, c)


# --- abs_max and all_finite: the extremes from one aminmax pass -----------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_abs_max_is_the_fp64_max_of_abs_with_nan_signed_zero_and_empty(dtype):
    big = torch.finfo(dtype).max
    cases = [[-3.0, 2.0], [2.0, -3.0], [-0.0, -0.0], [0.0, -0.0], [-big, 1.0], [1.0, float("-inf")], [7.0]]
    for values in cases:
        x = torch.tensor(values, dtype=dtype)
        got = numerics.abs_max(x)
        assert got.dtype == dtype and got.item() == max(abs(v) for v in x.double().tolist())
    # max |x| of [−0, −0] is +0, as |x|.amax() gives.
    assert not numerics.abs_max(torch.tensor([-0.0, -0.0], dtype=dtype)).signbit()
    for nan_at in range(3):
        x = torch.tensor([-1.0, 5.0, -7.0], dtype=dtype)
        x[nan_at] = float("nan")
        assert numerics.abs_max(x).isnan()
    assert numerics.abs_max(torch.empty(0, 4, dtype=dtype)) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_finds_one_bad_value_anywhere_and_nothing_else(dtype):
    big = torch.finfo(dtype).max
    # Finite tensors whose squares, sums or norms overflow are still finite.
    finite = [
        torch.full((1000,), big, dtype=dtype),
        torch.tensor([-big, big], dtype=dtype),
        torch.zeros(3, dtype=dtype),
        torch.tensor([torch.finfo(dtype).tiny / 4], dtype=dtype),
    ]
    assert numerics.all_finite(finite)
    assert numerics.all_finite([]) and numerics.all_finite([torch.empty(0, dtype=dtype)])
    for bad in (float("inf"), float("-inf"), float("nan"), -float("nan")):
        for where in (0, 517, 999):
            x = torch.randn(1000).to(dtype)
            x[where] = bad
            # The bad tensor among finite ones, first or last; an all-zero tensor beside it.
            assert not numerics.all_finite([torch.zeros(5, dtype=dtype), x])
            assert not numerics.all_finite([x, torch.ones(2, dtype=dtype)])
    # A non-contiguous view sees only its own elements.
    x = torch.zeros(4, 4, dtype=dtype)
    x[1, 0] = float("inf")
    assert numerics.all_finite([x[:, 1:]]) and not numerics.all_finite([x.t()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sqrt_rn_is_the_correctly_rounded_root(dtype):
    """Against Python's math.sqrt (correctly rounded FP64), rounded to the dtype on the host."""
    info = torch.finfo(dtype)
    generator = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            torch.rand(200_000, generator=generator) * 4,
            torch.exp2(torch.empty(5000).uniform_(math.log2(info.tiny) - 10, math.log2(info.max), generator=generator)),
            torch.tensor([0.0, -0.0, info.tiny, info.max, math.inf]),
        ]
    ).to(dtype)
    got = numerics.sqrt_rn(x)
    assert got.dtype == dtype
    expected = [round_to_dtype(math.sqrt(v), dtype) for v in x.double().tolist()]
    assert got.double().tolist() == expected
    assert numerics.sqrt_rn(torch.tensor([-0.0], dtype=dtype)).signbit()
    assert numerics.sqrt_rn(torch.tensor([-1.0, math.nan], dtype=dtype)).isnan().all()
    # Slices beyond the first keep their place; a non-contiguous input is read in its own order.
    long = torch.arange(3 * (1 << 20) + 5, dtype=torch.float32)
    assert bits_equal(numerics.sqrt_rn(long)[-3:], long[-3:].double().sqrt().float())
    assert bits_equal(numerics.sqrt_rn(x[:100].view(10, 10).t()), numerics.sqrt_rn(x[:100].view(10, 10)).t())
