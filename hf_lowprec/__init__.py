"""hf_lowprec: low-precision training strategies for the HuggingFace stack.

    from hf_lowprec import Trainer, TrainingArguments
    args = TrainingArguments(output_dir="out", precision_strategy="collage-plus", use_cpu=True)

`Trainer` and `TrainingArguments` import transformers on first use, so `import hf_lowprec`
stays light for custom loops that only need `get_strategy`.
"""

from __future__ import annotations

from typing import Any

from .registry import available_strategies, get_strategy, register

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
