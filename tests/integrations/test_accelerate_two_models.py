"""Two models in one Accelerate loop through PrecisionPlugin (a policy beside a value, reference or
GAN partner model): each trains as it would alone."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator

from hf_lowprec.fp8.scaled import get_master_scale
from hf_lowprec.integrations.accelerate import PrecisionPlugin
from tests.helpers import batches, tiny_gpt2

STEPS = 3


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True)


def _data():
    return [{"input_ids": b, "labels": b} for b in batches(STEPS, batch=2, seq=16)]


def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _o2_a(accelerator, partner):
    """Model A's weights after STEPS fp8-lm-o2 steps with its own AdamW; `partner`: None (A alone),
    "seq" (B, with its own AdamW, takes its backward and step after A's) or "sum" (one backward of
    both losses, then both steps)."""
    plugin = PrecisionPlugin("fp8-lm-o2")
    a = tiny_gpt2(seed=0)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-3)
    if partner is None:
        a, opt_a = plugin.prepare(accelerator, a, opt_a)
    else:
        b = tiny_gpt2(seed=3)
        opt_b = torch.optim.AdamW(b.parameters(), lr=1e-3)
        a, b, opt_a, opt_b = plugin.prepare(accelerator, a, b, opt_a, opt_b)
    start = _weights(a)
    for batch in _data():
        if partner == "sum":
            plugin.backward(accelerator, a(**batch).loss + b(**batch).loss)
            opt_a.step(), opt_b.step(), opt_a.zero_grad(), opt_b.zero_grad()
            continue
        plugin.backward(accelerator, a(**batch).loss)
        opt_a.step(), opt_a.zero_grad()
        if partner == "seq":
            plugin.backward(accelerator, b(**batch).loss)
            opt_b.step(), opt_b.zero_grad()
    return a, start


@pytest.mark.parametrize("partner", ["seq", "sum"])
def test_fp8_lm_o2_trains_each_model_with_its_own_optimizer_as_alone(accelerator, partner):
    # The FP8 GEMM weights' gradients, quantized in backward, went to the optimizer built last:
    # A's never moved (0.0 after 4 steps) and B's optimizer was handed A's gradients.
    alone, _ = _o2_a(accelerator, None)
    beside, start = _o2_a(accelerator, partner)
    fp8 = [n for n, p in beside.named_parameters() if get_master_scale(p) is not None]
    assert fp8
    assert all(not torch.equal(p, start[n]) for n, p in beside.named_parameters() if n in fp8)
    expected = _weights(alone)
    for name, p in beside.named_parameters():
        assert torch.equal(p, expected[name]), name


def test_fp8_lm_o2_one_model_over_two_optimizers_trains_as_over_one(accelerator):
    # Block 0's parameters in one AdamW, the rest in another: each FP8 weight's gradient reaches the
    # optimizer holding it, as with one AdamW over two groups (same hyper-parameters: same updates).
    def run(split):
        plugin = PrecisionPlugin("fp8-lm-o2")
        model = tiny_gpt2(seed=0)
        first = [p for n, p in model.named_parameters() if n.startswith("transformer.h.0.")]
        rest = [p for n, p in model.named_parameters() if not n.startswith("transformer.h.0.")]
        if split:
            opts = [torch.optim.AdamW(first, lr=1e-3), torch.optim.AdamW(rest, lr=1e-3)]
        else:
            opts = [torch.optim.AdamW([{"params": first}, {"params": rest}], lr=1e-3)]
        model, *opts = plugin.prepare(accelerator, model, *opts)
        start = _weights(model)
        for batch in _data():
            plugin.backward(accelerator, model(**batch).loss)
            for opt in opts:
                opt.step(), opt.zero_grad()
        return model, start

    one, _ = run(split=False)
    two, start = run(split=True)
    expected = _weights(one)
    for name, p in two.named_parameters():
        assert not torch.equal(p, start[name]), name
        assert torch.equal(p, expected[name]), name


def _als_policy(accelerator, reference):
    """fp16-als on a policy whose scaled activation gradients overflow FP16 (the loss times 50 at
    scale 2^15), for STEPS steps; `reference`: None, "later" (a frozen reference model prepared by
    a second `prepare`) or "same" (in the policy's `prepare`), run under no_grad each step.
    Returns (forward hooks on the policy, the plugin's metrics, the policy's weights)."""
    plugin = PrecisionPlugin("fp16-als", init_scale=32768.0)
    policy = tiny_gpt2(seed=0)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    ref = tiny_gpt2(seed=1).requires_grad_(False).eval() if reference else None
    if reference == "same":
        policy, opt, ref = plugin.prepare(accelerator, policy, opt, ref)
    else:
        policy, opt = plugin.prepare(accelerator, policy, opt)
    if reference == "later":
        ref = plugin.prepare(accelerator, ref)
    for batch in _data():
        loss = policy(**batch).loss
        if ref is not None:
            with torch.no_grad():
                ref(**batch)
        plugin.backward(accelerator, loss * 50.0)
        opt.step(), opt.zero_grad()
    hooks = sum(len(m._forward_hooks) for m in policy.modules())
    return hooks, plugin.metrics(), _weights(policy)


@pytest.mark.parametrize("reference", ["later", "same"])
def test_fp16_als_keeps_tracking_the_policy_beside_a_frozen_reference(accelerator, reference):
    # Tracking the reference un-tracked the policy (27 forward hooks → 2): its activation gradients
    # went unclipped (2337 clipped elements and a skipped step where alone it clipped 63, none skipped).
    hooks, metrics, weights = _als_policy(accelerator, None)
    hooks_beside, metrics_beside, weights_beside = _als_policy(accelerator, reference)
    assert metrics["precision/clipped_elements_total"] > 0  # the activation clipping is exercised
    assert hooks_beside == hooks
    keys = ("precision/clipped_elements_total", "precision/skipped_steps", "precision/loss_scale")
    assert {k: metrics_beside[k] for k in keys} == {k: metrics[k] for k in keys}
    for name, p in weights_beside.items():
        assert torch.equal(p, weights[name]), name
