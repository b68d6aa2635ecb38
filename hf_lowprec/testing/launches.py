"""Kernel launches of a training step, counted on CPU at the ATen dispatcher, per phase (forward,
backward, gradient processing, optimizer), as a GPU would be asked to run them: an eager operation
that computes is one launch; a call of one of the package's compiled graphs (`compiling.compiled_region`:
the FP8 casts, the optimizer steps) is one graph, whatever it runs inside. The host issues each
launch (5–30 µs), so a step of thousands is host-bound on a GPU (docs/gpu.md, "Launches").
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

import torch

from ..compiling import current_compiled_region, gpu_paths
from ..planning.counting import phased_step
from ..planning.ledger import PhasedMode, launches_a_kernel

__all__ = ["PHASES", "Launches", "anchor_launches", "launches_of"]

PHASES = ("forward", "backward", "gradients", "optimizer")


class Launches(PhasedMode):
    """Counts launches per phase: `with Launches() as counted:` around a step, `counted.phase(name)`
    around its parts; then `counted.eager[phase]`, `counted.graphs[phase]`, `counted.total(phase)`,
    `counted.ops` (phase, operation) for where the eager ones come from.

    Compiled functions run as their eager source inside it (dynamo refuses to run under a dispatch
    mode); the package marks its own compiled calls, so each counts once, as one graph. Inside a
    `torch.compile`d model everything is one compiled region of torch's own: count a step with an
    eager model, or read the compiled layers' kernels from their graphs.
    """

    def __init__(self) -> None:
        super().__init__()
        self.eager: Counter[str] = Counter()
        self.graphs: Counter[str] = Counter()
        self.ops: Counter[tuple[str, str]] = Counter()
        self.regions: Counter[tuple[str, str]] = Counter()
        self._last_region: int | None = None

    def total(self, phase: str | None = None) -> int:
        """Launches (eager operations plus compiled graphs) of one phase, or of all."""
        if phase is None:
            return sum(self.eager.values()) + sum(self.graphs.values())
        return self.eager[phase] + self.graphs[phase]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if launches_a_kernel(func):
            region = current_compiled_region()
            if region is None:
                self.eager[self._phase] += 1
                self.ops[(self._phase, str(func))] += 1
            elif region[1] != self._last_region:
                self._last_region = region[1]
                self.graphs[self._phase] += 1
                self.regions[(self._phase, region[0])] += 1
        return func(*args, **kwargs)

    def summary(self, phase: str | None = None, top: int = 12) -> str:
        """The most frequent eager operations (of `phase`, or all), then the graphs, one a line."""
        ops = Counter({op: n for (p, op), n in self.ops.items() if phase in (None, p)})
        graphs = Counter({name: n for (p, name), n in self.regions.items() if phase in (None, p)})
        lines = [f"{n}x {op}" for op, n in ops.most_common(top)]
        lines += [f"{n}x graph {name}" for name, n in graphs.most_common(top)]
        return "\n".join(lines)


def launches_of(name: str, n_layer: int, warmup: int = 2, clip: float | None = None, **options: Any) -> Launches:
    """The launches of one steady training step of strategy `name` on the paths a CUDA device
    takes (`compiling.gpu_paths`, FP8 GEMMs by `torch._scaled_mm`), eager model (GPT-2 of
    `n_layer` layers: `counted_step.gpt2`), after `warmup` steps, per phase: "forward",
    "backward" (the FP8 gradient hooks run in it), "gradients" (`process_gradients`),
    "optimizer" (`optimizer_step`), "zero_grad". Compiled functions run as their eager source
    (same bits; nothing is compiled, so counting takes seconds). `clip`: the gradients clipped
    to this norm before the step, as the Trainer does (`max_grad_norm`; phase "clip"). `options`
    go to the strategy."""
    from hf_lowprec.fp8.gemm import set_fp8_gemm_path

    from .counted_step import checked_strategy, gpt2, strategy_step, token_batch

    counted = Launches()
    set_fp8_gemm_path("scaled_mm")
    try:
        with torch.compiler.set_stance("force_eager"), gpu_paths():
            strategy = checked_strategy(name, **options)
            model = strategy.prepare_model(gpt2(n_layer))
            optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3, weight_decay=0.01)
            ids = token_batch()
            for _ in range(warmup):
                strategy_step(strategy, model, optimizer, ids)
            _counted_step(counted, strategy, model, optimizer, ids, clip)
    finally:
        set_fp8_gemm_path(None)
    return counted


def _counted_step(
    counted: Launches, strategy: Any, model: Any, optimizer: Any, ids: torch.Tensor, clip: float | None = None
) -> None:
    with counted:
        phased_step(counted, strategy, model, optimizer, ids, clip)


def anchor_launches(n_layer: int, warmup: int = 2, clip: float | None = None) -> Launches:
    """The launches of the anchor's steady step (torch autocast, GradScaler, `AdamW(fused=True)`:
    what `bf16=True` with `optim="adamw_torch_fused"` runs), same model and phases; the scaler's
    unscale and check are "gradients", `clip_grad_norm_(clip)` after them "clip" (as the
    Trainer clips, if `clip`), the fused step "optimizer"."""
    from .counted_step import gpt2, token_batch

    model, ids = gpt2(n_layer), token_batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    counted = Launches()
    for step in range(warmup + 1):
        with contextlib.ExitStack() as scope:
            if step == warmup:
                scope.enter_context(counted)
            with counted.phase("forward"), torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            with counted.phase("backward"):
                scaler.scale(loss).backward()
            with counted.phase("gradients"):
                scaler.unscale_(optimizer)
            if clip is not None:
                with counted.phase("clip"):
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with counted.phase("optimizer"):
                scaler.step(optimizer)
                scaler.update()
            with counted.phase("zero_grad"):
                optimizer.zero_grad(set_to_none=True)
    return counted
