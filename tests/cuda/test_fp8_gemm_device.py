"""FP8 GEMMs on each device against FP64 references of the same quantized operands.

On CUDA with FP8 tensor cores (compute capability ≥ 8.9) this is `torch._scaled_mm` through
cuBLASLt: layouts (row/column-major operands are re-laid out to row-major × column-major),
padding of dimensions that are not multiples of 16, E4M3 and E5M2 operands. Elsewhere (CPU,
older GPUs) the exact BF16 upcast runs. Both are checked with the same references.
"""

import pytest
import torch

from hf_lowprec.fp8 import FP8Linear, fp8_gemm_path, fp8_linear
from hf_lowprec.fp8.gemm import UpcastGemm, fp8_mm, gemm_for
from hf_lowprec.fp8.linear import quantize_tensorwise
from hf_lowprec.testing import snr_db
from tests.fp8_reference import dequantized, fp64_linear_reference, fp64_product, gemm_error_bound
from tests.helpers import gamma

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
U32, U_BF16 = 2.0**-24, 2.0**-8
# cuBLASLt's FP8 kernels sum partial products in the tensor cores with fewer bits than FP32
# before promoting to FP32 (about 14 bits retained on H800, DeepSeek-V3 report §3.3.2). The
# bound for that path uses u = 2^-13 instead of FP32's 2^-24: still far below anything a wrong
# layout, a wrong scale or a lost padding row would produce (errors of order |S| itself).
U_TENSOR_CORE = 2.0**-13


def accumulation_unit(device: torch.device) -> float:
    return U_TENSOR_CORE if gemm_for(device).name == "scaled_mm" else U32


def make(shape, fmt, device, seed, column_major):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 2.0 ** torch.randint(-6, 6, (), generator=g).item()
    if column_major:  # same values, transposed storage
        x = x.t().contiguous().t()
    payload, scale = quantize_tensorwise(x.to(device), fmt, 0)
    return payload, scale


@pytest.mark.parametrize(
    "fmts", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)], ids=["e4m3xe4m3", "e5m2xe4m3", "e4m3xe5m2"]
)
@pytest.mark.parametrize("layout", ["rr", "cr", "rc", "cc"])  # (a, b): row- or column-major storage
@pytest.mark.parametrize("mkn", [(64, 128, 32), (24, 200, 40)], ids=["aligned", "padded"])
def test_fp8_gemm_against_fp64_of_the_same_operands(device, fmts, layout, mkn):
    m, k, n = mkn
    a8, sa = make((m, k), fmts[0], device, 1, layout[0] == "c")
    b8, sb = make((k, n), fmts[1], device, 2, layout[1] == "c")
    out = fp8_mm(a8, sa, b8, sb, torch.float32)
    assert out.device.type == device.type and out.shape == (m, n)
    exact, total = fp64_product(dequantized(a8, sa), dequantized(b8, sb))
    # Exact FP8 products, exact power-of-two scales: the sum (γ_{K−1}·Σ|a||b|) and one rounding to BF16.
    bound = gemm_error_bound(exact, total, k, accumulation_unit(device))
    err = (out.cpu().double() - exact).abs()
    assert (err <= bound).all(), f"worst error/bound {(err / bound).max().item():.3f}"


def test_default_path_per_device(device):
    expected = "upcast"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        expected = "scaled_mm"
    assert fp8_gemm_path(device) == expected


def test_upcast_path_agrees_on_this_device(device):
    # The upcast path on this device against the device's default path: both within the bound of
    # the same exact value, hence within the sum of the two bounds of each other.
    m, k, n = 48, 256, 64
    a8, sa = make((m, k), E5M2, device, 3, False)
    b8, sb = make((k, n), E4M3, device, 4, True)
    default = fp8_mm(a8, sa, b8, sb, torch.float32).cpu().double()
    upcast = fp8_mm(a8, sa, b8, sb, torch.float32, UpcastGemm()).cpu().double()
    exact, total = fp64_product(dequantized(a8, sa), dequantized(b8, sb))
    bound = (gamma(k - 1, accumulation_unit(device)) + gamma(k - 1, U32)) * total + 2.5 * U_BF16 * exact.abs()
    assert ((default - upcast).abs() <= bound).all()


@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_linear_forward_and_gradients_on_device(device, transposed, dtype):
    # SNR floors as in tests/fp8/test_linear.py: per-tensor E4M3 operands give ≈ 28 dB forward,
    # E5M2 output gradients ≈ 25 dB; 25 / 22 dB leave room for data and the activation dtype.
    ref = fp64_linear_reference(100, 64, 48, transposed)  # 100 rows: padded to 112 on the scaled_mm path
    y, x_grad, w_grad = ref.run(lambda x, w: fp8_linear(x, w, weight_transposed=transposed), dtype, device)
    assert y.dtype == dtype and x_grad.dtype == dtype and w_grad.dtype == dtype
    assert snr_db(ref.y, y) >= 25.0
    assert snr_db(ref.x_grad, x_grad) >= 22.0 and snr_db(ref.w_grad, w_grad) >= 22.0


def test_fp8_linear_module_matches_the_functional_form_on_device(device):
    # The cached FP8 weight (quantized once per step) gives exactly the functional result.
    torch.manual_seed(0)
    layer = FP8Linear(64, 32).to(device)
    torch.nn.init.normal_(layer.weight, std=0.1)
    x = torch.randn(5, 64, device=device)
    with torch.no_grad():
        assert torch.equal(layer(x), fp8_linear(x, layer.weight, layer.bias))
        assert torch.equal(layer(x), fp8_linear(x, layer.weight, layer.bias))
