"""The short import path of `hf_lowprec.integrations.trl_trainers` (TRL configs and trainers with
`precision_strategy`): `from hf_lowprec.trl import SFTConfig, SFTTrainer`."""

from __future__ import annotations

from typing import Any

from .integrations import trl_trainers as _trl

__all__ = list(_trl.__all__)


def __getattr__(name: str) -> Any:
    # The classes are built on first access (trl is imported then): forward, do not copy.
    return getattr(_trl, name)
