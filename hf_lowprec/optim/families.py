"""The AdamW families, each a composition of `formats` and `rules` (docs/algorithms.md §2, §5): all
run the same arithmetic (`adamw.Composition.step`) and differ only in storage and in where they
round the update into θ.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from ..numerics import LOW_PRECISION_DTYPES
from .adamw import AdamW, Composition
from .dispatch import FusedMode
from .formats import Blockwise8bit, Format, Pair, Plain, Scaled
from .rules import Grow, Kahan, Master, Nearest, StochasticRounding

__all__ = [
    "FP32_ADAMW",
    "Collage8bitAdamW",
    "CollageAdamW",
    "FP32StatesAdamW",
    "FP32StatesSRAdamW",
    "KahanAdamW",
    "MasterWeightAdamW",
    "PlainAdamW",
    "SixteenBitAdamW",
    "StochasticRoundingAdamW",
]

ParamsT = Iterable[torch.Tensor] | Iterable[dict[str, Any]]
FP32 = Plain(torch.float32)

# The families below, with the bytes per BF16 parameter (the weight, its gradient and the states;
# "param's": the parameter's dtype):
#
#   optimizer                  m            v              rule                 bytes/param
#   PlainAdamW (option A)      param's      param's        Nearest              8
#   FP32StatesAdamW (D−MW)     FP32         FP32           Nearest              12
#   KahanAdamW                 param's      param's        Kahan                10
#   StochasticRoundingAdamW    param's      param's        StochasticRounding   8
#   CollageAdamW light (B)     param's      param's        Grow                 10
#   CollageAdamW plus (C)      param's      pair (v, δv)   Grow                 12
#   MasterWeightAdamW          FP32         FP32           Master               14 (16 for FP16)
#   FP32StatesSRAdamW          FP32         FP32           StochasticRounding   12
#   Collage8bitAdamW           8-bit block  8-bit block    Grow                 8.03
#
# Every family steps an FP32 parameter (one a model keeps in FP32: `_keep_in_fp32_modules`) as plain
# FP32 AdamW, 16 bytes/param, nothing to compensate, round or keep a master of: PlainAdamW by its own
# composition, the others by `SixteenBitAdamW`'s `FP32_ADAMW`.


def param_dtype_v(param: torch.Tensor) -> Format:
    """v in the parameter's dtype: plain, or scaled for FP16 (`formats.Scaled`).

    FP16 cannot hold v below 2^-24, and (1 − β2)·g² underflows for |g| ≲ 1e-2, which turns
    m/(√v + ε) into a huge step; BF16 has FP32's range and needs no scale."""
    return Scaled() if param.dtype == torch.float16 else Plain()


FP32_ADAMW = Composition(Plain(), Plain(), Nearest())


