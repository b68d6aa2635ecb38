"""What every section of the device check shares (bench/device_check.py runs them): where the
tree is, the scratch folder, a section's report, the CUDA check and the measured-rows loop.

The sections (bench/device_check_steps.py, _e2e, _moe, _rl) import this module and none of
each other's entry point, so that the device check's modules import in one direction only:
device_check.py → the sections → this module.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Files a section reads back before writing its report (kept out of $OUT, whose files come back).
SCRATCH = Path(tempfile.gettempdir()) / f"hf_lowprec-device-check-{os.getpid()}"


# --- results -------------------------------------------------------------------------------
class Report:
    """One section's results as DIR/<name>.json and DIR/<name>.md, rewritten after every change."""

    def __init__(self, out: Path, name: str, title: str, columns: list[str], context: dict[str, Any]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.paths = out / f"{name}.json", out / f"{name}.md"
        self.columns = columns
        self.data: dict[str, Any] = {
            "section": name,
            "title": title,
            "status": "running",
            "started": utc_now(),
            "finished": None,
            "context": context,
            "notes": [],
            "columns": columns,
            "rows": [],
        }
        self._write()

    def add(self, row: dict[str, Any]) -> None:
        self.data["rows"].append(row)
        self._write()

    def note(self, text: str) -> None:
        print(text, flush=True)
        self.data["notes"].append(text)
        self._write()

    def finish(self, status: str = "done") -> None:
        self.data["status"], self.data["finished"] = status, utc_now()
        self._write()

    def markdown(self) -> str:
        context = self.data["context"]
        lines = [
            f"## {self.data['title']}",
            "",
            f"{context.get('device', '?')}; section on {context.get('section_device', '?')}; torch {context.get('torch', '?')}; "
            f"tree {context.get('tree', '?')}; "
            f"{self.data['started']} – {self.data['finished'] or 'not finished'}; status: {self.data['status']}",
            "",
        ]
        lines += [f"- {n}" for n in self.data["notes"]]
        if self.columns and self.data["rows"]:
            lines += ["", "| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
            lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in self.columns) + " |" for r in self.data["rows"]]
        return "\n".join(lines) + "\n"

    def _write(self) -> None:
        # Replace, never truncate: a section killed while writing keeps its previous file.
        for path, text in zip(self.paths, (json.dumps(self.data, indent=1, default=str), self.markdown())):
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, path)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value).replace("|", "/").replace("\n", " ")


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def mark_cut(out: Path, name: str, budget: float) -> None:
    """A section the shell's `timeout` stopped: say so in its files (their rows stay)."""
    path = out / f"{name}.json"
    data = json.loads(path.read_text()) if path.exists() else {"section": name, "title": name, "rows": []}
    if data.get("status") == "running" or not path.exists():
        report = Report.__new__(Report)
        report.paths, report.columns = (path, out / f"{name}.md"), data.get("columns", [])
        report.data = {"context": {}, "notes": [], "started": "?", **data}
        report.data["notes"].append(
            f"stopped by the part's timeout after {budget:.0f} s: the rows above are all it ran"
        )
        report.finish("cut short")


# --- what the sections share ---------------------------------------------------------------
PREDICTIONS = "predictions.json"


def write_predictions(bundle: Path, sections: dict[str, tuple[str, bool, list[str]]]) -> None:
    """`predictions.json` in the bundle: for each section (model, compiled layers, rows), the step
    ms the step ledger predicts per row on an H100 and an H200 (`hf_lowprec.planning`), counted
    here, where CPU time costs no device time. Rows the ledger cannot count are left out."""
    from hf_lowprec.planning.counting import count_scaled
    from hf_lowprec.planning.gpus import GPUS
    from hf_lowprec.planning.models import quiet, rule_options
    from hf_lowprec.planning.roofline import predict

    found: dict[str, dict[str, dict[str, float]]] = {}
    for section, (model, compiled, rows) in sections.items():
        for row in rows:
            counts: dict[str, object] = {}
            for gpu in ("h100", "h200"):
                # FP8-LM keeps in BF16 what FP8 would not speed up on the GPU it runs on: counted
                # per GPU; another strategy's step is the same on both.
                key = gpu if rule_options(row, GPUS[gpu]) else ""
                try:  # the device check's steps do not clip
                    if key not in counts:
                        with quiet():
                            counts[key] = count_scaled(
                                row, model, (4, 2048), compiled_layers=compiled, clip=None, gpu=GPUS[gpu]
                            )
                except Exception as error:  # a row the ledger cannot count has no prediction
                    print(f"predictions: {section} {row}: {type(error).__name__}", file=sys.stderr)
                    break
                found.setdefault(section, {}).setdefault(gpu, {})[row] = round(
                    predict(counts[key], GPUS[gpu]).step * 1e3, 1
                )
    (bundle / PREDICTIONS).write_text(json.dumps(found, indent=1))


