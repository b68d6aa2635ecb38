"""`hf_lowprec.Seq2SeqTrainer`: a tiny T5 trained with `predict_with_generate=True`, its generation in
the strategy's forward context, a bit-for-bit resume, and the launcher's swap of transformers' class."""

import collections
import json
import subprocess
import sys

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from hf_lowprec import Seq2SeqTrainer, Seq2SeqTrainingArguments
from tests.helpers import assert_bits_equal, logged_losses, trainer_arguments
from tests.launching import ROOT, launch_command, subprocess_env

MAX_LENGTH = 10  # generation_max_length


# A T5 of two layers each side; decoding starts at the pad token 0 and stops at token 1.
T5 = dict(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4)
T5.update(decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0)


def tiny_t5(seed: int = 0) -> transformers.T5ForConditionalGeneration:
    torch.manual_seed(seed)
    return transformers.T5ForConditionalGeneration(transformers.T5Config(**T5))


def pairs(n: int) -> list[dict[str, torch.Tensor]]:
    """`n` examples of 12 tokens whose target is the first 8 of them reversed."""
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, 256, (12,), generator=g) for _ in range(n)]
    return [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.flip(0)[:8].clone()} for x in ids]


def s2s_args(output_dir, strategy, **overrides) -> Seq2SeqTrainingArguments:
    return Seq2SeqTrainingArguments(
        **trainer_arguments(output_dir, precision_strategy=strategy, **overrides),
        per_device_eval_batch_size=8,
        predict_with_generate=True,
        generation_max_length=MAX_LENGTH,
    )


class GemmDtypes(TorchDispatchMode):
    """Counts the (operator, input dtype) of every matrix product and attention run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in ("aten.mm", "aten.addmm", "aten.bmm") or "scaled_dot_product" in name:
            self.seen[(name, args[0].dtype)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("strategy", ["bf16-mixed", "fp8-lm-o2", "collage-plus"])
def test_generated_predictions_reach_compute_metrics_generated_in_the_strategys_context(tmp_path, strategy):
    """The stock prediction_step generates outside compute_loss_context_manager: under bf16-mixed all
    169 GEMMs and 38 attentions of this evaluation's generate ran in FP32, under fp8-lm-o2 9 GEMMs and
    the 38 attentions. Now every one is BF16, and the tokens compute_metrics gets are those of
    `generate` under the strategy's forward context, bit for bit."""
    seen = []

    def metrics(prediction):
        seen.append(prediction)
        return {"tokens": float(prediction.predictions.size)}

    trainer = Seq2SeqTrainer(
        model=tiny_t5(),
        args=s2s_args(tmp_path, strategy, max_steps=2, save_strategy="no"),
        train_dataset=pairs(16),
        eval_dataset=pairs(8),
        compute_metrics=metrics,
    )
    trainer.train()
    assert len(logged_losses(trainer)) == 2
    model, generate, dtypes = trainer.model, trainer.model.generate, GemmDtypes()

    def recorded(*args, **kwargs):
        with dtypes:
            return generate(*args, **kwargs)

    model.generate = recorded
    out = trainer.evaluate()
    del model.generate
    (prediction,) = seen  # what evaluate() returned is what compute_metrics computed
    assert out["eval_tokens"] == prediction.predictions.size and len(prediction.predictions) == 8
    assert dtypes.seen and {dtype for _, dtype in dtypes.seen} == {torch.bfloat16}, dict(dtypes.seen)

    batch = {k: torch.stack([p[k] for p in pairs(8)]) for k in ("input_ids", "attention_mask")}
    with torch.no_grad(), trainer.precision.forward_context():
        expected = model.generate(**batch, max_length=MAX_LENGTH)
    # Padded with pad_token_id to the model's generation_config.max_length, as the stock step pads.
    width = prediction.predictions.shape[1]
    assert_bits_equal(
        torch.from_numpy(prediction.predictions), torch.nn.functional.pad(expected, (0, width - expected.shape[1]))
    )
    assert torch.equal(torch.from_numpy(prediction.label_ids)[:, :8], torch.stack([p["labels"] for p in pairs(8)]))
    # Outside the context the FP32 weights of bf16-mixed and fp8-lm-o2 generate with FP32 GEMMs or
    # attention: the dtypes above tell the contexts apart (collage-plus stores BF16 and has no autocast).
    outside = GemmDtypes()
    with torch.no_grad(), outside:
        model.generate(**batch, max_length=MAX_LENGTH)
    assert (torch.float32 in {dtype for _, dtype in outside.seen}) == (strategy != "collage-plus"), outside.seen


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["collage-plus", "fp8-lm-o2"])
def test_train_evaluate_and_resume_bit_for_bit(tmp_path, strategy):
    checkpointed = dict(save_steps=3, save_strategy="steps", lr_scheduler_type="cosine", warmup_steps=1)

    def run(seed, **kwargs):
        args = s2s_args(tmp_path, strategy, weight_decay=0.01, **checkpointed)
        trainer = Seq2SeqTrainer(model=tiny_t5(seed), args=args, train_dataset=pairs(24), eval_dataset=pairs(8))
        trainer.train(**kwargs)
        return trainer, trainer.predict(pairs(8))

    full, predicted = run(0)
    assert len(logged_losses(full)) == 6
    resumed, again = run(7, resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert logged_losses(resumed) == logged_losses(full)
    for name, value in full.model.state_dict().items():
        assert_bits_equal(resumed.model.state_dict()[name], value, name)
    assert_bits_equal(torch.from_numpy(again.predictions), torch.from_numpy(predicted.predictions), "predictions")


# An unchanged script: transformers' names only.
PROBE = """
import json, sys, torch, transformers
import hf_lowprec
args = transformers.Seq2SeqTrainingArguments(output_dir="out", use_cpu=True, max_steps=1, report_to=[],
                                             predict_with_generate=True, generation_max_length=10)
model = transformers.T5ForConditionalGeneration(transformers.T5Config(**json.loads(sys.argv[1])))
x = torch.arange(3, 15)
data = [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x[:8]}] * 4
trainer = transformers.Seq2SeqTrainer(model=model, args=args, train_dataset=data)
print(json.dumps({
    "trainer": transformers.Seq2SeqTrainer is hf_lowprec.Seq2SeqTrainer,
    "module": transformers.trainer_seq2seq.Seq2SeqTrainer is hf_lowprec.Seq2SeqTrainer,
    "arguments": transformers.Seq2SeqTrainingArguments is hf_lowprec.Seq2SeqTrainingArguments,
    "strategy": args.precision_strategy,
    "dtype": str(next(trainer.model.parameters()).dtype),
}))
"""


def test_an_unchanged_seq2seq_script_under_the_launcher_gets_hf_lowprecs_classes(tmp_path):
    """transformers' Seq2SeqTrainer, imported after the launcher's patch, subclassed hf_lowprec's Trainer:
    it took the strategy but generated outside its context. The launcher now swaps in hf_lowprec's."""
    proc = subprocess.run(
        launch_command("--precision_strategy", "collage-plus", "--", sys.executable, "-c", PROBE, json.dumps(T5)),
        cwd=tmp_path,
        env=subprocess_env(PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = proc.stdout.strip().splitlines()[-1]
    assert seen == (
        '{"trainer": true, "module": true, "arguments": true, "strategy": "collage-plus", "dtype": "torch.bfloat16"}'
    )
