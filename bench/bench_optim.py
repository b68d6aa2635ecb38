"""Optimizer-step throughput: Collage against option D (FP32 AdamW + master weights).

Run with `make bench` (or `python bench/bench_optim.py`). Prints, for ~10M parameters in
a few transformer-like shapes, the median milliseconds per optimizer step, the ratio to
option D measured in the same run, and the achieved bandwidth against a measured copy
bandwidth. A benchmark, not a test: nothing here asserts on time. On a shared machine
prefer `--threads 1`: OpenMP threads spinning against other processes distort 2-thread
timings far more than the load itself.

Two byte counts per parameter and step. "ideal": each stored tensor read once and written
once, what a fused kernel would move. "foreach": what the `torch._foreach_*` calls of this
package (and of `torch.optim.AdamW`) actually read and write, one pass per op:

| option                     | ideal reads + writes                         | ideal | foreach |
|----------------------------|----------------------------------------------|-------|---------|
| D: FP32 AdamW + BF16 copy  | g, m, v, θ32 (16) + m, v, θ32 (12); copy 4+2 | 34    | 86      |
| Collage-plus (BF16)        | g, m, v, δv, θ, δθ (12) + m, v, δv, θ, δθ (10) | 22  | 156     |
| Collage-light (BF16)       | g, m, v, θ, δθ (10) + m, v, θ, δθ (8)        | 18    | 84      |
| Kahan (BF16)               | g, m, v, θ, k (10) + m, v, θ, k (8)          | 18    | 66      |
| A: plain BF16 AdamW        | g, m, v, θ (8) + m, v, θ (6)                 | 14    | 44      |

The foreach counts, in bytes per op (2 per BF16 operand, 4 per FP32 operand): D = lerp 12,
mul_ 8, addcmul_ 12, decay mul_ 8, sqrt 8, div_ 8, add_ 8, addcdiv_ 16, copy to BF16 6.
Collage-plus = lerp 6, Mul's cross term 6, Fast2Sum 22, (1 − β2)·g² 10, Grow of (v, δv) 46,
Δθ (sqrt 4, + ε 4, decay 4, addcdiv 8) 20, Grow of (θ, δθ) 46. Light = 6 + v 12 + 20 + 46;
Kahan = 6 + 12 + 20 + 6 + Fast2Sum 22; A = 6 + 12 + 20 + add 6.

D's gradient is taken as already FP32 (accumulated into the master's .grad); a BF16
gradient upcast would add 6 B/param to both of D's counts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_lowprec.fp8 import pow2_scale, quantize  # noqa: E402
from hf_lowprec.optim import CollageAdamW, FP8AdamW, KahanAdamW, PlainAdamW  # noqa: E402

# An embedding, two MLP blocks and attention projections of a d_model = 512 model.
SHAPES = [(10_000, 512)] + [(512, 2048), (2048, 512)] * 2 + [(512, 512)] * 4 + [(512,)] * 8
# (ideal, foreach) bytes per parameter and step, from the table above.
BYTES_PER_PARAM = {
    "D: fp32 adamw + copy": (34, 86),
    "collage-plus": (22, 156),
    "collage-light": (18, 84),
    "kahan": (18, 66),
    "plain-bf16 (A)": (14, 44),
    # FP8-LM O2: reads FP8 g, FP8 m1, FP16 m2, FP16 master; writes m1, m2, master (per-tensor
    # loop with upcasts, so the traffic actually moved is not counted: 0 = not counted).
    "fp8-lm-o2 FP8AdamW": (11, 0),
}


def interleaved_median_ms(
    steps: dict[str, Callable[[], None]], warmup: int, repeats: int
) -> dict[str, tuple[float, float]]:
    """Median wall and process-CPU milliseconds of each step.

    One step of each candidate is timed in turn, so that background load on a shared
    machine slows all of them alike and the ratios stay meaningful; CPU time is the
    less load-sensitive of the two.
    """
    for step in steps.values():
        for _ in range(warmup):
            step()
    wall: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            step()
            wall[name].append(time.perf_counter() - start_wall)
            cpu[name].append(time.process_time() - start_cpu)
    return {n: (1e3 * statistics.median(wall[n]), 1e3 * statistics.median(cpu[n])) for n in steps}


def copy_step(numel: int) -> Callable[[], None]:
    """`dst.copy_(src)` on an FP32 buffer: the bandwidth reference, timed with the others."""
    src = torch.randn(numel)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def low_precision_step(
    factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
) -> Callable[[], None]:
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=generator).bfloat16().requires_grad_() for s in SHAPES]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=generator) * 1e-3).bfloat16()
    optimizer = factory(params)
    return optimizer.step


def option_d_step() -> Callable[[], None]:
    generator = torch.Generator().manual_seed(0)
    master = [torch.randn(s, generator=generator).requires_grad_() for s in SHAPES]
    for p in master:
        p.grad = torch.randn(p.shape, generator=generator) * 1e-3
    model = [p.detach().bfloat16() for p in master]
    optimizer = torch.optim.AdamW(master, lr=1e-3, weight_decay=0.01, foreach=True)

    def step() -> None:
        optimizer.step()
        with torch.no_grad():
            torch._foreach_copy_(model, master)

    return step


def fp8_o2_step() -> Callable[[], None]:
    """FP8AdamW as the fp8-lm-o2 strategy drives it: FP8 gradients handed over, then the step."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=generator).half().requires_grad_() for s in SHAPES]
    grads = []
    for p in params:
        g = torch.randn(p.shape, generator=generator) * 1e-3
        scale = pow2_scale(g.abs().max(), torch.float8_e4m3fn)
        grads.append((quantize(g, scale, torch.float8_e4m3fn), scale))
    optimizer = FP8AdamW(params, lr=1e-3, weight_decay=0.01)

    def step() -> None:
        for p, (payload, scale) in zip(params, grads):
            optimizer.set_fp8_grad(p, payload, scale)
        optimizer.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed steps per optimizer")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    numel = sum(torch.Size(s).numel() for s in SHAPES)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs "
        f"(load average {load:.1f}), {numel / 1e6:.2f}M parameters in {len(SHAPES)} tensors"
    )

    def collage(variant: str) -> Callable[[], None]:
        return low_precision_step(lambda ps: CollageAdamW(ps, weight_decay=0.01, variant=variant))

    candidates: dict[str, Callable[[], Callable[[], None]]] = {
        "D: fp32 adamw + copy": option_d_step,
        "collage-plus": lambda: collage("plus"),
        "collage-light": lambda: collage("light"),
        "kahan": lambda: low_precision_step(lambda ps: KahanAdamW(ps, weight_decay=0.01)),
        "plain-bf16 (A)": lambda: low_precision_step(lambda ps: PlainAdamW(ps, weight_decay=0.01)),
        "fp8-lm-o2 FP8AdamW": fp8_o2_step,
    }
    copy_numel = 64 * 1024 * 1024
    steps = {"copy": copy_step(copy_numel), **{name: build() for name, build in candidates.items()}}
    results = interleaved_median_ms(steps, args.warmup, args.repeats)
    bandwidth = 2 * copy_numel * 4 / (results.pop("copy")[0] * 1e-3) / 1e9
    print(f"copy bandwidth (dst.copy_(src), 256 MB FP32, read + write): {bandwidth:.1f} GB/s\n")

    wall_d, cpu_d = results["D: fp32 adamw + copy"]
    print(
        f"{'optimizer':22s} {'ms/step':>8s} {'vs D':>6s} {'cpu ms':>7s} {'vs D':>6s} "
        f"{'ideal B':>7s} {'GB/s':>5s} {'foreach B':>9s} {'GB/s':>5s} {'of copy':>7s}"
    )
    for name, (wall, cpu) in results.items():
        ideal, moved = BYTES_PER_PARAM[name]
        ideal_gbs, moved_gbs = (b * numel / (wall * 1e-3) / 1e9 for b in (ideal, moved))
        moved_cols = (f"{moved:9d} {moved_gbs:5.1f} {100 * moved_gbs / bandwidth:6.0f}%" if moved
                      else f"{'-':>9s} {'-':>5s} {'-':>7s}")
        print(
            f"{name:22s} {wall:8.1f} {wall / wall_d:5.2f}x {cpu:7.1f} {cpu / cpu_d:5.2f}x "
            f"{ideal:7d} {ideal_gbs:5.1f} {moved_cols}"
        )
    print(
        "\n'vs D': time relative to option D in this run (below 1 is faster); 'cpu ms': process CPU"
        "\ntime of all threads. GB/s: the byte counts of this file's docstring over the wall time;"
        "\n'of copy': the foreach bandwidth as a share of the measured copy bandwidth."
    )


