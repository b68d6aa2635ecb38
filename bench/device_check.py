"""The device check: what one short, offline GPU session runs (scripts/device_check.sh), in parts.

    python bench/device_check.py plan part1            # sections of a part and their budgets (seconds)
    python bench/device_check.py run SECTION --out DIR --budget S [--device cuda|cpu] [--smoke]
    python bench/device_check.py versions              # what the machine has, and which tree runs
    python bench/device_check.py bundle DIR            # (make device-bundle) the manifest, the sizes

Each section writes DIR/<section>.json and DIR/<section>.md, rewritten after every row, so a
section stopped at its budget keeps the rows it finished. Sections that need a CUDA device say
"no CUDA device" without one and write that as their status; `--device cpu --smoke` runs them
on CPU at toy sizes instead, which checks their code and measures nothing. The sections:

- `tests`: `pytest -m cuda tests/cuda`, then as much of the rest of the suite as the budget
  leaves (one outcome per test, recorded as it comes: bench/device_check_pytest.py);
- `steps`: every strategy's steady steps under `torch.cuda.set_sync_debug_mode` (2 and 8
  layers, eager and compiled), and the `_scaled_mm` calls of the FP8 strategies per step
  (bench/device_check_steps.py): writes `syncs` and `fp8_gemms`;
- `e2e`: one Llama-style model, tokens/s and peak memory per strategy and for torchao's float8
  (bench/device_check_e2e.py);
- `optim`: every strategy's optimizer step against `torch.optim.AdamW(fused=True)`;
- `fidelity`: a tiny GPT-2 trained a few hundred steps on CUDA and on CPU, losses compared.

This file imports the sections' modules; they and it share bench/device_common.py (the report
files, the CUDA check, the measured-rows loop), which imports none of them.

The tree on the device is identified by the manifest `make device-bundle` writes beside the
wheels (bundle.json: the commit, and a hash of every file that travels), since no .git
travels with it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from device_common import ROOT, SCRATCH, Report, mark_cut, utc_now, write_predictions

BUNDLE = Path(os.environ.get("DEVICE_BUNDLE", ROOT / "build" / "device-bundle"))
MANIFEST = "bundle.json"
# The device tool sends at most this much: the working tree and the carried bundle together.
TRAVEL_LIMIT = 64 << 20
# Two commands of at most six minutes each cover every section; each budget bounds one section
# (the shell script also stops a part at DEVICE_CHECK_SECONDS, whatever the budgets say).
PARTS: dict[str, list[tuple[str, int]]] = {
    "part1": [("tests", 120), ("steps", 165), ("rl", 40)],
    "part2": [("e2e", 175), ("moe", 60), ("optim", 50), ("fidelity", 45)],
}
PACKAGES = ("triton", "transformers", "accelerate", "peft", "torchao", "safetensors", "tokenizers", "numpy")
# Collected and run first in the suite section: what the issue calls the suite's core.
CORE_TESTS = ("tests/fp8", "tests/optim", "tests/strategies", "tests/gpu")


# --- what runs where -------------------------------------------------------------------------
def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _git(*args: str, root: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout


def travelling_files(root: Path = ROOT) -> list[str]:
    """What the device tool sends of the tree: tracked files and untracked ones git does not ignore."""
    listed = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard", root=root).split("\0")
    return sorted(f for f in set(listed) if f and (root / f).is_file())


def largest_untracked(root: Path = ROOT, count: int = 5) -> list[tuple[str, int]]:
    """The untracked, not ignored top-level folders (or files) that travel, largest first, in bytes."""
    untracked = _git("ls-files", "-z", "--others", "--exclude-standard", root=root).split("\0")
    sizes: dict[str, int] = {}
    for f in untracked:
        if f and (root / f).is_file():
            top = f.split("/", 1)[0] + ("/" if "/" in f else "")
            sizes[top] = sizes.get(top, 0) + (root / f).stat().st_size
    return sorted(sizes.items(), key=lambda kv: -kv[1])[:count]


def over_limit_advice(root: Path, tree: int, bundle: int) -> str:
    """Why the device tool would refuse the tree, what is heaviest, and the fix."""
    lines = [
        f"over the device tool's limit: tree {tree / 2**20:.1f} MiB + bundle {bundle / 2**20:.1f} MiB "
        f"> {TRAVEL_LIMIT >> 20} MiB, so it would refuse to send the tree.",
    ]
    heavy = largest_untracked(root)
    if heavy:
        lines.append("largest untracked paths that git does not ignore (they travel with the tree):")
        lines += [f"  {name}  {size / 2**20:.1f} MiB" for name, size in heavy]
        lines.append(
            "fix: move them out of the checkout, delete them, or add them to .gitignore "
            "(a virtual environment belongs in .venv/, which is ignored)."
        )
    else:
        lines.append("fix: the tracked files alone are too large; keep large data out of git.")
    return "\n".join(lines)


def write_manifest(bundle: Path, root: Path = ROOT) -> int:
    """bundle.json beside the wheels (commit, file hashes); prints the sizes; 1 if over the limit."""
    files = travelling_files(root)
    tree = sum((root / f).stat().st_size for f in files)
    size = sum(p.stat().st_size for p in bundle.iterdir() if p.is_file())
    if tree + size > TRAVEL_LIMIT:
        # Refused before any hashing: the manifest of a tree that cannot travel is of no use.
        print(over_limit_advice(root, tree, size), file=sys.stderr)
        return 1
    modified = [line[3:] for line in _git("status", "--porcelain", "--untracked-files=no", root=root).splitlines()]
    manifest = {
        "commit": _git("rev-parse", "HEAD", root=root).strip(),
        "modified": modified,
        "made": utc_now(),
        "wheels": {p.name: p.stat().st_size for p in sorted(bundle.glob("*.whl"))},
        "files": {f: _sha(root / f) for f in files},
    }
    (bundle / MANIFEST).write_text(json.dumps(manifest, indent=1))
    size = sum(p.stat().st_size for p in bundle.iterdir() if p.is_file())
    for name, n in manifest["wheels"].items():
        print(f"  {name}: {n / 2**20:.1f} MiB")
    print(
        f"device bundle {size / 2**20:.1f} MiB in {bundle}; tree {tree / 2**20:.1f} MiB "
        f"({len(files)} files); together {(tree + size) / 2**20:.1f} MiB of {TRAVEL_LIMIT >> 20} MiB"
    )
    print(f"commit {manifest['commit'][:10]}" + (f" with {len(modified)} files modified" if modified else ""))
    if tree + size > TRAVEL_LIMIT:
        print(over_limit_advice(root, tree, size), file=sys.stderr)
        return 1
    return 0


def tree_state(bundle: Path = BUNDLE) -> str:
    """Which tree runs: the bundle's commit, and whether the files here are the ones it hashed."""
    path = bundle / MANIFEST
    if not path.exists():
        return "unknown (no bundle manifest: make device-bundle)"
    manifest = json.loads(path.read_text())
    label = manifest["commit"][:10] + (f" + {len(manifest['modified'])} modified" if manifest["modified"] else "")
    differ = [f for f, h in manifest["files"].items() if not (ROOT / f).is_file() or _sha(ROOT / f) != h]
    if differ:
        shown = ", ".join(differ[:4]) + (f" and {len(differ) - 4} more" if len(differ) > 4 else "")
        return f"{label}, but {len(differ)} files differ from the bundle's: {shown}"
    return f"{label} (the files are the ones bundled {manifest['made']})"


