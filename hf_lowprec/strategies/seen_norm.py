"""The pre-clip gradient norm the training loop's clipping measured this step, with the gradients
it covers (`SeenNorm`): the step's non-finite flag is read from it (the strategies'
process_gradients, `strategies.interface`) instead of from a pass of its own over every gradient:
two launches, where checking the gradients again is a multi-tensor reduction over all of them
(about 40 launches and a read of every gradient at 0.6 B parameters). When the norm serves, and
why it is the same decision: `SeenNorm`.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable

import torch

__all__ = ["SeenNorm", "reveals_nonfinite"]


def reveals_nonfinite(norm_type: float | str) -> bool:
    """Whether a `norm_type` norm of finite values is finite only if they all are: p > 0 or
    p = inf (|NaN|^p is NaN, inf^p is inf); not p = 0 (a count) or p < 0 (inf^p = 0)."""
    p = float(norm_type)
    return p > 0  # inf included; NaN is not > 0


@dataclasses.dataclass
class SeenNorm:
    """A clipping's pre-clip norm and, per gradient it covered, (weak reference, version).

    A p-norm with p > 0 or p = inf (`reveals_nonfinite`; not Accelerate's norm_type=0, a count) is
    finite exactly when every gradient it covers is finite and their norm is within FP32's range,
    so `norm · 0` is 0 or NaN. Gradients whose norm overflows though their elements are finite
    skip the step too (torch's GPU norm sums squares in FP32, so from |g| ≈ 1.8e19): clipping
    would have scaled them by max_norm / inf = 0, and torch's measuring call (max_norm = inf) by
    inf / inf = NaN.

    The norm serves only where it covers each gradient the step reads, as that gradient is now:
    the same tensor (a weak reference), unchanged since it was measured (its version counter: an
    in-place operation moves it, so clipping's own scaling comes before the note, a later backward
    after it). Some writes leave the counter as it was (`GradScaler.unscale_`'s fused kernel, a
    collective, a write through `.data`): a strategy that writes the gradients so after a clipping
    (fp16-mixed's unscaling, `strategies.fp16_base`) drops the note, and each step takes the note
    once. Where the norm does not serve, the step checks the gradients itself. A norm over more
    gradients than the step reads serves: a non-finite value anywhere makes a clipping's
    coefficient NaN for every gradient it scales.
    """

    norm: torch.Tensor
    covered: dict[int, tuple[weakref.ref, int]]

    @classmethod
    def of(cls, norm: torch.Tensor, parameters: Iterable[torch.Tensor]) -> SeenNorm:
        grads = (p.grad for p in parameters if p.grad is not None)
        return cls(norm.detach(), {id(g): (weakref.ref(g), g._version) for g in grads})

    def covers(self, grads: Iterable[torch.Tensor]) -> bool:
        """Whether the norm was measured over each of `grads` as it is now."""
        for grad in grads:
            entry = self.covered.get(id(grad))
            if entry is None or entry[0]() is not grad or entry[1] != grad._version:
                return False
        return True

    def nonfinite_flag(self, grads: list[torch.Tensor], device: torch.device | None) -> torch.Tensor | None:
        """1.0 when the norm is inf or NaN, else 0.0 (0-dim FP32 on `device`, no host sync), if it
        covers `grads` and lies on `device`; None otherwise (the caller checks the gradients)."""
        if not grads or self.norm.device != device or not self.covers(grads):
            return None
        return self.norm.float().mul(0.0).nan_to_num(nan=1.0)
