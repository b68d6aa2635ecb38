"""Every strategy's step on a fake CUDA device (`hf_lowprec.testing.fake_cuda`): it runs, the FP8
layers take the GEMM path of the device's compute capability, and a steady step copies
nothing from the host (issue #36).

With capability (9, 0) (Hopper) FP8 layers choose `torch._scaled_mm`, whose fake kernel
checks what cuBLASLt needs (FP8 operands, a row-major × column-major layout, dimensions that
are multiples of 16, scale shapes) for the forward GEMM and both backward GEMMs; with (8, 0)
(Ampere, no FP8 tensor cores) the BF16 upcast path. A CPU-only torch cannot run the autograd
engine or the whole model on CUDA tensors, fake or not: what runs is listed in that module's
docstring. Real-GPU tests are in tests/cuda (`make gpu-check`).
"""

import pytest
import torch

import hf_lowprec
from hf_lowprec.fp8 import FP8Linear, fp8_gemm_path
from hf_lowprec.testing import DEVICE, DeviceTraffic, fake_cuda, fake_cuda_step, fp8_layer_forward_backward

STRATEGIES = hf_lowprec.available_strategies()
FP8_STRATEGIES = [n for n in STRATEGIES if hf_lowprec.get_strategy(n).uses_fp8_gemm]
HOPPER, AMPERE = (9, 0), (8, 0)


# Every strategy runs here: what a CPU-only torch refuses on fake CUDA tensors (device guards in
# operator bindings, constant propagation onto the device) is worked around in
# hf_lowprec/testing/fake_cuda.py, each for its stated reason, never by excusing a strategy.
CASES = STRATEGIES


@pytest.mark.parametrize("name", CASES)
def test_a_steady_step_on_hopper_copies_nothing_from_the_host(name):
    result = fake_cuda_step(name, HOPPER)
    if name in FP8_STRATEGIES:
        assert result["fp8_layers"] > 0 and result["gemm_path"] == "scaled_mm", result
    listed = "\n".join(f"  {c}" for c in result["copies"])
    assert not result["copies"], f"{name}: {len(result['copies'])} host->device copies in one steady step:\n{listed}"


@pytest.mark.parametrize("name", FP8_STRATEGIES)
def test_fp8_layers_take_the_upcast_path_on_ampere(name):
    result = fake_cuda_step(name, AMPERE)
    assert result["fp8_layers"] > 0 and result["gemm_path"] == "upcast", result


def test_the_fake_scaled_mm_checks_what_cublaslt_needs():
    # Not a multiple of 16 (K = 40): the fake kernel refuses it as the real one would, so the
    # Hopper runs above do exercise the layout and padding of the FP8 layer.
    with fake_cuda(HOPPER):
        a = torch.empty(32, 40, device=DEVICE).to(torch.float8_e4m3fn)
        b = torch.empty(16, 40, device=DEVICE).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=DEVICE)
        with pytest.raises(RuntimeError):
            torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        layer = FP8Linear(40, 24).to(torch.float32)  # 40 and 24 are padded to 48 and 32 inside
        # Parameters that do not record autograd (fake_cuda: recording needs the device).
        layer.weight = torch.nn.Parameter(torch.empty(24, 40, device=DEVICE), requires_grad=False)
        layer.bias = torch.nn.Parameter(torch.empty(24, device=DEVICE), requires_grad=False)
        y, dx, dw, db = fp8_layer_forward_backward(layer, torch.empty(100, 40, device=DEVICE))
        assert fp8_gemm_path(DEVICE) == "scaled_mm"
        assert (y.shape, dx.shape, dw.shape, db.shape) == ((100, 24), (100, 40), (24, 40), (24,))
        assert {t.device for t in (y, dx, dw, db)} == {DEVICE}


def test_the_copy_counter_sees_a_host_tensor_sent_to_the_device():
    with fake_cuda(HOPPER):
        on_device = torch.zeros(3, device=DEVICE)
        with DeviceTraffic() as traffic:
            torch.zeros(3, device=DEVICE).add_(on_device)  # made on the device: no copy
            on_device * torch.tensor(2.0)  # a 0-dim host tensor is a kernel argument: no copy
        assert not traffic.copies, traffic.summary(traffic.copies)
        with DeviceTraffic() as traffic:
            torch.tensor([1.0, 2.0], device="cuda")
            torch.ones(4).to(DEVICE)
        assert len(traffic.copies) == 2, traffic.summary(traffic.copies)
        assert traffic.copies[0].where[0].startswith("tests/gpu/test_fake_cuda.py:")


