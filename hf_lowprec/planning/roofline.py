"""A counted step's time on a named GPU (`predict`): the device's time from a roofline, the
host's from the launches it issues, and the step as the slower of the two (the host queues
kernels ahead of the device unless it must wait for a value: each host sync adds a drained
queue). docs/planning.md states the model; `gpus.MEASURED` is how far it is from real steps.
"""

from __future__ import annotations

import dataclasses

import torch

from .counting import StepCount
from .gpus import GPU, Measured
from .ledger import PhaseCounts

__all__ = ["Prediction", "predict", "predict_measured"]

_WIDTHS = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp32": torch.float32}


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Seconds: `step`, the device's `gpu` time (of which `gemm` in GEMMs and `memory` in the
    other kernels' traffic), the `host`'s; `bound`: "GPU" or "host"; `limit`: what sets the
    pace, in words."""

    step: float
    gpu: float
    gemm: float
    memory: float
    host: float
    syncs: int
    bound: str
    limit: str


def _gpu_seconds(counts: PhaseCounts, gpu: GPU) -> tuple[float, float, float]:
    """(device seconds, GEMM seconds, other kernels' memory seconds) of `counts`."""
    bandwidth = gpu.bandwidth * gpu.bandwidth_fraction
    gemm = 0.0
    gemm_bytes = 0.0
    for dtype, flops, moved in counts.gemm_kernels:
        gemm += max(flops / gpu.gemm_rate(dtype), moved / bandwidth, gpu.kernel_floor_s)
        gemm_bytes += moved
    other_kernels = counts.kernels - len(counts.gemm_kernels)
    memory = max(counts.bytes - gemm_bytes, 0) / bandwidth
    device = gemm + max(memory, 0.0) + other_kernels * gpu.kernel_floor_s
    return device, gemm, memory


def _limit(pred_gemm: float, memory: float, host: float, gpu_time: float, syncs: int) -> str:
    if host > gpu_time:
        return "launches: the device waits for the host" + (f" ({syncs} host syncs)" if syncs else "")
    return "GEMMs" if pred_gemm >= memory else "memory traffic (casts, norms, optimizer)"


def predict(count: StepCount, gpu: GPU) -> Prediction:
    """The step time of a counted step on `gpu`."""
    total = count.total()
    device, gemm, memory = _gpu_seconds(total, gpu)
    host = total.eager * gpu.launch_s + (total.kernels - total.eager) * gpu.kernel_s + total.graphs * gpu.graph_s
    step = max(device, host) + total.syncs * gpu.sync_s
    bound = "host" if host > device else "GPU"
    return Prediction(
        step, device, gemm, memory, host, total.syncs, bound, _limit(gemm, memory, host, device, total.syncs)
    )


def predict_measured(row: Measured, gpu: GPU) -> float:
    """The model's step time (seconds) for a measured row, from the ledger kept with it: its GEMM
    FLOPs at the achieved rates, all its bytes at the achieved bandwidth (the ledger kept no
    split by kernel), its kernels at the floor, its launches at the host's cost, its syncs at
    theirs."""
    bandwidth = gpu.bandwidth * gpu.bandwidth_fraction
    gemm = sum(tflops * 1e12 / gpu.gemm_rate(_WIDTHS[width]) for width, tflops in row.tflops.items())
    device = gemm + row.gigabytes * 1e9 / bandwidth + row.kernels * gpu.kernel_floor_s
    host = row.eager * gpu.launch_s + (row.kernels - row.eager) * gpu.kernel_s
    return max(device, host) + row.syncs * gpu.sync_s
