"""Optimizer checkpoints written before the AdamW-core restructuring load and continue bit for bit.

tests/data/optimizer_states_6be633d.pt was written by the optimizers of commit 6be633d with
`python scripts/optimizer_states_6be633d.py OUT.pt` (its docstring says what the file holds):
for each family, the parameters and `state_dict()` after two steps, the third step's gradients,
and the parameters after that third step.

COAT's range expansion changed its power after that commit (PyTorch's `pow`, which rounds
differently in its vector and scalar loops, became `numerics.pow_nonnegative`, one fixed
sequence on every path): its checkpoints load exactly and continue within a few FP32 ulps of
the old trajectory, bounded below; every other family continues bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_lowprec import optim
from tests.helpers import assert_bits_equal

DATA = Path(__file__).resolve().parents[1] / "data" / "optimizer_states_6be633d.pt"

FACTORIES = {
    "collage_plus_bf16": lambda ps: optim.CollageAdamW(ps, lr=1e-3, weight_decay=0.1, variant="plus"),
    "collage_light_fp16": lambda ps: optim.CollageAdamW(ps, lr=1e-3, weight_decay=0.1, variant="light"),
    "kahan_bf16": lambda ps: optim.KahanAdamW(ps, lr=1e-3, weight_decay=0.0),
    "sr_bf16": lambda ps: optim.StochasticRoundingAdamW(ps, lr=1e-3, seed=5, weight_decay=0.0),
    "fp32states_bf16": lambda ps: optim.FP32StatesAdamW(ps, lr=1e-3, weight_decay=0.0),
    "plain_fp32": lambda ps: optim.PlainAdamW(ps, lr=1e-3, weight_decay=0.1),
    "coat_fp32": lambda ps: optim.COATAdamW(ps, lr=1e-3, weight_decay=0.0),
    "coat_bf16": lambda ps: optim.COATAdamW(ps, lr=1e-3, weight_decay=0.0),
    "fp8adamw_fp32": lambda ps: optim.FP8AdamW(ps, lr=1e-3, weight_decay=0.1),
}


@pytest.fixture(scope="module")
def saved() -> dict:
    return torch.load(DATA, weights_only=True)


@pytest.mark.compiles_step
@pytest.mark.parametrize("fused", ["reference", "compiled"])
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_old_checkpoint_loads_and_continues_bit_for_bit(saved: dict, name: str, fused: str) -> None:
    case = saved[name]
    params = [torch.nn.Parameter(p.clone()) for p in case["params"]]
    optimizer = FACTORIES[name](params)
    optimizer.fused = fused
    optimizer.load_state_dict(case["state"])
    for old_state, param in zip(case["state"]["state"].values(), params):
        for key, value in old_state.items():
            if torch.is_tensor(value):
                assert optimizer.state[param][key].dtype == value.dtype, (key, value.dtype)
    for param, grad in zip(params, case["grads"]):
        param.grad = grad.clone()
    optimizer.step()
    assert optimizer.paths_taken[fused] == len(params)
    for i, (param, before, expected) in enumerate(zip(params, case["params"], case["after"])):
        after = param.detach()
        if not name.startswith("coat"):
            assert_bits_equal(after, expected, f"{name}, parameter {i}")
            continue
        assert after.dtype == expected.dtype
        # Decoded moments move by a few FP32 ulps (|x|^(1/k) from log2/exp2, each within ~4
        # ulps = 2^-21 relative), so Δθ ∝ m/√v by under 2^-18 relative: 2^-16·|Δθ| bounds it,
        # plus one ulp of θ's dtype where the rounded sum lands on the other side of a tie.
        step = (expected.double() - before.double()).abs()
        ulp = torch.finfo(expected.dtype).eps * expected.double().abs()
        gap = (after.double() - expected.double()).abs()
        assert not gap.isnan().any() and bool((gap <= step * 2.0**-16 + ulp).all()), (name, float(gap.max()))