# The recipes' kernels, each on the first capability that has it. torch's CUDA build checks the
# scale layouts at run time (its argument error names them): rowwise (M, 1) and (1, N) FP32
# contiguous; blockwise 1×128 scales outer-dim-major (stride 1 along M or N) and 128×128 scales
# K-major with 16-byte aligned columns; MX scales E8M0 in the blocked layout (the fake kernel
# checks their count). A CPU-only torch reports no CUDA version: blockwise needs CUDA ≥ 12.9.
RECIPE_DEVICES = [("rowwise", (8, 9)), ("rowwise", HOPPER), ("blockwise", HOPPER), ("mxfp8", (10, 0))]


def _recording_scaled_mm(calls):
    original = torch._scaled_mm

    def scaled_mm(a, b, *, scale_a, scale_b, out_dtype):
        # A 128×128 B scale has one column per 128 of B's N columns; a 1×128 one, one per column.
        square_b = scale_b.dim() == 2 and scale_b.shape[1] != b.shape[1]
        calls.append((scale_a, scale_b, square_b))
        return original(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)

    return scaled_mm


def _major_along(scale, dim):
    """Unit stride along `dim` (a size-1 tensor has every layout)."""
    return scale.stride(dim) == 1 or scale.numel() == scale.shape[dim]


@pytest.mark.parametrize("recipe, capability", RECIPE_DEVICES)
def test_each_recipe_runs_its_native_kernel_with_no_host_traffic(recipe, capability, monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", _recording_scaled_mm(calls))
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    result = fake_cuda_step("fp8-lm-o2", capability, recipe=recipe)
    assert result["fp8_layers"] == 8 and result["gemm_path"] == "scaled_mm", result
    assert result["copies"] == [] and result["syncs"] == [], result
    # 8 layers × 3 GEMMs × 2 steps, every one through the kernel with the recipe's scales.
    assert len(calls) == 48
    for scale_a, scale_b, square_b in calls:
        if recipe == "mxfp8":
            assert scale_a.dtype == scale_b.dtype == torch.float8_e8m0fnu and scale_a.dim() == 1
        elif recipe == "rowwise":
            assert scale_a.shape[1] == 1 and scale_b.shape[0] == 1 and scale_a.dtype == torch.float32
        else:
            assert _major_along(scale_a, 0), f"1×128 scales of A must be outer-dim-major: {scale_a.stride()}"
            if square_b:
                assert _major_along(scale_b, 0) and scale_b.stride(1) % 4 == 0, scale_b.stride()
            else:
                assert scale_b.is_contiguous(), f"1×128 scales of B must be outer-dim-major: {scale_b.stride()}"
    if recipe == "blockwise":
        assert {square for *_, square in calls} == {True, False}, "forward and dx 128×128, dW 1×128"


@pytest.mark.parametrize("recipe, capability", [("blockwise", (8, 9)), ("mxfp8", HOPPER), ("rowwise", AMPERE)])
def test_a_recipe_without_its_kernel_is_emulated(recipe, capability, monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", _recording_scaled_mm(calls))
    result = fake_cuda_step("fp8-lm-o2", capability, recipe=recipe)
    assert result["fp8_layers"] == 8 and result["copies"] == [] and result["syncs"] == [], result
    assert calls == []


def test_the_fp16_range_check_at_preparation_reads_every_amax_in_one_transfer():
    """fp16-als casts its parameters to FP16 after checking each one's largest |value|
    (`strategies.casting`): one device→host read for all of them, where it waited once per
    parameter (28 at 2 layers, 52 at 4: `.cpu()` inside the list)."""
    from hf_lowprec.testing.counted_step import checked_strategy, gpt2
    from hf_lowprec.testing.fake_cuda import to_fake_cuda

    for n_layer in (2, 4):
        with fake_cuda(HOPPER):
            model = to_fake_cuda(gpt2(n_layer))
            with DeviceTraffic(stand_in=True) as traffic:
                checked_strategy("fp16-als").prepare_model(model)
        # The values then read from the CPU copy are host memory (the counter lists those reads too).
        transfers = [event for event in traffic.syncs if "device->host" in event.op]
        assert len(transfers) == 1, (n_layer, traffic.summary())
