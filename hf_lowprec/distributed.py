"""Small helpers for code that may run on FSDP2 shards (DTensors): the local shard, one agreement.

No engine here, only what the strategies need to treat a sharded gradient like a plain one;
`hf_lowprec.fsdp` builds on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_ranks_agree", "local_shard"]


def local_shard(tensor: Any) -> Any:
    """The local shard of a DTensor; any other tensor (or None) as is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def all_ranks_agree(flag: bool, tensors: Iterable[torch.Tensor]) -> bool:
    """`flag` AND-ed over the ranks of the DTensors' mesh (one all-reduce), or `flag` when no
    tensor is a DTensor. The flag tensor lives on the tensors' device (NCCL needs that)."""
    from torch.distributed.tensor import DTensor

    sharded = next((t for t in tensors if isinstance(t, DTensor)), None)
    if sharded is None:
        return flag
    value = torch.tensor(1.0 if flag else 0.0, device=sharded.to_local().device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=sharded.device_mesh.get_group())
    return bool(value.item() == 1.0)
