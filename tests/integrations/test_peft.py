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


# TrainingArguments of a short run that saves nothing (with output_dir, max_steps and the precision).
_UNSAVED = {
    "per_device_train_batch_size": 4,
    "learning_rate": 1e-2,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "use_cpu": True,
    "disable_tqdm": True,
    "seed": 0,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", available_strategies())
def test_lora_with_trainer(tmp_path, name):
    strategy = get_strategy(name)
    model = lora_model()
    args = TrainingArguments(output_dir=str(tmp_path), precision_strategy=name, max_steps=3, **_UNSAVED)
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


@pytest.mark.parametrize("name", ["bf16-mixed", "collage-plus", "fp8-lm-o2"])
def test_adapters_not_trained_keep_their_dtype_and_values(name):
    # Every frozen floating tensor went to the compute dtype: the inactive adapter and the
    # inactive modules_to_save copy too, rounded to BF16 and saved so.
    def config(r):
        return peft.LoraConfig(r=r, target_modules=["c_attn"], modules_to_save=["ln_f"], init_lora_weights=False)

    model = peft.get_peft_model(tiny_gpt2(), config(4))
    model.add_adapter("second", config(2))
    model.set_adapter("second")
    before = {n: p.detach().clone() for n, p in model.named_parameters() if ".default." in n}
    assert any("lora_A" in n for n in before) and any("modules_to_save" in n for n in before)
    strategy = get_strategy(name)
    model = prepare_model(strategy, model)
    after = dict(model.named_parameters())
    for n, p in before.items():
        assert after[n].dtype == torch.float32 and torch.equal(after[n], p), n
    base = [p for n, p in after.items() if not p.requires_grad and ".default." not in n and p.is_floating_point()]
    assert {p.dtype for p in base} == {strategy.compute_dtype}


def _lora_args(out, name, **overrides):
    return TrainingArguments(
        **{
            "output_dir": str(out),
            "precision_strategy": name,
            "max_steps": 4,
            "save_steps": 2,
            "per_device_train_batch_size": 4,
            "learning_rate": 1e-2,
            "logging_steps": 1,
            "report_to": "none",
            "use_cpu": True,
            "disable_tqdm": True,
            "seed": 0,
            **overrides,
        }
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["collage-plus", "bf16-pure", "fp16-als", "bf16-mixed"])
def test_lora_resumes_bit_for_bit(tmp_path, name):
    """The stock resume loads the adapter through PEFT's `load_adapter`, which turns 16-bit
    adapters to FP32: the strategy's optimizer then refused them (collage-plus, bf16-pure, fp16-als).
    They keep the strategy's dtype, and steps 3 and 4 repeat the uninterrupted run bit for bit."""
    full = Trainer(model=lora_model(), args=_lora_args(tmp_path / "a", name), train_dataset=TokenBlocks(16))
    full.train()
    # The same base (a LoRA checkpoint holds the adapters only); the adapters come from the checkpoint.
    resumed = Trainer(model=lora_model(), args=_lora_args(tmp_path / "b", name), train_dataset=TokenBlocks(16))
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    check_dtypes(resumed.model, get_strategy(name))
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (full, resumed)]
    assert losses[0] == losses[1], losses  # steps 1 and 2 from the checkpoint's log, 3 and 4 trained again
    after = dict(resumed.model.named_parameters())
    for n, p in full.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, after[n]), n


@pytest.mark.slow
def test_lora_best_model_at_end_keeps_the_adapters_dtype(tmp_path):
    """`load_best_model_at_end` loads the best adapter through `load_adapter` too: under
    collage-plus the adapters stay BF16, equal to the best checkpoint's."""
    args = _lora_args(tmp_path, "collage-plus", eval_strategy="steps", eval_steps=2, load_best_model_at_end=True)
    trainer = Trainer(model=lora_model(), args=args, train_dataset=TokenBlocks(16), eval_dataset=TokenBlocks(8))
    trainer.train()
    check_dtypes(trainer.model, get_strategy("collage-plus"))
    best = peft.PeftModel.from_pretrained(tiny_gpt2(), trainer.state.best_model_checkpoint)
    after = dict(trainer.model.named_parameters())
    for n, p in best.named_parameters():
        if "lora_" in n:
            assert torch.equal(p.detach().to(torch.bfloat16), after[n].detach()), n


