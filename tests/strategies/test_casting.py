"""`cast_model` (the 16-bit weight strategies' cast): what it warns of before casting."""

from __future__ import annotations

import logging

import pytest
from torch import nn
from torch.nn.utils.parametrizations import orthogonal, weight_norm

import hf_lowprec


def _warnings(name: str, caplog) -> list[str]:
    model = nn.Sequential(nn.Linear(16, 16), orthogonal(nn.Linear(16, 32)), weight_norm(nn.Linear(32, 8)))
    with caplog.at_level(logging.WARNING, logger="hf_lowprec.strategies.casting"):
        hf_lowprec.get_strategy(name).prepare_model(model)
    return [r.getMessage() for r in caplog.records if r.name == "hf_lowprec.strategies.casting"]


@pytest.mark.parametrize(
    ("name", "dtype"), [("bf16-pure", "bfloat16"), ("collage-plus", "bfloat16"), ("fp16-als", "float16")]
)
def test_an_orthogonal_parametrization_cast_to_16_bits_is_named(name, dtype, caplog):
    # Its maps in 16 bits: a 32×16 matrix_exp weight goes inf after one BF16 AdamW step, then NaN.
    # weight_norm trains in 16 bits (within their rounding): not named.
    (warning,) = _warnings(name, caplog)
    assert warning.startswith(
        f"1.weight parametrized orthogonal (torch.nn.utils.parametrizations.orthogonal) will be computed in {dtype}"
    )
    assert "strategy with FP32 parameters" in warning


@pytest.mark.parametrize("name", ["fp32", "bf16-mixed"])
def test_a_strategy_with_fp32_parameters_names_none(name, caplog):
    assert _warnings(name, caplog) == []
