"""`accelerator.save_state` / `load_state` in a custom loop with the precision plugin, as the Trainer
saves and resumes (docs/checkpoints.md, "Accelerate's save_state"): the save bracketed with the
marker and the manifest, FSDP2's optimizer kept per rank with the strategy's entry (Accelerate's
sharded file drops it); the load checked first and the saving version said once.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..checkpoints.complete_save import begin_save, finish_save
from ..checkpoints.fsdp2_trainer import load_rank_optimizer, rank_optimizer_file, save_rank_optimizer
from ..checkpoints.resume import check_accelerate_state
from ..memory import unwrap_optimizer
from ..version import one_resume

__all__ = ["load_state", "save_state"]


def _engine(accelerator: Any) -> str:
    """Accelerate's distributed type of `accelerator` as a string ("FSDP", "DEEPSPEED", ...)."""
    return str(getattr(getattr(accelerator, "distributed_type", None), "value", accelerator.distributed_type))


def _strategy_optimizers(accelerator: Any) -> list[tuple[int, Any]]:
    """(index in Accelerate's list, the strategy's optimizer) of each prepared optimizer the strategy built."""
    found = []
    for index, optimizer in enumerate(getattr(accelerator, "_optimizers", [])):
        while optimizer is not None and not hasattr(optimizer, "strategy"):  # Accelerate's wrapper
            optimizer = getattr(optimizer, "optimizer", None)
        if optimizer is not None:
            found.append((index, optimizer))
    return found


def save_state(plugin: Any, accelerator: Any, output_dir: Any = None, **kwargs: Any) -> str:
    """`accelerator.save_state(output_dir, ...)`, complete on every rank when it returns: the marker
    first (a directory named here), Accelerate's save, under FSDP2 each rank's optimizer file with the
    strategy's entry, a barrier, the manifest. Returns where it saved, as Accelerate's does."""
    named = os.fspath(output_dir) if output_dir is not None else None
    if named is not None and accelerator.is_main_process:
        begin_save(named, plugin.strategy)
    location = type(accelerator).save_state(accelerator, output_dir, **kwargs)
    location = os.fspath(location if location is not None else named)
    if _engine(accelerator) == "FSDP":  # what Accelerate's sharded optimizer file drops
        rank, world = accelerator.process_index, accelerator.num_processes
        for index, optimizer in _strategy_optimizers(accelerator):
            save_rank_optimizer(optimizer, location, rank, world, index)
    accelerator.wait_for_everyone()  # every rank's files (DeepSpeed's partitions, RNG states) exist
    if accelerator.is_main_process:
        finish_save(location, plugin.strategy, accelerator.num_processes)
    accelerator.wait_for_everyone()  # the manifest is there before any rank goes on
    return location


def _input_dir(accelerator: Any, input_dir: Any) -> str | None:
    """The directory Accelerate's `load_state(input_dir)` reads (the newest automatic checkpoint for None)."""
    if input_dir is not None:
        return os.path.expanduser(os.fspath(input_dir))
    config = getattr(accelerator, "project_configuration", None)
    if config is None or not config.automatic_checkpoint_naming:
        return None  # Accelerate's own error follows
    root = os.path.join(accelerator.project_dir, "checkpoints")
    folders = [os.path.join(root, f) for f in os.listdir(root)] if os.path.isdir(root) else []
    numbered = [(int(m[-1]), f) for f in folders if (m := re.findall(r"[0-9]+", os.path.basename(f)))]
    return max(numbered)[1] if numbered else None


def load_state(plugin: Any, accelerator: Any, input_dir: Any = None, *args: Any, **kwargs: Any) -> Any:
    """`accelerator.load_state(input_dir, ...)` of what `save_state` wrote: checked first (`check_accelerate_state`),
    the saving version said once; under FSDP2 the strategy's optimizer loads each rank's own file in
    place of Accelerate's, which dropped the strategy's entry."""
    path = _input_dir(accelerator, input_dir)
    with one_resume():
        engine = _engine(accelerator)
        if path:
            check_accelerate_state(plugin.strategy, path, accelerator.num_processes, engine)
        rank, world = accelerator.process_index, accelerator.num_processes
        ours = [
            (index, optimizer)
            for index, optimizer in _strategy_optimizers(accelerator)
            if engine == "FSDP" and path is not None and os.path.isfile(rank_optimizer_file(path, rank, world, index))
        ]
        held = accelerator._optimizers
        if ours and len(ours) == len(held):  # Accelerate's FSDP optimizer file is not read: the rank files hold it all
            accelerator._optimizers = []
        try:
            result = type(accelerator).load_state(accelerator, input_dir, *args, **kwargs)
        finally:
            accelerator._optimizers = held
        for index, optimizer in ours:
            load_rank_optimizer(optimizer, path, rank, world, index)
        for _, optimizer in _strategy_optimizers(accelerator):
            # Weights and state restored together: a write before the next step is where training goes on.
            getattr(unwrap_optimizer(optimizer), "watch_parameter_values", lambda: None)()
    return result
