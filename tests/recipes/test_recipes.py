"""Every recipe runs offline as a user runs it, `python recipes/X.py --precision_strategy NAME`.

Each recipe runs a couple of steps in a subprocess under collage-plus and bf16-mixed (one of
them taking the strategy from HF_LOWPREC_PRECISION_STRATEGY, as an `accelerate launch`
wrapper passes it). The other registered strategies run pretrain_clm in this process, where
the imports are already paid for. Recipes print one result line; the checks read it.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_lowprec import available_strategies
from tests.launching import GLUE_TWO_STEPS, QUICK, RECIPES, ROOT, check_trainable_dtypes, check_trained, import_recipe

MARKER = "hf_lowprec-recipe-result:"
SUBPROCESS_STRATEGIES = ("collage-plus", "bf16-mixed")
# TRL's configs checkpoint activations by default: off, as the installed transformers names it.
NO_CHECKPOINTING = [f"--{name}" for name in import_recipe("common").no_activation_checkpointing()] + ["false"]


def run_recipe(script: str, args: list[str], tmp_path: Path, *, strategy: str, via_env: bool = False) -> dict:
    """Run a recipe in a fresh interpreter and return its result line."""
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"}
    env.pop("HF_LOWPREC_PRECISION_STRATEGY", None)
    if via_env:
        env["HF_LOWPREC_PRECISION_STRATEGY"] = strategy
    else:
        args = ["--precision_strategy", strategy, *args]
    cmd = [sys.executable, str(RECIPES / script), "--output_dir", str(tmp_path / "out"), *QUICK, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    assert proc.returncode == 0 and lines, (
        f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    )
    return json.loads(lines[-1][len(MARKER) :])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", SUBPROCESS_STRATEGIES)
def test_pretrain_clm(tmp_path, strategy):
    via_env = strategy == "collage-plus"
    result = run_recipe(
        "pretrain_clm.py",
        ["--max_steps", "2", "--per_device_train_batch_size", "4", "--max_eval_samples", "12"],
        tmp_path,
        strategy=strategy,
        via_env=via_env,
    )
    check_trained(result, strategy, 2)
    assert math.isfinite(result["perplexity"]) and result["perplexity"] > 1
    assert (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.slow
def test_a_recipe_resumes_from_its_checkpoint_and_never_overwrites_one(tmp_path):
    """`--resume_from_checkpoint` was parsed and never passed to `trainer.train()`: the "resumed"
    run trained from step 0 and overwrote the checkpoint it was to continue. Now it continues
    (the last loss of 2 + 2 steps equals 4 straight), and a fresh run into a directory holding
    checkpoints is refused before any work."""
    args = ["--max_steps", "4", "--per_device_train_batch_size", "4", "--max_eval_samples", "12"]
    args += ["--save_strategy", "steps", "--save_steps", "2", "--logging_steps", "1"]
    straight = run_recipe("pretrain_clm.py", args, tmp_path, strategy="collage-plus")
    checkpoint = tmp_path / "out" / "checkpoint-2"
    stamp = (checkpoint / "trainer_state.json").stat().st_mtime_ns
    resumed = run_recipe(
        "pretrain_clm.py", [*args, "--resume_from_checkpoint", str(checkpoint)], tmp_path, strategy="collage-plus"
    )
    assert resumed["global_step"] == 4 and resumed["final_loss"] == straight["final_loss"]
    assert (checkpoint / "trainer_state.json").stat().st_mtime_ns == stamp
    cmd = [sys.executable, str(RECIPES / "pretrain_clm.py"), "--output_dir", str(tmp_path / "out"), *QUICK, *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode != 0 and "holds the checkpoints of an earlier run" in proc.stderr, proc.stderr[-2000:]
    assert (checkpoint / "trainer_state.json").stat().st_mtime_ns == stamp


@pytest.mark.slow
@pytest.mark.parametrize("strategy,model_type,phase", [("collage-plus", "bert", "1"), ("bf16-mixed", "roberta", "2")])
def test_pretrain_mlm(tmp_path, strategy, model_type, phase):
    result = run_recipe(
        "pretrain_mlm.py",
        [
            "--model_type",
            model_type,
            "--bert_phase",
            phase,
            "--phase1_seq_length",
            "32",
            "--phase2_seq_length",
            "64",
            "--max_steps",
            "2",
            "--per_device_train_batch_size",
            "4",
            "--max_eval_samples",
            "12",
        ],
        tmp_path,
        strategy=strategy,
    )
    check_trained(result, strategy, 2)
    assert result["model_type"] == model_type
    assert result["seq_length"] == (32 if phase == "1" else 64)


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy,task,metrics",
    [
        ("collage-plus", "synthetic-sst2", {"accuracy"}),  # single sentence
        ("bf16-mixed", "synthetic-stsb", {"pearson", "spearmanr"}),  # sentence pair, regression
    ],
)
def test_finetune_glue_reports_glue_metrics(tmp_path, strategy, task, metrics):
    result = run_recipe(
        "finetune_glue.py",
        [
            "--task_name",
            task,
            "--max_steps",
            "3",
            "--eval_strategy",
            "no",
            "--per_device_train_batch_size",
            "8",
            "--synthetic_size",
            "64",
            "--max_eval_samples",
            "32",
        ],
        tmp_path,
        strategy=strategy,
    )
    check_trained(result, strategy, 3)
    assert set(result["glue"]) == metrics
    assert all(-1.0 <= v <= 1.0 for v in result["glue"].values())
    # The task's headline metric, flat under the name `hf-lowprec compare` reads.
    primary = result["primary_metric"]
    assert primary == ("eval_pearson" if task == "synthetic-stsb" else "eval_accuracy")
    assert result[primary] == result["glue"][primary[len("eval_") :]]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", SUBPROCESS_STRATEGIES)
def test_dpo_learns_the_embedded_preferences(tmp_path, strategy):
    # 16 pairs seen 6 times: the policy must come to prefer the ordered continuation over the
    # shuffled one (reward margin > 0 and most pairs ranked right) on the last logged batch.
    result = run_recipe(
        "dpo.py",
        [
            "--num_pairs",
            "16",
            "--num_train_epochs",
            "6",
            "--per_device_train_batch_size",
            "8",
            "--learning_rate",
            "2e-3",
        ],
        tmp_path,
        strategy=strategy,
    )
    assert result["precision_strategy"] == strategy
    check_trainable_dtypes(result, strategy)
    assert result["final_loss"] < result["first_loss"] - 0.1, result
    assert result["final_margin"] > 0 and result["final_reward_accuracy"] >= 0.75, result


@pytest.mark.slow
@pytest.mark.parametrize("strategy,fmt", [("collage-plus", "text"), ("bf16-mixed", "messages")])
def test_sft(tmp_path, strategy, fmt):
    extra = ["--assistant_only_loss", "true"] if fmt == "messages" else []
    result = run_recipe(
        "sft.py",
        [
            "--dataset_format",
            fmt,
            "--max_steps",
            "2",
            "--per_device_train_batch_size",
            "4",
            "--max_length",
            "64",
            *NO_CHECKPOINTING,
            "--max_eval_samples",
            "8",
            *extra,
        ],
        tmp_path,
        strategy=strategy,
    )
    check_trained(result, strategy, 2)
    assert result["data_format"] == [fmt]


@pytest.mark.ppo
@pytest.mark.slow
@pytest.mark.parametrize("strategy", SUBPROCESS_STRATEGIES)
def test_ppo_rlhf_runs_a_full_ppo_update(tmp_path, strategy):
    result = run_recipe(
        "ppo_rlhf.py",
        [
            "--total_episodes",
            "8",
            "--per_device_train_batch_size",
            "4",
            "--num_mini_batches",
            "2",
            "--num_ppo_epochs",
            "1",
            "--response_length",
            "8",
            "--reward_steps",
            "2",
            "--num_prompts",
            "16",
            *NO_CHECKPOINTING,
        ],
        tmp_path,
        strategy=strategy,
    )
    assert result["precision_strategy"] == strategy
    assert result["ppo_updates"] == 2  # 8 episodes, 4 prompts a batch
    assert math.isfinite(result["loss/policy_avg"]) and math.isfinite(result["loss/value_avg"])
    assert result["loss/value_avg"] > 0
    check_trainable_dtypes(result, strategy)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", SUBPROCESS_STRATEGIES)
def test_grpo_rlhf(tmp_path, strategy):
    result = run_recipe(
        "grpo_rlhf.py",
        [
            "--max_steps",
            "1",
            "--per_device_train_batch_size",
            "4",
            "--num_generations",
            "4",
            "--max_completion_length",
            "8",
            "--reward_steps",
            "2",
            "--num_prompts",
            "8",
            *NO_CHECKPOINTING,
        ],
        tmp_path,
        strategy=strategy,
    )
    check_trained(result, strategy, 1)
    assert math.isfinite(result["reward"])


# --- in process: the other strategies, file inputs, argument handling -----------------------------
OTHER_STRATEGIES = [s for s in available_strategies() if s not in SUBPROCESS_STRATEGIES]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", OTHER_STRATEGIES)
def test_pretrain_clm_every_other_strategy(tmp_path, strategy):
    recipe = import_recipe("pretrain_clm")
    result = recipe.main(
        [
            "--precision_strategy",
            strategy,
            "--output_dir",
            str(tmp_path),
            *QUICK,
            "--max_steps",
            "2",
            "--per_device_train_batch_size",
            "4",
            "--max_eval_samples",
            "8",
            "--use_cpu",
            "true",
        ]
    )
    check_trained(result, strategy, 2)


@pytest.mark.parametrize("first_label", [0, 1])
def test_finetune_glue_from_csv_files(tmp_path, first_label):
    """run_glue-style files: sentence-pair classification scored with accuracy and F1; integer
    labels that do not start at 0 (1/2, as Yelp polarity's) become ids (IndexError before)."""
    recipe = import_recipe("finetune_glue")
    columns, _ = recipe.synthetic_task("synthetic-mrpc", 48, seed=1)
    for split, rows in columns.items():
        with open(tmp_path / f"{split}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["sentence1", "sentence2", "label"])
            writer.writerows(zip(rows["sentence1"], rows["sentence2"], [y + first_label for y in rows["label"]]))
    result = recipe.main(
        [
            "--precision_strategy",
            "bf16-pure",
            "--output_dir",
            str(tmp_path / "out"),
            *QUICK,
            "--train_file",
            str(tmp_path / "train.csv"),
            "--validation_file",
            str(tmp_path / "validation.csv"),
            *GLUE_TWO_STEPS,
        ]
    )
    check_trained(result, "bf16-pure", 2)
    assert result["metric_task"] == "mrpc" and set(result["glue"]) == {"accuracy", "f1"}


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_an_arguments_file_keeps_the_environments_strategy_and_the_recipes_defaults(monkeypatch, tmp_path, suffix):
    # HF's parse_json_file/parse_yaml_file built the arguments from the file alone: a plain FP32
    # run, reporting to every integration installed, with none of the recipe's defaults.
    common = import_recipe("common")
    from hf_lowprec import TrainingArguments

    monkeypatch.setenv(common.ENV_STRATEGY, "collage-plus")
    file = tmp_path / f"args{suffix}"
    given = {"output_dir": str(tmp_path / "out"), "max_steps": 2}
    file.write_text(json.dumps(given) if suffix == ".json" else "".join(f"{k}: {v}\n" for k, v in given.items()))
    (args,) = common.parse_args((TrainingArguments,), "t", [str(file)], learning_rate=2e-3)
    assert args.precision_strategy == "collage-plus" and args.max_steps == 2 and args.learning_rate == 2e-3
    assert args.report_to == []  # "none"
    file.write_text(json.dumps({"max_step": 2}) if suffix == ".json" else "max_step: 2\n")
    with pytest.raises(ValueError, match="max_step"):
        common.parse_args((TrainingArguments,), "t", [str(file)])


def test_strategy_from_environment_and_command_line_precedence(monkeypatch, tmp_path):
    common = import_recipe("common")
    from hf_lowprec import TrainingArguments

    monkeypatch.setenv(common.ENV_STRATEGY, "collage-plus")
    monkeypatch.setenv(common.ENV_OPTIONS, json.dumps({"lost_arithmetic_metrics": True}))
    (args,) = common.parse_args((TrainingArguments,), "t", ["--output_dir", str(tmp_path)])
    assert args.precision_strategy == "collage-plus"
    assert args.precision_options == {"lost_arithmetic_metrics": True}
    (args,) = common.parse_args(
        (TrainingArguments,),
        "t",
        ["--output_dir", str(tmp_path), "--precision_strategy", "bf16-pure", "--precision_options", "{}"],
    )
    assert args.precision_strategy == "bf16-pure" and args.precision_options == {}
    assert args.use_cpu == (not torch.cuda.is_available())
    monkeypatch.setenv(common.ENV_STRATEGY, "collage-pls")
    with pytest.raises(ValueError, match="unknown precision strategy 'collage-pls'"):
        common.parse_args((TrainingArguments,), "t", ["--output_dir", str(tmp_path)])


def test_the_environments_options_stay_with_the_environments_strategy(monkeypatch, tmp_path, caplog):
    """$HF_LOWPREC_PRECISION_OPTIONS written for $HF_LOWPREC_PRECISION_STRATEGY=bf16-sr were given to the
    fp32 of the command line (ValueError: fp32 has no option 'seed'); under another strategy they are
    dropped with a warning naming both, under the variable's own they apply."""
    common = import_recipe("common")
    from hf_lowprec import TrainingArguments

    monkeypatch.setenv(common.ENV_STRATEGY, "bf16-sr")
    monkeypatch.setenv(common.ENV_OPTIONS, json.dumps({"fused": "reference", "seed": 3}))
    with caplog.at_level(logging.WARNING, logger="hf_lowprec"):
        (args,) = common.parse_args(
            (TrainingArguments,), "t", ["--output_dir", str(tmp_path), "--precision_strategy", "fp32"]
        )
    assert args.precision_strategy == "fp32" and args.precision_options is None
    assert "from $HF_LOWPREC_PRECISION_OPTIONS ignored: they were given for precision_strategy='bf16-sr'" in caplog.text
    assert "this run's precision_strategy is 'fp32'" in caplog.text
    (args,) = common.parse_args((TrainingArguments,), "t", ["--output_dir", str(tmp_path)])
    assert args.precision_strategy == "bf16-sr" and args.precision_options == {"fused": "reference", "seed": 3}
