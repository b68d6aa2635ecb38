"""FSDP2's sharded checkpoints (torch.distributed.checkpoint) saved atomically and checked before loading.

torch's checkpoint writer writes each rank's shards (`__<rank>_<n>.distcp`) in place and renames
only `.metadata`: a rank that dies after rank 0 wrote leaves rank 0's new shard beside rank 1's
old one, which loads as a mix of two steps, and bytes overwritten in a shard load as NaN weights.
`save_checked` writes the whole save into `<path>.saving`, has every rank checksum its own shards,
writes the manifest (`hf_lowprec.checkpoints.manifest`: each file's size and CRC-32, the world
size, whether state is laid out per shard) and only then renames the directory into place, so
`<path>` always holds one complete save. `check_saved` verifies a save before anything loads:
every rank checks a share of the files and all ranks refuse together, naming the file; state
laid out per shard (COAT's per-group FP8 moments, collage-8bit's blocks) at another world size is
refused naming the world size it needs (DTensor state reshards, so that loads at any size).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable

import torch.distributed as dist

from .manifest import ManifestError, crash_point, file_entry, file_problem, read_manifest, write_manifest

__all__ = ["save_checked", "check_saved"]

logger = logging.getLogger(__name__)

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
    """Save through `write(directory)` (every rank calls it) into `path`, atomically, with a manifest."""
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
    """Raise ValueError (on every rank together) unless `path` is a complete, undamaged save this world can load."""
    rank, world = _rank_world()
    problem = None
    try:
        manifest = _manifest(path)
    except ValueError as err:
        manifest, problem = None, str(err)
    if manifest is not None:
        saved = manifest.get("world_size", 1)
        if (per_shard_state or manifest.get("per_shard_state")) and saved != world:
            problem = (
                f"sharded checkpoint {path} was saved by {saved} ranks and this run has {world}: its optimizer state "
                f"is laid out per shard (groups or blocks padded per rank), which cannot be resharded. Nothing was "
                f"loaded. Load it with {saved} ranks (torchrun --nproc_per_node {saved})"
            )
        else:
            for index, (rel, entry) in enumerate(sorted(manifest["files"].items())):
                if index % world == rank and problem is None:
                    what = file_problem(path, rel, entry)
                    if what is not None:
                        what = what if what == "missing" else f"damaged ({what})"
                        problem = (
                            f"sharded checkpoint file {os.path.join(path, rel)} is {what}. Nothing was loaded. "
                            "Load an earlier save, or save again from a run that holds this state"
                        )
    problems = [p for p in _gather(problem) if p is not None]
    if problems:
        raise ValueError(problems[0])


def _manifest(path: str) -> dict | None:
    if not os.path.isdir(path):
        previous = f"{path}.previous"
        if os.path.isdir(previous):
            raise ValueError(
                f"sharded checkpoint {path} is missing, and {previous} holds the previous complete save (a save "
                f"stopped between its two renames). Nothing was loaded. Rename {previous} to {path} to load it"
            )
        raise ValueError(f"sharded checkpoint {path} does not exist. Nothing was loaded")
    try:
        manifest = read_manifest(path)
    except ManifestError as err:
        raise ValueError(f"sharded checkpoint file {os.path.join(path, err.name)} is damaged ({err.problem})") from None
    if manifest is None:
        logger.warning("%s has no hf_lowprec_manifest.json (saved before checkpoints carried one): not checked", path)
    return manifest
