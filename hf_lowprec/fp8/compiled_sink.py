"""FP8-LM O2's gradient sink, and its form inside a `torch.compile`d model (docs/strategies/fp8-lm.md).

A compiled backward cannot call the sink, and autograd casts what it returns to the FP16 master's
dtype, unscaled (gradients under 2^-24 vanished). So it returns g·σ, σ = 2^floor(log2(65504 /
amax(g))) from g's own amax, and writes σ into the sink's slot; the post-accumulate-grad hook
quantizes `p.grad` / σ (exact) and resets the slot in the same graph. g·σ is exact in FP16 down to
2^-30·amax(g), which FP8 at g's own scale flushes anyway: the eager sink's payload and scale.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from .scaled import pow2_scale

__all__ = ["GRAD_SINK_ATTR", "GradientSink", "compiled_grad_scale", "scaled_weight_grad"]

GRAD_SINK_ATTR = "_hf_lowprec_grad_sink"


class GradientSink:
    """A weight's sink into its `take(param, grad)` (`fp8.gradients`): weakly held weight, not pickled, eager
    only; `scale` is the 0-dim FP32 slot σ of a compiled backward (1 when none is pending)."""

    __slots__ = ("grads", "param", "scale")
    eager_only = True

    def __init__(self, grads: Any, param: torch.Tensor) -> None:
        self.grads, self.param = grads, weakref.ref(param)
        self.scale = torch.ones((), dtype=torch.float32, device=param.device)

    def __call__(self, grad: torch.Tensor) -> torch.Tensor | None:
        param = self.param()
        return grad if param is None else self.grads.take(param, grad)

    def pending_scale(self, grad: torch.Tensor) -> torch.Tensor | None:
        """The slot σ for the hook that quantizes `grad` (`p.grad`), on its device; None off it."""
        return self.scale if self.scale.device == grad.device else None

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return type(None), ()


@torch.compiler.assume_constant_result
def _scales_in_graph(sink: Any) -> bool:
    # Decided once, when the graph is built: the hook stores the gradient (an owner holds the
    # weight, one process). Over several ranks DDP's reducer sums `p.grad` itself: unscaled there.
    param = sink.param()
    single = not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)
    return param is not None and single and sink.grads._owner_of(param) is not None


def compiled_grad_scale(param: torch.Tensor) -> torch.Tensor | None:
    """Inside a compiled graph, the slot σ of `param`'s gradient sink, where the compiled backward
    returns the weight gradient times σ (`scaled_weight_grad`); None elsewhere or without one."""
    if not torch.compiler.is_compiling() or not param.requires_grad or param.dtype.itemsize < 2:  # FP8-stored
        return None
    sink = getattr(param, GRAD_SINK_ATTR, None)
    if not isinstance(sink, GradientSink) or sink.scale.device != param.device or not _scales_in_graph(sink):
        return None
    return sink.scale


def scaled_weight_grad(grad_w: torch.Tensor, slot: torch.Tensor, weight_dtype: torch.dtype) -> torch.Tensor:
    """g·σ in the weight's dtype, σ the power of two that puts amax(g) in FP16's top binade
    (1 for a zero or non-finite amax), written into `slot` for the hook that divides it out."""
    sigma = pow2_scale(grad_w.abs().amax(), torch.float16)
    slot.copy_(sigma)
    return (grad_w.float() * sigma).to(weight_dtype)
