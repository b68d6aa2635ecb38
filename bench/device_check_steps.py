"""Sections `steps`, `optim` and `fidelity` of the device check (bench/device_check.py).

`steps`, per strategy, on GPT-2 from config (`hf_lowprec.testing.counted_step`: n_embd 128, batch 4×32):

- syncs: steady steps after warm-up under `torch.cuda.set_sync_debug_mode("warn")`, each
  warning counted with the innermost frame of this repository that led to it; then one more
  steady step under "error" (the literal check: 0 allowed). At 2 and 8 layers, eager and
  compiled. Compiled is regional, as torchtitan compiles: each transformer block
  `torch.compile`d (inductor), one graph serving every block, so 8 layers cost the compile of
  2. On CPU (`--smoke`) the eager count is `hf_lowprec.testing`'s dispatcher count instead.
- FP8 GEMMs (fp8-lm-o1/o2/o3, coat): the GEMMs of one steady step, eager through a dispatch
  mode that records `aten._scaled_mm` with its operand and output dtypes and every other
  GEMM with its output dtype; compiled through the profiler's operator names. Expected:
  three `_scaled_mm` per FP8 layer and step (forward, input gradient, weight gradient).

Each strategy runs in its own process (a crash stays in its row), several at once (they
count, they do not time). `optim` and `fidelity` time and train one thing at a time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from device_common import ROOT, SCRATCH, Report, cuda_or_say

ANCHOR = "anchor: torch AMP + AdamW(fused=True)"
FP8_STRATEGIES = ("fp8-lm-o1", "fp8-lm-o2", "fp8-lm-o3", "coat")
# Measured first, so a section cut short has these rows.
HEADLINE = ("bf16-mixed", "fp8-lm-o2", "coat", "collage-plus", "fp8-lm-o1", "fp8-lm-o3")
FIDELITY_STRATEGIES = ("fp32", "bf16-mixed", "collage-plus", "fp8-lm-o2", "coat", "bf16-pure", "fp8-lm-o1", "fp16-als")
FIDELITY_STEPS = 300
_OWN = str(ROOT / "hf_lowprec")
# The step every row runs (hf_lowprec.testing) drives the package; a sync is never its own.
_SHARED_STEP = str(ROOT / "hf_lowprec" / "testing")
_HARNESS = (str(ROOT / "bench"), str(Path(warnings.__file__)))


def ordered(names: list[str]) -> list[str]:
    return [n for n in HEADLINE if n in names] + [n for n in names if n not in HEADLINE]


# --- steps: syncs and FP8 GEMMs --------------------------------------------------------------
def _origin(frames: list[traceback.FrameSummary]) -> str:
    """The innermost frame of the package, else the innermost one outside torch and this harness."""
    frames = [f for f in frames if not f.filename.startswith(_HARNESS)]
    own = [f for f in frames if f.filename.startswith(_OWN) and not f.filename.startswith(_SHARED_STEP)]
    outside = [f for f in frames if f"{os.sep}torch{os.sep}" not in f.filename]
    frame = (own or outside or frames)[-1]
    path = Path(frame.filename)
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else Path(*path.parts[-3:])
    return f"{shown}:{frame.lineno} {frame.name}"


def cuda_syncs(step: Callable[[], None], steps: int) -> dict[str, Any]:
    """Syncs per step over `steps` steady steps (warn mode), then one step in error mode."""
    import torch

    where: Counter = Counter()
    in_step = [False]

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        # Only warnings raised inside a step: switching the mode on warns once itself (torch
        # 2.11 on the H200 run: "1× torch/cuda/__init__.py set_sync_debug_mode", anchor too).
        if in_step[0] and "synchroniz" in str(message):
            where[_origin(traceback.extract_stack())] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                in_step[0] = True
                step()
                in_step[0] = False
        finally:
            in_step[0] = False
            torch.cuda.set_sync_debug_mode("default")
    raised = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    except RuntimeError as error:
        raised = f"{str(error).splitlines()[0][:120]} at {_origin(traceback.extract_tb(error.__traceback__))}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return {"per_step": sum(where.values()) / steps, "where": dict(where), "error_mode": raised}


def cpu_syncs(step: Callable[[], None]) -> dict[str, Any]:
    """One steady step counted at the dispatcher (`hf_lowprec.testing`), as the CPU suite counts."""
    from hf_lowprec.testing import DeviceTraffic

    with DeviceTraffic() as traffic:
        step()
    return {"per_step": float(len(traffic.syncs)), "where": dict(Counter(str(e) for e in traffic.syncs))}


def build(name: str, n_layer: int, device: str) -> tuple[Callable[[], None], Any]:
    """(one training step, the model) of a strategy, or of the anchor, on the CPU suite's GPT-2."""
    from hf_lowprec.testing import anchor_step, checked_strategy, gpt2, strategy_step, token_batch

    ids = token_batch(device)
    model = gpt2(n_layer).to(device)
    if name == ANCHOR:
        return anchor_step(model, ids), model
    strategy = checked_strategy(name)  # FP8-LM: every layer FP8, however small
    model = strategy.prepare_model(model)
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3, weight_decay=0.01)
    return (lambda: strategy_step(strategy, model, optimizer, ids)), model


