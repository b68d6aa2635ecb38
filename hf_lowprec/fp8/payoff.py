"""FP8 where it pays: whether a layer's three training GEMMs (forward, input gradient, weight
gradient) run faster in FP8, its casts included, than in BF16 on a named GPU, priced with the
planner's roofline and the same table (`hardware.GPUS`). FP8-LM's strategies and COAT keep a layer
or an experts module that would not pay in BF16 (`PayoffRule`, `payoff_rule`), the startup report
names each with both times, and a resume must keep the same ones (`rule_layout`, checked by
`checkpoints.resume.check_fp8_layout`; docs/strategies/fp8-lm.md, "Where FP8 pays").
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..grouped_experts import expert_gemm_shapes
from ..hardware import GPU, cuda_gpu, gpu_named

__all__ = [
    "CAST_BYTES",
    "CAST_KERNELS",
    "Payoff",
    "PayoffReason",
    "PayoffRule",
    "payoff_rule",
    "rule_layout",
    "training_gemms",
]

# Bytes the casts move per element of each FP8 operand (x, the weight, the output gradient):
# read twice in 16 bits (its amax, then the scaled cast), written once in FP8 per layout, and
# the three GEMMs take each operand in two layouts (`_scaled_mm` wants its first operand
# row-major and its second column-major). Two kernels per operand: the amax, the cast.
CAST_BYTES = 2 + 2 + 1 + 1
CAST_KERNELS = 2 * 3


@dataclasses.dataclass(frozen=True)
class Payoff:
    """Device seconds of one layer's three training GEMMs in BF16, and in FP8 with the casts."""

    bf16_s: float
    fp8_s: float

    @property
    def pays(self) -> bool:
        return self.fp8_s < self.bf16_s


def _gemm_seconds(a: int, b: int, c: int, width: int, gpu: GPU, groups: int) -> float:
    """`groups` GEMMs (a×b)·(b×c) with `width`-byte operands and a 16-bit output: the slowest of
    the FLOPs at the achieved rate, the bytes at the achieved bandwidth, and a kernel's floor."""
    rate = gpu.gemm_rate(torch.float8_e4m3fn if width == 1 else torch.bfloat16)
    moved = width * (a * b + b * c) + 2 * a * c
    return groups * max(2 * a * b * c / rate, moved / (gpu.bandwidth * gpu.bandwidth_fraction), gpu.kernel_floor_s)


def training_gemms(rows: int, k: int, n: int, gpu: GPU, groups: int = 1) -> Payoff:
    """A layer y = x·Wᵀ (W: n × k) that `rows` tokens pass through per step, split evenly over
    `groups` weights (the experts of a grouped GEMM): forward (m×k)·(k×n), input gradient
    (m×n)·(n×k), weight gradient (n×m)·(m×k), m = rows / groups, each on every group."""
    m = max(rows // groups, 1)

    def three(width: int) -> float:
        return sum(_gemm_seconds(a, b, c, width, gpu, groups) for a, b, c in ((m, k, n), (m, n, k), (n, m, k)))

    elements = rows * k + groups * n * k + rows * n
    casts = elements * CAST_BYTES / (gpu.bandwidth * gpu.bandwidth_fraction) + CAST_KERNELS * gpu.kernel_floor_s
    return Payoff(three(2), three(1) + casts)


class PayoffReason(str):
    """Why a layer keeps BF16 by the rule: a decision, logged as information, not a warning."""


@dataclasses.dataclass(frozen=True)
class PayoffRule:
    """The rule on `gpu` at `tokens` tokens a micro-batch (per GPU)."""

    gpu: GPU
    tokens: int

    def linear(self, k: int, n: int) -> Payoff:
        return training_gemms(self.tokens, k, n, self.gpu)

    def experts(self, module: nn.Module) -> Payoff:
        """An experts module's grouped GEMMs: every token goes to top-k experts, spread evenly."""
        config = getattr(module, "config", None)
        top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "top_k", None) or 1
        parts = [training_gemms(self.tokens * top_k, k, n, self.gpu, e) for _, e, n, k in expert_gemm_shapes(module)]
        return Payoff(sum(p.bf16_s for p in parts), sum(p.fp8_s for p in parts))

    def reason(self, payoff: Payoff) -> PayoffReason:
        return PayoffReason(
            f"FP8 would not pay on {self.gpu.name} at {self.tokens} tokens a micro-batch: its training GEMMs "
            f"take {payoff.bf16_s * 1e6:.0f} µs in BF16 and {payoff.fp8_s * 1e6:.0f} µs in FP8 with the casts "
            "(fp8_layers='all' converts it)"
        )


def payoff_rule(gpu: str = "", tokens: int = 8192) -> tuple[PayoffRule | None, str]:
    """(the rule, a line for the startup report): for the GPU named `gpu` (a key of
    `hardware.GPUS`), else the CUDA device this process runs on. No rule where FP8 GEMMs are
    emulated (no CUDA device, a GPU without FP8 GEMMs) or the table has no figures for the GPU:
    every eligible layer is converted, as the line says."""
    if gpu:
        entry, name = gpu_named(gpu), gpu
    else:
        name, entry = cuda_gpu()
        if not name:
            return None, "no CUDA device: FP8 GEMMs are emulated here, so every eligible layer is converted"
        if entry is None:
            return None, (
                f"no figures for {name}: every eligible layer is converted; name the closest GPU with "
                "precision_options={'fp8_gpu': ...} to keep the layers FP8 would not speed up in BF16"
            )
    if not entry.fp8:
        return None, f"{entry.name} has no FP8 GEMMs (they are emulated): every eligible layer is converted"
    return PayoffRule(entry, tokens), (
        f"FP8 where it pays on {entry.name} ({name}) at {tokens} tokens a micro-batch: layers whose "
        "training GEMMs would not run faster in FP8, casts included, keep BF16"
    )


def rule_layout(model: nn.Module) -> dict[str, object]:
    """What the rule decided for a converted `model`: the GPU it priced (a key of `GPUS`, "" for
    none), the tokens, and the layers and experts modules it kept in BF16 (sorted names). Saved
    with the optimizer's state; a resume that would keep other layers is refused by name."""
    key, tokens = model.__dict__.get("fp8_rule_priced", ("", 0))
    skipped = model.__dict__.get("fp8_skipped_layers", {})
    return {"gpu": key, "tokens": tokens, "kept": sorted(n for n, r in skipped.items() if isinstance(r, PayoffReason))}
