"""`hf_lowprec.Trainer` against the stock `transformers.Trainer`, same script and seed.

- Every method the package overrides takes the stock signature (installed transformers and TRL).
- No strategy (directly, or under `hf-lowprec launch` without one): the stock files, resume and
  error messages. With a strategy, a resume the stock Trainer refuses is refused with the stock
  exception type and message first.
- `fp32`, `bf16-mixed`, `fp16-mixed` take the user's optimizer and scheduler as `bf16=True`
  does: bit-identical losses and weights against plain FP32 / `bf16=True`. Strategies with their
  own optimizer refuse them; a scheduler object over `trainer.create_optimizer()` works. On a
  CPU stock `fp16=True` trains in FP32 (Accelerate's FP16 autocast is off there), fp16-mixed in FP16.
- Stock behaviours (callbacks, evaluation, checkpoint rotation, best-model loading, gradient
  accumulation, resume mid-epoch, `train()` call forms) with no strategy, `fp32` and `bf16-mixed`.

The baselines' comparisons use non-AdamW optimizers: for the AdamW `optim` names the strategy
runs its own AdamW (the same rule as torch's, not bit-identical to torch's fused kernel), which
the README's table says.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers.training_args import OptimizerNames

import hf_lowprec
from hf_lowprec import Trainer, TrainingArguments
from hf_lowprec.checkpoints.resume import MANIFEST
from hf_lowprec.integrations.optimizer_arguments import ADAMW_OPTIMS
from hf_lowprec.integrations.trainer import REPORT_FILE
from hf_lowprec.strategies.interface import StrategyOptimizer
from hf_lowprec.strategies.registry import available_strategies, get_strategy
from tests.helpers import TokenBlocks, assert_bits_equal, finite, tiny_gpt2, trainer_arguments

ROOT = Path(__file__).resolve().parents[2]
# The stock Trainer's flags doing what each configuration does (None: no precision_strategy).
STOCK_FLAGS = {None: {}, "fp32": {}, "bf16-mixed": {"bf16": True}}
LOGGED = ("loss", "eval_loss", "learning_rate", "grad_norm")


def make(kind, out, *, stock: bool, trainer_kw=None, examples: int = 12, **kw):
    """A Trainer (ours with `precision_strategy=kind`, or the stock one with `STOCK_FLAGS[kind]`)."""
    base = trainer_arguments(out, max_steps=3, save_strategy="no", optim="sgd")
    base.update(kw)
    if stock:
        args, cls = transformers.TrainingArguments(**base, **STOCK_FLAGS.get(kind, {})), transformers.Trainer
    else:
        args, cls = TrainingArguments(**base, precision_strategy=kind), Trainer
    model = tiny_gpt2()
    extra = trainer_kw(model) if callable(trainer_kw) else dict(trainer_kw or {})
    eval_dataset = TokenBlocks(8, seed=2) if base.get("eval_strategy", "no") != "no" else None
    return cls(model=model, args=args, train_dataset=TokenBlocks(examples), eval_dataset=eval_dataset, **extra)


def logged(trainer) -> list[dict]:
    """The log history's stock keys (the strategy's `precision/…` metrics are its own)."""
    rows = [{k: h[k] for k in LOGGED if k in h} | {"step": h["step"]} for h in trainer.state.log_history]
    finite([r["loss"] for r in rows if "loss" in r])
    return [r for r in rows if len(r) > 1]


def assert_same_training(ours, stock) -> None:
    assert logged(ours) == logged(stock)
    a, b = ours.model.state_dict(), stock.model.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert_bits_equal(a[name], b[name], name)


# --- signatures -------------------------------------------------------------------------------


def _call_interface(function) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def _overrides(cls: type, stock: type) -> dict[str, object]:
    """The functions hf_lowprec's classes in `cls`'s MRO define over a method of `stock`."""
    found = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.startswith("hf_lowprec"):
            for name, value in vars(klass).items():
                if inspect.isfunction(value) and callable(getattr(stock, name, None)) and name != "__init_subclass__":
                    found[name] = getattr(cls, name)
    return found


def _pairs():
    from hf_lowprec import trl as hl_trl

    trl = pytest.importorskip("trl")
    yield Trainer, transformers.Trainer
    yield hf_lowprec.Seq2SeqTrainer, transformers.Seq2SeqTrainer
    yield hf_lowprec.Seq2SeqTrainingArguments, transformers.Seq2SeqTrainingArguments
    for kind in hl_trl.TRAINER_KINDS:
        yield getattr(hl_trl, f"{kind}Trainer"), getattr(trl, f"{kind}Trainer")
        yield getattr(hl_trl, f"{kind}Config"), getattr(trl, f"{kind}Config")


def test_overridden_methods_take_the_stock_signatures():
    checked = []
    for ours, stock in _pairs():
        for name, function in _overrides(ours, stock).items():
            mine, theirs = _call_interface(function), _call_interface(getattr(stock, name))
            if name == "__init__" and issubclass(stock, transformers.TrainingArguments):
                # The dataclass appends precision_strategy, precision_options, resume_reset, with defaults.
                assert mine[: len(theirs)] == theirs, (ours, name)
                assert all(p[2] is not inspect.Parameter.empty for p in mine[len(theirs) :]), (ours, name)
            else:
                assert mine == theirs, f"{ours.__name__}.{name}{inspect.signature(function)} vs stock"
            checked.append(f"{ours.__name__}.{name}")
    # The overrides that matter are found (the walk is not vacuous).
    for name in (
        "Trainer.__init__",
        "Trainer.train",
        "Trainer.compute_loss_context_manager",
        "Trainer.log",
        "Seq2SeqTrainer.prediction_step",
        "Seq2SeqTrainingArguments.__init__",
        "DPOTrainer.__init__",
    ):
        assert name in checked, checked


def test_positional_arguments_reach_the_stock_parameters(tmp_path):
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import GPT2LMHeadModel

    from hf_lowprec.data import build_tokenizer, tiny_gpt2_config
    from hf_lowprec.trl import DPOConfig, DPOTrainer

    tokenizer = build_tokenizer()
    config = tiny_gpt2_config(len(tokenizer))
    data = Dataset.from_dict({"prompt": ["a b"] * 4, "chosen": [" c"] * 4, "rejected": [" d"] * 4})
    args = DPOConfig(output_dir=str(tmp_path), precision_strategy="bf16-pure", use_cpu=True, report_to=[])
    # DPO's ref_model given by position is converted by the strategy, as one given by keyword is.
    trainer = DPOTrainer(
        GPT2LMHeadModel(config), GPT2LMHeadModel(config), args, train_dataset=data, processing_class=tokenizer
    )
    assert next(trainer.ref_model.parameters()).dtype == torch.bfloat16


# --- no strategy: the stock Trainer -----------------------------------------------------------


def _tree(out: Path) -> dict[str, list[str]]:
    return {str(d.relative_to(out)): sorted(os.listdir(d)) for d in [out, *sorted(out.glob("checkpoint-*"))]}


def _state(path: Path) -> dict:
    return json.loads((path / "trainer_state.json").read_text())


def _error(call) -> BaseException:
    with pytest.raises(Exception) as info:
        call()
    return info.value


def test_no_strategy_writes_resumes_and_refuses_as_the_stock_trainer(tmp_path):
    runs = {}
    for stock in (True, False):
        out = tmp_path / ("stock" if stock else "ours")
        trainer = make(None, out, stock=stock, max_steps=4, save_strategy="steps", save_steps=2)
        trainer.train()
        runs[stock] = (out, trainer)
    (stock_out, stock_run), (our_out, our_run) = runs[True], runs[False]
    assert_same_training(our_run, stock_run)
    assert _tree(our_out) == _tree(stock_out)
    assert not list(our_out.rglob(MANIFEST)) and not list(our_out.rglob(REPORT_FILE))
    for checkpoint in ("checkpoint-2", "checkpoint-4"):
        assert _state(our_out / checkpoint) == _state(stock_out / checkpoint)
        ours, theirs = (d / checkpoint / "model.safetensors" for d in (our_out, stock_out))
        assert ours.read_bytes() == theirs.read_bytes()

    # Resume mid-run from checkpoint-2, positionally (resume_from_checkpoint, trial).
    resumed = {}
    for stock, out in ((True, stock_out), (False, our_out)):
        trainer = make(None, tmp_path / f"resumed-{stock}", stock=stock, max_steps=4)
        trainer.train(str(out / "checkpoint-2"), None)
        resumed[stock] = trainer
    assert_same_training(resumed[False], resumed[True])

    # The stock refusals, word for word.
    empty = tmp_path / "empty"
    for resume in (str(tmp_path / "nowhere"), True):
        errors = [
            _error(lambda s=stock, r=resume: make(None, empty, stock=s).train(resume_from_checkpoint=r))
            for stock in (True, False)
        ]
        assert type(errors[0]) is type(errors[1]) and str(errors[0]) == str(errors[1]), errors


def test_resume_refusals_with_a_strategy_lead_with_the_stock_error(tmp_path):
    weights_only = tmp_path / "weights-only"  # a checkpoint whose trainer_state.json is missing
    tiny_gpt2().save_pretrained(weights_only)
    empty = tmp_path / "empty"
    for resume in (str(tmp_path / "nowhere"), True, str(weights_only)):
        stock = _error(lambda r=resume: make(None, empty, stock=True).train(resume_from_checkpoint=r))
        ours = _error(lambda r=resume: make("fp32", empty, stock=False).train(resume_from_checkpoint=r))
        assert isinstance(ours, type(stock)) and isinstance(ours, ValueError), (stock, ours)
        assert str(ours).startswith(str(stock)) and len(str(ours)) > len(str(stock)), (stock, ours)


LAUNCHED_SCRIPT = """
import json, sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

