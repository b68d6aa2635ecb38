"""An FP32 parameter among the 16-bit ones of a 16-bit family (one a model keeps in FP32:
`_keep_in_fp32_modules`, `strategies.casting.kept_parameters`) steps as plain FP32 AdamW: FP32 m and v,
no compensation, master or stochastic rounding, on every path; its 16-bit neighbours step as they do
alone; a resume continues bit for bit with every state in its own dtype."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from hf_lowprec import optim
from hf_lowprec.memory import model_state_bytes
from tests.helpers import UNIT_ROUNDOFF, assert_bits_equal, gamma

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
LR, BETAS, EPS, DECAY = 1e-2, (0.9, 0.999), 1e-8, 0.1
STEPS = 3

# (16-bit dtype, factory): the optimizers of bf16-pure, bf16-kahan, bf16-sr, bf16-fp32states,
# collage-light, collage-plus, collage-8bit and fp16-als (weights "master" and "sr").
FAMILIES = {
    "plain": (BF16, lambda ps, f: optim.PlainAdamW(ps, lr=LR, weight_decay=DECAY, fused=f)),
    "kahan": (BF16, lambda ps, f: optim.KahanAdamW(ps, lr=LR, weight_decay=DECAY, fused=f)),
    "sr": (BF16, lambda ps, f: optim.StochasticRoundingAdamW(ps, lr=LR, weight_decay=DECAY, seed=3, fused=f)),
    "fp32-states": (BF16, lambda ps, f: optim.FP32StatesAdamW(ps, lr=LR, weight_decay=DECAY, fused=f)),
    "collage-light": (BF16, lambda ps, f: optim.CollageAdamW(ps, lr=LR, weight_decay=DECAY, variant="light", fused=f)),
    "collage-plus": (BF16, lambda ps, f: optim.CollageAdamW(ps, lr=LR, weight_decay=DECAY, variant="plus", fused=f)),
    "collage-8bit": (BF16, lambda ps, f: optim.Collage8bitAdamW(ps, lr=LR, weight_decay=DECAY, fused=f)),
    "master-fp16": (F16, lambda ps, f: optim.MasterWeightAdamW(ps, lr=LR, weight_decay=DECAY, fused=f)),
    "sr-fp32-states-fp16": (F16, lambda ps, f: optim.FP32StatesSRAdamW(ps, lr=LR, weight_decay=DECAY, seed=3, fused=f)),
}


def _params(dtype: torch.dtype) -> list[torch.Tensor]:
    """A 16-bit matrix, an FP32 one (a router kept in FP32) and a 16-bit vector, in one group."""
    generator = torch.Generator().manual_seed(0)
    shapes = ((40, 24), (8, 24), (300,))
    values = [torch.randn(s, generator=generator) for s in shapes]
    return [v.to(F32 if i == 1 else dtype).requires_grad_() for i, v in enumerate(values)]


def _grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(p.shape, generator=generator) * 1e-2).to(p.dtype) for p in params]


def _run(make, params, fused, steps, start=0, optimizer=None):
    optimizer = optimizer if optimizer is not None else make(params, fused)
    for step in range(start, start + steps):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        optimizer.step()
    return optimizer


def _fp64_adamw(theta: torch.Tensor, grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """AdamW in FP64 (`torch.optim.AdamW`'s formula) and the bound on FP32's distance from it.

    Bound: step t of `adamw.adamw_math` rounds m (3 operations), v (4; its error halves under the
    root), the root, + ε', the product s·m, the quotient, the decay product and the sum Δθ, and its
    scalars s, ε', 1 − β1, 1 − β2, −α·λ once each: at most 16 relative roundings of the two terms of
    Δθ, counted with the t − 1 steps that made m and v (γ_{16t}); then θ + Δθ rounds once (u·|θ_t|).
    An error in θ carries to the next step times |1 − α·λ| ≤ 1, so the steps' bounds add up."""
    theta, bound = theta.double(), 0.0
    m, v = torch.zeros_like(theta), torch.zeros_like(theta)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = BETAS[0] * m + (1 - BETAS[0]) * g
        v = BETAS[1] * v + (1 - BETAS[1]) * g * g
        c1, c2 = 1 - BETAS[0] ** t, 1 - BETAS[1] ** t
        adam = LR * (m / c1) / ((v / c2).sqrt() + EPS)
        decay = LR * DECAY * theta
        theta = theta - decay - adam
        bound = bound + gamma(16 * t) * (decay.abs() + adam.abs()) + UNIT_ROUNDOFF[F32] * theta.abs()
    return theta, bound


# The native kernels run every family but FP16 stochastic rounding over FP32 moments ("auto" compiles
# that one); the compiled step, for two families (a graph per composition is slow to build on CPU).
PATHS = [(family, fused) for family in sorted(FAMILIES) for fused in ("reference", "native", "auto")]
PATHS = [(f, m) for f, m in PATHS if (f, m) != ("sr-fp32-states-fp16", "native")]
PATHS += [("collage-plus", "compiled"), ("master-fp16", "compiled")]


@pytest.mark.parametrize(("family", "fused"), PATHS)
def test_an_fp32_parameter_steps_as_fp32_adamw_beside_16_bit_ones(family, fused):
    dtype, make = FAMILIES[family]
    params = _params(dtype)
    start = params[1].detach().clone()
    optimizer = _run(make, params, fused, STEPS)
    if fused != "auto":
        assert set(optimizer.paths_taken) == {fused}, optimizer.paths_taken
    kept = params[1]
    assert kept.dtype == F32
    state = optimizer.state[kept]
    assert sorted(k for k, v in state.items() if torch.is_tensor(v) and k != "step") == ["exp_avg", "exp_avg_sq"]
    assert all(state[k].dtype == F32 for k in ("exp_avg", "exp_avg_sq")), family
    reference, bound = _fp64_adamw(start, [_grads(params, s)[1] for s in range(STEPS)])
    error = (kept.detach().double() - reference).abs()
    assert (error <= bound).all(), (family, fused, (error - bound).max().item())  # NaN fails too
    # The 16-bit parameters step as they do in a group of their own.
    alone = [p for i, p in enumerate(_params(dtype)) if i != 1]
    alone_optimizer = make(alone, fused)
    for step in range(STEPS):
        grads = _grads(_params(dtype), step)
        for p, g in zip(alone, (grads[0], grads[2])):
            p.grad = g
        alone_optimizer.step()
    if family not in ("sr", "sr-fp32-states-fp16"):  # one seed a parameter: the draws follow the order
        for mixed, single in zip((params[0], params[2]), alone):
            assert_bits_equal(mixed.detach(), single.detach(), family)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_resume_continues_a_mixed_group_bit_for_bit(family):
    dtype, make = FAMILIES[family]
    whole = _params(dtype)
    _run(make, whole, "auto", 4)
    first = _params(dtype)
    saved = copy.deepcopy(_run(make, first, "auto", 2).state_dict())
    resumed = [p.detach().clone().requires_grad_() for p in first]
    optimizer = make(resumed, "auto")
    optimizer.load_state_dict(saved)
    for index, param in enumerate(resumed):
        for key, value in optimizer.state[param].items():
            if torch.is_tensor(value) and key != "step":
                assert value.dtype == saved["state"][index][key].dtype, (family, index, key)
    _run(make, resumed, "auto", 2, start=2, optimizer=optimizer)
    for a, b in zip(whole, resumed):
        assert_bits_equal(a.detach(), b.detach(), family)


def test_the_memory_count_takes_the_fp32_parameter_at_16_bytes():
    """collage-plus: a BF16 parameter holds 2 bytes of θ, 2 of gradient and 2 + 2 of moments (δθ, δv are
    extras), the FP32 one 4, 4 and 4 + 4 (plain AdamW): counted from the tensors the optimizer holds."""
    params = _params(BF16)
    model = torch.nn.ParameterList(params)
    optimizer = _run(FAMILIES["collage-plus"][1], params, "auto", 1)
    counted = model_state_bytes(model, optimizer)
    n16 = sum(p.numel() for p in params if p.dtype == BF16)
    n32 = params[1].numel()
    n = n16 + n32
    assert math.isclose(counted["params"], (2 * n16 + 4 * n32) / n)
    assert math.isclose(counted["grads"], (2 * n16 + 4 * n32) / n)
    assert math.isclose(counted["optimizer_states"], (2 * 2 * n16 + 2 * 4 * n32) / n)
