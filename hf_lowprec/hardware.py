"""What a machine computes fast. On a CPU, measured rather than looked up by processor name:
`fp16_gemm_slowdown`, whose large ratio the startup report turns into one warning
(`hf_lowprec.report.slow_fp16_warning`; docs/numerics.md, "Slow FP16 on CPUs"). On a GPU, from
its datasheet: `GPUS`, the rates and costs the planner's roofline and the FP8 layer rule read
(docs/planning.md), and `cuda_gpu`, the entry of the GPU this process runs on.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import torch

__all__ = ["GPU", "GPUS", "SLOW_FP16_RATIO", "cuda_gpu", "fp16_gemm_slowdown", "gpu_named"]

# FP16 GEMMs this many times slower than BF16 ones are worth a warning: an order of magnitude
# is far beyond timing noise on a loaded machine and far below the ≈190× of emulated FP16.
SLOW_FP16_RATIO = 10.0


def _best_seconds(dtype: torch.dtype, shape: tuple[int, int, int], repeats: int) -> float:
    """Best time of a linear layer's forward and backward: y = x·Wᵀ, dx = dy·W, dW = dyᵀ·x."""
    m, k, n = shape
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=generator).to(dtype).requires_grad_()
    weight = torch.randn(n, k, generator=generator).to(dtype).requires_grad_()
    dy = torch.randn(m, n, generator=generator).to(dtype)

    def step() -> None:
        torch.nn.functional.linear(x, weight).backward(dy)

    step()  # the first call pays for kernel selection and allocation
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best


@functools.cache
def fp16_gemm_slowdown(device: str = "cpu", shape: tuple[int, int, int] = (128, 128, 128), repeats: int = 3) -> float:
    """time(FP16 GEMMs) / time(BF16 GEMMs) on `device`: a (m, k) × (k, n) linear layer's forward and
    backward, the best of `repeats` each; cached per process.

    Only CPUs are probed (GPUs with FP16 have fast FP16 GEMMs): another device gives 1.0. A
    CPU build that cannot multiply FP16 at all gives infinity. The default shape costs a few
    milliseconds where a dtype is emulated and well under one where it is native.

    Why measured: a CPU with native BF16 arithmetic but none for FP16 (AVX512-BF16 without
    AVX512-FP16) runs FP16 matrix products through slow conversion paths (on such a development
    machine a 1024×128×512 FP16 matmul took 61 ms against 0.33 ms in BF16, ≈190×, and an
    `fp16-als` fidelity run that `bf16-mixed` finished in 2 minutes took over 40); on a CPU with
    neither (AVX2 only) both are slow and the ratio is near 1, so a processor-name list would be
    wrong one way or the other.
    """
    if torch.device(device).type != "cpu":
        return 1.0
    try:
        fp16 = _best_seconds(torch.float16, shape, repeats)
    except RuntimeError:
        return math.inf
    bf16 = _best_seconds(torch.bfloat16, shape, repeats)
    return fp16 / max(bf16, 1e-9)


@dataclasses.dataclass(frozen=True)
class GPU:
    """Peak rates (dense, per second), the fraction of each a training step's large kernels
    reach, and the host's cost of issuing work.

    - `bf16`, `fp8`, `fp32`: peak dense FLOPs of GEMMs with operands of that width (`fp8` 0 where
      the GPU has no FP8 GEMM: FP8 GEMMs then run at the BF16 rate, as the package's upcast path
      does); `fp32` without TF32 (torch's default for matmul).
    - `bandwidth`: memory bandwidth, bytes/s; `memory`: bytes.
    - `gemm_fraction`, `bandwidth_fraction`: achieved shares of peak on large GEMMs and streams.
    - `kernel_floor_s`: the least a kernel takes on the device, however small.
    - `launch_s`: host time per eager operation (Python, the dispatcher, the driver), fitted to
      the measured rows; `kernel_s`: per kernel of a compiled graph (its wrapper launches them);
      `graph_s`: per call of a compiled graph (guards, wrapper); `sync_s`: what one host sync adds
      to a step (the drained queue).
    - `link`, `network`: bytes/s per GPU within a node (NVLink) and between nodes."""

    name: str
    bf16: float
    fp8: float
    fp32: float
    bandwidth: float
    memory: float
    link: float
    network: float
    source: str
    gemm_fraction: float = 0.7
    bandwidth_fraction: float = 0.8
    kernel_floor_s: float = 2.5e-6
    launch_s: float = 40e-6
    kernel_s: float = 6e-6
    graph_s: float = 20e-6
    sync_s: float = 0.3e-3

    def gemm_rate(self, dtype: torch.dtype) -> float:
        """Achieved FLOPs/s of a GEMM whose operands have `dtype`."""
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            peak = self.fp8 or self.bf16
        elif dtype in (torch.bfloat16, torch.float16):
            peak = self.bf16
        else:
            peak = self.fp32
        return peak * self.gemm_fraction


_HOPPER = "NVIDIA H100/H200 datasheets (SXM, dense): BF16 989 TFLOPS, FP8 1979, FP32 67"
GPUS = {
    "h100": GPU("H100 SXM", 989e12, 1979e12, 67e12, 3.35e12, 80e9, 450e9, 50e9, _HOPPER + ", HBM3 3.35 TB/s"),
    "h200": GPU("H200 SXM", 989e12, 1979e12, 67e12, 4.8e12, 141e9, 450e9, 50e9, _HOPPER + ", HBM3e 4.8 TB/s"),
    "b200": GPU(
        "B200", 2250e12, 4500e12, 80e12, 8e12, 180e9, 900e9, 50e9,
        "NVIDIA B200 datasheet (dense): BF16 2.25 PFLOPS, FP8 4.5, HBM3e 8 TB/s",
    ),
    "a100": GPU(
        "A100 SXM 80GB", 312e12, 0.0, 19.5e12, 2.039e12, 80e9, 300e9, 25e9,
        "NVIDIA A100 datasheet (dense): BF16 312 TFLOPS, no FP8, FP32 19.5, HBM2e 2.04 TB/s",
    ),
}  # fmt: skip


def gpu_named(name: str, **numbers: float) -> GPU:
    """The GPU `name` (a key of `GPUS`), with any of its numbers replaced (`bandwidth=…`)."""
    if name not in GPUS:
        close = [key for key in GPUS if key == name.lower()]
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown GPU {name!r}: choose one of {sorted(GPUS)}{hint}")
    return dataclasses.replace(GPUS[name], **numbers) if numbers else GPUS[name]


# Names a CUDA device reports, mapped to the table's entries (H100 PCIe/NVL report "H100" too:
# the SXM figures are an upper bound for them).
_DEVICE_NAMES = (("H200", "h200"), ("H100", "h100"), ("H800", "h100"), ("B200", "b200"), ("A100", "a100"))


def cuda_gpu() -> tuple[str, GPU | None]:
    """(the CUDA device's name, its `GPUS` entry or None when the table has none), or
    ("", None) where this process has no CUDA device."""
    if not torch.cuda.is_available():
        return "", None
    try:
        name = torch.cuda.get_device_name()
    except (AssertionError, RuntimeError):  # a device that cannot say its name (a test's fake one)
        return "an unnamed CUDA device", None
    key = next((k for marker, k in _DEVICE_NAMES if marker in name.upper()), None)
    return name, GPUS[key] if key else None
