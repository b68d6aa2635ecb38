"""fp16-als's running mean in a loop written for Accelerate: what the step takes equals what stock
Accelerate's loop sums (two backward passes of one micro-batch; micro-batches accumulated by hand,
each loss divided by the loop), in the same FP16 arithmetic."""

from __future__ import annotations

import math

import torch
from accelerate import Accelerator

from hf_lowprec.integrations.accelerate import PrecisionPlugin
from tests.helpers import batches, tiny_gpt2


def _unscaled_grads(backwards):
    """fp16-als under the plugin: `backwards(model, backward)` runs the micro-batches, then
    `accelerator.clip_grad_norm_(…, inf)` unscales (by the first step's scale, 1: exact).
    Returns the FP16 gradients the step would take."""
    accelerator = Accelerator(cpu=True)
    plugin = PrecisionPlugin("fp16-als")
    model = tiny_gpt2()
    model, _ = plugin.prepare(accelerator, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    backwards(model, lambda loss, **kw: plugin.backward(accelerator, loss, **kw))
    accelerator.clip_grad_norm_(model.parameters(), math.inf)
    return [p.grad.clone() for p in model.parameters()]


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _ulp16(x):
    """FP16's spacing at |x| (2⁻²⁴ among the subnormals), in float64."""
    exponent = torch.floor(torch.log2(x.double().abs().clamp_min(2.0**-14)))
    return torch.exp2(exponent - 10)


def test_two_backward_passes_of_one_micro_batch_add_up():
    """A main loss and an auxiliary one (here 0.5·loss) backwarded separately after one forward:
    stock sums their gradients; the running mean took the second as micro-batch 2 and halved
    the sum (clip_grad_norm_ 1.436 where stock gave 2.872). Now autograd's FP16 sum g₁ + g₂ of
    the two backward passes, each as it comes alone, bit for bit."""
    ids = batches(1, seed=5)[0]

    def both(model, backward):
        loss = _loss(model, ids)
        backward(loss, retain_graph=True)
        backward(0.5 * loss)

    main = _unscaled_grads(lambda model, backward: backward(_loss(model, ids)))
    aux = _unscaled_grads(lambda model, backward: backward(0.5 * _loss(model, ids)))
    for got, g1, g2 in zip(_unscaled_grads(both), main, aux):
        assert torch.equal(got, g1 + g2)


def test_micro_batches_accumulated_by_hand_with_the_loss_divided_give_stock_sum():
    """Accelerate's manual accumulation (no `accumulate`: each loss divided by 2 by the loop,
    `no_sync` on the first micro-step) sums g_a + g_b of the divided losses; the running mean
    averaged them, dividing by 2 twice (clip_grad_norm_ 0.642 where stock gave 1.285). Now
    2·M₂ = 2·fl(fl(g_a/2) + fl(g_b/2)) against stock's fl(g_a + g_b): the halvings are exact
    but among FP16 subnormals (2⁻²⁵ each), the sum rounds to half an ulp of (g_a+g_b)/2, so
    per element |2·M₂ − fl(g_a+g_b)| ≤ 2⁻²³ + ulp(g_a+g_b) ≤ 2⁻²³ + 2·ulp(fl(g_a+g_b))."""
    data = batches(2, seed=21)
    singles = [_unscaled_grads(lambda model, backward, ids=ids: backward(_loss(model, ids) / 2)) for ids in data]

    def by_hand(model, backward):
        for ids in data:
            backward(_loss(model, ids) / 2)

    for got, ga, gb in zip(_unscaled_grads(by_hand), *singles):
        expected = ga + gb
        bound = 2.0**-23 + 2 * _ulp16(expected)
        assert ((got.double() - expected.double()).abs() <= bound).all()
        assert got.double().norm() > 0.75 * expected.double().norm()  # not halved
