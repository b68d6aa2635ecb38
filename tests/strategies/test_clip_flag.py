"""The step's skip flag read from the clipping's norm (`hf_lowprec.strategies.seen_norm`).

A step the loop clipped decides to skip from the pre-clip norm, which is finite exactly when every
gradient it covers is finite and their norm within FP32's range: no second pass over the gradients.
Where the norm does not cover the gradients as they are now (one changed or replaced after it was
measured, one left out of the clipping), the step checks the gradients itself.
"""

import math

import pytest
import torch
from transformers import GPT2LMHeadModel

import hf_lowprec
import hf_lowprec.strategies.interface as interface
from hf_lowprec.data import tiny_gpt2_config
from hf_lowprec.strategies.seen_norm import reveals_nonfinite
from hf_lowprec.testing import DeviceTraffic
from tests.helpers import assert_bits_equal, batches

# The strategies whose flag is the base class's, and FP8-LM's, whose non-FP8 gradients take it
# (COAT's and fp16-als's are their own).
STRATEGIES = ["fp32", "bf16-mixed", "bf16-pure", "collage-plus", "fp16-mixed", "fp8-lm-o2", "fp8-lm-o3"]
# FP8-LM's FP8 gradients as the optimizer stores them: a skipped step zeroes them (no NaN kept).
FP8_GRADIENT_STORE = ("grad", "grad_scale")


@pytest.fixture
def checks(monkeypatch) -> list[int]:
    """How many times the step checked the gradients itself (`numerics.nonfinite_flag`)."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    original = interface.nonfinite_flag
    monkeypatch.setattr(interface, "nonfinite_flag", counted)
    return calls


def setup(name: str):
    strategy = hf_lowprec.get_strategy(name)
    torch.manual_seed(0)
    model = strategy.prepare_model(GPT2LMHeadModel(tiny_gpt2_config(n_embd=64, n_layer=2, pad_token_id=None)))
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3, weight_decay=0.01)
    return strategy, model, optimizer


def backward(strategy, model, ids) -> None:
    with strategy.forward_context():
        loss = model(input_ids=ids, labels=ids).loss
    strategy.scale_loss(loss).backward()


def clip(strategy, optimizer, params, max_norm: float = 1.0) -> torch.Tensor:
    strategy.unscale_gradients(optimizer.optimizer)
    return strategy.clip_grad_norm(params, max_norm)


def held(model, optimizer) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Copies of the parameters and optimizer states (not FP8-LM's gradient store), and the
    tensors themselves, by id."""
    tensors = {id(p): p for p in model.parameters()}
    state = [(k, v) for s in optimizer.state.values() for k, v in s.items() if torch.is_tensor(v)]
    tensors.update({id(v): v for k, v in state if k not in FP8_GRADIENT_STORE})
    return {key: t.detach().clone() for key, t in tensors.items()}, tensors


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_clipped_step_takes_its_flag_from_the_norm(name, checks):
    strategy, model, optimizer = setup(name)
    ids = batches(1)[0]
    params = list(model.parameters())
    backward(strategy, model, ids)
    clip(strategy, optimizer, params)
    with DeviceTraffic() as traffic:
        found_inf = strategy.process_gradients(optimizer.optimizer)
    assert not traffic.syncs and found_inf.dtype == torch.float32 and found_inf.dim() == 0
    assert found_inf.item() == 0.0 and not checks, name
    strategy.optimizer_step(optimizer.optimizer, found_inf)
    optimizer.zero_grad(set_to_none=True)

    # One infinite element in one gradient before the clipping: the norm is inf, the step skipped.
    backward(strategy, model, ids)
    params[3].grad.view(-1)[5] = float("inf")
    before, tensors = held(model, optimizer)
    clip(strategy, optimizer, params)
    found_inf = strategy.process_gradients(optimizer.optimizer)
    assert found_inf.item() == 1.0 and not checks, name
    strategy.optimizer_step(optimizer.optimizer, found_inf)
    for key, tensor in tensors.items():
        assert_bits_equal(tensor.detach(), before[key], f"{name}: a tensor changed on a skipped step")
    for state in optimizer.optimizer.state.values():
        if "grad" in state:
            assert not state["grad"].float().any() and (state["grad_scale"] == 1).all(), name


def poison(grad: torch.Tensor) -> None:
    grad.view(-1)[0] = float("nan")


@pytest.mark.parametrize(
    "after_clip",
    [
        # A NaN written into a gradient after its norm was measured (its version moved).
        lambda params: poison(params[0].grad),
        # A gradient replaced by another tensor after the clipping (the same values, then a NaN).
        lambda params: (setattr(params[0], "grad", params[0].grad.clone()), poison(params[0].grad)),
    ],
    ids=["changed", "replaced"],
)
def test_a_gradient_changed_after_the_clipping_is_checked_again(after_clip, checks):
    strategy, model, optimizer = setup("bf16-mixed")
    params = list(model.parameters())
    backward(strategy, model, batches(1)[0])
    norm = clip(strategy, optimizer, params)
    assert torch.isfinite(norm)
    after_clip(params)
    assert strategy.process_gradients(optimizer.optimizer).item() == 1.0 and len(checks) == 1


def test_a_gradient_the_clipping_left_out_is_checked(checks):
    strategy, model, optimizer = setup("bf16-mixed")
    params = list(model.parameters())
    backward(strategy, model, batches(1)[0])
    poison(params[0].grad)
    assert torch.isfinite(clip(strategy, optimizer, params[1:]))  # the NaN is outside the norm
    assert strategy.process_gradients(optimizer.optimizer).item() == 1.0 and len(checks) == 1


