"""A gradient of a gradient through FP8 layers is refused, never silently wrong.

An FP8 GEMM's backward, and COAT's backward of a layer that saved its input in FP8, compute from
quantized copies with no graph; under create_graph (grad mode on in backward) their second-order
terms would be dropped without a word, so `refuse_double_backward` raises in the backward instead.
"""

from __future__ import annotations

import torch

__all__ = ["WITHOUT_FP8_GEMMS", "DoubleBackwardError", "refuse_double_backward", "refuse_fp8_gemm_double_backward"]

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


class DoubleBackwardError(RuntimeError):
    """A backward that was asked to build a graph ran through a layer whose backward cannot be
    differentiated (an FP8 GEMM, a COAT FP8-saved activation)."""


def _transform_level() -> int | None:
    return torch._C._functorch.maybe_current_level()


def refuse_double_backward(layer: str, why: str, fix: str) -> None:
    """Raise `DoubleBackwardError` when the backward now running builds a graph (create_graph=True:
    autograd runs backward functions with grad mode on exactly then).

    `layer` names the layer and the strategies that use it, `why` says what its backward computes
    from, `fix` what to train with instead. Host-side only: no kernel, no sync. Not checked while
    torch.compile traces (a compiled graph's backward refuses double backward itself), nor in the
    backward of one `torch.func.grad` (grad mode on there, yet first order).
    """
    # One torch.func.grad runs its backward with grad mode on, at transform level 1: first order.
    # A nested transform's inner backward runs at level 2, a create_graph backward at none.
    if torch.is_grad_enabled() and not torch.compiler.is_compiling() and _transform_level() != 1:
        raise DoubleBackwardError(
            f"{layer}: {_ASKED}, but {why}, so the second-order terms through it cannot be "
            f"formed (they would be missing without an error). Fix: {fix}."
        )


def refuse_fp8_gemm_double_backward(layer: str, saved: str = "FP8") -> None:
    """`refuse_double_backward` for the backward of an FP8 layer's GEMMs: `layer` as "an FP8 linear
    layer"; `saved`, the format of the copies its forward saved (BF16 where the guard raised it)."""
    if torch.is_grad_enabled():
        refuse_double_backward(
            f"{layer} ({_FP8_STRATEGIES})",
            f"its backward computes from the {saved} copies of its input and weight that the forward "
            "saved, which carry no graph",
            WITHOUT_FP8_GEMMS,
        )
