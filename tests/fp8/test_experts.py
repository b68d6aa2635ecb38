"""FP8 grouped GEMMs of the fused MoE experts (hf_lowprec/fp8/grouped.py, fp8/experts.py):
the three GEMMs per recipe against FP64, per-expert scales, routing edges, overflow, the
conversion of the five MoE architectures, and scaled FP16 masters in the state dict.

The FP64 references are built here from the recipes' definitions (module docstrings): the
block table below and the two scale rules, computed exactly from the operands' exponents, so
the module's quantization is checked, not reused."""

import copy
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from hf_lowprec.fp8 import fp8_linear
from hf_lowprec.fp8.experts import (
    FP8Experts,
    convert_experts,
    experts_modules,
    fp8_grouped_linear,
    is_experts_module,
    quantize_expert_weight,
    quantize_rows,
    token_groups,
)
from hf_lowprec.fp8.scaling_recipes import scaling_recipe
from hf_lowprec.testing import snr_db
from hf_lowprec.testing.moe import MOE_ARCHITECTURES, tiny_moe
from tests.helpers import assert_bits_equal, bits_equal, gamma, snr_floor_db, unit_roundoff

E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
RECIPES = ["tensorwise", "rowwise", "blockwise", "mxfp8"]

# The recipes as docs/algorithms.md §3 states them for experts, written out independently of
# fp8/scaling_recipes.py:
# (x and dy blocks, W blocks, dy's format, E8M0 rule). Blocks are (rows, cols) of a
# contraction-last operand, None = the whole dimension of one expert's operand.
SPEC = {
    "tensorwise": ((None, None), (None, None), E5M2, False),
    "rowwise": ((1, None), (1, None), E4M3, False),
    "blockwise": ((1, 128), (128, 128), E4M3, False),
    "mxfp8": ((1, 32), (1, 32), E4M3, True),
}

# SNR floors against the unquantized FP64 product (`snr_floor_db`): every GEMM operand rounded
# once to its FP8 format (E[δ²] ≤ u²/3 per operand, u = 2^-4 for E4M3, 2^-3 for E5M2), plus the
# BF16 output (u = 2^-8): E4M3·E4M3 → 25.8 dB; tensorwise gradients, E5M2·E4M3 → 21.9 dB. The
# finer recipes' gradients are E4M3; their re-quantized operands (Wᵀ, xᵀ from the saved FP8
# values) are FP8 values already, so the second quantization is exact but for elements deep
# below their new block's amax, which carry no power: one rounding each, 25.8 dB.
SNR_E4M3_DB = snr_floor_db(E4M3, E4M3, BF16)
SNR_E5M2_DB = snr_floor_db(E5M2, E4M3, BF16)


def snr_floor(name: str, gemm: str) -> float:
    return SNR_E5M2_DB if name == "tensorwise" and gemm != "y" else SNR_E4M3_DB


# --- the FP64 reference ----------------------------------------------------------------------


def ref_scale(amax: torch.Tensor, dtype: torch.dtype, e8m0: bool) -> torch.Tensor:
    """The scale rules, exactly, from the exponents (FP64): with amax = m_a·2^a and fmax = m_f·2^f
    (m in [0.5, 1), torch.frexp),
    power of two: s = 2^⌊log2(fmax/amax)⌋ = 2^(f − a) if m_a ≤ m_f else 2^(f − a − 1);
    OCP MX:       s = 2^(emax − ⌊log2 amax⌋), emax = ⌊log2 fmax⌋ = f − 1, so s = 2^(f − a).
    amax = 0 or non-finite: s = 1."""
    fmax = torch.finfo(dtype).max
    m_f, f = math.frexp(fmax)
    usable = (amax > 0) & torch.isfinite(amax)
    m_a, a = torch.frexp(torch.where(usable, amax, torch.ones_like(amax)))
    exponent = f - a
    if not e8m0:
        exponent = exponent - (m_a > m_f).to(exponent.dtype)
    return torch.where(usable, torch.exp2(exponent.double()), torch.ones_like(amax))


