"""The per-step scalars of AdamW, one definition for every path (reference, compiled, native).

Slots: W1 = 1 − β1, B2 = β2, OMB2 = 1 − β2, STEP = −α·√c2/c1, EPS = max(ε·√c2, tiny),
DECAY = −α·λ, with c1 = 1 − β1^t and c2 = 1 − β2^t, computed in FP64 on the host.
"""

from __future__ import annotations

import math

import torch

__all__ = ["B2", "DECAY", "EPS", "OMB2", "STEP", "W1", "adamw_scalars"]

# Slots of the per-step scalar vector.
W1, B2, OMB2, STEP, EPS, DECAY = range(6)


def adamw_scalars(step: int, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> list[float]:
    """The per-step scalars (slots W1 … DECAY), computed in FP64 on the host."""
    sqrt_c2 = math.sqrt(1.0 - beta2**step)
    values = [0.0] * 6
    values[W1], values[B2], values[OMB2] = 1.0 - beta1, beta2, 1.0 - beta2
    values[STEP] = -lr * sqrt_c2 / (1.0 - beta1**step)
    values[EPS] = max(eps * sqrt_c2, torch.finfo(torch.float32).smallest_normal)
    values[DECAY] = -lr * weight_decay
    return values
