"""End-to-end training step on GPT-2 small (124M, from config): step time and peak RSS per
strategy, as ratios to bf16-mixed measured in the same run; then the same model under
`torch.compile` against torchao's float8 training.

    python bench/bench_e2e.py [--strategies bf16-mixed,collage-plus,fp8-lm-o1,fp8-lm-o2,coat]
                              [--steps 3] [--threads 2] [--batch 2] [--seq 256] [--rounds 2]
                              [--compiled bf16-mixed,fp8-lm-o2,coat,torchao-float8]
                              [--compiled-batch 4] [--compiled-steps 5] [--smoke]

Compiled table (issue #36): `torch.compile(model)` (inductor) around the prepared model, batch
4×256, the median of `--compiled-steps` (≥ 5) steps after two warm-up steps (compilation), with
the fastest and slowest step so that a swing shows, the first step (where the compilation
happens) and the graphs dynamo built after the warm-up steps (recompilations: 0 expected);
beside each, the same row run eagerly on the same model, batch and steps (the eager table
above uses its own batch, `--batch`).
torchao's float8 training (`convert_to_float8_training`: dynamic per-tensor E4M3/E5M2
scaling, FP32 weights under BF16 autocast, torch's AdamW(fused=True)) converts `nn.Linear`
only and GPT-2's blocks are `Conv1D`: for every compiled row the blocks' `Conv1D` layers are converted to `nn.Linear`
(same values, weight transposed) before the strategy or torchao sees the model, so all rows
train the same model. torchao 0.18 is installed with `pip install --no-deps --target
build/bench-site` on first use (a row that cannot install or run says so).
`--smoke`: a 2-layer n_embd 64 GPT-2, batch 2×32, two steps, one round: checks the script
runs, measures nothing.

Each strategy runs in its own process (peak RSS is per process: `ru_maxrss`), `--rounds` times,
the rounds interleaved across strategies (A B C D A B C D) so that a burst of load from other jobs
hits every strategy alike; the fastest round counts. Each process runs the strategy
loop the Trainer drives (forward context, scaled backward, optimizer step). The first step is
warm-up (allocations, the optimizer's compiled kernels); the median of the next `--steps` is
reported, for the whole step and for forward + backward alone (the optimizer step is measured
on its own by bench_optim.py), and the fastest single step. On a shared machine absolute times
drift; the ratios to the first strategy, measured in the same run, are what to read, with the
load average printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = "bf16-mixed,collage-plus,fp8-lm-o1,fp8-lm-o2,coat"
COMPILED = "bf16-mixed,fp8-lm-o2,coat,torchao-float8"
TORCHAO = "torchao-float8"
BENCH_SITE = ROOT / "build" / "bench-site"
COMPILED_WARMUP = 2


def conv1d_to_linear(model):
    """`model` with every transformers `Conv1D` replaced by the `nn.Linear` computing the same map."""
    import torch
    from transformers.pytorch_utils import Conv1D

    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, Conv1D):
                n_in, n_out = child.weight.shape
                linear = torch.nn.Linear(n_in, n_out)
                with torch.no_grad():
                    linear.weight.copy_(child.weight.t())
                    linear.bias.copy_(child.bias)
                setattr(parent, child_name, linear)
    return model


def ensure_torchao() -> str | None:
    """Put torchao 0.18 on sys.path (installing it into build/bench-site once); why not, or None."""
    if not (BENCH_SITE / "torchao").exists():
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(BENCH_SITE),
            "torchao==0.18.*",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            return f"pip install torchao failed: {proc.stderr.strip().splitlines()[-1:]}"
    sys.path.insert(0, str(BENCH_SITE))
    try:
        import torchao.float8  # noqa: F401
    except Exception as error:
        return f"torchao does not import here: {type(error).__name__}: {error}"
    return None


def build(name: str, model, compiled: bool):
    """(forward context, scale_loss, model, optimizer) of `name`: a strategy or torchao's float8."""
    import torch

    if name == TORCHAO:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)

        def context():
            return torch.autocast("cpu", dtype=torch.bfloat16)

        def scale(loss):
            return loss
    else:
        import hf_lowprec

        strategy = hf_lowprec.get_strategy(name)
        model = strategy.prepare_model(model)
        optimizer = strategy.create_optimizer(model.parameters(), lr=1e-4, weight_decay=0.01)
        context, scale = strategy.forward_context, strategy.scale_loss
    return context, scale, (torch.compile(model) if compiled else model), optimizer


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    if args.smoke:
        config = GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=1024)
    else:
        config = GPT2Config(n_layer=args.layers) if args.layers else GPT2Config()
    model = GPT2LMHeadModel(config)
    if args.compile or args.linear:
        model = conv1d_to_linear(model)
    if args.child == TORCHAO:
        problem = ensure_torchao()
        if problem:
            print(json.dumps({"error": problem}))
            return
    context, scale_loss, model, optimizer = build(args.child, model, args.compile)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    warmup = COMPILED_WARMUP if args.compile else 1
    times, passes, losses = [], [], []
    graphs = []  # dynamo's graphs built so far, after each step (compiled rows)
    for _ in range(args.steps + warmup):
        start = time.perf_counter()
        with context():
            loss = model(input_ids=ids, labels=ids).loss
        scale_loss(loss).backward()
        passes.append(time.perf_counter() - start)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
        if args.compile:
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = {
        "step_s": statistics.median(times[warmup:]),
        "fwd_bwd_s": statistics.median(passes[warmup:]),
        "peak_mib": peak_mib,
        "fastest_s": min(times[warmup:]),
        "slowest_s": max(times[warmup:]),
        "first_s": times[0],
    }
    if args.compile:  # graphs built after the warm-up steps: recompilations (goal 0)
        out["recompiles"] = graphs[-1] - graphs[warmup - 1]
    print(json.dumps({**out, "loss": losses[-1]}))