def strategy_memory_table() -> None:
    """Model-state bytes/param of every registered strategy, measured after one step of a tiny GPT-2."""
    from transformers import GPT2LMHeadModel

    from hf_lowprec import available_strategies, get_strategy
    from hf_lowprec.data import tiny_gpt2_config
    from hf_lowprec.memory import model_state_bytes

    print(f"\n{'strategy':18s} {'params':>7s} {'grads':>6s} {'states':>7s} {'extra':>6s} {'total':>6s} {'vs D':>6s}")
    rows = {}
    for name in available_strategies():
        strategy = get_strategy(name)
        torch.manual_seed(0)
        model = strategy.prepare_model(GPT2LMHeadModel(tiny_gpt2_config(vocab_size=256)))
        optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 256, (2, 32))
        with strategy.forward_context():
            loss = model(input_ids=ids, labels=ids).loss
        strategy.scale_loss(loss).backward()
        optimizer.step()
        rows[name] = model_state_bytes(model, optimizer)
    base = rows["bf16-mixed"]["total"]
    for name, m in rows.items():
        print(f"{name:18s} {m['params']:7.2f} {m['grads']:6.2f} {m['optimizer_states']:7.2f} "
              f"{m['extra']:6.2f} {m['total']:6.2f} {m['total'] / base:5.2f}x")


if __name__ == "__main__":
    main()
    strategy_memory_table()
