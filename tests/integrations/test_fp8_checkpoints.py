"""Published FP8 checkpoints in and out (issue #48, items 2-4; docs/checkpoints.md).

The checkpoints here are written as DeepSeek-V3 / Qwen3-FP8 releases are (E4M3 `weight`,
FP32 `weight_scale_inv` per 128×128 block, `quantization_config.quant_method: "fp8"`), by a
writer independent of the package's own `quantize_published` (`tests/fp8_reference.py`). They
are loaded as users load them: `from_pretrained(path)`, which on this CPU dequantizes into BF16
layers, or, with CUDA faked for the load, into transformers' FP8 inference layers as on a GPU.
"""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_lowprec
from hf_lowprec import Trainer, TrainingArguments
from hf_lowprec.checkpoints.fp8_published import restore_published_fp8
from hf_lowprec.fp8.blocks import FrozenBlockFP8Linear, dequantize_published, quantize_published
from hf_lowprec.report import describe, format_report
from tests.fp8_reference import publish_fp8
from tests.helpers import VOCAB, TokenBlocks, assert_bits_equal, load_as_on_a_gpu, tiny_llama_config, trainer_arguments

E4M3 = torch.float8_e4m3fn
STRATEGIES = hf_lowprec.available_strategies()
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = tiny_llama_config(128)  # whole 128×128 blocks, as transformers' dequantizing load needs
    bf16, fp8 = tmp_path_factory.mktemp("bf16"), tmp_path_factory.mktemp("fp8")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(bf16)
    publish_fp8(bf16, fp8)
    return str(fp8)


def _stored(path: str) -> dict[str, torch.Tensor]:
    return load_file(f"{path}/model.safetensors")


def _trainer(model, out, name: str, **overrides) -> Trainer:
    args = TrainingArguments(**trainer_arguments(out, precision_strategy=name, **{"save_strategy": "no", **overrides}))
    return Trainer(model=model, args=args, train_dataset=TokenBlocks())


# --- the arithmetic ---------------------------------------------------------------------------


def test_dequantized_blocks_are_the_exact_products_rounded_once():
    # E4M3 has a 4-bit significand, FP32 a 24-bit one: their product is exact in FP64 (28 bits),
    # so FP64 rounded to FP32 is the correctly rounded product, which FP32's multiply also gives.
    # A 200×300 weight leaves partial last blocks (DeepSeek's format rounds the grid up).
    torch.manual_seed(1)
    payload = (torch.randn(200, 300) * 100).to(E4M3)
    scale = torch.rand(2, 3) * 1e-3 + 1e-4
    reference = (
        payload.double() * scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    ).float()
    assert_bits_equal(dequantize_published(payload, scale, torch.float32), reference)
    assert_bits_equal(dequantize_published(payload, scale, torch.bfloat16), reference.bfloat16())
    with pytest.raises(ValueError, match=r"needs \(2, 3\)"):
        dequantize_published(payload, scale[:, :2], torch.float32)


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_quantized_blocks_are_within_e4m3_rounding_of_fp64(scale_fmt):
    # Per element: E4M3 rounds to nearest with 3 fraction bits (relative error ≤ 2^-4) down to its
    # smallest normal 2^-6, below which the spacing is 2^-9 (absolute error ≤ 2^-10), both in units
    # of the block's scale; the FP32 division before the cast adds at most 2^-24 relative.
    torch.manual_seed(2)
    weight = torch.randn(256, 384, dtype=torch.float64) * torch.logspace(-3, 2, 384, dtype=torch.float64)
    weight[:128, :128] = 0  # an all-zero block
    payload, scale_inv = quantize_published(weight.float(), scale_fmt=scale_fmt)
    assert payload.dtype == E4M3 and scale_inv.shape == (2, 3)
    scales = dequantize_published(torch.ones(256, 384).to(E4M3), scale_inv, torch.float64)
    if scale_fmt == "ue8m0":
        assert torch.equal(torch.log2(scales), torch.round(torch.log2(scales)))  # powers of two
    error = (dequantize_published(payload, scale_inv, torch.float64) - weight).abs()
    bound = torch.maximum(weight.abs() * 2**-4, scales * 2**-10) * (1 + 2**-20) + weight.abs() * 2**-23
    assert (error <= bound).all(), (error / bound).max()
    assert (dequantize_published(payload, scale_inv, torch.float64)[:128, :128] == 0).all()
    assert error.max() > 0  # the bound is met by rounding, not by a copy
    bad = weight.float().clone()
    bad[5, 200] = float("inf")
    payload, scale_inv = quantize_published(bad)
    assert not torch.isfinite(dequantize_published(payload, scale_inv, torch.float32)[:128, 128:256]).any()


