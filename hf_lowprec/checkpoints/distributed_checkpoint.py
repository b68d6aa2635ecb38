"""Sharded checkpoints of FSDP2 models (`save_sharded`, `load_sharded`; re-exported by `fsdp2`).

torch.distributed.checkpoint writes each DTensor once, split by its shards, and plain values
once; state laid out per shard (COAT's groups, collage-8bit's blocks, FP8-LM's per-shard scales)
is written as one row per rank. Saves are atomic and checksummed
(`hf_lowprec.checkpoints.sharded`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from ..version import one_resume, warn_other_version

__all__ = ["load_sharded", "save_sharded", "sharded_state_dict"]


def sharded_state_dict(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """{"model": ..., "optimizer": ...} of live references: DTensor shards, the optimizer's
    state (every parameter's, created at zero where no step ran yet, so that a load has
    somewhere to write) and the strategy's counters under "hf_lowprec". State laid out per
    shard (COAT's per-group FP8 moments, collage-8bit's blocks) appears as copies; see
    `_per_shard_state`."""
    return _sharded_state_dict(model, optimizer)[0]


def _sharded_state_dict(model: torch.nn.Module, optimizer: Any) -> tuple[dict[str, Any], list[tuple]]:
    from ..memory import unwrap_optimizer

    inner = unwrap_optimizer(optimizer)
    init_states = getattr(inner, "init_states", None)
    if init_states is None:
        raise TypeError(f"{type(inner).__name__} cannot create its state before a step; sharded checkpoints need it")
    init_states()
    optimizer_state = dict(optimizer.state_dict())
    params = [p for group in inner.param_groups for p in group["params"]]
    # String keys: the checkpoint's loader writes a non-tensor value (a step number) back under
    # str(key), so an int-keyed entry would come back as a second, string-keyed one.
    states = {str(index): dict(state) for index, state in optimizer_state["state"].items()}
    optimizer_state["state"] = states
    restore = _per_shard_state(states, params)
    return {"model": model.state_dict(), "optimizer": optimizer_state}, restore


def _per_shard_state(states: dict[str, dict[str, Any]], params: list[torch.Tensor]) -> list[tuple]:
    """Replace, in `states`, each state tensor of a DTensor parameter not shaped like its shard
    (groups or blocks padded per shard, a shard's own scale) by a DTensor (world, longest): row r
    is rank r's flattened tensor, zero-padded to the longest over the ranks (one all-reduce of
    the lengths). The checkpoint then holds every rank's tensor once, where a plain tensor would
    be written once for all ranks. Such state resumes at the same world size only (its layout
    follows the shards). Returns (state, key, original) to copy loaded rows back."""
    from torch.distributed.tensor import DTensor, Shard

    found = [
        (state, key, value, params[int(index)])
        for index, state in states.items()
        for key, value in state.items()
        if isinstance(params[int(index)], DTensor)
        and torch.is_tensor(value)
        and not isinstance(value, DTensor)
        and key != "step"  # the step count: the same on every rank
    ]
    if not found:
        return []
    mesh = found[0][3].device_mesh
    lengths = torch.tensor([value.numel() for _, _, value, _ in found], dtype=torch.int64, device=found[0][2].device)
    dist.all_reduce(lengths, op=dist.ReduceOp.MAX, group=mesh.get_group())
    restore = []
    for (state, key, value, _), longest in zip(found, lengths.tolist()):
        row = torch.zeros(1, longest, dtype=value.dtype, device=value.device)
        row[0, : value.numel()] = value.reshape(-1)
        state[key] = DTensor.from_local(
            row, mesh, [Shard(0)], run_check=False, shape=(mesh.size(), longest), stride=(longest, 1)
        )
        restore.append((state, key, value))
    return restore


def save_sharded(path: str | os.PathLike, model: torch.nn.Module, optimizer: Any) -> None:
    """Write model and optimizer shards to the directory `path` (torch.distributed.checkpoint;
    every rank calls it). A DTensor is written once, split by its shards; a plain value (the
    strategy's counters, step numbers, a random generator's state: equal on every rank) once.
    Atomic, with every rank's shards checksummed (`hf_lowprec.checkpoints.sharded`)."""
    import torch.distributed.checkpoint as dcp

    from .sharded import save_checked

    state, restore = _sharded_state_dict(model, optimizer)
    save_checked(path, lambda directory: dcp.save(state, checkpoint_id=directory), bool(restore))


def load_sharded(path: str | os.PathLike, model: torch.nn.Module, optimizer: Any) -> None:
    """Read what `save_sharded` wrote into a freshly sharded `model` and its new `optimizer`
    (same strategy; any world size, DTensors are resharded, except state laid out per shard,
    which needs the world size it was saved at), then continue bit for bit."""
    with one_resume():  # the saving version checked once: from the manifest, else the optimizer state
        _load_sharded(os.fspath(path), model, optimizer)


def _load_sharded(path: str, model: torch.nn.Module, optimizer: Any) -> None:
    import torch.distributed.checkpoint as dcp

    from ..memory import unwrap_optimizer
    from .manifest import read_manifest
    from .resume import refuse_split_fp8_groups
    from .sharded import check_saved

    target, restore = _sharded_state_dict(model, optimizer)
    check_saved(path, bool(restore))  # damaged, torn or another world size: refused here
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    groups = {k.split(".")[2] for k in keys if k.startswith("optimizer.param_groups.")}
    refuse_split_fp8_groups(len(groups), target["optimizer"]["param_groups"])
    manifest = read_manifest(path)  # checked above
    if manifest is not None:
        warn_other_version(manifest, f"sharded checkpoint {path}")
    dcp.load(target, checkpoint_id=path)
    for state, key, original in restore:
        original.reshape(-1).copy_(state[key].to_local()[0, : original.numel()])
        state[key] = original
    model.load_state_dict(target["model"])
    optimizer_state = dict(target["optimizer"])
    optimizer_state["state"] = {int(index): state for index, state in optimizer_state["state"].items()}
    optimizer.load_state_dict(optimizer_state)
    # Weights and state restored together: a write before the next step is where training goes on.
    getattr(unwrap_optimizer(optimizer), "watch_parameter_values", lambda: None)()