out = sys.argv[1]
ids = torch.randint(0, 256, (12, 16), generator=torch.Generator().manual_seed(1))
data = [{"input_ids": i, "labels": i} for i in ids]
def trainer(directory, steps):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    args = TrainingArguments(directory, max_steps=steps, per_device_train_batch_size=4, save_steps=2, logging_steps=1,
                             report_to=[], use_cpu=True, disable_tqdm=True, optim="sgd")
    return Trainer(model=model, args=args, train_dataset=data)
first = trainer(out, 3)
first.train()
second = trainer(out, 3)
second.train(resume_from_checkpoint=True)
errors = []
for resume in (out + "/nowhere", True):
    try:
        trainer(out + "/empty", 1).train(resume_from_checkpoint=resume)
    except Exception as err:
        errors.append(f"{type(err).__name__}: {err}")
files = {d: sorted(__import__("os").listdir(f"{out}/{d}")) for d in ("checkpoint-2", "checkpoint-3")}
print(json.dumps({"logs": [first.state.log_history, second.state.log_history[-2]], "errors": errors,
                  "files": files, "trainer": type(first).__module__}))
"""


def test_a_stock_script_runs_unchanged_under_the_launcher_without_strategy(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(LAUNCHED_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_LOWPREC_PRECISION")}
    env["PYTHONPATH"] = str(ROOT)
    results = {}
    for launched in (False, True):
        out = tmp_path / f"out-{launched}"
        prefix = [sys.executable, "-m", "hf_lowprec", "launch", "--"] if launched else []
        command = [*prefix, sys.executable, str(script), str(out)]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        results[launched] = json.loads(proc.stdout.strip().splitlines()[-1].replace(str(out), "OUT"))
    stock, launched = results[False], results[True]
    assert (
        launched.pop("trainer") == "hf_lowprec.integrations.trainer" and stock.pop("trainer") == "transformers.trainer"
    )
    for run in (stock, launched):  # wall-clock figures differ between any two runs
        for row in [*run["logs"][0], run["logs"][1]]:
            for key in [k for k in row if k.endswith(("_runtime", "_per_second"))]:
                del row[key]
    assert launched == stock


# --- the baselines take your optimizer and scheduler --------------------------------------------


def _cpu_optims() -> list[str]:
    """The `optim` names transformers builds here (no optional package missing), AdamW ones apart."""
    names = []
    for name in OptimizerNames:
        args = transformers.TrainingArguments(output_dir="unused", optim=name.value, use_cpu=True, report_to=[])
        try:
            transformers.Trainer.get_optimizer_cls_and_kwargs(args, tiny_gpt2())
        except (ImportError, ValueError):
            continue
        if name.value not in ADAMW_OPTIMS:
            names.append(name.value)
    return names


def _sgd(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=3e-3, momentum=0.9)
    return {"optimizers": (optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step))}


def _plateau(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=3e-3)
    return {"optimizers": (optimizer, torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5))}


OPTIMIZER_CASES = {
    "optimizers=(SGD, LambdaLR)": ({}, _sgd),
    "optimizer_cls_and_kwargs": ({}, {"optimizer_cls_and_kwargs": (torch.optim.Adagrad, {"lr": 3e-3})}),
    "ReduceLROnPlateau": (
        {"eval_strategy": "steps", "eval_steps": 1, "metric_for_best_model": "eval_loss", "max_steps": 4},
        _plateau,
    ),
    **{f"optim={name}": ({"optim": name}, {}) for name in _cpu_optims()},
}


@pytest.mark.parametrize("case", list(OPTIMIZER_CASES))
@pytest.mark.parametrize("strategy", ["fp32", "bf16-mixed"])
def test_baseline_strategies_train_your_optimizer_as_the_stock_flags_do(tmp_path, strategy, case):
    arguments, trainer_kw = OPTIMIZER_CASES[case]
    ours = make(strategy, tmp_path / "ours", stock=False, trainer_kw=trainer_kw, **arguments)
    stock = make(strategy, tmp_path / "stock", stock=True, trainer_kw=trainer_kw, **arguments)
    ours.train()
    stock.train()
    assert isinstance(ours.optimizer.optimizer, StrategyOptimizer)
    assert type(ours.optimizer.optimizer.optimizer) is type(stock.optimizer.optimizer)
    assert_same_training(ours, stock)
    if case == "ReduceLROnPlateau":
        assert len({r["learning_rate"] for r in logged(ours) if "learning_rate" in r}) > 1  # it did reduce


def test_fp16_mixed_trains_your_optimizer_under_its_loss_scale(tmp_path):
    # FP16 matmuls are slow on CPUs without FP16 arithmetic: construction and one step.
    for arguments, trainer_kw in [({}, _sgd), ({"optim": "adagrad"}, {})]:
        trainer = make("fp16-mixed", tmp_path, stock=False, trainer_kw=trainer_kw, max_steps=1, **arguments)
        before = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.train()
        inner = trainer.optimizer.optimizer
        assert isinstance(inner, StrategyOptimizer) and not isinstance(inner.optimizer, StrategyOptimizer)
        assert trainer.precision.skipped_steps == 0
        assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
        assert trainer.state.log_history[0]["precision/loss_scale"] == 2.0**16


class _FP16AutocastTrainer(transformers.Trainer):
    """The stock Trainer with its loss computed under FP16 autocast on the CPU."""

    def autocast_smart_context_manager(self, cache_enabled=True):
        return torch.autocast("cpu", dtype=torch.float16)


def test_fp16_mixed_on_a_cpu_computes_in_fp16_where_stock_fp16_true_computes_in_fp32(tmp_path):
    """Stock `fp16=True` on a CPU trains in FP32: Accelerate enables FP16 autocast and GradScaler
    only off the CPU, so its step-1 loss is FP32's bit for bit (4.551743030548096 on the GPT-2 of
    docs/strategies/fp16.md), where fp16-mixed's (4.551736354827881) is FP16 autocast's, as on a
    GPU. The difference is the autocast alone: the stock Trainer with its loss under FP16 autocast
    gives fp16-mixed's step-1 loss bit for bit. docs/strategies/fp16.md says so."""

    def first_loss(trainer):
        trainer.train()
        return logged(trainer)[0]["loss"]

    base = trainer_arguments(tmp_path / "stock", max_steps=1, save_strategy="no", optim="sgd")
    data = TokenBlocks(12)
    stock_fp16 = transformers.Trainer(
        model=tiny_gpt2(), args=transformers.TrainingArguments(**base, fp16=True), train_dataset=data
    )
    assert not stock_fp16.accelerator.native_amp and stock_fp16.accelerator.scaler is None
    fp32 = first_loss(make(None, tmp_path / "fp32", stock=True, max_steps=1))
    assert first_loss(stock_fp16) == fp32
    autocast = _FP16AutocastTrainer(model=tiny_gpt2(), args=transformers.TrainingArguments(**base), train_dataset=data)
    ours = first_loss(make("fp16-mixed", tmp_path / "ours", stock=False, max_steps=1))
    assert ours == first_loss(autocast) and ours != fp32
    assert "## `fp16=True` on a CPU" in (ROOT / "docs/strategies/fp16.md").read_text()


