"""The recipes `hf-lowprec compare` runs, the arguments each run gets, and their check before any run.

A run's recipe arguments are compare's own (`recipe_argv`) followed by those given after `--`,
which must neither repeat one of compare's (`OWNED_ARGUMENTS`) nor name an option the recipe
lacks (`recipe_options`): `check_recipe_arguments` refuses both before the first run.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = [
    "TRAINING_RECIPES",
    "SCRIPT_METRICS",
    "OWNED_ARGUMENTS",
    "resolve_recipe",
    "recipe_argv",
    "recipe_options",
    "check_recipe_arguments",
]

logger = logging.getLogger(__name__)

# In-package recipes: name → (module run with `python -m`, the eval metric it reports).
TRAINING_RECIPES: dict[str, tuple[str, str]] = {
    "pretrain_clm": ("hf_lowprec.runner", "perplexity"),
}
# The eval metric of the repository's recipe scripts, by file stem (others: eval_loss).
SCRIPT_METRICS: dict[str, str] = {
    "pretrain_clm": "perplexity",
    "pretrain_mlm": "eval_loss",
    "finetune_glue": "eval_accuracy",
    "sft": "eval_loss",
}


def resolve_recipe(recipe: str) -> tuple[list[str], Path | None, str]:
    """The command prefix, working directory (None: the run's own) and eval metric of `recipe`.

    `recipe` is an in-package name (`TRAINING_RECIPES`) or the path of a recipe script.
    """
    if recipe in TRAINING_RECIPES:
        module, metric = TRAINING_RECIPES[recipe]
        return [sys.executable, "-m", module], None, metric
    path = Path(recipe)
    if path.suffix == ".py" and path.is_file():
        path = path.resolve()
        return [sys.executable, str(path)], path.parent, SCRIPT_METRICS.get(path.stem, "eval_loss")
    raise ValueError(
        f"--recipe {recipe!r} is neither an in-package recipe ({', '.join(sorted(TRAINING_RECIPES))}) nor the path of a "
        "recipe script (e.g. recipes/finetune_glue.py in a source checkout)"
    )


def recipe_argv(strategy: str, seed: int, run_dir: Path, max_steps: int, metrics: bool, extra: list[str]) -> list[str]:
    """The arguments one run hands the recipe after its command (`check_recipe_arguments` reads the same)."""
    argv = [
        "--precision_strategy",
        strategy,
        "--seed",
        str(seed),
        "--max_steps",
        str(max_steps),
        "--output_dir",
        str(run_dir),
        "--logging_steps",
        "1",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
    ]
    if metrics:
        argv += ["--precision_options", json.dumps({"lost_arithmetic_metrics": True})]
    return argv + extra


# The recipe flags every run gets from compare itself (`recipe_argv`): given again after `--`, the
# last would win and the row would name what did not run. What to use instead, per flag.
OWNED_ARGUMENTS: dict[str, str] = {
    "precision_strategy": "one per run: name them with --strategies",
    "seed": "one per run: name them with --seeds",
    "max_steps": "give --max_steps before --",
    "output_dir": "OUT/runs/STRATEGY-seedN: choose OUT with --out",
    "logging_steps": "1: its curves need every step",
    "logging_strategy": "steps: its curves need every step",
    "logging_first_step": "its curves need every step",
    "save_strategy": "no: a comparison saves no checkpoint",
    "save_steps": "a comparison saves no checkpoint",
    "report_to": "none",
    "disable_tqdm": "true: --no-progress hides compare's own bar",
}
_METRICS_OWNED = "the lost-arithmetic metrics: with --no-metrics it is yours to give"


@functools.lru_cache(maxsize=8)
def recipe_options(recipe: str) -> frozenset[str] | None:
    """Every option name `recipe` accepts (without the dashes, `-` read as `_`), read from its
    help; None when a recipe script prints none (its own arguments then go unchecked)."""
    command, cwd, _ = resolve_recipe(recipe)
    if recipe in TRAINING_RECIPES:  # its module's parser, in this process
        text = importlib.import_module(TRAINING_RECIPES[recipe][0]).recipe_parser().format_help()
    else:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        try:
            proc = subprocess.run([*command, "--help"], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)
        except subprocess.TimeoutExpired:
            logger.warning("%s --help did not finish in 300 s: its own arguments go unchecked", recipe)
            return None
        if proc.returncode != 0:
            logger.warning("%s --help failed (exit code %d): its own arguments go unchecked", recipe, proc.returncode)
            return None
        text = proc.stdout
    return frozenset(m.replace("-", "_") for m in re.findall(r"(?<![\w-])--([A-Za-z][\w-]*)", text))


def _given_options(extra: list[str]) -> list[str]:
    """The option names (`--name` or `--name=value`) among the recipe arguments, as typed."""
    return [a[2:].split("=", 1)[0] for a in extra if a.startswith("--") and len(a) > 2]


def check_recipe_arguments(
    strategies: list[str], extra: list[str], metrics: bool = True, recipe: str = "pretrain_clm"
) -> None:
    """The recipe's extra arguments, before the first run: an option compare sets itself
    (`OWNED_ARGUMENTS`), one the recipe does not have (`recipe_options`), a value that does not
    parse as `TrainingArguments` reads it under each strategy, or a setting a strategy refuses (an
    `optim` it replaces, a bf16/fp16 flag it contradicts) is a ValueError, not a failure after the
    runs before it."""
    import argparse

    from transformers import HfArgumentParser

    from .integrations.trainer import TrainingArguments

    owned = {**OWNED_ARGUMENTS, **({"precision_options": _METRICS_OWNED} if metrics else {})}
    known = recipe_options(recipe) if _given_options(extra) else None  # (a script's --help runs it)
    for name in _given_options(extra):
        flag = name.replace("-", "_")
        if flag in owned:
            raise ValueError(f"--{name} after -- is set by compare itself ({owned[flag]}); no run was started")
        if known is not None and flag not in known:
            close = difflib.get_close_matches(flag, sorted(known), n=1)
            hint = f" (did you mean --{close[0]}?)" if close else ""
            if close and close[0] in owned:
                hint = f" (--{close[0]} is set by compare itself: {owned[close[0]]})"
            shown = " ".join(["python", *resolve_recipe(recipe)[0][1:], "--help"])
            raise ValueError(
                f"the recipe {recipe} has no option --{name}{hint} (its options: {shown}); no run was started"
            )
    # No abbreviations: an option of the recipe's own (`--block_size`, `--model`) is left over, not
    # taken for a prefix of a TrainingArguments field (`--eval` would be ambiguous among six).
    parser = HfArgumentParser(TrainingArguments, exit_on_error=False, allow_abbrev=False)
    with tempfile.TemporaryDirectory() as scratch:
        for name in strategies:
            argv = recipe_argv(name, 0, Path(scratch), 1, metrics, extra)
            try:
                parser.parse_args_into_dataclasses(argv, return_remaining_strings=True)
            except (argparse.ArgumentError, ValueError) as error:
                raise ValueError(
                    f"the recipe arguments {' '.join(extra)!r} under precision_strategy={name!r}: {error}; "
                    "no run was started"
                ) from None
