"""The Trainer's resume of an FP8-LM O2/O3 checkpoint saved with each param group split in two.

Versions before `unscaled_format` (up to 2026-12-06) split every group into its FP8 GEMM weights
and the rest: `optimizer.pt` holds 3 groups where the run now has 2, and `scheduler.pt` a schedule
over those 3. The optimizer's `load_state_dict` merges the pairs (`optim.fp8_adamw`); the LR
scheduler's state is merged here the same way, before either is loaded.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ..checkpoints.resume import check_split_schedule
from ..optim.fp8_adamw import merge_split_schedule, split_group_counts

__all__ = ["load_split_layout"]

logger = logging.getLogger(__name__)


def load_split_layout(trainer: Any, checkpoint: str, resets: set[str]) -> bool:
    """Load `checkpoint`'s optimizer and scheduler files into `trainer` when the schedule was saved
    over more param groups than the optimizer has, the split pairs merged; False (nothing loaded)
    for any other checkpoint. A schedule over other groups than the split layout's is refused,
    before anything is loaded, naming both counts and the fix."""
    schedule_file, state_file = (os.path.join(checkpoint, f) for f in ("scheduler.pt", "optimizer.pt"))
    if "scheduler" in resets or not os.path.isfile(schedule_file):
        return False
    schedule = torch.load(schedule_file, weights_only=True)
    groups = trainer.optimizer.param_groups
    saved_lrs = schedule.get("base_lrs") if isinstance(schedule, dict) else None
    if not isinstance(saved_lrs, list) or len(saved_lrs) <= len(groups):
        return False
    state = torch.load(state_file, map_location="cpu", weights_only=True) if os.path.isfile(state_file) else {}
    counts = split_group_counts(groups, state.get("param_groups", []))
    check_split_schedule(counts, len(saved_lrs), len(groups), schedule_file, state_file)
    if "optimizer" not in resets:
        trainer.optimizer.load_state_dict(state)
    trainer.lr_scheduler.load_state_dict(merge_split_schedule(counts, schedule))
    logger.info(
        "%s: saved with FP8-LM's older split param groups (%d), resumed as %d groups (optimizer and LR schedule)",
        checkpoint,
        len(saved_lrs),
        len(groups),
    )
    return True
