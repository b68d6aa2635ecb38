"""Storage formats (`hf_lowprec.optim.formats`) and update rules (`hf_lowprec.optim.rules`) against FP64.

Each format stores FP32 register values and decodes them back; the tests bound the round trip
element by element with the error the format's rounding allows (derived in each test), check
that zeros stay zero and NaN stays NaN, and for the block formats the blocks that hold only
zeros or one value far above the rest. The update rules are checked for what each promises:
the compensated rules keep θ + δθ on the exact FP64 sum of many updates far below ulp(θ)/2,
stochastic rounding is unbiased, and the master rule keeps the FP32 master.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_lowprec.fp8.scaled import format_max
from hf_lowprec.numerics import sqrt_rn
from hf_lowprec.optim.formats import Blockwise8bit, GroupFP8, Pair, Plain, Scaled, dynamic_map, root
from hf_lowprec.optim.rules import Grow, Kahan, Master, Nearest, StochasticRounding, uniform_bits
from tests.helpers import bits_equal

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Unit roundoff 2^-p (p significand bits, round to nearest): |r(x) − x| ≤ u·|x| in the normal range.
U = {BF16: 2.0**-8, F16: 2.0**-11, E4M3: 2.0**-4, E5M2: 2.0**-3}
# Half the spacing of the subnormals: the absolute error of a value rounded below the normal range.
HALF_SUBNORMAL = {BF16: 2.0**-134, F16: 2.0**-25, E4M3: 2.0**-10, E5M2: 2.0**-17}


def values(n: int = 4096, binades: float = 40.0, seed: int = 0) -> torch.Tensor:
    """FP32 values of both signs whose magnitudes span `binades` binades, with exact zeros."""
    generator = torch.Generator().manual_seed(seed)
    magnitude = torch.exp2((torch.rand(n, generator=generator, dtype=F64) - 0.5) * binades)
    sign = torch.where(torch.rand(n, generator=generator) < 0.5, -1.0, 1.0).double()
    x = (sign * magnitude * (1 + torch.rand(n, generator=generator, dtype=F64))).float()
    x[::97] = 0.0
    return x


def round_trip(fmt, x: torch.Tensor, param_dtype: torch.dtype = F32) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """encode_(x) into a fresh state of `fmt` for a parameter like x, then decode (FP32)."""
    param = torch.zeros(x.shape, dtype=param_dtype)
    stored = fmt.zeros(param)
    block = fmt.block
    padded = -(-x.numel() // block) * block
    registers = torch.zeros(padded, dtype=F32)
    registers[: x.numel()] = x
    if block > 1:
        registers = registers.view(-1, block)
    fmt.encode_(registers, *stored)
    decoded = fmt.decode(*stored).reshape(-1)[: x.numel()]
    assert decoded.dtype == F32
    return decoded, stored


def test_root_is_correctly_rounded_eagerly():
    x = torch.rand(100_000, generator=torch.Generator().manual_seed(0)) * 10
    assert bits_equal(root(x), sqrt_rn(x))
    assert bits_equal(root(x).double(), x.double().sqrt().float().double())


# --- element-wise formats ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_plain_rounds_once_to_nearest(dtype):
    # One rounding to nearest even: decoded = x.to(dtype) bit for bit, hence |x̂ − x| ≤ u·|x| in the
    # normal range (u = 2^-8 BF16, 2^-11 FP16, exact for FP32). Values within FP16's normal range.
    x = values(binades=20.0 if dtype == F16 else 200.0)
    decoded, (payload,) = round_trip(Plain(dtype), x)
    assert payload.dtype == dtype
    assert bits_equal(decoded, x.to(dtype).float())
    exact = x.double()
    error = (decoded.double() - exact).abs()
    if dtype == F32:
        assert bits_equal(decoded, x)
    else:
        assert bool((error <= U[dtype] * exact.abs()).all())
        assert error.max() > 0  # really rounded: the format is not wider than it says
    assert bool((decoded[x == 0] == 0).all())


def test_plain_of_none_takes_the_parameter_dtype_and_keeps_nan():
    fmt = Plain()
    assert fmt.storage_dtype(torch.zeros(1, dtype=BF16)) == BF16
    x = torch.tensor([1.0, float("nan"), -2.0, 0.0])
    decoded, _ = round_trip(fmt, x, BF16)
    assert torch.isnan(decoded[1]) and bits_equal(decoded[[0, 2, 3]], x[[0, 2, 3]])


@pytest.mark.parametrize(("dtype", "margin"), [(F16, 0), (F16, 2), (E4M3, 0), (E5M2, 0)])
def test_scaled_round_trip_against_fp64(dtype, margin):
    # s = 2^(floor(log2(max/amax)) − margin): a power of two putting amax·s in the top binade
    # (below max: nothing saturates). x·s and payload/s are exact, so the only rounding is the
    # cast: |x̂ − x| ≤ u·|x| where x·s is normal, half a subnormal spacing / s below that.
    # Values span 30 binades: the top ones normal (rel ≤ 2^-11 FP16, 2^-4 E4M3), the rest not.
    x = values(binades=30.0) * 1e-3
    decoded, (payload, scale) = round_trip(Scaled(dtype, margin), x)
    assert payload.dtype == dtype and scale.dtype == F32 and scale.dim() == 0
    s = scale.item()
    assert s == 2.0 ** round(math.log2(s))
    amax = x.abs().max().item()
    limit = format_max(dtype)
    assert limit / 2 ** (margin + 1) < amax * s <= limit / 2**margin
    exact, scaled = x.double(), x.double().abs() * s
    normal = scaled >= torch.finfo(dtype).smallest_normal
    error = (decoded.double() - exact).abs()
    assert bool((error[normal] <= U[dtype] * exact.abs()[normal]).all())
    assert bool((error[~normal] <= HALF_SUBNORMAL[dtype] / s).all())
    assert normal.float().mean() > 0.1 and (~normal).any()  # both regimes were exercised
    assert bool((decoded[x == 0] == 0).all())


def test_scaled_edge_cases():
    fmt = Scaled(F16)
    # All zeros: s = 1 and zeros back.
    decoded, (_, scale) = round_trip(fmt, torch.zeros(10))
    assert scale.item() == 1.0 and bits_equal(decoded, torch.zeros(10))
    # NaN makes amax NaN: s = 1, NaN stays NaN, the others are FP16 roundings of themselves.
    x = torch.tensor([1.0, float("nan"), -3.0, 1e-3])
    decoded, (_, scale) = round_trip(fmt, x)
    assert scale.item() == 1.0 and torch.isnan(decoded[1])
    assert bits_equal(decoded[[0, 2, 3]], x[[0, 2, 3]].half().float())
    # ±inf is made NaN (the FP8 cast convention), never stored as the format's max.
    decoded, _ = round_trip(fmt, torch.tensor([1.0, float("inf")]))
    assert torch.isnan(decoded[1])
    # FP32 storage is not scaled: exact.
    x = values()
    decoded, (_payload, scale) = round_trip(Scaled(F32), x)
    assert scale.item() == 1.0 and bits_equal(decoded, x)


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_pair_holds_about_twice_the_bits(dtype):
    # hi = r(x), lo = r(x − hi); x − hi is exact in FP32, and lo rounds it with relative error
    # u, so |hi + lo − x| ≤ u·|x − hi| ≤ u²·|x| (2^-16 BF16, 2^-22 FP16) while lo is normal;
    # hi + lo spans ≤ 24 bits, so the FP32 decode adds exactly. FP16 pairs are scaled (the
    # family's `Pair(Scaled())`); lo below FP16's normal range adds half a subnormal / s.
    fmt = Pair(Scaled()) if dtype == F16 else Pair(Plain())
    x = values(binades=20.0 if dtype == F16 else 200.0)
    decoded, stored = round_trip(fmt, x, dtype)
    value, error = stored[0], stored[1]
    assert value.dtype == error.dtype == dtype
    s = stored[2].item() if dtype == F16 else 1.0
    exact = x.double()
    deviation = (decoded.double() - exact).abs()
    bound = U[dtype] ** 2 * exact.abs() + HALF_SUBNORMAL[dtype] / s
    assert bool((deviation <= bound).all()), (deviation / bound).max().item()
    # Far better than the plain format: hi alone errs by up to u·|x|, and by more than u/2·|x|
    # (2^(p−1) times the pair's bound) somewhere among these 4096 values.
    plain = (value.double() / s - exact).abs()
    assert bool((plain > U[dtype] / 2 * exact.abs() + HALF_SUBNORMAL[dtype] / s).any())
    assert bool((decoded[x == 0] == 0).all())
    nan = torch.tensor([float("nan"), 1.0])
    assert torch.isnan(round_trip(fmt, nan, dtype)[0][0])


# --- COAT's per-group FP8 --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("expand", [True, False])
def test_group_fp8_round_trip_within_the_coat_bound(dtype, expand):
    # Per element: the code of y·s (y = (|x|/c)^k from the stored c, k, s, in FP64) rounds with
    # absolute error e ≤ max(u·|y·s|, half a subnormal spacing); decoding takes the k-th root,
    # so with δ = e/|y·s| the relative error of x is at most 1 − (1 − δ)^(1/k) (the downward
    # side is the larger). The FP32 arithmetic of encode/decode (pow, division, ·c) adds < 1e-5.
    generator = torch.Generator().manual_seed(0)
    n = 128 * 32
    x = (
        torch.randn(n, generator=generator, dtype=F64) * torch.exp(3 * torch.rand(n, generator=generator, dtype=F64))
    ).float()
    x[::53] = 0.0
    fmt = GroupFP8(dtype, 128, expand)
    decoded, (payload, scale, exponent, center) = round_trip(fmt, x)
    assert payload.dtype == dtype and scale.dtype == exponent.dtype == center.dtype == F32
    if expand:
        assert (exponent > 1).any()
    else:
        assert bits_equal(exponent, torch.ones(32)) and bits_equal(center, torch.ones(32))
    k, c, s = (t.double().repeat_interleave(128) for t in (exponent, center, scale))
    nonzero = x != 0
    exact = x.double()
    code = (exact.abs() / c).pow(k) * s
    e = torch.maximum(code * U[dtype], torch.full_like(code, HALF_SUBNORMAL[dtype]))
    bound = 1 - (1 - (e / code).clamp(max=1.0)).pow(1 / k) + 1e-5
    relative = (decoded.double() - exact).abs() / exact.abs()
    assert bool((relative[nonzero] <= bound[nonzero]).all()), (relative[nonzero] / bound[nonzero]).max().item()
    assert bool((decoded[~nonzero] == 0).all())


def test_group_fp8_edge_groups():
    fmt = GroupFP8(E4M3, 128, True)
    x = torch.randn(128 * 4, generator=torch.Generator().manual_seed(1))
    x[:128] = 0.0  # an all-zero group: s = k = c = 1, zeros back
    x[128:256] = 0.0
    x[200] = 3e-3  # one non-zero element: amin = amax, k = 1; it maps to the top code F
    x[300] = float("nan")  # a NaN group decodes to NaN, the others are untouched
    decoded, (_, scale, exponent, center) = round_trip(fmt, x)
    assert scale[0].item() == exponent[0].item() == center[0].item() == 1.0
    assert bits_equal(decoded[:128], torch.zeros(128))
    # s = F/amax is not a power of two: F/s = amax·(1 ± 2^-23)², two FP32 roundings.
    assert exponent[1].item() == 1.0 and decoded[200].item() == pytest.approx(x[200].item(), rel=2.0**-22, abs=0)
    assert bool((decoded[128:256][torch.arange(128) != 72] == 0).all())
    assert torch.isnan(decoded[256:384]).all()
    clean, _ = round_trip(fmt, torch.where(torch.isnan(x), 0.0, x))
    assert bits_equal(decoded[384:], clean[384:])


# --- blockwise 8-bit ---------------------------------------------------------------------------


def _gap_bound(normalized: torch.Tensor, signed: bool) -> torch.Tensor:
    """Half the gap between the two map values around each normalized value (FP64); beyond the
    map's ends (the signed map has no −1) the distance to the end code."""
    codes = torch.tensor(dynamic_map(signed), dtype=F64)
    upper = torch.searchsorted(codes, normalized).clamp(max=len(codes) - 1)
    lower = (upper - 1).clamp(min=0)
    hi, lo = codes[upper], codes[lower]
    inside = (normalized >= codes[0]) & (normalized <= codes[-1])
    below = codes[0] - normalized
    return torch.where(inside, (hi - lo) / 2, below.clamp(min=0))