OWN_OPTIMIZER = [name for name in available_strategies() if not get_strategy(name).takes_user_optimizer]


@pytest.mark.parametrize("strategy", OWN_OPTIMIZER)
def test_strategies_with_their_own_optimizer_refuse_yours(tmp_path, strategy):
    assert {"fp32", "bf16-mixed", "fp16-mixed"}.isdisjoint(OWN_OPTIMIZER) and "collage-plus" in OWN_OPTIMIZER
    with pytest.raises(ValueError, match="drop `optimizers=`"):
        make(strategy, tmp_path, stock=False, trainer_kw=_sgd, optim="adamw_torch")
    with pytest.raises(ValueError, match="drop optimizer_cls_and_kwargs="):
        cls_and_kwargs = {"optimizer_cls_and_kwargs": (torch.optim.SGD, {})}
        make(strategy, tmp_path, stock=False, trainer_kw=cls_and_kwargs, optim="adamw_torch")
    with pytest.raises(ValueError, match="builds its own AdamW, but optim='sgd'"):
        make(strategy, tmp_path, stock=False)


def test_a_scheduler_object_over_the_strategys_optimizer(tmp_path):
    # docs/recipes.md: build the strategy's optimizer through the trainer, then the scheduler over it.
    trainer = make("collage-plus", tmp_path, stock=False, optim="adamw_torch")
    optimizer = trainer.create_optimizer()
    trainer.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    trainer.train()
    assert isinstance(trainer.optimizer.optimizer, StrategyOptimizer)
    rates = [r["learning_rate"] for r in logged(trainer) if "learning_rate" in r]
    assert rates == [3e-3 * 0.5**k for k in range(3)]  # powers of two: exact


