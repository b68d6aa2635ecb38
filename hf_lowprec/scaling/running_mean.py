"""Running-mean gradient accumulation for FP16 (docs/algorithms.md §5, ALS post, seed 002).

Over micro-batches k = 1..N, M_k = ((k−1)/k)·M_{k−1} + g_k/k (M_0 = 0), so the FP16 accumulator
never exceeds the largest micro-batch gradient, where a plain sum grows N-fold and overflows.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..compiling import run_fused, takes_gpu_path
from .loss_scale import FP16_MAX

__all__ = ["RunningMeanGradients", "running_mean_", "running_mean_hook_step"]


def running_mean_(mean: torch.Tensor, value: torch.Tensor, k: int) -> torch.Tensor:
    """M_k = ((k−1)/k)·M_{k−1} + value/k, in place in `mean`'s dtype.

    Three roundings, the arithmetic of `RunningMeanGradients`' hooks (autograd adds value/k
    as its own tensor). |M_k| ≤ max_j |g_j| up to rounding, so an FP16 accumulator cannot
    overflow from the sum.
    """
    if k < 1:
        raise ValueError(f"the micro-batch index k counts from 1, got {k}")
    if k == 1:
        return mean.copy_(value)
    return mean.mul_((k - 1) / k).add_(value / k)


def running_mean_hook_step(grad: torch.Tensor, mean: torch.Tensor | None, last: int, k: int) -> torch.Tensor:
    """What a running-mean hook does to one incoming gradient, run as it is on CPU and as one compiled
    graph on a GPU (`RunningMeanGradients`): an FP16 `grad` clamped to ±65504; `mean` (p.grad, None to
    leave it) zeroed where `last` is 0, else rescaled by last/k; returns the clamped grad / k."""
    if grad.dtype == torch.float16:
        grad = grad.clamp(-FP16_MAX, FP16_MAX)  # NaN stays NaN, ±inf becomes ±65504
    if mean is not None:
        if last == 0:
            mean.zero_()
        else:  # the ratio rounded to FP32, as the eager op's scalar is (a graph would keep it in FP64)
            mean.mul_(torch.full((), last / k, dtype=torch.float32, device=mean.device))
    return grad if k == 1 else grad / k


def _hook_step(grad: torch.Tensor, mean: torch.Tensor | None, last: int, k: int) -> torch.Tensor:
    """`running_mean_hook_step` eagerly on CPU; one launch (a compiled graph) on a GPU, where its eager
    ops were one to three launches per parameter per backward (issue #66); none with nothing to do."""
    if grad.dtype != torch.float16 and mean is None and k == 1:
        return grad
    if not takes_gpu_path(grad.device):
        return running_mean_hook_step(grad, mean, last, k)
    return run_fused(running_mean_hook_step, grad, mean, last, k, like=grad)


class _Windows:
    """The forward pre-hook that counts micro-batches (an object, not a closure: a model holding
    it pickles; an attribute update, which torch.compile traces)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        self.count += 1


class RunningMeanGradients:
    """Running-mean gradient accumulation over micro-batches, through parameter hooks.

    Each parameter's hook sees the incoming micro-batch gradient g_k before autograd adds it
    to `p.grad`: it rescales `p.grad` by (k−1)/k and hands on g_k/k, so `p.grad` holds M_k.
    Where the loop names the micro-batch's index j in its window (`micro_batch(j)`), k is j: a
    parameter last reached at i < j − 1 rescales by i/j (the micro-batches between had g = 0)
    and `to_sums` ends the window's mean over all of them. Otherwise k counts the micro-batch
    windows that reached the parameter since `p.grad` was last None (zero_grad) or `reset()`; a
    window starts at each forward of an attached model (or `new_window()`), and a second backward
    within one window (an auxiliary loss, a regularizer backwarded apart) adds to that micro-batch's
    g_k, as autograd sums it. Incoming FP16 gradients are clamped to ±65504 first, so +inf and −inf
    micro-batch gradients cannot meet as NaN.

    The loss must *not* be divided by the number of micro-batches: the mean does that (a loop
    that expects the sum, Accelerate's, turns the mean back with `to_sums`).
    """

    def __init__(self) -> None:
        self._counts: dict[int, tuple[int, int]] = {}  # id(param) → (k, the window of its last g_k)
        self._windows = _Windows()
        self._index: int | None = None  # the loop's micro-batch index in its window, where it names one
        self._models: set[int] = set()
        self._handles: list[Any] = []
        self._hooked: dict[int, weakref.ref] = {}  # id(param) → the parameter hooked

    def attach(self, model: torch.nn.Module) -> RunningMeanGradients:
        """Hook `model`'s trainable parameters; a model attached before keeps its hooks (a policy
        beside a value or reference model)."""
        if id(model) not in self._models:
            self._models.add(id(model))
            self._handles.append(model.register_forward_pre_hook(self._windows))
        for param in model.parameters():
            if param.requires_grad and not self._holds(param):
                self._add_hook(param)
        return self

    def new_window(self) -> None:
        """Start a micro-batch: the gradients of later backward passes are its g_k (each forward
        of an attached model calls this)."""
        self._windows.count += 1

    def micro_batch(self, index: int | None) -> None:
        """The gradients of later backward passes are micro-batch `index` (from 1) of the window; None:
        count the windows that reach each parameter instead."""
        if index is not None and index < 1:
            raise ValueError(f"the micro-batch index counts from 1, got {index}")
        self._index = index

    def to_sums(self, params: Any, divisor: int) -> None:
        """Once per accumulation window, before the unscale: each hooked parameter's M_k becomes
        k·M_k/`divisor`, the sum of its micro-batch gradients over the loss division `divisor` that
        the loop's own backward undid (k == `divisor`, whole windows under Accelerate's
        accumulation: untouched). What stock Accelerate accumulates, the mean kept while it sums;
        with `micro_batch` indices (k the last one reaching the parameter), the mean over `divisor`."""
        by_ratio: dict[float, list[torch.Tensor]] = {}  # one multi-tensor product per ratio, not one per parameter
        for param in params:
            k, window = self._counts.get(id(param), (0, 0)) if self._holds(param) else (0, 0)
            if param.grad is not None and k and k != divisor:
                by_ratio.setdefault(k / divisor, []).append(param.grad)
                self._counts[id(param)] = (divisor, window)  # once: a second unscale, another optimizer's
        for ratio, grads in by_ratio.items():
            torch._foreach_mul_(grads, ratio)  # FP16 overflow: the scaler's unscale_ clips it, and counts

    def params(self) -> list[torch.Tensor]:
        """The parameters hooked (still alive)."""
        return [p for p in (ref() for ref in self._hooked.values()) if p is not None]

    def adopt(self, params: Any, micro_batches: int) -> None:
        """Hook the parameters among `params` that began to train after `attach` (a frozen one
        unfrozen, one added to the optimizer later; a tensor that does not require a gradient
        cannot be hooked): the gradient each summed over this window's `micro_batches` backward
        passes becomes their mean, and later windows run through the hook."""
        for param in params:
            if param.requires_grad and not self._holds(param):
                if param.grad is not None and micro_batches > 1:
                    param.grad.div_(micro_batches)
                self._add_hook(param)

    def _add_hook(self, param: torch.Tensor) -> None:
        self._handles.append(param.register_hook(self._hook(param)))
        self._hooked[id(param)] = weakref.ref(param)

    def _holds(self, param: torch.Tensor) -> bool:
        hooked = self._hooked.get(id(param))
        return hooked is not None and hooked() is param

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._hooked = {}
        self._models = set()

    def reset(self) -> None:
        """Start a new accumulation window (call after the optimizer step)."""
        self._counts.clear()

    def _hook(self, param: torch.Tensor):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            key = id(param)
            last, window = (0, -1) if param.grad is None else self._counts.get(key, (0, -1))
            index = self._index
            here = self._windows.count if index is None else index
            if window == here:  # this micro-batch's g_k again: autograd adds g/k to M_k
                return _hook_step(grad, None, 0, last)
            k = last + 1 if index is None else index
            self._counts[key] = (k, here)
            # M_{k-1} zeroed where no micro-batch reached it, else rescaled by last/k: (k−1)/k where
            # the last micro-batch reached it (`to_sums` before the last micro-batch left M = (Σ g)/k).
            mean = param.grad if param.grad is not None and last != k else None
            return _hook_step(grad, mean, last, k)

        return hook
