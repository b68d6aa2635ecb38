"""A 16-bit model as loaded, with part of it frozen, under the strategies that promise FP32 parameters.

Layer-wise freezing and gradual unfreezing of a BF16 checkpoint: the frozen block or LayerNorms
must be made FP32 like the trainable parameters, or they meet FP32 activations and neighbours in
the first forward (a dtype error); under autocast a frozen GEMM layer keeps its 16 bits, which
autocast gives it anyway. The model is its FP32 load, value for value (every BF16 value is an
FP32 value), and the run is the same computation: bit-identical losses and weights.
A PEFT base and a model with no trainable parameter keep their parameters as loaded.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.pytorch_utils import Conv1D

import hf_lowprec
from hf_lowprec.fp8.linear import FP8Linear
from tests.helpers import assert_bits_equal, assert_same_losses, batches, tiny_gpt2

GEMM_LAYERS = (torch.nn.Linear, Conv1D, FP8Linear)
FREEZES = {"a block": "transformer.h.0.", "the LayerNorms": ".ln_"}
# fp8-lm-o2 keeps an FP16 load's trainable parameters for their scaled masters, then makes the rest FP32.
LOADS = [("fp32", "bfloat16"), ("bf16-mixed", "bfloat16"), ("fp8-lm-o2", "bfloat16"), ("fp8-lm-o2", "float16")]
LOADS += [("coat", "bfloat16")]


def _frozen(model: torch.nn.Module, part: str) -> list[str]:
    names = [n for n, p in model.named_parameters() if part in n]
    for name, p in model.named_parameters():
        p.requires_grad_(name not in names)
    return names


def _run(name: str, model: torch.nn.Module, frozen: list[str]) -> tuple[list[float], torch.nn.Module]:
    """Two steps with `frozen` frozen, then (fp32, where every frozen parameter is made FP32) one with
    them unfrozen (gradual unfreezing)."""
    strategy = hf_lowprec.get_strategy(name)
    model = strategy.prepare_model(model)
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3, weight_decay=0.0)
    losses = []
    for step, ids in enumerate(batches(3 if name == "fp32" else 2)):
        if step == 2:
            for n, p in model.named_parameters():
                if n in frozen:
                    p.requires_grad_(True)
        losses.append(strategy.train_step(model, ids, optimizer).item())
    return losses, model


@pytest.mark.parametrize("part", FREEZES)
@pytest.mark.parametrize(("name", "stored"), LOADS)
def test_a_partly_frozen_16_bit_load_trains_as_its_fp32_load(name, stored, part):
    loaded = tiny_gpt2().to(getattr(torch, stored))  # as from_pretrained of a 16-bit checkpoint
    frozen = _frozen(loaded, FREEZES[part])
    as_fp32 = copy.deepcopy(loaded).float()  # from_pretrained(..., dtype=torch.float32) of it
    values = {n: p.detach().float() for n, p in loaded.named_parameters() if n in frozen}
    prepared = hf_lowprec.get_strategy(name).prepare_model(copy.deepcopy(loaded))
    gemm = {
        f"{n}.{k}" for n, m in prepared.named_modules() if isinstance(m, GEMM_LAYERS) for k, _ in m.named_parameters()
    }
    for n, p in prepared.named_parameters():
        if n in frozen:  # FP32 made from the loaded values, exactly, and still frozen
            assert not p.requires_grad
            # Under autocast a frozen GEMM layer keeps its loaded 16 bits (autocast casts it so anyway).
            loaded_dtype = getattr(torch, stored) if n in gemm and name != "fp32" else torch.float32
            assert p.dtype == loaded_dtype, (n, p.dtype)
            assert_bits_equal(p.detach().float(), values[n], n)
    got, model = _run(name, loaded, frozen)
    expected, reference = _run(name, as_fp32, frozen)
    # The same model in the same dtypes under the same strategy: the same computation, bit for bit.
    assert_same_losses(got, expected, name)
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_bits_equal(p.detach().float(), q.detach().float(), n)


def test_a_model_with_nothing_to_train_stays_as_loaded():
    # A frozen reference model: no trainable parameter, nothing made FP32.
    model = tiny_gpt2().to(torch.bfloat16).requires_grad_(False)
    model = hf_lowprec.get_strategy("fp32").prepare_model(model)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("name", ["fp32", "bf16-mixed", "fp8-lm-o2"])
def test_a_lora_base_stays_as_loaded(name):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], task_type="CAUSAL_LM")
    model = peft.get_peft_model(tiny_gpt2().to(torch.bfloat16), config)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # the adapters FP32: the base alone is 16-bit
    model = hf_lowprec.get_strategy(name).prepare_model(model)
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
