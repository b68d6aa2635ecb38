"""torch.func transforms over a prepared model: `grad(lambda P: functional_call(model, P, ...).loss)`
(meta-learning, influence functions) under the strategies whose hooks and FP8 layers used to crash
there, and `vmap` refused in words where the FP8 layers cannot be batched."""

import copy

import pytest
import torch
from torch.func import functional_call, grad, vmap
from transformers import LlamaForCausalLM

import hf_lowprec
from hf_lowprec.fp8.linear import FP8Linear
from tests.helpers import assert_bits_equal, batches, tiny_llama_config

STRATEGIES = ["fp16-als", "fp8-lm-o1", "fp8-lm-o2", "coat"]


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = tiny_llama_config(32)
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config)


def loss_of(strategy, model, ids):
    def loss(params):
        context = strategy.forward_context() if strategy is not None else torch.enable_grad()
        with context:
            return functional_call(model, params, (), {"input_ids": ids, "labels": ids}).loss.float()

    return loss


def func_grad(strategy, model, ids) -> dict[str, torch.Tensor]:
    params = {n: p.detach() for n, p in model.named_parameters()}
    return grad(loss_of(strategy, model, ids))(params)


def backward_grad(strategy, model, ids) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_of(strategy, model, ids)(dict(model.named_parameters())).backward()
    return {n: p.grad.float() for n, p in model.named_parameters()}


def worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest per-tensor relative difference ‖a − b‖ / ‖b‖."""
    return max(float((a[n].float() - b[n]).norm() / b[n].norm()) for n in b)


@pytest.mark.parametrize("name", STRATEGIES)
def test_func_grad_over_functional_call_is_the_strategys_gradient(name):
    """fp16-als crashed (its activation-gradient tally wrote in place into the step's counts),
    fp8-lm-o1/o2 crashed (the FP8 weight cache read a wrapper's data pointer; the FP8 function had no
    `setup_context`), coat crashed (its FP8-saved activations: a Function without `setup_context`
    and saved-tensor hooks). Now torch.func.grad gives the strategy's gradient: computed by the same
    layers as `loss.backward()`, its error against FP32 is the strategy's own, so it and backward's
    gradient lie within that error of the FP32 gradient, and within twice it of each other (coat's
    activations are kept exactly inside the transform: one FP8 rounding fewer)."""
    strategy = hf_lowprec.get_strategy(name)
    ids = batches(1, batch=2, seq=16)[0]
    base = llama()
    reference = backward_grad(None, copy.deepcopy(base), ids)  # FP32, no strategy
    model = strategy.prepare_model(copy.deepcopy(base))
    transformed = func_grad(strategy, model, ids)
    backward = backward_grad(strategy, model, ids)
    own_error = worst(backward, reference)
    assert worst(transformed, reference) <= 1.5 * own_error, (worst(transformed, reference), own_error)
    assert worst(transformed, backward) <= 2 * own_error, (worst(transformed, backward), own_error)


def test_func_grad_leaves_the_training_state_alone():
    """Inside the transform the gradient is the transform's: fp8-lm-o2's gradient sinks (set by its
    optimizer) take nothing and `.grad` stays empty; an FP8 layer's func.grad is its backward's bit
    for bit; fp16-als's loss scaler counts nothing (its tallies are a training step's)."""
    ids = batches(1, batch=2, seq=16)[0]
    strategy = hf_lowprec.get_strategy("fp8-lm-o2")
    model = strategy.prepare_model(llama())
    _optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)  # kept alive: the sinks hold it weakly
    transformed = func_grad(strategy, model, ids)
    assert all(p.grad is None for p in model.parameters())
    layer = next(m for m in model.modules() if isinstance(m, FP8Linear))
    x = torch.randn(8, layer.in_features)
    params = {n: p.detach() for n, p in layer.named_parameters()}
    g = grad(lambda P: functional_call(layer, P, (x,)).float().square().sum())(params)
    plain = copy.deepcopy(layer)
    plain(x).float().square().sum().backward()
    for n, p in plain.named_parameters():
        assert_bits_equal(g[n], p.grad, n)
    assert all(torch.isfinite(t).all() for t in transformed.values())

    strategy = hf_lowprec.get_strategy("fp16-als")
    model = strategy.prepare_model(llama())
    scaler = strategy.scaler
    before = scaler._step.clone(), scaler._clipped.clone()
    func_grad(strategy, model, ids)
    assert_bits_equal(scaler._step, before[0], "this step's tallies")
    assert_bits_equal(scaler._clipped, before[1], "clipped counts")
    backward_grad(strategy, model, ids)  # a backward counts as before
    assert scaler._step.sum() > 0


def test_vmap_over_fp8_layers_is_refused_in_words():
    """Per-sample gradients with vmap crashed inside the FP8 layers; the FP8 casts and GEMMs have no
    batching rule, so the refusal names vmap, the strategies and the fix."""
    strategy = hf_lowprec.get_strategy("fp8-lm-o1")
    model = strategy.prepare_model(llama())
    ids = batches(1, batch=2, seq=16)[0]
    params = {n: p.detach() for n, p in model.named_parameters()}

    def sample_loss(params, row):
        with strategy.forward_context():
            return functional_call(model, params, (), {"input_ids": row[None], "labels": row[None]}).loss.float()

    with pytest.raises(NotImplementedError, match=r"torch\.func\.vmap .*fp8-lm-o1.*once per sample"):
        vmap(grad(sample_loss), in_dims=(None, 0))(params, ids)