def test_the_frozen_layer_computes_the_dequantized_linear_and_saves_no_widened_weight():
    torch.manual_seed(3)
    payload, scale = quantize_published(torch.randn(256, 128))
    layer = FrozenBlockFP8Linear(payload, scale, torch.randn(256))
    x = torch.randn(4, 7, 128, dtype=torch.bfloat16, requires_grad=True)
    weight = dequantize_published(payload, scale, torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x)
    assert_bits_equal(y, torch.nn.functional.linear(x, weight, layer.bias.bfloat16()))
    assert all(t.dtype in (E4M3, torch.float32) for t in saved), [t.dtype for t in saved]  # payload and scales only
    grad = torch.randn_like(y)
    y.backward(grad)
    assert_bits_equal(x.grad, grad @ weight)
    assert layer.weight.grad is None and layer.weight_scale_inv.grad is None
    for cast in (torch.nn.Module.float, torch.nn.Module.half, torch.nn.Module.bfloat16):
        cast(layer)
        assert layer.weight.dtype == E4M3 and layer.weight_scale_inv.dtype == torch.float32
        assert_bits_equal(layer.weight_scale_inv, scale)
    assert layer.bias.dtype == torch.bfloat16  # the bias is an ordinary tensor
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x.detach().float()).dtype == torch.bfloat16


# --- in: the stored values ---------------------------------------------------------------------


@pytest.mark.parametrize("load", ["dequantized", "fp8 layers"])
def test_trained_layers_start_from_the_stored_values_not_a_bf16_round_trip(fp8_checkpoint, tmp_path, load, caplog):
    stored = _stored(fp8_checkpoint)
    model = (
        AutoModelForCausalLM.from_pretrained(fp8_checkpoint)
        if load == "dequantized"
        else load_as_on_a_gpu(fp8_checkpoint)
    )
    with caplog.at_level("WARNING"):
        trainer = _trainer(model, tmp_path, "fp8-lm-o1", max_steps=1, precision_options={"margin": 1})  # FP32 masters
    # The checkpoint's layers are no FP8Linear of a conversion before the strategy's: they take its options.
    assert "already in the model keep their own configuration" not in caplog.text
    rounded_twice = 0
    for name, module in trainer.model.named_modules():
        if name.rsplit(".", 1)[-1] not in PROJECTIONS:
            continue
        exact = dequantize_published(stored[name + ".weight"], stored[name + ".weight_scale_inv"], torch.float32)
        assert module.weight.dtype == torch.float32 and module.weight.requires_grad
        assert_bits_equal(module.weight, exact, name)
        rounded_twice += (exact.bfloat16().float() != exact).sum().item()
    assert rounded_twice > 0  # the BF16 load really lost bits that the restore gave back
    report = format_report(describe(trainer.precision, trainer.model))
    assert "FP8 checkpoint: 7 layers from their stored values: 7 trained from FP32 values" in report
    assert "FP8 layers: 7 converted (7 with recipe tensorwise, margin 1)" in report
    trainer.train()  # the stock checks accept the model (transformers' FP8 layers are refused for full training)


def test_a_layer_changed_after_loading_keeps_its_values(fp8_checkpoint, tmp_path, caplog):
    model = AutoModelForCausalLM.from_pretrained(fp8_checkpoint)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(2)
    edited = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    record = restore_published_fp8(model, keep_frozen_fp8=False)
    assert record["changed"] == ["model.layers.0.mlp.up_proj"] and len(record["layers"]) == 6
    assert_bits_equal(model.model.layers[0].mlp.up_proj.weight, edited)
    assert "changed after loading" in caplog.text


