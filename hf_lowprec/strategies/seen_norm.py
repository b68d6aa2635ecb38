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

__all__ = ["SeenGradients", "SeenNorm", "reveals_nonfinite"]


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
        return cls(norm.detach(), _versions(grads))

    def covers(self, grads: Iterable[torch.Tensor]) -> bool:
        """Whether the norm was measured over each of `grads` as it is now."""
        return all(_unchanged(self.covered, grad) for grad in grads)

    def nonfinite_flag(self, grads: list[torch.Tensor], device: torch.device | None) -> torch.Tensor | None:
        """1.0 when the norm is inf or NaN, else 0.0 (0-dim FP32 on `device`, no host sync), if it
        covers `grads` and lies on `device`; None otherwise (the caller checks the gradients)."""
        if not grads or self.norm.device != device or not self.covers(grads):
            return None
        return self.norm.float().mul(0.0).nan_to_num(nan=1.0)


@dataclasses.dataclass
class SeenGradients:
    """The gradients a strategy's own pass read, as that pass left them: per gradient (weak
    reference, version). fp16-als's scaler sets the step's NaN flag as it unscales; the flag
    decides the step only for gradients unchanged since (a later in-place write, a callback's
    edit or noise, moves the version counter), the rule `SeenNorm` keeps for a clipping's norm.
    The versions are taken after the pass, so a write that leaves the counter as it was (a fused
    kernel's) within it does not matter."""

    covered: dict[int, tuple[weakref.ref, int]]

    @classmethod
    def of(cls, grads: Iterable[torch.Tensor]) -> SeenGradients:
        return cls(_versions(grads))

    def changed(self, grads: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """Those of `grads` the pass did not read as they are now (written or replaced since)."""
        return [grad for grad in grads if not _unchanged(self.covered, grad)]

    def unchanged(self, grads: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """Those of `grads` the pass read, unchanged since."""
        return [grad for grad in grads if _unchanged(self.covered, grad)]

    def renew(self, grads: Iterable[torch.Tensor]) -> None:
        """Take `grads` as they are now: for a write that cannot make a finite value non-finite
        (clipping's multiply by a factor at most 1), made to gradients `unchanged` before it."""
        self.covered.update(_versions(grads))


def _versions(grads: Iterable[torch.Tensor]) -> dict[int, tuple[weakref.ref, int]]:
    return {id(g): (weakref.ref(g), g._version) for g in grads}


def _unchanged(covered: dict[int, tuple[weakref.ref, int]], grad: torch.Tensor) -> bool:
    entry = covered.get(id(grad))
    return entry is not None and entry[0]() is grad and entry[1] == grad._version
