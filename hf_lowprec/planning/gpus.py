"""The GPUs a plan can name, with the numbers the roofline needs and where each comes from, and
every step the project has measured on a real GPU, kept with its tree and date, so a plan can say
how far the model is from each (`MEASURED`). When a new measurement disagrees by more than 20%,
this table is what changes (docs/planning.md, "Calibration").
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["GPUS", "MEASURED", "GPU", "Measured", "gpu_named"]


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
        raise ValueError(f"unknown GPU {name!r}: choose one of {sorted(GPUS)}, or give its numbers")
    return dataclasses.replace(GPUS[name], **numbers) if numbers else GPUS[name]


@dataclasses.dataclass(frozen=True)
class Measured:
    """A step measured on a real GPU, with the ledger of the tree it ran, counted at its shapes:
    kernels launched (`eager` of them one operation at a time, the rest in compiled graphs), GB
    moved, host syncs, GEMM TFLOPs by operand width; `note`: where a figure was derived."""

    section: str
    row: str
    gpu: str
    tree: str
    date: str
    step_ms: float
    kernels: int
    eager: int
    gigabytes: float
    syncs: int
    tflops: dict[str, float]
    note: str = ""


# The first device check (docs/benchmarks.md "On a GPU"): H200, tree e3ae492, 2026-11-28. Kernels,
# eager kernels and GB are that tree's ledger at the same shapes (issues #66 and #67); TFLOPs are
# the models' GEMM FLOPs (this ledger; the same in both trees), by the operand width each row ran
# them in. e2e: Llama 0.63 B, batch 4×2048, decoder layers compiled. moe: Qwen3-MoE 0.90 B, eager.
_FIRST = ("h200", "e3ae492", "2026-11-28")
_MOE_BF16_MIXED = (
    "its experts ran FP32 GEMMs through torch's per-group path (48 syncs): that tree's ledger was "
    "not kept, so the figures are today's count of torch-amp, which runs the same (autocast leaves "
    "the grouped GEMMs in FP32)"
)
MEASURED = (
    Measured("e2e", "bf16-mixed", *_FIRST, 63.6, 915, 303, 106, 0, {"bf16": 31.8}),
    Measured("e2e", "torchao float8", *_FIRST, 55.2, 811, 51, 114, 0, {"bf16": 7.1, "fp8": 24.7}),
    Measured("e2e", "fp8-lm-o2", *_FIRST, 147, 3845, 2865, 144, 0, {"bf16": 7.1, "fp8": 24.7}),
    Measured("moe", "bf16-pure", *_FIRST, 98.1, 2220, 2220, 99, 0, {"bf16": 7.27}),
    Measured("moe", "bf16-mixed", *_FIRST, 214, 5030, 5030, 170, 48, {"bf16": 4.8, "fp32": 2.47}, _MOE_BF16_MIXED),
    Measured("moe", "fp8-lm-o2", *_FIRST, 327, 9533, 9533, 311, 0, {"bf16": 6.03, "fp8": 1.23}),
)  # fmt: skip