def test_a_model_not_loaded_from_fp8_is_left_alone(tmp_path, caplog):
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert restore_published_fp8(model, keep_frozen_fp8=True) is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert "names neither a folder" not in caplog.text  # built from a config: no folder to look for
    # Nor when it was given a name for a trainer's logs (the RL recipes' reward model): the
    # warning said "loaded from 'tiny-reward-model' ... if it is a published FP8 checkpoint".
    model.name_or_path = "tiny-reward-model"
    assert restore_published_fp8(model, keep_frozen_fp8=True) is None
    assert "names neither a folder" not in caplog.text


def test_a_checkpoint_whose_folder_cannot_be_found_is_said(fp8_checkpoint, tmp_path, monkeypatch, caplog):
    """A CPU load dequantizes and drops `quantization_config`: only the folder says the model is
    FP8. Loaded by a relative path and the directory changed after (or the folder moved), it was
    silently trained from the dequantized values and saved in FP32/BF16; now one warning says so."""
    parent, folder = fp8_checkpoint.rsplit("/", 1)
    monkeypatch.chdir(parent)
    model = AutoModelForCausalLM.from_pretrained(folder)
    monkeypatch.chdir(tmp_path)
    assert restore_published_fp8(model, keep_frozen_fp8=False) is None
    assert restore_published_fp8(model, keep_frozen_fp8=False) is None
    warned = [r.getMessage() for r in caplog.records if "names neither a folder" in r.getMessage()]
    assert len(warned) == 1 and repr(folder) in warned[0] and "absolute path" in warned[0]
    # Said by the first rank only (every rank of a distributed run loads the same model).
    monkeypatch.setenv("RANK", "1")
    assert restore_published_fp8(AutoModelForCausalLM.from_pretrained(fp8_checkpoint), keep_frozen_fp8=False)
    model = AutoModelForCausalLM.from_pretrained(fp8_checkpoint)
    model.name_or_path = folder  # relative to the directory left
    assert restore_published_fp8(model, keep_frozen_fp8=False) is None
    assert len([r for r in caplog.records if "names neither a folder" in r.getMessage()]) == 1


@pytest.mark.parametrize("name", ["fp8-lm-o1", "fp8-lm-o2"])
def test_lora_keeps_the_frozen_base_as_published(fp8_checkpoint, tmp_path, name):
    from peft import LoraConfig, get_peft_model

    stored = _stored(fp8_checkpoint)
    plain = AutoModelForCausalLM.from_pretrained(fp8_checkpoint)  # transformers' own dequantized BF16 model
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = plain(ids).logits
    torch.manual_seed(5)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(fp8_checkpoint), LoraConfig(r=16, target_modules=["q_proj", "v_proj"])
    )
    trainer = _trainer(model, tmp_path, name, max_steps=2)
    frozen = [(n, m) for n, m in trainer.model.named_modules() if isinstance(m, FrozenBlockFP8Linear)]
    assert len(frozen) == 7
    params = sum(m.weight.numel() for _, m in frozen)
    stored_bytes = sum(t.numel() * t.element_size() for _, m in frozen for t in (m.weight, m.weight_scale_inv))
    assert stored_bytes / params <= 1.1  # BF16 would be 2
    for fqn, module in frozen:
        name_in_checkpoint = fqn.split("base_model.model.", 1)[1].replace(".base_layer", "")
        assert_bits_equal(module.weight.view(torch.uint8), stored[name_in_checkpoint + ".weight"].view(torch.uint8))
        assert_bits_equal(module.weight_scale_inv, stored[name_in_checkpoint + ".weight_scale_inv"])
    with torch.no_grad(), trainer.precision.forward_context():  # LoRA's B starts at zero
        # The BF16 logits widened to FP32, as the autocast strategies hand outputs on (bf16=True's way).
        assert_bits_equal(trainer.model(ids).logits, expected.float(), "first forward")
    assert "7 frozen as published FP8" in format_report(describe(trainer.precision, trainer.model))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert all(m.weight.dtype == E4M3 for _, m in frozen)


