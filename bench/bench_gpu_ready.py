"""GPU readiness per strategy (issue #36): host syncs per training step, graph breaks under
`torch.compile`, host→device copies per step on a fake CUDA device; markdown on stdout.

    python bench/bench_gpu_ready.py [--strategies a,b] [--layers 2,8] [--smoke]

Nothing here is timed: every figure is a count (`hf_lowprec.testing`), the same on a loaded
machine as on an idle one. Columns:

- syncs/step (L layers): host syncs in one steady step of GPT-2 (n_embd 128, batch 4×32) on
  CPU after two warm-up steps; "first step": those of the first step (state being built).
- graph breaks: two steps of the prepared model under `torch.compile` (2 layers).
- H2D copies/step: host→device copies in one steady step on a fake CUDA device of compute
  capability 9.0 (what runs there: `hf_lowprec.testing.fake_cuda`), and its FP8 GEMM path.

The goal (issue #36): 0 syncs, breaks ≤ bf16-mixed's, 0 copies. The anchor row is torch's AMP
recipe (autocast, GradScaler, AdamW(fused=True)) on the same model.
`--smoke`: two strategies at 2 layers, to check the script runs.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch

import hf_lowprec
from hf_lowprec.testing import (
    anchor_syncs,
    count_graph_breaks,
    fake_cuda_step,
    gpt2,
    strategy_graph_breaks,
    strategy_syncs,
)
from hf_lowprec.testing.launches import PHASES, anchor_launches, launches_of

GOAL = "0 syncs per step, graph breaks <= bf16-mixed's, 0 host->device copies per step"


def cell(measure: Callable[[], Any]) -> str:
    """The measured value, or the error that stopped it (a failed strategy keeps its row)."""
    try:
        return str(measure())
    except Exception as error:  # a strategy that fails here is a finding, not a crash
        traceback.print_exc(file=sys.stderr)
        return f"error: {type(error).__name__}"


def strategy_row(name: str, layers: list[int]) -> list[str]:
    row = [name]
    syncs: dict[int, Any] = {}
    for n_layer in layers:

        def measure(n_layer: int = n_layer) -> int:
            syncs[n_layer] = strategy_syncs(name, n_layer)
            return len(syncs[n_layer][1])

        row.append(cell(measure))
        if n_layer == layers[0]:
            row.append(str(len(syncs[n_layer][0])) if n_layer in syncs else "-")
    row.append(cell(lambda: strategy_graph_breaks(name)[0]))
    fake: dict[str, Any] = {}

    def copies() -> int:
        fake.update(fake_cuda_step(name, (9, 0)))
        return len(fake["copies"])

    row.append(cell(copies))
    row.append(str(fake.get("gemm_path") or "-"))
    return row


def anchor_row(layers: list[int]) -> list[str]:
    row = ["anchor: torch AMP + AdamW(fused=True)"]
    for n_layer in layers:
        row.append(cell(lambda n_layer=n_layer: len(anchor_syncs(n_layer).syncs)))
        if n_layer == layers[0]:
            row.append("-")

    def breaks() -> int:
        model = torch.compile(gpt2(2), backend="eager")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        ids = torch.randint(0, 1024, (4, 32), generator=torch.Generator().manual_seed(1))

        def train() -> None:
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        return count_graph_breaks(train)[0]

    return [*row, cell(breaks), "-", "-"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategies", default=",".join(hf_lowprec.available_strategies()))
    parser.add_argument("--layers", default="2,8")
    parser.add_argument("--smoke", action="store_true", help="bf16-mixed and fp8-lm-o2 at 2 layers")
    args = parser.parse_args()
    names = ["bf16-mixed", "fp8-lm-o2"] if args.smoke else args.strategies.split(",")
    layers = [2] if args.smoke else [int(n) for n in args.layers.split(",")]
    unknown = sorted(set(names) - set(hf_lowprec.available_strategies()))
    if unknown:
        parser.error(f"unknown strategies {unknown}; choose from {hf_lowprec.available_strategies()}")
    torch.set_num_threads(1)
    header = ["strategy"]
    for n_layer in layers:
        header.append(f"syncs/step ({n_layer} layers)")
        if n_layer == layers[0]:
            header.append(f"first-step syncs ({n_layer} layers)")
    header += ["graph breaks (2 layers)", "H2D copies/step (fake CUDA 9.0)", "FP8 GEMM path (9.0)"]
    rows = [anchor_row(layers)] + [strategy_row(name, layers) for name in names]
    print(f"GPT-2 from config, n_embd 128, batch 4x32; torch {torch.__version__}; goal: {GOAL}")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()
    print_launches(names, [2] if args.smoke else [2, 8])
    return 0


def print_launches(names: list[str], layers: list[int]) -> None:
    """Kernel launches of one steady step on the CUDA paths (`hf_lowprec.testing.launches`), per
    phase, eager model: what the host issues; the compiled graphs counted once each."""
    print(f"Launches per step on the CUDA paths (eager model; {'/'.join(map(str, layers))} layers)")
    header = ["strategy", *PHASES, "total", "per added layer"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name in ["anchor: torch autocast + AdamW(fused=True)", *names]:
        try:
            counts = [anchor_launches(n) if name.startswith("anchor") else launches_of(name, n) for n in layers]
        except Exception as error:  # a strategy that fails here is a finding, not a crash
            traceback.print_exc(file=sys.stderr)
            print(f"| {name} | error: {type(error).__name__} |")
            continue
        first, last = counts[0], counts[-1]
        per_layer = (last.total() - first.total()) / max(layers[-1] - layers[0], 1)
        cells = [" / ".join(str(c.total(phase)) for c in counts) for phase in PHASES]
        totals = " / ".join(str(c.total()) for c in counts)
        print(f"| {name} | " + " | ".join(cells) + f" | {totals} | {per_layer:.0f} |")


if __name__ == "__main__":
    sys.exit(main())
