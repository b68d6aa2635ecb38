"""FP8-published Mixture-of-Experts releases in and out (issue #56, item 5; docs/checkpoints.md).

A release stores each expert's projections apart, as Qwen3-30B-A3B-FP8 and DeepSeek-V3 do
(`experts.N.gate_proj.weight` in E4M3 with an FP32 `weight_scale_inv` per 128×128 block), and
transformers fuses them at load into 3-D weights. The release here is written by the tests'
writer (`tests/fp8_reference.py`), independent of the package's `quantize_published`, from a
tiny Qwen3-MoE saved in BF16; it is loaded as users load it: dequantized on this CPU, or into
transformers' FP8 experts with CUDA faked for the load, as on a GPU.
"""

import json
import pathlib

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_lowprec import Trainer, TrainingArguments
from hf_lowprec.testing.moe import tiny_moe
from tests.fp8_reference import publish_fp8
from tests.helpers import TokenBlocks, load_as_on_a_gpu, trainer_arguments

E4M3 = torch.float8_e4m3fn
EXPERTS = 4


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    bf16, fp8 = tmp_path_factory.mktemp("moe_bf16"), tmp_path_factory.mktemp("moe_fp8")
    # Every projection on whole 128-blocks (k and v too: 4 key/value heads of 32), as a release quantizes them all.
    model = tiny_moe("qwen3_moe", hidden=128, intermediate=128, experts=EXPERTS, num_key_value_heads=4)
    model.to(torch.bfloat16).save_pretrained(bf16)
    publish_fp8(bf16, fp8)
    return fp8


def _stored_fused(path: pathlib.Path, layer: int) -> dict[str, torch.Tensor]:
    """The fused weights the stored values mean, in FP64: [gate; up] per expert, and down."""
    stored = load_file(f"{path}/model.safetensors")

    def real(name: str) -> torch.Tensor:
        payload, scale = stored[name + ".weight"].double(), stored[name + ".weight_scale_inv"].double()
        return payload * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)

    prefix = f"model.layers.{layer}.mlp.experts"
    return {
        "gate_up_proj": torch.stack(
            [torch.cat([real(f"{prefix}.{e}.gate_proj"), real(f"{prefix}.{e}.up_proj")]) for e in range(EXPERTS)]
        ),
        "down_proj": torch.stack([real(f"{prefix}.{e}.down_proj") for e in range(EXPERTS)]),
    }


def _trainer(model, out, name: str, **overrides) -> Trainer:
    args = TrainingArguments(**trainer_arguments(out, precision_strategy=name, **{"save_strategy": "no", **overrides}))
    return Trainer(model=model, args=args, train_dataset=TokenBlocks())


@pytest.mark.parametrize("load", ["dequantized (CPU)", "FP8 experts (GPU)"])
def test_fused_experts_start_from_the_stored_values_and_train(release, load, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(release) if load.startswith("deq") else load_as_on_a_gpu(release)
    trainer = _trainer(model, tmp_path, "fp32", max_steps=0)
    trainer.create_optimizer()  # the strategy prepared the model: the stored values are restored
    for layer in range(2):
        experts = model.model.layers[layer].mlp.experts
        for name, value in _stored_fused(release, layer).items():
            weight = getattr(experts, name)
            assert weight.dtype == torch.float32 and weight.requires_grad
            # payload × scale rounded once to FP32: the FP64 product (exact) rounded to FP32.
            assert torch.equal(weight.detach(), value.float()), f"layer {layer} {name}"
    record = model.__dict__["hf_lowprec_fp8_published"]
    assert record["changed"] == []
    # The released experts compute in high precision under a strategy that does not convert them
    # (transformers' FP8 experts would dispatch to its FP8 kernels), as after a dequantized load.
    reference = AutoModelForCausalLM.from_pretrained(release).float()
    ids = TokenBlocks()[0]["input_ids"][None]
    with torch.no_grad():
        logits, expected = model(input_ids=ids).logits, reference(input_ids=ids).logits
    assert torch.isfinite(logits).all()
    assert torch.allclose(logits, expected, rtol=0, atol=1e-2 * expected.abs().max())
    assert record["layers"]["model.layers.1.mlp.experts.3.up_proj"] == "trained from FP32 values"

    model = AutoModelForCausalLM.from_pretrained(release) if load.startswith("deq") else load_as_on_a_gpu(release)
    trainer = _trainer(model, tmp_path / "o2", "fp8-lm-o2", max_steps=3)
    losses = [row["loss"] for row in trainer.train() and trainer.state.log_history if "loss" in row]
    assert len(losses) == 3 and all(0 < loss < 10 for loss in losses)
    assert trainer.state.log_history[-2].get("precision/skipped_steps", 0) == 0


def test_the_save_writes_every_expert_back_in_the_release_layout(release, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(release)
    trainer = _trainer(model, tmp_path, "fp8-lm-o2", max_steps=2)
    trainer.train()
    trained = {n: p.detach().float().clone() for n, p in model.model.layers[0].mlp.experts.state_dict().items()}
    trainer.save_model(str(tmp_path / "final"))
    saved = load_file(f"{tmp_path}/final/model.safetensors")
    for e in range(EXPERTS):
        for part in ("gate_proj", "up_proj", "down_proj"):
            key = f"model.layers.0.mlp.experts.{e}.{part}"
            assert saved[key + ".weight"].dtype == E4M3 and saved[key + ".weight_scale_inv"].dtype == torch.float32
    assert not any("gate_up_proj" in k for k in saved)
    config = json.loads((tmp_path / "final" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")  # plain transformers
    again = reloaded.model.layers[0].mlp.experts.gate_up_proj.detach().double()
    # What was trained, quantized once per 128-block to E4M3 (scale = block amax / 448): a normal
    # value errs by at most half an ulp, 2^-4 relative; a subnormal one by half the subnormal step,
    # 2^-10 · scale ≤ 2^-10 · amax / 448; then dequantized to BF16 (2^-8 relative, on a value within
    # 2^-4 of w). The whole tensor's amax bounds every block's.
    expected = trained["gate_up_proj"].double()
    amax = expected.abs().amax()
    bound = (2**-4 + 2**-8 * (1 + 2**-4)) * expected.abs() + amax / 448 * 2**-10 * (1 + 2**-8)
    assert ((again - expected).abs() <= bound).all()
