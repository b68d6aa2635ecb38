"""Whole-tensor distribution over ranks: the FP8 ZeRO assignment of docs/algorithms.md §3.

Each tensor goes whole to one rank: largest first, to the rank with the fewest bytes so far
(greedy list scheduling). Pure arithmetic on sizes: no process group is needed, so memory
plans (`partition_report`) run anywhere, and every rank of a job computes the same owners
from the same list.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = ["PartitionReport", "assign_whole_tensors", "partition_report"]


def assign_whole_tensors(sizes: Sequence[int], world_size: int) -> list[int]:
    """The owning rank of each tensor: largest first, each to the rank with the fewest bytes so far.

    Ties go to the lower rank and, among equal sizes, the earlier tensor goes first, so every
    rank computes the same assignment from the same list.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if any(s < 0 for s in sizes):
        raise ValueError("tensor sizes must be >= 0")
    owners = [0] * len(sizes)
    loads = [(0, rank) for rank in range(world_size)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, rank = heapq.heappop(loads)
        owners[index] = rank
        heapq.heappush(loads, (load + sizes[index], rank))
    return owners


@dataclasses.dataclass(frozen=True)
class PartitionReport:
    """Bytes and tensors per rank of a whole-tensor distribution, and the greedy bound.

    For largest-first greedy assignment of total T bytes over N ranks with largest tensor s,
    max(T/N, s) ≤ max bytes per rank ≤ T/N + (1 − 1/N)·s (the rank that ends up heaviest was the
    least loaded, hence at most T/N before its last tensor).
    """

    world_size: int
    owners: tuple[int, ...]
    bytes_per_rank: tuple[int, ...]
    tensors_per_rank: tuple[int, ...]
    lower_bound: float
    greedy_bound: float

    @property
    def max_min_ratio(self) -> float:
        low = min(self.bytes_per_rank)
        return math.inf if low == 0 else max(self.bytes_per_rank) / low

    def markdown(self) -> str:
        rows = ["| rank | tensors | bytes |", "|---|---|---|"]
        rows += [f"| {r} | {t} | {b} |" for r, (t, b) in enumerate(zip(self.tensors_per_rank, self.bytes_per_rank))]
        rows.append(
            f"\nmax/min = {self.max_min_ratio:.4f}; bounds {self.lower_bound:.0f} ≤ max ≤ {self.greedy_bound:.0f}"
        )
        return "\n".join(rows)


def _nbytes(item: Any, bytes_per_element: float) -> int:
    if isinstance(item, torch.Tensor):
        return round(item.numel() * (bytes_per_element or item.element_size()))
    if isinstance(item, (tuple, list, torch.Size)):
        return round(math.prod(item) * (bytes_per_element or 1))
    return round(item * (bytes_per_element or 1))


def partition_report(
    tensors: Iterable[torch.Tensor | Sequence[int] | int], world_size: int, *, bytes_per_element: float = 0.0
) -> PartitionReport:
    """The whole-tensor distribution of `tensors` over `world_size` ranks (no processes needed).

    Args:
        tensors: tensors, shapes or element counts.
        world_size: number of ranks.
        bytes_per_element: bytes each element costs its owner (e.g. 5 for an FP8-LM O3 owner: FP16
            master, FP8 m, FP16 v); 0 takes the tensor's element size (1 for shapes and counts).
    """
    sizes = [_nbytes(t, bytes_per_element) for t in tensors]
    owners = assign_whole_tensors(sizes, world_size)
    loads = [0] * world_size
    counts = [0] * world_size
    for size, rank in zip(sizes, owners):
        loads[rank] += size
        counts[rank] += 1
    total, largest = sum(sizes), max(sizes, default=0)
    return PartitionReport(
        world_size=world_size,
        owners=tuple(owners),
        bytes_per_rank=tuple(loads),
        tensors_per_rank=tuple(counts),
        lower_bound=max(total / world_size, largest),
        greedy_bound=total / world_size + (1 - 1 / world_size) * largest,
    )
