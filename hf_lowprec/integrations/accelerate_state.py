"""`accelerator.save_state` / `load_state` in a custom loop with the precision plugin, as the Trainer
saves and resumes (docs/checkpoints.md, "Accelerate's save_state"): the save bracketed with the
marker and the manifest, FSDP2's optimizer kept per rank with the strategy's entry (Accelerate's
sharded file drops it); the load checked first and the saving version said once.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

from ..checkpoints.complete_save import begin_save, finish_save
from ..checkpoints.fsdp2_trainer import load_rank_optimizer, rank_optimizer_file, save_rank_optimizer
from ..checkpoints.manifest import MANIFEST
from ..checkpoints.resume import SAVE_MARKER, check_saved_manifest
from ..memory import unwrap_optimizer
from ..version import one_resume, warn_other_version

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


def check_state(strategy: Any, path: str, world: int, engine: str) -> dict | None:
    """Refuse, before anything loads, what `save_state` wrote that this run cannot load (an interrupted
    save, a damaged file, another strategy or options, another number of processes where the state is
    each rank's: DeepSpeed's partitions, FSDP2's rank files); warn once where another version saved it.
    Returns the manifest (None: saved without one, which loads as Accelerate loads it)."""
    manifest = check_saved_manifest(path, strategy)
    if manifest is None:
        if os.path.isfile(os.path.join(path, SAVE_MARKER)):
            raise ValueError(
                f"{path} is an incomplete save: {SAVE_MARKER} is there and {MANIFEST} is not (a process stopped "
                "inside accelerator.save_state). Nothing was loaded. Load an earlier save, or save again"
            )
        return None
    saved = manifest.get("world_size", 1)
    per_rank = engine == "DEEPSPEED" or glob.glob(
        os.path.join(glob.escape(path), "hf_lowprec_optimizer*.rank*-of-*.pt")
    )
    if saved != world and per_rank:
        what = "DeepSpeed's optimizer partitions" if engine == "DEEPSPEED" else "each rank's optimizer state (FSDP2)"
        raise ValueError(
            f"{path} was saved by {saved} processes, but this run has {world}: it holds {what}, laid out per rank, "
            f"which another number of processes cannot split. Nothing was loaded. Load it with {saved} processes "
            f"(accelerate launch --num_processes {saved}, torchrun --nproc_per_node {saved})"
        )
    warn_other_version(manifest, f"checkpoint {path}")  # the optimizer's load then says nothing
    return manifest


def load_state(plugin: Any, accelerator: Any, input_dir: Any = None, *args: Any, **kwargs: Any) -> Any:
    """`accelerator.load_state(input_dir, ...)` of what `save_state` wrote: checked first (`check_state`),
    the saving version said once; under FSDP2 the strategy's optimizer loads each rank's own file in
    place of Accelerate's, which dropped the strategy's entry."""
    path = _input_dir(accelerator, input_dir)
    with one_resume():
        engine = _engine(accelerator)
        if path:
            check_state(plugin.strategy, path, accelerator.num_processes, engine)
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
