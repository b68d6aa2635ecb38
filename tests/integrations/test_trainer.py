"""hf_lowprec.Trainer end to end: precision_strategy, logs, save and bit-for-bit resume, bad input."""

import json

import pytest
import torch
from transformers import HfArgumentParser

import hf_lowprec.strategies.interface as interface
from hf_lowprec import Trainer, TrainingArguments
from hf_lowprec.checkpoints.complete_save import with_export
from hf_lowprec.numerics import nonfinite_flag
from hf_lowprec.strategies.interface import StrategyOptimizer
from tests.helpers import (
    VOCAB,
    ParameterSnapshots,
    TokenBlocks,
    assert_bits_equal,
    checkpointed_args,
    finite,
    logged_losses,
    make_args,
    tiny_gpt2,
    trainer_arguments,
)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["bf16-pure", "bf16-mixed", "collage-plus", "bf16-sr"])
def test_train_save_and_resume_bit_for_bit(tmp_path, strategy):
    torch.manual_seed(0)
    trainer = Trainer(model=tiny_gpt2(), args=checkpointed_args(tmp_path, strategy), train_dataset=TokenBlocks())
    trainer.train()
    full = logged_losses(trainer)
    assert len(full) == 6
    assert isinstance(trainer.optimizer.optimizer, StrategyOptimizer)
    logged = trainer.state.log_history[0]
    assert "precision/skipped_steps" in logged

    if strategy == "bf16-pure":
        assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())

    resumed = Trainer(model=tiny_gpt2(seed=7), args=checkpointed_args(tmp_path, strategy), train_dataset=TokenBlocks())
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    # The resumed state starts from the checkpoint's log history (steps 1-3).
    assert logged_losses(resumed) == full
    for a, b in zip(trainer.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_fp8_blockwise_recipe_trains_and_resumes_bit_for_bit_through_the_trainer(tmp_path):
    # Issue #49's "done when": the recipe chosen in TrainingArguments; a 128-wide GPT-2 puts
    # every block layer on blockwise's 128-blocks.
    def run(seed, **kw):
        args = checkpointed_args(tmp_path, "fp8-lm-o2", precision_options={"recipe": "blockwise"})
        trainer = Trainer(model=tiny_gpt2(seed, n_embd=128), args=args, train_dataset=TokenBlocks())
        trainer.train(**kw)
        return trainer

    trainer = run(0)
    layers = [m for m in trainer.model.modules() if type(m).__name__ == "FP8Linear"]
    assert len(layers) == 8 and {m.recipe for m in layers} == {"blockwise"}
    resumed = run(7, resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert logged_losses(resumed) == logged_losses(trainer) and len(logged_losses(trainer)) == 6
    for a, b in zip(trainer.model.state_dict().values(), resumed.model.state_dict().values()):
        assert_bits_equal(a, b)


def test_precision_strategy_parses_from_the_command_line(tmp_path):
    parser = HfArgumentParser(TrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        [
            "--output_dir",
            str(tmp_path),
            "--precision_strategy",
            "bf16-pure",
            "--use_cpu",
            "--precision_options",
            json.dumps({"lost_arithmetic_metrics": True}),
        ]
    )
    assert args.precision_strategy == "bf16-pure"
    assert args.precision_options == {"lost_arithmetic_metrics": True}
    assert args.build_precision_strategy().options.lost_arithmetic_metrics is True


def test_unknown_strategy_fails_at_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown precision strategy 'collage-pls'"):
        TrainingArguments(output_dir=str(tmp_path), precision_strategy="collage-pls", use_cpu=True)


def test_bad_options_fail_at_arguments(tmp_path):
    with pytest.raises(ValueError, match="no option"):
        TrainingArguments(output_dir=str(tmp_path), precision_strategy="fp32", precision_options={"x": 1})
    with pytest.raises(ValueError, match="JSON object"):
        TrainingArguments(output_dir=str(tmp_path), precision_strategy="fp32", precision_options="{not json")
    with pytest.raises(ValueError, match="without precision_strategy"):
        TrainingArguments(output_dir=str(tmp_path), precision_options={"lost_arithmetic_metrics": True})


def test_accelerates_mixed_precision_is_refused_or_cleared_like_the_flags(tmp_path, monkeypatch):
    # `accelerate launch --mixed_precision bf16` (or a config file saying so) reaches the stock
    # arguments through the environment: the Accelerator autocast an fp32 or fp16-als model in BF16
    # while the startup report said FP32/FP16.
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    for name in ("fp32", "fp16-als", "fp16-mixed"):
        with pytest.raises(ValueError, match=r"Accelerate's mixed_precision is 'bf16'.*set mixed_precision 'no'"):
            TrainingArguments(output_dir=str(tmp_path), precision_strategy=name, use_cpu=True)
    args = TrainingArguments(output_dir=str(tmp_path), precision_strategy="fp8-lm-o2", use_cpu=True)
    assert args.mixed_precision == "no"
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenBlocks(4))
    assert trainer.accelerator.mixed_precision == "no"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    assert (
        TrainingArguments(output_dir=str(tmp_path), precision_strategy="fp16-als", use_cpu=True).mixed_precision == "no"
    )
    assert TrainingArguments(output_dir=str(tmp_path), use_cpu=True).mixed_precision == "fp16"  # no strategy: stock


def test_contradictory_flags(tmp_path):
    with pytest.raises(ValueError, match="remove fp16=True"):
        TrainingArguments(output_dir=str(tmp_path), precision_strategy="bf16-pure", fp16=True, use_cpu=True)
    with pytest.raises(ValueError, match="remove bf16=True"):
        TrainingArguments(output_dir=str(tmp_path), precision_strategy="fp32", bf16=True, use_cpu=True)
    with pytest.raises(ValueError, match="remove --optim"):
        TrainingArguments(output_dir=str(tmp_path), precision_strategy="bf16-pure", optim="sgd", use_cpu=True)
    # fp32 is your optimizer in FP32: it takes the optimizer `optim` names (tests/integrations/test_stock_compat.py).
    assert (
        TrainingArguments(output_dir=str(tmp_path), precision_strategy="fp32", optim="sgd", use_cpu=True).optim == "sgd"
    )
    # bf16=True agrees with a BF16 strategy: the strategy takes over and the flag is cleared.
    args = TrainingArguments(output_dir=str(tmp_path), precision_strategy="bf16-pure", bf16=True, use_cpu=True)
    assert args.bf16 is False
    # The full-eval flags likewise: a contradicting one is refused, an agreeing one cleared.
    for name, flag in (("collage-plus", "fp16_full_eval"), ("fp16-als", "bf16_full_eval"), ("fp32", "fp16_full_eval")):
        with pytest.raises(ValueError, match=f"remove {flag}=True"):
            TrainingArguments(output_dir=str(tmp_path), precision_strategy=name, use_cpu=True, **{flag: True})
    args = TrainingArguments(
        output_dir=str(tmp_path), precision_strategy="fp8-lm-o2", bf16_full_eval=True, use_cpu=True
    )
    assert args.bf16_full_eval is False


def test_full_eval_flag_leaves_the_strategys_weights_as_they_are(tmp_path):
    """`bf16_full_eval=True` (a `bf16=True` habit) under bf16-mixed: an evaluation before training
    would have cast the FP32 master weights to BF16 in place (the stock Trainer's full-eval cast);
    the strategy evaluates in its own precision, and the weights keep their dtype and bits."""
    model = tiny_gpt2()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    args = make_args(tmp_path, "bf16-mixed", bf16_full_eval=True, max_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=TokenBlocks(), eval_dataset=TokenBlocks(n=8))
    metrics = trainer.evaluate()
    assert torch.isfinite(torch.tensor(metrics["eval_loss"]))
    for name, p in trainer.model.named_parameters():
        assert p.dtype == torch.float32, name
        assert torch.equal(p.detach(), before[name]), name


def test_foreign_optimizer_refused(tmp_path):
    model = tiny_gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="drop `optimizers=`"):
        Trainer(
            model=model,
            args=checkpointed_args(tmp_path, "bf16-pure"),
            train_dataset=TokenBlocks(),
            optimizers=(opt, None),
        )


