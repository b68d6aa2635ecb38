"""Train one recipe under several strategies and seeds on the same data; tabulate and plot.

`hf-lowprec compare` (docs/recipes.md): the default recipe ships inside the package
(`TRAINING_RECIPES`), so it works from an installed wheel in any directory; `--recipe` may also be
the path of a recipe script of a source checkout (`SCRIPT_METRICS`). Each run is a child process,
so what is compared is exactly what a user runs, and each run's peak RSS is its own.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from .recipe_arguments import (
    SCRIPT_METRICS,
    TRAINING_RECIPES,
    check_recipe_arguments,
    recipe_argv,
    resolve_recipe,
)

__all__ = [
    "TRAINING_RECIPES",
    "SCRIPT_METRICS",
    "check_recipe_arguments",
    "resolve_recipe",
    "run_compare",
    "plot",
    "summary_table",
]

logger = logging.getLogger(__name__)

# Logged keys that are curves of their own, beyond the loss.
_LOST = ("precision/imprecision_pct", "precision/edq_ratio")
_SCALES = ("precision/loss_scale", "precision/fp8_grad_mu")


def _run_one(
    command: list[str],
    cwd: Path | None,
    strategy: str,
    seed: int,
    out: Path,
    max_steps: int,
    metrics: bool,
    extra: list[str],
) -> dict[str, Any]:
    run_dir = (out / "runs" / f"{strategy}-seed{seed}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [*command, *recipe_argv(strategy, seed, run_dir, max_steps, metrics, extra)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    start = time.perf_counter()
    with open(run_dir / "stdout.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(cwd or run_dir))
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = (run_dir / "stdout.log").read_text().splitlines()[-15:]
        what = " ".join(command[1:])
        raise RuntimeError(
            f"{what} with {strategy!r} (seed {seed}) failed with exit code {proc.returncode}; "
            f"last lines of {run_dir / 'stdout.log'}:\n" + "\n".join(tail)
        )
    result = json.loads((run_dir / "recipe_result.json").read_text())
    history = json.loads((run_dir / "log_history.json").read_text())
    return {"result": result, "history": history, "peak_rss_mib": usage.ru_maxrss / 1024, "wall_s": wall}


def run_compare(
    recipe: str,
    strategies: list[str],
    *,
    seeds: list[int],
    max_steps: int,
    out: str | Path,
    metrics: bool = True,
    extra_args: list[str] | None = None,
    progress: bool = True,
    predict_gpu: bool = True,
) -> list[dict[str, Any]]:
    """Run `recipe` for every strategy × seed, write the CSVs and plots to `out`; the summary rows.

    With `predict_gpu`, each row also carries `gpu_step_ms`: the step `hf-lowprec plan` predicts on
    an H100 for GPT-2 small (`planning.plan.GPU_PREVIEW`, the main job's architecture at GPU
    size, whatever the recipe), since FP8 on a CPU is emulated and a CPU step says nothing of a
    GPU's.

    - `results.csv`: one row per logged step per strategy and seed (loss, learning rate, every
      `precision/...` metric logged at that step);
    - `summary.csv`: one row per run (eval metric, final loss, median step time, model-state
      bytes/param, peak RSS read from the child's resource usage, skipped steps);
    - the PNG plots (`plot`).
    """
    from .strategies.registry import strategy_class

    command, cwd, metric = resolve_recipe(recipe)
    for name in strategies:
        strategy_class(name)  # unknown names fail before any run
    if not strategies or not seeds:
        raise ValueError("give at least one strategy and one seed")
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    check_recipe_arguments(strategies, list(extra_args or []), metrics, recipe)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("results.csv", "summary.csv"):  # an earlier compare's, which a failed run would leave beside
        (out / stale).unlink(missing_ok=True)

    from tqdm.auto import tqdm

    runs = [(s, seed) for s in strategies for seed in seeds]
    step_rows: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    bar = tqdm(runs, desc=f"compare {Path(recipe).stem}", unit="run", disable=not progress)
    for strategy, seed in bar:
        bar.set_postfix_str(f"{strategy} seed {seed}")
        run = _run_one(command, cwd, strategy, seed, out, max_steps, metrics, list(extra_args or []))
        for entry in run["history"]:
            if "loss" in entry and "step" in entry:
                row = {
                    "strategy": strategy,
                    "seed": seed,
                    "step": entry["step"],
                    "loss": entry["loss"],
                    "learning_rate": entry.get("learning_rate"),
                }
                row.update({k: v for k, v in entry.items() if k.startswith("precision/")})
                step_rows.append(row)
        res = run["result"]
        run_metric = res.get("primary_metric", metric)  # a recipe whose metric follows its task names it
        step_s = res.get("median_step_seconds")
        summary.append(
            {
                "strategy": strategy,
                "seed": seed,
                "eval_metric": run_metric,
                "eval_value": res.get(run_metric),
                "final_loss": res.get("final_loss"),
                "median_step_ms": 1000 * step_s if step_s is not None else None,
                "bytes_per_param": res.get("model_state_bytes_per_param"),
                "peak_rss_mib": run["peak_rss_mib"],
                "skipped_steps": res.get("precision/skipped_steps"),
                "wall_s": run["wall_s"],
            }
        )
        # After every run: a later run that fails loses none of the finished ones.
        _write_csv(out / "results.csv", step_rows)
        _write_csv(out / "summary.csv", summary)
    if predict_gpu:  # after the runs' rows are safe on disk: a failed prediction loses nothing
        from .planning.plan import gpu_preview

        try:
            predicted = gpu_preview(strategies)
        except Exception as error:  # the runs stand without it
            logger.warning("no GPU prediction beside the CPU rows: %s: %s", type(error).__name__, error)
        else:
            for row in summary:
                row["gpu_step_ms"] = predicted[row["strategy"]]
    _write_csv(out / "summary.csv", summary)
    plot(step_rows, summary, out, title=f"{Path(recipe).stem}, {max_steps} steps")
    return summary


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    fields: list[str] = []
    for row in rows:
        fields += [k for k in row if k not in fields]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def _curves(
    step_rows: list[dict[str, Any]], key: str
) -> dict[str, tuple[list[int], list[float], list[float], list[float]]]:
    """strategy → (steps, mean, min, max) of `key` over seeds, on the steps every seed logged."""
    by: dict[str, dict[int, list[float]]] = {}
    for row in step_rows:
        value = row.get(key)
        if value is None or value == "":
            continue
        by.setdefault(row["strategy"], {}).setdefault(int(row["step"]), []).append(float(value))
    seeds = {s: len({r["seed"] for r in step_rows if r["strategy"] == s}) for s in by}
    out = {}
    for strategy, steps in by.items():
        xs = sorted(x for x, v in steps.items() if len(v) == seeds[strategy])
        if xs:
            out[strategy] = (
                xs,
                [statistics.fmean(steps[x]) for x in xs],
                [min(steps[x]) for x in xs],
                [max(steps[x]) for x in xs],
            )
    return out


def plot(
    step_rows: list[dict[str, Any]], summary: list[dict[str, Any]], out: str | Path, *, title: str = ""
) -> list[Path]:
    """Write the PNG plots into `out`; the paths written: `loss.png` (mean and min–max band over
    seeds), `lost_arithmetic.png` (imprecision % and EDQ ratio, when logged), `scaling.png` (loss
    scale / FP8 gradient μ, when logged), `cost.png` (memory and speed per strategy)."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "the comparison plots need matplotlib: install the `plots` extra (from a checkout: pip install -e '.[plots]')"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    written: list[Path] = []

    def curves_figure(keys: tuple[str, ...], labels: dict[str, str], name: str, log_y: bool = False) -> None:
        present = [k for k in keys if _curves(step_rows, k)]
        if not present:
            return
        fig, axes = plt.subplots(1, len(present), figsize=(6.4 * len(present), 4.2), squeeze=False)
        for ax, key in zip(axes[0], present):
            for strategy, (xs, mean, lo, hi) in _curves(step_rows, key).items():
                (line,) = ax.plot(xs, mean, label=strategy, linewidth=1.4)
                if any(a != b for a, b in zip(lo, hi)):
                    ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
            ax.set_xlabel("training step")
            ax.set_ylabel(labels[key])
            if log_y:
                ax.set_yscale("log", base=2)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(
            title + ("  (line: mean over seeds, band: min–max)" if len({r["seed"] for r in step_rows}) > 1 else "")
        )
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    curves_figure(("loss",), {"loss": "training loss (nats/token)"}, "loss.png")
    curves_figure(
        _LOST,
        {
            "precision/imprecision_pct": "imprecision: updates lost entirely (% of elements)",
            "precision/edq_ratio": "EDQ ratio (1.0 = intended update kept)",
        },
        "lost_arithmetic.png",
    )
    curves_figure(
        _SCALES,
        {"precision/loss_scale": "loss scale", "precision/fp8_grad_mu": "FP8 gradient scale μ"},
        "scaling.png",
        log_y=True,
    )

    strategies = list(dict.fromkeys(r["strategy"] for r in summary))
    panels = [
        ("bytes_per_param", "model-state bytes / parameter"),
        ("median_step_ms", "median step time on this CPU (ms)"),
        ("peak_rss_mib", "process peak RSS (MiB)"),
    ]
    if all(r.get("gpu_step_ms") is not None for r in summary):
        from .planning.plan import GPU_PREVIEW

        panels.append(("gpu_step_ms", f"predicted step on an H100 (ms): {GPU_PREVIEW}"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
    for ax, (key, label) in zip(axes, panels):
        values = [
            statistics.fmean([float(r[key]) for r in summary if r["strategy"] == s and r[key] is not None] or [0.0])
            for s in strategies
        ]
        bars = ax.bar(strategies, values, color=[f"C{i}" for i in range(len(strategies))])
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_ylabel(label)
        ax.tick_params(axis="x", rotation=30, labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{title}: memory and speed per strategy")
    fig.tight_layout()
    path = out / "cost.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def summary_table(summary: list[dict[str, Any]], step_rows_path: str | Path | None = None) -> str:
    """The per-strategy table printed at the end (means over seeds)."""
    lost: dict[str, tuple[float, float]] = {}
    if step_rows_path is not None and Path(step_rows_path).is_file():
        with open(step_rows_path) as f:
            rows = list(csv.DictReader(f))
        for strategy in {r["strategy"] for r in rows}:
            imp = [
                float(r["precision/imprecision_pct"])
                for r in rows
                if r["strategy"] == strategy and r.get("precision/imprecision_pct")
            ]
            edq = [
                float(r["precision/edq_ratio"])
                for r in rows
                if r["strategy"] == strategy and r.get("precision/edq_ratio")
            ]
            if imp:
                # The last quarter of training, where the learning rate is smallest and updates are lost most.
                tail = max(1, len(imp) // 4)
                lost[strategy] = (statistics.fmean(imp[-tail:]), statistics.fmean(edq[-tail:]))
    metric = summary[0]["eval_metric"] if summary else "eval"
    gpu = bool(summary) and all(r.get("gpu_step_ms") is not None for r in summary)
    header = (
        f"{'strategy':<16} {metric:>11} {'final loss':>10} {'bytes/param':>11} {'step ms':>8} {'peak MiB':>9}"
        f" {'lost %':>7} {'EDQ':>6}" + (f" {'H100 ms*':>9}" if gpu else "")
    )
    lines = [header, "-" * len(header)]
    for strategy in dict.fromkeys(r["strategy"] for r in summary):
        rows = [r for r in summary if r["strategy"] == strategy]

        def mean(key: str, rows: list = rows) -> float:
            values = [float(r[key]) for r in rows if r[key] is not None]
            return statistics.fmean(values) if values else float("nan")

        imp, edq = lost.get(strategy, (float("nan"), float("nan")))
        lines.append(
            f"{strategy:<16} {mean('eval_value'):>11.3f} {mean('final_loss'):>10.3f} "
            f"{mean('bytes_per_param'):>11.2f} {mean('median_step_ms'):>8.1f} {mean('peak_rss_mib'):>9.0f}"
            f" {imp:>7.2f} {edq:>6.3f}" + (f" {mean('gpu_step_ms'):>9.1f}" if gpu else "")
        )
    if gpu:
        from .planning.plan import GPU_PREVIEW

        fastest = min(summary, key=lambda r: float(r["gpu_step_ms"]))["strategy"]
        lines.append(
            f"step ms: on this CPU, where FP8 is emulated (no FP8 arithmetic): it says nothing of a GPU. "
            f"H100 ms*: predicted by `hf-lowprec plan` for {GPU_PREVIEW}; fastest there: {fastest}"
        )
    if lost:
        lines.append(
            "lost % / EDQ: mean over the last quarter of logged steps (imprecision % of elements whose "
            "update was lost entirely; EDQ ratio 1.0 = the intended update was applied)"
        )
    return "\n".join(lines)
