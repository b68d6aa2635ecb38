"""What `torch.compile` makes of a training step: graph breaks and recompilations, counted on CPU.

A compiled step runs well on a GPU when it is one graph, built once; dynamo's own counters say
both, read from a clean state. A graph break (`count_graph_breaks`) splits the step, and the host
runs Python between the pieces; a recompilation (`compiled_run`) is a full compilation inside the
training step on a GPU.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CompiledRun", "compiled_run", "count_graph_breaks", "graph_breaks"]


def graph_breaks() -> int:
    """Graph breaks dynamo has counted since the last `torch._dynamo.reset()` (all reasons)."""
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def count_graph_breaks(run: Callable[[], Any]) -> tuple[int, Counter]:
    """(breaks, reasons) of `run()` from a clean dynamo state: `torch._dynamo.reset()` first."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    run()
    reasons = Counter(torch._dynamo.utils.counters["graph_break"])
    return sum(reasons.values()), reasons


@dataclasses.dataclass(frozen=True)
class CompiledRun:
    """What dynamo did while a compiled model trained: graph breaks in the warm-up steps, and
    the graphs it built (recompilations) in the steady steps after them, with dynamo's reasons
    (the guards that failed, one line each)."""

    breaks: int
    break_reasons: Counter
    new_graphs: int
    recompile_reasons: tuple[str, ...]
    #: Graphs dynamo built in the warm-up steps (the forward's pieces, the backward's).
    warmup_graphs: int = 0

    def recompiles_summary(self) -> str:
        return "\n".join(f"  {r}" for r in self.recompile_reasons) or "  (no reason recorded)"


def compiled_run(step: Callable[[], Any], warmup: int = 2, steady: int = 4) -> CompiledRun:
    """Run `step()` `warmup` + `steady` times from a clean dynamo state, with dynamo's settings
    as they are (a recompile limit raised to hide a per-step graph would hide the defect).

    The first steps may build graphs (the forward, then the backward, a graph for a shape met
    once); from step `warmup + 1` on, every graph dynamo makes is a recompilation: a guard
    failed because some value read while tracing changed between steps.
    """
    from torch._dynamo.utils import counters, guard_failures

    torch._dynamo.reset()
    counters.clear()
    guard_failures.clear()
    for _ in range(warmup):
        step()
    breaks = Counter(counters["graph_break"])
    graphs = counters["stats"]["unique_graphs"]
    guard_failures.clear()
    for _ in range(steady):
        step()
    reasons = tuple(
        f"{getattr(code, 'co_name', code)}: {str(reason).splitlines()[0][:300]}"
        for code, failures in guard_failures.items()
        for reason in failures
    )
    return CompiledRun(sum(breaks.values()), breaks, counters["stats"]["unique_graphs"] - graphs, reasons, graphs)