def test_a_model_merged_after_training_is_saved_as_it_holds_it_under_save_full_precision(tmp_path, caplog):
    """`trainer.model = trainer.model.merge_and_unload(); trainer.save_model()` with
    save_full_precision: the optimizer holds only the adapters, which the merged model no longer
    has, so nothing of it has an FP32 value beyond its own. It was written as FP32 copies of its
    BF16 weights (`dtype: float32`, the file twice the size); now as it holds them, with a warning."""
    import json

    from safetensors.torch import load_file

    options = {"save_full_precision": True}
    args = _lora_args(tmp_path, "collage-plus", max_steps=1, save_strategy="no", precision_options=options)
    trainer = Trainer(model=lora_model(), args=args, train_dataset=TokenBlocks(8))
    trainer.train()
    trainer.model = trainer.model.merge_and_unload()
    trainer.save_model()
    saved, held = load_file(f"{tmp_path}/model.safetensors"), trainer.model.state_dict()
    assert {v.dtype for v in saved.values()} == {torch.bfloat16}
    assert all(torch.equal(v, held[k]) for k, v in saved.items())
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert "holds none of the parameters of the model being saved" in caplog.text


def _fp8_lora(name, seed=0, **config):
    """A tiny GPT-2 with rank-16 LoRA (a width FP8 could take) prepared by `name`, trained 3 steps."""
    torch.manual_seed(seed)
    lora = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": ["c_attn", "c_fc"], **config}
    strategy = get_strategy(name)
    model = prepare_model(strategy, peft.get_peft_model(tiny_gpt2(seed), peft.LoraConfig(**lora)))
    optimizer = strategy.create_optimizer([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for ids in batches(3):
        strategy.train_step(model, ids, optimizer)
    return strategy, model


@pytest.mark.parametrize("name", ["fp8-lm-o1", "fp8-lm-o2", "coat"])
def test_fp8_strategies_leave_lora_adapters_out_of_fp8_and_merges_reach_the_fp8_weights(name):
    # The adapters were FP8 layers (O2: scaled FP16 masters PEFT's merge read raw: inf, NaN
    # logits), and a merge wrote the base weight's .data in place, which the FP8 weight cache did
    # not see: merge_and_unload's model computed without the adapter (1.19 off).
    from hf_lowprec.fp8 import FP8Linear

    strategy, model = _fp8_lora(name)
    layers = [m for n, m in model.named_modules() if n.endswith((".lora_A.default", ".lora_B.default"))]
    assert layers and all(type(m) is torch.nn.Linear and m.weight.dtype == torch.float32 for m in layers)
    target = model.base_model.model.transformer.h[0].attn.c_attn
    assert isinstance(target.base_layer, FP8Linear)
    a, b = target.lora_A["default"].weight, target.lora_B["default"].weight
    # B·A·scaling from the adapter's true values (Conv1D stores K×N); PEFT's FP32 product of r
    # terms is within r·2^-24 of Σ|b||a| per element (plus one rounding of the scaling).
    scaling = target.scaling["default"]
    expected = (b.double() @ a.double() * scaling).t()
    bound = ((b.double().abs() @ a.double().abs()) * scaling * (a.shape[0] + 2) * 2.0**-24).t()
    assert ((target.get_delta_weight("default").double() - expected).abs() <= bound).all()
    ids = batches(1)[0]
    model.train()  # training mode (no dropout): the FP8 weight cache is used; eval mode casts every forward
    with torch.no_grad(), strategy.forward_context():
        unmerged = model(input_ids=ids).logits  # fills every FP8 layer's weight cache
        merged_model = model.merge_and_unload()
        merged = merged_model(input_ids=ids).logits
        for m in merged_model.modules():
            if isinstance(m, FP8Linear):
                m.forget_weight_cast()
        fresh = merged_model(input_ids=ids).logits
    assert torch.equal(merged, fresh)  # the merged weights are what the FP8 GEMMs take
    assert torch.isfinite(merged).all()
    # LoRA's part is there: the merged model is the unmerged one to FP8's rounding of the sum.
    assert (merged - unmerged).abs().max() < 0.5 * (
        unmerged - _base_logits(strategy, merged_model, target, ids)
    ).abs().max()


def _base_logits(strategy, model, target, ids):
    """The merged model's logits with the adapter's delta taken out of the first block's c_attn."""
    layer = model.transformer.h[0].attn.c_attn
    delta = target.get_delta_weight("default").to(layer.weight.dtype)
    with torch.no_grad(), strategy.forward_context():
        layer.weight.sub_(delta)
        try:
            return model(input_ids=ids).logits
        finally:
            layer.weight.add_(delta)


def test_the_lm_head_in_modules_to_save_stays_high_precision_under_fp8():
    # get_output_embeddings() is PEFT's wrapper: only it was skipped, and both heads inside it
    # became FP8 layers, silently.
    from hf_lowprec.fp8 import FP8Linear

    _, model = _fp8_lora("fp8-lm-o2", modules_to_save=["lm_head"])
    head = model.base_model.model.lm_head
    assert type(head).__name__ == "ModulesToSaveWrapper"
    assert not any(isinstance(m, FP8Linear) for m in head.modules())
    assert any(isinstance(m, FP8Linear) for m in model.modules())


def test_a_classification_head_in_modules_to_save_stays_high_precision_under_fp8():
    # The head was found through get_output_embeddings() only, None for a sequence classifier:
    # its `score`, which PEFT's SEQ_CLS puts in modules_to_save, became FP8 layers (both copies).
    from transformers import LlamaForSequenceClassification

    from hf_lowprec.fp8 import FP8Linear
    from tests.helpers import tiny_llama_config

    config = tiny_llama_config(hidden_size=64)
    config.num_labels, config.pad_token_id = 16, 0
    lora = peft.LoraConfig(r=16, target_modules=["q_proj"], task_type="SEQ_CLS")
    model = prepare_model(get_strategy("fp8-lm-o2"), peft.get_peft_model(LlamaForSequenceClassification(config), lora))
    head = model.base_model.model.score
    assert type(head).__name__ == "ModulesToSaveWrapper"
    assert not any(isinstance(m, FP8Linear) for m in head.modules())
    assert any(isinstance(m, FP8Linear) for m in model.modules())


@pytest.mark.parametrize("name", ["fp8-lm-o2", "fp8-lm-o3"])
def test_lora_on_moe_experts_trains_under_o2_and_o3(tmp_path, name):
    # PEFT's ParamWrapper read the scaled adapters raw: one step of grad norm 1.26e4, then 0.0,
    # the loss flat, no warning.
    from hf_lowprec.testing.moe import tiny_moe

    config = peft.LoraConfig(
        r=16, lora_alpha=32, target_modules=["q_proj"], target_parameters=["mlp.experts.down_proj"]
    )
    model = peft.get_peft_model(tiny_moe("qwen3_moe"), config)
    args = _lora_args(tmp_path, name, max_steps=6, save_strategy="no", learning_rate=1e-2)
    trainer = Trainer(model=model, args=args, train_dataset=TokenBlocks(4))
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    norms = [h["grad_norm"] for h in logged]
    assert all(0 < n < 10 for n in norms), norms
    assert logged[-1]["loss"] < logged[0]["loss"] - 0.2


@pytest.mark.parametrize("name", ["fp8-lm-o1", "fp8-lm-o2", "fp8-lm-o3", "coat"])
def test_an_adapter_added_after_an_fp8_prepare_is_refused_by_peft_as_the_docs_say(name):
    """docs/recipes.md "PEFT" and docs/numerics.md name PEFT's message for this order: the FP8
    strategies take the adapter before `prepare_model` (or the Trainer), as `_fp8_lora` does."""
    prepared = get_strategy(name).prepare_model(tiny_gpt2())
    with pytest.raises(ValueError, match=r"Target module FP8Linear\(.*\) is not supported"):
        peft.get_peft_model(prepared, peft.LoraConfig(r=4, target_modules=["c_attn"]))


@pytest.mark.parametrize(
    "name, dtype", [("bf16-mixed", torch.bfloat16), ("fp16-als", torch.float16), ("fp8-lm-o2", torch.bfloat16)]
)
def test_a_merge_is_in_the_frozen_base_dtype_and_the_callers_base_was_cast(name, dtype):
    """docs/recipes.md "PEFT": `merge_and_unload()` gives the frozen base's dtype, and the base the
    caller passed in holds it too (cast in place)."""
    base = tiny_gpt2()
    model = prepare_model(get_strategy(name), peft.get_peft_model(base, peft.LoraConfig(r=16, target_modules=["c_fc"])))
    assert base.transformer.h[0].mlp.c_proj.weight.dtype == dtype  # not an adapter target: the base, cast
    merged = model.merge_and_unload().state_dict()
    assert merged["transformer.h.0.mlp.c_fc.weight"].dtype == dtype
