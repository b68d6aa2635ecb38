"""Built-in precision strategies; importing this package registers them."""

from . import (  # noqa: F401  # noqa: F401
    baselines,
    coat,
    collage,
    fp8_lm,
    fp8_lm_o3,
    fp16_als,
    fp16_mixed,
)
from .interface import PrecisionStrategy, StrategyOptimizer, StrategyOptions

__all__ = ["PrecisionStrategy", "StrategyOptimizer", "StrategyOptions"]