def model_label(args: argparse.Namespace) -> str:
    if args.smoke:
        return "smoke model (2-layer GPT-2, n_embd 64): times mean nothing"
    return f"GPT-2 124M's shape with {args.layers} of its 12 layers" if args.layers else "GPT-2 124M"


def run_children(
    names: list[str], args: argparse.Namespace, *, compiled: bool, same_as_compiled: bool = False
) -> dict[str, list[dict]] | None:
    """Each strategy's child process `args.rounds` times, interleaved; None if one failed.
    `same_as_compiled`: an eager run with the compiled table's batch, steps and model."""
    batch, steps = (args.compiled_batch, args.compiled_steps) if compiled else (args.batch, args.steps)
    if same_as_compiled:
        batch, steps = args.compiled_batch, args.compiled_steps
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            cmd = [sys.executable, __file__, "--child", name, "--steps", str(steps), "--threads", str(args.threads)]
            cmd += ["--batch", str(batch), "--seq", str(args.seq), "--layers", str(args.layers)]
            cmd += ["--compile"] * compiled + ["--linear"] * same_as_compiled + ["--smoke"] * args.smoke
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if proc.returncode:
                print(f"{name}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
                return None
            runs[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            # Each row as it finishes (stderr): a long run cut short keeps what it measured.
            print(f"{name}{' compiled' * compiled}: {runs[name][-1]}", file=sys.stderr, flush=True)
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategies", default=DEFAULT, help="rows of the eager table ('' for none)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2, help="processes per strategy, interleaved")
    parser.add_argument("--compiled", default=COMPILED, help="rows of the compiled table ('' for none)")
    parser.add_argument("--compiled-batch", type=int, default=4)
    parser.add_argument("--compiled-steps", type=int, default=5)
    parser.add_argument(
        "--layers",
        type=int,
        default=0,
        help="blocks of the GPT-2 124M model (0: all 12); compiling all 12 took over 15 min per process on 2 cores",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model, two steps, one round: runs, measures nothing")
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--linear", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    if args.smoke:
        args.steps = args.compiled_steps = 2
        args.rounds, args.batch, args.compiled_batch, args.seq = 1, 2, 2, 32
    names = [n for n in args.strategies.split(",") if n]
    if not names:  # `--strategies ''`: the compiled table only
        return print_compiled(args) if args.compiled else 0
    load = os.getloadavg()
    runs = run_children(names, args, compiled=False)
    if runs is None:
        return 1
    # Other jobs on a shared machine only ever slow a run down: the fastest round is the closest
    # to the strategy's own cost. Peak RSS barely moves between rounds; the largest is kept.
    results = {
        name: {
            "step_s": min(r["step_s"] for r in rs),
            "fwd_bwd_s": min(r["fwd_bwd_s"] for r in rs),
            "fastest_s": min(r["fastest_s"] for r in rs),
            "peak_mib": max(r["peak_mib"] for r in rs),
            "loss": rs[0]["loss"],
        }
        for name, rs in runs.items()
    }
    base = results[names[0]]
    print(
        f"{model_label(args)}, batch {args.batch}x{args.seq}, {args.threads} threads, median of {args.steps} steps, "
        f"fastest of {args.rounds} interleaved rounds; ratios to {names[0]} in this run"
    )
    print(f"load average before / after: {load[0]:.1f} / {os.getloadavg()[0]:.1f}")
    # A step's time swings with page faults (freed memory returned to the OS and faulted in
    # again), more for some strategies than others: the fastest single step is the steadier
    # measure of the work a step needs, the median what a run sees.
    print(
        "| strategy | step | step ratio | fastest step | fastest ratio | forward+backward | fwd+bwd ratio "
        "| peak RSS | RSS ratio | loss |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['step_s']:.2f} s | {r['step_s'] / base['step_s']:.2f} | {r['fastest_s']:.2f} s | "
            f"{r['fastest_s'] / base['fastest_s']:.2f} | {r['fwd_bwd_s']:.2f} s | "
            f"{r['fwd_bwd_s'] / base['fwd_bwd_s']:.2f} | {r['peak_mib']:.0f} MiB | "
            f"{r['peak_mib'] / base['peak_mib']:.2f} | {r['loss']:.3f} |"
        )
    return print_compiled(args) if args.compiled else 0


def print_compiled(args: argparse.Namespace) -> int:
    """The compiled table: median, fastest and slowest step per row, ratios to the first row,
    and each row's eager step on the same model and batch."""
    names = args.compiled.split(",")
    load = os.getloadavg()
    runs = run_children(names, args, compiled=True)
    eager = run_children(names, args, compiled=False, same_as_compiled=True)
    if runs is None or eager is None:
        return 1
    print()
    print(
        f"torch.compile (inductor), {model_label(args)} with Conv1D as nn.Linear, batch {args.compiled_batch}x{args.seq}, "
        f"{args.threads} threads, median of {args.compiled_steps} steps after {COMPILED_WARMUP} warm-up steps, "
        f"fastest of {args.rounds} rounds; load average before / after: {load[0]:.1f} / {os.getloadavg()[0]:.1f}"
    )
    print(
        "| compiled | step (median) | ratio | fastest | slowest | eager step, same batch | compiled ÷ eager "
        "| first step (compiles) | graphs after warm-up | peak RSS | loss |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    base = None
    for name, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            print(f"| {name} | {rs[0]['error']} | | | | | | | | | |")
            continue
        best = min(ok, key=lambda r: r["step_s"])
        plain = min((r["step_s"] for r in eager[name] if "error" not in r), default=float("nan"))
        base = base or best
        print(
            f"| {name} | {best['step_s']:.2f} s | {best['step_s'] / base['step_s']:.2f} | {best['fastest_s']:.2f} s | "
            f"{best['slowest_s']:.2f} s | {plain:.2f} s | {best['step_s'] / plain:.2f} | {best['first_s']:.0f} s | "
            f"{best['recompiles']} | {best['peak_mib']:.0f} MiB | {best['loss']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
