"""FP8 GEMM paths (scaled_mm, upcast), the layout handed to cuBLASLt, the fused quantization and
the once-per-step weight cache of FP8Linear (hf_lowprec/fp8/linear.py)."""

import functools
import logging
import os

import pytest
import torch
from torch import nn

from hf_lowprec.fp8 import FP8Linear, fp8_gemm_path, fp8_linear, set_fp8_gemm_path
from hf_lowprec.fp8 import gemm as fp8_gemm_module
from hf_lowprec.fp8 import linear as fp8_linear_module
from hf_lowprec.fp8.gemm import ScaledMMGemm, UpcastGemm, fp8_mm
from hf_lowprec.fp8.linear import quantize_tensorwise
from hf_lowprec.fp8.scaled import pow2_scale, quantize, tensor_amax
from tests.helpers import bits_equal, gamma

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
U_BF16 = 2.0**-8  # unit roundoff of BF16 (the GEMM output)


def operands(m, k, n, fmt_a, fmt_b, seed=0, positive=False):
    """FP8 payloads a (M×K), b (K×N) with their power-of-two scales."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * 3
    b = torch.randn(k, n, generator=g) * 1e-3
    if positive:
        a, b = a.abs(), b.abs()
    a8, sa = quantize_tensorwise(a, fmt_a, 0)
    b8, sb = quantize_tensorwise(b, fmt_b, 0)
    return a8, sa, b8, sb


def reference(a8, sa, b8, sb):
    """(S, T) in FP64: the exact product of the quantized operands and Σ|a||b|, real units."""
    a, b = a8.double() / sa.double(), b8.double() / sb.double()
    return a @ b, a.abs() @ b.abs()


def error_bound(k, exact, total):
    # Products of FP8 payloads (≤ 4 significant bits each) are exact in FP32 and the power-of-two
    # scales are exact, so the only errors are the FP32 sum (≤ γ_{K−1}·Σ|a||b|, any summation
    # order) and the final rounding to BF16 (≤ u_bf16 relative, of a value within that sum bound).
    sum_error = gamma(k - 1) * total
    return sum_error + U_BF16 * (exact.abs() + sum_error)


PATHS = {"upcast": UpcastGemm(), "scaled_mm": ScaledMMGemm(pad=False), "scaled_mm_padded": ScaledMMGemm(pad=True)}


def _cpu_scaled_mm_runs() -> bool:
    # oneDNN's FP8 matmul needs AVX-512 (measured: with ATEN_CPU_CAPABILITY=avx2 and
    # ONEDNN_MAX_CPU_ISA=AVX2, torch._scaled_mm on CPU fails to create its primitive for some
    # calls and not others). The library never picks it on CPU (the upcast path is the CPU
    # default); on such CPUs these tests check the upcast path alone, and the layout test below
    # uses an FP64 stand-in for the kernel.
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512") and isa not in ("AVX2", "AVX", "SSE41")


CPU_SCALED_MM = _cpu_scaled_mm_runs()
needs_cpu_scaled_mm = pytest.mark.skipif(not CPU_SCALED_MM, reason="torch._scaled_mm needs an AVX-512 CPU")


@pytest.mark.parametrize(
    "path", [p if p == "upcast" else pytest.param(p, marks=needs_cpu_scaled_mm) for p in sorted(PATHS)]
)
@pytest.mark.parametrize(
    "shape, fmts, positive",
    [
        ((40, 256, 24), (E4M3, E4M3), False),  # forward: x·Wᵀ; no dimension a multiple of 16 except K
        ((24, 200, 40), (E5M2, E4M3), False),  # input gradient: dy·W
        ((16, 1024, 16), (E5M2, E4M3), True),  # long positive sums: BF16 accumulation would miss the bound by 4x
    ],
)
def test_each_path_is_within_the_fp32_accumulation_bound_of_fp64(path, shape, fmts, positive):
    m, k, n = shape
    a8, sa, b8, sb = operands(m, k, n, *fmts, positive=positive)
    exact, total = reference(a8, sa, b8, sb)
    out = fp8_mm(a8, sa, b8, sb, torch.float32, PATHS[path])
    assert out.shape == (m, n) and out.dtype == torch.float32
    err = (out.double() - exact).abs()
    bound = error_bound(k, exact, total)
    assert (err <= bound).all(), f"{path}: worst error/bound {(err / bound).max().item():.3f}"


@needs_cpu_scaled_mm
@pytest.mark.parametrize("fmts", [(E4M3, E4M3), (E5M2, E4M3)], ids=["e4m3", "e5m2"])
def test_paths_agree_within_twice_the_bound(fmts):
    # Both paths are within error_bound of the same exact value, hence within twice it of each other.
    m, k, n = 48, 320, 32
    a8, sa, b8, sb = operands(m, k, n, *fmts, seed=3)
    exact, total = reference(a8, sa, b8, sb)
    up = fp8_mm(a8, sa, b8, sb, torch.float32, PATHS["upcast"]).double()
    mm = fp8_mm(a8, sa, b8, sb, torch.float32, PATHS["scaled_mm"]).double()
    assert ((up - mm).abs() <= 2 * error_bound(k, exact, total)).all()


def test_all_zero_operand_gives_zero():
    a8, sa = quantize_tensorwise(torch.zeros(16, 32), E4M3, 0)
    assert sa.item() == 1.0
    b8, sb = quantize_tensorwise(torch.randn(32, 16), E4M3, 0)
    for gemm in PATHS.values() if CPU_SCALED_MM else [PATHS["upcast"]]:
        assert bits_equal(fp8_mm(a8, sa, b8, sb, torch.float32, gemm), torch.zeros(16, 16))


def test_scaled_mm_layout_is_row_major_times_column_major_padded():
    # Issue 8: a column-major first operand whose dims are already multiples of 16 used to reach
    # _scaled_mm unchanged; cuBLASLt needs row-major × column-major.
    gemm = ScaledMMGemm(pad=True)
    for a, b in [
        (torch.zeros(32, 64).t(), torch.zeros(32, 48)),  # a column-major 64×32, b row-major
        (torch.zeros(20, 40), torch.zeros(24, 40).t()),  # b already column-major, odd dims
    ]:
        a_rows, b_cols = gemm.layout(a.to(E4M3), b.to(E4M3))
        (m, k), n = a.shape, b.shape[1]
        mp, kp, np_ = (-(-d // 16) * 16 for d in (m, k, n))
        assert a_rows.shape == (mp, kp) and a_rows.stride() == (kp, 1)
        assert b_cols.shape == (kp, np_) and b_cols.stride() == (1, kp)


def _cublaslt_contract():
    """A stand-in for torch._scaled_mm that enforces cuBLASLt's operand contract and computes
    the product in FP64 (so the test runs where the CPU has no FP8 kernel)."""
    calls = []

    def checked(a, b, *, scale_a, scale_b, out_dtype):
        assert a.stride(1) == 1 and a.stride(0) == a.shape[1], f"first operand not row-major: {a.stride()}"
        assert b.stride(0) == 1 and b.stride(1) == b.shape[0], f"second operand not column-major: {b.stride()}"
        assert all(d % 16 == 0 for d in (*a.shape, b.shape[1])), f"dims not multiples of 16: {a.shape}, {b.shape}"
        calls.append((a.dtype, b.dtype))
        return ((a.double() * scale_a.double()) @ (b.double() * scale_b.double())).to(out_dtype)

    return checked, calls


def test_fp8_linear_hands_scaled_mm_the_cuda_layout_on_every_gemm(monkeypatch):
    # What fp8_mm hands over when the path is scaled_mm on CUDA (padding on), checked on CPU.
    checked, calls = _cublaslt_contract()
    monkeypatch.setattr(torch, "_scaled_mm", checked)
    monkeypatch.setitem(fp8_gemm_module._chosen, ("cpu", None), ScaledMMGemm(pad=True))
    g = torch.Generator().manual_seed(0)
    for transposed in (False, True):
        x = torch.randn(32, 16, generator=g).t().requires_grad_()  # 16×32, column-major, multiples of 16
        w = (torch.randn((32, 48) if transposed else (48, 32), generator=g) * 0.1).requires_grad_()
        y = fp8_linear(x, w, weight_transposed=transposed)
        y.backward(torch.randn(16, 48, generator=g))
        assert x.grad.shape == x.shape and w.grad.shape == w.shape
    assert calls.count((E4M3, E4M3)) == 2 and calls.count((E5M2, E4M3)) == 3 and calls.count((E4M3, E5M2)) == 1
    assert len(calls) == 6  # forward, input gradient, weight gradient, for both layouts


def test_the_cuda_layout_gives_the_upcast_path_s_gradients(monkeypatch):
    """The operands the CUDA path hands over (dy's payload transposed by its cast graph, the
    weight and input transposed by the layout) multiply to the same gradients as the upcast
    path's, for both weight layouts: the same FP8 values, so they differ only in summation
    (FP64 in the stand-in, FP32 there) and each result's rounding to BF16 (2^-8 relative, once
    on each side)."""
    checked, _ = _cublaslt_contract()
    g = torch.Generator().manual_seed(1)
    for transposed in (False, True):
        x0 = torch.randn(32, 16, generator=g).t()
        w0 = torch.randn((32, 48) if transposed else (48, 32), generator=g) * 0.1
        dy = torch.randn(16, 48, generator=g)
        grads = {}
        for path in ("upcast", "scaled_mm"):
            with monkeypatch.context() as patch:
                if path == "scaled_mm":
                    patch.setattr(torch, "_scaled_mm", checked)
                    patch.setitem(fp8_gemm_module._chosen, ("cpu", None), ScaledMMGemm(pad=True))
                else:
                    patch.setitem(fp8_gemm_module._chosen, ("cpu", None), UpcastGemm())
                x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
                fp8_linear(x, w, weight_transposed=transposed).backward(dy)
                grads[path] = (x.grad, w.grad)
        for got, want in zip(grads["scaled_mm"], grads["upcast"]):
            assert (got - want).abs().max() <= 2**-7 * want.abs().max(), (transposed, got, want)


def test_path_choice_is_made_once_per_device_and_logged(caplog):
    set_fp8_gemm_path(None)
    with caplog.at_level(logging.INFO, logger="hf_lowprec.fp8.gemm"):
        assert fp8_gemm_path("cpu") == "upcast"
        assert fp8_gemm_path("cpu") == "upcast"
    assert caplog.text.count("FP8 GEMM path on cpu: upcast") == 1
    try:
        set_fp8_gemm_path("scaled_mm")
        assert fp8_gemm_path("cpu") == "scaled_mm"
    finally:
        set_fp8_gemm_path(None)
    with pytest.raises(ValueError, match="'scaled_mm', 'upcast' or None"):
        set_fp8_gemm_path("cublas")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fused_quantization_is_bit_identical_to_quantize(dtype, fmt):
    x = (torch.randn(64, 96, generator=torch.Generator().manual_seed(1)) * 7).to(dtype)
    x[0, :3] = torch.tensor([0.0, -0.0, 1e-30]).to(dtype)
    master = torch.tensor(2.0**10)
    for master_scale in (None, master):
        payload, scale = quantize_tensorwise(x, fmt, margin=1, master_scale=master_scale)
        real_amax = tensor_amax(x) / (1 if master_scale is None else master_scale)
        expected_scale = pow2_scale(real_amax, fmt, 1)
        factor = expected_scale if master_scale is None else expected_scale / master_scale
        assert bits_equal(scale, expected_scale)
        # Equal values (quantize turns −0 into +0; the fused form keeps the sign of zero).
        assert torch.equal(payload.float(), quantize(x, factor, fmt).float())


def test_fused_quantization_edges():
    payload, scale = quantize_tensorwise(torch.zeros(4, 4), E4M3, 0)
    assert scale.item() == 1.0 and not payload.float().any()
    # An overflow upstream must stay visible: any inf or NaN makes the whole payload NaN.
    for bad in (float("inf"), float("-inf"), float("nan")):
        x = torch.ones(4, 4)
        x[1, 2] = bad
        payload, _ = quantize_tensorwise(x, E5M2, 0)
        assert payload.float().isnan().all()
    payload, scale = quantize_tensorwise(torch.empty(0, 8), E4M3, 0)
    assert payload.shape == (0, 8) and scale.item() == 1.0


def _kept(saved, t):
    saved.append(t)
    return t


def test_the_weight_gradient_takes_x_transposed_from_the_forward_s_cast(monkeypatch):
    """On the CUDA path the forward's cast writes x's payload in both layouts and backward saves
    x8ᵀ, so backward copies at most one FP8 operand: the weight's for dx with nn.Linear's layout
    (it was two), none with Conv1D's (it was one); what is saved is still one FP8 copy of x. (Copies inside the package's compiled
    graphs, which run as their eager source under a dispatch mode, are kernels of those graphs.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_lowprec.compiling import current_compiled_region

    class FP8Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.copies = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            fp8 = args and torch.is_tensor(args[0]) and args[0].dtype in (E4M3, E5M2)
            copy = func in (torch.ops.aten.clone.default, torch.ops.aten.copy_.default)
            self.copies += bool(fp8 and copy and current_compiled_region() is None)
            return func(*args, **(kwargs or {}))

    checked, _ = _cublaslt_contract()
    monkeypatch.setattr(torch, "_scaled_mm", checked)
    monkeypatch.setitem(fp8_gemm_module._chosen, ("cpu", None), ScaledMMGemm(pad=True))
    g = torch.Generator().manual_seed(2)
    for transposed in (False, True):
        x = torch.randn(32, 64, generator=g).requires_grad_()
        w = (torch.randn((64, 48) if transposed else (48, 64), generator=g) * 0.1).requires_grad_()
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(_kept, saved), lambda t: t):
            y = fp8_linear(x, w, weight_transposed=transposed)
        x_saved = [t for t in saved if t.dtype == E4M3 and t.numel() == x.numel()]
        assert len(x_saved) == 1 and x_saved[0].shape == (64, 32) and x_saved[0].is_contiguous()
        with FP8Copies() as counted:
            y.backward(torch.randn(32, 48, generator=g))
        assert counted.copies == (0 if transposed else 1), (transposed, counted.copies)


