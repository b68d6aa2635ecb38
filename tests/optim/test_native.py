"""The native CPU kernels (`hf_lowprec.optim.native`) against the references, on every ISA this CPU runs.

Bit for bit: each family's parameters and every state tensor equal the reference's, over several
steps with a different step count per tensor: the eager sequences below (`_adamw_reference` and
each family's update, the operation sequence the optimizers' reference path performs, with
PyTorch's own casts and the correctly rounded root `numerics.sqrt_rn`), the public optimizers on
their reference path (`fused="reference"`, `test_optimizers_reference_path_matches_native`),
`fp8_adamw.fp8_adamw_param_step` and `COATAdamW`; on data with the edges in it: zeros,
FP32 and BF16 subnormals, a finite gradient whose square overflows, ±inf and NaN gradients,
lengths that are odd, below one vector, not multiples of 16, and across blocks of the parallel
split. NaN lanes must be NaN on both sides (the bits of a NaN are not specified by the references).
Stochastic rounding uses the optimizers' counter-based stream (a hash of seed and index): its bits
are checked exactly against that stream applied to the reference's FP32 target, and its
statistics against FP64.

The tests call the kernels directly: a native path that did not run leaves the tensors at their
initial values and fails the comparison. The module is skipped (with the reason) only when no
compiler or ninja is available; a failed build fails.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from hf_lowprec.fp8.scaled import dequantize, pow2_scale, quantize, set_master_scale
from hf_lowprec.numerics import sqrt_rn
from hf_lowprec.optim import native
from hf_lowprec.optim.fp8_adamw import fp8_adamw_param_step

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# A machine without a compiler or ninja cannot build the kernels: every test here then fails with
# the reason (the build's own message included), never skips: the package depends on ninja and
# the project's machines have a C++ compiler, so an unavailable build is a defect to see.
_REASON = native.native_unavailable()


def test_the_extension_builds():
    assert _REASON is None, _REASON


def _cpu_isas() -> list[str]:
    """Every ISA this CPU runs, widest first (all are tested by default)."""
    assert _REASON is None, _REASON
    best = native.ISAS.index(native.best_isa())
    return list(native.ISAS[best:])


def _isa_param(isa: str):
    runs = _REASON is not None or isa in _cpu_isas()
    return pytest.param(isa, marks=pytest.mark.skipif(not runs, reason=f"this CPU lacks {isa}"))


ISAS = [_isa_param(isa) for isa in native.ISAS]

# Lengths: 1, below one AVX2 vector, odd, not multiples of 16, and one across two 32768-element
# blocks (run in parallel).
SIZES = [1, 7, 17, 257, 48 * 33, 70001]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
STEP_OFFSETS = [0, 4, 0, 99, 1, 0]  # a different step count per tensor


def _steps(step: int) -> list[int]:
    return [step + 1 + o for o in STEP_OFFSETS]


def _values(numel: int, generator: torch.Generator, scale: float) -> torch.Tensor:
    return torch.randn(numel, generator=generator) * scale


def _edge_params(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """Parameters with zeros, values near zero (|Δθ| > |θ|), BF16/FP32 subnormals and large values."""
    generator = torch.Generator().manual_seed(seed)
    params = [_values(n, generator, 1.0) for n in SIZES]
    flat = params[-1]
    flat[:5] = 0.0
    flat[5:40] = _values(35, generator, 1e-3)
    flat[40:45] = 3e4
    flat[45:50] = torch.tensor([1e-39, -1e-39, 1e-40, 5e-42, -2e-45])
    flat[50:55] = -0.0
    params[3][:3] = torch.tensor([0.0, 1e-39, -3e-40])
    return [p.to(dtype) for p in params]


def _edge_grads(step: int, dtype: torch.dtype, sizes: list[int] = SIZES) -> list[torch.Tensor]:
    """Gradients of `sizes` (at least 4 tensors, the last one over 110 elements) with zeros,
    subnormals, an all-zero tensor, a finite g whose g² overflows FP32 (BF16/FP32 only) and, on
    one step, ±inf and NaN."""
    generator = torch.Generator().manual_seed(1000 + step)
    grads = [_values(n, generator, 1e-2) for n in sizes]
    g = grads[-1]
    g[0] = 0.0
    g[1] = 1e30 if dtype != FP16 else 6e4
    g[2:6] = torch.tensor([1e-39, -1e-40, 1e-44, -0.0])
    g[100:110] = _values(10, generator, 1e-20)
    if step == 1:
        g[7], g[8], g[9] = math.inf, -math.inf, math.nan
    grads[3][5] = -1e30 if dtype != FP16 else -6e4
    grads[2].zero_()
    return [t.to(dtype) for t in grads]


def _moments(dtype: torch.dtype, seed: int = 7) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Non-zero starting moments (a zero v and subnormal v included)."""
    generator = torch.Generator().manual_seed(seed)
    ms = [_values(n, generator, 1e-2) for n in SIZES]
    vs = [_values(n, generator, 1e-2).square() for n in SIZES]
    vs[-1][:4] = torch.tensor([0.0, 1e-40, 1e-39, 3e38])
    return [m.to(dtype) for m in ms], [v.to(dtype) for v in vs]


def _clone(tensors):
    return [t.clone() for t in tensors]


def _same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bit equality, except that a NaN only has to be matched by a NaN."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    nan_a, nan_e = torch.isnan(actual.float()), torch.isnan(expected.float())
    assert torch.equal(nan_a, nan_e), f"{what}: NaN at different places"
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[actual.element_size()]
    differ = (actual.view(bits) != expected.view(bits)) & ~nan_a
    assert not bool(differ.any()), (
        f"{what}: {int(differ.sum())} elements differ, first at {int(differ.nonzero()[0])}: "
        f"{actual.view(-1)[differ.view(-1)][:3].tolist()} vs {expected.view(-1)[differ.view(-1)][:3].tolist()}"
    )


def _same_all(actual: list, expected: list, what: str) -> None:
    for index, (a, e) in enumerate(zip(actual, expected)):
        _same(a, e, f"{what}[{index}] (numel {a.numel()})")


def _scalars(steps):
    return native.adamw_scalars(steps, **HYPER)


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to `dtype` by PyTorch's cast and widened back to FP32."""
    return x.to(dtype).float()


