"""The `hf-lowprec` command line (also `python -m hf_lowprec`): `list`, `memory`, `compare` and
`launch` (`main`). Every command works from an installed wheel in any directory: `compare` trains
what ships in the package (`hf_lowprec.runner`). Maintainer tools live in the repository
(`make readme`, `make bench`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from .strategies.registry import available_strategies, get_strategy, strategy_class, strategy_summary

__all__ = ["main", "strategy_rows", "memory_plan", "MODELS"]

# Named model shapes for `memory`: (config class, its arguments, model class), all from transformers.
MODELS: dict[str, tuple[str, dict[str, Any], str]] = {
    "gpt2": ("GPT2Config", {}, "GPT2LMHeadModel"),
    "bert-base": ("BertConfig", {}, "BertForMaskedLM"),
    "roberta-base": (
        "RobertaConfig",
        {"vocab_size": 50265, "max_position_embeddings": 514, "type_vocab_size": 1, "pad_token_id": 1},
        "RobertaForMaskedLM",
    ),
    "llama-7b": (
        "LlamaConfig",
        {
            "vocab_size": 32000,
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
        },
        "LlamaForCausalLM",
    ),
    # A Mixture-of-Experts model: 128 experts, top-8, expert width 768 (its published config).
    "qwen3-30b-a3b": (
        "Qwen3MoeConfig",
        {
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "decoder_sparse_step": 1,
            "tie_word_embeddings": False,
        },
        "Qwen3MoeForCausalLM",
    ),
}


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


# Config fields that count or size something: a model needs each at least 1.
_SIZE_FIELDS = (
    "vocab_size",
    "n_layer",
    "n_head",
    "n_embd",
    "n_positions",
    "n_inner",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_size",
    "intermediate_size",
    "max_position_embeddings",
)


def _model_config(model: str) -> tuple[Any, Any]:
    """The config and model class `--model` names (a known shape or a config.json), checked; ValueError if bad."""
    import transformers

    if model in MODELS:
        config_cls, kwargs, model_cls = MODELS[model]
        return getattr(transformers, config_cls)(**kwargs), getattr(transformers, model_cls)
    path = Path(model)
    if not path.is_file():
        raise ValueError(f"--model must be one of {sorted(MODELS)} or a path to a config.json; {model!r} is neither")
    try:
        config = transformers.AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"--model {model}: not a transformers config.json ({str(err).splitlines()[0]})") from None
    for key in _SIZE_FIELDS:
        value = getattr(config, key, None)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"--model {model}: {key} must be a positive integer, got {value!r}")
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch) if arch and hasattr(transformers, arch) else transformers.AutoModelForCausalLM
    return config, cls


def _build_meta_model(model: str) -> torch.nn.Module:
    import transformers

    config, cls = _model_config(model)
    with torch.device("meta"):
        return cls.from_config(config) if cls is transformers.AutoModelForCausalLM else cls(config)


def memory_plan(model: str, strategies: list[str], world_size: int = 1, zero_stage: int = 0) -> list[dict[str, Any]]:
    """Model-state memory per strategy for `model`, planned on the meta device (no weights allocated).

    Each strategy prepares the meta model and builds its optimizer; the optimizer's own state
    initialisers give the state tensors (`hf_lowprec.report.plan_model_state`). With ZeRO, the
    per-rank share follows `hf_lowprec.report.zero_per_rank`.
    """
    from .report import plan_model_state, zero_per_rank

    logging.getLogger("hf_lowprec.fp8").setLevel(logging.ERROR)  # skipped-layer warnings, once per strategy
    rows = []
    for name in strategies:
        strategy = get_strategy(name)
        prepared = strategy.prepare_model(_build_meta_model(model))
        optimizer = strategy.create_optimizer([p for p in prepared.parameters() if p.requires_grad], lr=1e-4)
        plan = plan_model_state(prepared, optimizer)
        row = {"strategy": name, **plan}
        if world_size > 1 or zero_stage:
            refusal = _zero_refusal(name, zero_stage)
            per_rank = zero_per_rank(plan, world_size, zero_stage)
            row["per_rank_total"] = per_rank["total"]
            row["zero"] = refusal or "ok"
        rows.append(row)
    return rows


def _zero_refusal(name: str, stage: int) -> str | None:
    """The support matrix's refusal for `name` under ZeRO `stage` (None where it runs)."""
    if stage == 0:
        return None
    from .engines.zero import zero_support  # imports without DeepSpeed

    return zero_support(get_strategy(name), stage)


