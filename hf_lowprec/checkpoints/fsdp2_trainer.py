"""The optimizer of a Trainer under FSDP2, each rank's own (`save_rank_optimizer`, `load_rank_optimizer`).

Accelerate's FSDP optimizer checkpoint (torch.distributed.checkpoint) keeps only `state` and
`param_groups`: the strategy's entry (loss scaler, FP8 gradient scale, counters, generators) is
dropped, and a state tensor laid out per shard but not a DTensor (COAT's groups, collage-8bit's
blocks, per-shard scales) is written once for all ranks. Beside it each rank writes its own
state as it holds it, and a resume at the same world size loads that, bit for bit.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import torch

from .resume import refuse_rank_optimizers, refuse_split_fp8_groups

__all__ = [
    "load_rank_optimizer",
    "load_trainer_optimizer",
    "rank_optimizer_file",
    "save_rank_optimizer",
    "trainer_rank_world",
]


def rank_optimizer_file(checkpoint: str, rank: int, world: int, index: int = 0) -> str:
    """Where rank `rank` of `world` keeps its optimizer state in `checkpoint` (optimizer `index` of
    an Accelerate loop's: the first is the Trainer's one)."""
    name = "hf_lowprec_optimizer" if index == 0 else f"hf_lowprec_optimizer_{index}"
    return os.path.join(checkpoint, f"{name}.rank{rank}-of-{world}.pt")


def _local(state_dict: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    out = dict(state_dict)
    out["state"] = {
        index: {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}
        for index, state in state_dict["state"].items()
    }
    return out


def _creates_its_state(optimizer: Any) -> bool:
    """Whether the optimizer can create its whole state before a step (the strategies' can; a
    user's torch optimizer cannot, and keeps Accelerate's file, which it loses nothing in)."""
    from ..memory import unwrap_optimizer

    return callable(getattr(unwrap_optimizer(optimizer), "init_states", None))


def save_rank_optimizer(optimizer: Any, checkpoint: str, rank: int, world: int, index: int = 0) -> None:
    """Write `optimizer`'s state dict (the strategy's optimizer wrapper's, with its entry) as this
    rank holds it: DTensor states as their local shards, per-shard tensors as they are."""
    if _creates_its_state(optimizer):
        torch.save(_local(optimizer.state_dict()), rank_optimizer_file(checkpoint, rank, world, index))


def load_rank_optimizer(optimizer: Any, checkpoint: str, rank: int, world: int, index: int = 0) -> None:
    """Load what `save_rank_optimizer` wrote for this rank into `optimizer` (the same strategy and
    sharding): each local shard back into a DTensor placed as the live state's is."""
    from torch.distributed.tensor import DTensor

    from ..memory import unwrap_optimizer

    unwrap_optimizer(optimizer).init_states()  # the live state, whose placements the shards take
    live = optimizer.state_dict()["state"]
    saved = torch.load(rank_optimizer_file(checkpoint, rank, world, index), map_location="cpu", weights_only=True)
    refuse_split_fp8_groups(len(saved["param_groups"]), unwrap_optimizer(optimizer).param_groups)
    for index, state in saved["state"].items():
        for key, value in state.items():
            target = live.get(index, {}).get(key)
            if isinstance(target, DTensor) and torch.is_tensor(value):
                state[key] = DTensor.from_local(
                    value.to(target.device), target.device_mesh, target.placements, run_check=False,
                    shape=target.shape, stride=target.stride(),
                )  # fmt: skip
    optimizer.load_state_dict(saved)


def trainer_rank_world(trainer: Any) -> tuple[int, int]:
    """(this process's rank, the number of processes) of `trainer`."""
    return int(trainer.args.process_index), int(trainer.args.world_size)


def load_trainer_optimizer(trainer: Any, checkpoint: str | None, resets: set[str]) -> bool:
    """Under FSDP2: load the strategy's optimizer and the scheduler from `checkpoint`'s rank files,
    `resets` left out; False (nothing loaded) where there is no checkpoint or no file for this
    rank at this world size, for the Trainer's own load."""
    if not getattr(trainer, "_hf_lowprec_adopted", False):
        # A resume loads the optimizer before on_train_begin: its seeded state (Collage's δθ)
        # moves onto the shards first, or reading its state_dict finds parameters it lost.
        trainer._hf_lowprec_adopted = True
        trainer.adopt_fsdp2_shards()
    rank, world = trainer_rank_world(trainer)
    optimizer = trainer.optimizer
    while optimizer is not None and not hasattr(optimizer, "strategy"):  # Accelerate's wrapper
        optimizer = getattr(optimizer, "optimizer", None)
    if optimizer is None or not _creates_its_state(optimizer):
        return False
    if checkpoint is None or not os.path.isfile(rank_optimizer_file(checkpoint, rank, world)):
        saved = sorted(glob.glob(os.path.join(glob.escape(checkpoint or ""), "hf_lowprec_optimizer.rank0-of-*.pt")))
        if saved and "optimizer" not in resets:  # saved by another number of processes
            refuse_rank_optimizers(checkpoint, int(saved[0].rsplit("-of-", 1)[1].removesuffix(".pt")), world)
        return False
    if "optimizer" not in resets:
        load_rank_optimizer(optimizer, checkpoint, rank, world)
    scheduler = os.path.join(checkpoint, "scheduler.pt")
    if "scheduler" not in resets and os.path.isfile(scheduler):
        trainer.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
    return True
