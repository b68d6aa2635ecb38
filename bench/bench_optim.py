"""Optimizer-step speed of every strategy against torch's fused AdamW (option D), same run.

Run with `make bench` (or `python bench/bench_optim.py`). A benchmark, not a test: nothing here
asserts on time. For each strategy's optimizer, on ~50M parameters in the shapes of four
d_model = 1024 transformer blocks (well out of cache), 2 threads:

- the median step time, timed alternately with option D (`torch.optim.AdamW(fused=True)` on FP32
  weights, FP32 gradients and FP32 m, v) so that background load on a shared machine slows both
  alike; the ratio is D's time over the candidate's (above 1 = faster than D);
- the compiled path ("compiled") and the eager reference ("reference") of each optimizer;
- the first step's time, which includes compiling the kernel (a warm Inductor cache under build/
  makes it small);
- achieved GB/s: the bytes a fused step must move (each stored tensor read once and written
  once, the "ideal" column) over the step time, against a measured copy bandwidth;
- peers a user might pick instead, where they are installed (`pip install -e '.[bench]'`):
  torchao AdamWFp8 / AdamW8bit / _AdamW(bf16_stochastic_round=True), bitsandbytes AdamW8bit,
  torch-optimi AdamW(kahan_sum=True). A peer that is missing or fails on CPU is listed as such.

Ideal bytes per parameter and step (reads + writes):

| optimizer | reads | writes | B/param |
|---|---|---|---|
| D: torch fused AdamW, FP32 | g, m, v, θ: 16 | m, v, θ: 12 | 28 |
| collage-plus (BF16) | g, m, v, δv, θ, δθ: 12 | m, v, δv, θ, δθ: 10 | 22 |
| collage-light, bf16-kahan (BF16) | g, m, v, θ, δθ: 10 | m, v, θ, δθ: 8 | 18 |
| bf16-pure, bf16-sr (BF16) | g, m, v, θ: 8 | m, v, θ: 6 | 14 |
| bf16-fp32states | g, θ: 4 + m, v: 8 | θ: 2 + m, v: 8 | 22 |
| fp8-lm-o2 FP8AdamW | g 1, m 1, v 2, θ 2: 6 | m 1, v 2, θ 2: 5 | 11 |
| coat COATAdamW (FP32 θ) | g 4, θ 4, m 1, v 1: 10 | θ 4, m 1, v 1: 6 | 16 |
| collage-8bit (BF16 θ, δθ, 8-bit m, v) | g, θ, δθ: 6 + m, v: 2 | θ, δθ: 4 + m, v: 2 | 14 |
| 8-bit peers (BF16 θ) | g, θ: 4 + m, v: 2 | θ: 2 + m, v: 2 | 10 |

"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / "build" / "inductor"))

from hf_lowprec.optim import (  # noqa: E402
    COATAdamW,
    Collage8bitAdamW,
    CollageAdamW,
    FP8AdamW,
    FP32StatesAdamW,
    KahanAdamW,
    PlainAdamW,
    StochasticRoundingAdamW,
)

D_MODEL = 1024
# Four transformer blocks: QKV, attention output, MLP in and out, their biases, two LayerNorms.
BLOCK = [
    (3 * D_MODEL, D_MODEL),
    (3 * D_MODEL,),
    (D_MODEL, D_MODEL),
    (D_MODEL,),
    (4 * D_MODEL, D_MODEL),
    (4 * D_MODEL,),
    (D_MODEL, 4 * D_MODEL),
    (D_MODEL,),
] + [(D_MODEL,)] * 4
SHAPES = BLOCK * 4

# The project's goals: torch fused AdamW FP32's step time over ours, at N threads.
GOALS = {
    "bf16-pure": 1.4,
    "bf16-sr": 1.3,
    "bf16-kahan": 1.1,
    "bf16-fp32states": 1.1,
    "collage-light": 1.0,
    "collage-plus": 0.8,
    "collage-8bit": 1.0,
    "fp8-lm-o2": 1.0,
    "coat": 0.4,
}


@dataclasses.dataclass
class Candidate:
    name: str
    path: str
    ideal_bytes: int
    build: Callable[[], Callable[[], None]]
    note: str = ""


def _tensors(dtype: torch.dtype, grad_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    params = []
    for shape in SHAPES:
        p = (torch.randn(shape, generator=generator) * 0.02).to(dtype).requires_grad_()
        p.grad = (torch.randn(shape, generator=generator) * 1e-3).to(grad_dtype or dtype)
        params.append(p)
    return params


def _optimizer_step(
    factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer], dtype: torch.dtype
) -> Callable[[], Callable[[], None]]:
    def build() -> Callable[[], None]:
        return factory(_tensors(dtype)).step

    return build


def _option_d() -> Callable[[], None]:
    return torch.optim.AdamW(_tensors(torch.float32), lr=1e-3, weight_decay=0.01, fused=True).step


def _fp8_o2(fused: str) -> Callable[[], Callable[[], None]]:
    """FP8AdamW as fp8-lm-o2 drives it: scaled FP16 masters, FP8 gradients handed over, then the step."""
    from hf_lowprec.fp8 import pow2_scale, quantize, set_master_scale

    def build() -> Callable[[], None]:
        params = []
        for real in _tensors(torch.float32):  # scaled FP16 masters, as fp8-lm-o2 holds them
            scale = pow2_scale(real.detach().abs().max(), torch.float16)
            master = quantize(real.detach(), scale, torch.float16).requires_grad_()
            master.grad = real.grad.half()
            set_master_scale(master, scale)
            params.append(master)
        grads = []
        for p in params:
            g = p.grad.float()
            scale = pow2_scale(g.abs().max(), torch.float8_e4m3fn)
            grads.append((quantize(g, scale, torch.float8_e4m3fn), scale))
            p.grad = None
        optimizer = FP8AdamW(params, lr=1e-3, weight_decay=0.01, fused=fused)

        def step() -> None:
            for p, (payload, scale) in zip(params, grads):
                optimizer.set_fp8_grad(p, payload, scale)
            optimizer.step()

        step.optimizer = optimizer
        return step

    return build


FAMILIES = [  # (family, ideal bytes per parameter, optimizer factory over (params, fused))
    ("bf16-pure", 14, lambda ps, f: PlainAdamW(ps, weight_decay=0.01, fused=f)),
    ("bf16-sr", 14, lambda ps, f: StochasticRoundingAdamW(ps, weight_decay=0.01, seed=0, fused=f)),
    ("bf16-kahan", 18, lambda ps, f: KahanAdamW(ps, weight_decay=0.01, fused=f)),
    ("bf16-fp32states", 22, lambda ps, f: FP32StatesAdamW(ps, weight_decay=0.01, fused=f)),
    ("collage-light", 18, lambda ps, f: CollageAdamW(ps, weight_decay=0.01, variant="light", fused=f)),
    ("collage-plus", 22, lambda ps, f: CollageAdamW(ps, weight_decay=0.01, variant="plus", fused=f)),
    ("collage-8bit", 14, lambda ps, f: Collage8bitAdamW(ps, weight_decay=0.01, fused=f)),
]
# The peer a user would pick for the same arithmetic, by family (a name from `_peers`).
PEER_OF = {
    "bf16-pure": "DeepSpeedCPUAdam BF16",
    "bf16-sr": "torchao _AdamW SR",
    "bf16-kahan": "optimi Kahan AdamW",
    "collage-8bit": "torchao AdamW8bit",
    "fp8-lm-o2": "torchao AdamWFp8",
}


def _ours(paths: tuple[str, ...]) -> list[Candidate]:
    rows = []
    for name, ideal, make in FAMILIES:
        for path in paths:
            rows.append(
                Candidate(name, path, ideal, _optimizer_step(lambda ps, m=make, p=path: m(ps, p), torch.bfloat16))
            )
    for path in paths:
        rows.append(Candidate("fp8-lm-o2", path, 11, _fp8_o2(path), "FP8AdamW, FP16 masters"))
    for path in paths:
        make = lambda ps, p=path: COATAdamW(ps, weight_decay=0.01, fused=p)  # noqa: E731
        rows.append(Candidate("coat", path, 16, _optimizer_step(make, torch.float32), "COATAdamW, FP32 masters"))
    return rows


def _peers() -> list[Candidate]:
    """Peer optimizers, each built lazily so a missing package only affects its row."""

    def torchao(name: str, **kwargs):
        def make(ps):
            import torchao.optim as ao

            return getattr(ao, name)(ps, lr=1e-3, weight_decay=0.01, **kwargs)

        return make

    def bnb(ps):
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(ps, lr=1e-3, weight_decay=0.01)

    def optimi(ps):
        import optimi

        return optimi.AdamW(ps, lr=1e-3, weight_decay=0.01, kahan_sum=True)

    def deepspeed(ps):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(ps, lr=1e-3, weight_decay=0.01, adamw_mode=True, fp32_optimizer_states=False)

    bf16 = torch.bfloat16
    return [
        Candidate("DeepSpeedCPUAdam BF16", "peer", 14, _optimizer_step(deepspeed, bf16), "BF16 θ, m, v"),
        Candidate("torchao AdamWFp8", "peer", 10, _optimizer_step(torchao("AdamWFp8"), bf16), "BF16 θ"),
        Candidate("torchao AdamW8bit", "peer", 10, _optimizer_step(torchao("AdamW8bit"), bf16), "BF16 θ"),
        Candidate(
            "torchao _AdamW SR",
            "peer",
            14,
            _optimizer_step(torchao("_AdamW", bf16_stochastic_round=True), bf16),
            "BF16 θ, BF16 m, v",
        ),
        Candidate("bnb AdamW8bit", "peer", 10, _optimizer_step(bnb, bf16), "BF16 θ"),
        Candidate("optimi Kahan AdamW", "peer", 18, _optimizer_step(optimi, bf16), "BF16 θ, m, v, k"),
    ]


def _median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def copy_bandwidth(repeats: int) -> float:
    """GB/s of `dst.copy_(src)` on 256 MB of FP32 (read + write), median over `repeats`."""
    src = torch.randn(64 * 1024 * 1024)
    dst = torch.empty_like(src)
    samples = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        dst.copy_(src)
        samples.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / (statistics.median(samples[1:])) / 1e9


# The clock of the timed steps: wall time by default; `--clock cpu` takes the process's CPU
# time instead (what the step itself costs, not the time spent waiting for a core on a busy
# machine; with more than one thread it adds up the threads, idle OpenMP spinning included).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


def measure(candidate: Candidate, option_d: Callable[[], None], repeats: int) -> dict:
    """Build, time the first step, then time it alternately with option D."""
    try:
        step = candidate.build()
        start = time.perf_counter()
        step()
        first = time.perf_counter() - start
        step()
    except Exception as error:  # a peer that does not run on CPU, a missing package
        return {"error": f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:70]}"}
    taken = _paths_taken(step)
    ours, theirs = [], []
    for _ in range(repeats):
        for fn, out in ((option_d, theirs), (step, ours)):
            start = clock()
            fn()
            out.append(clock() - start)
    del step
    gc.collect()
    return {"ms": _median_ms(ours), "d_ms": _median_ms(theirs), "first_s": first, "taken": taken}


def _paths_taken(step: Callable[[], None]) -> str:
    optimizer = getattr(step, "optimizer", getattr(step, "__self__", None))
    taken = dict(getattr(optimizer, "paths_taken", {}))
    return "+".join(sorted(taken)) or "?"


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per candidate (and as many of D)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads (N)")
    parser.add_argument("--only", default="", help="comma-separated substrings: run only matching families")
    parser.add_argument("--no-peers", action="store_true", help="skip the peer optimizers")
    parser.add_argument("--paths", default="native,compiled", help="paths timed besides auto's choice")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall time (default), or the process's CPU time on a busy machine",
    )
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    threads = args.threads
    torch.set_num_threads(threads)
    from hf_lowprec.optim import native

    numel = sum(torch.Size(s).numel() for s in SHAPES)
    isa = native.isa() if native.native_unavailable() is None else f"none ({native.native_unavailable()})"
    print(
        f"torch {torch.__version__}, N = {threads} threads, {os.cpu_count()} CPUs, native ISA {isa}, "
        f"{numel / 1e6:.1f}M parameters in {len(SHAPES)} tensors, medians of {args.repeats} steps alternated "
        f"with D, {args.clock} clock; load average before: {_load()}"
    )
    bandwidth = copy_bandwidth(args.repeats)
    print(f"copy bandwidth (dst.copy_(src), 256 MB FP32, read + write, {threads} threads): {bandwidth:.1f} GB/s\n")

    only = [k for k in args.only.split(",") if k]
    paths = tuple(p for p in args.paths.split(",") if p)
    candidates = _ours(("auto", *paths)) + ([] if args.no_peers else _peers())
    if only:
        candidates = [c for c in candidates if c.path == "peer" or any(k in c.name for k in only)]
        if not args.no_peers:
            wanted = {PEER_OF.get(c.name) for c in candidates if c.path != "peer"}
            candidates = [c for c in candidates if c.path != "peer" or c.name in wanted]
    option_d = _option_d()
    option_d()
    results: dict[tuple[str, str], dict] = {}
    print(f"{'optimizer':22s} {'path':9s} {'ms/step':>8s} {'D ms':>7s} {'x D':>6s} {'GB/s':>5s} {'of copy':>7s}  note")
    for candidate in candidates:
        result = measure(candidate, option_d, args.repeats)
        results[(candidate.name, candidate.path)] = result
        if "error" in result:
            print(f"{candidate.name:22s} {candidate.path:9s} not run: {result['error']}", flush=True)
            continue
        ms, d_ms = result["ms"], result["d_ms"]
        gbs = candidate.ideal_bytes * numel / (ms * 1e-3) / 1e9
        result["gbs"] = gbs
        print(
            f"{candidate.name:22s} {candidate.path + ('=' + result['taken'] if candidate.path == 'auto' else ''):9s} "
            f"{ms:8.1f} {d_ms:7.1f} {d_ms / ms:5.2f}x {gbs:5.1f} {100 * gbs / bandwidth:6.0f}%  {candidate.note}",
            flush=True,
        )

    # auto's choice again at one thread (D at one thread beside it): the threads' speed-up.
    torch.set_num_threads(1)
    single = {}
    for candidate in candidates:
        if candidate.path == "auto" and "error" not in results[(candidate.name, "auto")]:
            single[candidate.name] = measure(candidate, option_d, max(3, args.repeats // 2))
    torch.set_num_threads(threads)

    print(
        f"\nSummary, N = {threads} threads (ratio = torch fused AdamW FP32 ÷ ours, same run; > 1 is faster; "
        f"copy bandwidth {bandwidth:.1f} GB/s)\n"
    )
    print(
        "| family | auto runs | ms | × fused FP32 | goal | GB/s | % of copy | ms at 1 thread | N/1 | peer | peer ms | peer ÷ ours |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for candidate in candidates:
        if candidate.path != "auto":
            continue
        r = results[(candidate.name, "auto")]
        if "error" in r:
            print(f"| {candidate.name} | not run: {r['error']} |||||||||||")
            continue
        one = single.get(candidate.name, {})
        peer_name = PEER_OF.get(candidate.name)
        peer = results.get((peer_name, "peer"), {}) if peer_name else {}
        peer_ms = peer.get("ms")
        goal = GOALS.get(candidate.name)
        print(
            f"| {candidate.name} | {r['taken']} | {r['ms']:.1f} | {r['d_ms'] / r['ms']:.2f}× | "
            f"{'≥ ' + format(goal, '.2f') + '×' if goal else ''} | {r['gbs']:.1f} | {100 * r['gbs'] / bandwidth:.0f}% | "
            f"{_fmt(one.get('ms'))} | {_fmt(one['ms'] / r['ms'] if one.get('ms') else None, '.2f')} | "
            f"{peer_name or '—'} | {_fmt(peer_ms) if 'error' not in peer else 'not run'} | "
            f"{_fmt(peer_ms / r['ms'] if peer_ms else None, '.2f')} |"
        )
    d_gbs = 28 * numel / (statistics.median([_time(option_d) for _ in range(args.repeats)])) / 1e9
    print(
        f"\nD (torch fused AdamW, FP32): 28 B/param at {d_gbs:.1f} GB/s ({100 * d_gbs / bandwidth:.0f}% of copy). "
        f"Load average after: {_load()}."
    )


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "unavailable"


def _time(fn: Callable[[], None]) -> float:
    start = clock()
    fn()
    return clock() - start


if __name__ == "__main__":
    main()
