"""The `hf-lowprec` command line: list, memory, compare (the wheel install: tests/test_wheel.py)."""

import csv
import struct
from pathlib import Path

import pytest

import hf_lowprec
from hf_lowprec.cli import main, memory_plan, strategy_rows
from hf_lowprec.compare import plot, run_compare, summary_table


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_list_names_every_strategy_with_its_bytes(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for row in strategy_rows():
        assert row["name"] in out
        assert row["summary"], f"{row['name']} has no one-line summary"
    assert {r["name"] for r in strategy_rows()} == set(hf_lowprec.available_strategies())


def test_memory_plan_of_gpt2_small_on_the_meta_device():
    rows = {r["strategy"]: r for r in memory_plan("gpt2", ["bf16-pure", "collage-plus", "bf16-mixed"])}
    # GPT-2 small: 124,439,808 parameters in 148 tensors (tied LM head counted once); the first step
    # gives each tensor its step count, a 0-dim FP64 tensor: 8 B a tensor beside the B/param.
    n, counts = 124_439_808, 8 * 148
    assert rows["bf16-pure"]["num_params"] == n
    assert round(rows["bf16-pure"]["total"] * n) == 8 * n + counts
    assert round(rows["collage-plus"]["total"] * n) == 12 * n + counts
    assert round(rows["collage-plus"]["extra"] * n) == 4 * n + counts  # δθ and δv, BF16 each
    assert round(rows["bf16-mixed"]["total"] * n) == 16 * n + counts


def test_memory_with_zero_splits_states_gradients_and_parameters(capsys):
    rows = memory_plan("bert-base", ["collage-plus"], world_size=4, zero_stage=2)
    # ZeRO-2 on 4 ranks: BF16 parameters stay whole (2), gradients (2) and states + components (8) split,
    # and the rank's BF16 weight partition (2 / 4) sits beside the whole model.
    assert rows[0]["per_rank_total"] == pytest.approx(2 + (2 + 8 + 2) / 4)
    assert (
        main(["memory", "--model", "bert-base", "--strategies", "bf16-pure", "--world-size", "4", "--zero-stage", "3"])
        == 0
    )
    out = capsys.readouterr().out
    assert "bf16-pure" in out and "GiB/rank" in out


def test_memory_marks_what_ddp_refuses():
    """Ranks without ZeRO are DDP: fp8-lm-o3 (FP8-LM's own ZeRO) is refused there, as DDP refuses it."""
    rows = {r["strategy"]: r for r in memory_plan("gpt2", ["fp8-lm-o3", "fp8-lm-o2"], world_size=8)}
    assert rows["fp8-lm-o3"]["zero"].startswith("precision strategy 'fp8-lm-o3' is not supported under torch DDP")
    assert rows["fp8-lm-o2"]["zero"] == "ok"


def test_memory_refuses_an_unknown_model_before_any_work():
    with pytest.raises(ValueError, match="--model must be one of"):
        memory_plan("gpt5", ["bf16-pure"])


def test_plot_draws_mean_and_range_over_seeds(tmp_path):
    steps = [
        {
            "strategy": s,
            "seed": seed,
            "step": k,
            "loss": 5.0 - 0.1 * k + 0.01 * seed,
            "precision/imprecision_pct": 10.0 * (s == "bf16-pure"),
            "precision/edq_ratio": 1.0,
        }
        for s in ("bf16-pure", "collage-plus")
        for seed in (0, 1, 2)
        for k in range(1, 6)
    ]
    summary = [
        {"strategy": s, "seed": seed, "bytes_per_param": b, "median_step_ms": 10.0, "peak_rss_mib": 500.0}
        for s, b in (("bf16-pure", 8.0), ("collage-plus", 12.0))
        for seed in (0, 1, 2)
    ]
    written = plot(steps, summary, tmp_path, title="synthetic")
    assert {p.name for p in written} == {"loss.png", "lost_arithmetic.png", "cost.png"}
    for path in written:
        width, height = _png_size(path)
        assert width >= 600 and height >= 400


@pytest.mark.slow
def test_compare_runs_the_recipe_per_strategy_and_writes_one_row_per_step(tmp_path):
    steps = 3
    summary = run_compare(
        "pretrain_clm",
        ["bf16-pure", "collage-plus"],
        seeds=[0],
        max_steps=steps,
        out=tmp_path,
        progress=False,
        extra_args=["--per_device_train_batch_size", "4"],
    )
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    for strategy in ("bf16-pure", "collage-plus"):
        mine = [r for r in rows if r["strategy"] == strategy]
        assert [int(r["step"]) for r in mine] == list(range(1, steps + 1))
        assert all(r["precision/imprecision_pct"] != "" for r in mine)  # lost-arithmetic metrics on by default
    by = {r["strategy"]: r for r in summary}
    assert by["bf16-pure"]["bytes_per_param"] == pytest.approx(8.0, abs=0.01)
    assert by["collage-plus"]["bytes_per_param"] == pytest.approx(12.0, abs=0.01)
    assert all(r["peak_rss_mib"] > 100 and r["eval_value"] > 1.0 for r in summary)
    # Beside each CPU row, the step `hf-lowprec plan` predicts on a GPU (issue #69).
    assert all(r["gpu_step_ms"] > 0 for r in summary)
    table = summary_table(summary, tmp_path / "results.csv")
    assert "H100 ms*" in table and "FP8 is emulated" in table and "fastest there:" in table
    for name in ("loss.png", "lost_arithmetic.png", "cost.png"):
        _png_size(tmp_path / name)


def test_compare_refuses_an_unknown_strategy_before_running(tmp_path):
    with pytest.raises(ValueError, match="unknown precision strategy"):
        run_compare("pretrain_clm", ["bf16-pure", "colage-plus"], seeds=[0], max_steps=2, out=tmp_path)
    assert not (tmp_path / "runs").exists()


def test_compare_refuses_an_unknown_recipe_naming_the_choices(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"in-package recipe .*pretrain_clm.*path of a recipe script"):
        run_compare("pretrain_gpt", ["bf16-pure"], seeds=[0], max_steps=2, out=tmp_path)
    with pytest.raises(SystemExit):
        main(["compare", "--recipe", "nowhere/recipe.py", "--strategies", "bf16-pure", "--out", str(tmp_path)])
    assert "neither an in-package recipe" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_maintainer_tools_are_not_user_subcommands(capsys):
    for command in ("readme", "bench"):
        with pytest.raises(SystemExit):
            main([command])
        assert "invalid choice" in capsys.readouterr().err


def test_the_result_counts_every_trainable_dtype_by_elements(tmp_path, capsys):
    """An FP8 strategy's trainable weights are FP32 (embeddings, norms) and FP16 (scaled GEMM
    masters): the result said "torch.float32", the first parameter's dtype, for the whole model."""
    from types import SimpleNamespace

    import torch

    from hf_lowprec.runner import write_result

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(8, 8).half())  # 6 FP32, 72 FP16
    frozen = torch.nn.Parameter(torch.zeros(100, dtype=torch.bfloat16), requires_grad=False)
    model.register_parameter("frozen", frozen)
    trainer = SimpleNamespace(
        state=SimpleNamespace(log_history=[], global_step=0),
        precision=SimpleNamespace(metrics=dict),
        model=model,
        optimizer=None,
    )
    args = SimpleNamespace(precision_strategy="fp8-lm-o2", world_size=1, process_index=0, output_dir=str(tmp_path))
    result = write_result(args, trainer)
    assert result["trainable_param_elements"] == {"torch.float16": 72, "torch.float32": 6}
    assert list(result["trainable_param_elements"]) == ["torch.float16", "torch.float32"]  # largest first
    assert result["trainable_param_dtype"] == "torch.float16"


