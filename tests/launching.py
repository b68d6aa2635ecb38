"""Running what users run, in fresh interpreters: `hf-lowprec launch` commands, a torchrun of
gloo ranks, and the recipes (`recipes/X.py`) with their quick arguments and result checks."""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from hf_lowprec import get_strategy
from tests.deepspeed._launch import EXIT_ABORT

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
# What every recipe run of the tests adds: every step logged, no progress bar, no saving, seed 0.
QUICK = ["--logging_steps", "1", "--disable_tqdm", "true", "--save_strategy", "no", "--seed", "0"]
# Two GLUE training steps on the CPU, evaluation left out.
GLUE_TWO_STEPS = ["--max_steps", "2", "--eval_strategy", "no", "--per_device_train_batch_size", "8"]
GLUE_TWO_STEPS += ["--max_eval_samples", "16", "--use_cpu", "true"]


def subprocess_env(**extra: str) -> dict[str, str]:
    """This environment without any HF_LOWPREC_PRECISION* variable, the repository on PYTHONPATH,
    TRL's experimental warning silenced; `extra` wins."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_LOWPREC_PRECISION")}
    env.update({"PYTHONPATH": str(ROOT), "TRL_EXPERIMENTAL_SILENCE": "1", **extra})
    return env


def launch_command(*launcher_args: str) -> list[str]:
    """`hf-lowprec launch <launcher_args>` as this interpreter runs it."""
    return [sys.executable, "-m", "hf_lowprec", "launch", *launcher_args]


def run_checked(cmd: list[str], cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """Run `cmd` in `subprocess_env(**env)`; its output, or a failure with its stdout and stderr."""
    proc = subprocess.run(cmd, cwd=cwd, env=subprocess_env(**env), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-5000:]}"
    )
    return proc


def run_ranks(cmd: list[str], cwd: Path, complete: Callable[[], bool]) -> None:
    """`run_checked` of a command that starts 2 gloo ranks under torchrun. A rank that aborts at
    teardown, after its work (`terminate called without an active exception`, SIGABRT: the known
    gloo exit abort that tests/deepspeed/_launch.py tolerates too), passes when `complete()` says
    every output was written; a run it cut short runs once more. Any other failure fails."""
    for _ in range(2):
        proc = subprocess.run(cmd, cwd=cwd, env=subprocess_env(), capture_output=True, text=True, timeout=600)
        if proc.returncode == 0 or not (EXIT_ABORT in proc.stderr and "SIGABRT" in proc.stderr):
            break
        if complete():
            return
    assert proc.returncode == 0, (
        f"{' '.join(cmd)}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-5000:]}"
    )


def import_recipe(name: str):
    """The module `recipes/<name>.py`, imported into this process."""
    if str(RECIPES) not in sys.path:
        sys.path.insert(0, str(RECIPES))
    return importlib.import_module(name)


def check_trained(result: dict, strategy: str, steps: int) -> None:
    """A recipe's result line says it trained `steps` steps under `strategy`, none skipped, to a finite loss."""
    assert result["precision_strategy"] == strategy
    assert result["global_step"] == steps
    assert result["precision/skipped_steps"] == 0.0
    check_trainable_dtypes(result, strategy)
    assert math.isfinite(result["final_loss"])


def check_trainable_dtypes(result: dict, strategy: str) -> None:
    """The result counts every trainable dtype by elements, the strategy's parameter dtype among them,
    and names the one holding the most (fp8-lm-o2/o3: their FP8 GEMM weights' scaled FP16 masters)."""
    elements = result["trainable_param_elements"]
    assert result["trainable_param_dtype"] == max(elements, key=elements.get)
    assert str(get_strategy(strategy).param_dtype) in elements
    if strategy in ("fp8-lm-o2", "fp8-lm-o3"):
        assert "torch.float16" in elements