def test_dynamic_maps():
    for signed in (True, False):
        codes = dynamic_map(signed)
        assert len(codes) == 256 and list(codes) == sorted(set(codes))
        assert 0.0 in codes and codes[-1] == 1.0
    # The map is FP64 arithmetic: each value takes ≤ 8 roundings of 2^-53 of quantities ≤ 2
    # (edges 0.1 + 0.9·i/n, their sum, the power of ten and the product), so it is within 2^-49
    # of the exact value, as is the expected value here: 2^-48 apart, 2^-47 relative to 0.99,
    # and a difference of two within 2^-48 is 2^-40 relative to a gap ≥ 0.9/128 > 2^-8. A map
    # computed in FP32 (2^-24 relative) fails these; pytest.approx's default 1e-6 did not.
    assert dynamic_map(True)[0] == pytest.approx(-(0.1 + 0.9 * 127 / 128), rel=2.0**-47, abs=0)
    assert min(dynamic_map(False)) == 0.0
    # Relative spacing of the top decade: 1/128 (signed) and 1/256 (unsigned) of 0.9.
    assert dynamic_map(True)[-2] - dynamic_map(True)[-3] == pytest.approx(0.9 / 64, rel=2.0**-40, abs=0)
    assert dynamic_map(False)[-2] - dynamic_map(False)[-3] == pytest.approx(0.9 / 128, rel=2.0**-40, abs=0)
    # The tensors a step decodes with (built from the values' FP32 bit patterns) are each value
    # rounded once to FP32. A midpoint is the FP32 mean of two neighbours: their sum rounded once
    # (halving is exact), within 2^-24 relative of the FP64 mean, and strictly between them.
    from hf_lowprec.optim.dynamic_maps import map_tensors

    for signed in (True, False):
        values, midpoints = map_tensors(signed, torch.device("cpu"))
        once = torch.tensor(dynamic_map(signed), dtype=F64).float()
        assert bits_equal(values, once)
        exact = (once[1:].double() + once[:-1].double()) / 2
        assert bool(((midpoints.double() - exact).abs() <= 2.0**-24 * exact.abs()).all())
        assert bool(((once[:-1] < midpoints) & (midpoints < once[1:])).all())


