"""Built-in precision strategies; importing this package registers them."""

from . import baselines, collage  # noqa: F401
from . import fp8_lm  # noqa: F401
from . import coat  # noqa: F401
from . import fp8_zero  # noqa: F401  (after fp8_lm: it extends FP8LM)
from . import fp16_als, fp16_mixed  # noqa: F401
from .base import PrecisionStrategy, StrategyOptimizer, StrategyOptions

__all__ = ["PrecisionStrategy", "StrategyOptimizer", "StrategyOptions"]