# --- in, trained, out ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_strategy_trains_an_fp8_checkpoint_and_saves_it_in_the_same_format(fp8_checkpoint, tmp_path, name):
    stored = _stored(fp8_checkpoint)
    trainer = _trainer(AutoModelForCausalLM.from_pretrained(fp8_checkpoint), tmp_path / "run", name, max_steps=2)
    trainer.train()
    trainer.save_model(str(tmp_path / "out"))
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8" and config["dtype"] == "bfloat16"
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))  # plain transformers
    for key in stored:
        if key.endswith("weight_scale_inv"):
            assert saved[key].shape == stored[key].shape and saved[key].dtype == torch.float32
            continue
        assert saved[key].dtype == stored[key].dtype, key
        module = reloaded.get_submodule(key.removesuffix(".weight"))
        if saved[key].dtype == E4M3:
            as_loaded = dequantize_published(
                saved[key], saved[key.removesuffix("weight") + "weight_scale_inv"], torch.bfloat16
            )
            assert_bits_equal(module.weight, as_loaded, key)
    logits = reloaded(torch.randint(0, VOCAB, (1, 8))).logits
    assert torch.isfinite(logits).all()


def test_a_dequantizing_load_conversion_left_on_the_model_is_not_reversed_at_save(fp8_checkpoint, tmp_path):
    """transformers 5.17 (the GPU machine's) keeps the load's FP8 dequantization among the model's
    weight conversions and reverses it at save, where it quantized every `weight` (the embedding
    and the head as well, which the release stores in BF16). Attached here as 5.17 attaches it,
    the save must still write the release's layout: the same keys and dtypes as stored."""
    from transformers.core_model_loading import WeightConverter
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    from transformers.utils.quantization_config import FineGrainedFP8Config

    model = AutoModelForCausalLM.from_pretrained(fp8_checkpoint)
    dequantize = Fp8Dequantize(FineGrainedFP8HfQuantizer(FineGrainedFP8Config(weight_block_size=[128, 128])))
    converter = WeightConverter(["weight$", "weight_scale_inv", "activation_scale"], ["weight"], [dequantize])
    model._weight_conversions = [converter]
    trainer = _trainer(model, tmp_path / "run", "bf16-mixed", max_steps=1)
    trainer.train()
    trainer.save_model(str(tmp_path / "out"))
    stored, saved = _stored(fp8_checkpoint), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert {k: v.dtype for k, v in saved.items()} == {k: v.dtype for k, v in stored.items()}


def test_the_saved_fp8_weights_are_the_trained_weights_within_e4m3_rounding(fp8_checkpoint, tmp_path):
    trainer = _trainer(
        AutoModelForCausalLM.from_pretrained(fp8_checkpoint),
        tmp_path / "run",
        "fp8-lm-o1",
        max_steps=2,
        save_strategy="steps",
        save_steps=1,
    )
    trainer.train()
    trained = {
        n: m.weight.detach().double() for n, m in trainer.model.named_modules() if n.rsplit(".", 1)[-1] in PROJECTIONS
    }
    trainer.save_model(str(tmp_path / "out"))
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, weight in trained.items():
        scale = saved[name + ".weight_scale_inv"]
        error = (dequantize_published(saved[name + ".weight"], scale, torch.float64) - weight).abs()
        unit = dequantize_published(
            torch.ones_like(saved[name + ".weight"]), scale, torch.float64
        )  # block scale per element
        assert (
            error <= torch.maximum(weight.abs() * 2**-4, unit * 2**-10) * (1 + 2**-20) + weight.abs() * 2**-23
        ).all()
    # A checkpoint to resume from keeps every bit: FP32, not FP8.
    with safe_open(str(tmp_path / "run" / "checkpoint-1" / "model.safetensors"), "pt") as f:
        names = f.keys()
        assert all(f.get_tensor(k).dtype != E4M3 for k in names)


