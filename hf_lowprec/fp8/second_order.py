"""A gradient of a gradient through FP8 layers is refused, never silently wrong.

An FP8 GEMM's backward, and COAT's backward of a layer that saved its input in FP8, compute from
quantized copies with no graph; under create_graph (grad mode on in backward) their second-order
terms would be dropped without a word, so `refuses_double_backward` makes such a backward refuse.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ..compiling import in_torch_func

__all__ = [
    "WITHOUT_FP8_GEMMS",
    "DoubleBackwardError",
    "fp8_gemm_refusal",
    "keep_inputs",
    "refusal_message",
    "refuses_double_backward",
]

_ASKED = (
    "a gradient of a gradient was asked for (torch.autograd.grad(..., create_graph=True) or "
    "backward(create_graph=True), as a gradient penalty, R1, MAML or a Hessian-vector product does)"
)

#: The fix for a layer with FP8 GEMMs: a run without them.
WITHOUT_FP8_GEMMS = (
    "train this run with a strategy without FP8 GEMMs: 'bf16-mixed', or 'coat' with "
    "precision_options={'activations': False} (its FP8 optimizer states, BF16 GEMMs and activations); "
    "or take the gradient without create_graph"
)

_FP8_STRATEGIES = "fp8-lm-o1, fp8-lm-o2, fp8-lm-o3 and coat compute linear layers with FP8 GEMMs"

Backward = Callable[..., Any]


class DoubleBackwardError(RuntimeError):
    """A backward that was asked to build a graph ran through a layer whose backward cannot be
    differentiated (an FP8 GEMM, a COAT FP8-saved activation)."""


def refusal_message(layer: str, why: str, fix: str) -> str:
    """The refusal's words: `layer` names the layer and the strategies that use it, `why` says what
    its backward computes from, `fix` what to train with instead."""
    return (
        f"{layer}: {_ASKED}, but {why}, so the second-order terms through it cannot be "
        f"formed (they would be missing without an error). Fix: {fix}."
    )


def fp8_gemm_refusal(layer: str, saved: str = "FP8") -> str:
    """`refusal_message` for the backward of an FP8 layer's GEMMs: `layer` as "an FP8 linear
    layer"; `saved`, the format of the copies its forward saved (BF16 where the guard raised it)."""
    return refusal_message(
        f"{layer} ({_FP8_STRATEGIES})",
        f"its backward computes from the {saved} copies of its input and weight that the forward "
        "saved, which carry no graph",
        WITHOUT_FP8_GEMMS,
    )


class _Undifferentiable(torch.autograd.Function):
    """The gradients a backward computed, as they are (views), joined to the tensors they depend on
    (the incoming gradients, the layer's inputs): differentiating them raises."""

    @staticmethod
    def forward(message: str, count: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(g.view_as(g) for g in tensors[:count])

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.message = inputs[0]

    @staticmethod
    def backward(ctx: Any, *_: Any) -> Any:
        raise DoubleBackwardError(ctx.message)


def _undifferentiable(result: Any, message: str, sources: tuple[Any, ...]) -> Any:
    single = not isinstance(result, tuple)
    result = (result,) if single else result
    at = [i for i, g in enumerate(result) if isinstance(g, torch.Tensor) and g.is_floating_point()]
    sources = tuple(t for t in sources if isinstance(t, torch.Tensor) and t.requires_grad)
    if not at or not sources:  # nothing computed, or nothing it depends on is differentiable
        return result[0] if single else result
    marked = _Undifferentiable.apply(message, len(at), *(result[i] for i in at), *sources)
    out = list(result)
    for i, g in zip(at, marked):
        out[i] = g
    return out[0] if single else tuple(out)


def keep_inputs(ctx: Any, *inputs: Any) -> None:
    """In an autograd Function's `setup_context` under a torch.func transform: keep the layer's
    `inputs` (references, no copies) on `ctx`, so that the gradients its backward computes there stay
    joined to what they depend on and differentiating them is refused (`refuses_double_backward`)."""
    if in_torch_func():
        ctx.graph_inputs = inputs


def refuses_double_backward(message: Callable[[Any], str]) -> Callable[[Backward], Backward]:
    """Decorate the `backward(ctx, *grads)` of an autograd Function whose gradients carry no graph
    (computed from quantized copies): a backward that builds a graph (create_graph=True: autograd
    runs backward functions with grad mode on exactly then) raises `DoubleBackwardError` with
    `message(ctx)` (`refusal_message`) before it computes anything.

    Inside one `torch.func.grad` (transform level 1) every backward runs with grad mode on, the
    transform's own first-order one included, so there the gradients are returned as computed and
    raise only when differentiated: a `torch.autograd.grad(..., create_graph=True)` inside the
    transformed function (a gradient penalty in a functional loss) is refused when the transform
    differentiates its result, before any gradient is returned; the transform's own gradients are
    never differentiated. A nested transform's inner backward runs at level 2 and a create_graph
    backward at none: refused at once. Host-side only: no kernel, no sync; a backward without grad
    mode (every training step) runs as written. Not checked while torch.compile traces (a compiled
    graph's backward refuses double backward itself).
    """

    def decorate(backward: Backward) -> Backward:
        @functools.wraps(backward)
        def guarded(ctx: Any, *grads: Any) -> Any:
            if not torch.is_grad_enabled() or torch.compiler.is_compiling():
                return backward(ctx, *grads)
            if torch._C._functorch.maybe_current_level() != 1:
                raise DoubleBackwardError(message(ctx))
            sources = (*grads, *getattr(ctx, "graph_inputs", ()))
            return _undifferentiable(backward(ctx, *grads), message(ctx), sources)

        return guarded

    return decorate