class NaNOnceTrainer(Trainer):
    """Returns a NaN loss on the second optimizer step."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        if self.state.global_step == 1 and model.training:
            loss = loss * float("nan")
        return loss


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
def test_nonfinite_step_is_skipped_and_logged(tmp_path, monkeypatch, max_grad_norm):
    args = checkpointed_args(
        tmp_path,
        "bf16-pure",
        max_steps=3,
        save_strategy="no",
        lr_scheduler_type="linear",
        warmup_steps=0,
        max_grad_norm=max_grad_norm,
    )
    trainer = NaNOnceTrainer(model=tiny_gpt2(), args=args, train_dataset=TokenBlocks())
    snap = ParameterSnapshots()
    trainer.add_callback(snap)
    # The Trainer measures the gradient norm at every step, clipping or not; the skip flag is read
    # from that norm (`strategies.seen_norm`), so the step never checks the gradients again.
    checks = []
    monkeypatch.setattr(interface, "nonfinite_flag", lambda *a, **k: checks.append(a) or nonfinite_flag(*a, **k))
    trainer.train()
    assert not checks
    snapshots = snap.taken
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    # Step 2 (global_step 1 -> 2) was skipped: the weights after it equal the weights before it.
    assert all(torch.equal(a, b) for a, b in zip(snapshots[0], snapshots[1]))
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[1], snapshots[2]))
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["precision/skipped_steps"] for h in logs] == [0.0, 1.0, 1.0]
    # The LR schedule did not advance on the skipped step: 2 scheduler steps in 3 optimizer steps.
    assert trainer.lr_scheduler.last_epoch == 2


def capture_bounds(strategy, bounds):
    """Wrap the strategy's measurement to record ‖Δθ̂ − Δθ‖/‖Δθ‖ of each measured step, from the
    tracked FP64 tensors: by Cauchy–Schwarz |EDQ ratio − 1| ≤ that (docs/algorithms.md §1)."""
    measure = strategy._measure_lost_arithmetic

    def wrapped(records, group_count):
        effective = torch.cat([(r.after - r.before).reshape(-1) for r in records])
        intended = torch.cat([r.update.double().reshape(-1) for r in records])
        bounds.append((torch.linalg.vector_norm(effective - intended) / torch.linalg.vector_norm(intended)).item())
        return measure(records, group_count)

    return wrapped


@pytest.mark.slow
def test_lost_arithmetic_metrics_are_logged_and_do_not_change_training(tmp_path):
    runs, bounds = {}, []
    for enabled in (False, True):
        args = checkpointed_args(
            tmp_path / str(enabled),
            "collage-plus",
            max_steps=4,
            save_strategy="no",
            logging_steps=2,
            precision_options={"lost_arithmetic_metrics": enabled},
        )
        trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenBlocks())
        if enabled:
            trainer.precision._measure_lost_arithmetic = capture_bounds(trainer.precision, bounds)
        trainer.train()
        runs[enabled] = trainer
    assert logged_losses(runs[True]) == logged_losses(runs[False])
    for a, b in zip(runs[True].model.parameters(), runs[False].model.parameters()):
        assert torch.equal(a, b)
    logs = [h for h in runs[True].state.log_history if "loss" in h]
    assert len(logs) == 2 and len(bounds) == 2
    for h, bound in zip(logs, bounds):
        assert 0.0 <= h["precision/imprecision_pct"] <= 100.0
        # Round-to-nearest can overshoot, so the ratio may exceed 1 (1.00003 on an AVX-512-BF16
        # CPU): the bound comes from the tensors, not from the machine the test was tuned on.
        assert abs(h["precision/edq_ratio"] - 1.0) <= bound + 1e-12
        # θ + δθ keeps Δθ up to its rounding to BF16 (2^-8 = 0.4 %) and Grow's rounding of
        # δθ (which loses only |Δθ| < 2^-8·ulp(θ)/2); on θ alone most of Δθ would be lost (≈ 1).
        assert bound < 0.05
        assert "precision/imprecision_pct/group0" in h and "precision/edq_ratio/group1" in h
    assert "precision/imprecision_pct" not in runs[False].state.log_history[0]


def test_every_rank_gathers_the_export_under_deepspeed_whatever_transformers_saves(tmp_path, monkeypatch):
    """fp8-lm-o3's export gathers the FP8 masters, a collective under DeepSpeed. transformers
    before 5.23 calls `_save` there on the saving rank only, and the gather in `_save` hung: it
    comes from `save_model`, on every rank. Played in one process: DeepSpeed marked on, and the
    stock `save_model` standing for a rank that does not save (it never reaches `_save`)."""
    import transformers

    trainer = Trainer(
        model=tiny_gpt2(), args=make_args(tmp_path, "fp8-lm-o3", max_steps=1), train_dataset=TokenBlocks()
    )
    trainer.train()
    calls = []
    export = trainer.precision.exported_state_dict
    monkeypatch.setattr(trainer.precision, "exported_state_dict", lambda *a: calls.append(a) or export(*a))
    monkeypatch.setattr(transformers.Trainer, "save_model", lambda self, output_dir=None, _internal_call=False: None)
    monkeypatch.setattr(trainer, "is_deepspeed_enabled", True)
    trainer.save_model(str(tmp_path / "out"), _internal_call=True)
    assert len(calls) == 1 and calls[0][0] is trainer.model and calls[0][1] is trainer.optimizer


def test_the_gathered_export_replaces_exactly_the_weights_it_names():
    saved = {"a": torch.zeros(2), "b": torch.ones(2)}
    out = with_export(None, None, None, saved, {"a": torch.full((2,), 5.0), "b": None, "c": torch.ones(1)})
    assert set(out) == {"a", "b"} and out["b"] is saved["b"] and torch.equal(out["a"], torch.full((2,), 5.0))


def _best_at_step_2(tmp_path, model, strategy, higher=True, **options):
    """Trains 4 steps, saving and evaluating at 2 and 4, the best model loaded at the end; the
    metric's direction makes checkpoint-2 the best (its eval loss is the `higher` one)."""
    args = make_args(
        tmp_path,
        strategy,
        max_steps=4,
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        greater_is_better=higher,
        learning_rate=1e-2,
        precision_options=options or None,
    )
    trainer = Trainer(model=model, args=args, train_dataset=TokenBlocks(16), eval_dataset=TokenBlocks(8, seed=3))
    trainer.train()
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-2"), trainer.state.best_model_checkpoint
    trainer.save_model(str(tmp_path / "final"))
    return trainer


