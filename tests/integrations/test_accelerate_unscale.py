"""`accelerator.unscale_gradients()` and torch's keywords to `accelerator.clip_grad_norm_` after
`plugin.prepare`: the stock idiom for clipping or reading gradients by hand under fp16, and the
arguments stock Accelerate refuses, alike under every strategy."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator

from hf_lowprec.integrations.accelerate import PrecisionPlugin
from tests.helpers import batches, tiny_gpt2

# fp16-als starts at scale 1 (unscaling changes nothing there): 2**10 makes its unscaling visible.
LOSS_SCALING = [("fp16-mixed", {}), ("fp16-als", {"init_scale": 2.0**10})]


def _after_backward(name, options, accumulation=1):
    """A fresh Accelerator and plugin, the model and optimizer prepared, one backward done."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    plugin = PrecisionPlugin(name, **options)
    torch.manual_seed(0)
    model = tiny_gpt2()
    model, optimizer = plugin.prepare(accelerator, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    batch = batches(1)[0]
    with accelerator.accumulate(model):
        plugin.backward(accelerator, model(input_ids=batch, labels=batch).loss)
    return accelerator, plugin, model, optimizer


def _grads(model):
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize(("name", "options"), LOSS_SCALING)
@pytest.mark.parametrize("which", [(), ("optimizer",)])
def test_unscale_gradients_gives_the_loop_the_unscaled_gradients(name, options, which):
    """The stock fp16 idiom: `accelerator.unscale_gradients()`, torch's clipping, the step. It found no
    scaler (the Accelerator's mixed_precision is "no") and left the gradients scaled: fp16-mixed's FP64
    norm after it was 168161 against stock fp16's 2.566 (2**16 over), torch's clip scaled them to norm 1
    still scaled, and the step trained on 2**-16 of the clipped gradient."""
    accelerator, plugin, model, optimizer = _after_backward(name, options)
    scaled = _grads(model)
    accelerator.unscale_gradients(*(optimizer for _ in which))
    _, twin_plugin, twin, twin_optimizer = _after_backward(name, options)
    twin_plugin.strategy.unscale_gradients(twin_optimizer.optimizer)  # the strategy's own unscaling
    unscaled = _grads(twin)
    assert len(scaled) == len(unscaled) == len(_grads(model))
    # Bit for bit the strategy's unscaling, and smaller than before by about the scale (2**16, 2**10).
    for got, expected in zip(_grads(model), unscaled, strict=True):
        assert torch.equal(got, expected)
    assert sum(float(b.double().norm()) for b in scaled) > 2**9 * sum(float(g.double().norm()) for g in unscaled)
    # The step does not unscale them again: the same weights as the twin clipped and stepped by hand.
    for m, opt in ((model, optimizer), (twin, twin_optimizer)):
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    assert plugin.strategy.skipped_steps == 0


@pytest.mark.parametrize(("name", "options"), LOSS_SCALING)
def test_unscale_gradients_on_a_micro_step_that_does_not_sync_leaves_them_alone(name, options):
    """A loss-scaling strategy unscales once, at the step (as its `clip_grad_norm_`): unscaled on an earlier
    micro-step, the gradients would take the later micro-batches' scaled ones on top."""
    accelerator, _, model, _ = _after_backward(name, options, accumulation=2)
    assert not accelerator.sync_gradients
    before = _grads(model)
    accelerator.unscale_gradients()
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), before, strict=True))


@pytest.mark.parametrize("name", [None, "fp32", "bf16-mixed", "collage-plus", "fp16-mixed", "fp16-als", "fp8-lm-o2"])
@pytest.mark.parametrize("keyword", ["error_if_nonfinite", "foreach"])
def test_clip_grad_norm_refuses_torchs_keywords_as_stock_accelerate_does(name, keyword):
    """Stock Accelerate's clip_grad_norm_ takes (parameters, max_norm, norm_type): torch's
    `error_if_nonfinite=True` raised TypeError under stock (name None), fp32 and bf16-mixed, and was
    dropped under collage-plus, fp16-mixed, fp16-als and fp8-lm-o2 (a NaN norm returned, no error)."""
    if name is None:
        accelerator = Accelerator(cpu=True)
        torch.manual_seed(0)
        model, _ = accelerator.prepare(tiny_gpt2(), torch.optim.AdamW(tiny_gpt2().parameters()))
        batch = batches(1)[0]
        accelerator.backward(model(input_ids=batch, labels=batch).loss)
    else:
        accelerator, _, model, _ = _after_backward(name, {})
    model.transformer.wte.weight.grad.view(-1)[0] = float("nan")
    before = _grads(model)
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}'"):
        accelerator.clip_grad_norm_(model.parameters(), 1.0, **{keyword: True})
    # Refused before any work: nothing unscaled or clipped.
    for a, b in zip(_grads(model), before, strict=True):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
