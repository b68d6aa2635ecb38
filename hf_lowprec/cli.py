"""The `hf-lowprec` command line (also `python -m hf_lowprec`): `list`, `memory`, `plan`, `compare` and
`launch` (`main`). Every command works from an installed wheel in any directory: `compare` trains
what ships in the package (`hf_lowprec.runner`). Maintainer tools live in the repository
(`make readme`, `make bench`).
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from .hardware import gpu_named
from .planning.counting import without_collector
from .planning.heads import check_head
from .planning.models import MODELS, engine_refusal, memory_plan, model_config, position_limit, quiet
from .strategies.registry import available_strategies, get_strategy, strategy_class, strategy_summary

__all__ = ["main", "strategy_rows", "memory_plan", "MODELS"]


def _needs(name: str) -> str:
    cls, _ = strategy_class(name)
    return getattr(cls, "needs", "") or ""


def strategy_rows() -> list[dict[str, Any]]:
    """name, summary, documented bytes/param and requirements of every registered strategy."""
    rows = []
    for name in available_strategies():
        strategy = get_strategy(name)
        rows.append(
            {
                "name": name,
                "summary": strategy_summary(name),
                "bytes_per_param": float(strategy.bytes_per_param),
                "needs": _needs(name),
            }
        )
    return rows


def _print_memory(rows: list[dict[str, Any]], model: str, world_size: int, zero_stage: int, rule: str = "") -> None:
    num = int(rows[0]["num_params"]) if rows else 0
    print(f"model {model}: {num:,} trainable parameters; bytes per parameter, planned on the meta device{rule}")
    head = f"{'strategy':<16} {'params':>7} {'grads':>7} {'optim':>7} {'extra':>7} {'total':>7} {'GiB':>9}"
    zero = world_size > 1 or zero_stage
    if zero:
        head += f" {'GiB/rank':>9}  {f'ZeRO-{zero_stage}' if zero_stage else 'DDP'} on {world_size} ranks"
    print(head)
    print("-" * len(head))
    for r in rows:
        line = (
            f"{r['strategy']:<16} {r['params']:>7.2f} {r['grads']:>7.2f} {r['optimizer_states']:>7.2f} "
            f"{r['extra']:>7.2f} {r['total']:>7.2f} {r['total'] * r['num_params'] / 2**30:>9.2f}"
        )
        if zero:
            line += f" {r['per_rank_total'] * r['num_params'] / 2**30:>9.2f}  {r['zero']}"
        print(line + ("  refused: no FP8 layer" if r.get("refused") else ""))
    for r in (r for r in rows if r.get("refused")):
        print(f"{r['strategy']}: the run would be refused before its first step: {r['refused']}")


def _check_strategy_names(parser: argparse.ArgumentParser, text: str, peers: tuple[str, ...] = ()) -> list[str]:
    """The comma-separated strategy names in `text` (or `peers`, the planner's peer rows); a usage
    error (exit 2) for an unknown one."""
    names = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))  # each once, in order
    if not names:
        parser.error("--strategies names no strategy; pass comma-separated names (hf-lowprec list shows them)")
    for name in names:
        if name in peers:
            continue
        try:
            strategy_class(name)
        except ValueError as error:
            close = difflib.get_close_matches(name, peers, n=1, cutoff=0.6)
            if close:
                parser.error(f"--strategies: unknown name {name!r}. Did you mean the peer row {close[0]!r}?")
            also = f" Peer rows: {', '.join(peers)}." if peers else ""
            parser.error(f"--strategies: {error}{also}")
    return names


def _check_writable(parser: argparse.ArgumentParser, out: str) -> None:
    """Create `out` and write a file in it now, so no run's results are lost at the end."""
    if Path(out).exists() and not Path(out).is_dir():
        parser.error(f"--out {out} is a file; name a directory (it is created if missing)")
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        parser.error(f"--out {out} is not writable ({error.strerror or error}); pick another directory")


def _batch(parser: argparse.ArgumentParser, batch: str) -> tuple[int, int]:
    """(sequences, tokens each) from --batch, or the parser's error."""
    try:
        sequences, tokens = (int(v) for v in batch.lower().split("x"))
        if sequences < 1 or tokens < 1:
            raise ValueError
    except ValueError:
        parser.error(f"--batch must be SEQUENCESxTOKENS with both positive, e.g. 4x2048; got {batch!r}")
    return sequences, tokens


def _model_batch(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> tuple[int, int]:
    """`--batch` (default 4x2048, cut to the longest sequence a model with learned positions holds),
    or the parser's error for a longer one."""
    sequences, tokens = _batch(parser, ns.batch or "4x2048")
    limit = position_limit(ns.model)
    if limit is not None and tokens > limit:
        if ns.batch is not None:
            parser.error(f"--batch {ns.batch}: {ns.model} holds at most {limit} tokens a sequence (learned positions)")
        tokens = limit
    return sequences, tokens


def _plan(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    """`hf-lowprec plan`: every input checked before any counting starts."""
    import json

    from .planning.counting import ANCHOR, PEERS
    from .planning.plan import calibration_lines, format_plan, plan_rows, scaling_lines

    for flag, value in (("--link-gbps", ns.link_gbps), ("--network-gbps", ns.network_gbps)):
        if value is not None and not value > 0:
            parser.error(f"{flag} must be a positive bandwidth in GB/s per GPU, got {value}")
    try:
        check_head(model_config(ns.model)[1])
        numbers = {k: v * 1e9 for k, v in (("link", ns.link_gbps), ("network", ns.network_gbps)) if v is not None}
        gpu = gpu_named(ns.gpu, **numbers)
    except ValueError as error:
        parser.error(str(error))
    sequences, tokens = _model_batch(parser, ns)
    if ns.gpus < 1:
        parser.error(f"--gpus must be at least 1, got {ns.gpus}")
    names = (
        [ANCHOR, *available_strategies()]
        if ns.strategies is None
        else _check_strategy_names(parser, ns.strategies, tuple(PEERS))
    )
    if "torchao-float8" in names and importlib.util.find_spec("torchao") is None:
        parser.error("--strategies torchao-float8 counts torchao's float8 training: pip install torchao first")
    # A strategy the engine refuses before training is not planned under it (its figures would
    # describe a run that cannot start): said, with the engine's reason, before the table.
    refused = {n: engine_refusal(n, ns.engine) for n in names} if ns.gpus > 1 else {}
    refused = {n: why for n, why in refused.items() if why}
    for why in refused.values():
        print(f"not planned under {ns.engine} on {ns.gpus} GPUs: {why}", file=sys.stderr if ns.json else sys.stdout)
    names = [n for n in names if n not in refused]
    if not names:
        parser.error(f"--engine {ns.engine} refuses every strategy asked for (above); pick another engine")
    try:
        with quiet():
            rows = plan_rows(ns.model, names, (sequences, tokens), gpu, ns.gpus, ns.engine, ns.compiled_layers)
    except RuntimeError as error:  # the model's own forward refused these shapes (a config it cannot run)
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        parser.error(f"--model {ns.model}: counting a step at batch {sequences}x{tokens} failed ({reason})")
    if ns.json:
        print(json.dumps(rows, indent=1))
        return 0
    where = f"{ns.gpus}× {gpu.name}, {ns.engine}" if ns.gpus > 1 else f"one {gpu.name}"
    print(format_plan(rows, f"{ns.model}, batch {sequences}x{tokens} per GPU, {where} (predicted, docs/planning.md)"))
    print("\n" + "\n".join(scaling_lines(rows, gpu, ns.engine)))
    print("\nHow far this model was from steps measured on a GPU:")
    print("\n".join(calibration_lines()))
    return 0


def _memory(mem: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    names = _check_strategy_names(mem, ns.strategies or ",".join(available_strategies()))
    if ns.world_size < 1:
        mem.error("--world-size must be >= 1")
    try:
        model_config(ns.model)
        gpu = None if ns.gpu is None else gpu_named(ns.gpu)
    except ValueError as error:
        mem.error(str(error))
    if ns.batch is not None and gpu is None:
        mem.error("--batch prices the FP8 layer rule on a GPU: give --gpu too (without it every layer is FP8)")
    sequences, tokens = _model_batch(mem, ns) if gpu is not None else (4, 2048)
    rows = memory_plan(ns.model, names, ns.world_size, ns.zero_stage, gpu, sequences * tokens)
    rule = f"; FP8 layers where FP8 pays on one {gpu.name} at batch {sequences}x{tokens}" if gpu is not None else ""
    _print_memory(rows, ns.model, ns.world_size, ns.zero_stage, rule)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit status.

    hf-lowprec list                                  every strategy, what it does, bytes/param, needs
    hf-lowprec memory --model gpt2 [--strategies a,b] [--world-size N --zero-stage S] [--gpu h100 --batch 4x2048]
    hf-lowprec plan --model llama-3-70b --batch 8x8192 --gpu h100 [--gpus 64 --engine fsdp2] [--json]
    hf-lowprec compare --strategies bf16-pure,collage-plus [--recipe pretrain_clm] [--seeds 0,1] [--out DIR]
    hf-lowprec launch [--precision_strategy NAME] [--precision_options JSON] -- COMMAND...
                                                     any training command, unchanged, with the strategy
    """
    parser = argparse.ArgumentParser(
        prog="hf-lowprec", description="Low-precision training strategies for the HF stack."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("list", help="every registered strategy: what it does, bytes/param, what it needs")

    mem = sub.add_parser("memory", help="model-state memory per strategy (Collage Table 2 style)")
    mem.add_argument("--model", default="gpt2", help=f"one of {', '.join(MODELS)} or a path to a config.json")
    mem.add_argument("--strategies", default=None, help="comma-separated names (default: all)")
    mem.add_argument("--world-size", type=int, default=1)
    mem.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    mem.add_argument(
        "--gpu", default=None, help="h100, h200, b200 or a100: FP8 keeps in BF16 what it would not speed up there"
    )
    mem.add_argument(
        "--batch",
        default=None,
        help="per-GPU batch with --gpu: SEQUENCESxTOKENS (default 4x2048, or the longest sequence)",
    )

    plan = sub.add_parser(
        "plan", help="predicted step time, memory and traffic per strategy on a named GPU (docs/planning.md)"
    )
    plan.add_argument("--model", default="llama-0.63b", help=f"one of {', '.join(MODELS)} or a path to a config.json")
    plan.add_argument(
        "--batch",
        default=None,
        help="per-GPU batch: SEQUENCESxTOKENS (default 4x2048, or the model's longest sequence)",
    )
    plan.add_argument("--gpu", default="h100", help="h100, h200, b200 or a100")
    plan.add_argument("--gpus", type=int, default=1, help="how many GPUs train together")
    plan.add_argument("--engine", default="ddp", choices=["ddp", "fsdp2", "zero2"])
    plan.add_argument("--link-gbps", type=float, default=None, help="GB/s per GPU within a node (NVLink)")
    plan.add_argument("--network-gbps", type=float, default=None, help="GB/s per GPU between nodes")
    plan.add_argument("--strategies", default=None, help="comma-separated names (default: all, and torch-amp)")
    plan.add_argument("--compiled-layers", action="store_true", help="each decoder layer torch.compile'd")
    plan.add_argument("--json", action="store_true", help="the rows as JSON, for scripts")

    cmp_ = sub.add_parser("compare", help="train a recipe per strategy and seed; CSV, plots and a summary table")
    from .compare import TRAINING_RECIPES

    cmp_.add_argument(
        "--recipe",
        default="pretrain_clm",
        help=f"in-package: {', '.join(sorted(TRAINING_RECIPES))} (default); or the path of a recipe script",
    )
    cmp_.add_argument("--strategies", required=True, help="comma-separated strategy names")
    cmp_.add_argument("--max_steps", "--max-steps", type=int, default=100)
    cmp_.add_argument("--seeds", default="0", help="comma-separated seeds")
    cmp_.add_argument("--out", default="compare_out")
    cmp_.add_argument("--no-metrics", action="store_true", help="do not log the lost-arithmetic metrics")
    cmp_.add_argument("--no-progress", action="store_true")
    cmp_.add_argument("recipe_args", nargs=argparse.REMAINDER, help="after --: more arguments for the recipe")

    run = sub.add_parser(
        "launch",
        help="run COMMAND (python/torchrun/accelerate launch/deepspeed/trl ...) so that its transformers and "
        "TRL trainers take the strategy (docs/launch.md)",
    )
    run.add_argument(
        "--precision_strategy",
        "--precision-strategy",
        default=None,
        help="the default strategy of every process (a --precision_strategy on the script's command line wins); "
        "unset: $HF_LOWPREC_PRECISION_STRATEGY",
    )
    run.add_argument(
        "--precision_options",
        "--precision-options",
        default=None,
        help="a JSON object of the strategy's options; unset: $HF_LOWPREC_PRECISION_OPTIONS",
    )
    run.add_argument("launched", nargs=argparse.REMAINDER, metavar="COMMAND", help="after --: the command to run")

    ns = parser.parse_args(argv)
    if ns.command == "launch":
        from .integrations.launch import run as launch
        from .integrations.launch_env import ENV_OPTIONS, ENV_STRATEGY

        # A value from the environment, when it is wrong, is named as such: the user typed no flag.
        from_env = [
            f"${var}={os.environ[var]!r}"
            for flag, var in (("precision_strategy", ENV_STRATEGY), ("precision_options", ENV_OPTIONS))
            if getattr(ns, flag) is None and os.environ.get(var)
        ]
        strategy = ns.precision_strategy or os.environ.get(ENV_STRATEGY) or None
        # The variable's options belong to the variable's strategy: not to one typed on the command line.
        if ns.precision_strategy is not None and ns.precision_options is None and os.environ.get(ENV_OPTIONS):
            from_env = [e for e in from_env if not e.startswith(f"${ENV_OPTIONS}=")]
            print(f"hf-lowprec launch: ${ENV_OPTIONS} ignored: --precision_strategy was given", file=sys.stderr)
            options = None
        else:
            options = ns.precision_options or os.environ.get(ENV_OPTIONS) or None
        try:
            command = ns.launched[1:] if ns.launched[:1] == ["--"] else ns.launched
            launch(command, strategy, options)
        except ValueError as error:
            origin = f" (from the environment: {', '.join(from_env)}; fix or unset it, or pass the flag)"
            message = str(error).removeprefix("hf-lowprec launch: ")  # the usage error names the command
            run.error(f"{message}{origin if from_env and command else ''}")
    if ns.command == "list":
        rows = strategy_rows()
        width, needs = max(len(r["name"]) for r in rows), max(len(r["needs"] or "-") for r in rows)
        print(f"{'strategy':<{width}}  {'B/param':>7}  {'needs':<{needs}}  what (B/param: on the layers it converts)")
        for r in rows:
            print(f"{r['name']:<{width}}  {r['bytes_per_param']:>7g}  {(r['needs'] or '-'):<{needs}}  {r['summary']}")
        return 0
    if ns.command in ("memory", "plan"):
        # Short-lived planners that make millions of objects reference counting frees: the
        # collector's passes are time lost (the transformers import among them).
        with without_collector():
            return _plan(plan, ns) if ns.command == "plan" else _memory(mem, ns)
    if ns.command == "compare":
        from .compare import check_recipe_arguments, resolve_recipe, run_compare, summary_table

        try:
            resolve_recipe(ns.recipe)
        except ValueError as error:
            cmp_.error(str(error))
        names = _check_strategy_names(cmp_, ns.strategies)
        try:
            seeds = [int(s) for s in ns.seeds.split(",") if s]
        except ValueError:
            cmp_.error(f"--seeds must be comma-separated integers, got {ns.seeds!r}")
        if not seeds:
            cmp_.error(f"--seeds names no seed, got {ns.seeds!r}; pass comma-separated integers, e.g. 0,1,2")
        if ns.max_steps < 1:
            cmp_.error(f"--max_steps must be >= 1, got {ns.max_steps}")
        _check_writable(cmp_, ns.out)
        extra = [a for a in ns.recipe_args if a != "--"]
        try:
            check_recipe_arguments(names, extra, not ns.no_metrics, ns.recipe)
        except ValueError as error:
            cmp_.error(str(error))
        try:
            summary = run_compare(
                ns.recipe,
                names,
                seeds=seeds,
                max_steps=ns.max_steps,
                out=ns.out,
                metrics=not ns.no_metrics,
                extra_args=extra,
                progress=not ns.no_progress,
            )
        except RuntimeError as error:  # a run failed: the finished runs' CSVs are in --out
            done = Path(ns.out) / "summary.csv"  # written after each run that finished
            print(
                f"hf-lowprec compare: {error}" + (f"\nthe runs before it: {done}" if done.exists() else ""),
                file=sys.stderr,
            )
            return 1
        print(summary_table(summary, Path(ns.out) / "results.csv"))
        plots = ", ".join(sorted(p.name for p in Path(ns.out).glob("*.png")))  # those with something to draw
        print(
            f"\nplots and CSVs in {Path(ns.out).resolve()}: {plots + ', ' if plots else ''}"
            "results.csv (per step), summary.csv (per run)"
        )
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
