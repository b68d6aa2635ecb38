"""`make gpu-check`: every test marked `cuda`, then a short GPU bench, on one screen.

    python bench/gpu_check.py                  # what `make gpu-check` runs
    python bench/gpu_check.py --device cpu --smoke --no-tests   # exercise the bench code on CPU

Without a CUDA device it says so and exits 0 having run nothing. With one, it runs
`pytest -m cuda` (exit status non-zero if any test fails), then prints, all as ratios against
a peer measured in the same run:
  - the optimizer step of every strategy against `torch.optim.AdamW(fused=True)` (FP32, option D);
  - an FP8 GEMM (the device's FP8 path, hf_lowprec.fp8) against a BF16 GEMM at 4096³;
  - GPT-2 small (124M, from config) training step time and `torch.cuda.max_memory_allocated`
    per strategy against bf16-mixed.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import hf_lowprec  # noqa: E402
from hf_lowprec.fp8 import fp8_gemm_path  # noqa: E402

E2E_STRATEGIES = ("bf16-mixed", "collage-plus", "fp8-lm-o1", "fp8-lm-o2")
TIME_BUDGET_S = 480  # the bench part; the tests come before it (whole command within ten minutes)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn, device: torch.device, warmup: int, reps: int) -> float:
    """Median wall time of fn() in seconds, after `warmup` calls (compilation, autotuning)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_tests() -> int:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "cuda",
        "-q",
        "--no-header",
        "--tb=line",
        "-p",
        "no:cacheprovider",
        "tests",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.strip() and not set(line) <= set(".sxF ")]
    print("\n".join(lines[-12:]))  # failures (one line each) and the summary
    return proc.returncode


def optimizer_times(
    device: torch.device,
    numel: int,
    deadline: float,
    names: list[str] | None = None,
    on_row: Callable[[float, str, float | str], None] | None = None,
) -> tuple[float, dict[str, float | str]]:
    """Median step seconds of torch's AdamW (fused where the device has it) and of each strategy's
    optimizer (`names`, default all) on the same layers (8 Linear layers of `numel` parameters in
    all); a strategy that cannot run here, or that the deadline stopped, gets the reason instead.
    `on_row(base, name, time)` hears each row as it is measured (a caller stopped at its budget
    keeps the rows before)."""
    rows = 8
    cols = numel // rows // 1024 * 1024 // 1024  # square-ish Linear layers, multiples of 16

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(1024, cols, bias=False) for _ in range(rows)]).to(device)

    def stepper(module: torch.nn.Module, optimizer: torch.optim.Optimizer, strategy=None):
        params = [p for p in module.parameters() if p.requires_grad]
        grads = [torch.randn_like(p, dtype=torch.float32).mul_(1e-3).to(p.dtype) for p in params]
        one = torch.ones((), device=device)

        def step() -> None:
            for p, g in zip(params, grads):
                p.grad = g.clone()
            if strategy is not None:
                strategy.scale_loss(one)  # loss-scaling strategies expect a scaled loss each step
            optimizer.step()

        return step

    reference = model()
    fused = device.type == "cuda"
    base = median_time(
        stepper(reference, torch.optim.AdamW(reference.parameters(), lr=1e-4, fused=fused)), device, 2, 5
    )
    del reference
    times: dict[str, float | str] = {}
    for name in names or hf_lowprec.available_strategies():
        if time.monotonic() > deadline:
            times[name] = "not run: time budget spent"
            continue
        try:
            strategy = hf_lowprec.get_strategy(name)
            module = strategy.prepare_model(model())
            optimizer = strategy.create_optimizer(module.parameters(), lr=1e-4)
            times[name] = median_time(stepper(module, optimizer, strategy), device, 3, 5)
        except Exception as exc:  # a strategy that cannot run here is reported, not fatal
            times[name] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
        if on_row is not None:
            on_row(base, name, times[name])
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return base, times


def bench_optimizers(device: torch.device, numel: int, deadline: float) -> list[str]:
    base, times = optimizer_times(device, numel, deadline)
    rows = [f"{name} {t / base:.2f}" if isinstance(t, float) else f"{name} ({t})" for name, t in times.items()]
    fused = device.type == "cuda"
    return [
        f"optimizer step, {numel / 1e6:.0f}M params: torch AdamW(fused={fused}) {base * 1e3:.1f} ms = 1.00",
        "  time / AdamW: " + ", ".join(rows),
    ]


