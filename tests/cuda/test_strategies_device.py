"""Every registered strategy on a device: the contract of tests/strategies/test_contract.py (dtypes,
bit-for-bit resume, loss goes down).

The CPU instance runs two strategies, enough to exercise this code in `make test` (the full CPU
contract is tests/strategies/test_contract.py); the CUDA instance runs all of them.
"""

import io

import pytest
import torch

import hf_lowprec
from hf_lowprec.testing import checked_strategy
from tests.helpers import batches, requires_cuda, tiny_gpt2, train_steps

STRATEGIES = hf_lowprec.available_strategies()
CPU_SAMPLE = ("bf16-mixed", "fp8-lm-o2")
CASES = [pytest.param("cpu", name, id=f"cpu-{name}") for name in CPU_SAMPLE] + [
    pytest.param("cuda", name, marks=requires_cuda, id=f"cuda-{name}") for name in STRATEGIES
]


def setup(name, device, seed=0):
    strategy = checked_strategy(name)  # FP8-LM: every layer FP8 (the rule would keep a tiny model's in BF16)
    model = strategy.prepare_model(tiny_gpt2(seed).to(device))
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3, weight_decay=0.01)
    return strategy, model, optimizer


def on(device, data):
    return [ids.to(device) for ids in data]


@pytest.mark.parametrize("device, name", CASES)
def test_param_dtypes_and_device(device, name):
    strategy, model, optimizer = setup(name, device)
    train_steps(strategy, model, optimizer, on(device, batches(1)))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {p.dtype for p in trainable} <= set(strategy.promised_param_dtypes())
    assert {p.device.type for p in trainable} == {device}
    states = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
    assert states and {t.device.type for t in states} == {device}


@pytest.mark.parametrize("device, name", CASES)
def test_resume_continues_bit_for_bit(device, name):
    data = on(device, batches(6))
    strategy, model, optimizer = setup(name, device)
    train_steps(strategy, model, optimizer, data[:3])
    buffer = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "strategy": strategy.state_dict()}, buffer
    )
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True, map_location=device)
    strategy2, model2, optimizer2 = setup(name, device, seed=123)
    model2.load_state_dict(saved["model"])
    optimizer2.load_state_dict(saved["optimizer"])
    strategy2.load_state_dict(saved["strategy"])
    assert train_steps(strategy, model, optimizer, data[3:]) == train_steps(strategy2, model2, optimizer2, data[3:])
    for (key, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), f"{name}: {key} differs after resume on {device}"


@pytest.mark.parametrize("device, name", CASES)
def test_loss_goes_down(device, name):
    strategy, model, optimizer = setup(name, device)
    for group in optimizer.param_groups:
        group["lr"] = 3e-3
    losses = train_steps(strategy, model, optimizer, on(device, batches(1)) * 30)
    # As in the CPU contract: memorising one batch from ln(256) ≈ 5.5 drops the loss by more than 1.
    assert losses[-1] < losses[0] - 1.0, f"{name} on {device}: {losses[0]:.3f} -> {losses[-1]:.3f}"
