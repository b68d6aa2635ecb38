"""Optimizers for low-precision parameters and states: AdamW as (m format × v format × update rule).

`adamw` holds the core (arithmetic, step loop), `formats` and `rules` the pieces, `families` the
BF16/FP16 families, `fp8_adamw` and `coat_adamw` the FP8 ones, `dispatch` which implementation runs
a step (the eager reference, the compiled step, the `native` kernels), `zero_fp8` FP8-LM O3's
distributed optimizer (`zero_fp8.FP8ZeroAdamW`).
"""

from .adamw import AdamW, Composition
from .coat_adamw import COATAdamW
from .families import (
    Collage8bitAdamW,
    CollageAdamW,
    FP32StatesAdamW,
    FP32StatesSRAdamW,
    KahanAdamW,
    MasterWeightAdamW,
    PlainAdamW,
    StochasticRoundingAdamW,
)
from .fp8_adamw import FP8AdamW
from .lowprec_optimizer import LowPrecisionOptimizer, TrackedUpdate

__all__ = [
    "AdamW",
    "COATAdamW",
    "Collage8bitAdamW",
    "CollageAdamW",
    "Composition",
    "FP32StatesAdamW",
    "FP32StatesSRAdamW",
    "FP8AdamW",
    "KahanAdamW",
    "LowPrecisionOptimizer",
    "MasterWeightAdamW",
    "PlainAdamW",
    "StochasticRoundingAdamW",
    "TrackedUpdate",
]
