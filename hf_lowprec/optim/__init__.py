"""Optimizers for low-precision parameters and states."""

from .base import LowPrecisionOptimizer, TrackedUpdate
from .bf16 import FP32StatesAdamW, KahanAdamW, PlainAdamW, StochasticRoundingAdamW
from .collage import CollageAdamW

__all__ = [
    "CollageAdamW",
    "FP32StatesAdamW",
    "KahanAdamW",
    "LowPrecisionOptimizer",
    "PlainAdamW",
    "StochasticRoundingAdamW",
    "TrackedUpdate",
]

from .fp8_adamw import FP8AdamW  # noqa: E402

__all__ += ["FP8AdamW"]

from .coat import COATAdamW  # noqa: E402

__all__ += ["COATAdamW"]

from .fp8_zero import FP8ZeroAdamW  # noqa: E402

__all__ += ["FP8ZeroAdamW"]