def ref_quantize(t: torch.Tensor, block, dtype: torch.dtype, e8m0: bool):
    """(payload, scale grid, exact real values in FP64) of a 2-D R × C operand of ONE expert,
    blocks from its first row and column (zero padding does not change an amax)."""
    t = t.double()
    rows, cols = t.shape
    if t.numel() == 0:
        return t.to(dtype), t.new_ones(0, 0), t.clone()
    br = rows if block[0] is None else block[0]
    bc = cols if block[1] is None else block[1]
    padded = F.pad(t, (0, -cols % bc, 0, -rows % br))
    blocks = padded.reshape(padded.shape[0] // br, br, padded.shape[1] // bc, bc)
    scale = ref_scale(blocks.abs().amax(dim=(1, 3)), dtype, e8m0)
    fmax = torch.finfo(dtype).max
    # x·s is exact (a power of two times an FP32 or FP8 value): one rounding, the cast (MX
    # saturates what exceeds the maximum).
    payload = (blocks * scale[:, None, :, None]).clamp(-fmax, fmax).float().to(dtype)
    real = payload.double() / scale[:, None, :, None]
    shape = padded.shape
    return (
        payload.reshape(shape)[:rows, :cols],
        scale,
        real.reshape(shape)[:rows, :cols],
    )


def ref_operands(name: str, x_e: torch.Tensor, w_e: torch.Tensor, dy_e: torch.Tensor) -> dict:
    """One expert's exact FP8 operands (A, B) of each GEMM C = A·Bᵀ, in FP64:
    y = x·Wᵀ, dx = dy·W (B = Wᵀ, K × N), dW = dyᵀ·x (A = dyᵀ, B = xᵀ: blocks along the tokens).
    The finer recipes quantize dy twice from its high-precision values and re-quantize W and x
    from the forward's FP8 values along the other axis (recipes.py's docstring)."""
    act, wblock, gdt, e8m0 = SPEC[name]
    x = ref_quantize(x_e, act, E4M3, e8m0)[2]
    w = ref_quantize(w_e, wblock, E4M3, e8m0)[2]
    g = ref_quantize(dy_e, act, gdt, e8m0)[2]
    if name == "tensorwise":  # one scale per expert's operand serves every GEMM
        return {"y": (x, w), "dx": (g, w.t()), "dw": (g.t(), x.t())}
    wt = ref_quantize(w.t(), wblock, E4M3, e8m0)[2]
    gt = ref_quantize(dy_e.t(), act, E4M3, e8m0)[2]
    xt = ref_quantize(x.t(), act, E4M3, e8m0)[2]
    return {"y": (x, w), "dx": (g, wt), "dw": (gt, xt)}


def assert_exact_gemm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """`out` is a·bᵀ of exact FP8 operands (FP64 here) as the GEMM path computes it: products
    of ≤ 4-bit significands times powers of two are exact in FP32; their FP32 sum over L terms
    errs by ≤ γ_{L−1}·Σ|a||b| in any order; then one rounding to BF16, 2^-8 relative."""
    exact, total = a @ b.t(), a.abs() @ b.abs().t()
    sum_error = gamma(max(a.shape[1] - 1, 0)) * total
    bound = sum_error + unit_roundoff(BF16) * (exact.abs() + sum_error)
    excess = (out.double() - exact).abs() - bound
    assert (excess <= 0).all(), f"{what}: exceeds the bound by up to {excess.max().item():.3g}"


# --- operands and runs -----------------------------------------------------------------------


def routing(counts):
    """(offsets, rows) of token rows sorted by expert with `counts` tokens per expert."""
    counts = torch.tensor(counts)
    return torch.cumsum(counts, 0).to(torch.int32), torch.repeat_interleave(torch.arange(len(counts)), counts)


def operands(counts, k=256, n=128, seed=0, x_mag=None, w_mag=None, g_mag=None):
    """x (S × K), logical W (E × N × K), dy (S × N) in FP32; optional magnitude per expert."""
    gen = torch.Generator().manual_seed(seed)
    s, e = sum(counts), len(counts)
    x = torch.randn(s, k, generator=gen)
    w = torch.randn(e, n, k, generator=gen) * 0.05
    dy = torch.randn(s, n, generator=gen)
    _, rows = routing(counts)
    if x_mag is not None:
        x *= torch.tensor(x_mag)[rows, None]
    if w_mag is not None:
        w *= torch.tensor(w_mag)[:, None, None]
    if g_mag is not None:
        dy *= torch.tensor(g_mag)[rows, None]
    return x, w, dy


def run_grouped(name, x, w, dy, counts, transposed=False):
    """(y, dx, dW in logical E × N × K) of fp8_grouped_linear; W stored E × K × N if transposed."""
    offsets, rows = routing(counts)
    xr = x.clone().requires_grad_()
    wr = (w.transpose(1, 2).contiguous() if transposed else w.clone()).requires_grad_()
    y = fp8_grouped_linear(xr, wr, offsets, rows, transposed=transposed, recipe=name)
    y.backward(dy)
    assert y.dtype == x.dtype and xr.grad.dtype == x.dtype and wr.grad.shape == wr.shape
    return y.detach(), xr.grad, (wr.grad.transpose(1, 2) if transposed else wr.grad)


class EagerCasts(TorchDispatchMode):
    """A pass-through dispatch mode: under any, fp8/cast.py runs its casts as plain ops instead of
    compiling them (the same bits, test_cast.py), which spares this file a compile of seconds."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def segments(counts):
    ends = torch.cumsum(torch.tensor(counts), 0).tolist()
    return [slice(end - c, end) for c, end in zip(counts, ends)]


def check_against_reference(name, x, w, dy, counts, transposed, snr=False):
    y, dx, dw = run_grouped(name, x, w, dy, counts, transposed)
    for e, seg in enumerate(segments(counts)):
        ops = ref_operands(name, x[seg], w[e], dy[seg])
        assert_exact_gemm(y[seg], *ops["y"], f"{name} y, expert {e}")
        assert_exact_gemm(dx[seg], *ops["dx"], f"{name} dx, expert {e}")
        assert_exact_gemm(dw[e], *ops["dw"], f"{name} dW, expert {e}")
        if snr and counts[e]:
            xd, wd, gd = x[seg].double(), w[e].double(), dy[seg].double()
            for gemm, ref, got in (("y", xd @ wd.t(), y[seg]), ("dx", gd @ wd, dx[seg]), ("dw", gd.t() @ xd, dw[e])):
                value = snr_db(ref, got)
                assert value >= snr_floor(name, gemm), (name, gemm, e, value)
    return y, dx, dw


# --- 1. the three GEMMs against FP64 ---------------------------------------------------------

# Four experts, one with more than 128 tokens (two blockwise token blocks, five MX ones), no
# count a multiple of 16, and magnitudes spread over 10^4 between experts (per-expert scales).
COUNTS = [40, 150, 23, 61]
MAGNITUDES = dict(x_mag=[1.0, 1e-3, 30.0, 0.2], w_mag=[1.0, 60.0, 0.02, 1.0], g_mag=[1.0, 1e2, 1e-2, 3.0])


@pytest.mark.parametrize("transposed", [False, True], ids=["out_in", "in_out"])
@pytest.mark.parametrize("name", RECIPES)
def test_three_gemms_are_the_exact_fp8_products_and_within_the_snr_floor(name, transposed):
    """y, dx and dW of every expert: the FP64 product of the reference's exact FP8 operands to
    within FP32 summation and one BF16 rounding (`assert_exact_gemm`), and at least the SNR floor
    against the unquantized FP64 product; weights stored [E, out, in] and [E, in, out] (gpt-oss)."""
    x, w, dy = operands(COUNTS, **MAGNITUDES)
    check_against_reference(name, x, w, dy, COUNTS, transposed, snr=True)


@pytest.mark.compiles_step
@pytest.mark.parametrize("name", RECIPES)
def test_a_gpus_grouped_casts_are_compiled_graphs_with_the_eager_bits(name, monkeypatch):
    """On a GPU every cast of the grouped GEMM (an operand's scales and payload, an expert weight's,
    the re-quantized Wᵀ and xᵀ of the finer recipes, and the emulated GEMM's exact BF16 operands,
    which CPU tensors always take) is one compiled graph (`compiling.run_fused`):
    eagerly each was about ten passes over FP32 temporaries, the size of the operand, and an FP32
    copy of every expert weight. Compiled here (the GPU's paths on CPU tensors), forward and
    backward give the eager path's bits, for experts of spread magnitudes and odd token counts,
    and for a scaled FP16 master."""
    from hf_lowprec import compiling
    from hf_lowprec.fp8.grouped import quantize_expert_weight
    from hf_lowprec.fp8.scaled import pow2_scale, quantize, tensor_amax

    compiled = []
    run = compiling._run_compiled
    monkeypatch.setattr(compiling, "_run_compiled", lambda fn, *a: compiled.append(fn.__name__) or run(fn, *a))
    x, w, dy = operands(COUNTS, **MAGNITUDES)
    eager = run_grouped(name, x, w, dy, COUNTS)
    with compiling.gpu_paths():
        fused = run_grouped(name, x, w, dy, COUNTS)
    for what, got, want in zip(("y", "dx", "dW"), fused, eager):
        assert_bits_equal(got, want, f"{name} {what}")
    expected = {"_quantize_rows", "_quantize_expert_weight", "_real_rows", "_real_expert_weight"}
    if name in ("rowwise", "mxfp8"):  # Wᵀ re-quantized along its own rows
        expected.add("_requantized_transpose")
    if name != "tensorwise":  # xᵀ re-quantized along each expert's tokens
        expected.add("_requantized_rows")
    assert set(compiled) == expected, compiled
    recipe = scaling_recipe(name)
    master = w.half()
    master_scale = pow2_scale(tensor_amax(master), torch.float16)
    master = quantize(master, master_scale, torch.float16)
    want = quantize_expert_weight(recipe, master, 1, master_scale)
    with compiling.gpu_paths():
        got = quantize_expert_weight(recipe, master, 1, master_scale)
    assert_bits_equal(got[0], want[0], "scaled master's payload")
    assert_bits_equal(got[1], want[1], "scaled master's scales")
    assert not compiling._broken, compiling._broken


@pytest.mark.parametrize("name", RECIPES)
def test_scales_follow_the_recipe_rule_per_expert(name):
    """The module's own scales and payloads are the reference's, bit for bit: the weight's per
    expert (E × N/br × K/bc), the activations' per expert segment (tensorwise) or per row block."""
    recipe = scaling_recipe(name)
    act, wblock, _, e8m0 = SPEC[name]
    x, w, _ = operands(COUNTS, **MAGNITUDES)
    w8, sw = quantize_expert_weight(recipe, w, 0)
    ref = [ref_quantize(w[e], wblock, E4M3, e8m0) for e in range(len(COUNTS))]
    assert_bits_equal(sw, torch.stack([r[1] for r in ref]).float(), "weight scales")
    assert_bits_equal(w8, torch.stack([r[0] for r in ref]), "weight payloads")
    assert len(torch.unique(sw)) > 1, "the experts' magnitudes differ: so must their scales"

    _, rows = routing(COUNTS)
    grouping = (rows, len(COUNTS)) if name == "tensorwise" else (None, 0)
    x8, sx = quantize_rows(recipe, x, E4M3, 0, act[1], *grouping)
    ref = [ref_quantize(x[seg], act, E4M3, e8m0) for seg in segments(COUNTS)]
    assert_bits_equal(x8, torch.cat([r[0] for r in ref]), "activation payloads")
    assert_bits_equal(sx, torch.cat([r[1] for r in ref]).float(), "activation scales")


# --- 2. per-expert scales --------------------------------------------------------------------


@pytest.mark.parametrize("name", RECIPES)
def test_an_expert_computes_as_if_alone_whatever_the_other_experts_hold(name):
    """Expert 0's weights, activations and output gradients 1e4× larger do not change a bit of
    the other experts' y, dx and dW: each expert runs exactly as the grouped GEMM of it alone
    (per-expert weight scales, per-segment activation scales, token blocks from each expert's
    first token)."""
    counts = [30, 45, 1, 18]
    x, w, dy = operands(counts, seed=3)
    x[:30] *= 1e4
    w[0] *= 1e4
    dy[:30] *= 1e4
    y, dx, dw = run_grouped(name, x, w, dy, counts)
    for e, seg in enumerate(segments(counts)):
        if e == 0:
            continue
        alone = run_grouped(name, x[seg], w[e : e + 1], dy[seg], [counts[e]])
        assert_bits_equal(y[seg], alone[0], f"y of expert {e}")
        assert_bits_equal(dx[seg], alone[1], f"dx of expert {e}")
        assert_bits_equal(dw[e], alone[2][0], f"dW of expert {e}")


# --- 3. routing edges ------------------------------------------------------------------------


@pytest.mark.parametrize("transposed", [False, True], ids=["out_in", "in_out"])
@pytest.mark.parametrize("name", RECIPES)
def test_expert_without_tokens_and_odd_token_counts(name, transposed):
    counts = [13, 0, 7, 1, 0]  # no count a multiple of 16; experts 1 and 4 get no token
    x, w, dy = operands(counts, seed=5)
    y, dx, dw = check_against_reference(name, x, w, dy, counts, transposed)
    assert all(bool(torch.isfinite(t).all()) for t in (y, dx, dw)), "no NaN or inf anywhere"
    assert (dw[1] == 0).all() and (dw[4] == 0).all(), "an expert without tokens has a zero gradient"
    # Its scales: the per-expert activation scale (tensorwise) of an empty segment is 1 (amax 0);
    # the weight-gradient operands' token groups without rows are 1 too; all are finite.
    recipe, (act, _, gdt, _) = scaling_recipe(name), SPEC[name]
    offsets, rows = routing(counts)
    if name == "tensorwise":
        _, sx = quantize_rows(recipe, x, E4M3, 0, None, rows, len(counts))
        assert sx[1].item() == sx[4].item() == 1.0
    else:
        groups, n_groups = token_groups(offsets, rows, act[1])
        _, sg = quantize_rows(recipe, dy, gdt, 0, 1, groups, n_groups)
        unused = torch.ones(n_groups, dtype=torch.bool)
        unused[groups] = False
        assert bool(torch.isfinite(sg).all()) and (sg[unused] == 1).all()
    assert bool(torch.isfinite(quantize_expert_weight(recipe, w, 0)[1]).all())


@pytest.mark.parametrize("name", RECIPES)
def test_one_expert_taking_every_token_is_the_single_gemm(name):
    """All 37 tokens to expert 2: its y, dx and dW are the dense FP8 layer's on the same
    operands bit for bit (the same scales: its segment is the whole tensor, its token blocks
    start at row 0), the reference holds, and the other experts' gradients are zero."""
    counts = [0, 0, 37, 0]
    x, w, dy = operands(counts, seed=7)
    y, dx, dw = check_against_reference(name, x, w, dy, counts, transposed=False)
    xd, wd = x.clone().requires_grad_(), w[2].clone().requires_grad_()
    with EagerCasts():
        yd = fp8_linear(xd, wd, recipe=name)
        yd.backward(dy)
    assert_bits_equal(y, yd.detach(), "y")
    assert_bits_equal(dx, xd.grad, "dx")
    assert_bits_equal(dw[2], wd.grad, "dW")
    assert all((dw[e] == 0).all() for e in (0, 1, 3))


def test_token_groups_start_at_each_experts_first_token():
    # Experts with 3, 0, 5 and 2 tokens; blocks of 2 tokens.
    offsets, rows = routing([3, 0, 5, 2])
    groups, n_groups = token_groups(offsets, rows, 2)
    assert groups.tolist() == [0, 0, 1, 2, 2, 3, 3, 4, 5, 5]
    assert n_groups == 10 // 2 + 4  # the static bound ⌊S/block⌋ + E, whatever the routing
    # MX-sized blocks: 40 tokens → blocks of 32 + 8; one token; 33 → 32 + 1.
    offsets, rows = routing([40, 0, 1, 33])
    groups, n_groups = token_groups(offsets, rows, 32)
    assert groups.tolist() == [0] * 32 + [1] * 8 + [2] + [3] * 32 + [4]
    assert n_groups == 74 // 32 + 4 and groups.max().item() < n_groups
    # No block: one group per expert (its rows).
    groups, n_groups = token_groups(offsets, rows, None)
    assert bits_equal(groups, rows) and n_groups == 4


# --- 4. overflow -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", RECIPES)
def test_inf_in_one_experts_activations_makes_its_scale_group_nan_and_nothing_else(name):
    """experts.py: an inf in an operand makes the payload of its scale group NaN (visible to the
    non-finite step check). Tensorwise: the group is the expert's whole segment, so all its
    output rows and its dW are NaN; the finer recipes scale per row, so only the inf's row is.
    Other experts' rows and gradients are those of the run without the inf, bit for bit, and
    dx (dy·W, no x in it) is unchanged."""
    counts = [6, 5, 9]
    x, w, dy = operands(counts, seed=11)
    clean = run_grouped(name, x, w, dy, counts)
    x[7, 3] = float("inf")  # expert 1 holds rows 6..10
    y, dx, dw = run_grouped(name, x, w, dy, counts)
    nan_rows = list(range(6, 11)) if name == "tensorwise" else [7]
    other = [r for r in range(sum(counts)) if r not in nan_rows]
    assert bool(y[nan_rows].isnan().all())
    assert_bits_equal(y[other], clean[0][other], "other rows")
    assert_bits_equal(dx, clean[1], "dx")
    # dW[1] = dyᵀ·x over expert 1's tokens: NaN in the columns of x's NaN block (the inf's
    # 1 × 128 or 1 × 32 block, the whole row for rowwise, the whole segment for tensorwise),
    # finite in the others.
    nan_cols = SPEC[name][0][1] or x.shape[1]
    assert bool(dw[1][:, :nan_cols].isnan().all()) and bool(torch.isfinite(dw[1][:, nan_cols:]).all())
    assert_bits_equal(dw[[0, 2]], clean[2][[0, 2]], "other experts' dW")


# --- 5–8. the converted modules --------------------------------------------------------------


def _ids(batch=2, seq=16, seed=0):
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _step(model, ids):
    """(logits, loss, {expert parameter name: gradient}) of one forward and backward."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if ".experts." in n and p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")


def test_converted_model_computes_the_same_bits_whatever_experts_implementation():
    model = tiny_moe("qwen3_moe")
    experts = [m for m in model.modules() if is_experts_module(m)]
    assert experts and all(m.config is model.config for m in experts), "the layers read the model's config"
    ids = _ids()
    # The setting is live: the unconverted model runs transformers' batched_mm or grouped_mm
    # function (seen through a recording stand-in) or, for "eager", neither; the converted one
    # runs none of them. (The logits alone cannot show it: with one thread, eager and grouped_mm
    # sum in the same order and agree bit for bit.)
    calls = []

    def recording(impl):
        function = ALL_EXPERTS_FUNCTIONS[impl]

        def run(*args, **kwargs):
            calls.append(impl)
            return function(*args, **kwargs)

        return run

    def implementations_run(impl):
        calls.clear()
        model.config._experts_implementation = impl
        logits, _, grads = _step(model, ids)
        return list(calls), logits, grads

    recorded = ("batched_mm", "grouped_mm")
    for impl in recorded:
        ALL_EXPERTS_FUNCTIONS[impl] = recording(impl)  # an override local to this interface
    try:
        for impl in IMPLEMENTATIONS:
            assert implementations_run(impl)[0] == ([impl] * len(experts) if impl in recorded else []), impl
        converted, skipped = convert_experts(model)
        assert len(converted) == len(experts) and not skipped
        runs = {impl: implementations_run(impl) for impl in IMPLEMENTATIONS}
    finally:
        for impl in recorded:
            del ALL_EXPERTS_FUNCTIONS[impl]
    assert all(run[0] == [] for run in runs.values()), "the FP8 forward replaces every implementation"
    _, logits, grads = runs["eager"]
    assert grads.keys() == {n for n, _ in model.named_parameters() if ".experts." in n}
    for impl in IMPLEMENTATIONS[1:]:
        assert_bits_equal(runs[impl][1], logits, f"logits under {impl}")
        for name, grad in grads.items():
            assert_bits_equal(runs[impl][2][name], grad, f"{name} under {impl}")


# Expert-weight gradients of the FP8 model against the unconverted FP32 one. Tensorwise, the
# FP8 model rounds 12 tensors once each: per experts module (2) and projection (2), x, W and dy
# (the three GEMMs reuse those payloads). A rounding adds relative noise power ≤ u²/3 ≤ 2^-6/3
# (E5M2; E4M3 a quarter of it); if none reaches a gradient stronger than it is in its own
# operand, a gradient's noise is ≤ 12·2^-6/3 = 1/16 of its power (SNR ≥ 12 dB), and
# cos = 1/√(1 + noise/signal) ≥ 1/√(1 + 1/16) ≈ 0.970. Measured: ≥ 0.992.
COSINE_FLOOR = 1 / math.sqrt(1 + 12 * unit_roundoff(E5M2) ** 2 / 3)
# RMS relative error of an experts module's output: its four E4M3 roundings (x, W_gate_up, the
# gate's output, W_down), those of the first GEMM counted twice (both factors of the gate's
# product carry them), and two BF16 outputs: ε = √((8·2^-8 + 2·2^-16)/3) ≈ 0.10.
EXPERT_OUTPUT_EPS = math.sqrt((8 * unit_roundoff(E4M3) ** 2 + 2 * unit_roundoff(BF16) ** 2) / 3)


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_converted_model_stays_close_to_the_unconverted_one(arch):
    """Tensorwise FP8 experts: the loss moves by at most its first-order change under the FP8
    error of each experts module's output, |ΔL| ≤ Σ_l ‖∂L/∂y_l‖·ε·‖y_l‖ (Cauchy–Schwarz; the
    local errors of the layers add to first order; measured ≤ 1% of it, at most 8.5e-5 of the
    loss), and the expert-weight gradients keep a cosine ≥ COSINE_FLOOR with the FP32 ones."""
    model = tiny_moe(arch)
    ids = _ids(seq=32)
    outputs = []

    def keep(module, args, output):
        output.retain_grad()
        outputs.append(output)

    hooks = [m.register_forward_hook(keep) for m in model.modules() if is_experts_module(m)]
    _, loss, grads = _step(model, ids)
    for hook in hooks:
        hook.remove()
    bound = EXPERT_OUTPUT_EPS * sum(y.grad.norm().item() * y.detach().norm().item() for y in outputs)

    fp8 = copy.deepcopy(model)
    converted, skipped = convert_experts(fp8)
    assert len(converted) == len(outputs) and not skipped
    _, fp8_loss, fp8_grads = _step(fp8, ids)
    assert abs(fp8_loss.item() - loss.item()) <= bound, (fp8_loss.item(), loss.item(), bound)
    assert fp8_grads.keys() == grads.keys()
    for name, grad in grads.items():
        cosine = F.cosine_similarity(grad.flatten().double(), fp8_grads[name].flatten().double(), dim=0).item()
        assert cosine >= COSINE_FLOOR, (arch, name, cosine)


def test_experts_off_the_recipe_blocks_stay_high_precision_with_a_reason(caplog):
    # Hidden 64, intermediate 32: not multiples of blockwise's 128, multiples of MX's 32.
    model = tiny_moe("qwen3_moe")
    reference = model(input_ids=_ids()).logits.detach()
    with caplog.at_level(logging.WARNING, logger="hf_lowprec.fp8.experts"):
        converted, skipped = convert_experts(model, recipe="blockwise")
    names = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert converted == [] and sorted(skipped) == names
    for name in names:
        assert "in_features=64, out_features=64 not a multiple of 128" in skipped[name]
        assert f"kept experts {name} in high precision" in caplog.text
    assert not list(experts_modules(model)) and not any(isinstance(m, FP8Experts) for m in model.modules())
    assert_bits_equal(model(input_ids=_ids()).logits.detach(), reference, "unconverted forward")

    converted, skipped = convert_experts(model, recipe="mxfp8")
    assert converted == names and not skipped
    assert all(m.fp8_recipe == "mxfp8" for _, m in experts_modules(model))

    # Tensorwise needs multiples of 16: an expert width of 24 is refused on down_proj's input.
    narrow = tiny_moe("mixtral", intermediate=24)
    converted, skipped = convert_experts(narrow)
    assert not converted and all("down_proj: in_features=24 not a multiple of 16" in r for r in skipped.values())
    # Dimensions on the 128 blocks convert under blockwise.
    wide = tiny_moe("olmoe", hidden=128, intermediate=128, layers=1)
    assert convert_experts(wide, recipe="blockwise") == (["model.layers.0.mlp.experts"], {})


def test_module_filter_decides_which_experts_convert():
    model = tiny_moe("qwen3_moe")
    seen = []

    def only_first_layer(module, fqn):
        seen.append(fqn)
        return fqn.startswith("model.layers.0.")

    converted, skipped = convert_experts(model, module_filter=only_first_layer)
    assert seen == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"], "asked about experts only"
    assert converted == ["model.layers.0.mlp.experts"]
    assert skipped == {"model.layers.1.mlp.experts": "rejected by module_filter"}
    assert isinstance(model.model.layers[0].mlp.experts, FP8Experts)
    assert not isinstance(model.model.layers[1].mlp.experts, FP8Experts)
    # Converting again leaves the converted module alone and asks only about the other.
    seen.clear()
    assert convert_experts(model, module_filter=lambda m, fqn: seen.append(fqn) or True) == (
        ["model.layers.1.mlp.experts"],
        {},
    )
    assert seen == ["model.layers.1.mlp.experts"]


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])  # [E, out, in]; gpt-oss: [E, in, out] and biases
def test_scaled_fp16_masters_export_real_values_and_load_back(arch):
    names = ("gate_up_proj", "down_proj")
    prefix = "model.layers.0.mlp.experts."

    def fp16_model(seed):
        """(FP16 model with FP8 experts, its first experts module, that module's FP32 weights)."""
        model = tiny_moe(arch, seed=seed)
        convert_experts(model)
        module = model.model.layers[0].mlp.experts
        fp32 = {name: getattr(module, name).detach().clone() for name in names}
        return model.half(), module, fp32

    model, module, fp32 = fp16_model(0)
    real16 = {name: getattr(module, name).detach().float().clone() for name in names}
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(12, 64, generator=gen).half()
    index = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(12)])
    weights = torch.softmax(torch.randn(12, 2, generator=gen), -1).half()
    plain = module(hidden, index, weights)

    module.scale_master_weights()
    for name in names:
        scale = getattr(module, name + "_master_scale")
        assert scale.item() > 1 and math.log2(scale.item()).is_integer()
        assert getattr(module, name).dtype == torch.float16 and getattr(module, name).abs().max() > 2**14
    # Scaling by a power of two inside FP16's normal range is exact: the exported FP32 values
    # are the FP16 weights bit for bit (so within one FP16 rounding of the FP32 weights they
    # came from), and the same real values give the same FP8 GEMMs.
    state = model.state_dict()
    for name, real in real16.items():
        assert state[prefix + name].dtype == torch.float32
        assert_bits_equal(state[prefix + name], real, f"exported {name}")
        # One rounding to FP16: ≤ 2^-11 relative in its normal range, ≤ 2^-25 (half the
        # subnormal spacing) below it.
        error = (state[prefix + name].double() - fp32[name].double()).abs()
        assert (error <= unit_roundoff(torch.float16) * fp32[name].double().abs() + 2.0**-25).all()
    assert_bits_equal(module(hidden, index, weights), plain, "forward with scaled masters")

    # A 16-bit cast of the model keeps each master scale FP32 (`.half()` made those past 65504 inf).
    model.half()
    assert all(getattr(module, n + "_master_scale").dtype == torch.float32 for n in names)
    assert_bits_equal(module(hidden, index, weights), plain, "forward after .half()")

    # Another model whose masters hold other values under other scales (8× larger weights).
    fresh_model, fresh, _ = fp16_model(seed=4)
    with torch.no_grad():
        for name in names:
            getattr(fresh, name).mul_(8)
    fresh.scale_master_weights()
    assert all(getattr(fresh, n + "_master_scale") != getattr(module, n + "_master_scale") for n in names)
    fresh_model.load_state_dict(state)
    for name in names:
        assert_bits_equal(getattr(fresh, name), getattr(module, name), f"re-imported {name} payload")
        assert_bits_equal(getattr(fresh, name + "_master_scale"), getattr(module, name + "_master_scale"))
        assert_bits_equal(fresh_model.state_dict()[prefix + name], state[prefix + name], f"re-exported {name}")
    assert_bits_equal(fresh(hidden, index, weights), plain, "forward after loading")


@pytest.mark.parametrize("name", RECIPES)
def test_experts_given_no_tokens_return_an_empty_output_and_zero_weight_gradients(name):
    """No token routed to any expert (a capacity-dropping router, an emptied micro-batch): an
    empty (0, N) output and dW an empty sum, exactly 0, as a loop of nn.Linear per expert gives."""
    counts = [0, 0, 0, 0]
    x, w, dy = operands(counts)
    y, dx, dw = run_grouped(name, x, w, dy, counts)
    assert y.shape == (0, w.shape[1]) and dx.shape == x.shape
    assert torch.equal(dw, torch.zeros_like(w))
