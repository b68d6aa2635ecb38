"""What this machine computes fast, measured rather than looked up by processor name:
`fp16_gemm_slowdown`, whose large ratio the startup report turns into one warning
(`hf_lowprec.report.slow_fp16_warning`; docs/numerics.md, "Slow FP16 on CPUs").
"""

from __future__ import annotations

import functools
import math
import time

import torch

__all__ = ["fp16_gemm_slowdown", "SLOW_FP16_RATIO"]

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
