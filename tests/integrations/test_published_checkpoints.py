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
from hf_lowprec.fp8.blocks import dequantize_published
from hf_lowprec.memory import unwrap_optimizer
from tests.fp8_reference import publish_fp8
from tests.helpers import assert_same_losses, tiny_llama_config
from tests.launching import (
    GLUE_TWO_STEPS,
    QUICK,
    check_trained,
    import_recipe,
    launch_command,
    run_checked,
    run_ranks,
)

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
    publish_fp8(root / "llama-bf16", root / "llama-fp8")
    tokenizer.save_pretrained(root / "llama-fp8")
    texts = [t[:200] for t in embedded_corpus() if t.strip()][:32]
    (root / "sft.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return root


def _sft(path: Path, name: str, out: Path, peft_config=None, **load):
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
        model=model,
        args=config,
        train_dataset=Dataset.from_dict({"text": texts}),
        processing_class=build_tokenizer(),
        peft_config=peft_config,
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


def test_trl_sft_with_lora_keeps_an_fp8_base_as_published(published, tmp_path):
    from peft import LoraConfig

    from hf_lowprec.fp8.blocks import FrozenBlockFP8Linear

    lora = LoraConfig(r=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = _sft(published / "llama-fp8", "fp8-lm-o2", tmp_path, peft_config=lora)
    frozen = [m for m in trainer.model.modules() if isinstance(m, FrozenBlockFP8Linear)]
    assert len(frozen) == 7 and all(m.weight.dtype == torch.float8_e4m3fn for m in frozen)
    assert len([h for h in trainer.state.log_history if "loss" in h]) == 2


@pytest.mark.parametrize("name", ["bf16-mixed", "fp8-lm-o1"])
def test_the_glue_recipe_fine_tunes_a_bf16_checkpoint(tmp_path, name):
    from transformers import BertForSequenceClassification

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


@pytest.mark.parametrize(
    "checkpoint,name,options",
    [
        ("gpt2-bf16", "bf16-mixed", {}),
        ("llama-fp8", "fp8-lm-o2", {}),
        ("llama-fp8", "fp8-lm-o2", {"recipe": "rowwise"}),
    ],
)
def test_launch_fine_tunes_a_published_checkpoint_with_an_unchanged_script(
    published, tmp_path, checkpoint, name, options
):
    script = tmp_path / "finetune.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    given = ["--precision_options", json.dumps(options)] if options else []
    cmd = launch_command("--precision_strategy", name, *given, "--", sys.executable, str(script))
    run_checked([*cmd, str(published / checkpoint), str(published / "sft.jsonl"), str(out)], tmp_path)
    report = json.loads((out / "precision_report.json").read_text())
    assert report["strategy"] == name
    assert all(report["options"][key] == value for key, value in options.items())
    config = json.loads((out / "config.json").read_text())
    if checkpoint == "llama-fp8":  # back in the published format, loadable by plain transformers
        assert config["quantization_config"]["quant_method"] == "fp8"
        assert report["fp8_checkpoint"] == {"trained from FP32 values": 7}
        from safetensors.torch import load_file

        saved = load_file(str(out / "model.safetensors"))
        key = "model.layers.0.mlp.down_proj"
        reloaded = AutoModelForCausalLM.from_pretrained(str(out))
        expected = dequantize_published(saved[key + ".weight"], saved[key + ".weight_scale_inv"], torch.bfloat16)
        assert torch.equal(reloaded.get_submodule(key).weight, expected)
    else:
        assert report["adopted"] == {
            "bfloat16": sum(
                p.numel() for p in GPT2LMHeadModel.from_pretrained(str(published / checkpoint)).parameters()
            )
        }


DDP_LORA = """
import sys

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from hf_lowprec import Trainer, TrainingArguments

path, out = sys.argv[1:3]
ids = torch.randint(0, 64, (16, 32), generator=torch.Generator().manual_seed(0))
model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
args = TrainingArguments(
    out, precision_strategy="fp8-lm-o2", max_steps=2, per_device_train_batch_size=2, report_to=[], use_cpu=True,
    save_strategy="no", ddp_backend="gloo", disable_tqdm=True,
)
trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": i, "labels": i} for i in ids])
trainer.train()
rank = trainer.args.process_index
torch.save({n: p.detach().float() for n, p in trainer.model.named_parameters() if p.requires_grad}, f"{out}/lora{rank}.pt")
"""


@pytest.mark.slow
@pytest.mark.multiproc
def test_lora_on_an_fp8_base_trains_under_ddp(published, tmp_path):
    # DDP broadcasts parameters when it wraps the model; the frozen FP8 base is left out of that
    # (same bytes on every rank; gloo cannot send FP8), and the adapters stay equal on both ranks.
    script = tmp_path / "ddp_lora.py"
    script.write_text(DDP_LORA)
    (tmp_path / "out").mkdir()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    written = [tmp_path / "out" / f"lora{r}.pt" for r in (0, 1)]
    run_ranks(
        [*torchrun, str(published / "llama-fp8"), str(tmp_path / "out")],
        tmp_path,
        lambda: all(map(Path.is_file, written)),
    )
    rank0, rank1 = (torch.load(tmp_path / "out" / f"lora{r}.pt") for r in (0, 1))
    assert rank0.keys() == rank1.keys() and len(rank0) == 4
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    assert any(k.endswith("lora_B.default.weight") and rank0[k].abs().sum() > 0 for k in rank0)  # trained
