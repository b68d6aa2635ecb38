"""The 16-bit-weight strategies keep FP32 the trainable parameters transformers keeps in FP32 when it
loads a model in 16 bits (`_keep_in_fp32_modules_strict`, for FP16 `_keep_in_fp32_modules` too:
`strategies.casting.kept_parameters`), and their optimizers step them as plain FP32 AdamW
(tests/optim/test_kept_fp32.py); a T5 whose `wo` output passes 65504 trains finite under fp16-als."""

from __future__ import annotations

import logging
import tempfile

import pytest
import torch
import transformers

from hf_lowprec import Seq2SeqTrainer, Seq2SeqTrainingArguments, get_strategy
from hf_lowprec.engines.fsdp2 import shard_model
from hf_lowprec.report import check_promises
from hf_lowprec.testing.moe import tiny_moe
from tests.helpers import logged_losses, train_steps, trainer_arguments

STRATEGIES = ["bf16-pure", "bf16-kahan", "bf16-sr", "bf16-fp32states", "collage-light", "collage-plus", "collage-8bit"]
T5 = dict(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4)
T5.update(decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0, feed_forward_proj="gated-gelu")
WO_SCALE = 1e5  # a T5 v1.1 checkpoint's `wo` output passes FP16's 65504: here |wo(x)| reaches ~2.8e5


def t5_overflowing_fp16() -> transformers.T5ForConditionalGeneration:
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(**T5))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".wo.weight"):
                param.mul_(WO_SCALE)
    return model


def _loaded_dtypes(model: torch.nn.Module, dtype: torch.dtype, cls) -> dict[str, torch.dtype]:
    with tempfile.TemporaryDirectory() as stored:
        model.save_pretrained(stored)
        loaded = cls.from_pretrained(stored, dtype=dtype)
    return {name: p.dtype for name, p in loaded.named_parameters()}


@pytest.mark.parametrize(
    ("name", "arch"), [(s, "deepseek_v3") for s in STRATEGIES] + [("fp16-als", "deepseek_v3"), ("fp16-als", "t5")]
)
def test_the_prepared_parameters_have_the_dtypes_transformers_loads(name, arch):
    """DeepSeek-V3's router `gate.weight` (strict) and, in FP16, T5's `wo` stay FP32; nothing else does."""
    strategy = get_strategy(name)
    build = t5_overflowing_fp16 if arch == "t5" else lambda: tiny_moe(arch)
    cls = transformers.T5ForConditionalGeneration if arch == "t5" else transformers.AutoModelForCausalLM
    expected = _loaded_dtypes(build(), strategy.param_dtype, cls)
    assert torch.float32 in expected.values() and strategy.param_dtype in expected.values()
    model = strategy.prepare_model(build())
    assert {n: p.dtype for n, p in model.named_parameters()} == expected
    check_promises(strategy, model)  # the kept FP32 parameters break no promise
    if arch == "t5":
        return  # trained below, by the Trainer
    kept = {n: p.detach().clone() for n, p in model.named_parameters() if p.dtype == torch.float32}
    optimizer = strategy.create_optimizer(list(model.parameters()), lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = train_steps(strategy, model, optimizer, [ids, ids])
    assert all(torch.isfinite(torch.tensor(losses)))
    after = dict(model.named_parameters())
    for name, before in kept.items():
        assert after[name].dtype == torch.float32 and not torch.equal(after[name].detach(), before), name


@pytest.mark.parametrize("name", ["collage-plus", "fp16-als"])
def test_fsdp2_shards_them_in_the_strategys_dtype(one_rank_group, caplog, name):
    """FSDP2 all-gathers a block's parameters in one dtype (`fully_shard` refuses a block of BF16 experts
    beside an FP32 router): before sharding they are cast to the strategy's dtype, named, and it trains."""
    strategy = get_strategy(name)
    with caplog.at_level(logging.WARNING, logger="hf_lowprec.strategies.casting"):
        model = shard_model(strategy, tiny_moe("deepseek_v3"))
    assert {p.dtype for p in model.parameters()} == {strategy.param_dtype}
    assert "model.layers.1.mlp.gate.weight" in caplog.text and "FSDP2" in caplog.text
    optimizer = strategy.create_optimizer(list(model.parameters()), lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    assert all(torch.isfinite(torch.tensor(train_steps(strategy, model, optimizer, [ids, ids]))))


def _pairs(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, 256, (12,), generator=g) for _ in range(n)]
    return [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.flip(0)[:8].clone()} for x in ids]


def test_fp16_als_trains_a_t5_whose_wo_output_passes_65504_finite(tmp_path):
    """Stored in FP16, `wo`'s output was inf in every feed-forward block (T5 clamps it to 64504):
    kept FP32, as transformers loads it, every output is finite and larger than FP16 holds."""
    model = t5_overflowing_fp16()
    outputs: list[torch.Tensor] = []
    for name, module in model.named_modules():
        if name.endswith(".wo"):
            module.register_forward_hook(lambda m, i, out: outputs.append(out.detach()))
    args = trainer_arguments(tmp_path, precision_strategy="fp16-als", max_steps=3, save_strategy="no")
    trainer = Seq2SeqTrainer(model=model, args=Seq2SeqTrainingArguments(**args), train_dataset=_pairs(12))
    trainer.train()
    assert outputs and all(bool(torch.isfinite(out).all()) for out in outputs)
    assert max(out.abs().max().item() for out in outputs) > 65504
    assert all(p.dtype == torch.float32 for n, p in trainer.model.named_parameters() if ".wo." in n)
    losses = [loss for _, loss in logged_losses(trainer)]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


def test_fp16_als_skips_a_step_whose_kept_fp32_gradient_is_inf():
    """fp16-als clamps an FP16 gradient's inf (its overflow policy) and skips only on NaN; a kept FP32
    gradient has no clamp, so an inf there (an FP16 activation gradient's overflow upstream) went
    into the weight: `wo` non-finite for good. Any non-finite FP32 gradient skips the step."""
    torch.manual_seed(0)
    strategy = get_strategy("fp16-als")
    model = strategy.prepare_model(transformers.T5ForConditionalGeneration(transformers.T5Config(**T5)))
    optimizer = strategy.create_optimizer(list(model.parameters()), lr=1e-3)
    wo = model.encoder.block[0].layer[1].DenseReluDense.wo.weight
    assert wo.dtype == torch.float32
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with strategy.forward_context():
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids[:, :8].contiguous()).loss
    strategy.scale_loss(loss).backward()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        wo.grad.view(-1)[0] = float("inf")
    optimizer.step()
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), f"{name} changed in a step that should have been skipped"