def _print_memory(rows: list[dict[str, Any]], model: str, world_size: int, zero_stage: int) -> None:
    num = int(rows[0]["num_params"]) if rows else 0
    print(f"model {model}: {num:,} trainable parameters; bytes per parameter, planned on the meta device")
    head = f"{'strategy':<16} {'params':>7} {'grads':>7} {'optim':>7} {'extra':>7} {'total':>7} {'GiB':>9}"
    zero = world_size > 1 or zero_stage
    if zero:
        head += f" {'GiB/rank':>9}  ZeRO-{zero_stage} on {world_size} ranks"
    print(head)
    print("-" * len(head))
    for r in rows:
        line = (
            f"{r['strategy']:<16} {r['params']:>7.2f} {r['grads']:>7.2f} {r['optimizer_states']:>7.2f} "
            f"{r['extra']:>7.2f} {r['total']:>7.2f} {r['total'] * r['num_params'] / 2**30:>9.2f}"
        )
        if zero:
            line += f" {r['per_rank_total'] * r['num_params'] / 2**30:>9.2f}  {r['zero']}"
        print(line)


def _check_strategy_names(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """The comma-separated strategy names in `text`; a usage error (exit 2) for an unknown one."""
    names = [s for s in text.split(",") if s]
    if not names:
        parser.error("--strategies names no strategy; pass comma-separated names (hf-lowprec list shows them)")
    for name in names:
        try:
            strategy_class(name)
        except ValueError as error:
            parser.error(f"--strategies: {error}")
    return names


def _check_writable(parser: argparse.ArgumentParser, out: str) -> None:
    """Create `out` and write a file in it now, so no run's results are lost at the end."""
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        parser.error(f"--out {out} is not writable ({error.strerror or error}); pick another directory")


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit status.

    hf-lowprec list                                  every strategy, what it does, bytes/param, needs
    hf-lowprec memory --model gpt2 [--strategies a,b] [--world-size N --zero-stage S]
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
        default=os.environ.get("HF_LOWPREC_PRECISION_STRATEGY") or None,
        help="the default strategy of every process (a --precision_strategy on the script's command line wins)",
    )
    run.add_argument(
        "--precision_options",
        "--precision-options",
        default=os.environ.get("HF_LOWPREC_PRECISION_OPTIONS") or None,
        help="a JSON object of the strategy's options",
    )
    run.add_argument("launched", nargs=argparse.REMAINDER, metavar="COMMAND", help="after --: the command to run")

    ns = parser.parse_args(argv)
    if ns.command == "launch":
        from .integrations.launch import run as launch

        try:
            command = ns.launched[1:] if ns.launched[:1] == ["--"] else ns.launched
            launch(command, ns.precision_strategy, ns.precision_options)
        except ValueError as error:
            run.error(str(error))
    if ns.command == "list":
        rows = strategy_rows()
        width = max(len(r["name"]) for r in rows)
        print(f"{'strategy':<{width}}  {'B/param':>7}  needs            what")
        for r in rows:
            print(f"{r['name']:<{width}}  {r['bytes_per_param']:>7g}  {(r['needs'] or '-'):<16} {r['summary']}")
        return 0
    if ns.command == "memory":
        names = _check_strategy_names(mem, ns.strategies or ",".join(available_strategies()))
        if ns.world_size < 1:
            mem.error("--world-size must be >= 1")
        try:
            _model_config(ns.model)
        except ValueError as error:
            mem.error(str(error))
        _print_memory(
            memory_plan(ns.model, names, ns.world_size, ns.zero_stage), ns.model, ns.world_size, ns.zero_stage
        )
        return 0
    if ns.command == "compare":
        from .compare import resolve_recipe, run_compare, summary_table

        try:
            resolve_recipe(ns.recipe)
        except ValueError as error:
            cmp_.error(str(error))
        names = _check_strategy_names(cmp_, ns.strategies)
        try:
            seeds = [int(s) for s in ns.seeds.split(",") if s]
        except ValueError:
            cmp_.error(f"--seeds must be comma-separated integers, got {ns.seeds!r}")
        if ns.max_steps < 1:
            cmp_.error(f"--max_steps must be >= 1, got {ns.max_steps}")
        _check_writable(cmp_, ns.out)
        extra = [a for a in ns.recipe_args if a != "--"]
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
        print(summary_table(summary, Path(ns.out) / "results.csv"))
        print(
            f"\nplots and CSVs in {Path(ns.out).resolve()}: loss.png, lost_arithmetic.png, cost.png, "
            "results.csv (per step), summary.csv (per run)"
        )
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