def bench_gemm(device: torch.device, size: int) -> list[str]:
    from hf_lowprec.fp8.gemm import fp8_mm
    from hf_lowprec.fp8.linear import quantize_tensorwise

    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=g)
    b = torch.randn(size, size, device=device, generator=g)
    a8, sa = quantize_tensorwise(a, torch.float8_e4m3fn, 0)
    b8, sb = quantize_tensorwise(b, torch.float8_e4m3fn, 0)
    ab, bb = a.bfloat16(), b.bfloat16()
    bf16 = median_time(lambda: torch.mm(ab, bb), device, 3, 10)
    fp8 = median_time(lambda: fp8_mm(a8, sa, b8, sb, torch.bfloat16), device, 3, 10)
    tflops = 2 * size**3 / fp8 / 1e12
    return [
        f"GEMM {size}³: BF16 {bf16 * 1e3:.2f} ms; FP8 ({fp8_gemm_path(device)}) {fp8 * 1e3:.2f} ms "
        f"= {fp8 / bf16:.2f}x BF16 time ({tflops:.0f} TFLOP/s)"
    ]


def bench_e2e(device: torch.device, smoke: bool, deadline: float) -> list[str]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=128, n_head=2, vocab_size=512, n_positions=64) if smoke else GPT2Config()
    batch, seq = (2, 64) if smoke else (8, 512)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    results = {}
    for name in E2E_STRATEGIES:
        if time.monotonic() > deadline:
            results[name] = None
            continue
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        torch.manual_seed(0)
        strategy = hf_lowprec.get_strategy(name)
        model = strategy.prepare_model(GPT2LMHeadModel(config).to(device))
        optimizer = strategy.create_optimizer(model.parameters(), lr=1e-4, weight_decay=0.01)
        losses = []

        def step(strategy=strategy, model=model, optimizer=optimizer, losses=losses) -> None:
            with strategy.forward_context():
                loss = model(input_ids=ids, labels=ids).loss
            strategy.scale_loss(loss).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())

        t = median_time(step, device, 2, 3 if smoke else 5)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else float("nan")
        results[name] = (t, peak, losses[-1].item())
        del model, optimizer, strategy
    base = results[E2E_STRATEGIES[0]]
    out = [
        f"GPT-2 {'smoke' if smoke else '124M'} step, batch {batch}x{seq}: {E2E_STRATEGIES[0]} "
        f"{base[0] * 1e3:.0f} ms, peak {base[1] / 2**20:.0f} MiB = 1.00"
    ]
    cells = []
    for name in E2E_STRATEGIES[1:]:
        r = results[name]
        cells.append(f"{name} (time)" if r is None else f"{name} time {r[0] / base[0]:.2f} mem {r[1] / base[1]:.2f}")
    out.append("  vs bf16-mixed: " + "; ".join(cells))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (checks the bench code, measures nothing)")
    parser.add_argument("--no-tests", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA GPU visible (torch {torch.__version__}, torch.cuda.is_available() is False): "
            "nothing run."
        )
        return 0
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        print(
            f"gpu-check: {torch.cuda.get_device_name(device)} (sm_{cap[0]}{cap[1]}, {torch.cuda.device_count()} GPU), "
            f"torch {torch.__version__}, FP8 GEMM path: {fp8_gemm_path(device)}"
        )
    status = 0
    if not args.no_tests:
        status = run_tests()
        print(f"tests marked cuda: {'ok' if status == 0 else f'FAILED (pytest exit {status})'}")
    deadline = time.monotonic() + TIME_BUDGET_S
    numel = 1 << 20 if args.smoke else 50 << 20
    for section in (
        lambda: bench_optimizers(device, numel, deadline),
        lambda: bench_gemm(device, 256 if args.smoke else 4096),
        lambda: bench_e2e(device, args.smoke, deadline),
    ):
        print("\n".join(section()))
    return status


if __name__ == "__main__":
    sys.exit(main())