def compile_blocks(model: Any, backend: str) -> None:
    """Each block `torch.compile`d. The model keeps its KV cache (no host sync, see
    `hf_lowprec.testing.counted_step.gpt2`), so each block guards on whether its layer of the cache is
    filled: one graph per block, and the limit on graphs per function is raised to hold them all
    (the first H200 run hit dynamo's default of 8 at 8 layers and ran the last block eagerly)."""
    import torch

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(model.transformer.h))
    for block in model.transformer.h:
        block.compile(backend=backend)


def gemm_calls(step: Callable[[], None]) -> dict[str, int]:
    """The GEMMs of one eager step, by kind and dtypes (the package's compiled helpers run as
    their eager source meanwhile: dynamo does not run under a dispatch mode)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    others = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
    calls: Counter = Counter()

    def short(dtype: torch.dtype) -> str:
        return str(dtype).removeprefix("torch.").replace("float8_", "")

    class Gemms(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if func.overloadpacket is aten._scaled_mm:
                calls[f"_scaled_mm {short(args[0].dtype)}×{short(args[1].dtype)}→{short(result.dtype)}"] += 1
            elif func.overloadpacket in others:
                calls[f"{func.overloadpacket.__name__}→{short(result.dtype)}"] += 1
            return result

    with torch.compiler.set_stance("force_eager"), Gemms():
        step()
    return dict(calls)


def profiled_gemms(step: Callable[[], None]) -> dict[str, int]:
    """The GEMM operators one (compiled) step dispatches, by name, from the profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    names = {"aten::_scaled_mm", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return dict(Counter(e.name.removeprefix("aten::") for e in prof.events() if e.name in names))


def steps_worker(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Syncs (and FP8 GEMMs) of one strategy: one row."""
    import torch

    from hf_lowprec.fp8 import FP8Linear

    name, device, smoke = spec["strategy"], spec["device"], spec["smoke"]
    row: dict[str, Any] = {"strategy": name, "syncs": {}, "errors": {}}
    for compiled in (False, True):
        for n_layer in (2,) if smoke else (2, 8):
            key = f"{'compiled' if compiled else 'eager'} {n_layer}L"
            try:
                step, model = build(name, n_layer, device)
                if compiled:
                    compile_blocks(model, "eager" if smoke else "inductor")
                for _ in range(3 if compiled else 2):
                    step()
                if device == "cuda":
                    row["syncs"][key] = cuda_syncs(step, 1 if smoke else 2)
                elif not compiled:
                    row["syncs"][key] = cpu_syncs(step)
                if name in FP8_STRATEGIES and n_layer == 2:
                    gemms = row.setdefault(
                        "gemms", {"fp8_layers": sum(isinstance(m, FP8Linear) for m in model.modules())}
                    )
                    gemms["compiled" if compiled else "eager"] = profiled_gemms(step) if compiled else gemm_calls(step)
            except Exception as error:  # a strategy that fails here is a finding: its row says how
                row["errors"][key] = f"{type(error).__name__}: {str(error)[:300]}"
                traceback.print_exc()
            if device == "cuda":
                torch.cuda.empty_cache()
    yield row


def start_worker(job: str, spec: dict[str, Any], out: Path, compile_threads: int | None = None) -> subprocess.Popen:
    """`device_check.py worker JOB SPEC` in its own process, its JSON lines into `out`."""
    cmd = [sys.executable, str(ROOT / "bench" / "device_check.py"), "worker", job, json.dumps(spec)]
    env = dict(os.environ)
    if compile_threads:  # workers side by side share the CPUs Inductor compiles with
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(compile_threads)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as lines:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=lines, text=True, env=env)


def worker_lines(out: Path) -> list[dict[str, Any]]:
    text = out.read_text() if out.exists() else ""
    out.unlink(missing_ok=True)
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def run_pool(jobs: list[tuple[str, dict[str, Any]]], parallel: int, deadline: float) -> Iterator[dict[str, Any]]:
    """Worker processes, `parallel` at a time, until `deadline`: every JSON line they print,
    and {"unfinished": spec, "why": ...} for each that did not finish."""
    waiting, running = list(enumerate(jobs)), []
    while waiting or running:
        while waiting and len(running) < parallel and time.monotonic() < deadline:
            index, (job, spec) = waiting.pop(0)
            out = SCRATCH / f"worker-{index}.jsonl"
            running.append((spec, out, start_worker(job, spec, out, max(1, (os.cpu_count() or 1) // parallel))))
        if time.monotonic() >= deadline:
            for spec, out, proc in running:
                proc.kill()
                proc.wait()
                yield from worker_lines(out) or [{"unfinished": spec, "why": "stopped at the section's budget"}]
            yield from ({"unfinished": spec, "why": "not started: budget spent"} for _, (_, spec) in waiting)
            return
        for entry in list(running):
            spec, out, proc = entry
            if proc.poll() is None:
                continue
            running.remove(entry)
            yield from worker_lines(out) or [{"unfinished": spec, "why": f"worker exited {proc.returncode}, no result"}]
        time.sleep(0.2)


def _sync_cell(result: dict[str, Any] | None) -> str:
    if result is None:
        return "-"
    return f"{result['per_step']:g}" + (" (error mode raised)" if result.get("error_mode") else "")


def run_steps(args: argparse.Namespace, context: dict[str, Any]) -> None:
    import hf_lowprec

    layers = (2,) if args.smoke else (2, 8)
    keys = [f"{kind} {n}L" for kind in ("eager", "compiled") for n in layers]
    syncs = Report(
        args.out,
        "syncs",
        "Host syncs per steady step on the device (goal 0)",
        ["strategy", *keys, "verdict", "where"],
        context,
    )
    gemms = Report(
        args.out,
        "fp8_gemms",
        "FP8 GEMMs per step: is FP8 really FP8",
        ["strategy", "FP8 layers", "expected _scaled_mm", "eager", "compiled", "verdict"],
        context,
    )
    ready = [cuda_or_say(args, report) for report in (syncs, gemms)]  # both reports say it
    if not all(ready):
        return
    deadline = time.monotonic() + args.budget - 5
    names = ["bf16-mixed", "fp8-lm-o2"] if args.smoke else [ANCHOR, *ordered(hf_lowprec.available_strategies())]
    jobs = [("steps", {"strategy": n, "device": args.device, "smoke": args.smoke}) for n in names]
    parallel = max(1, min(6, (os.cpu_count() or 1) // 2)) if args.device == "cuda" else 1
    syncs.note(
        f"{len(names)} rows, {parallel} processes at once; compiled: each GPT-2 block torch.compile'd "
        f"({'eager backend (smoke)' if args.smoke else 'inductor'}); CPU rows count dispatcher syncs, eager only"
    )
    for row in run_pool(jobs, parallel, deadline):
        if "unfinished" in row:
            syncs.add({"strategy": row["unfinished"]["strategy"], "verdict": row["why"]})
            continue
        counts = [row["syncs"].get(k) for k in keys]
        measured = [c for c in counts if c is not None]
        clean = bool(measured) and all(c["per_step"] == 0 and not c.get("error_mode") for c in measured)
        where = Counter()
        for c in counts:
            where.update((c or {}).get("where", {}))
        shown = "; ".join(f"{n}× {w}" for w, n in where.most_common(3))
        errors = "; ".join(f"{k}: {e}" for k, e in row["errors"].items())
        verdict = "errors" if errors else "0 in every count" if clean else "SYNCS" if measured else "nothing counted"
        syncs.add(
            {"strategy": row["strategy"], **{k: _sync_cell(c) for k, c in zip(keys, counts)}, "verdict": verdict}
            | {"where": "; ".join(filter(None, [shown, errors])), "raw": row}
        )
        if "gemms" in row:
            gemms.add(gemm_row(row["strategy"], row["gemms"]))
    syncs.finish()
    gemms.finish()


def gemm_row(name: str, found: dict[str, Any]) -> dict[str, Any]:
    expected = 3 * found["fp8_layers"]
    eager, compiled = found.get("eager", {}), found.get("compiled", {})
    eager_fp8 = sum(n for k, n in eager.items() if k.startswith("_scaled_mm"))
    compiled_fp8 = compiled.get("_scaled_mm", 0)
    fp8_path = eager_fp8 == expected and (not compiled or compiled_fp8 == expected)
    return {
        "strategy": name,
        "FP8 layers": found["fp8_layers"],
        "expected _scaled_mm": expected,
        "eager": ", ".join(f"{n}× {k}" for k, n in sorted(eager.items())) or "-",
        "compiled": ", ".join(f"{n}× {k}" for k, n in sorted(compiled.items())) or "-",
        "verdict": "every FP8 layer's GEMMs are _scaled_mm" if fp8_path else "NOT all FP8",
        "raw": found,
    }


# --- optim: each strategy's optimizer step against torch's fused AdamW -------------------------
def run_optim(args: argparse.Namespace, context: dict[str, Any]) -> None:
    import torch
    from gpu_check import optimizer_times

    import hf_lowprec
    from hf_lowprec.optim.dispatch import combo_rows

    report = Report(
        args.out,
        "optim",
        "Optimizer step vs torch.optim.AdamW(fused=True), FP32 (goal: time ratio ≤ 1.0)",
        ["strategy", "ms", "time / AdamW", "goal"],
        context,
    )
    if not cuda_or_say(args, report):
        return
    numel = 1 << 20 if args.smoke else 200 << 20
    device = torch.device(args.device)
    names = ordered(hf_lowprec.available_strategies())

    def add(base: float, name: str, t: float | str) -> None:
        # Each row written as it is measured: a section stopped at its budget keeps them (the first
        # H200 run lost every row, as they were written only at the end).
        if not report.data["notes"]:
            report.note(
                f"{numel / 1e6:.0f}M parameters in 8 Linear layers; torch AdamW(fused=True): {base * 1e3:.2f} ms"
            )
        if isinstance(t, str):
            report.add({"strategy": name, "ms": t})
            return
        report.add(
            {"strategy": name, "ms": round(t * 1e3, 3), "time / AdamW": round(t / base, 3)}
            | {"goal": "met" if t <= base else "missed"}
        )

    deadline = time.monotonic() + args.budget - 5
    # After the two headline rows, bf16-mixed again with combo kernels over each chunk's rows (one
    # launch per chunk where the default has one per row): which of the two is faster on the GPU
    # decides the default (`optim.dispatch.combo_rows`; docs/gpu.md).
    optimizer_times(device, numel, deadline, names[:2], on_row=add)
    with combo_rows():
        optimizer_times(
            device, numel, deadline, ["bf16-mixed"], on_row=lambda b, n, t: add(b, f"{n}, combo kernels", t)
        )
    optimizer_times(device, numel, deadline, names[2:], on_row=add)
    report.finish()


# --- fidelity: the same training on CUDA and on CPU ----------------------------------------------
def fidelity_run(name: str, device: str, steps: int) -> dict[str, Any]:
    """Tiny GPT-2 on the embedded corpus, `steps` steps of batch 8×64 from one seed; the losses."""
    import torch
    from transformers import GPT2LMHeadModel

    from hf_lowprec.data import build_tokenizer, clm_datasets, tiny_gpt2_config
    from hf_lowprec.testing import checked_strategy

    tokenizer = build_tokenizer()
    train, held_out = clm_datasets(tokenizer, block_size=64)
    order = torch.randint(len(train), (steps, 8), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    config = tiny_gpt2_config(len(tokenizer), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    # On CPU the eager reference step: the native and compiled CPU steps give its bits, and it
    # builds nothing first (a native build would take the CPU half's whole budget).
    strategy = checked_strategy(name, **({"fused": "reference"} if device == "cpu" else {}))
    model = strategy.prepare_model(GPT2LMHeadModel(config).to(device))
    optimizer = strategy.create_optimizer(model.parameters(), lr=2e-3, weight_decay=0.01)
    warmup = max(1, steps // 20)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    losses = torch.empty(steps, device=device)
    start = time.perf_counter()
    for i in range(steps):
        ids = torch.stack([train[j]["input_ids"] for j in order[i].tolist()]).to(device)
        losses[i] = strategy.train_step(model, ids, optimizer)
        scheduler.step()
    model.eval()
    with torch.no_grad(), strategy.forward_context():
        blocks = torch.stack([held_out[j]["input_ids"] for j in range(min(32, len(held_out)))]).to(device)
        eval_loss = torch.stack([model(input_ids=b, labels=b).loss for b in blocks.split(8)]).float().mean()
    return {
        "strategy": name,
        "device": device,
        "losses": losses.tolist(),
        "eval_loss": eval_loss.item(),
        "skipped": strategy.skipped_steps,
        "seconds": time.perf_counter() - start,
    }


def fidelity_worker(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    import torch

    torch.set_num_threads(spec["threads"])
    for name in spec["strategies"]:
        try:
            result = fidelity_run(name, spec["device"], spec["steps"])
        except Exception as error:
            traceback.print_exc()
            result = {"strategy": name, "device": spec["device"], "error": f"{type(error).__name__}: {error}"}
        yield result


def compare(cpu: dict[str, Any], cuda: dict[str, Any]) -> dict[str, Any]:
    a, b = cpu["losses"], cuda["losses"]
    tail = max(1, len(a) // 6)
    final_cpu, final_cuda = sum(a[-tail:]) / tail, sum(b[-tail:]) / tail
    relative = abs(cuda["eval_loss"] - cpu["eval_loss"]) / cpu["eval_loss"]
    return {
        "strategy": cpu["strategy"],
        "first loss CPU / CUDA": f"{a[0]:.4f} / {b[0]:.4f}",
        "mean abs Δ, first 20 steps": round(sum(abs(x - y) for x, y in zip(a[:20], b[:20])) / min(20, len(a)), 5),
        f"train loss, last {tail} (CPU / CUDA)": f"{final_cpu:.4f} / {final_cuda:.4f}",
        "eval loss CPU / CUDA": f"{cpu['eval_loss']:.4f} / {cuda['eval_loss']:.4f}",
        "eval Δ / CPU": round(relative, 4),
        "skipped CPU / CUDA": f"{cpu['skipped']} / {cuda['skipped']}",
        "verdict": "agree" if relative <= 0.02 else "LOOK: differ by more than 2%",
    }


def run_fidelity(args: argparse.Namespace, context: dict[str, Any]) -> None:
    steps = 5 if args.smoke else FIDELITY_STEPS
    tail = max(1, steps // 6)
    columns = [
        "strategy",
        "first loss CPU / CUDA",
        "mean abs Δ, first 20 steps",
        f"train loss, last {tail} (CPU / CUDA)",
    ]
    columns += ["eval loss CPU / CUDA", "eval Δ / CPU", "skipped CPU / CUDA", "verdict"]
    report = Report(args.out, "fidelity", f"Fidelity: tiny GPT-2, {steps} steps, CUDA against CPU", columns, context)
    if not cuda_or_say(args, report):
        return
    deadline = time.monotonic() + args.budget - 5
    names = list(FIDELITY_STRATEGIES[:2] if args.smoke else FIDELITY_STRATEGIES)
    report.note(
        "same initial weights, batches and learning-rate schedule (2e-3, warm-up then cosine) on both "
        "devices, dropout off: the runs differ only by the devices' arithmetic. 'agree': eval losses within "
        "2% (the fp32 row shows how far reduction order alone moves them)."
    )
    threads = max(1, min(8, (os.cpu_count() or 2) // 2))
    spec = {"strategies": names, "device": "cpu", "steps": steps, "threads": threads}
    cpu_out = SCRATCH / "fidelity-cpu.jsonl"
    cpu_side = start_worker("fidelity", spec, cpu_out)  # the CPU half runs beside the device half
    on_device = {}
    for name in names:
        if time.monotonic() >= deadline:
            break
        try:
            on_device[name] = fidelity_run(name, args.device, steps)
        except Exception as error:
            traceback.print_exc()
            report.add({"strategy": name, "verdict": f"error on {args.device}: {type(error).__name__}: {error}"})
    try:
        cpu_side.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        cpu_side.kill()
        cpu_side.wait()
        report.note("the CPU half stopped at the budget: rows only for the strategies it finished")
    for cpu in worker_lines(cpu_out):
        device = on_device.get(cpu["strategy"])
        if "error" in cpu:
            report.add({"strategy": cpu["strategy"], "verdict": f"error on CPU: {cpu['error']}"})
        elif device is not None:
            report.add(compare(cpu, device) | {"raw": {"cpu": cpu, "device": device}})
    report.finish()


WORKERS = {"steps": steps_worker, "fidelity": fidelity_worker}


def worker(job: str, spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    return WORKERS[job](spec)
