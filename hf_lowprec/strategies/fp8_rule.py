"""The options of the FP8 layer rule (`hf_lowprec.fp8.payoff`), shared by the strategies that
convert layers to FP8 (FP8-LM's and COAT): `fp8_layers`, `fp8_gpu`, `fp8_tokens`, checked
before any work, and `layer_rule`, which reads them when a model is converted; what it kept is
checked on resume (`checkpoints.resume.check_fp8_layout`; docs/strategies/fp8-lm.md).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Literal

from torch import nn

from ..fp8 import PayoffRule, payoff_rule
from ..fp8.payoff import rule_layout
from ..fp8.refusal import no_fp8_layer
from ..hardware import GPUS
from .interface import StrategyOptions

__all__ = ["RULE_OPTIONS", "FP8RuleOptions", "converted_layout"]

# The rule's options may change on resume: what decides the saved state's layout is the set of
# layers the rule kept, which the optimizer's state records and a resume checks (`fp8.payoff`).
RULE_OPTIONS = frozenset({"fp8_layers", "fp8_gpu", "fp8_tokens"})

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FP8RuleOptions(StrategyOptions):
    """Which layers an FP8 strategy converts.

    Args:
        fp8_layers: "pays": on a GPU with FP8 GEMMs, a layer or experts module whose three
            training GEMMs would not run faster in FP8, casts included, keeps BF16 (the startup
            report names each with both times); "all": every eligible layer is converted. Where
            FP8 is emulated (no CUDA device, or one without FP8 GEMMs) every layer is converted,
            unless `fp8_gpu` names the GPU to decide for. The rule prices the three GEMMs of a
            trained layer; a frozen one (a PEFT base, an RL reference model) runs fewer.
        fp8_gpu: the GPU the rule prices ("h100", "h200", "b200", "a100"); "" (default): the CUDA
            device this process runs on.
        fp8_tokens: tokens per micro-batch on each GPU the rule assumes (sequences × length).
    """

    fp8_layers: Literal["pays", "all"] = "pays"
    fp8_gpu: str = ""
    fp8_tokens: int = 8192

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fp8_gpu and self.fp8_gpu not in GPUS:
            raise ValueError(
                f"fp8_gpu must be one of {sorted(GPUS)} (or '' for this process's GPU), got {self.fp8_gpu!r}"
            )
        if not isinstance(self.fp8_tokens, int) or isinstance(self.fp8_tokens, bool) or self.fp8_tokens < 1:
            raise ValueError(f"fp8_tokens must be >= 1 (tokens per micro-batch), got {self.fp8_tokens}")

    def unread_options(self) -> dict[str, str]:
        unread = super().unread_options()
        if self.fp8_layers == "all":
            for key in ("fp8_gpu", "fp8_tokens"):
                unread[key] = (
                    f"{key} prices the layers for fp8_layers='pays', and fp8_layers='all' converts every "
                    f"eligible layer: drop {key} (or pass fp8_layers='pays')"
                )
        return unread

    def layer_rule(self, model: nn.Module) -> PayoffRule | None:
        """The rule to convert `model` with (None: every eligible layer); what it decided is
        logged and kept for the startup report (`model.fp8_rule`)."""
        if self.fp8_layers == "pays":
            rule, note = payoff_rule(self.fp8_gpu, self.fp8_tokens)
        else:
            rule, note = None, "fp8_layers='all': every eligible layer is converted"
        logger.info("FP8: %s", note)
        model.__dict__["fp8_rule"] = note
        key = next((k for k, g in GPUS.items() if rule is not None and g.name == rule.gpu.name), "")
        model.__dict__["fp8_rule_priced"] = (key, self.fp8_tokens)
        return rule


def converted_layout(strategy: Any, model: nn.Module) -> dict[str, object]:
    """What the rule decided for `model`, just converted by `strategy` (`rule_layout`, saved with
    the optimizer's state); a model `strategy` will refuse at its first step for want of an FP8
    layer (`fp8.refusal.no_fp8_layer`, the promise check's rule) is warned about now, with why."""
    refusal = no_fp8_layer(
        model, strategy.name, uses_fp8_gemm=strategy.uses_fp8_gemm, frozen_in_fp8=strategy.frozen_in_fp8
    )
    if refusal:
        logger.warning("%s. Training will stop with PrecisionPromiseError before its first step.", refusal)
    return rule_layout(model)
