"""The `coat` strategy: each piece on its own, the BF16 + δθ master option (docs/algorithms.md §4).

The default options are covered by tests/strategies/test_contract.py like every registered
strategy; this file checks the option combinations the contract does not see.
"""

import io

import pytest
import torch

import hf_lowprec
from hf_lowprec.fp8 import FP8Linear
from hf_lowprec.memory import model_state_bytes
from hf_lowprec.optim import COATAdamW, CollageAdamW, PlainAdamW
from tests.helpers import batches, tiny_gpt2, train_steps


def setup(seed=0, **options):
    strategy = hf_lowprec.get_strategy("coat", **options)
    model = strategy.prepare_model(tiny_gpt2(seed))
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3, weight_decay=0.01)
    return strategy, model, optimizer


@pytest.mark.parametrize(
    "options, match",
    [
        ({"master_weights": "fp16"}, "master_weights"),
        ({"exp_avg_sq_format": "fp16"}, "exp_avg_sq_format"),
        ({"group_size": 0}, "group_size"),
        ({"expand": 1}, "expand"),
        ({"states": False, "activations": False}, "enable a piece"),
    ],
)
def test_bad_options_raise_before_any_work(options, match):
    with pytest.raises(ValueError, match=match):
        hf_lowprec.get_strategy("coat", **options)


@pytest.mark.parametrize(
    "options, fp8_layers, optimizer_class, dtype, documented",
    [
        ({}, True, COATAdamW, torch.float32, 10.1875),
        ({"activations": False}, False, COATAdamW, torch.float32, 10.1875),
        ({"states": False}, True, PlainAdamW, torch.float32, 16.0),
        ({"master_weights": "bf16-collage"}, True, COATAdamW, torch.bfloat16, 8.1875),
        ({"master_weights": "bf16-collage", "states": False}, True, CollageAdamW, torch.bfloat16, 10.0),
    ],
)
def test_options_select_the_pieces_and_bytes_per_param(options, fp8_layers, optimizer_class, dtype, documented):
    strategy, model, optimizer = setup(**options)
    assert any(isinstance(m, FP8Linear) for m in model.modules()) == fp8_layers
    assert type(optimizer.optimizer) is optimizer_class
    assert strategy.param_dtype == dtype and strategy.bytes_per_param == documented
    train_steps(strategy, model, optimizer, batches(1))
    assert {p.dtype for p in model.parameters()} == {dtype}
    # Padding of the 64-element biases and LayerNorm gains to 128 adds < 0.1 bytes/param here.
    assert model_state_bytes(model, optimizer)["total"] == pytest.approx(documented, abs=0.1)


def test_bf16_master_resumes_bit_for_bit_and_trains():
    data = batches(5)
    strategy, model, optimizer = setup(master_weights="bf16-collage", exp_avg_sq_format="e5m2")
    train_steps(strategy, model, optimizer, data[:2])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    strategy2, model2, optimizer2 = setup(seed=1, master_weights="bf16-collage", exp_avg_sq_format="e5m2")
    model2.load_state_dict(saved["model"])
    optimizer2.load_state_dict(saved["optimizer"])
    for state in optimizer2.state.values():
        assert state["exp_avg_sq"].dtype == torch.float8_e5m2 and state["param_error"].dtype == torch.bfloat16
    assert train_steps(strategy, model, optimizer, data[2:]) == train_steps(strategy2, model2, optimizer2, data[2:])
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