# --- stock behaviours through the package's Trainer --------------------------------------------


class Recorder(transformers.TrainerCallback):
    """Every event, with the step and the metrics it carries."""

    def __init__(self):
        self.events = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            return lambda args, state, control, **kw: self.events.append(
                (name, state.global_step, json.dumps(kw.get("metrics") or kw.get("logs"), default=str, sort_keys=True))
            )
        return super().__getattribute__(name)


def _events(recorder) -> list[tuple]:
    # Timings and the strategy's metrics are no stock event content.
    def clean(text):
        if text == "null":
            return text
        values = json.loads(text)
        return {k: v for k, v in values.items() if k in LOGGED or k == "epoch"}

    return [(name, step, clean(text)) for name, step, text in recorder.events]


BEHAVIOURS = dict(
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,  # 12 examples: 3 steps an epoch
    max_steps=5,
    eval_strategy="steps",
    eval_steps=2,
    save_strategy="steps",
    save_steps=2,
    save_total_limit=1,
    load_best_model_at_end=True,
    metric_for_best_model="eval_loss",
)


@pytest.mark.parametrize("strategy", [None, "fp32", "bf16-mixed"])
def test_stock_behaviours_through_the_package(tmp_path, strategy):
    runs = {}
    for stock in (True, False):
        recorder = Recorder()
        out = tmp_path / ("stock" if stock else "ours")
        trainer = make(strategy, out, stock=stock, trainer_kw={"callbacks": [recorder]}, **BEHAVIOURS)
        trainer.train(None, None, ["past_key_values"])  # train(resume_from_checkpoint, trial, ignore_keys_for_eval)
        runs[stock] = (trainer, recorder, out)
    (stock, stock_events, stock_out), (ours, our_events, our_out) = runs[True], runs[False]
    assert_same_training(ours, stock)  # losses, eval losses, learning rates; the best model's weights
    assert _events(our_events) == _events(stock_events)
    # Rotation kept the same checkpoints; a strategy adds its report (the README's table).
    assert set(os.listdir(our_out)) == set(os.listdir(stock_out)) | ({REPORT_FILE} if strategy else set())
    assert Path(ours.state.best_model_checkpoint).name == Path(stock.state.best_model_checkpoint).name
    stock_callbacks = [type(c) for c in stock.callback_handler.callbacks]
    assert [type(c) for c in ours.callback_handler.callbacks][: len(stock_callbacks)] == stock_callbacks

    # Resume mid-epoch (step 4 of 3-step epochs) from the last checkpoint, both forms of the call.
    resumed = {}
    for is_stock, out in ((True, stock_out), (False, our_out)):
        trainer = make(strategy, tmp_path / f"resumed-{is_stock}", stock=is_stock, **BEHAVIOURS)
        if is_stock:
            trainer.train(resume_from_checkpoint=str(out / "checkpoint-4"))
        else:
            trainer.train(str(out / "checkpoint-4"))
        resumed[is_stock] = trainer
    assert resumed[False].state.global_step == 5
    assert_same_training(resumed[False], resumed[True])