def _adamw_reference(theta, grad, m, v, h, v_error=None):
    """The AdamW core on one tensor, eager, each FP32 operation rounded on its own; stores m, v
    (and δv) and returns Δθ₃₂. `h`: the six FP32 scalars (ONE_MINUS_BETA1, BETA2, ONE_MINUS_BETA2, STEP, EPS, DECAY).

    m₃₂ = m + ONE_MINUS_BETA1·(g − m); v₃₂ = min(v·BETA2 + (ONE_MINUS_BETA2·g)·g, max of v's dtype), v read as v + δv
    when δv is kept; Δθ = θ·DECAY + (STEP·m₃₂)/(√v₃₂ + EPS)."""
    w1, b2, omb2, step, eps, decay = h
    g = grad.float()
    m_old = m.float()
    v_old = v.float() if v_error is None else v.float() + v_error.float()
    m32 = m_old + w1 * (g - m_old)
    v32 = (v_old * b2 + (omb2 * g) * g).clamp(max=torch.finfo(v.dtype).max)
    delta = theta.float() * decay + (step * m32) / (sqrt_rn(v32) + eps)
    m.copy_(m32)
    v.copy_(v32)
    if v_error is not None:
        v_error.copy_(v32 - v.float())
    return delta


def _h(scalars: torch.Tensor, index: int) -> list[float]:
    return [float(x) for x in scalars[index]]  # exactly the FP32 values (Python floats hold them)


def _reference_delta(params, grads, ms, vs, steps, v_errors=None):
    scalars = _scalars(steps)
    errors = v_errors or [None] * len(params)
    return [
        _adamw_reference(p, g, m, v, _h(scalars, i), e)
        for i, (p, g, m, v, e) in enumerate(zip(params, grads, ms, vs, errors))
    ]


def _two_sum(a, b, dtype):
    """TwoSum in `dtype` arithmetic: s = r(a + b), bb = r(s − a), e = (b − bb) + (a − (s − bb))."""
    s = _round(a + b, dtype)
    bb = _round(s - a, dtype)
    return s, (b - bb) + (a - (s - bb))


def _grow_reference(param, param_error, delta):
    """(θ, δθ) ← Grow((θ, δθ), r(Δθ₃₂)): TwoSum, r(δθ + e), Fast2Sum, in θ's dtype."""
    dtype = param.dtype
    s, e = _two_sum(param.float(), _round(delta, dtype), dtype)
    b = _round(param_error.float() + e, dtype)
    total = _round(s + b, dtype)
    param.copy_(total)
    param_error.copy_(b + (s - total))


def _collage_reference(params, errors, grads, ms, vs, v_errors, steps):
    for p, e, d in zip(params, errors, _reference_delta(params, grads, ms, vs, steps, v_errors)):
        _grow_reference(p, e, d)


# --- AdamW: bf16-pure, FP32 states, FP32 -------------------------------------------------

ADAMW_DTYPES = [  # (param, grad, moments)
    (BF16, BF16, BF16),
    (BF16, FP32, BF16),
    (BF16, BF16, FP32),
    (FP16, FP16, FP32),
    (FP32, FP32, FP32),
    (FP32, BF16, FP32),
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtypes", ADAMW_DTYPES, ids=lambda d: "-".join(str(x).split(".")[1] for x in d))
def test_adamw_is_bit_identical(isa, dtypes):
    p_dtype, g_dtype, m_dtype = dtypes
    params = _edge_params(p_dtype)
    ms, vs = _moments(m_dtype)
    ref = [_clone(params), _clone(ms), _clone(vs)]
    for step in range(3):
        grads = _edge_grads(step, g_dtype)
        native.adamw_step(params, grads, ms, vs, _scalars(_steps(step)), isa=isa)
        delta = _reference_delta(ref[0], grads, ref[1], ref[2], _steps(step))
        for p, d in zip(ref[0], delta):
            p.add_(d)
        _same_all(params, ref[0], f"step {step} param")
        _same_all(ms, ref[1], f"step {step} exp_avg")
        _same_all(vs, ref[2], f"step {step} exp_avg_sq")


# --- Collage light / plus ------------------------------------------------------------------


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("variant", ["light", "plus"])
@pytest.mark.parametrize("g_dtype", [BF16, FP32], ids=["g-bf16", "g-fp32"])
def test_collage_is_bit_identical(isa, variant, g_dtype):
    params = _edge_params(BF16)
    generator = torch.Generator().manual_seed(3)
    errors = [(_values(p.numel(), generator, 1e-3) * p.float().abs()).to(BF16) for p in params]
    ms, vs = _moments(BF16)
    v_errors = [(v.float() * 1e-3).to(BF16) for v in vs] if variant == "plus" else None
    ref = [_clone(params), _clone(errors), _clone(ms), _clone(vs), None if v_errors is None else _clone(v_errors)]
    for step in range(3):
        grads = _edge_grads(step, g_dtype)
        native.collage_step(params, errors, grads, ms, vs, v_errors, _scalars(_steps(step)), isa=isa)
        _collage_reference(ref[0], ref[1], grads, ref[2], ref[3], ref[4], _steps(step))
        _same_all(params, ref[0], f"step {step} param")
        _same_all(errors, ref[1], f"step {step} param_error")
        _same_all(ms, ref[2], f"step {step} exp_avg")
        _same_all(vs, ref[3], f"step {step} exp_avg_sq")
        if v_errors is not None:
            _same_all(v_errors, ref[4], f"step {step} exp_avg_sq_error")


# --- Kahan ---------------------------------------------------------------------------------


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    "dtypes", [(BF16, BF16), (BF16, FP32), (FP16, FP32)], ids=["bf16", "bf16-fp32states", "fp16-fp32states"]
)
def test_kahan_is_bit_identical(isa, dtypes):
    p_dtype, m_dtype = dtypes
    params = _edge_params(p_dtype)
    generator = torch.Generator().manual_seed(5)
    comps = [(_values(p.numel(), generator, 1e-3) * p.float().abs()).to(p_dtype) for p in params]
    ms, vs = _moments(m_dtype)
    ref = [_clone(params), _clone(comps), _clone(ms), _clone(vs)]
    for step in range(3):
        grads = _edge_grads(step, p_dtype)
        native.kahan_step(params, comps, grads, ms, vs, _scalars(_steps(step)), isa=isa)
        delta = _reference_delta(ref[0], grads, ref[2], ref[3], _steps(step))
        for p, k, d in zip(ref[0], ref[1], delta):
            y = _round(k.float() + d, p.dtype)  # y = r(Δθ₃₂ + k), then (θ, k) ← TwoSum(θ, y)
            total, error = _two_sum(p.float(), y, p.dtype)
            p.copy_(total)
            k.copy_(error)
        _same_all(params, ref[0], f"step {step} param")
        _same_all(comps, ref[1], f"step {step} compensation")
        _same_all(ms, ref[2], f"step {step} exp_avg")
        _same_all(vs, ref[3], f"step {step} exp_avg_sq")