@pytest.mark.parametrize("signed", [True, False])
def test_blockwise_8bit_round_trip_within_half_a_code_gap(signed):
    # x̂ = map[code]·a with a = max|x| of the block and code the nearest map value to x/a:
    # |x̂ − x| ≤ (half the gap between the map values around x/a)·a, plus the FP32 roundings of
    # x/a, of the map values and of the product (each ≤ 2^-24 relative; 2^-21·a covers them).
    x = values(n=256 * 12 + 40, binades=12.0)  # not a multiple of the block: padded with zeros
    if not signed:
        x = x.abs()
    fmt = Blockwise8bit(signed, 256)
    decoded, (codes, absmax) = round_trip(fmt, x)
    assert codes.dtype == torch.uint8 and codes.numel() == 256 * 13 and absmax.shape == (13,)
    a = absmax.double().repeat_interleave(256)[: x.numel()]
    assert bits_equal(absmax[:12], x[: 256 * 12].view(12, 256).abs().amax(dim=1))
    exact = x.double()
    bound = _gap_bound(exact / a, signed) * a + 2.0**-21 * a
    error = (decoded.double() - exact).abs()
    assert bool((error <= bound).all()), (error / bound).max().item()
    # The code is the nearest map value (ties either way): no other is closer.
    table = torch.tensor(dynamic_map(signed), dtype=F64)
    nearest = (exact[:, None] / a[:, None] - table[None, :]).abs().min(dim=1).values * a
    assert bool((error <= nearest + 2.0**-21 * a).all())
    # The block maximum itself is exact (map value 1), and zeros stay zero.
    top = x.abs().argmax()
    if x[top] > 0:
        assert decoded[top] == x[top]
    assert bool((decoded[x == 0] == 0).all())


