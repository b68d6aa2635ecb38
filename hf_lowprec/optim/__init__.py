"""Optimizers for low-precision parameters and states: AdamW as (m format × v format × update rule).

`adamw` holds the core (arithmetic, step loop), `formats` and `rules` the pieces, `families` the
BF16/FP16 families, `fp8_adamw` and `coat` the FP8 ones, `dispatch` the dispatch between the
eager reference and the compiled step. `zero_fp8` FP8-LM O3's distributed `FP8ZeroAdamW` (whole
FP8 weights per rank; it runs in one process, under DDP and as DeepSpeed ZeRO's client optimizer).
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