# --- master weights ------------------------------------------------------------------------


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("p_dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_master_weight_step_is_bit_identical(isa, p_dtype):
    masters = _edge_params(FP32)
    params = [m.to(p_dtype) for m in masters]
    ms, vs = _moments(FP32)
    ref = [_clone(params), _clone(masters), _clone(ms), _clone(vs)]
    for step in range(3):
        grads = _edge_grads(step, p_dtype)
        native.master_step(params, masters, grads, ms, vs, _scalars(_steps(step)), isa=isa)
        delta = _reference_delta(ref[1], grads, ref[2], ref[3], _steps(step))
        for master, d in zip(ref[1], delta):
            master.add_(d)
        torch._foreach_copy_(ref[0], ref[1])
        _same_all(params, ref[0], f"step {step} param")
        _same_all(masters, ref[1], f"step {step} master")
        _same_all(ms, ref[2], f"step {step} exp_avg")
        _same_all(vs, ref[3], f"step {step} exp_avg_sq")


# --- stochastic rounding -------------------------------------------------------------------


def _uniform_bits16(numel: int, seed: int) -> torch.Tensor:
    """The optimizers' counter-based stream: two multiply-xorshift rounds over index + seed·golden
    ratio (32-bit), its top 16 bits."""
    mask = 0xFFFFFFFF
    x = (torch.arange(numel, dtype=torch.int64) + seed * 0x9E3779B9) & mask
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & mask
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & mask
    return ((x ^ (x >> 16)) >> 16).to(torch.int32)


def _sr_expected(target: torch.Tensor, seed: int) -> torch.Tensor:
    """Stochastic rounding of an FP32 target to BF16 with that stream: add 16 random bits below
    BF16's significand and truncate; non-finite values and those beyond BF16's maximum to nearest."""
    bits = target.view(torch.int32) + _uniform_bits16(target.numel(), seed)
    rounded = (bits & -65536).view(torch.float32)
    plain = ~torch.isfinite(target) | (target.abs() > torch.finfo(BF16).max)
    return torch.where(plain, target, rounded).to(BF16)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m_dtype", [BF16, FP32], ids=["bf16-states", "fp32-states"])
def test_stochastic_rounding_is_the_reference_stream_bit_for_bit(isa, m_dtype):
    params = _edge_params(BF16)
    params[-1][60:70] = torch.tensor([3.3e38, -3.3e38] * 5).to(BF16)  # near BF16's maximum
    ms, vs = _moments(m_dtype)
    ref = [_clone(params), _clone(ms), _clone(vs)]
    for step in range(3):
        grads = _edge_grads(step, BF16)
        seeds = torch.arange(len(SIZES), dtype=torch.int64) * 7919 + 2**31 - 100 * step - 2
        native.sr_step(params, grads, ms, vs, _scalars(_steps(step)), seeds, isa=isa)
        delta = _reference_delta(ref[0], grads, ref[1], ref[2], _steps(step))
        for index, (p, d) in enumerate(zip(ref[0], delta)):
            p.copy_(_sr_expected(d + p.float(), int(seeds[index])))
        _same_all(params, ref[0], f"step {step} param")
        _same_all(ms, ref[1], f"step {step} exp_avg")
        _same_all(vs, ref[2], f"step {step} exp_avg_sq")


def test_stochastic_rounding_is_unbiased_and_bounded():
    """θ = 1 with an update of about −0.1 ulp: every result is one of the two BF16 neighbours of
    the target x = θ + Δθ₃₂, and the mean over 2^20 elements (summed in FP64) is x within 5
    standard deviations of a Bernoulli average, σ = ulp·√(p(1 − p)/n). x is the FP32 value the
    kernel rounds: the same step on an FP32 parameter (bit-identical to the reference above)."""
    n = 1 << 20
    scalars = native.adamw_scalars([1], lr=2.0**-8 * 0.1, beta1=0.9, beta2=0.999, eps=0.0, weight_decay=0.0)
    exact = [torch.ones(1)]
    native.adamw_step(exact, [torch.ones(1)], [torch.zeros(1)], [torch.zeros(1)], scalars)
    target = float(exact[0])
    param = torch.ones(n, dtype=BF16)
    state = [torch.zeros(n, dtype=BF16), torch.zeros(n, dtype=BF16)]
    native.sr_step([param], [torch.ones(n, dtype=BF16)], [state[0]], [state[1]], scalars, torch.tensor([12345]))
    low, high = 1.0 - 2.0**-8, 1.0  # the BF16 neighbours of x (ulp 2^-8 just below 1)
    assert low < target < high and target < 1.0 - 2.0**-12
    values = param.double()
    assert bool(((values == low) | (values == high)).all())
    p_low = (high - target) / (high - low)
    sigma = (high - low) * math.sqrt(p_low * (1 - p_low) / n)
    assert abs(values.mean().item() - target) < 5 * sigma


def test_stochastic_rounding_repeats_with_the_same_seed_and_differs_with_another():
    def run(seed: int) -> torch.Tensor:
        params = _edge_params(BF16)
        ms, vs = _moments(BF16)
        native.sr_step(params, _edge_grads(0, BF16), ms, vs, _scalars(_steps(0)), torch.full((len(SIZES),), seed))
        return params[-1]

    first, again, other = run(11), run(11), run(12)
    assert torch.equal(first.view(torch.int16), again.view(torch.int16))
    assert not torch.equal(first.view(torch.int16), other.view(torch.int16))


# --- FP8AdamW --------------------------------------------------------------------------------


def _fp8_setup(kind: str, seed: int = 0):
    """One FP8-LM O2 row set: scaled FP16 masters with E4M3 m / FP16 v, or FP32 params with
    FP32 states; every size of SIZES."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for n in SIZES:
        real = _values(n, generator, 0.05)
        if kind == "scaled":
            scale = pow2_scale(real.abs().amax(), FP16)
            param = quantize(real, scale, FP16)
            state = {
                "step": 0,
                "exp_avg": torch.zeros(n, dtype=torch.float8_e4m3fn),
                "exp_avg_scale": torch.ones(()),
                "exp_avg_sq": torch.zeros(n, dtype=FP16),
                "exp_avg_sq_scale": torch.ones(()),
            }
        else:
            scale, param = None, real
            state = {
                "step": 0,
                "exp_avg": torch.zeros(n),
                "exp_avg_scale": torch.ones(()),
                "exp_avg_sq": torch.zeros(n),
                "exp_avg_sq_scale": torch.ones(()),
            }
        rows.append([param, scale, state])
    return rows


def _fp8_grads(step: int, kind: str, clip: float):
    generator = torch.Generator().manual_seed(500 + step)
    out = []
    for index, n in enumerate(SIZES):
        g = _values(n, generator, 1e-3)
        g[0] = 0.0
        if index == 2 and step == 1:
            g.zero_()
        if kind == "scaled":
            scale = pow2_scale(g.abs().amax(), torch.float8_e4m3fn) * clip
            out.append((quantize(g, scale, torch.float8_e4m3fn), scale))
        else:
            out.append((g.to(BF16), None))
    return out


def _copy_rows(rows):
    return [
        [
            p.clone(),
            None if s is None else s.clone(),
            {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()},
        ]
        for p, s, st in rows
    ]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["scaled", "fp32"])
@pytest.mark.parametrize("clip", [1.0, 0.7], ids=["pow2", "clipped"])
def test_fp8_adamw_is_bit_identical(isa, kind, clip):
    rows = _fp8_setup(kind)
    ref = _copy_rows(rows)
    for step in range(4):
        grads = _fp8_grads(step, kind, clip)
        for row in rows:
            row[2]["step"] += 1
        scalars = _scalars([r[2]["step"] for r in rows])
        native.fp8_adamw_step(
            [r[0] for r in rows],
            [r[1] for r in rows],
            [g for g, _ in grads],
            [s for _, s in grads],
            [r[2]["exp_avg"] for r in rows],
            [r[2]["exp_avg_scale"] for r in rows],
            [r[2]["exp_avg_sq"] for r in rows],
            [r[2]["exp_avg_sq_scale"] for r in rows],
            scalars,
            margin=0,
            isa=isa,
        )
        for (param, scale, state), (g, g_scale) in zip(ref, grads):
            set_master_scale(param, scale)
            real_g = g.float() if g_scale is None else dequantize(g, g_scale)
            fp8_adamw_param_step(
                param,
                real_g,
                state,
                lr=HYPER["lr"],
                beta1=HYPER["beta1"],
                beta2=HYPER["beta2"],
                eps=HYPER["eps"],
                weight_decay=HYPER["weight_decay"],
                margin=0,
            )
        for index, ((p, s, st), (rp, rs, rst)) in enumerate(zip(rows, ref)):
            what = f"step {step} row {index}"
            _same(p, rp, f"{what} param")
            if s is not None:
                _same(s, rs, f"{what} master scale")
            for key in ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale"):
                _same(st[key], rst[key], f"{what} {key}")


@pytest.mark.parametrize("isa", ISAS)
def test_fp8_adamw_edges_follow_the_reference(isa):
    """FP8AdamW's kernel runs the composition core's arithmetic (`adamw_math`) at its edges too:
    a finite gradient whose square overflows FP32 leaves v at FP32's largest value (the
    reference's clamp, `Scaled.register_max`), not inf, and without weight decay θ·0 is still
    added (−0 + (+0) = +0 where θ = −0 and the step is −0). One step, FP32 master and moments,
    λ = 0, against `fp8_adamw_param_step` bit for bit."""
    param = torch.tensor([0.5, -0.0, 0.25, -1.0] * 4)
    grad = torch.tensor([1e30, -0.0, -3e25, 2e-3] * 4)
    state = {
        "step": 1,
        "exp_avg": torch.zeros(16),
        "exp_avg_scale": torch.ones(()),
        "exp_avg_sq": torch.zeros(16),
        "exp_avg_sq_scale": torch.ones(()),
    }
    ref_param, ref_state = param.clone(), {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
    hyper = {**HYPER, "weight_decay": 0.0}
    scalars = native.adamw_scalars([1], **hyper)
    native.fp8_adamw_step(
        [param], [None], [grad], [None], [state["exp_avg"]], [state["exp_avg_scale"]],
        [state["exp_avg_sq"]], [state["exp_avg_sq_scale"]], scalars, isa=isa,
    )  # fmt: skip
    ref_state["step"] = 0
    fp8_adamw_param_step(
        ref_param, grad, ref_state, lr=hyper["lr"], beta1=hyper["beta1"], beta2=hyper["beta2"], eps=hyper["eps"],
        weight_decay=0.0, margin=0,
    )  # fmt: skip
    assert ref_state["exp_avg_sq"][0] == torch.finfo(FP32).max  # the edge is reached
    _same(param, ref_param, "param")
    _same(state["exp_avg_sq"], ref_state["exp_avg_sq"], "exp_avg_sq")
    _same(state["exp_avg"], ref_state["exp_avg"], "exp_avg")


# --- the ISA switch, errors ----------------------------------------------------------------


def test_forced_isa_by_environment_runs_that_isa():
    """HF_LOWPREC_CPU_ISA picks the kernels (checked in a fresh process); an unknown value or an
    ISA the CPU lacks is refused with the fix, before any work."""
    code = (
        "import torch; from hf_lowprec.optim import native; print(native.isa());"
        "p = [torch.ones(37, dtype=torch.bfloat16)]; g = [torch.full((37,), 0.5, dtype=torch.bfloat16)];"
        "m = [torch.zeros(37, dtype=torch.bfloat16)]; v = [torch.zeros(37, dtype=torch.bfloat16)];"
        "native.adamw_step(p, g, m, v, native.adamw_scalars([1], lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, "
        "weight_decay=0.0)); print(p[0][0].item())"
    )
    for isa in _cpu_isas():
        env = {**os.environ, native.ISA_ENV: isa}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout.split()
        assert out[0] == isa and float(out[1]) < 1.0
    bad = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, native.ISA_ENV: "sse9"}, capture_output=True, text=True
    )
    assert bad.returncode != 0 and "choose one of avx512_bf16, avx512, avx2, scalar" in bad.stderr
    lacked = [isa for isa in native.ISAS if isa not in _cpu_isas()]
    if lacked:  # the widest ISA this CPU lacks
        lacking = subprocess.run(
            [sys.executable, "-c", code], env={**os.environ, native.ISA_ENV: lacked[-1]}, capture_output=True, text=True
        )
        assert lacking.returncode != 0 and "which this CPU lacks" in lacking.stderr


def test_bad_arguments_are_refused_before_any_work():
    params = [torch.ones(10, dtype=BF16), torch.ones(12, dtype=BF16)]
    before = [p.clone() for p in params]
    grads = [torch.ones(10, dtype=BF16), torch.ones(11, dtype=BF16)]
    ms = [torch.zeros(10, dtype=BF16), torch.zeros(12, dtype=BF16)]
    vs = [torch.zeros(10, dtype=BF16), torch.zeros(12, dtype=BF16)]
    scalars = _scalars([1, 1])
    with pytest.raises(RuntimeError, match=r"grad\[1\] has 11 elements"):
        native.adamw_step(params, grads, ms, vs, scalars)
    grads[1] = torch.ones(12, dtype=BF16)
    with pytest.raises(RuntimeError, match="shape \\(2, 6\\)"):
        native.adamw_step(params, grads, ms, vs, scalars[:1])
    with pytest.raises(RuntimeError, match="not contiguous"):
        native.adamw_step(params, [grads[0], torch.ones(24, dtype=BF16)[::2]], ms, vs, scalars)
    with pytest.raises(RuntimeError, match="no native kernel for \\(plain, plain, nearest\\) with θ float16"):
        native.adamw_step([p.half() for p in params], grads, [m.half() for m in ms], [v.half() for v in vs], scalars)
    with pytest.raises(RuntimeError, match="m bfloat16, v float32"):
        native.adamw_step(params, grads, ms, [v.float() for v in vs], scalars)
    for p, b in zip(params, before):
        assert torch.equal(p, b)


# --- COAT ------------------------------------------------------------------------------------

COAT_SIZES = [7, 640, 1584, 70001]  # a partial group alone, whole groups, partial last groups


def _coat_grads(step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(2000 + step)
    grads = [_values(n, generator, 1e-2) for n in COAT_SIZES]
    grads[-1][:3] = torch.tensor([0.0, 1e30, -1e-39])
    grads[1][:128] = 0.0  # an all-zero group
    if step == 1:
        grads[2][200] = math.nan  # poisons its group: NaN scale, NaN from then on
    return [g.to(dtype) for g in grads]


def _coat_pair(dtype: torch.dtype, v_format: str, expand: bool):
    """A reference COATAdamW (foreach) and native state for the same parameters."""
    from hf_lowprec.optim import COATAdamW
    from hf_lowprec.optim.coat_adamw import FP8GroupState

    generator = torch.Generator().manual_seed(9)
    params = [_values(n, generator, 1.0).to(dtype) for n in COAT_SIZES]
    ref = [p.clone().requires_grad_() for p in params]
    optimizer = COATAdamW(
        ref,
        exp_avg_sq_format=v_format,
        expand=expand,
        fused="reference",
        lr=HYPER["lr"],
        betas=(HYPER["beta1"], HYPER["beta2"]),
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
    )
    v_dtype = torch.float8_e4m3fn if v_format == "e4m3" else torch.float8_e5m2
    ms = [FP8GroupState.zeros(p.shape, expand=expand) for p in params]
    vs = [FP8GroupState.zeros(p.shape, fp8_dtype=v_dtype, expand=expand) for p in params]
    errors = None if dtype == FP32 else [torch.zeros_like(p) for p in params]
    return params, errors, ms, vs, ref, optimizer


def _coat_state_fields(state: dict, key: str) -> list[torch.Tensor]:
    return [state[key], state[f"{key}_scale"], state[f"{key}_exponent"], state[f"{key}_center"]]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32-master", "bf16-grow"])
@pytest.mark.parametrize("v_format", ["e4m3", "e5m2"])
@pytest.mark.parametrize("expand", [False, True], ids=["plain-groups", "range-expansion"])
def test_coat_is_bit_identical(isa, dtype, v_format, expand):
    params, errors, ms, vs, ref, optimizer = _coat_pair(dtype, v_format, expand=expand)
    for step in range(3):
        grads = _coat_grads(step, dtype)
        native.coat_step(params, errors, grads, ms, vs, _scalars([step + 1] * len(params)), expand=expand, isa=isa)
        for r, g in zip(ref, grads):
            r.grad = g
        optimizer.step()
        for index, (p, r) in enumerate(zip(params, ref)):
            what = f"step {step} tensor {index}"
            state = optimizer.state[r]
            _same(p, r.detach(), f"{what} param")
            if errors is not None:
                _same(errors[index], state["param_error"], f"{what} param_error")
            for key, mine in (("exp_avg", ms[index]), ("exp_avg_sq", vs[index])):
                fields = [mine.payload, mine.scale, mine.exponent, mine.center]
                for name, a, e in zip(
                    ("payload", "scale", "exponent", "center"), fields, _coat_state_fields(state, key)
                ):
                    _same(a, e, f"{what} {key} {name}")
    if expand:  # the powers really ran: groups with k > 1 in both moments
        assert all(max(float(x.exponent.max()) for x in states) > 1 for states in (ms, vs))


def _decode64(payload: torch.Tensor, scale, exponent, center, numel: int) -> torch.Tensor:
    """A group state decoded in FP64: sign(y)·|y|^(1/k)·c, y = q/s."""
    groups = scale.numel()
    y = payload.double().view(groups, -1) / scale.double()[:, None]
    x = y.abs().pow(1.0 / exponent.double()[:, None]) * center.double()[:, None]
    return x.copysign(y).view(-1)[:numel]


def _fp8_half_ulp(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of `dtype` (E4M3/E5M2) codes at |y| (FP64), subnormals included."""
    mantissa, min_exp = (3, -6) if dtype == torch.float8_e4m3fn else (2, -14)
    exponent = torch.floor(torch.log2(y.abs().clamp_min(2.0**min_exp)))
    return torch.exp2(exponent - mantissa - 1)


def _quantization_interval(x64, slack, scale, exponent, center, dtype, group, keep_nonzero=False):
    """Bounds on |decode(encode(x))| for |x| within x64 ± slack, given the group's (s, k, c):
    the encoded y = (|x|/c)^k·s moves to a code within half an FP8 spacing (plus 2^-16
    relative for the FP32 evaluation), then decodes through (·/s)^(1/k)·c; FP64 throughout.
    `keep_nonzero` (the second moment): a non-zero y may also take the smallest code."""
    s = scale.double()[group]
    k = exponent.double()[group]
    c = center.double()[group]
    lo = ((x64.abs() - slack).clamp_min(0) / c).pow(k) * s
    hi = ((x64.abs() + slack) / c).pow(k) * s
    lo = (lo - _fp8_half_ulp(lo, dtype)).clamp_min(0) * (1 - 2.0**-16)
    hi = (hi + _fp8_half_ulp(hi, dtype)) * (1 + 2.0**-16)
    if keep_nonzero:
        smallest = 2.0 ** (-9 if dtype == torch.float8_e4m3fn else -16)
        hi = torch.where(x64.abs() + slack > 0, hi.clamp_min(smallest * (1 + 2.0**-16)), hi)
    return (lo / s).pow(1 / k) * c * (1 - 2.0**-16), (hi / s).pow(1 / k) * c * (1 + 2.0**-16)


@pytest.mark.parametrize("isa", ISAS)
def test_coat_with_expansion_is_within_the_fp64_bounds(isa):
    """With range expansion the native powers are not PyTorch's `pow` (a few FP32 ulps): from
    the same state, one step of the native kernel and of the reference are both checked against
    FP64 (the decoded old state, the AdamW update and θ in FP64):

    - θ: |θ − θ₆₄| ≤ 2^-16·(|s|·(|m_old| + |g|)/(√v + ε') + |Δθ₆₄|) + ulp(θ₆₄): FP32 rounding of
      the moment update (its cancellation is absolute, in |m_old| + |g|), of the decoded moments
      (a few ulps from the powers), the root and the division, then the add;
    - each decoded new moment within the quantization interval of its FP64 value (half an FP8
      spacing of y = (|x|/c)^k·s, with the group's own (s, k, c) and the same FP32 slack);
    - the exponents k: the same as the reference's in at least 99% of the groups (the moments'
      smallest non-zero value, which sets k and c, can come from a cancellation)."""
    params, _, ms, vs, ref, optimizer = _coat_pair(FP32, "e4m3", expand=True)
    for step in range(2):  # the second step starts from a non-trivial reference state
        grads = _coat_grads(step, FP32)
        for r, g in zip(ref, grads):
            r.grad = g
        if step == 1:
            states = [optimizer.state[r] for r in ref]
            for m, v, state, p, r in zip(ms, vs, states, params, ref):
                for mine, key in ((m, "exp_avg"), (v, "exp_avg_sq")):
                    for target, source in zip(
                        (mine.payload, mine.scale, mine.exponent, mine.center), _coat_state_fields(state, key)
                    ):
                        target.copy_(source)
                p.copy_(r.detach())
            before = [
                (
                    p.double(),
                    [f.clone() for f in _coat_state_fields(s, "exp_avg")],
                    [f.clone() for f in _coat_state_fields(s, "exp_avg_sq")],
                )
                for p, s in zip(params, states)
            ]
            native.coat_step(params, None, grads, ms, vs, _scalars([2] * len(params)), expand=True, isa=isa)
        optimizer.step()
    h = _scalars([2])[0].double()
    groups_total, k_same = 0, 0
    for index, ((theta, m_fields, v_fields), g, p, r) in enumerate(zip(before, grads, params, ref)):
        n = theta.numel()
        finite = torch.isfinite(g)
        g64 = g.double()
        m_old = _decode64(*m_fields, n)
        v_old = _decode64(*v_fields, n)
        m64 = m_old + h[0] * (g64 - m_old)
        v64 = (v_old * h[1] + h[2] * g64 * g64).clamp_max(torch.finfo(FP32).max)
        den = v64.sqrt() + h[4]
        delta = theta * h[5] + h[3] * m64 / den
        theta64 = theta + delta
        ulp = torch.finfo(FP32).eps * theta64.abs().clamp_min(torch.finfo(FP32).tiny)
        tol = 2.0**-16 * (h[3].abs() * (m_old.abs() + g64.abs()) / den + delta.abs()) + ulp
        ok = finite & torch.isfinite(theta64)
        for name, got in (("native", p), ("reference", r.detach())):
            error = (got.double() - theta64).abs()
            assert bool((error[ok] <= tol[ok]).all()), (
                f"{name} θ of tensor {index}: {(error / tol)[ok].max():.3g} × the bound"
            )
        group = torch.arange(n) // 128
        slack_m = 2.0**-16 * (m_old.abs() + g64.abs())
        slack_v = 2.0**-16 * (v_old.abs() + h[2] * g64 * g64)
        good_groups = torch.isfinite(ms[index].scale)
        usable = good_groups[group] & finite
        for name, fields in (("native", None), ("reference", optimizer.state[r])):
            for key, x64, slack, state in (
                ("exp_avg", m64, slack_m, ms[index]),
                ("exp_avg_sq", v64, slack_v, vs[index]),
            ):
                stored = (
                    [state.payload, state.scale, state.exponent, state.center]
                    if fields is None
                    else _coat_state_fields(fields, key)
                )
                dtype = stored[0].dtype
                decoded = _decode64(*stored, n).abs()
                lo, hi = _quantization_interval(x64, slack, *stored[1:], dtype, group, key == "exp_avg_sq")
                inside = (decoded >= lo) & (decoded <= hi)
                assert bool(inside[usable].all()), (
                    f"{name} {key} of tensor {index}: {int((~inside & usable).sum())} outside"
                )
        groups_total += ms[index].exponent.numel() + vs[index].exponent.numel()
        k_same += int((ms[index].exponent == optimizer.state[r]["exp_avg_exponent"]).sum())
        k_same += int((vs[index].exponent == optimizer.state[r]["exp_avg_sq_exponent"]).sum())
    assert k_same >= 0.99 * groups_total


# --- the public optimizers' reference path -----------------------------------------------------

# family: (optimizer class name, options, moment dtype, extra state keys in the native call's order)
OPTIMIZER_FAMILIES = {
    "bf16-pure": ("PlainAdamW", {}, BF16, ()),
    "bf16-fp32states": ("FP32StatesAdamW", {}, FP32, ()),
    "collage-light": ("CollageAdamW", {"variant": "light"}, BF16, ("param_error",)),
    "collage-plus": ("CollageAdamW", {"variant": "plus"}, BF16, ("param_error", "exp_avg_sq_error")),
    "bf16-kahan": ("KahanAdamW", {}, BF16, ("compensation",)),
    "master-weights": ("MasterWeightAdamW", {}, FP32, ("master",)),
}


@pytest.mark.parametrize("family", list(OPTIMIZER_FAMILIES))
def test_optimizers_reference_path_matches_native(family):
    """Each family's optimizer on its reference path (`fused="reference"`), three steps on the edge
    data, against the native kernel from the same zero state: every state tensor, bit for bit."""
    from hf_lowprec import optim

    name, options, m_dtype, extra_keys = OPTIMIZER_FAMILIES[family]
    params = _edge_params(BF16)
    ref = [p.clone().requires_grad_() for p in params]
    cls = getattr(optim, name, None)
    if cls is None:  # before the optimizer core exported it from hf_lowprec.optim
        from hf_lowprec.optim import fp16

        cls = getattr(fp16, name)
    optimizer = cls(
        ref,
        lr=HYPER["lr"],
        betas=(HYPER["beta1"], HYPER["beta2"]),
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
        fused="reference",
        **options,
    )
    ms = [torch.zeros_like(p, dtype=m_dtype) for p in params]
    vs = [torch.zeros_like(p, dtype=m_dtype) for p in params]
    extras = {key: [p.float() if key == "master" else torch.zeros_like(p) for p in params] for key in extra_keys}
    for step in range(3):
        grads = _edge_grads(step, BF16)
        for r, g in zip(ref, grads):
            r.grad = g
        optimizer.step()
        scalars = _scalars([step + 1] * len(params))
        if family in ("bf16-pure", "bf16-fp32states"):
            native.adamw_step(params, grads, ms, vs, scalars)
        elif family.startswith("collage"):
            native.collage_step(params, extras["param_error"], grads, ms, vs, extras.get("exp_avg_sq_error"), scalars)
        elif family == "bf16-kahan":
            native.kahan_step(params, extras["compensation"], grads, ms, vs, scalars)
        else:
            native.master_step(params, extras["master"], grads, ms, vs, scalars)
        for index, r in enumerate(ref):
            state = optimizer.state[r]
            what = f"{family} step {step} tensor {index}"
            _same(params[index], r.detach(), f"{what} param")
            _same(ms[index], state["exp_avg"], f"{what} exp_avg")
            _same(vs[index], state["exp_avg_sq"], f"{what} exp_avg_sq")
            for key in extra_keys:
                _same(extras[key][index], state[key], f"{what} {key}")


# --- threads -------------------------------------------------------------------------------

# Bucket sizes that split into many 32768-element blocks, unevenly over the threads.
_THREAD_SIZES = [70001, 200003, 33, 131072, 98305]


def _thread_bucket(family: str) -> dict:
    """Fresh state for one family's kernel on `_THREAD_SIZES` (random, seeded)."""
    gen = torch.Generator().manual_seed(11)
    rand = lambda scale, dtype: [(_values(n, gen, scale)).to(dtype) for n in _THREAD_SIZES]  # noqa: E731
    if family == "fp8adamw":
        real = rand(1.0, FP32)
        master_scales = [pow2_scale(r.abs().amax(), FP16) for r in real]
        grads = rand(1e-2, FP32)
        grad_scales = [pow2_scale(g.abs().amax(), torch.float8_e4m3fn) for g in grads]
        return dict(
            params=[quantize(r, s, FP16) for r, s in zip(real, master_scales)],
            master_scales=master_scales,
            grads=[quantize(g, s, torch.float8_e4m3fn) for g, s in zip(grads, grad_scales)],
            grad_scales=grad_scales,
            exp_avgs=[x.to(torch.float8_e4m3fn) for x in rand(1e-2, FP32)],
            exp_avg_scales=[torch.ones(()) for _ in _THREAD_SIZES],
            exp_avg_sqs=[x.square().to(FP16) for x in rand(1e-2, FP32)],
            exp_avg_sq_scales=[torch.ones(()) for _ in _THREAD_SIZES],
        )
    if family == "eightbit":
        from hf_lowprec.optim.formats import Blockwise8bit

        params = rand(1.0, BF16)
        return dict(
            params=params,
            errors=[torch.zeros_like(p) for p in params],
            grads=rand(1e-2, BF16),
            m=[Blockwise8bit(True).zeros(p) for p in params],
            v=[Blockwise8bit(False).zeros(p) for p in params],
        )
    if family == "coat":
        from hf_lowprec.optim.coat_adamw import FP8GroupState

        return dict(
            params=rand(1.0, FP32),
            grads=rand(1e-2, FP32),
            m=[FP8GroupState.zeros((n,), device="cpu") for n in _THREAD_SIZES],
            v=[FP8GroupState.zeros((n,), device="cpu") for n in _THREAD_SIZES],
        )
    moments = FP32 if family in ("master", "fp32states") else BF16
    bucket = dict(
        params=rand(1.0, BF16),
        grads=rand(1e-2, BF16),
        ms=rand(1e-2, moments),
        vs=[x.square() for x in rand(1e-2, moments)],
        extra=rand(1e-3, FP32 if family == "master" else BF16),
        extra2=rand(1e-5, moments),
    )
    return bucket


def _thread_step(family: str, b: dict, step: int) -> list[torch.Tensor]:
    """One step of `family` on bucket `b`; returns every tensor the step writes."""
    scalars = _scalars([step + 1 + i for i in range(len(_THREAD_SIZES))])
    if family == "fp8adamw":
        native.fp8_adamw_step(
            b["params"], b["master_scales"], b["grads"], b["grad_scales"], b["exp_avgs"], b["exp_avg_scales"],
            b["exp_avg_sqs"], b["exp_avg_sq_scales"], scalars,
        )  # fmt: skip
        return [*b["params"], *b["master_scales"], *b["exp_avgs"], *b["exp_avg_scales"], *b["exp_avg_sqs"]]
    if family == "eightbit":
        m_codes, m_absmax = zip(*b["m"])
        v_codes, v_absmax = zip(*b["v"])
        native.eightbit_step(b["params"], b["errors"], b["grads"], m_codes, m_absmax, v_codes, v_absmax, scalars)
        return [*b["params"], *b["errors"], *m_codes, *m_absmax, *v_codes, *v_absmax]
    if family == "coat":
        native.coat_step(b["params"], None, b["grads"], b["m"], b["v"], scalars, expand=True)
        states = [f for s in b["m"] + b["v"] for f in (s.payload, s.scale, s.exponent, s.center)]
        return [*b["params"], *states]
    p, g, m, v, x = b["params"], b["grads"], b["ms"], b["vs"], b["extra"]
    if family in ("bf16-pure", "fp32states"):
        native.adamw_step(p, g, m, v, scalars)
    elif family == "collage-plus":
        native.collage_step(p, x, g, m, v, b["extra2"], scalars)
    elif family == "kahan":
        native.kahan_step(p, x, g, m, v, scalars)
    elif family == "sr":
        native.sr_step(p, g, m, v, scalars, torch.arange(len(p)) * 7919 + step)
    elif family == "master":
        native.master_step(p, x, g, m, v, scalars)
    return [*p, *m, *v, *x, *b["extra2"]]


@pytest.mark.parametrize(
    "family", ["bf16-pure", "fp32states", "collage-plus", "kahan", "sr", "master", "fp8adamw", "coat", "eightbit"]
)
def test_results_do_not_depend_on_the_thread_count(family):
    """The same bucket stepped at 1 thread and at 2 (the blocks of the parallel split land on
    different threads): every written tensor equal bit for bit, three steps."""
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            bucket = _thread_bucket(family)
            results.append([t.clone() for step in range(3) for t in _thread_step(family, bucket, step)])
    finally:
        torch.set_num_threads(before)
    _same_all(results[1], results[0], f"{family} at 2 threads vs 1")


# --- blockwise 8-bit (collage-8bit) ---------------------------------------------------------

# Lengths: below a block, one block, a partial last block, several blocks across the parallel split.
EIGHTBIT_SIZES = [1, 7, 256, 300, 4113, 70001]


def _eightbit_pair(dtype: torch.dtype, block_size: int):
    """A reference Collage8bitAdamW and native state for the same parameters."""
    from hf_lowprec.optim import Collage8bitAdamW
    from hf_lowprec.optim.formats import Blockwise8bit

    generator = torch.Generator().manual_seed(5)
    params = [_values(n, generator, 1.0).to(dtype) for n in EIGHTBIT_SIZES]
    params[-1][:3] = 0.0
    ref = [p.clone().requires_grad_() for p in params]
    optimizer = Collage8bitAdamW(
        ref,
        block_size=block_size,
        fused="reference",
        lr=HYPER["lr"],
        betas=(HYPER["beta1"], HYPER["beta2"]),
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
    )
    m = [Blockwise8bit(True, block_size).zeros(p) for p in params]
    v = [Blockwise8bit(False, block_size).zeros(p) for p in params]
    errors = [torch.zeros_like(p) for p in params]
    return params, errors, m, v, ref, optimizer


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("block_size", [256, 64])
def test_eightbit_is_bit_identical(isa, dtype, block_size):
    """Codes, absmax, θ and δθ equal the reference's over four steps, with the edge gradients
    (zeros, subnormals, a square that overflows, ±inf and NaN on one step: NaN blocks)."""
    params, errors, m, v, ref, optimizer = _eightbit_pair(dtype, block_size)
    for step in range(4):
        grads = _edge_grads(step, dtype, EIGHTBIT_SIZES)
        native.eightbit_step(
            params,
            errors,
            grads,
            [c for c, _ in m],
            [a for _, a in m],
            [c for c, _ in v],
            [a for _, a in v],
            _scalars([step + 1] * len(params)),
            block_size=block_size,
            isa=isa,
        )
        for r, g in zip(ref, grads):
            r.grad = g
        optimizer.step()
        for index, (p, r) in enumerate(zip(params, ref)):
            what = f"step {step} tensor {index}"
            state = optimizer.state[r]
            _same(p, r.detach(), f"{what} param")
            _same(errors[index], state["param_error"], f"{what} param_error")
            _same(m[index][0], state["exp_avg"], f"{what} exp_avg codes")
            _same(m[index][1], state["exp_avg_absmax"], f"{what} exp_avg absmax")
            _same(v[index][0], state["exp_avg_sq"], f"{what} exp_avg_sq codes")
            _same(v[index][1], state["exp_avg_sq_absmax"], f"{what} exp_avg_sq absmax")
    finite = [bool(a.isfinite().all()) for _, a in m]
    assert not all(finite) and any(finite), "the data must hold both NaN blocks and finite ones"


def test_a_family_runs_natively_only_where_both_sides_declare_it():
    """A composition reaches the kernels through its declaration (`native.declaration`: the
    formats' and rule's `native_name`); the C++ side runs the declarations listed in its
    `Families`. A format without a kernel is named in Python; a declarable composition the C++
    list lacks (Kahan over a Collage-plus pair) is refused by `native.check` before any work,
    naming where families are listed; a declared one is accepted."""
    from hf_lowprec.optim.formats import Pair, Plain, Scaled
    from hf_lowprec.optim.rules import Grow, Kahan

    assert "Pair(" in native.declaration(Plain(), Pair(Scaled()), Grow())
    n = 40
    named = {
        "param": [torch.zeros(n, dtype=BF16)],
        "grad": [torch.ones(n, dtype=BF16)],
        "exp_avg": [torch.zeros(n, dtype=BF16)],
        "exp_avg_sq": [torch.zeros(n, dtype=BF16)],
        "exp_avg_sq_error": [torch.zeros(n, dtype=BF16)],
        "compensation": [torch.zeros(n, dtype=BF16)],
    }
    scalars = _scalars([1])
    reason = native.check(native.declaration(Plain(), Pair(), Kahan()), named, scalars)
    assert reason is not None and "no native kernel for (plain, pair, kahan)" in reason and "Families" in reason
    before = named["param"][0].clone()
    with pytest.raises(RuntimeError, match="no native kernel"):
        native.step(native.declaration(Plain(), Pair(), Kahan()), named, scalars)
    assert torch.equal(named["param"][0], before)
    named["param_error"] = named.pop("compensation")
    assert native.check(native.declaration(Plain(), Pair(), Grow()), named, scalars) is None
    named["stray"] = [torch.zeros(n)]
    assert "does not read 'stray'" in native.check(native.declaration(Plain(), Pair(), Grow()), named, scalars)