def test_blockwise_8bit_edge_blocks():
    fmt = Blockwise8bit(True, 256)
    x = torch.randn(256 * 4, generator=torch.Generator().manual_seed(2))
    x[:256] = 0.0  # all zeros: absmax 0, zero codes, zeros back
    x[300] = 1e30  # one huge value: it is exact, the rest of its block falls to the map's bottom
    x[600] = float("nan")  # NaN: the block decodes to NaN, the others are untouched
    decoded, (codes, absmax) = round_trip(fmt, x)
    assert absmax[0].item() == 0.0 and bits_equal(decoded[:256], torch.zeros(256))
    assert bool((codes[:256] == dynamic_map(True).index(0.0)).all())
    assert decoded[300] == x[300]  # the map's 1 times the absmax
    rest = torch.cat([decoded[256:300], decoded[301:512]]).double()
    smallest = min(abs(v) for v in dynamic_map(True) if v != 0) * 1e30
    # |x|/1e30 ≤ 4e-30 is below half the smallest code, so it rounds to 0.
    assert bool((rest == 0).all()) and smallest > 2 * 4.0
    assert torch.isnan(decoded[512:768]).all() and math.isnan(absmax[2].item())
    clean, _ = round_trip(fmt, torch.where(torch.isnan(x), 0.0, x))
    assert bits_equal(decoded[768:], clean[768:])


