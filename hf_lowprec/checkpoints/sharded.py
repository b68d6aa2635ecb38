"""FSDP2's sharded checkpoints (torch.distributed.checkpoint) saved atomically and checked before loading.

torch's writer writes each rank's shards in place, so a rank that dies mid-save leaves a mix of two
steps (docs/checkpoints.md): `save_checked` makes the whole save in `<path>.saving` and renames it
into place, so `<path>` always holds one complete save; `check_saved` verifies it before loading.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable

import torch.distributed as dist

from .manifest import crash_point, file_entry, write_manifest
from .resume import sharded_checkpoint_problem

__all__ = ["save_checked", "check_saved"]

_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(value: object) -> list:
    world = _rank_world()[1]
    if world == 1:
        return [value]
    gathered: list = [None] * world
    dist.all_gather_object(gathered, value)
    return gathered


def _barrier() -> None:
    if _rank_world()[1] > 1:
        dist.barrier()


def save_checked(path: str, write: Callable[[str], None], per_shard_state: bool) -> None:
    """Save through `write(directory)` (every rank calls it) into `path`, atomically, with a manifest.

    The save goes into `<path>.saving`; every rank checksums its own shards, the manifest
    (`hf_lowprec.checkpoints.manifest`: each file's size and CRC-32, the world size, whether state
    is laid out per shard) is written, and only then is the directory renamed into place."""
    rank, world = _rank_world()
    staging, previous = f"{path}.saving", f"{path}.previous"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # a save that died before its rename
        os.makedirs(staging)
    _barrier()
    write(staging)
    crash_point("sharded-after-shards")
    own = {}
    for name in os.listdir(staging):
        match = _RANK_FILE.match(name)
        if match and int(match.group(1)) == rank:
            own[name] = file_entry(os.path.join(staging, name))
    files = {name: entry for entries in _gather(own) for name, entry in entries.items()}
    if rank == 0:
        for name in os.listdir(staging):  # .metadata and anything not one rank's
            if name not in files and not _RANK_FILE.match(name) and os.path.isfile(os.path.join(staging, name)):
                files[name] = file_entry(os.path.join(staging, name))
        write_manifest(staging, files, world_size=world, per_shard_state=per_shard_state)
        crash_point("sharded-before-rename")
        if os.path.exists(path):
            shutil.rmtree(previous, ignore_errors=True)
            os.rename(path, previous)
        os.rename(staging, path)
        shutil.rmtree(previous, ignore_errors=True)
    _barrier()


def check_saved(path: str, per_shard_state: bool) -> None:
    """Raise ValueError (on every rank together) unless `path` is a complete, undamaged save this world
    can load: each rank checks its share (`sharded_checkpoint_problem`), and all refuse with the first,
    naming the file. State laid out per shard (COAT's per-group FP8 moments, collage-8bit's blocks) at
    another world size is refused naming the world size it needs (DTensor state reshards: any size)."""
    rank, world = _rank_world()
    problems = [p for p in _gather(sharded_checkpoint_problem(path, per_shard_state, rank, world)) if p is not None]
    if problems:
        raise ValueError(problems[0])
