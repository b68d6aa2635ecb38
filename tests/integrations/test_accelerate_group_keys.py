"""`plugin.prepare`'s optimizer swap keeps every parameter-group key: an LR scheduler built on the
torch AdamW before `prepare` (OneCycleLR and CyclicLR keep keys in the groups, LambdaLR does not)
drives the strategy's AdamW as it drives torch's, and a user's own group key stays."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from torch.optim.lr_scheduler import CyclicLR, LambdaLR, OneCycleLR

from hf_lowprec.integrations.accelerate import PrecisionPlugin

STEPS = 8
# torch.optim.AdamW's own switches (amsgrad, foreach, fused, ...): the strategy's AdamW reads none of them.
_TORCH_ONLY = set(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).defaults) - {
    "lr",
    "betas",
    "eps",
    "weight_decay",
}
_SCHEDULES = {
    # cycle_momentum: the schedule writes β1 into each group's betas as well as lr.
    "one-cycle": lambda opt: OneCycleLR(
        opt, max_lr=[2e-2, 1e-2], total_steps=STEPS, base_momentum=0.8, max_momentum=0.95, cycle_momentum=True
    ),
    "cyclic": lambda opt: CyclicLR(
        opt, base_lr=1e-3, max_lr=2e-2, step_size_up=3, base_momentum=0.8, max_momentum=0.9, cycle_momentum=True
    ),
    "lambda": lambda opt: LambdaLR(opt, [lambda s: 1.0 / (1 + s), lambda s: 0.7**s]),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _groups(params: list[torch.Tensor]) -> list[dict]:
    # "lr_scale": a key of the user's own (layer-wise decay), which no optimizer reads.
    return [
        {"params": [p for p in params if p.dim() == 2], "weight_decay": 0.1, "lr_scale": 0.5},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _grads(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    # FP32 gradients, exact in FP64: both runs step on the same values.
    generator = torch.Generator().manual_seed(1)
    return [[torch.randn(p.shape, generator=generator) for p in params] for _ in range(STEPS)]


def _run(optimizer, scheduler, params, grads) -> list[list[tuple]]:
    seen = []
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(p.dtype)
        optimizer.step()
        scheduler.step()
        seen.append([(g["lr"], tuple(g["betas"])) for g in optimizer.param_groups])
    return seen


def _kept(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params" and k not in _TORCH_ONLY}


@pytest.mark.parametrize("passed", [True, False], ids=["scheduler-prepared", "scheduler-not-prepared"])
@pytest.mark.parametrize("kind", sorted(_SCHEDULES))
def test_a_scheduler_built_before_prepare_drives_the_strategys_adamw_as_torchs(kind, passed):
    # Only lr/betas/eps/weight_decay/initial_lr/name were carried over: OneCycleLR's step raised
    # KeyError 'max_lr', CyclicLR's lost its momentum keys, and "lr_scale" was dropped.
    model = _model()
    reference = [p.detach().double().requires_grad_() for p in model.parameters()]
    grads = _grads(reference)
    stock = torch.optim.AdamW(_groups(reference), lr=1e-3)
    expected = _run(stock, _SCHEDULES[kind](stock), reference, grads)

    params = list(model.parameters())
    initial = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(_groups(params), lr=1e-3)
    scheduler = _SCHEDULES[kind](optimizer)
    plugin = PrecisionPlugin("fp32", fused="reference")
    if passed:
        model, prepared, scheduler = plugin.prepare(Accelerator(cpu=True), model, optimizer, scheduler)
    else:
        model, prepared = plugin.prepare(Accelerator(cpu=True), model, optimizer)
    seen = _run(prepared, scheduler, params, grads)

    assert seen == expected  # the schedule's own float arithmetic, on the same values: equal
    assert [_kept(g) for g in prepared.optimizer.param_groups] == [_kept(g) for g in stock.param_groups]
    assert prepared.optimizer.param_groups[0]["lr_scale"] == 0.5
    # The steps follow the schedule: FP32 against FP64, same gradients. Each of the 8 steps rounds θ
    # (|θ| < 1) once to FP32 (≤ 2^-24) and computes Δθ (|Δθ| ≤ 3·lr ≤ 0.06) through about 16 FP32
    # roundings: 8·2^-24·(1 + 16·0.06) ≈ 9e-7, so 2e-6. A schedule not followed (lr or β1 of
    # another step) moves θ by about lr·0.1 ≥ 1e-4 in 8 steps.
    error = max((p.double() - r).abs().max().item() for p, r in zip(params, reference))
    moved = max((p - p0).abs().max().item() for p, p0 in zip(params, initial))
    assert error <= 2e-6, error
    assert moved > 1e-3


def test_a_torch_adamw_with_differentiable_is_refused_before_any_work():
    # differentiable=True was dropped without a word: the strategy's step is not differentiable.
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, differentiable=True)
    with pytest.raises(ValueError, match=r"differentiable=True.*no counterpart.*drop the argument"):
        PrecisionPlugin("bf16-pure").prepare(Accelerator(cpu=True), model, optimizer)
    assert all(torch.equal(p.view(torch.int32), b.view(torch.int32)) for p, b in zip(model.parameters(), before))
