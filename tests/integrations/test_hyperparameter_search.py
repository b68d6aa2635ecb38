"""`Trainer.hyperparameter_search` over `precision_strategy` and `precision_options`: each trial trains
under its own strategy and options, checked as `TrainingArguments` checks them, with its own report.

Optuna is not among the test dependencies: the trials run through the stock `train(trial=...)` path
that `hyperparameter_search(backend="optuna")` takes (`hp_search_backend`, `hp_space(trial)`), with a
trial object carrying what the Trainer reads of an Optuna trial (`number`, `params`)."""

import json

import pytest
import torch
import transformers.integrations
from transformers.trainer_utils import HPSearchBackend

from hf_lowprec import Trainer, TrainingArguments
from tests.helpers import TokenBlocks, assert_bits_equal, logged_losses, make_args, tiny_gpt2, trainer_arguments


class _Trial:
    """What the stock Trainer reads of an `optuna.Trial` outside evaluation and saving."""

    def __init__(self, number: int, params: dict) -> None:
        self.number, self.params = number, params


@pytest.fixture
def searching(monkeypatch):
    """A Trainer set up as `hyperparameter_search(backend="optuna")` sets it, over trials `space[k]`;
    `calls` counts `hp_space` calls per trial number."""
    # The trial's params for the state's `trial_params` (transformers reads them from an optuna Trial).
    monkeypatch.setattr(transformers.integrations, "hp_params", lambda trial: trial.params)
    calls: dict[int, int] = {}

    def build(args, space, **kwargs):
        trainer = Trainer(args=args, train_dataset=TokenBlocks(8), **kwargs)
        trainer.hp_search_backend = HPSearchBackend.OPTUNA

        def hp_space(trial):
            calls[trial.number] = calls.get(trial.number, 0) + 1
            return space[trial.number]

        trainer.hp_space = hp_space
        return trainer

    build.calls = calls
    return build


def test_each_trial_trains_with_its_own_strategy_and_options(tmp_path, searching):
    """The stock train() calls model_init before it sets the trial's arguments: trial 0 (fp16-als) trained
    bf16-mixed's FP32 weights under BF16Mixed, trial 1 (bf16-pure) FP16 weights under FP16ALS, each with
    the previous trial's options, and trial 1 had no report. Each trial now trains bit for bit as a fresh
    run under its strategy and options (a JSON string, as Optuna's categorical choices give them)."""
    space = [
        {"precision_strategy": "fp16-als", "learning_rate": 2e-3},
        {
            "precision_strategy": "bf16-pure",
            "precision_options": '{"lost_arithmetic_metrics": true}',
            "learning_rate": 3e-3,
        },
    ]
    searched = searching(
        make_args(tmp_path / "search", "bf16-mixed", max_steps=2), space, model_init=lambda: tiny_gpt2()
    )
    for number, params in enumerate(space):
        searched.train(trial=_Trial(number, params))
        fresh = Trainer(
            model_init=lambda: tiny_gpt2(),
            args=TrainingArguments(**trainer_arguments(tmp_path / f"fresh-{number}", max_steps=2, **params)),
            train_dataset=TokenBlocks(8),
        )
        fresh.train()
        assert type(searched.precision) is type(fresh.precision)
        assert searched.precision.options == fresh.precision.options
        assert logged_losses(searched) == logged_losses(fresh)
        assert set(searched.state.log_history[0]) == set(fresh.state.log_history[0])  # the options' metrics
        for a, b in zip(searched.model.parameters(), fresh.model.parameters(), strict=True):
            assert_bits_equal(a, b)  # dtypes and bits
        report = json.loads((tmp_path / "search" / "precision_report.json").read_text())
        assert report["strategy"] == params["precision_strategy"] and report["violations"] == []
        assert (
            report["options"]
            == json.loads((tmp_path / f"fresh-{number}" / "precision_report.json").read_text())["options"]
        )
        assert searching.calls[number] == 1  # hp_space once per trial, as the stock Trainer calls it
    assert searched.args.precision_options == {"lost_arithmetic_metrics": True}  # parsed as the arguments parse it
    assert {p.dtype for p in searched.model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize(
    "params, message",
    [
        ({"precision_strategy": "collage-pls"}, "unknown precision strategy 'collage-pls'"),
        ({"precision_options": {"x": 1}}, "no option"),
        ({"precision_options": "{not json"}, "JSON object"),
        ({"precision_strategy": "fp16-als", "bf16": True}, "remove bf16=True"),
        ({"precision_strategy": "bf16-pure", "optim": "sgd"}, "remove --optim"),
        ({"precision_strategy": None}, "precision_strategy=None"),
    ],
)
def test_a_bad_trial_is_refused_as_the_arguments_refuse_it_before_its_model_is_built(
    tmp_path, searching, params, message
):
    built = []
    trainer = searching(
        make_args(tmp_path, "bf16-mixed", max_steps=1), [params], model_init=lambda: built.append(1) or tiny_gpt2()
    )
    built.clear()  # the Trainer's own model_init call
    with pytest.raises(ValueError, match=message):
        trainer.train(trial=_Trial(0, params))
    assert built == []
    if "precision_strategy" in params and params["precision_strategy"] is not None:
        with pytest.raises(ValueError, match=message):  # the same refusal as the arguments'
            TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **params)
    assert trainer.args.precision_strategy == "bf16-mixed" and trainer.args.bf16 is False


def test_a_precision_search_without_a_strategy_or_model_init_or_under_fsdp_is_refused(tmp_path, searching):
    """Without a strategy the Trainer has none of its optimizer, callbacks or loss scaling; without
    model_init the model was prepared once, by the arguments' strategy, when the Trainer was built;
    under FSDP (DeepSpeed likewise) the engine's setup for the strategy ran in `__init__`."""
    space = [{"precision_strategy": "bf16-pure"}]
    stock = searching(make_args(tmp_path / "stock", None, max_steps=1), space, model_init=lambda: tiny_gpt2())
    with pytest.raises(ValueError, match="built without a precision_strategy; set precision_strategy"):
        stock.train(trial=_Trial(0, space[0]))
    passed = searching(make_args(tmp_path / "passed", "bf16-mixed", max_steps=1), space, model=tiny_gpt2())
    with pytest.raises(ValueError, match="needs model_init="):
        passed.train(trial=_Trial(0, space[0]))
    assert passed.args.precision_strategy == "bf16-mixed"
    sharded = searching(make_args(tmp_path / "fsdp", "bf16-mixed", max_steps=1), space, model_init=lambda: tiny_gpt2())
    sharded.is_fsdp_enabled = True  # (as an FSDP config sets it; the refusal comes before Accelerate's setup)
    with pytest.raises(ValueError, match="under FSDP, whose setup for the strategy ran once"):
        sharded.train(trial=_Trial(0, space[0]))