def test_the_in_package_runner_shares_the_pretrain_clm_recipe_defaults():
    from pathlib import Path

    from hf_lowprec.runner import PRETRAIN_CLM_DEFAULTS, _parse

    _, args = _parse(["--output_dir", "unused"])
    for key, value in PRETRAIN_CLM_DEFAULTS.items():
        parsed = getattr(args, key)
        assert getattr(parsed, "value", parsed) == value, (key, parsed, value)
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "pretrain_clm.py"
    assert "**PRETRAIN_CLM_DEFAULTS" in recipe.read_text(), (
        "recipes/pretrain_clm.py must train with the runner's defaults"
    )


def _usage_error(argv, capsys) -> str:
    """Run the CLI; it must exit 2 with a one-line argparse error and no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and err.rstrip().endswith(errors[0]), err
    return errors[0]


@pytest.mark.parametrize(
    "argv, match",
    [
        (["compare", "--strategies", "nonexistent"], "unknown precision strategy 'nonexistent'"),
        (["compare", "--strategies", "bf16-pure", "--max_steps", "-3"], "--max_steps must be >= 1, got -3"),
        (["memory", "--model", "nonexistent"], "--model must be one of"),
        (["memory", "--strategies", "bf16-pur"], "Did you mean 'bf16-pure'"),
        (["compare", "--strategies", "bf16-pure", "--seeds", ","], "--seeds names no seed, got ','"),
    ],
)
def test_user_errors_are_usage_errors(argv, match, capsys, monkeypatch):
    import hf_lowprec.compare

    monkeypatch.setattr(hf_lowprec.compare, "run_compare", _no_training)
    assert match in _usage_error(argv, capsys)


@pytest.mark.parametrize(
    "environ, argv, match",
    [
        ({"HF_LOWPREC_PRECISION_STRATEGY": "colage-plus"}, [], "$HF_LOWPREC_PRECISION_STRATEGY='colage-plus'"),
        (
            {"HF_LOWPREC_PRECISION_STRATEGY": "fp32", "HF_LOWPREC_PRECISION_OPTIONS": "[1"},
            [],
            "$HF_LOWPREC_PRECISION_OPTIONS='[1'",
        ),
    ],
)
def test_launch_names_the_environment_variable_a_bad_value_came_from(environ, argv, match, capsys, monkeypatch):
    """No flag was typed: the error must say where the value came from, or the user cannot find it."""
    for variable, value in environ.items():
        monkeypatch.setenv(variable, value)
    line = _usage_error(["launch", *argv, "--", "python", "-c", "raise SystemExit(7)"], capsys)
    assert "(from the environment: " in line and match in line and "fix or unset it, or pass the flag)" in line
    # The flag wins over the variable, and a typed flag is not blamed on the environment.
    monkeypatch.setenv("HF_LOWPREC_PRECISION_STRATEGY", "fp32")
    monkeypatch.delenv("HF_LOWPREC_PRECISION_OPTIONS", raising=False)
    line = _usage_error(["launch", "--precision_strategy", "colage-plus", "--", "python"], capsys)
    assert "unknown precision strategy 'colage-plus'" in line and "from the environment" not in line


def test_a_launch_error_names_the_command_once(tmp_path, capsys):
    line = _usage_error(["launch", "--", str(tmp_path / "absent.py")], capsys)
    assert line == f"hf-lowprec launch: error: '{tmp_path / 'absent.py'}' does not exist", line


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly(tmp_path):
    """`hf-lowprec list | head -0`: the status of a command SIGPIPE ended, and no traceback."""
    import subprocess
    import sys

    from tests.launching import subprocess_env

    proc = subprocess.Popen(
        [sys.executable, "-m", "hf_lowprec", "list"],
        cwd=tmp_path,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()  # before the command has written anything
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141 and err == "", err


def test_launch_takes_the_variables_options_only_with_the_variables_strategy(capsys, monkeypatch):
    """$HF_LOWPREC_PRECISION_OPTIONS set for fp16-als's weights='sr' must not go to a strategy typed
    on the command line (collage-plus has no such option; another's guard was switched on silently)."""
    import hf_lowprec.integrations.launch as launch

    given = []
    monkeypatch.setattr(launch, "run", lambda command, strategy, options: given.append((strategy, options)))
    monkeypatch.setenv("HF_LOWPREC_PRECISION_STRATEGY", "fp16-als")
    monkeypatch.setenv("HF_LOWPREC_PRECISION_OPTIONS", '{"weights": "sr"}')
    main(["launch", "--precision_strategy", "collage-plus", "--", "python", "x.py"])
    assert "$HF_LOWPREC_PRECISION_OPTIONS ignored: --precision_strategy was given" in capsys.readouterr().err
    main(["launch", "--", "python", "x.py"])
    assert given == [("collage-plus", None), ("fp16-als", '{"weights": "sr"}')]


def _no_training(*args, **kwargs):
    raise AssertionError("training started before the arguments were checked")


def test_memory_checks_the_config_it_is_given(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "gpt2", "n_layer": -2}')
    line = _usage_error(["memory", "--model", str(config), "--strategies", "bf16-pure"], capsys)
    assert f"--model {config}: n_layer must be a positive integer, got -2" in line


@pytest.mark.parametrize(
    "recipe_args, match",
    [
        # bf16-mixed trains the optimizer `optim` names; collage-plus builds its own: refused before bf16-mixed runs.
        (["--optim", "adafactor"], "under precision_strategy='collage-plus': precision_strategy='collage-plus' builds"),
        (["--learning_rate", "abc"], "under precision_strategy='bf16-mixed': argument --learning_rate"),
        (["--fp16"], "under precision_strategy='bf16-mixed': precision_strategy='bf16-mixed' computes in"),
    ],
)
def test_compare_checks_the_recipe_arguments_under_every_strategy_before_training(
    tmp_path, capsys, monkeypatch, recipe_args, match
):
    import hf_lowprec.compare

    monkeypatch.setattr(hf_lowprec.compare, "run_compare", _no_training)
    argv = ["compare", "--strategies", "bf16-mixed,collage-plus", "--out", str(tmp_path), "--", *recipe_args]
    assert match in _usage_error(argv, capsys)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "recipe_args, match",
    [
        # Given again after --, the last would win: rows labelled bf16-mixed that trained fp32, ran 5 steps, ...
        (["--precision_strategy", "fp32"], "--precision_strategy after -- is set by compare itself (one per run: "),
        (["--max_steps", "5"], "--max_steps after -- is set by compare itself (give --max_steps before --)"),
        (["--max-steps=5"], "--max-steps after -- is set by compare itself (give --max_steps before --)"),
        (["--seed", "3"], "--seed after -- is set by compare itself (one per run: name them with --seeds)"),
        (["--output_dir", "x"], "--output_dir after -- is set by compare itself (OUT/runs/STRATEGY-seedN: "),
        (["--precision_options", "{}"], "--precision_options after -- is set by compare itself (the lost-arithmetic"),
        (["--logging_steps", "5"], "--logging_steps after -- is set by compare itself"),
        # Unknown to the recipe: it failed in the first run, with a traceback.
        (["--bogus_flag", "3"], "the recipe pretrain_clm has no option --bogus_flag (its options: python -m "),
        (["--learning_rat", "1e-3"], "no option --learning_rat (did you mean --learning_rate?)"),
    ],
)
def test_compare_refuses_its_own_and_unknown_recipe_arguments_before_training(
    tmp_path, capsys, monkeypatch, recipe_args, match
):
    import hf_lowprec.compare

    monkeypatch.setattr(hf_lowprec.compare, "run_compare", _no_training)
    argv = ["compare", "--strategies", "bf16-mixed", "--out", str(tmp_path), "--", *recipe_args]
    line = _usage_error(argv, capsys)
    assert match in line and line.endswith("no run was started"), line
    assert not (tmp_path / "runs").exists()


