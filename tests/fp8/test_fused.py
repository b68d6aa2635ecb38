"""One compiled pass per FP8 operand (hf_lowprec.fp8.fused): the compiled graph gives the eager
reference's bits, and the reference is the rule `fp8.scaled` states piece by piece."""

import pytest
import torch

from hf_lowprec import compiling
from hf_lowprec.fp8 import cast, fused
from hf_lowprec.fp8.scaled import dequantize, pow2_scale, quantize, quantize_counting, tensor_amax
from tests.helpers import bits, bits_equal, gamma

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _inputs():
    gen = torch.Generator().manual_seed(0)
    yield torch.randn(64, 48, generator=gen) * 1e-3
    yield (torch.randn(1000, generator=gen) * 50).bfloat16()
    yield torch.randn(3, 77, generator=gen).half()
    yield torch.randn(5, generator=gen) * 1e30  # amax·s near FP32's top
    yield torch.randn(8, generator=gen) * 1e-38  # subnormal FP32 inputs
    yield torch.zeros(33)  # amax 0: s = 1
    yield torch.tensor([1.0, float("inf"), -2.0])
    yield torch.tensor([float("nan"), 2.0])
    # Ties of the cast: 448 and 480 are E4M3 neighbours, amax 480 puts x = 464 on their midpoint.
    yield torch.tensor([464.0, -464.0, 480.0, 3.0, -0.0])


def _same(got, want):
    return all(bits_equal(bits(g), bits(w)) for g, w in zip(got, want))


@pytest.fixture
def compiled_calls(monkeypatch):
    """The functions `run_fused` ran as compiled graphs (the test fails if it fell back to eager)."""
    calls = []
    run = compiling._run_compiled

    def spy(fn, eager, *args):
        calls.append(fn.__name__)
        return run(fn, eager, *args)

    monkeypatch.setattr(compiling, "_run_compiled", spy)
    yield calls
    assert not compiling._broken, compiling._broken


@pytest.mark.compiles_step
@pytest.mark.parametrize("fp8", FP8)
def test_tensorwise_cast_compiled_gives_the_reference_bits(fp8, compiled_calls):
    for x in _inputs():
        for master_scale in (None, torch.tensor(2.0**-3)):
            got = fused.tensorwise_cast(x, fp8, 1, master_scale)
            want = fused._tensorwise(x.reshape(-1), fp8, 1, master_scale)
            assert got[0].shape == x.shape and got[0].dtype == fp8
            assert _same((got[0].reshape(-1), got[1]), want), (x, master_scale)
    assert compiled_calls and set(compiled_calls) == {"_tensorwise"}


@pytest.mark.compiles_step
@pytest.mark.parametrize("fp8", FP8)
def test_the_transposed_cast_gives_the_payload_in_both_layouts_bit_for_bit(fp8, compiled_calls):
    """What the FP8 backward hands `torch._scaled_mm` for dyᵀ·x: the payload and scale of
    `tensorwise_cast`, and the payload transposed into a contiguous copy, from one graph."""
    for x in [x for x in _inputs() if x.dim() == 2]:
        payload, transposed, scale = fused.tensorwise_cast_transposed(x, fp8, 1)
        want_payload, want_scale = fused.tensorwise_cast(x, fp8, 1)
        assert transposed.is_contiguous() and transposed.shape == (x.shape[1], x.shape[0])
        assert _same((payload, scale, transposed), (want_payload, want_scale, want_payload.t()))
    assert "_tensorwise_transposed" in compiled_calls


@pytest.mark.compiles_step
@pytest.mark.parametrize("fp8", FP8)
def test_gradient_cast_compiled_gives_the_reference_bits(fp8, compiled_calls):
    mu = torch.tensor(4.0)  # μ > 1: the cast clips, and counts what it clips
    for grad in _inputs():
        got = fused.gradient_cast(grad, mu, fp8, 0)
        assert _same((got[0].reshape(-1), *got[1:]), fused._gradient(grad.reshape(-1), mu, fp8, 0, None, None))
        pending = fused.gradient_cast(grad * 0.5, mu, fp8, 0)[:2]
        got = fused.gradient_cast(grad, mu, fp8, 0, pending)
        want = fused._gradient(grad.reshape(-1), mu, fp8, 0, pending[0].reshape(-1), pending[1])
        assert _same((got[0].reshape(-1), *got[1:]), want), grad
    assert set(compiled_calls) == {"_gradient"}


