"""Collage (multi-component float BF16 AdamW) and the BF16 compensation baselines (docs/algorithms.md §2;
docs/strategies/collage.md, docs/strategies/bf16.md).

Every strategy here trains a BF16 model with BF16 gradients; they differ only in the update
rule, i.e. in the optimizer they build (`_UPDATES`: collage-light, collage-plus, collage-8bit,
bf16-kahan, bf16-sr, bf16-fp32states).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Literal

import torch

from ..distributed import written_since, written_version
from ..numerics import split
from ..optim import Collage8bitAdamW, CollageAdamW, FP32StatesAdamW, KahanAdamW, StochasticRoundingAdamW
from .baselines import BF16Pure
from .interface import PrecisionStrategy, StrategyOptions
from .registry import register
from .support import EngineSupport

__all__ = ["COMPENSATED_UPDATES", "BF16AdamWVariant", "BF16Weights", "BF16WeightsOptions", "Collage"]

logger = logging.getLogger(__name__)

Update = Literal["collage-light", "collage-plus", "collage-8bit", "kahan", "sr", "fp32-states"]

# update → (optimizer factory, model-state bytes/param). collage-light: Collage Alg. 2, (θ, δθ) via
# Grow; collage-plus: + β2 as an expansion and (v, δv); collage-8bit: (θ, δθ) via Grow, m and v
# blockwise 8-bit; kahan: Kahan-compensated update; sr: update stochastically rounded into BF16;
# fp32-states: option D−MW, FP32 moments and no master weights.
_UPDATES: dict[str, tuple[Any, float]] = {
    "collage-light": (lambda groups, o, **h: CollageAdamW(groups, variant="light", **h), 10.0),
    "collage-plus": (lambda groups, o, **h: CollageAdamW(groups, variant="plus", **h), 12.0),
    # 2 (θ) + 2 (δθ) + 2 (g) + 1 (m) + 1 (v) + 2·4/256 (the absmax per block of m and v).
    "collage-8bit": (lambda groups, o, **h: Collage8bitAdamW(groups, **h), 8.03),
    "kahan": (lambda groups, o, **h: KahanAdamW(groups, **h), 10.0),
    "sr": (lambda groups, o, **h: StochasticRoundingAdamW(groups, seed=o.seed, **h), 8.0),
    "fp32-states": (lambda groups, o, **h: FP32StatesAdamW(groups, **h), 12.0),
}
# Updates whose optimizer completes θ with a compensation (δθ, Kahan's k) that can be seeded.
COMPENSATED_UPDATES = ("collage-light", "collage-plus", "collage-8bit", "kahan")


@dataclasses.dataclass(frozen=True)
class BF16WeightsOptions(StrategyOptions):
    """Options of the BF16 update family.

    Args:
        update: the update rule; fixed by the registered name.
        seed: seed of the stochastic-rounding generator (bf16-sr only, refused by the others; its
            state is checkpointed). None: drawn from the run's seed
            (`optim.lowprec_optimizer.seed_from_run`: the Trainer's `--seed`, the same on every
            rank), so runs of other seeds round differently.
        seed_compensation: when `PrecisionStrategy.prepare_model` converts FP32, FP64 or FP16 parameters, keep the
            residual r(θ₃₂ − r(θ₃₂)) and start the optimizer's compensation (δθ, Kahan's k)
            at it, so θ + δθ holds the FP32 weights to ~16 bits instead of 8 (collage-light,
            collage-plus, collage-8bit, bf16-kahan; refused by the others when given).
    """

    update: Update = "collage-plus"
    seed: int | None = None
    seed_compensation: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.update not in _UPDATES:
            raise ValueError(f"update must be one of {sorted(_UPDATES)}, got {self.update!r}")

    def unread_options(self) -> dict[str, str]:
        unread = super().unread_options()
        if self.update != "sr":
            unread["seed"] = (
                "seed seeds bf16-sr's stochastic rounding, and this update rounds to nearest with no "
                "random state: drop seed (or pick bf16-sr)"
            )
        if self.update not in COMPENSATED_UPDATES:
            unread["seed_compensation"] = (
                "seed_compensation starts the compensation (δθ, Kahan's k) of collage-light, collage-plus, "
                "collage-8bit and bf16-kahan, and this update keeps none: drop seed_compensation"
            )
        return unread


class BF16Weights(BF16Pure):
    """A BF16 model whose optimizer compensates (or not) for BF16's lost arithmetic, by update rule.

    Registered as `Collage` (collage-*) and `BF16AdamWVariant` (bf16-kahan, bf16-sr, bf16-fp32states).
    """

    Options = BF16WeightsOptions
    # A new seed restarts the stochastic-rounding generators from it (StrategyOptimizer.load_state_dict);
    # seed_compensation acts only on a fresh run, between prepare_model and create_optimizer.
    resume_safe_options = PrecisionStrategy.resume_safe_options | {"seed", "seed_compensation"}
    prepared_state = ("_residuals",)

    def __init__(self, name: str | None = None, **options: Any) -> None:
        super().__init__(name, **options)
        # id(parameter) → (parameter, BF16 residual, its `written_version` after the cast),
        # from prepare_model until an optimizer claims them: the residual lives here between the two
        # calls, then in optimizer state.
        self._residuals: dict[int, tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]] = {}

    @property
    def bytes_per_param(self) -> float:  # type: ignore[override]
        return _UPDATES[self.options.update][1]

    def engine_support(self) -> EngineSupport:
        """collage-8bit's blocks follow the shards under FSDP2 and the partitions under ZeRO 1/2."""
        if self.options.update != "collage-8bit":
            return self.support
        return dataclasses.replace(
            self.support,
            fsdp2_note=(
                "BF16 DTensor shards and δθ sharded like them; 8-bit m, v blocks (256) laid out per "
                "shard, written per rank by the sharded checkpoint; BF16 all-gather, gradients averaged in FP32"
            ),
            zero_stages=(1, 2),
            zero_refusal=(
                "ZeRO-3 keeps a padded shard of every parameter, and 8-bit blocks over those shards are not "
                "verified; use ZeRO stage 1 or 2 (blocks over each rank's flat partition), or collage-light"
            ),
            zero_note=(
                "BF16 partitions; 8-bit blocks of 256 (m, v) laid over each rank's flat partition, padded per "
                "partition, so a block may span two parameters' elements; δθ in BF16"
            ),
        )

    def convert_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Cast to BF16, keeping each wide trainable parameter's residual for `build_optimizer`."""
        residuals = {}
        if self.options.update in COMPENSATED_UPDATES and self.options.seed_compensation:
            for param in model.parameters():
                # Any other float dtype (FP32, FP64, an FP16 checkpoint as loaded) leaves a residual.
                if param.requires_grad and param.is_floating_point() and param.dtype != self.param_dtype:
                    residuals[id(param)] = (param, split(param, self.param_dtype)[1])
        model = super().convert_model(model)
        # `Module.to` converts parameters in place (same objects), so the keys still hold.
        kept = {key: (p, r, written_version(p)) for key, (p, r) in residuals.items() if p.dtype == self.param_dtype}
        self._residuals.update(kept)
        return model

    def discard_prepared_state(self) -> None:
        self._residuals.clear()

    def build_optimizer(self, param_groups: list[dict[str, Any]], **hyper: Any) -> torch.optim.Optimizer:
        factory, _ = _UPDATES[self.options.update]
        optimizer = factory(param_groups, self.options, fused=self.options.fused, **hyper)
        for group in optimizer.param_groups:
            for param in group["params"]:
                claimed = self._residuals.pop(id(param), None)
                # A parameter written since prepare_model (a load, `resize_token_embeddings`, which swaps
                # in a tensor of another shape) starts at δθ = 0: the residual completed the old value.
                _, residual, version = claimed if claimed is not None and claimed[0] is param else (None, None, None)
                if residual is not None and not written_since(param, version) and residual.shape == param.shape:
                    optimizer.seed_compensation(param, residual)
        if self._residuals:
            # An optimizer over other tensors (e.g. DeepSpeed's partitions) cannot take them.
            logger.info("%d FP32 residuals not claimed by the optimizer were dropped", len(self._residuals))
            self._residuals.clear()
        return optimizer


@register(
    "collage-8bit",
    update="collage-8bit",
    summary="Collage-light weights (BF16 θ + δθ) with blockwise 8-bit AdamW states: 8 bytes/param",
)
@register(
    "collage-plus",
    update="collage-plus",
    summary="Collage (option C): + second moment as a BF16 pair (v, δv), so β2 = 0.999 still decays it",
)
@register(
    "collage-light",
    update="collage-light",
    summary="Collage (option B): BF16 everything, weights as a 2-component MCF (θ, δθ) updated by Grow",
)
class Collage(BF16Weights):
    """Collage: BF16 weights kept as a multi-component float pair (θ, δθ) updated by Grow."""


@register(
    "bf16-fp32states", update="fp32-states", summary="option D−MW: BF16 weights, FP32 AdamW states, no master weights"
)
@register("bf16-sr", update="sr", summary="BF16 AdamW whose update is stochastically rounded into the BF16 weights")
@register("bf16-kahan", update="kahan", summary="BF16 AdamW with a Kahan-compensated weight update")
class BF16AdamWVariant(BF16Weights):
    """The BF16 baselines Collage is compared against: Kahan, stochastic rounding, FP32 states."""
