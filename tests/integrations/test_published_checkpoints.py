"""Checkpoints as they are published, on the other paths users take (issue #48, item 4).

`test_loaded_dtypes.py` trains BF16 and FP16 loads through `hf_lowprec.Trainer`, and
`test_fp8_checkpoints.py` FP8 ones; here the same loads go through TRL's SFT trainer, the GLUE
recipe and `hf-lowprec launch` of an unchanged transformers script.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2LMHeadModel

import hf_lowprec
from hf_lowprec import trl as hl_trl
from hf_lowprec.data import build_tokenizer, embedded_corpus, tiny_bert_config, tiny_gpt2_config
from hf_lowprec.fp8.blocks import dequantize_blocks
from hf_lowprec.memory import unwrap_optimizer
from tests.helpers import assert_same_losses, tiny_llama_config
from tests.integrations.test_fp8_checkpoints import _publish
from tests.integrations.test_launch import _launch, _run

STRATEGIES = hf_lowprec.available_strategies()


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A tiny GPT-2 with its tokenizer saved in BF16, SFT text, and an FP8-published tiny Llama."""
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("published")
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    GPT2LMHeadModel(tiny_gpt2_config(vocab_size=len(tokenizer), n_positions=64)).to(torch.bfloat16).save_pretrained(
        root / "gpt2-bf16"
    )
    tokenizer.save_pretrained(root / "gpt2-bf16")
    llama = tiny_llama_config(128, vocab_size=len(tokenizer))
    LlamaForCausalLM(llama).to(torch.bfloat16).save_pretrained(root / "llama-bf16")
    (root / "llama-fp8").mkdir()
    _publish(root / "llama-bf16", root / "llama-fp8")
    tokenizer.save_pretrained(root / "llama-fp8")
    texts = [t[:200] for t in embedded_corpus() if t.strip()][:32]
    (root / "sft.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return root


def _sft(path: Path, name: str, out: Path, **load):
    from datasets import Dataset

    texts = [json.loads(line)["text"] for line in (path.parent / "sft.jsonl").read_text().splitlines()]
    config = hl_trl.SFTConfig(
        output_dir=str(out),
        precision_strategy=name,
        max_steps=2,
        per_device_train_batch_size=4,
        max_length=32,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(str(path), **load)
    trainer = hl_trl.SFTTrainer(
        model=model, args=config, train_dataset=Dataset.from_dict({"text": texts}), processing_class=build_tokenizer()
    )
    trainer.train()
    return trainer


def _state_dtypes(trainer) -> dict:
    optimizer = unwrap_optimizer(trainer.optimizer)
    return {
        n: (p.dtype, sorted((k, v.dtype) for k, v in optimizer.state.get(p, {}).items() if torch.is_tensor(v)))
        for n, p in trainer.model.named_parameters()
    }


@pytest.mark.parametrize("name", STRATEGIES)
def test_trl_sft_trains_a_bf16_checkpoint_as_loaded(published, tmp_path, name):
    trainer = _sft(published / "gpt2-bf16", name, tmp_path / "bf16")
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    if name in ("bf16-mixed", "fp8-lm-o1", "coat"):  # three of the five that refused it: as from an FP32 load
        reference = _sft(published / "gpt2-bf16", name, tmp_path / "fp32", dtype=torch.float32)
        assert _state_dtypes(trainer) == _state_dtypes(reference)
        assert_same_losses(losses, [h["loss"] for h in reference.state.log_history if "loss" in h], name)


@pytest.mark.parametrize("name", ["bf16-mixed", "fp8-lm-o1"])
def test_the_glue_recipe_fine_tunes_a_bf16_checkpoint(tmp_path, name):
    from transformers import BertForSequenceClassification

    from tests.recipes.test_recipes import GLUE_TWO_STEPS, QUICK, check_trained, import_recipe

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    BertForSequenceClassification(tiny_bert_config(len(tokenizer))).to(torch.bfloat16).save_pretrained(
        tmp_path / "bert"
    )
    tokenizer.save_pretrained(tmp_path / "bert")
    result = import_recipe("finetune_glue").main(
        [
            "--precision_strategy",
            name,
            "--output_dir",
            str(tmp_path / "out"),
            *QUICK,
            "--model_name_or_path",
            str(tmp_path / "bert"),
            "--task_name",
            "synthetic-sst2",
            "--synthetic_size",
            "48",
            *GLUE_TWO_STEPS,
        ]
    )
    check_trained(result, name, 2)


SCRIPT = """
import sys

from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, default_data_collator

path, data, out = sys.argv[1:4]
tokenizer = AutoTokenizer.from_pretrained(path)
raw = load_dataset("json", data_files=data)["train"]
ids = sum(raw.map(lambda b: tokenizer(b["text"]), batched=True)["input_ids"], [])
train = [{"input_ids": ids[i : i + 32], "labels": ids[i : i + 32]} for i in range(0, len(ids) - 32, 32)]
model = AutoModelForCausalLM.from_pretrained(path)
args = TrainingArguments(out, max_steps=2, per_device_train_batch_size=4, report_to=[], use_cpu=True, save_strategy="no")
trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=default_data_collator)
trainer.train()
trainer.save_model()
"""


@pytest.mark.parametrize("checkpoint,name", [("gpt2-bf16", "bf16-mixed"), ("llama-fp8", "fp8-lm-o2")])
def test_launch_fine_tunes_a_published_checkpoint_with_an_unchanged_script(published, tmp_path, checkpoint, name):
    script = tmp_path / "finetune.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    cmd = _launch("--precision_strategy", name, "--", sys.executable, str(script))
    _run([*cmd, str(published / checkpoint), str(published / "sft.jsonl"), str(out)], tmp_path)
    report = json.loads((out / "precision_report.json").read_text())
    assert report["strategy"] == name
    config = json.loads((out / "config.json").read_text())
    if checkpoint == "llama-fp8":  # back in the published format, loadable by plain transformers
        assert config["quantization_config"]["quant_method"] == "fp8"
        assert report["fp8_checkpoint"] == {"trained from FP32 values": 7}
        from safetensors.torch import load_file

        saved = load_file(str(out / "model.safetensors"))
        key = "model.layers.0.mlp.down_proj"
        reloaded = AutoModelForCausalLM.from_pretrained(str(out))
        expected = dequantize_blocks(saved[key + ".weight"], saved[key + ".weight_scale_inv"], torch.bfloat16)
        assert torch.equal(reloaded.get_submodule(key).weight, expected)
    else:
        assert report["adopted"] == {
            "bfloat16": sum(
                p.numel() for p in GPT2LMHeadModel.from_pretrained(str(published / checkpoint)).parameters()
            )
        }