def test_the_recipe_arguments_check_leaves_the_recipes_own_options_alone():
    """Options of the recipe's own (the runner's `--block_size`; a script's `--task_name`, which
    abbreviation would take for a TrainingArguments prefix) pass the check untouched; with
    --no-metrics, `--precision_options` is the user's to give."""
    from hf_lowprec.compare import check_recipe_arguments

    check_recipe_arguments(["bf16-mixed", "collage-plus"], ["--block_size", "32", "--vocab-size=512"])
    check_recipe_arguments(["bf16-mixed"], ["--precision_options", "{}"], metrics=False)
    script = str(Path(__file__).resolve().parents[1] / "recipes" / "finetune_glue.py")
    check_recipe_arguments(["bf16-mixed"], ["--task_name", "sst2", "--max_seq_length", "32"], recipe=script)
    with pytest.raises(ValueError, match=r"finetune_glue\.py has no option --block_size"):
        check_recipe_arguments(["bf16-mixed"], ["--block_size", "32"], recipe=script)


def test_compare_keeps_the_finished_runs_when_a_later_one_fails(tmp_path, capsys, monkeypatch):
    """The CSVs are written after every run: the second strategy's failure loses not the first's
    row, and the command ends with the failure's message and exit 1, not a traceback."""
    import hf_lowprec.compare

    def one_run(command, cwd, strategy, seed, *args):
        if strategy == "collage-plus":
            raise RuntimeError(f"recipe with {strategy!r} (seed {seed}) failed with exit code 1")
        history = [{"loss": 2.5, "step": 1, "learning_rate": 1e-3}]
        return {"result": {"final_loss": 2.5}, "history": history, "peak_rss_mib": 1.0, "wall_s": 1.0}

    monkeypatch.setattr(hf_lowprec.compare, "_run_one", one_run)
    argv = ["compare", "--strategies", "bf16-pure,collage-plus", "--out", str(tmp_path), "--no-progress"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "'collage-plus' (seed 0) failed with exit code 1" in err
    assert f"the runs before it: {tmp_path / 'summary.csv'}" in err
    with open(tmp_path / "summary.csv") as f:
        assert [r["strategy"] for r in csv.DictReader(f)] == ["bf16-pure"]
    with open(tmp_path / "results.csv") as f:
        assert [(r["strategy"], r["loss"]) for r in csv.DictReader(f)] == [("bf16-pure", "2.5")]


def test_compare_reads_the_metric_a_recipe_names_for_its_task(tmp_path, monkeypatch):
    """finetune_glue reports its task's metric as `primary_metric` (cola: Matthews correlation):
    the summary row takes that name and value, not the script's default `eval_accuracy` (which
    the run does not hold: the value was left empty and the table printed nan)."""
    import hf_lowprec.compare

    def one_run(command, cwd, strategy, seed, *args):
        result = {
            "final_loss": 0.5,
            "glue": {"matthews_correlation": 0.25},
            "primary_metric": "eval_matthews_correlation",
            "eval_matthews_correlation": 0.25,
        }
        return {"result": result, "history": [{"loss": 0.5, "step": 1}], "peak_rss_mib": 1.0, "wall_s": 1.0}

    monkeypatch.setattr(hf_lowprec.compare, "_run_one", one_run)
    monkeypatch.setattr(hf_lowprec.compare, "plot", lambda *args, **kwargs: None)
    monkeypatch.setattr(hf_lowprec.compare, "check_recipe_arguments", lambda *args: None)
    glue = Path(__file__).resolve().parents[1] / "recipes" / "finetune_glue.py"
    summary = run_compare(str(glue), ["bf16-pure"], seeds=[0], max_steps=1, out=tmp_path, progress=False)
    assert [(r["eval_metric"], r["eval_value"]) for r in summary] == [("eval_matthews_correlation", 0.25)]
    with open(tmp_path / "summary.csv") as f:
        assert [(r["eval_metric"], r["eval_value"]) for r in csv.DictReader(f)] == [
            ("eval_matthews_correlation", "0.25")
        ]


def test_compare_checks_out_is_writable_before_training(tmp_path, capsys, monkeypatch):
    import hf_lowprec.compare

    monkeypatch.setattr(hf_lowprec.compare, "run_compare", _no_training)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    line = _usage_error(["compare", "--strategies", "bf16-pure", "--out", str(blocked / "out")], capsys)
    assert f"--out {blocked / 'out'} is not writable" in line
