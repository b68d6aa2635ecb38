"""Built-in precision strategies; importing this package registers them."""

from . import baselines, collage  # noqa: F401
from . import fp8_lm  # noqa: F401
from . import coat  # noqa: F401
from .base import PrecisionStrategy, StrategyOptimizer, StrategyOptions

__all__ = ["PrecisionStrategy", "StrategyOptimizer", "StrategyOptions"]
