"""`fp8.refusal.no_fp8_layer`: an FP8 strategy that converts no layer of a model refuses it naming
the cause per kind of layer (the speed rule, dimensions FP8 GEMMs cannot take, a layer kept by
name) and the fix; prepare_model warns with the same text before any step."""

from __future__ import annotations

import logging

import pytest

import hf_lowprec
from hf_lowprec.report import PrecisionPromiseError
from tests.helpers import assert_bits_equal, batches, tiny_gpt2


def _refusal(strategy, model, caplog):
    """(the first step's PrecisionPromiseError text, what prepare_model warned), weights untouched."""
    with caplog.at_level(logging.WARNING, logger="hf_lowprec.strategies.fp8_rule"):
        model = strategy.prepare_model(model)
    warned = [r.getMessage() for r in caplog.records if r.name == "hf_lowprec.strategies.fp8_rule"]
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PrecisionPromiseError) as raised:
        strategy.train_step(model, batches(1)[0], optimizer)
    for k, v in model.state_dict().items():
        assert_bits_equal(v, before[k], k)
    return str(raised.value), warned


@pytest.mark.parametrize("name", ["fp8-lm-o1", "fp8-lm-o2"])
def test_a_model_the_speed_rule_keeps_in_bf16_is_refused_naming_the_rule_and_its_fix(name, caplog):
    # 64 wide at 8192 tokens on an H100: every GEMM is faster in BF16 than FP8 with its casts, and
    # every dimension is a multiple of 16. The message said "check ... their dimensions".
    message, warned = _refusal(hf_lowprec.get_strategy(name, fp8_gpu="h100"), tiny_gpt2(), caplog)
    assert "the speed rule (fp8_layers='pays') kept c_attn, c_fc, c_proj in BF16" in message
    assert "FP8 would not pay on H100 SXM at 8192 tokens" in message
    assert "kept in high precision by name, whatever the options: lm_head" in message
    assert "precision_options={'fp8_layers': 'all'}" in message and "dimensions" not in message
    assert len(warned) == 1 and warned[0].split(". Training will stop")[0] in message  # at prepare time
    # The fix it names trains the model in FP8.
    strategy = hf_lowprec.get_strategy(name, fp8_layers="all")
    model = strategy.prepare_model(tiny_gpt2())
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    assert strategy.train_step(model, batches(1)[0], optimizer).isfinite()


@pytest.mark.parametrize("name, options", [("fp8-lm-o2", {}), ("fp8-lm-o2", {"fp8_gpu": "h100"}), ("coat", {})])
def test_a_model_whose_dimensions_fp8_cannot_take_is_refused_naming_them(name, options, caplog):
    # Width 40: no GEMM dimension is a multiple of 16. On an H100 the speed rule kept the layers
    # first, but fp8_layers='all' would not convert them either: the dimensions are the cause.
    message, warned = _refusal(hf_lowprec.get_strategy(name, **options), tiny_gpt2(n_embd=40), caplog)
    assert "FP8 GEMMs cannot take the dimensions of c_attn, c_fc, c_proj" in message
    assert "in_features=40, out_features=120 not a multiple of 16" in message
    assert "speed rule" not in message and "fp8_layers" not in message
    assert "train this model with 'bf16-mixed'" in message
    assert len(warned) == 1


def test_coat_on_a_model_the_speed_rule_alone_keeps_in_bf16_is_not_refused(caplog):
    from hf_lowprec.fp8.refusal import no_fp8_layer

    strategy = hf_lowprec.get_strategy("coat", fp8_gpu="h100")
    with caplog.at_level(logging.WARNING, logger="hf_lowprec.strategies.fp8_rule"):
        model = strategy.prepare_model(tiny_gpt2())
    assert no_fp8_layer(model, "coat", uses_fp8_gemm=False, frozen_in_fp8=True) is None
    assert not [r for r in caplog.records if r.name == "hf_lowprec.strategies.fp8_rule"]