@pytest.mark.parametrize("signed", [True, False])
def test_blockwise_8bit_traced_holds_its_map_as_one_constant(signed):
    """Traced by dynamo with dynamic shapes (as the compiled optimizer steps are), a round trip's
    graph keeps the map tensor whole. `torch.tensor` of the 256 map values, read from a global,
    made each value a graph input (a 0-d tensor handed in at every call) and a stack of them,
    about 1,500 Inductor nodes per map: a collage-8bit optimizer step took minutes to compile. Dynamo only (no Inductor): the graph's inputs and
    node count, and the same bits as eager."""
    graphs: list[torch.fx.GraphModule] = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm

    fmt = Blockwise8bit(signed, 256)
    x = values(n=256 * 3, binades=12.0)
    x = x if signed else x.abs()
    traced = torch.compile(lambda r: round_trip(fmt, r), backend=count, fullgraph=True, dynamic=True)
    torch._dynamo.reset()
    decoded, stored = traced(x)
    eager, eager_stored = round_trip(fmt, x)
    assert bits_equal(decoded, eager) and all(bits_equal(a, b) for a, b in zip(stored, eager_stored))
    assert len(graphs) == 1
    inputs = [n for n in graphs[0].graph.nodes if n.op == "placeholder" and "example_value" in n.meta]
    tensors = [n for n in inputs if isinstance(n.meta["example_value"], torch.Tensor)]
    assert len(tensors) == 1, f"{len(tensors)} tensor inputs: the map's values are handed in one by one"
    nodes = len(graphs[0].graph.nodes)
    # The round trip is a few dozen ops; a map traced value by value adds 257 nodes per use.
    assert nodes < 100, f"{nodes} nodes: the map is traced element by element"


