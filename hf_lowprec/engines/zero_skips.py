"""The steps DeepSpeed's ZeRO optimizer skips itself, counted by the strategy.

Where DeepSpeed's gradient norm sees a non-finite value it skips the step before the client
optimizer runs, so the strategy's own check never sees it. `count_deepspeed_skips` adds each such
step to the strategy's `skipped_steps` (logged, with its warning, at the next log) from the
`overflow` flag DeepSpeed has already read on the host: no wait for the device is added.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["count_deepspeed_skips"]


def count_deepspeed_skips(zero_optimizer: Any, strategy: Any, device: torch.device | None) -> None:
    """After each `zero_optimizer.step()` DeepSpeed skipped (its `overflow` flag set), count one
    skipped step on `strategy` (a counter on `device`, the partitions' own). Called again (a new
    `train()`, a new strategy), the newest strategy counts; the step is wrapped once."""
    zero_optimizer.hf_lowprec_skips_counted_by = (strategy, device)
    if getattr(zero_optimizer, "hf_lowprec_counts_skips", False):
        return
    step = zero_optimizer.step

    @functools.wraps(step)
    def step_counting_skips(*args: Any, **kwargs: Any) -> Any:
        result = step(*args, **kwargs)
        overflow = getattr(zero_optimizer, "overflow", False)
        # A host bool in DeepSpeed's ZeRO optimizers: reading it waits for nothing.
        if not torch.is_tensor(overflow) and bool(overflow):
            counter, where = zero_optimizer.hf_lowprec_skips_counted_by
            counter.count_skip(torch.ones((), dtype=torch.float32, device=where))
        return result

    zero_optimizer.step = step_counting_skips
    zero_optimizer.hf_lowprec_counts_skips = True
