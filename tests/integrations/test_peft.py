"""LoRA (peft) under every strategy: adapter-only optimizer state, frozen base in the compute dtype, adapter saving."""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")

from accelerate import Accelerator  # noqa: E402

from hf_lowprec import Trainer, TrainingArguments, available_strategies, get_strategy  # noqa: E402
from hf_lowprec.integrations.accelerate import PrecisionPlugin  # noqa: E402
from hf_lowprec.integrations.peft import prepare_model  # noqa: E402
from tests.helpers import TokenBlocks, batches, tiny_gpt2  # noqa: E402

STORAGE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def lora_model(seed=0):
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn", "c_proj"], task_type="CAUSAL_LM"
    )
    return peft.get_peft_model(tiny_gpt2(seed), config)


def check_dtypes(model, strategy):
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert trainable and frozen
    assert {p.dtype for p in trainable} == {strategy.param_dtype}
    if strategy.compute_dtype in STORAGE_DTYPES:
        assert {p.dtype for p in frozen if p.is_floating_point()} == {strategy.compute_dtype}
    return trainable, frozen


@pytest.mark.slow
@pytest.mark.parametrize("name", available_strategies())
def test_lora_with_trainer(tmp_path, name):
    strategy = get_strategy(name)
    model = lora_model()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        precision_strategy=name,
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=TokenBlocks(16))
    # Snapshots after the strategy converted the model (FP8 layers may store scaled weights).
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    adapter_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()

    trainable, _frozen = check_dtypes(trainer.model, strategy)
    # Optimizer state exists for exactly the adapter weights.
    assert {id(p) for p in trainer.optimizer.state} == {id(p) for p in trainable}
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(after[n], before) for n, before in base_before.items())  # frozen stays frozen
    assert any(not torch.equal(after[n], before) for n, before in adapter_before.items())

    trainer.save_model()
    assert (tmp_path / "adapter_model.safetensors").exists()
    assert not (tmp_path / "model.safetensors").exists()
    reloaded = peft.PeftModel.from_pretrained(tiny_gpt2(), str(tmp_path))
    saved = {n: p for n, p in reloaded.named_parameters() if "lora_" in n}
    assert saved
    for n, p in saved.items():
        assert torch.equal(p.detach().to(after[n].dtype), after[n].detach())


def test_lora_with_the_accelerate_plugin():
    accelerator = Accelerator(cpu=True)
    plugin = PrecisionPlugin("collage-plus")
    model = lora_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # a plain loop passes every parameter
    model, optimizer = plugin.prepare(accelerator, model, optimizer)
    batch = batches(1, batch=2, seq=16)[0]
    for _ in range(2):
        plugin.backward(accelerator, model(input_ids=batch, labels=batch).loss)
        optimizer.step()
        optimizer.zero_grad()
    trainable, _ = check_dtypes(model, plugin.strategy)
    # Frozen weights have no gradient, so they get no state.
    assert {id(p) for p in optimizer.optimizer.state} == {id(p) for p in trainable}


def test_prepare_model_leaves_a_plain_model_to_the_strategy():
    model = prepare_model(get_strategy("bf16-mixed"), tiny_gpt2())
    assert {p.dtype for p in model.parameters()} == {torch.float32}
