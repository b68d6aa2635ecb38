"""hf_lowprec: low-precision training strategies for the HuggingFace stack.

    from hf_lowprec import Trainer, TrainingArguments
    args = TrainingArguments(output_dir="out", precision_strategy="collage-plus", use_cpu=True)

Every name here is imported on first use (`get_strategy` imports torch and the strategies,
`Trainer` transformers), so `import hf_lowprec` itself stays light.
"""

from __future__ import annotations

import os
from typing import Any

from hf_lowprec.version import __version__  # bumped when an update rule or a state layout changes

__all__ = [
    "available_strategies",
    "get_strategy",
    "register",
    "Trainer",
    "TrainingArguments",
    "Seq2SeqTrainer",
    "Seq2SeqTrainingArguments",
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
    "Seq2SeqTrainer": "hf_lowprec.integrations.seq2seq",
    "Seq2SeqTrainingArguments": "hf_lowprec.integrations.seq2seq",
    "PrecisionCallback": "hf_lowprec.integrations.trainer",
    "PrecisionPlugin": "hf_lowprec.integrations.accelerate",
}


# 16-bit GEMMs as FP32 GEMMs rounded once on CPUs without 16-bit GEMM instructions, when asked
# (hf_lowprec/cpu_gemm.py): read here so that every process of a run, children included, has it.
if os.environ.get("HF_LOWPREC_CPU_GEMM", "").strip().lower() not in ("", "native"):
    from hf_lowprec import cpu_gemm as _cpu_gemm

    _cpu_gemm.install_if_asked()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_lowprec' has no attribute {name!r}")
