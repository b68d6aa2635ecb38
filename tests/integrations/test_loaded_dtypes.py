"""A checkpoint stored in 16 bits, loaded as users load it, trains under every strategy (issue #48).

transformers 5's `from_pretrained(path)` keeps the stored dtype, and Hub checkpoints are
nearly all BF16. Each strategy must train such a model as it trains an FP32 load of the same
checkpoint: the strategies that promise FP32 parameters make them from the loaded values
(exact), the others convert as they always do. So the two runs are the same computation:
same parameter and optimizer-state dtypes, and bit-identical losses, checked here through
`hf_lowprec.Trainer` for all strategies, from BF16 and from FP16 checkpoints.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import hf_lowprec
from hf_lowprec import Trainer, TrainingArguments
from hf_lowprec.memory import unwrap_optimizer
from hf_lowprec.report import PrecisionPromiseError, check_promises, describe, format_report
from tests.helpers import VOCAB, TokenBlocks, assert_same_losses, tiny_llama_config, trainer_arguments

STRATEGIES = hf_lowprec.available_strategies()


def _checkpoint(path, dtype: torch.dtype) -> str:
    torch.manual_seed(0)
    config = tiny_llama_config(32)  # widths multiples of 16: the FP8 strategies convert every projection
    LlamaForCausalLM(config).to(dtype).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {dtype: _checkpoint(root / str(dtype), dtype) for dtype in (torch.bfloat16, torch.float16)}


def _train(path: str, name: str, out, frozen: str | None = None, **load) -> tuple[list[float], Trainer]:
    model = AutoModelForCausalLM.from_pretrained(path, **load)
    for n, p in model.named_parameters():
        p.requires_grad_(frozen is None or not n.startswith(frozen))
    args = TrainingArguments(**trainer_arguments(out, precision_strategy=name, max_steps=3, save_strategy="no"))
    trainer = Trainer(model=model, args=args, train_dataset=TokenBlocks())
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer


@pytest.mark.parametrize("name", ["bf16-mixed", "fp8-lm-o2"])
def test_gemmas_embedding_scale_made_at_load_in_bf16_trains_as_the_fp32_loads(tmp_path, name):
    # Gemma scales embeddings by √hidden, a buffer made at init in the load dtype: 8.9375 in BF16
    # for √80 = 8.9443. The FP32 masters' embedding must take the FP32 scale the FP32 load has.
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=80,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        sliding_window=16,
    )
    Gemma3ForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "gemma3")
    bf16, _ = _train(str(tmp_path / "gemma3"), name, tmp_path / "bf16")
    fp32, trainer = _train(str(tmp_path / "gemma3"), name, tmp_path / "fp32", dtype=torch.float32)
    assert_same_losses(bf16, fp32, name)
    scale = trainer.model.model.embed_tokens.embed_scale
    assert scale.dtype == torch.float32 and scale.item() == torch.tensor(80**0.5, dtype=torch.float32).item()


def _dtypes(trainer: Trainer) -> dict[str, object]:
    optimizer = unwrap_optimizer(trainer.optimizer)
    return {
        name: (
            p.dtype,
            sorted((k, v.dtype) for k, v in optimizer.state.get(p, {}).items() if torch.is_tensor(v)),
        )
        for name, p in trainer.model.named_parameters()
    }


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", STRATEGIES)
def test_a_16_bit_checkpoint_as_loaded_trains_as_its_fp32_load(checkpoints, tmp_path, name, stored):
    path = checkpoints[stored]
    assert next(AutoModelForCausalLM.from_pretrained(path).parameters()).dtype == stored  # the default keeps it
    as_loaded, trainer = _train(path, name, tmp_path / "loaded")
    reference, fp32_trainer = _train(path, name, tmp_path / "fp32", dtype=torch.float32)
    assert_same_losses(as_loaded, reference, name)
    assert _dtypes(trainer) == _dtypes(fp32_trainer)


def test_the_report_says_what_was_made(checkpoints):
    model = AutoModelForCausalLM.from_pretrained(checkpoints[torch.bfloat16])
    trainable = sum(p.numel() for p in model.parameters())
    strategy = hf_lowprec.get_strategy("bf16-mixed")
    model = strategy.prepare_model(model)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    report = describe(strategy, model)
    assert report["adopted"] == {"bfloat16": trainable}
    assert f"parameters loaded as bfloat16: FP32 made of {trainable} elements (exact)" in format_report(report)


@pytest.mark.parametrize("name", ["fp32", "bf16-mixed"])
def test_a_frozen_body_as_loaded_trains_as_its_fp32_load(checkpoints, tmp_path, name):
    # Layer-wise freezing: the frozen body of a BF16 load is made FP32 as its trainable head is, or
    # its BF16 hidden states meet the FP32 head (a dtype error in the first forward); under autocast
    # (bf16-mixed) its linear layers keep their BF16 weights, which autocast computes with anyway.
    path = checkpoints[torch.bfloat16]
    as_loaded, trainer = _train(path, name, tmp_path / "loaded", frozen="model.")
    reference, fp32_trainer = _train(path, name, tmp_path / "fp32", frozen="model.", dtype=torch.float32)
    assert_same_losses(as_loaded, reference, name)
    kept = set()
    if name != "fp32":
        linear = [m for m in trainer.model.model.modules() if isinstance(m, torch.nn.Linear)]
        kept = {id(p) for m in linear for p in m.parameters()}
        assert kept and {p.dtype for m in linear for p in m.parameters()} == {torch.bfloat16}
    names = {n for n, p in trainer.model.named_parameters() if id(p) not in kept}
    assert {n: v for n, v in _dtypes(trainer).items() if n in names} == {
        n: v for n, v in _dtypes(fp32_trainer).items() if n in names
    }
    assert not any(p.requires_grad for p in trainer.model.model.parameters())
    elements = sum(p.numel() for p in trainer.model.parameters() if id(p) not in kept)
    assert describe(trainer.precision, trainer.model)["adopted"] == {"bfloat16": elements}


def test_a_cast_after_preparation_is_still_refused_and_named(checkpoints):
    strategy = hf_lowprec.get_strategy("bf16-mixed")
    model = strategy.prepare_model(AutoModelForCausalLM.from_pretrained(checkpoints[torch.bfloat16])).half()
    with pytest.raises(PrecisionPromiseError, match=r"(?s)float16.*model.half\(\) after prepare_model: remove it"):
        check_promises(strategy, model)
