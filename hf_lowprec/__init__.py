"""hf_lowprec: low-precision training strategies for the HuggingFace stack.

    from hf_lowprec import Trainer, TrainingArguments
    args = TrainingArguments(output_dir="out", precision_strategy="collage-plus", use_cpu=True)

Every name here is imported on first use (`get_strategy` imports torch and the strategies,
`Trainer` transformers), so `import hf_lowprec` itself stays light.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = [
    "available_strategies",
    "get_strategy",
    "register",
    "Trainer",
    "TrainingArguments",
    "PrecisionCallback",
    "PrecisionPlugin",
    "__version__",
]

_LAZY = {
    "available_strategies": "hf_lowprec.strategies.registry",
    "get_strategy": "hf_lowprec.strategies.registry",
    "register": "hf_lowprec.strategies.registry",
    "Trainer": "hf_lowprec.integrations.trainer",
    "TrainingArguments": "hf_lowprec.integrations.trainer",
    "PrecisionCallback": "hf_lowprec.integrations.trainer",
    "PrecisionPlugin": "hf_lowprec.integrations.accelerate",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_lowprec' has no attribute {name!r}")
