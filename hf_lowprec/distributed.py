"""Small helpers for code that may run on FSDP2 shards (DTensors): the local shard, agreement over ranks.

No engine here, only what the strategies need to treat a sharded gradient like a plain one;
`hf_lowprec.engines.fsdp2` builds on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

try:  # FSDP2 parameters; a torch built without distributed support has none
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = type("DTensor", (), {})  # matches no tensor

__all__ = [
    "DTensor",
    "all_ranks_agree",
    "any_rank",
    "local_shard",
    "mark_sharded_by",
    "sharded_by",
    "sharded_like",
    "written_since",
    "written_version",
    "written_without_change",
]

# Set on the FSDP2 parameters that `hf_lowprec.engines.fsdp2` sharded (shard_model, the Accelerate path):
# the strategy's name, so that `create_optimizer` can tell them from parameters sharded by hand.
_SHARDED_BY = "_hf_lowprec_sharded_by"


def local_shard(tensor: Any) -> Any:
    """The local shard of a DTensor (same storage: in-place updates reach it); anything else as is.

    A shard that FSDP2 all-gathers in another form (`hf_lowprec.fp8.sharded_weight.FP8WeightShard`)
    gives the plain tensor of its values (`local_values`), which the optimizer updates in place."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return getattr(local, "local_values", local)


def written_version(tensor: torch.Tensor) -> tuple[int, int, int]:
    """What a write of `tensor` changes: the version counters that in-place writes bump, a DTensor's own
    (an op on the DTensor, such as `load_state_dict`'s copy) and its local shard's (what an optimizer
    writes; a tensor's twice), and the local shard's storage address, which a `.data` assignment
    (`p.data = x`, `torch.nn.utils.vector_to_parameters`) changes while it keeps the counters.
    Host values: reading them waits for nothing. A fake tensor (a step counted at GPU size) has no
    address to read: 0."""
    local = local_shard(tensor)
    return tensor._version, local._version, 0 if isinstance(local, FakeTensor) else local.data_ptr()


_UNCHANGED = "_hf_lowprec_unchanged_version"


def written_without_change(params: Iterable[torch.Tensor]) -> None:
    """Take each of `params`' last in-place write as leaving its value as it was: DDP's construction
    broadcasts every rank's parameters in place with the values they hold (`engines.ddp.prepare_ddp`)."""
    for param in params:
        setattr(param, _UNCHANGED, written_version(param))


def written_since(param: torch.Tensor, recorded: tuple[int, int, int]) -> bool:
    """Whether `param` was written since `recorded` (`written_version`: in place or by a `.data`
    assignment), but for a write `written_without_change` took aside. Host-side: no sync."""
    now = written_version(param)
    return now != recorded and now != getattr(param, _UNCHANGED, None)


def mark_sharded_by(params: Iterable[torch.Tensor], strategy_name: str) -> None:
    """Record on each DTensor parameter that `strategy_name`'s sharding produced it."""
    for param in params:
        if isinstance(param, DTensor):
            setattr(param, _SHARDED_BY, strategy_name)


def sharded_by(param: torch.Tensor) -> str | None:
    """The strategy whose sharding produced the DTensor `param`, or None (sharded by hand, or plain)."""
    return getattr(param, _SHARDED_BY, None)


def sharded_like(value: Any, param: torch.Tensor) -> Any:
    """`value` (shaped like the local shard of the DTensor `param`) as a DTensor sharded like it;
    anything else (a plain `param`, a scalar, another shape) as is."""
    if not isinstance(param, DTensor) or not torch.is_tensor(value) or isinstance(value, DTensor):
        return value
    if value.shape != param.to_local().shape:
        return value
    return DTensor.from_local(
        value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def any_rank(found: torch.Tensor, tensors: Iterable[torch.Tensor] = (), group: Any = None) -> torch.Tensor:
    """`found` (a 0-dim tensor flag, nonzero = found) MAX-ed over the ranks, in place, without a
    host sync: over the mesh of the first DTensor among `tensors` (FSDP2 shards), and over
    `group` (DDP's process group, ZeRO's data-parallel group) when it spans several ranks.
    One all-reduce per group; the flag lives on the tensors' device (NCCL needs that)."""
    sharded = next((t for t in tensors if isinstance(t, DTensor)), None)
    if sharded is not None:
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=sharded.device_mesh.get_group())
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return found


def all_ranks_agree(flag: bool, tensors: Iterable[torch.Tensor]) -> bool:
    """`flag` AND-ed over the ranks of the DTensors' mesh (one all-reduce and one host sync), or
    `flag` when no tensor is a DTensor. Inside a training step use `any_rank`, which stays on
    the device."""
    tensors = list(tensors)
    sharded = next((t for t in tensors if isinstance(t, DTensor)), None)
    if sharded is None:
        return flag
    missing = torch.zeros((), device=sharded.to_local().device)
    if not flag:
        missing.fill_(1.0)
    return not bool(any_rank(missing, tensors))
