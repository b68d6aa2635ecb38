"""Why an FP8 strategy refuses a model: `no_fp8_layer` reads what the conversion kept in high
precision (`model.fp8_skipped_layers`) and names the cause of each kind of layer (the speed rule,
dimensions FP8 GEMMs cannot take, a layer kept by what it is) and the fix. The promise check, the
strategies' prepare-time warning and the planners (`hf-lowprec plan`, `memory`) all ask it.
"""

from __future__ import annotations

from torch import nn

from .blocks import FrozenBlockFP8Linear
from .convert import DimensionReason, dimension_problem, is_gemm_layer
from .experts import FP8Experts
from .linear import FP8Linear
from .payoff import PayoffReason

__all__ = ["no_fp8_layer"]

_CAUSES = {
    "rule": "the speed rule (fp8_layers='pays') kept {layers} in BF16",
    "dims": "FP8 GEMMs cannot take the dimensions of {layers}",
    "name": "kept in high precision by name, whatever the options: {layers}",
}


def _cause(model: nn.Module, fqn: str, reason: str) -> tuple[str, str]:
    """("rule", "dims" or "name", the reason to show): why the layer at `fqn` kept high precision.
    A layer the rule kept whose dimensions FP8 could not take counts as "dims": fp8_layers='all'
    would not convert it either."""
    if isinstance(reason, PayoffReason):
        module = model.get_submodule(fqn) if fqn != "<root>" else model
        problem = dimension_problem(module) if is_gemm_layer(module) else None
        return ("dims", problem) if problem else ("rule", reason)
    return ("dims" if isinstance(reason, DimensionReason) else "name"), reason


def no_fp8_layer(model: nn.Module, name: str, *, uses_fp8_gemm: bool, frozen_in_fp8: bool) -> str | None:
    """The refusal when strategy `name` computes linear layers in FP8 and the converted `model`
    has no FP8 layer, naming per cause the kinds of layers kept (their last name, one reason
    each) and the fix; None when nothing is refused. `frozen_in_fp8` (COAT): its FP8 states
    still train where the speed rule kept layers FP8 could take, so those are no refusal."""
    if not (uses_fp8_gemm or frozen_in_fp8):
        return None
    if any(isinstance(m, (FP8Linear, FrozenBlockFP8Linear, FP8Experts)) for m in model.modules()):
        return None
    groups: dict[str, dict[str, str]] = {}  # cause → last name → one full name with its reason
    for fqn, reason in model.__dict__.get("fp8_skipped_layers", {}).items():
        cause, shown = _cause(model, fqn, reason)
        groups.setdefault(cause, {}).setdefault(fqn.rsplit(".", 1)[-1], f"{fqn}: {shown}")
    if not uses_fp8_gemm and "rule" in groups:
        return None
    causes = "; ".join(
        _CAUSES[c].format(layers=", ".join(sorted(groups[c]))) + f" (e.g. {next(iter(groups[c].values()))})"
        for c in _CAUSES
        if c in groups
    )
    if "rule" in groups:
        fix = (
            "pass precision_options={'fp8_layers': 'all'} to train those layers in FP8 anyway (slower than "
            "BF16 for layers this small), or train this model with 'bf16-mixed'"
        )
    else:
        fix = "train this model with 'bf16-mixed' (or another strategy without FP8 GEMMs)"
    return (
        f"{name!r} computes linear layers in FP8, but the model has no FP8 layer: "
        f"{causes or 'it has no linear layer'}. Fix: {fix}"
    )