def versions() -> dict[str, Any]:
    import torch

    import hf_lowprec

    found: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    found["cuda"] = torch.version.cuda or "none"
    if torch.cuda.is_available():
        found["device"] = f"{torch.cuda.get_device_name()} ×{torch.cuda.device_count()}"
        found["capability"] = "{}.{}".format(*torch.cuda.get_device_capability())
    else:
        found["device"] = "no CUDA device"
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "absent"
    where = Path(hf_lowprec.__file__).resolve().parent.parent
    found["hf_lowprec"] = f"from {'the tree' if where == ROOT else where}"
    found["tree"] = tree_state()
    found["cpus"] = os.cpu_count()
    return found


# --- sections --------------------------------------------------------------------------------
def section_tests(args: argparse.Namespace, context: dict[str, Any]) -> None:
    columns = ["phase", "passed", "failed", "errors", "skipped", "seconds", "command"]
    report = Report(args.out, "tests", "Tests on the device", columns, context)
    deadline = time.monotonic() + args.budget
    cpus = os.cpu_count() or 1
    phases = [
        # 8 workers: the tests wait on compiles and start-up, not on the GPU (the first H200 run:
        # 153 s of tests took 125 s on 4 workers).
        ("cuda", ["-m", "cuda", "tests/cuda"], min(8, cpus)),
        # The rest of the suite on this machine's CPUs (markers of multi-process and slow runs
        # left out: they would not fit), the core first.
        (
            "suite",
            ["-m", "not cuda and not slow and not multiproc and not ppo", *CORE_TESTS, "tests"],
            max(1, cpus // 2),
        ),
    ]
    import torch

    failures: list[dict[str, Any]] = []
    for phase, selection, workers in phases:
        if phase == "cuda" and args.device == "cuda" and not torch.cuda.is_available():
            report.note("no CUDA device: the tests marked cuda would all skip; not run")
            continue
        left = deadline - time.monotonic()
        if left < 20:
            report.note(f"{phase}: no time left in the budget")
            continue
        outcomes, seconds, command = run_pytest(selection, workers, left - 5, SCRATCH / f"{phase}.jsonl")
        counts = Counter(o["outcome"] for o in outcomes)
        report.add(
            {
                "phase": phase,
                "passed": counts["passed"],
                "failed": counts["failed"],
                "errors": counts["error"],
                "skipped": counts["skipped"],
                "seconds": round(seconds),
                "command": command,
            }
        )
        failures += [o for o in outcomes if o["outcome"] in ("failed", "error")]
        report.data.setdefault("outcomes", {})[phase] = outcomes
    for failure in failures:
        report.note(f"{failure['outcome']}: {failure['test']}: {failure.get('reason', '')}")
    report.finish("done" if not failures else "failures")


def run_pytest(selection: list[str], workers: int, seconds: float, log: Path) -> tuple[list[dict], float, str]:
    """pytest on `selection`, stopped after `seconds`; each outcome as recorded while it ran."""
    log.parent.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-p", "device_check_pytest", "-q", "-p", "no:cacheprovider"]
    cmd += ["--continue-on-collection-errors", *selection]
    if workers > 1:
        cmd += ["-n", str(workers), "--dist", "worksteal"]
    env = dict(os.environ, DEVICE_CHECK_PYTEST_LOG=str(log))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    start = time.monotonic()
    # Its own process group, so that stopping it stops its xdist workers too; the part's
    # `timeout` signals only this process's group, hence the handler.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)

    def stop(signum: int = signal.SIGTERM, frame: Any = None) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        if frame is not None:  # called as the handler: this process goes too
            os._exit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        stop()
        proc.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
    shown = shlex.join(["pytest", *cmd[5:]])  # without the interpreter and the recording plugin
    outcomes = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    log.unlink(missing_ok=True)
    return outcomes, time.monotonic() - start, shown


def section_steps(args: argparse.Namespace, context: dict[str, Any]) -> None:
    from device_check_steps import run_steps

    run_steps(args, context)


def section_e2e(args: argparse.Namespace, context: dict[str, Any]) -> None:
    from device_check_e2e import run_e2e

    run_e2e(args, context)


def section_moe(args: argparse.Namespace, context: dict[str, Any]) -> None:
    from device_check_moe import run_moe

    run_moe(args, context)


def section_rl(args: argparse.Namespace, context: dict[str, Any]) -> None:
    from device_check_rl import run_rl

    run_rl(args, context)


def section_optim(args: argparse.Namespace, context: dict[str, Any]) -> None:
    from device_check_steps import run_optim

    run_optim(args, context)


def section_fidelity(args: argparse.Namespace, context: dict[str, Any]) -> None:
    from device_check_steps import run_fidelity

    run_fidelity(args, context)


SECTIONS: dict[str, Callable[[argparse.Namespace, dict[str, Any]], None]] = {
    "tests": section_tests,
    "steps": section_steps,
    "e2e": section_e2e,
    "moe": section_moe,
    "rl": section_rl,
    "optim": section_optim,
    "fidelity": section_fidelity,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="the sections of a part, one 'name budget' line each")
    plan.add_argument("part", choices=[*PARTS, "all"])
    sub.add_parser("versions", help="print what runs here")
    bundle = sub.add_parser("bundle", help="write the bundle's manifest and print the sizes")
    bundle.add_argument("dir", type=Path)
    sub.add_parser("travel", help="check that the tree (without the bundle) fits what the device tool sends")
    cut = sub.add_parser("cut", help="mark a section's files as stopped by the timeout")
    cut.add_argument("section")
    cut.add_argument("--out", type=Path, required=True)
    cut.add_argument("--budget", type=float, required=True)
    run = sub.add_parser("run", help="run one section")
    run.add_argument("section", choices=SECTIONS)
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--budget", type=float, default=300.0, help="seconds this section may take")
    run.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    run.add_argument("--smoke", action="store_true", help="toy sizes: checks the section's code, measures nothing")
    worker = sub.add_parser("worker", help=argparse.SUPPRESS)
    worker.add_argument("job")
    worker.add_argument("spec")
    args = parser.parse_args(argv)
    if args.command == "plan":
        for name, budget in PARTS[args.part] if args.part != "all" else [s for p in PARTS.values() for s in p]:
            print(name, budget)
        return 0
    if args.command == "bundle":
        from device_check_e2e import ROWS as E2E_ROWS
        from device_check_moe import ROWS as MOE_ROWS

        # The ledger's predictions for the rows to be measured (docs/planning.md), written before
        # the manifest so that it lists them.
        write_predictions(
            args.dir.resolve(),
            {
                "e2e": ("llama-0.63b", True, [r for r in E2E_ROWS if not r.startswith("torchao")]),
                "moe": ("qwen3-moe-0.9b", False, [label for label, _, options in MOE_ROWS if not options]),
            },
        )
        return write_manifest(args.dir.resolve())
    if args.command == "travel":
        files = travelling_files()
        tree = sum((ROOT / f).stat().st_size for f in files)
        if tree > TRAVEL_LIMIT:
            print(over_limit_advice(ROOT, tree, 0), file=sys.stderr)
            return 1
        print(f"tree {tree / 2**20:.1f} MiB ({len(files)} files) of {TRAVEL_LIMIT >> 20} MiB")
        return 0
    if args.command == "cut":
        mark_cut(args.out, args.section, args.budget)
        return 0
    sys.path.insert(0, str(ROOT))
    sys.path.insert(1, str(ROOT / "bench"))
    if args.command == "worker":
        from device_check_steps import worker

        for result in worker(args.job, json.loads(args.spec)):
            print(json.dumps(result, default=str), flush=True)
        return 0
    context = versions()
    if args.command == "versions":
        for key, value in context.items():
            print(f"{key:>12}: {value}")
        return 0
    context["section_device"] = args.device + (" (smoke: toy sizes, nothing measured)" if args.smoke else "")
    SECTIONS[args.section](args, context)
    return 0


if __name__ == "__main__":
    sys.exit(main())