def test_a_norm_from_an_earlier_step_is_not_reused(checks):
    """Clipped at one step, not at the next, whose backward accumulates into the same gradient
    tensors (zeroed in place): the note of the first clipping does not decide the second step."""
    strategy, model, optimizer = setup("bf16-mixed")
    params = list(model.parameters())
    ids = batches(1)[0]
    backward(strategy, model, ids)
    clip(strategy, optimizer, params)
    optimizer.zero_grad(set_to_none=False)
    with strategy.forward_context():
        loss = model(input_ids=ids, labels=ids).loss * float("nan")
    strategy.scale_loss(loss).backward()
    assert strategy.process_gradients(optimizer.optimizer).item() == 1.0 and len(checks) == 1


@pytest.mark.parametrize("max_norm", [1.0, math.inf, None], ids=["clipped", "measured", "neither"])
def test_a_norm_past_fp32s_range_skips_a_step_whose_norm_was_taken(max_norm, checks):
    """Finite gradients of 2e38 (FP32's largest finite value is about 3.4e38): their 2-norm over
    n ≥ 3 elements is 2e38·√n > 3.4e38, inf in FP32 however it is accumulated. Clipping would
    scale them by max_norm / inf = 0, and measuring (max_norm = inf, the Trainer's call without
    clipping) by inf / inf = NaN: the step is skipped. With no norm taken, it is taken."""
    strategy, model, optimizer = setup("bf16-mixed")
    params = list(model.parameters())
    backward(strategy, model, batches(1)[0])
    for p in params:
        p.grad.fill_(2e38)
    if max_norm is not None:
        assert clip(strategy, optimizer, params, max_norm).isinf()
    assert strategy.process_gradients(optimizer.optimizer).item() == float(max_norm is not None)
    assert len(checks) == (max_norm is None)  # the unmeasured step's own check


def test_fp16_mixed_unscaling_after_the_clipping_drops_the_norm(checks):
    """fp16-mixed's unscaling (GradScaler's fused kernel) writes the gradients without moving
    their version counters: a norm of the still scaled gradients does not decide the step."""
    strategy, model, optimizer = setup("fp16-mixed")
    backward(strategy, model, batches(1)[0])
    strategy.clip_grad_norm(list(model.parameters()), 1.0)  # before unscaling: a custom loop's slip
    optimizer.step()  # unscales, then decides
    assert len(checks) == 1 and strategy.skipped_steps == 0


def test_only_norms_that_see_inf_and_nan_reveal_them():
    assert all(reveals_nonfinite(p) for p in (1, 2.0, 0.5, math.inf, "inf"))
    assert not any(reveals_nonfinite(p) for p in (0, -1.0, -math.inf))


@pytest.fixture
def als_checks(monkeypatch) -> list[int]:
    """How many times fp16-als's step checked gradients itself, beside its scaler's NaN flag."""
    import hf_lowprec.strategies.fp16_als as fp16_als

    calls = []
    original = fp16_als.nonfinite_flag
    monkeypatch.setattr(fp16_als, "nonfinite_flag", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


# How the NaN enters after fp16-als's unscale: written into a gradient (its version counter moves), or in a
# tensor of the same values that replaced the gradient.
EDITS = {
    "edited": lambda model: poison(model.transformer.h[0].mlp.c_fc.weight.grad),
    "replaced": lambda model: (
        setattr(model.transformer.wte.weight, "grad", model.transformer.wte.weight.grad.clone()),
        poison(model.transformer.wte.weight.grad),
    ),
}


@pytest.mark.parametrize("max_norm", [1.0, math.inf, None], ids=["clipped", "measured", "neither"])
@pytest.mark.parametrize("edit", list(EDITS))
def test_fp16_als_skips_a_nan_written_after_its_unscale(max_norm, edit, als_checks):
    """fp16-als decided its step from the NaN flag its scaler set while unscaling: a NaN written into a
    gradient after that (a Trainer callback's `on_pre_optimizer_step`, noise injection) was stepped on,
    the weight NaN for good and no step counted as skipped, clipped or not. Now a gradient changed since
    the unscale (clipping's factor aside) is checked again, as every other strategy's step checks a
    gradient changed since its clipping's norm: the step is skipped, counted, and the scale halved, as
    for a NaN the unscale saw. An unchanged step checks nothing beyond the scaler's flag."""
    strategy = hf_lowprec.get_strategy("fp16-als", init_scale=2.0**8)
    torch.manual_seed(0)
    model = strategy.prepare_model(GPT2LMHeadModel(tiny_gpt2_config(n_embd=64, n_layer=2, pad_token_id=None)))
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    ids = batches(1)[0]
    for poisoned in (False, True):
        backward(strategy, model, ids)
        strategy.unscale_gradients(optimizer.optimizer)
        if max_norm is not None:
            strategy.clip_grad_norm(list(model.parameters()), max_norm)
        if poisoned:
            scale = strategy.scaler.get_scale()
            before, tensors = held(model, optimizer)
            EDITS[edit](model)
        with DeviceTraffic() as traffic:
            optimizer.step()
        assert not traffic.syncs
        assert len(als_checks) == int(poisoned), (poisoned, als_checks)  # the unchanged step: the flag only
        assert strategy.skipped_steps == int(poisoned)
        optimizer.zero_grad(set_to_none=True)
    for key, tensor in tensors.items():
        assert_bits_equal(tensor.detach(), before[key], f"{edit}: a tensor changed on a skipped step")
    assert strategy.scaler.get_scale() == scale / 2
