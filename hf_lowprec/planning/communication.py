"""What each GPU sends per step past one GPU, and how long that takes (`communication`): DDP
all-reduces the gradients, FSDP2 all-gathers the weights in forward and backward and
reduce-scatters the gradients, ZeRO-2 reduce-scatters the gradients and all-gathers the updated
weights. Ring collectives: each GPU sends (n-1)/n of the buffer per reduce-scatter or all-gather,
twice that per all-reduce, at the node's link speed up to 8 GPUs and at the network's past it.
"""

from __future__ import annotations

import dataclasses

from .gpus import GPU

__all__ = ["ENGINES", "Traffic", "communication"]

ENGINES = ("ddp", "fsdp2", "zero2")
GPUS_PER_NODE = 8


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes each GPU sends in one step, and the seconds at the slowest link it crosses."""

    bytes: float
    seconds: float


def communication(engine: str, gpus: int, params: float, grad_bytes: float, weight_bytes: float, gpu: GPU) -> Traffic:
    """Per-GPU traffic of one step of a model of `params` parameters whose gradients travel at
    `grad_bytes` per parameter (4 FP32, 2 BF16, 1 with FP8-LM's FP8 all-reduce) and whose weights
    are gathered at `weight_bytes` per parameter (2 BF16, 1 FP8)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}: choose one of {ENGINES}")
    if gpus < 1:
        raise ValueError(f"--gpus must be at least 1, got {gpus}")
    if gpus == 1:
        return Traffic(0.0, 0.0)
    share = (gpus - 1) / gpus
    if engine == "ddp":
        sent = 2 * share * params * grad_bytes
    elif engine == "fsdp2":
        sent = share * params * (2 * weight_bytes + grad_bytes)
    else:
        sent = share * params * (grad_bytes + weight_bytes)
    link = gpu.link if gpus <= GPUS_PER_NODE else gpu.network
    return Traffic(sent, sent / link)
