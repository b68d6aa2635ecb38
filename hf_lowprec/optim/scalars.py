"""The per-step scalars of AdamW, one definition for every path (reference, compiled, native):
computed in FP64 on the host (`adamw_scalars`) or on the device (`device_scalar_rows`), with the
same bits on CPU, and rounded once to FP32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..compiling import run_fused

__all__ = [
    "BETA2",
    "DECAY",
    "EPS",
    "ONE_MINUS_BETA2",
    "STEP",
    "ONE_MINUS_BETA1",
    "adamw_scalars",
    "check_adamw_hyperparameters",
    "device_scalar_rows",
    "scalar_rows",
]

# Slots of the per-step scalar vector: ONE_MINUS_BETA1 = 1 − β1, BETA2 = β2, ONE_MINUS_BETA2 = 1 − β2,
# STEP = −α·√c2/c1, EPS = max(ε·√c2, tiny), DECAY = −α·λ, with c1 = 1 − β1^t and c2 = 1 − β2^t.
ONE_MINUS_BETA1, BETA2, ONE_MINUS_BETA2, STEP, EPS, DECAY = range(6)
_TINY = torch.finfo(torch.float32).smallest_normal


def check_adamw_hyperparameters(name: str, lr: float, betas: Sequence[float], eps: float, weight_decay: float) -> None:
    """Raise ValueError naming the bad value and what to pass instead (TypeError for a string)."""
    for key, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay), ("betas", betas)):
        if isinstance(value, str) or (key == "betas" and any(isinstance(b, str) for b in value)):
            raise TypeError(f"{name}: {key}={value!r} is text; pass a number (e.g. lr=1e-3, betas=(0.9, 0.999))")
    if not lr >= 0.0:
        raise ValueError(f"{name}: invalid lr={lr!r}; the learning rate must be >= 0 (e.g. lr=1e-3)")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{name}: invalid betas={tuple(betas)!r}; pass two values in [0, 1), e.g. betas=(0.9, 0.999)")
    if not eps >= 0.0:
        raise ValueError(f"{name}: invalid eps={eps!r}; eps must be >= 0 (e.g. eps=1e-8)")
    if not weight_decay >= 0.0:
        raise ValueError(f"{name}: invalid weight_decay={weight_decay!r}; it must be >= 0 (0.0 disables decay)")


def adamw_scalars(step: int, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> list[float]:
    """The per-step scalars (slots ONE_MINUS_BETA1 … DECAY), computed in FP64 on the host."""
    sqrt_c2 = math.sqrt(1.0 - beta2**step)
    values = [0.0] * 6
    values[ONE_MINUS_BETA1], values[BETA2], values[ONE_MINUS_BETA2] = 1.0 - beta1, beta2, 1.0 - beta2
    values[STEP] = -lr * sqrt_c2 / (1.0 - beta1**step)
    values[EPS] = max(eps * sqrt_c2, _TINY)
    values[DECAY] = -lr * weight_decay
    return values


def scalar_rows(step: int, device: torch.device, **hyper: float) -> torch.Tensor:
    """`adamw_scalars(step)` as an FP32 tensor on `device`: built in place on a CPU, filled in
    slot by slot elsewhere (a kernel argument, not a pageable copy from the host)."""
    values = adamw_scalars(step, **hyper)
    if device.type == "cpu":
        return torch.tensor(values, dtype=torch.float32)
    row = torch.empty(len(values), dtype=torch.float32, device=device)
    for slot, value in enumerate(values):
        row.select(0, slot).fill_(value)
    return row


def device_scalar_rows(
    steps: list[torch.Tensor], *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float
) -> list[torch.Tensor]:
    """The scalar rows of the next step of each 0-dim FP64 step count in `steps` (one device),
    computed there in FP64 as `adamw_scalars` computes them on the host, rounded once to FP32.

    Used once a skipped step may have left the host not knowing t (while the step counts are host
    integers, `adamw_scalars` serves). The sequence is the host's operation for operation, so the
    bits are the same on CPU: β^t is libm's `pow` in both (0-dim CPU tensors take the scalar
    loop), every other operation is one IEEE-rounded FP64 operation. Nothing is copied from the
    host to the device. One compiled graph (`run_fused`; eagerly, about twenty launches a
    step per bucket): lr, the betas and the other hyper-parameters enter it as numbers, not
    constants, so a schedule changing lr or β1 does not compile it again. The counts enter it stacked, one tensor of
    any length (a list is guarded on its length: a graph per bucket size, and a process that met
    33 sizes hit the recompile limit and ran the eager operations from then on)."""
    counts = torch.stack(steps)
    return list(run_fused(_device_scalar_table, counts, lr, beta1, beta2, eps, weight_decay, like=counts).unbind(0))


def _device_scalar_table(
    counts: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float
) -> torch.Tensor:
    # Every hyper-parameter meets tensors only in tensor arithmetic (not as a multi-tensor op's
    # scalar, not as pow's base), so each stays an input of the graph: a schedule moving lr or β1
    # (OneCycleLR's momentum cycle) compiles nothing again. Exact products by 1 make them tensors,
    # then each slot is the host's FP64 operation.
    t = counts + 1.0
    one = torch.ones_like(t)
    b1, b2 = one * beta1, one * beta2
    c1 = -torch.pow(b1, t) + 1.0  # fl(1 − β1^t): negation is exact
    c2 = -torch.pow(b2, t) + 1.0
    sqrt_c2 = torch.sqrt(c2)
    columns = [
        -b1 + 1.0,  # fl(1 − β1)
        b2,
        -b2 + 1.0,
        sqrt_c2 * -(one * lr) / c1,  # −α·√c2/c1
        torch.clamp_min(sqrt_c2 * (one * eps), _TINY),
        -(one * lr) * weight_decay,  # −α·λ
    ]
    # One (parameters × 6) table; the caller's rows are views of it.
    return torch.stack(columns, dim=1).float()
