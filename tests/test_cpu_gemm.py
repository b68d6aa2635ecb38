"""16-bit GEMMs as FP32 GEMMs rounded once (hf_lowprec/cpu_gemm.py, HF_LOWPREC_CPU_GEMM): every other
dtype keeps torch's bits, the 16-bit results are within FP32 summation and one rounding of the FP64
product, gradients and compiled graphs take the same kernels, and a bad setting is refused."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hf_lowprec import cpu_gemm

# Each case's products in one process, saved: run once with torch's kernels, once with FP32 GEMMs.
SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import hf_lowprec  # installs what HF_LOWPREC_CPU_GEMM asks for
    from hf_lowprec import cpu_gemm

    torch.manual_seed(0)
    results = {"installed": cpu_gemm.installed()}
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for m, k, n in [(1, 1, 1), (3, 5, 7), (64, 33, 17), (130, 257, 65)]:
            a, b, c = torch.randn(m, k), torch.randn(k, n), torch.randn(n)
            A, B, C = torch.randn(3, m, k), torch.randn(3, k, n), torch.randn(m, n)
            a, b, c, A, B, C = (t.to(dtype) for t in (a, b, c, A, B, C))
            out = torch.empty(0, dtype=dtype)
            results[(str(dtype), m, k, n)] = {
                "operands": (a, b, c, A, B, C),
                "mm": a @ b,
                "mm of a transposed layout": a @ b.t().contiguous().t(),
                "addmm": torch.addmm(c, a, b),
                "addmm, beta and alpha": torch.addmm(C, a, b, beta=0.5, alpha=2.0),
                "bmm": torch.bmm(A, B),
                "baddbmm": torch.baddbmm(C, A, B, alpha=0.25),
                "mm out=": torch.mm(a, b, out=out).clone(),
                "linear": torch.nn.functional.linear(a, b.t(), c),
                "compiled matmul": torch.compile(torch.matmul, backend="inductor")(A, b),
            }
    x = torch.randn(4, 16, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.nn.functional.linear(x, w)
    y.float().square().sum().backward()
    results["autocast"] = (y.dtype, x.grad.dtype, w.grad.dtype, x.grad, w.grad)
    torch.save(results, sys.argv[1])
    """
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    folder = tmp_path_factory.mktemp("cpu_gemm")
    script = folder / "products.py"
    script.write_text(SCRIPT)
    for setting in ("native", "fp32"):
        env = {**os.environ, cpu_gemm.ENV: setting, "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor")}
        path = folder / f"{setting}.pt"
        subprocess.run([sys.executable, str(script), str(path)], env=env, check=True, timeout=600)
        out[setting] = torch.load(path, weights_only=False)
    return out


def test_only_what_is_asked_for_is_installed(runs):
    assert runs["native"]["installed"] is False and runs["fp32"]["installed"] is True


def test_other_dtypes_keep_torchs_bits(runs):
    for key, cases in runs["native"].items():
        if not isinstance(key, tuple) or key[0] not in ("torch.float32", "torch.float64"):
            continue
        for what, want in cases.items():
            if what != "operands":
                got = runs["fp32"][key][what]
                assert got.dtype == want.dtype and torch.equal(got, want), (key, what)


def test_sixteen_bit_products_are_fp32_sums_rounded_once_against_fp64(runs):
    """|y − y64| ≤ u·|y64| + γ_n·(1 + u)·Σ|a||b| per element, with u the 16-bit unit roundoff (one
    rounding of the FP32 sum), γ_n = n·u32 / (1 − n·u32) for FP32 summation of n exact products (n = k,
    or k + 1 with the bias term), and the operands' products exact in FP32 (8 + 8 or 11 + 11 bits)."""
    u32 = 2.0**-24
    checked = 0
    for key, cases in runs["fp32"].items():
        if not isinstance(key, tuple) or key[0] not in ("torch.bfloat16", "torch.float16"):
            continue
        u = 2.0**-8 if key[0] == "torch.bfloat16" else 2.0**-11
        a, b, c, A, B, C = (t.double() for t in cases["operands"])
        references = {
            "mm": (a @ b, a.abs() @ b.abs()),
            "addmm": (c + a @ b, c.abs() + a.abs() @ b.abs()),
            "addmm, beta and alpha": (0.5 * C + 2.0 * (a @ b), 0.5 * C.abs() + 2.0 * (a.abs() @ b.abs())),
            "bmm": (A @ B, A.abs() @ B.abs()),
            "baddbmm": (C + 0.25 * (A @ B), C.abs() + 0.25 * (A.abs() @ B.abs())),
            "linear": (a @ b + c, a.abs() @ b.abs() + c.abs()),
            "compiled matmul": (A @ b, A.abs() @ b.abs()),
        }
        n = key[2] + 2
        gamma = n * u32 / (1 - n * u32)
        for what, (exact, magnitude) in references.items():
            got = cases[what]
            assert got.dtype == cases["operands"][0].dtype, (key, what)
            bound = u * exact.abs() + gamma * (1 + u) * magnitude
            excess = (got.double() - exact).abs() - bound
            assert excess.max() <= 0, (key, what, excess.max().item())
            checked += 1
    assert checked == 2 * 4 * len(references)


def test_gradients_under_autocast_take_the_same_kernels(runs):
    """bf16-mixed's habit: autocast's BF16 linear, its FP32 gradients, within a 16-bit rounding of
    torch's own kernels (one BF16 ulp of the largest element bounds the difference of two FP32 sums
    of the same exact products rounded once, both ways)."""
    native, fp32 = runs["native"]["autocast"], runs["fp32"]["autocast"]
    assert native[:3] == fp32[:3] == (torch.bfloat16, torch.float32, torch.float32)
    for want, got in zip(native[3:], fp32[3:]):
        assert (got - want).abs().max() <= 2.0**-7 * want.abs().max()


@pytest.mark.parametrize("value", ["yes", "bf16", "FP32 "])
def test_a_bad_setting_is_refused_naming_the_choices(value):
    if value.strip().lower() == "fp32":
        assert cpu_gemm.wanted(value)
        return
    with pytest.raises(ValueError, match="native, fp32, auto"):
        cpu_gemm.wanted(value)


def test_auto_asks_for_it_exactly_where_torch_lacks_avx512():
    assert cpu_gemm.wanted("auto") == (not torch.cpu._is_avx512_supported())
    assert cpu_gemm.wanted("native") is False and cpu_gemm.wanted("") is False