def _saved(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fp16-als", "collage-plus"])
def test_best_model_at_end_exports_the_best_checkpoints_full_precision(tmp_path, strategy):
    """With `save_full_precision`, a save exports the strategy's full precision (FP32 masters, θ + δθ),
    which the optimizer holds: loading the best checkpoint's weights alone left them at the last
    step (fp16-als exported checkpoint-4; collage-plus the best θ with the last δθ). The final
    save is the best checkpoint's export, bit for bit."""
    _best_at_step_2(tmp_path, tiny_gpt2(), strategy, save_full_precision=True)
    best, final = _saved(tmp_path / "checkpoint-2"), _saved(tmp_path / "final")
    assert best.keys() == final.keys()
    for key, value in best.items():
        assert value.dtype == torch.float32 and torch.equal(value, final[key]), key


def test_a_model_only_best_checkpoint_with_a_full_precision_export_is_refused(tmp_path):
    """Model-only checkpoints hold no optimizer state: the export after loading the best one mixed
    its weights with the last step's masters/δθ (collage-plus: 3.4e-4 from checkpoint-2's export,
    fp16-als: exactly checkpoint-8's). Refused before any work, naming the fix."""
    best = {"load_best_model_at_end": True, "eval_strategy": "steps", "save_only_model": True}
    with pytest.raises(ValueError, match=r"save_only_model=True: the best checkpoint .* Drop save_only_model"):
        make_args(tmp_path, "collage-plus", **best, precision_options={"save_full_precision": True})
    assert make_args(tmp_path, "collage-plus", **best).save_only_model  # the model alone is the best's
    with pytest.raises(ValueError, match=r"precision_strategy='fp8-lm-o2', load_best_model_at_end=True"):
        make_args(tmp_path, "fp8-lm-o2", **best, precision_options={"save_full_precision": True})
    # Where the export is the weights themselves (FP32 ones, or 16-bit ones widened), the best's is right.
    for name, options in [("bf16-mixed", {}), ("bf16-pure", {}), ("fp16-als", {"weights": "sr"}), ("coat", {})]:
        full = {**options, "save_full_precision": True}
        assert make_args(tmp_path, name, **best, precision_options=full).save_only_model, name
    assert make_args(
        tmp_path, "collage-plus", **{**best, "save_only_model": False}, precision_options={"save_full_precision": True}
    ).load_best_model_at_end


@pytest.mark.parametrize("strategy", ["bf16-mixed", "fp8-lm-o2"])
def test_a_partly_frozen_bf16_load_saves_its_fp32_training_as_float32(tmp_path, strategy):
    """A BF16 checkpoint trained under an FP32-parameter strategy with its embeddings and first block
    frozen: the trained weights are FP32, the frozen GEMM weights stay BF16 (autocast's dtype), and
    save_pretrained recorded the first parameter's dtype (`bfloat16`), so a stock load rounded all 11
    trained tensors. The config says float32: the stock load gives back every trained weight, and
    the frozen ones exactly as loaded."""
    from transformers import AutoModelForCausalLM

    model = tiny_gpt2().to(torch.bfloat16)
    frozen = {}
    for name, param in model.named_parameters():
        param.requires_grad = not name.startswith(("transformer.wte", "transformer.wpe", "transformer.h.0."))
        if not param.requires_grad:
            frozen[name] = param.detach().clone()
    args = make_args(tmp_path, strategy, max_steps=1, save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=TokenBlocks(8))
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    saved = _saved(tmp_path / "final")
    assert {v.dtype for v in saved.values()} == {torch.float32, torch.bfloat16}
    for name, value in frozen.items():
        assert torch.equal(saved[name].float(), value.float()), name
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    assert reloaded.dtype == torch.float32
    state = reloaded.state_dict()
    for key, value in saved.items():
        assert torch.equal(state[key], value.float()), key


@pytest.mark.slow
def test_best_model_at_end_brings_a_mixture_of_experts_back_whole(tmp_path):
    """The best checkpoint holds the experts per expert; the stock load left the fused experts at
    the last step beside every other weight at the best step. The model at the end is the best
    checkpoint's, experts included (its export equals that checkpoint's weights)."""
    from hf_lowprec.testing.moe import tiny_moe

    _best_at_step_2(tmp_path, tiny_moe("qwen3_moe", vocab=VOCAB), "bf16-mixed", higher=False)
    best, final = _saved(tmp_path / "checkpoint-2"), _saved(tmp_path / "final")
    assert best.keys() == final.keys() and any(".experts." in key for key in best)
    for key, value in best.items():
        assert torch.equal(value, final[key]), key


def test_a_weights_only_checkpoint_is_refused_unless_the_reset_is_asked_for(tmp_path):
    """`save_only_model=True` writes the weights alone, and the manifest lists no optimizer,
    scheduler or RNG file, so none was found missing: a resume started Collage's δθ, the moments,
    the schedule and the generators afresh without a word. It is refused before anything loads,
    naming the option and the reset that accepts it; with that reset it resumes."""
    args = checkpointed_args(tmp_path, "collage-plus", max_steps=4, save_steps=2, save_only_model=True)
    Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenBlocks(16)).train()
    resumed = Trainer(model=tiny_gpt2(seed=7), args=args, train_dataset=TokenBlocks(16))
    before = {n: p.detach().clone() for n, p in resumed.model.named_parameters()}
    with pytest.raises(ValueError, match=r"saved with save_only_model=True.*resume_reset='optimizer,scheduler,rng'"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert all(torch.equal(p, before[n]) for n, p in resumed.model.named_parameters())  # nothing loaded
    # A manifest written before it carried "model_only": told by its files (no RNG state), refused too.
    manifest_file = tmp_path / "checkpoint-2" / "hf_lowprec_manifest.json"
    manifest = json.loads(manifest_file.read_text())
    del manifest["model_only"]
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"saved with save_only_model=True"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    reset = checkpointed_args(
        tmp_path,
        "collage-plus",
        max_steps=4,
        save_steps=2,
        save_only_model=True,
        resume_reset="optimizer,scheduler,rng",
    )
    again = Trainer(model=tiny_gpt2(seed=7), args=reset, train_dataset=TokenBlocks(16))
    again.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert again.state.global_step == 4


@pytest.mark.parametrize("strategy", ["collage-plus", "fp8-lm-o2", "fp16-als"])
def test_a_model_from_model_init_is_prepared_and_trains_as_one_passed_in(tmp_path, strategy):
    # transformers' train() builds a model_init model anew (as hyperparameter_search does): the
    # strategy never saw it, and collage-plus stopped with "cast the model ... cast_model".
    args = make_args(tmp_path / "init", strategy, max_steps=3)
    built = Trainer(model_init=lambda: tiny_gpt2(), args=args, train_dataset=TokenBlocks(12))
    built.train()
    passed = Trainer(
        model=tiny_gpt2(), args=make_args(tmp_path / "passed", strategy, max_steps=3), train_dataset=TokenBlocks(12)
    )
    passed.train()
    assert logged_losses(built) == logged_losses(passed)
    for a, b in zip(built.model.parameters(), passed.model.parameters(), strict=True):
        assert_bits_equal(a, b)
    assert json.loads((tmp_path / "init" / "precision_report.json").read_text())["violations"] == []


class _OwnLoss(Trainer):
    """transformers' documented override: its own loss, without the base class's compute_loss."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return _own_loss(model(input_ids=inputs["input_ids"]).logits, inputs["labels"])


class _OwnLossFromBaseOutputs(Trainer):
    """The base class's compute_loss for its outputs, then a loss of its own from their logits."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        _, outputs = super().compute_loss(model, inputs, return_outputs=True)
        return _own_loss(outputs.logits, inputs["labels"])


class _BaseLoss(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs=return_outputs)  # a mean, as _own_loss


def _own_loss(logits, labels):
    logits = logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))


