"""The phases of a counted training step (`PHASES`), what is counted per phase (`PhaseCounts`),
and the dispatch mode that tells them apart (`PhasedMode`), which the step ledger and the
launch counts of tests/gpu build on."""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["PHASES", "PhaseCounts", "PhasedMode"]

PHASES = ("forward", "backward", "gradients", "clip", "optimizer")


@dataclasses.dataclass
class PhaseCounts:
    """One phase's counts: `kernels` launched (eager operations, plus each compiled call's fused
    kernels), `graphs` (compiled calls), `eager` (operations run one by one), `bytes` read and
    written, GEMM `flops` by operand dtype, the share of `bytes` in GEMM kernels, `syncs`, and
    `gemm_kernels` (FLOPs and bytes per GEMM kernel, for the roofline)."""

    kernels: int = 0
    graphs: int = 0
    eager: int = 0
    bytes: int = 0
    syncs: int = 0
    flops: Counter = dataclasses.field(default_factory=Counter)
    gemm_kernels: list = dataclasses.field(default_factory=list)

    def add(self, other: PhaseCounts, times: float = 1.0) -> None:
        self.kernels += round(other.kernels * times)
        self.graphs += round(other.graphs * times)
        self.eager += round(other.eager * times)
        self.bytes += round(other.bytes * times)
        self.syncs += round(other.syncs * times)
        for dtype, n in other.flops.items():
            self.flops[dtype] += round(n * times)
        self.gemm_kernels += [(dtype, f * times, b * times) for dtype, f, b in other.gemm_kernels]


class PhasedMode(TorchDispatchMode):
    """A dispatch mode that counts per phase (`with mode.phase(name):`) and runs every
    `torch.compile`d function as its eager source while it is on (dynamo refuses to run under a
    dispatch mode), so it sees each operation; the package marks its own compiled calls."""

    def __init__(self) -> None:
        super().__init__()
        self._phase = "step"
        self._patches = contextlib.ExitStack()

    def __enter__(self) -> PhasedMode:
        self._patches.enter_context(torch.compiler.set_stance("force_eager"))
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._patches.close()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        previous, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = previous