@pytest.mark.parametrize(
    ("fmt", "dtype"),
    [
        (Plain(), BF16),
        (Scaled(), F16),
        (Pair(Plain()), BF16),
        (Pair(Scaled()), F16),
        (GroupFP8(E4M3), F32),
        (Blockwise8bit(True), BF16),
        (Blockwise8bit(False), BF16),
    ],
)
def test_zeros_state_decodes_to_zero_and_counts_its_bytes(fmt, dtype):
    param = torch.zeros(300, dtype=dtype)
    stored = fmt.zeros(param)
    assert len(stored) == len(fmt.keys("exp_avg")) == len(fmt.like_param)
    assert bits_equal(fmt.decode(*stored).reshape(-1)[:300], torch.zeros(300))
    per_element = sum(t.numel() * t.element_size() for t in stored) / param.numel()
    # Stored bytes per element: the format's count, up to the padding to whole blocks and one
    # scalar scale.
    assert per_element >= fmt.bytes_per_element(dtype) - 1e-9
    assert per_element <= fmt.bytes_per_element(dtype) * (-(-300 // fmt.block) * fmt.block) / 300 + 4 / 300


# --- update rules ------------------------------------------------------------------------------


def _tiny_updates(n: int, steps: int, scale: float, seed: int = 0) -> list[torch.Tensor]:
    """FP32 updates of about `scale`, a drift plus noise, far below ulp(θ)/2 for θ ≈ 1."""
    generator = torch.Generator().manual_seed(seed)
    drift = torch.rand(n, generator=generator) - 0.5
    return [((drift + torch.rand(n, generator=generator) - 0.5) * scale).float() for _ in range(steps)]


def _half_ulp(magnitude: float, dtype: torch.dtype) -> float:
    """Half the spacing of `dtype` at `magnitude` (normal range): the largest rounding error there."""
    return 2.0 ** (math.floor(math.log2(magnitude)) - {BF16: 8, F16: 11}[dtype])


@pytest.mark.parametrize("rule", [Kahan(), Grow()], ids=["kahan", "grow"])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_compensated_rules_keep_the_exact_sum_of_tiny_updates(rule, dtype):
    # θ ∈ [1, 1.5) (ulp 2^(1−p)), 300 updates of |Δθ| < ulp(θ)/2: round to nearest loses
    # every one. θ + δθ instead changes by exactly the sum of what was rounded into it:
    # TwoSum and Fast2Sum are exact, so per step the only roundings are r(δθ + Δθ) (Kahan) or
    # r(Δθ) and r(δθ + e) (Grow), of magnitudes below ulp(θ)/2 + |Δθ|: each error is at most
    # half an ulp there, summed over the steps. (θ stays in (0.8, 1.7): ulp(θ)/2 ≤ 2^-p.)
    steps, n = 300, 2048
    scale = {BF16: 1e-3, F16: 1.5e-4}[dtype]  # max |Δθ| below ulp(1)/2: 2^-8 BF16, 2^-11 FP16
    generator = torch.Generator().manual_seed(1)
    theta0 = (1 + 0.5 * torch.rand(n, generator=generator)).to(dtype)
    updates = _tiny_updates(n, steps, scale)
    param = theta0.clone()
    (compensation,) = rule.zeros(param)
    exact = theta0.double()
    for delta in updates:
        rule.apply_(delta, param.float(), param, compensation)
        exact += delta.double()
    held = rule.held_value(param, {rule.compensation_key: compensation})
    assert bits_equal(held, param.double() + compensation.double())
    p = {BF16: 8, F16: 11}[dtype]
    largest = max(u.abs().max().item() for u in updates)
    per_step = _half_ulp(2.0**-p + largest, dtype) + (_half_ulp(largest, dtype) if isinstance(rule, Grow) else 0.0)
    bound = steps * (per_step + 2.0**-30)  # + the FP32 rounding of δθ + Δθ before its cast
    error = (held - exact).abs().max().item()
    assert error <= bound, (error, bound)
    # Round to nearest loses them: the same updates leave θ where it was.
    plain = theta0.clone()
    for delta in updates:
        Nearest().apply_(delta, plain.float(), plain)
    assert bits_equal(plain, theta0)
    assert (plain.double() - exact).abs().max().item() > 10 * bound


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_kahan_step_is_error_free_apart_from_one_rounding(dtype):
    # (θ', k') = TwoSum(θ, y) with y = r(k + Δθ): θ' + k' = θ + y exactly, in FP64.
    generator = torch.Generator().manual_seed(3)
    param = (torch.randn(4096, generator=generator)).to(dtype)
    param[:10] = 0.0  # |y| > |θ|: Fast2Sum would be wrong here, TwoSum is exact
    (compensation,) = Kahan().zeros(param)
    for delta in _tiny_updates(4096, 20, 1e-2):
        before = param.double() + 0.0
        y = (compensation.float() + delta).to(dtype).double()
        Kahan().apply_(delta, param.float(), param, compensation)
        assert bits_equal(param.double() + compensation.double(), before + y)


def _sr_draws(dtype: torch.dtype, target: torch.Tensor, seed: int) -> torch.Tensor:
    """SR(target) for every element with one seed (the bits differ per element)."""
    param = torch.zeros(target.shape, dtype=dtype)
    zero = torch.zeros_like(target)
    StochasticRounding().apply_(zero, target, param, seed=torch.tensor(seed))
    return param


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("fraction", [0.3, 0.9])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_stochastic_rounding_is_unbiased(dtype, fraction, sign):
    # target = x + f·ulp between neighbours x and x + ulp: each draw is one of the two, up with
    # probability f; over n draws the mean's standard deviation is ulp·√(f(1 − f)/n), and the
    # mean must be within 4σ of the target (a biased rounding, e.g. to nearest, is off by
    # ≥ 0.1·ulp, which is > 100σ here).
    n = 2**17
    x = 1.5 if dtype == BF16 else 0.75
    ulp = torch.finfo(dtype).eps * (1.0 if x >= 1 else 0.5)
    target = torch.full((n,), sign * (x + fraction * ulp), dtype=F32)
    result = _sr_draws(dtype, target, seed=11).double()
    assert set(result.unique().tolist()) <= {sign * x, sign * (x + ulp)}
    sigma = ulp * math.sqrt(fraction * (1 - fraction) / n)
    assert abs(result.mean().item() - target[0].item()) <= 4 * sigma
    # Another seed draws another stream; the same seed reproduces it.
    assert not bits_equal(result, _sr_draws(dtype, target, seed=12).double())
    assert bits_equal(result, _sr_draws(dtype, target, seed=11).double())


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_stochastic_rounding_is_unbiased_over_many_values(dtype):
    # Random targets over several binades: Σ(SR(x) − x) has standard deviation ≤ √(Σ ulp(x)²/4)
    # (each draw's variance is ulp²·f(1 − f) ≤ ulp²/4); it must stay within 4 of them.
    generator = torch.Generator().manual_seed(5)
    target = (torch.randn(2**17, generator=generator) * 10).float()
    result = _sr_draws(dtype, target, seed=3)
    down = target.to(dtype)
    up = torch.nextafter(down, torch.full_like(down, math.inf))
    below = torch.where(down.float() > target, torch.nextafter(down, torch.full_like(down, -math.inf)), down)
    above = torch.where(down.float() < target, up, down)
    assert bool(((result == below) | (result == above)).all())
    ulp = above.double() - below.double()
    total = (result.double() - target.double()).sum().item()
    assert abs(total) <= 4 * math.sqrt((ulp**2 / 4).sum().item())


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_stochastic_rounding_keeps_exact_values_and_rounds_the_rest_as_a_cast(dtype):
    limit = torch.finfo(dtype).max
    big = min(2 * limit, torch.finfo(F32).max)  # beyond the dtype's largest, finite in FP32
    target = torch.tensor([1.0, -0.5, 0.0, float("inf"), float("nan"), big, -big], dtype=F32)
    result = _sr_draws(dtype, target, seed=1)
    expected = target.to(dtype)
    assert bits_equal(result[:4], expected[:4]) and torch.isnan(result[4])
    assert bits_equal(result[5:], expected[5:])


def test_uniform_bits_are_32_bits_and_depend_on_the_seed():
    bits = uniform_bits(torch.Size([1 << 16]), torch.tensor(7), torch.device("cpu"))
    assert bits.dtype == torch.int64 and bits.min() >= 0 and bits.max() < 2**32
    # Each of the 32 bits is set about half the time (σ = 0.5/√n = 0.002; 4σ allowed).
    ones = torch.stack([(bits >> i) & 1 for i in range(32)]).double().mean(dim=1)
    assert bool(((ones - 0.5).abs() <= 4 * 0.5 / math.sqrt(1 << 16)).all())
    assert not bits_equal(bits, uniform_bits(torch.Size([1 << 16]), torch.tensor(8), torch.device("cpu")))


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_master_rule_keeps_the_fp32_master(dtype):
    # The master takes θ₃₂ + Δθ rounded once to FP32 (≤ 2^-24·|θ| per step, θ < 2), the weight
    # is r(master) after every step, and the held value is the master, not the weight.
    generator = torch.Generator().manual_seed(4)
    param = (1 + 0.5 * torch.rand(1024, generator=generator)).to(dtype)
    rule = Master()
    (master,) = rule.zeros(param)
    assert master.dtype == F32 and bits_equal(master, param.float())
    exact = param.double()
    updates = _tiny_updates(1024, 200, 1e-4)
    for delta in updates:
        rule.apply_(delta, rule.read(param, master), param, master)
        exact += delta.double()
        assert bits_equal(param, master.to(dtype))
    assert (master.double() - exact).abs().max().item() <= 200 * 2.0**-23
    held = rule.held_value(param, {"master": master})
    assert bits_equal(held, master.double())
    assert (param.double() - held).abs().max() > 1e-5  # the weight alone would not be the master


def test_fp16_neighbours_from_the_bit_pattern_match_nextafter_for_every_code() -> None:
    # Every finite FP16 code, both directions, eager and compiled: the stochastic rounding of
    # FP16 takes its neighbours from this function (compiled `nextafter` on FP16 returns x).
    import math

    from hf_lowprec.optim.rules import _next_fp16

    codes = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    finite = codes[torch.isfinite(codes)]
    for up in (True, False):
        expected = torch.nextafter(finite, torch.full_like(finite, math.inf if up else -math.inf)).float()
        keep = torch.isfinite(expected)  # ±max steps to ±inf, which the rounding never asks for
        assert bits_equal(_next_fp16(finite, up=up)[keep], expected[keep])
        compiled = torch.compile(lambda x, u=up: _next_fp16(x, up=u))(finite)
        assert bits_equal(compiled[keep], expected[keep])


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_dynamic_map_lookup_encodes_as_bucketize(signed):
    """The lookup-table encoding of the native kernels gives torch.bucketize's code for the floats
    that decide it: the first and last float of every 16-bit key (both signs), every midpoint
    and its neighbours 1 and 2 ulps away, ±0, ±inf, NaN, and random values over the map's
    decades and beyond."""
    from hf_lowprec.optim.dynamic_maps import dynamic_map_lookup, map_tensors

    _, midpoints = map_tensors(signed, torch.device("cpu"))
    values, mids, lookup, nan_code = dynamic_map_lookup(signed)
    keys = torch.arange(1 << 16, dtype=torch.int64) << 16
    edges = torch.cat([keys, keys | 0xFFFF]).to(torch.int32).view(torch.float32)
    near = midpoints.view(torch.int32)[:, None] + torch.tensor([-2, -1, 0, 1, 2], dtype=torch.int32)
    generator = torch.Generator().manual_seed(3)
    random = torch.randn(200_000, generator=generator) * torch.exp(
        torch.empty(200_000).uniform_(-20, 5, generator=generator)
    )
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1.0, -1.0])
    x = torch.cat([edges, near.view(torch.float32).reshape(-1), random, specials])
    key = (x.view(torch.int32) >> 16) & 0xFFFF
    base = lookup[key.long()].long()
    code = base + (mids[base] < x).long()
    code = torch.where(x.isnan(), nan_code, code)
    expected = torch.bucketize(x, midpoints)
    differ = code != expected
    assert not bool(differ.any()), (x[differ][:5].tolist(), code[differ][:5].tolist(), expected[differ][:5].tolist())
    assert torch.equal(values.view(torch.int32), map_tensors(signed, torch.device("cpu"))[0].view(torch.int32))
