"""Gradients of gradients through FP8 layers and COAT's FP8-saved activations are refused
(`hf_lowprec.fp8.second_order`), and first-order backward is what it was."""

import pytest
import torch
from torch import nn
from transformers import LlamaForCausalLM

import hf_lowprec
from hf_lowprec.coat import compress_activations
from hf_lowprec.fp8 import DoubleBackwardError, FP8Linear
from hf_lowprec.fp8.grouped import fp8_grouped_linear
from hf_lowprec.fp8.linear import deliver_weight_grad, fp8_linear
from hf_lowprec.fp8.raised import raised_linear
from tests.helpers import assert_bits_equal, batches, tiny_llama_config

# A Llama (RMSNorm, gated SiLU MLP: COAT's autograd-re-run path and its kernel path) whose every
# projection FP8 converts; eager attention, whose double backward torch has on CPU.
IDS = batches(1, batch=2, seq=16)[0]
FIXES = {"fp8-lm-o1": "'bf16-mixed'", "fp8-lm-o2": "'bf16-mixed'", "coat": "{'activations': False}"}


def prepared(name, **options):
    torch.manual_seed(0)
    config = tiny_llama_config(32)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config)
    if name is None:
        return None, model
    strategy = hf_lowprec.get_strategy(name, **options)
    return strategy, strategy.prepare_model(model)


def penalty_gradients(strategy, model):
    """The gradients of CE + ‖∂CE/∂inputs_embeds‖² (an input-gradient penalty) with respect to the
    parameters; stock BF16 autocast where `strategy` is None."""
    emb = model.get_input_embeddings()(IDS).detach().requires_grad_(True)
    context = strategy.forward_context() if strategy else torch.autocast("cpu", dtype=torch.bfloat16)
    with context:
        loss = model(inputs_embeds=emb, labels=IDS).loss
    (g,) = torch.autograd.grad(loss, emb, create_graph=True)
    (loss + g.float().pow(2).sum()).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["fp8-lm-o1", "fp8-lm-o2", "coat"])
def test_a_gradient_penalty_through_fp8_layers_is_refused_naming_the_fix(name):
    """The penalty's `create_graph` backward ran without error and returned an input gradient with no
    graph through the FP8 layers: the penalty's weight gradients were 5-6x too small under
    fp8-lm-o1/o2 (rel. L2 error 0.97) and absent under coat (its gradient was CE's alone)."""
    strategy, model = prepared(name, fp8_layers="all")
    with pytest.raises(DoubleBackwardError, match="create_graph") as refused:
        penalty_gradients(strategy, model)
    message = str(refused.value)
    assert name in message and FIXES[name] in message and "no graph" in message, message


@pytest.mark.parametrize("fix", ["bf16-mixed", "coat"])
def test_the_fixes_named_train_the_penalty_as_stock_bf16_autocast_does(fix):
    """What the refusals suggest takes the whole penalty: coat with `activations=False` (BF16 GEMMs and
    activations under BF16 autocast) and bf16-mixed run stock BF16 autocast's arithmetic, so their
    gradients are its gradients bit for bit."""
    options = {"activations": False} if fix == "coat" else {}
    want = penalty_gradients(*prepared(None))
    got = penalty_gradients(*prepared(fix, **options))
    assert got.keys() == want.keys() and len(got) > 10
    for n, grad in want.items():
        assert_bits_equal(got[n].float(), grad.float(), n)


def _linear():
    torch.manual_seed(0)
    return FP8Linear.from_float(nn.Linear(32, 48))


def _grouped(x, w):
    offsets, rows = torch.tensor([8, 16], dtype=torch.int32), torch.tensor([0] * 8 + [1] * 8)
    return fp8_grouped_linear(x, w, offsets, rows)


LAYERS = {
    "fp8_linear": (lambda x, w: fp8_linear(x, w), (48, 32)),
    "grouped": (_grouped, (2, 48, 32)),
    "raised": (lambda x, w: raised_linear(_linear(), x, torch.float32, None, deliver_weight_grad), (48, 32)),
    "coat_layernorm": (lambda x, w: compress_activations(nn.LayerNorm(32))(x), (1,)),
    "coat_gelu": (lambda x, w: compress_activations(nn.GELU())(x), (1,)),
}


@pytest.mark.parametrize("layer", LAYERS)
def test_each_layer_refuses_create_graph_and_keeps_its_first_order_gradient(layer):
    """Every hand-written backward that computes from saved FP8 (or, raised, BF16) copies refuses a
    create_graph backward; without create_graph, and under an outer `enable_grad` (which autograd
    does not pass into backward), the input gradient is the same bits."""
    forward, shape = LAYERS[layer]
    torch.manual_seed(1)
    x = torch.randn(16, 32, requires_grad=True)
    w = (torch.randn(shape) / 8).requires_grad_(True)
    with pytest.raises(DoubleBackwardError, match="no graph"):
        torch.autograd.grad(forward(x, w).pow(2).sum(), x, create_graph=True)
    (plain,) = torch.autograd.grad(forward(x, w).pow(2).sum(), x)
    with torch.enable_grad():
        forward(x, w).pow(2).sum().backward()
    assert_bits_equal(x.grad, plain, layer)


@pytest.mark.parametrize("name", ["fp8-lm-o1", "fp8-lm-o2", "coat"])
def test_gradient_checkpointing_trains_as_without_it(name):
    """Checkpointing re-runs forwards inside backward (reentrant: a nested backward with grad mode on
    around the forward): three steps, the O2 gradient sink included, are the plain run's bit for bit."""

    def losses(reentrant):
        strategy, model = prepared(name, fp8_layers="all")
        model.train()
        if reentrant is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
        return [strategy.train_step(model, ids, optimizer).item() for ids in batches(3, batch=2, seq=16)]

    plain = losses(None)
    assert losses(False) == plain and losses(True) == plain
