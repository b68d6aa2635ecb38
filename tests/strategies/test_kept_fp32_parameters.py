"""The 16-bit-weight strategies keep FP32 the trainable parameters transformers keeps in FP32 when it
loads a model in 16 bits (`_keep_in_fp32_modules_strict`, for FP16 `_keep_in_fp32_modules` too:
`strategies.casting.kept_parameters`), and their optimizers step them as plain FP32 AdamW
(tests/optim/test_kept_fp32.py); a T5 whose `wo` output passes 65504 trains finite under fp16-als.
With PEFT the frozen base keeps them FP32 too (`integrations.peft.prepare_model`)."""

from __future__ import annotations

import logging
import tempfile

import pytest
import torch
import transformers

from hf_lowprec import Seq2SeqTrainer, Seq2SeqTrainingArguments, get_strategy
from hf_lowprec.engines.fsdp2 import shard_model
from hf_lowprec.integrations.peft import adapter_parameters
from hf_lowprec.integrations.peft import prepare_model as prepare_peft_model
from hf_lowprec.report import check_promises
from hf_lowprec.testing.moe import tiny_moe
from tests.helpers import gamma, logged_losses, train_steps, trainer_arguments

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


LORA_TARGETS = {"t5": ["q", "v"], "deepseek_v3": ["o_proj"]}  # `wo`, the router: frozen base


def _lora(model: torch.nn.Module, arch: str):
    peft = pytest.importorskip("peft")
    task = "SEQ_2_SEQ_LM" if arch == "t5" else "CAUSAL_LM"
    return peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS[arch], task_type=task)
    )


def _frozen_base_dtypes(model: torch.nn.Module) -> dict[str, torch.dtype]:
    adapters = adapter_parameters(model)
    return {n: p.dtype for n, p in model.named_parameters() if id(p) not in adapters}


@pytest.mark.parametrize(
    ("name", "arch"),
    [
        ("collage-plus", "deepseek_v3"),
        ("bf16-mixed", "deepseek_v3"),
        ("fp16-als", "t5"),
        ("fp16-mixed", "t5"),
        ("bf16-mixed", "t5"),
    ],
)
def test_a_peft_models_frozen_base_has_the_dtypes_of_a_stock_load_in_the_compute_dtype(name, arch):
    """The integrations' PEFT preparation (Trainer, TRL `peft_config=`, the plugin) holds the frozen base in
    the compute dtype but for what `from_pretrained(dtype=<compute dtype>)` keeps FP32: it cast T5's `wo`
    to FP16 (inf at every step) and DeepSeek-V3's router `gate.weight` to BF16. T5 in BF16: `wo` BF16."""
    strategy = get_strategy(name)
    build = t5_overflowing_fp16 if arch == "t5" else lambda: tiny_moe(arch)
    cls = transformers.T5ForConditionalGeneration if arch == "t5" else transformers.AutoModelForCausalLM
    with tempfile.TemporaryDirectory() as stored:
        build().save_pretrained(stored)
        expected = _frozen_base_dtypes(_lora(cls.from_pretrained(stored, dtype=strategy.compute_dtype), arch))
    assert torch.float32 in expected.values() or (name, arch) == ("bf16-mixed", "t5")
    model = prepare_peft_model(strategy, _lora(build(), arch))
    assert _frozen_base_dtypes(model) == expected
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all(id(p) in adapter_parameters(model) for p in trained)


def test_trainer_with_lora_keeps_the_frozen_t5_wo_fp32_and_trains_finite(tmp_path):
    """Seq2SeqTrainer + LoRA on q, v under fp16-als: the frozen `wo` was FP16, its output inf at every step
    and no step skipped (losses 5.789, 6.098, 6.043 against FP32's 5.699, 6.038, 6.002). Kept FP32, each
    `wo` output is finite, passes 65504 and is within γ_K·(|x|·|W|ᵀ) of its FP64 product (an FP32 dot
    product of K = d_ff terms, any order: Higham's bound)."""
    model = _lora(t5_overflowing_fp16(), "t5")
    calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for name, module in model.named_modules():
        if name.endswith(".wo"):
            module.register_forward_hook(lambda m, i, out: calls.append((i[0].detach(), m.weight, out.detach())))
    args = trainer_arguments(tmp_path, precision_strategy="fp16-als", max_steps=3, save_strategy="no")
    trainer = Seq2SeqTrainer(model=model, args=Seq2SeqTrainingArguments(**args), train_dataset=_pairs(12))
    trainer.train()
    assert calls and all(bool(torch.isfinite(out).all()) for _, _, out in calls)
    assert max(out.abs().max().item() for _, _, out in calls) > 65504
    bound = gamma(T5["d_ff"])
    for x, weight, out in calls:
        assert weight.dtype == torch.float32 and not weight.requires_grad
        exact = x.double() @ weight.double().T
        error = (out.double() - exact).abs()
        assert bool((error <= bound * (x.double().abs() @ weight.double().abs().T)).all())
    assert trainer.precision.skipped_steps == 0
    losses = [loss for _, loss in logged_losses(trainer)]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