@pytest.mark.compiles_step
@pytest.mark.parametrize("fp8", FP8)
def test_the_cast_into_the_owners_buffers_gives_gradient_cast_s_bits(fp8, compiled_calls):
    """O2's hook writes the optimizer's buffers in the cast's own graph: the same payload, scale,
    count and flag as `gradient_cast` (whose result `set_fp8_grad` copied), first micro-batch
    and accumulated."""
    mu = torch.tensor(4.0)
    for grad in _inputs():
        want = fused.gradient_cast(grad, mu, fp8, 0)
        into = (torch.empty(grad.shape, dtype=fp8), torch.tensor(0.0))
        got = fused.gradient_cast_into(grad, mu, fp8, 0, into, accumulate=False)
        assert _same((*into, *got), (want[0], want[1], want[2], want[3])), grad
        want = fused.gradient_cast(grad, mu, fp8, 0, (want[0], want[1]))
        got = fused.gradient_cast_into(grad, mu, fp8, 0, into, accumulate=True)
        assert _same((*into, *got), (want[0], want[1], want[2], want[3])), grad
    assert set(compiled_calls) == {"_gradient", "_gradient_into"}


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("mu", [1.0, 2.0**32])
def test_the_gradient_cast_flags_exactly_the_payloads_that_hold_nan(fp8, mu):
    """The step's non-finite flag comes from the cast (FP8-LM O2 reads no payload for it): it
    equals `cast.nan_flag` of the payload for every input (inf, NaN, zeros, FP32's top, μ at
    its ceiling, where every finite product saturates), and for a sum with a NaN-holding
    stored gradient."""
    mu = torch.tensor(mu)
    flags = []
    for grad in _inputs():
        payload, _, _, nonfinite = fused.gradient_cast(grad, mu, fp8, 0)
        assert bool(nonfinite) == bool(cast.nan_flag(payload)), grad
        flags.append(bool(nonfinite))
        clean = fused.gradient_cast(torch.ones_like(grad, dtype=torch.float32), mu, fp8, 0)[:2]
        poisoned = (torch.full_like(clean[0], float("nan")), clean[1])  # a NaN code stored earlier
        for pending in (clean, poisoned):
            payload, _, _, nonfinite = fused.gradient_cast(grad, mu, fp8, 0, pending)
            assert bool(nonfinite) == bool(cast.nan_flag(payload)), (grad, pending)
    # The inf and the NaN inputs; at μ = 2^32 also the subnormal one, whose scale overflows.
    assert flags.count(True) == (2 if mu == 1.0 else 3)


@pytest.mark.compiles_step
@pytest.mark.parametrize("fp8", FP8)
def test_every_o1_gradient_in_one_graph_gives_each_ones_bits(fp8, compiled_calls):
    """`gradients_roundtrip_` (FP8-LM O1 on a GPU: one graph for all the gradients) against
    `gradient_roundtrip_` one gradient at a time: the same values written back and the same
    clipped counts, each gradient with its own μ (μ = 4 clips)."""
    grads = [x.float() for x in _inputs() if x.numel() > 1]
    mus = [torch.tensor(float(2 ** (i % 3))) for i in range(len(grads))]
    together, apart = [g.clone() for g in grads], [g.clone() for g in grads]
    counts = fused.gradients_roundtrip_(together, mus, fp8, 0)
    expected = [fused.gradient_roundtrip_(g, mu, fp8, 0) for g, mu in zip(apart, mus)]
    assert [int(c) for c in counts] == [int(c) for c in expected] and sum(int(c) for c in counts) > 0
    assert _same(together, apart)
    assert set(compiled_calls) == {"_gradients_roundtrip", "_gradient_roundtrip"}


@pytest.mark.compiles_step
@pytest.mark.parametrize("skipped", [False, True])
def test_every_o3_gradient_cast_into_its_buffers_in_one_graph_gives_each_ones_bits(skipped, compiled_calls):
    """`gradients_cast_into` (FP8-LM O3 in one process on a GPU) against `gradient_cast` one
    gradient at a time: the same payloads and scales in the buffers and the same clipped counts,
    each with its own μ (μ = 4 clips); on a skipped step a zero payload and scale 1 (an inf and a
    NaN gradient among them: no NaN stays in the buffers)."""
    grads = [x.float() for x in _inputs() if x.numel() > 1]
    mus = [torch.tensor(float(2 ** (i % 3))) for i in range(len(grads))]
    e4m3 = torch.float8_e4m3fn
    into = [(torch.full(g.shape, 7.0).to(e4m3), torch.tensor(3.0)) for g in grads]
    counts = fused.gradients_cast_into(grads, mus, e4m3, 0, into, torch.tensor(float(skipped)))
    for (payload, scale), grad, mu, count in zip(into, grads, mus, counts):
        expected_payload, expected_scale, saturated, _ = fused.gradient_cast(grad, mu, e4m3, 0)
        if skipped:
            expected_payload, expected_scale = torch.zeros_like(expected_payload), torch.tensor(1.0)
        assert bits_equal(bits(payload), bits(expected_payload)) and bits_equal(scale, expected_scale)
        assert int(count) == int(saturated)
    assert sum(int(c) for c in counts) > 0 and any(g.isnan().any() for g in grads)
    assert "_gradients_into" in compiled_calls