def predicted_ms(section: str, row: str) -> float | None:
    """The ledger's predicted step ms of `row` on this GPU (an H100 or an H200), from the bundle."""
    import torch

    bundle = Path(os.environ.get("DEVICE_BUNDLE", Path(__file__).resolve().parents[1] / "build" / "device-bundle"))
    path = bundle / PREDICTIONS
    if not path.exists() or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name().lower()
    gpu = "h200" if "h200" in name else "h100" if "h100" in name else None
    return json.loads(path.read_text()).get(section, {}).get(gpu or "", {}).get(row)


def prediction_check(predicted: float | None, measured: float) -> str:
    """How far the ledger's prediction is from the measured step (docs/planning.md, "Calibration"):
    its signed error, and past 20% the words that say the table is what changes."""
    if predicted is None or not measured > 0:
        return ""
    off = predicted / measured - 1
    if abs(off) <= 0.2:
        return f"{off:+.0%}"
    return f"{off:+.0%}: more than 20% off, the table (hf_lowprec.planning.gpus) changes"


def profiled_step(step: Callable[[], Any]) -> dict[str, Any]:
    """One more step under `torch.profiler`: kernels launched, device busy ms (the kernels' time
    summed), host ms (the step's wall time), and the five kernels that took longest. A profiler
    that fails gives its error, not the row's: the measured figures stay."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        sync()
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            step()
            sync()
        wall = time.perf_counter() - start
        kernels: dict[str, float] = {}
        launches = 0
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels[event.name] = kernels.get(event.name, 0.0) + event.device_time_total / 1e3
            elif event.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"):
                launches += 1
    except Exception as error:  # the profiler's failure is a finding of its own
        return {"profile": f"error: {type(error).__name__}: {str(error)[:200]}"}
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:5]
    return {
        "launches": launches,
        "device busy ms": round(sum(kernels.values()), 2),
        "profiled step ms": round(wall * 1e3, 2),
        "top kernels": "; ".join(f"{name[:60]} {ms:.2f} ms" for name, ms in top),
    }


def cuda_or_say(args: argparse.Namespace, report: Report) -> bool:
    """True if the section can run on `args.device`; else notes "no CUDA device" and finishes."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        report.note("no CUDA device: nothing run (torch.cuda.is_available() is False)")
        report.finish("no CUDA device")
        return False
    return True


def measured_rows(
    report: Report,
    rows: Any,
    measure: Callable[..., dict[str, Any]],
    args: argparse.Namespace,
    *,
    reserve: float,
    column: str = "note",
) -> Iterator[tuple[str, dict[str, Any]]]:
    """(label, result) for each row `(label, *spec)` of `rows`, `measure(label, *spec, args)` run in
    turn within the section's budget. A row started less than `reserve` seconds before the budget
    ends, or one that raises, is written to `report` with its reason in `column` instead (a row
    that fails is a finding). Memory and compiled graphs are freed after each row."""
    import torch

    deadline = time.monotonic() + args.budget - 5
    for label, *spec in rows:
        if time.monotonic() >= deadline - reserve:
            report.add({"row": label, column: "not run: time budget spent"})
            continue
        try:
            result = measure(label, *spec, args)
        except Exception as error:
            traceback.print_exc()
            report.add({"row": label, column: f"error: {type(error).__name__}: {str(error)[:300]}"})
            continue
        finally:
            gc.collect()
            torch._dynamo.reset()
            if args.device == "cuda":
                with contextlib.suppress(RuntimeError):
                    torch.cuda.empty_cache()
        yield label, result