class SixteenBitAdamW(AdamW):
    """A family for 16-bit parameters (`sixteen_bit_composition`) that steps an FP32 one as plain FP32 AdamW."""

    param_dtypes: ClassVar[tuple[torch.dtype, ...] | None] = (*LOW_PRECISION_DTYPES, torch.float32)
    dtype_advice: ClassVar[str] = (
        "cast the model with hf_lowprec.strategies.casting.cast_model(model, torch.bfloat16) (model.to would round "
        "its rotary frequencies too)"
    )

    def __init__(self, params: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        dtypes = {p.dtype for group in self.param_groups for p in group["params"]}
        if dtypes == {torch.float32}:  # FP32 beside 16-bit parameters only: an FP32 model was not cast
            raise ValueError(
                f"{type(self).__name__} steps BF16 or FP16 parameters (an FP32 one only beside them, as a "
                f"model keeps in FP32), but every parameter here is FP32; {self.dtype_advice}, or use "
                f"PlainAdamW / torch.optim.AdamW for an FP32 model"
            )

    def composition(self, param: torch.Tensor, group: dict[str, Any]) -> Composition:
        return FP32_ADAMW if param.dtype == torch.float32 else self.sixteen_bit_composition(param, group)

    def sixteen_bit_composition(self, param: torch.Tensor, group: dict[str, Any]) -> Composition:
        """The formats of m and v and the update rule for a BF16 or FP16 `param` in `group`."""
        raise NotImplementedError


class PlainAdamW(AdamW):
    """AdamW stored in the parameter's dtype, θ ← r(θ + Δθ).

    For BF16 parameters this is option A (pure BF16: updates below ulp(θ)/2 are lost); for FP32
    parameters it is ordinary AdamW. The `fp32`, `bf16-mixed` and `bf16-pure` strategies use
    it, so they share the lost-arithmetic tracking with the low-precision optimizers.
    """

    param_dtypes: ClassVar[tuple[torch.dtype, ...] | None] = None

    def composition(self, param: torch.Tensor, group: dict[str, Any]) -> Composition:
        return Composition(Plain(), param_dtype_v(param), Nearest())


class FP32StatesAdamW(SixteenBitAdamW):
    """Option D−MW: BF16/FP16 parameters, FP32 moments, θ ← r(θ + Δθ), no master.

    Small updates are still lost at the parameter (Collage Tables 3–6: worse than Collage-plus
    at the same 12 bytes/param).
    """

    def sixteen_bit_composition(self, param: torch.Tensor, group: dict[str, Any]) -> Composition:
        return Composition(FP32, FP32, Nearest())


class KahanAdamW(SixteenBitAdamW):
    """BF16/FP16 AdamW whose update is added with Kahan compensated summation (`rules.Kahan`)."""

    def sixteen_bit_composition(self, param: torch.Tensor, group: dict[str, Any]) -> Composition:
        return Composition(Plain(), param_dtype_v(param), Kahan())


class StochasticRoundingAdamW(SixteenBitAdamW):
    """BF16/FP16 AdamW writing θ ← SR(θ + Δθ) (`rules.StochasticRounding`), unbiased.

    `seed` seeds the per-device generator that draws one seed per parameter and step; its state
    travels in `state_dict()["generator_states"]`, so a resumed run continues bit for bit.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        seed: int | None = None,
        *,
        fused: FusedMode = "auto",
        **torch_arguments: Any,
    ):
        super().__init__(params, lr, betas, eps, weight_decay, fused=fused, seed=seed, **torch_arguments)

    def sixteen_bit_composition(self, param: torch.Tensor, group: dict[str, Any]) -> Composition:
        return Composition(Plain(), param_dtype_v(param), StochasticRounding())


class FP32StatesSRAdamW(StochasticRoundingAdamW):
    """`StochasticRoundingAdamW` with FP32 moments (the ALS post keeps optimizer states in FP32):
    in FP16, v ≈ g² of gradients near 1e-3 sits at the subnormal floor. 12 bytes/param."""

    def sixteen_bit_composition(self, param: torch.Tensor, group: dict[str, Any]) -> Composition:
        return Composition(FP32, FP32, StochasticRounding())


class MasterWeightAdamW(SixteenBitAdamW):
    """Classic mixed precision: FP32 master θ₃₂ and FP32 moments; the weight is r(θ₃₂).

    Nothing is lost at the weight: the master keeps what FP16 cannot hold, and it is what the
    metrics and full-precision exports read (`held_value`).
    """

    def sixteen_bit_composition(self, param: torch.Tensor, group: dict[str, Any]) -> Composition:
        return Composition(FP32, FP32, Master())


VARIANTS = ("light", "plus")


class CollageAdamW(SixteenBitAdamW):
    """Collage (Yu et al., ICML 2024, Alg. 2): BF16/FP16 states, MCF-compensated updates.

    Args:
        variant: "light" compensates θ only (option B, 10 bytes/param); "plus" also keeps the
            second moment as a pair (v, δv) (option C, 12 bytes/param), so β2·v decays under
            β2 = 0.999 as it must (in plain BF16, r(0.999·v) == v).
        Other arguments as `AdamW`.

    State (parameter's dtype): "exp_avg", "exp_avg_sq", "param_error" δθ, "exp_avg_sq_error" δv
    (plus only; a group switched from light to plus starts δv at zero), "step".
    """

    extra_options: ClassVar[tuple[str, ...]] = ("variant",)

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        variant: str = "plus",
        *,
        fused: FusedMode = "auto",
        **torch_arguments: Any,
    ):
        super().__init__(params, lr, betas, eps, weight_decay, fused=fused, variant=variant, **torch_arguments)

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        if group["variant"] not in VARIANTS:
            raise ValueError(
                f"CollageAdamW: unknown variant={group['variant']!r}; choose 'light' "
                f"(compensated parameters) or 'plus' (also compensated second moment)"
            )

    def sixteen_bit_composition(self, param: torch.Tensor, group: dict[str, Any]) -> Composition:
        v = param_dtype_v(param)
        return Composition(Plain(), Pair(v) if group["variant"] == "plus" else v, Grow())


class Collage8bitAdamW(SixteenBitAdamW):
    """Collage-light weights (BF16 θ + δθ, `rules.Grow`) with blockwise 8-bit m and v.

    m and v are stored as `formats.Blockwise8bit` (dynamic-map codes, one absmax per 256
    elements): 2 + 2 (δθ) + 1 + 1 bytes per parameter plus 2 for the gradient, 8.03 in all —
    the bytes of pure BF16 AdamW with compensated weights, where 8-bit-state optimizers
    usually round the weight stochastically.

    Args:
        block_size: elements per absmax block (256).
        Other arguments as `AdamW`.
    """

    extra_options: ClassVar[tuple[str, ...]] = ("block_size",)

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        block_size: int = 256,
        fused: FusedMode = "auto",
        **torch_arguments: Any,
    ):
        super().__init__(params, lr, betas, eps, weight_decay, fused=fused, block_size=block_size, **torch_arguments)

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        size = group["block_size"]
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"Collage8bitAdamW: block_size must be a positive integer, got {size!r} (default 256)")

    def sixteen_bit_composition(self, param: torch.Tensor, group: dict[str, Any]) -> Composition:
        size = group["block_size"]
        return Composition(Blockwise8bit(True, size), Blockwise8bit(False, size), Grow())
