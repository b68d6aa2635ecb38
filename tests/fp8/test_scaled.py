"""Scaled FP8 tensors (docs/algorithms.md §3): power-of-two scales, saturating casts, safe loading."""

import io
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_lowprec.fp8 import (
    ScaledTensor,
    count_saturated,
    dequantize,
    format_dtype,
    format_max,
    pow2_scale,
    quantize,
    quantize_counting,
)
from tests.helpers import bits_equal

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Half an ulp relative to the value: 2^-(P) for P significand bits (E4M3: 4, E5M2: 3, FP16: 11).
HALF_ULP = {E4M3: 2.0**-4, E5M2: 2.0**-3, torch.float16: 2.0**-11}


def test_format_table():
    assert format_max(E4M3) == 448.0
    assert format_max(E5M2) == 57344.0
    assert format_max(torch.float16) == 65504.0
    assert format_dtype("e4m3") is E4M3
    with pytest.raises(ValueError, match="valid formats"):
        format_dtype("e3m4")


@settings(max_examples=200, deadline=None)
@given(
    log2_amax=st.floats(min_value=-100.0, max_value=100.0),
    margin=st.integers(min_value=0, max_value=4),
    dtype=st.sampled_from([E4M3, E5M2, torch.float16]),
)
def test_pow2_scale_puts_amax_in_the_top_binade_below_the_margin(log2_amax, margin, dtype):
    amax = torch.tensor(2.0**log2_amax)
    s = pow2_scale(amax, dtype, margin)
    exponent = math.log2(s.item())
    assert exponent == round(exponent), "scales must be powers of two"
    top = format_max(dtype) / 2**margin
    assert top / 2 < (amax * s).item() <= top


def test_pow2_scale_of_zero_and_nonfinite_is_one():
    amax = torch.tensor([0.0, float("inf"), float("nan")])
    assert bits_equal(pow2_scale(amax, E4M3), torch.ones(3))
    with pytest.raises(ValueError, match="margin"):
        pow2_scale(amax, E4M3, margin=-1)


@pytest.mark.parametrize("dtype", [E4M3, E5M2, torch.float16])
def test_round_trip_error_is_half_an_ulp(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g, dtype=torch.float64) * 3e-3
    st_ = ScaledTensor.quantize(x, dtype)
    back = st_.dequantize(torch.float64)
    # Elements in the normal range of the format keep a relative error of half an ulp.
    smallest_normal = torch.finfo(dtype).smallest_normal / st_.scale.item()
    normal = x.abs() >= smallest_normal
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max().item() <= HALF_ULP[dtype] * (1 + 1e-12)
    assert normal.float().mean() > 0.99


def test_saturation_and_nonfinite_values():
    x = torch.tensor([1.0, 447.0, 500.0, -1e6, float("inf"), float("nan"), 0.0])
    one = torch.tensor(1.0)
    payload, clipped = quantize_counting(x, one, E4M3)
    assert payload.float()[:4].tolist() == [1.0, 448.0, 448.0, -448.0]
    assert payload.float()[4:6].isnan().all(), "overflow upstream (inf) must stay visible as NaN"
    # 500 and -1e6 were clipped; 447 rounds to 448 but was representable, inf/NaN are not 'saturation'.
    assert clipped.item() == 2 == count_saturated(x, one, E4M3).item()
    assert quantize(torch.tensor([1e5]), one, E5M2).float().item() == 57344.0


def test_per_group_scales():
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(4, 64, generator=g) * torch.tensor([1e-4, 1e-1, 1.0, 1e3])[:, None]
    grouped = ScaledTensor.quantize(rows, "e4m3", group_size=64)
    assert grouped.scale.shape == (4,)
    assert len(set(grouped.scale.tolist())) == 4
    rel = ((grouped.dequantize() - rows).abs() / rows.abs()).max()
    per_tensor_rel = ((ScaledTensor.quantize(rows, "e4m3").dequantize() - rows).abs() / rows.abs()).max()
    assert rel < per_tensor_rel, "per-group scales must help rows of very different magnitude"
    with pytest.raises(ValueError, match="group_size"):
        ScaledTensor.quantize(rows, "e4m3", group_size=48)


def test_dequantize_matches_the_convention_real_equals_payload_over_scale():
    payload = torch.tensor([2.0, -4.0]).to(E4M3)
    assert dequantize(payload, torch.tensor(8.0)).tolist() == [0.25, -0.5]


def test_zeros_and_safe_loading():
    zeros = ScaledTensor.zeros((3, 16), "e5m2", group_size=16)
    assert zeros.payload.dtype == E5M2 and zeros.scale.shape == (3,)
    assert bits_equal(zeros.dequantize(), torch.zeros(3, 16))
    x = ScaledTensor.quantize(torch.randn(32), "e4m3")
    buffer = io.BytesIO()
    torch.save({"container": x, "plain": (x.payload, x.scale)}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded["container"].payload.dtype == E4M3
    assert bits_equal(loaded["container"].payload.view(torch.uint8), x.payload.view(torch.uint8))
    assert bits_equal(loaded["plain"][1], x.scale)
    assert x.nbytes() == 32 + 4