@pytest.mark.parametrize("name", ["fp8-lm-o2", "bf16-mixed"])
def test_a_frozen_layer_is_saved_as_it_was_published(fp8_checkpoint, tmp_path, name):
    stored = _stored(fp8_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(fp8_checkpoint)
    model.model.layers[0].mlp.requires_grad_(False)  # a user's partial freeze, no PEFT
    trainer = _trainer(model, tmp_path / "run", name, max_steps=2)
    mlp = trainer.model.model.layers[0].mlp
    assert isinstance(mlp.down_proj, FrozenBlockFP8Linear) == (name == "fp8-lm-o2")
    trainer.train()
    trainer.save_model(str(tmp_path / "out"))
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    for proj in ("gate_proj", "up_proj", "down_proj"):
        for suffix in ("weight", "weight_scale_inv"):
            key = f"model.layers.0.mlp.{proj}.{suffix}"
            assert_bits_equal(saved[key].view(torch.uint8), stored[key].view(torch.uint8), key)
    key = "model.layers.0.self_attn.q_proj.weight"  # trained: written anew
    assert saved[key].dtype == E4M3 and not torch.equal(saved[key].view(torch.uint8), stored[key].view(torch.uint8))


@pytest.mark.parametrize("name", ["fp8-lm-o1", "fp8-lm-o2", "collage-plus"])
def test_a_checkpoint_scaled_per_tensor_trains_and_saves_in_its_format(tmp_path, name):
    """`weight_block_size: null` (one scale per weight, shape (1,)), which transformers loads: the
    Trainer raised "a (128, 128) weight in 128×128 blocks needs (1, 1)" (null read as 128×128).
    Each projection trains from payload · scale in FP32 (the values the checkpoint means: exact)
    and is saved back per tensor, scale shape (1,), block size null; plain transformers reloads it
    as the saved payload · scale rounded once to BF16. Saved in shards, the index's total_size is
    the bytes the shards hold (it kept the FP32 export's)."""
    import functools

    import transformers

    torch.manual_seed(0)
    bf16, fp8 = tmp_path / "bf16", tmp_path / "fp8"
    LlamaForCausalLM(tiny_llama_config(128)).to(torch.bfloat16).save_pretrained(bf16)
    fp8.mkdir()
    publish_fp8(bf16, fp8, per_tensor=True)
    stored = _stored(str(fp8))
    trainer = _trainer(AutoModelForCausalLM.from_pretrained(str(fp8)), tmp_path / "run", name, max_steps=2)
    if name == "fp8-lm-o1":  # FP32 masters hold the stored values exactly (the others round them once)
        key = "model.layers.0.mlp.down_proj"
        expected = stored[key + ".weight"].float() * stored[key + ".weight_scale_inv"]
        assert_bits_equal(trainer.model.get_submodule(key).weight, expected, "the trained layer's start")
    trainer.train()
    original = transformers.PreTrainedModel.save_pretrained
    for out, shard in ((tmp_path / "out", None), (tmp_path / "sharded", "150KB")):
        if shard:
            transformers.PreTrainedModel.save_pretrained = functools.partialmethod(original, max_shard_size=shard)
        try:
            trainer.save_model(str(out))
        finally:
            transformers.PreTrainedModel.save_pretrained = original
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["weight_block_size"] is None
    saved = _stored(str(tmp_path / "out"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    for name_ in (k for k in stored if k.endswith("proj.weight")):
        scale = saved[name_.removesuffix("weight") + "weight_scale_inv"]
        assert saved[name_].dtype == E4M3 and scale.shape == (1,) and scale.dtype == torch.float32
        as_loaded = (saved[name_].float() * scale).to(torch.bfloat16)
        assert_bits_equal(reloaded.get_submodule(name_.removesuffix(".weight")).weight, as_loaded, name_)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    held = 0
    for file in shards:
        with safe_open(str(tmp_path / "sharded" / file), "pt") as f:
            names = list(f.keys())
            held += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in names)
    assert index["metadata"]["total_size"] == held