@pytest.mark.compiles_step
def test_o2_clipping_on_a_gpu_in_chunks_against_fp64(compiled_calls):
    """O2's clipping on a GPU (`stored_sums.clip_on_device`: each gradient's square in compiled
    calls over chunks of gradients, the norm and coefficient in one graph, the coefficient applied
    by multi-tensor operations), compiled here on more gradients than a chunk holds: the norm
    within n·u_FP32 of the FP64 norm of the same values (n the elements summed: the order of the
    additions is the compiler's), each FP32 gradient scaled by c = min(1, max_norm / (norm + 1e-6))
    and each FP8 gradient's scale divided by c within three FP32 roundings of the exact result (the
    sum and division that form c, then the product or quotient), a BF16 gradient's product as its
    eager `mul_` by c rounded to BF16 gives it; with max_norm = inf the same norm and nothing
    changed."""
    from hf_lowprec.compiling import ROWS_PER_GRAPH, gpu_paths
    from hf_lowprec.fp8.stored_sums import clip_on_device

    gen = torch.Generator().manual_seed(5)
    count = ROWS_PER_GRAPH + 3
    dense = [torch.randn(64, 32, generator=gen) for _ in range(count)] + [torch.randn(100, generator=gen) * 3]
    half = [torch.randn(40, generator=gen).bfloat16()]
    payloads = [(torch.randn(48, 16, generator=gen) * 40).to(torch.float8_e4m3fn) for _ in range(count)]
    scales = [torch.tensor(2.0 ** (i % 5 - 2)) for i in range(count)]
    real = [g.double() for g in dense + half] + [p.double() / s.double() for p, s in zip(payloads, scales)]
    want = torch.sqrt(sum((r * r).sum() for r in real))
    n = sum(r.numel() for r in real)
    before = [g.clone() for g in dense + half]
    old_scales = [s.clone() for s in scales]
    with gpu_paths():
        measured = clip_on_device(dense + half, list(zip(payloads, scales)), float("inf"))
        assert all(torch.equal(g, b) for g, b in zip(dense + half, before))
        assert all(torch.equal(s, old) for s, old in zip(scales, old_scales))
        norm = clip_on_device(dense + half, list(zip(payloads, scales)), 1.0)
    for got in (measured, norm):
        assert abs(got.double() - want) <= n * 2.0**-24 * want, (got, want)
    c = min(1.0, 1.0 / (norm.item() + 1e-6))
    assert c < 1.0  # the clip binds
    bound = gamma(3)
    for got, g in zip(dense, before):
        assert ((got.double() - g.double() * c).abs() <= bound * (g.double() * c).abs()).all()
    coefficient = (1.0 / (norm + 1e-6)).clamp(max=1.0)
    assert torch.equal(half[0], before[-1].mul(coefficient.bfloat16()))
    for s, old in zip(scales, old_scales):
        assert abs(s.item() - old.item() / c) <= bound * old.item() / c
    assert set(compiled_calls) == {"_squares_of_dense", "_squares_of_stored", "_norm_of", "_norm_and_coefficient"}


@pytest.mark.parametrize("fp8", FP8)
def test_the_references_are_the_scaled_tensor_rules(fp8):
    """The fused references, term by term: `pow2_scale` of `tensor_amax` (times μ), then
    `quantize_counting`; accumulation adds the FP32 dequantized stored gradient."""
    mu = torch.tensor(4.0)
    for x in _inputs():
        if not x.isfinite().all():
            continue  # the non-finite cases: a NaN payload either way (tests/fp8/test_cast.py)
        # −0 + 0 = +0: `quantize` does not keep the sign of zero, the fused casts do (as the casts
        # they replace did: `cast.saturate_to_fp8_eager`, tests/fp8/test_cast.py).
        x = x + 0.0
        payload, scale = fused._tensorwise(x, fp8, 1, None)
        want_scale = pow2_scale(tensor_amax(x), fp8, 1)
        assert _same((payload, scale), (quantize(x, want_scale, fp8), want_scale))
        payload, scale, saturated, _ = fused._gradient(x, mu, fp8, 0, None, None)
        want_scale = pow2_scale(tensor_amax(x), fp8) * mu
        assert _same((payload, saturated, scale), (*quantize_counting(x, want_scale, fp8), want_scale))
        pending = fused._gradient(x * 0.5, mu, fp8, 0, None, None)[:2]
        total = dequantize(*pending).add_(x)
        got = fused._gradient(x, mu, fp8, 0, *pending)
        want_scale = pow2_scale(tensor_amax(total), fp8) * mu
        assert _same(got[:2], (quantize_counting(total, want_scale, fp8)[0], want_scale))