@pytest.mark.parametrize("strategy, accumulation", [("fp16-als", 1), ("fp16-als", 2), ("fp16-mixed", 2)])
def test_a_compute_loss_of_its_own_is_loss_scaled_once(tmp_path, strategy, accumulation):
    # The scale was a hook the base class's compute_loss put on its loss: an override that did not
    # return that loss left fp16-als dividing unscaled gradients by the scale (grad norms 2.03,
    # 0.83, 0.40 for 2.03, 1.65, 1.62) and fp16-mixed failing in GradScaler.unscale_. It is
    # applied at accelerator.backward now, once, whatever computed the loss.
    runs = {}
    for cls in (_BaseLoss, _OwnLoss, _OwnLossFromBaseOutputs):
        args = make_args(tmp_path / cls.__name__, strategy, max_steps=3, gradient_accumulation_steps=accumulation)
        trainer = cls(model=tiny_gpt2(), args=args, train_dataset=TokenBlocks(24))
        trainer.train()
        norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
        runs[cls] = (logged_losses(trainer), norms, [p.detach().clone() for p in trainer.model.parameters()])
    base, own, from_outputs = runs.values()
    assert own[:2] == from_outputs[:2]
    for a, b in zip(own[2], from_outputs[2], strict=True):
        assert_bits_equal(a, b)
    # The same loss as the model's own, to the rounding of a differently ordered mean: the same
    # gradient norms to 1% (a missing or doubled scale is a factor of 2^k).
    assert [s for s, _ in own[0]] == [s for s, _ in base[0]]
    assert own[1] == pytest.approx(base[1], rel=1e-2)


