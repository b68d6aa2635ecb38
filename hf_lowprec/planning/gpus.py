"""The GPUs a plan can name (`GPUS`, kept in `hardware` with the numbers the roofline needs and
where each comes from: the FP8 layer rule reads them too), and every step the project has
measured on a real GPU, kept with its tree and date, so a plan can say
how far the model is from each (`MEASURED`). When a new measurement disagrees by more than 20%,
this table is what changes (docs/planning.md, "Calibration").
"""

from __future__ import annotations

import dataclasses

from ..hardware import GPU, GPUS, gpu_named

__all__ = ["GPUS", "MEASURED", "GPU", "Measured", "gpu_named"]


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
# Both ledgers counted attention with the packed-sequence mask no GPU run builds (non-causal, the
# mask's kernels and bytes): since 2026-12-07 the TFLOPs are recounted causal, and each row's
# kernels, eager kernels and GB less what today's ledger counts for that mask at the same shape
# and strategy (e2e 31 kernels, 15 eager, 3.2 GB; moe 79, all eager, 2.5-3.4 GB).
_FIRST = ("h200", "e3ae492", "2026-11-28")
_MOE_BF16_MIXED = (
    "its experts ran FP32 GEMMs through torch's per-group path (48 syncs): that tree's ledger was "
    "not kept, so the figures are today's count of torch-amp, which runs the same (autocast leaves "
    "the grouped GEMMs in FP32)"
)
MEASURED = (
    Measured("e2e", "bf16-mixed", *_FIRST, 63.6, 884, 288, 103, 0, {"bf16": 29.9}),
    Measured("e2e", "torchao float8", *_FIRST, 55.2, 780, 36, 111, 0, {"bf16": 5.1, "fp8": 24.7}),
    Measured("e2e", "fp8-lm-o2", *_FIRST, 147, 3814, 2850, 141, 0, {"bf16": 5.1, "fp8": 24.7}),
    Measured("moe", "bf16-pure", *_FIRST, 98.1, 2141, 2141, 96, 0, {"bf16": 6.31}),
    Measured("moe", "bf16-mixed", *_FIRST, 214, 4951, 4951, 167, 48, {"bf16": 3.84, "fp32": 2.47}, _MOE_BF16_MIXED),
    Measured("moe", "fp8-lm-o2", *_FIRST, 327, 9454, 9454, 308, 0, {"bf16": 5.07, "fp8": 1.23}),
)  # fmt: skip