class _DropoutStream(transformers.TrainerCallback):
    """The global RNG's state as each step begins: what the model's dropout masks are drawn from."""

    def __init__(self):
        self.states = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.states.append(torch.get_rng_state())


# One strategy per optimizer family and model preparation (each builds and steps its own optimizer).
DROPOUT_CASES = ["bf16-mixed", "bf16-sr", "collage-8bit", "fp8-lm-o3", "coat", "fp16-als"]


@pytest.mark.parametrize("strategy", DROPOUT_CASES)
def test_dropout_masks_are_the_stock_trainers(tmp_path, strategy):
    # Same seed, same masks: building the strategy's optimizer (its stochastic-rounding seed) and its
    # steps leave the global generator alone, so a run differs from `bf16=True` by its arithmetic only.
    streams = {}
    for stock in (True, False):
        base = trainer_arguments(tmp_path / str(stock), max_steps=2, save_strategy="no", optim="adamw_torch")
        if stock:
            args, cls = transformers.TrainingArguments(**base), transformers.Trainer
        else:
            args, cls = TrainingArguments(**base, precision_strategy=strategy), Trainer
        streams[stock] = _DropoutStream()
        trainer = cls(model=tiny_gpt2(dropout=0.1), args=args, train_dataset=TokenBlocks(8), callbacks=[streams[stock]])
        trainer.train()
    assert len(streams[True].states) == len(streams[False].states) == 2
    for ours, theirs in zip(streams[False].states, streams[True].states):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("strategy", ["bf16-mixed", "fp8-lm-o2"])
