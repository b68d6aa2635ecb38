"""fp16-mixed's loss scaler (`scaling.loss_scale.AgreeingGradScaler`) unscales in fewer launches
than `torch.amp.GradScaler` and must give its bits: the unscaled gradients, the found-inf flags,
the skipped steps and the scale's path, step after step, an overflow and a NaN included."""

import pytest
import torch

from hf_lowprec.scaling.loss_scale import AgreeingGradScaler
from tests.helpers import assert_bits_equal


def _setup(cls):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in [(33, 7), (7,), (5, 5, 3)]]
    params.append(torch.nn.Parameter(torch.randn(4, dtype=torch.float64)))  # a second dtype
    optimizer = torch.optim.SGD(params, lr=0.1)
    return params, optimizer, cls("cpu", init_scale=2.0**15, growth_interval=2)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_unscaling_gives_torch_grad_scalers_bits_flags_and_scales(bad):
    ours, theirs = _setup(AgreeingGradScaler), _setup(torch.amp.GradScaler)
    for step in range(6):
        torch.manual_seed(100 + step)
        grads = [torch.randn_like(p) * 2.0**15 * 10.0 ** torch.randint(-9, 2, p.shape) for p in ours[0]]
        if step == 2:
            grads[1][3] = bad
        for params, optimizer, scaler in (ours, theirs):
            scaler.scale(torch.ones(()))  # makes the scale
            for p, g in zip(params, grads):
                p.grad = g.clone()
            scaler.unscale_(optimizer)
        for a, b in zip(ours[0], theirs[0]):
            assert_bits_equal(a.grad, b.grad, f"step {step}: unscaled gradient")
        flags = [s._per_optimizer_states[id(o)]["found_inf_per_device"] for _, o, s in (ours, theirs)]
        assert flags[0].keys() == flags[1].keys()
        assert all(torch.equal(flags[0][d], flags[1][d]) for d in flags[0])
        assert flags[0][torch.device("cpu")].item() == float(step == 2)
        for _, optimizer, scaler in (ours, theirs):
            scaler.step(optimizer)
            scaler.update()
        assert ours[2].get_scale() == theirs[2].get_scale(), step
        for a, b in zip(ours[0], theirs[0]):
            assert_bits_equal(a.detach(), b.detach(), f"step {step}: weight")
    # The scale halved at the overflow and doubled after two clean steps, twice.
    assert ours[2].get_scale() == 2.0**15 / 2 * 2 * 2


def test_a_second_unscale_in_one_step_is_refused_as_torch_refuses_it():
    params, optimizer, scaler = _setup(AgreeingGradScaler)
    scaler.scale(torch.ones(()))
    for p in params:
        p.grad = torch.ones_like(p)
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(optimizer)
    half = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    half.grad = torch.ones_like(half)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(torch.optim.SGD([half], lr=0.1))