class _OwnBackward(Trainer):
    """A training_step of its own that calls `loss.backward()`, not `self.accelerator.backward(loss)`."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        loss = self.compute_loss(model, inputs)
        loss.backward()
        return loss.detach()


@pytest.mark.parametrize("strategy", ["fp16-als", "fp16-mixed"])
def test_a_backward_that_skips_the_loss_scale_is_refused_at_the_step(tmp_path, strategy):
    # The step unscales: true gradients divided by the scale (2^16 for fp16-mixed) trained silently
    # at Adam's ε-floor. Now the first step names the fix, before any weight moved.
    trainer = _OwnBackward(
        model=tiny_gpt2(), args=make_args(tmp_path, strategy, max_steps=2), train_dataset=TokenBlocks()
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(RuntimeError, match=r"self\.accelerator\.backward\(loss\)"):
        trainer.train()
    for a, b in zip(before, trainer.model.parameters(), strict=True):
        assert_bits_equal(a, b)


@pytest.mark.parametrize("strategy", ["fp16-mixed", "bf16-mixed", "fp16-als", "collage-plus"])
def test_predictions_reach_compute_metrics_as_the_stock_flags_hand_them(tmp_path, strategy):
    # fp16=True/bf16=True widen the model's outputs to FP32 (Accelerate's convert_outputs_to_fp32,
    # whatever the weights' dtype): fp16-mixed handed FP16 logits to compute_metrics, and fp16-als a
    # model stored in FP16's (an np.exp over them overflows at 11.1).
    seen = []

    def metrics(prediction):
        seen.append(prediction.predictions.dtype)
        return {}

    args = make_args(tmp_path, strategy, max_steps=1)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenBlocks(8), compute_metrics=metrics)
    out = trainer.predict(TokenBlocks(4))
    assert str(out.predictions.dtype) == "float32" and [str(d) for d in seen] == ["float32"]
    with torch.no_grad(), trainer.compute_loss_context_manager():
        ids = TokenBlocks(4).ids.to(trainer.model.device)
        logits = trainer.model(input_ids=ids).logits
        inner = trainer.model.lm_head(trainer.model.transformer(input_ids=ids)[0])  # the forward's own
    assert inner.dtype == args.build_precision_strategy().compute_dtype
    assert torch.equal(torch.from_numpy(out.predictions), logits) and torch.equal(logits, inner.float())


@pytest.mark.parametrize("strategy", ["bf16-pure", "collage-plus", "fp16-als"])
def test_label_smoothing_is_computed_from_fp32_logits_as_under_the_stock_flags(tmp_path, strategy):
    # The Trainer's own loss from the outputs (label_smoothing_factor) saw the 16-bit logits of a model
    # stored in BF16/FP16: collage-plus's smoothed loss was 5.376 where bf16=True's is 5.388.
    from transformers.trainer_pt_utils import LabelSmoother

    args = make_args(tmp_path, strategy, max_steps=1, label_smoothing_factor=0.1)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenBlocks(8))
    ids = TokenBlocks(4).ids
    inputs = {"input_ids": ids, "labels": ids}
    with torch.no_grad(), trainer.compute_loss_context_manager():
        loss = trainer.compute_loss(trainer.model, dict(inputs))
        inner = trainer.model.lm_head(trainer.model.transformer(input_ids=inputs["input_ids"])[0])
    smoother = LabelSmoother(epsilon=0.1)
    reference = smoother({"logits": inner.double()}, ids, shift_labels=True)  # FP64, on the same logits
    narrow = smoother({"logits": inner}, ids, shift_labels=True)  # what the 16-bit logits gave
    # An FP32 log-softmax: each term's sum over VOCAB logits errs by at most VOCAB·eps (relative);
    # a 16-bit one errs by a 16-bit eps, far more.
    bound = VOCAB * torch.finfo(torch.float32).eps * reference
    assert loss.dtype == torch.float32 and abs(loss.double() - reference) <= bound
    assert abs(narrow.double() - reference) > bound


@pytest.mark.parametrize("strategy", ["collage-plus", "fp16-mixed", "bf16-mixed"])
def test_a_second_train_call_steps_the_same_strategy_optimizer(tmp_path, strategy):
    # A later train() (as auto_find_batch_size's retry after an out-of-memory error) found Accelerate's
    # wrapper and wrapped it again: the state lost its strategy entry, or the loss scaler stepped twice.
    args = trainer_arguments(tmp_path, max_steps=2, save_strategy="no", optim="adamw_torch")
    trainer = Trainer(model=tiny_gpt2(), args=TrainingArguments(**args, precision_strategy=strategy),
                      train_dataset=TokenBlocks(16))  # fmt: skip
    trainer.train()
    first = trainer.optimizer.optimizer
    trainer.train()
    chain, wrapper = [], trainer.optimizer
    while wrapper is not None:
        chain.append(wrapper)
        wrapper = getattr(wrapper, "optimizer", None)
    assert [o for o in chain if isinstance(o, StrategyOptimizer)] == [first]
    finite([h["loss"] for h in trainer.state.log_history if "loss" in h])
    steps = {int(s["step"]) for s in first.state_dict()["state"].values() if "step" in s}
    assert steps in ({4}, set())  # both calls stepped it (a state without per-parameter steps aside)