def test_the_trained_model_computes_outside_the_trainer_as_after_bf16_true(tmp_path, strategy):
    # `bf16=True` leaves the model's forward under BF16 autocast after training (Accelerate patches
    # it): a `generate()` or call in the user's script computes as the training forward did, and
    # `unwrap_model(keep_fp32_wrapper=False)` restores the plain forward. The strategy does the same.
    from accelerate import Accelerator

    ids = TokenBlocks(4, seed=3).ids[:2, :16]
    runs = {}
    for stock in (True, False):
        optim = "sgd" if strategy == "bf16-mixed" else "adamw_torch"
        trainer = make(
            "bf16-mixed" if stock else strategy, tmp_path / str(stock), stock=stock, max_steps=2, optim=optim
        )
        trainer.train()
        model = trainer.model
        seen = []
        model.transformer.h[0].mlp.register_forward_pre_hook(
            lambda m, a, seen=seen: seen.append(
                torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
            )
        )
        logits = model(input_ids=ids).logits
        generated = model.generate(ids[:, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)
        copied = copy.deepcopy(model)(input_ids=ids).logits
        plain = Accelerator(cpu=True).unwrap_model(model, keep_fp32_wrapper=False)(input_ids=ids).logits
        runs[stock] = logits, generated, copied, plain, seen
    for ours, theirs in zip(runs[False][:2], runs[True][:2]):
        assert ours.dtype == theirs.dtype  # FP32 outputs, as Accelerate's wrapper gives them
        if strategy == "bf16-mixed":  # same weights (SGD, same seed), same arithmetic
            assert_bits_equal(ours, theirs)
    assert runs[False][4][:2] == runs[True][4][:2] == [torch.bfloat16, torch.bfloat16]
    assert_bits_equal(runs[False][2], runs[False][0], "a deep copy computes as the model")
    assert runs[False][4][-1] is runs[True][4][-1] is None  # the unwrapped forward: no autocast