def test_only_fp8_copies_are_saved_for_backward():
    layer = FP8Linear(64, 48)
    nn.init.normal_(layer.weight, std=0.1)
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    x = torch.randn(8, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    big = [(d, n) for d, n in saved if n > 1]
    assert sorted(big, key=str) == sorted([(E4M3, 8 * 64), (E4M3, 48 * 64)], key=str), saved


class _DataSGD(torch.optim.Optimizer):
    """Writes through p.data, which leaves the parameter's version counter untouched."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.data.add_(p.grad, alpha=-group["lr"])


@pytest.mark.parametrize("optimizer_cls", [torch.optim.SGD, _DataSGD], ids=["sgd", "writes_p_data"])
def test_cached_weight_follows_every_update_bit_for_bit(optimizer_cls):
    # Training with the cached FP8 weight gives the trajectory of re-quantizing on every call.
    torch.manual_seed(0)
    layer = FP8Linear(32, 32, bias=False)
    nn.init.normal_(layer.weight, std=0.2)
    ref_w = layer.weight.detach().clone().requires_grad_()
    opt, ref_opt = optimizer_cls([layer.weight], lr=0.5), optimizer_cls([ref_w], lr=0.5)
    data = [torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    for step in range(3):
        for x in data[:2] if step % 2 else data:  # gradient accumulation over 2 or 4 micro-batches
            layer(x).pow(2).mean().backward()
            fp8_linear(x, ref_w).pow(2).mean().backward()
        assert bits_equal(layer.weight.grad, ref_w.grad)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        assert layer._weight_cache is None, "an optimizer step drops the cached FP8 weight"
    with torch.no_grad():
        assert bits_equal(layer.eval()(data[0]), fp8_linear(data[0], ref_w))


def test_weight_is_quantized_once_per_step_and_requantized_after_any_change(monkeypatch):
    layer = FP8Linear(32, 16)
    nn.init.normal_(layer.weight, std=0.1)
    quantized = []
    real = fp8_linear_module.quantize_tensorwise

    def counting(x, *args, **kwargs):
        quantized.append(x is layer.weight)
        return real(x, *args, **kwargs)

    monkeypatch.setattr(fp8_linear_module, "quantize_tensorwise", counting)
    x = torch.randn(4, 32)
    for _ in range(3):
        layer(x).sum().backward()
    assert quantized.count(True) == 1
    with torch.no_grad():
        layer.weight.mul_(2)  # an in-place edit outside any optimizer
    y = layer(x)
    assert quantized.count(True) == 2
    layer.load_state_dict({k: v * 0.5 for k, v in layer.state_dict().items()})
    assert not bits_equal(layer(x), y) and quantized.count(True) == 3
