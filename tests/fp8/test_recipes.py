"""FP8 scaling recipes (hf_lowprec/fp8/recipes.py): scale rules, the emulated GEMMs against FP64,
the layer's three GEMMs per recipe, outlier rows, and the conversion filters."""

import logging
import math

import pytest
import torch
from torch import nn

from hf_lowprec.fp8 import FP8Linear, convert_to_fp8, fp8_linear
from hf_lowprec.fp8.scaling_recipes import (
    SCALING_RECIPES,
    dequantize_blocks,
    fp8_config,
    mx_scale,
    quantize_blocks,
    recipe_mm,
    scaling_recipe,
)
from hf_lowprec.testing import row_snr_db, snr_db
from tests.fp8_reference import fp64_linear_reference, fp64_product, gemm_error_bound
from tests.helpers import assert_bits_equal, bits_equal, snr_floor_db

E4M3 = torch.float8_e4m3fn
FINE = ["rowwise", "blockwise", "mxfp8"]
# The finer recipes' gradients are E4M3 too: every GEMM operand is rounded once to E4M3, plus
# the BF16 output (`snr_floor_db`, 25.8 dB), as the tensorwise forward.
SNR_FINE_DB = snr_floor_db(E4M3, E4M3, torch.bfloat16)


def test_unknown_recipe_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"tensorwise.*rowwise.*blockwise.*mxfp8"):
        scaling_recipe("colwise")
    with pytest.raises(ValueError, match="valid recipes"):
        FP8Linear(32, 32, recipe="nvfp4")


@pytest.mark.parametrize(
    "name, x_scales, w_scales",
    [("rowwise", (300, 1), (96, 1)), ("blockwise", (300, 2), (1, 2)), ("mxfp8", (300, 8), (96, 8))],
)
def test_scale_shapes_follow_the_blocks(name, x_scales, w_scales):
    recipe = scaling_recipe(name)
    x, w = torch.randn(300, 256), torch.randn(96, 256)
    assert quantize_blocks(x, recipe.activation_block, E4M3, e8m0=recipe.e8m0)[1].shape == x_scales
    assert quantize_blocks(w, recipe.weight_block, E4M3, e8m0=recipe.e8m0)[1].shape == w_scales


@pytest.mark.parametrize("name", FINE)
def test_each_block_is_scaled_by_its_own_amax_and_dequantizes_to_the_rounded_values(name):
    recipe = scaling_recipe(name)
    g = torch.Generator().manual_seed(0)
    # Rows and blocks over 24 binades: one scale per tensor would flush the small ones to zero.
    x = torch.randn(200, 256, generator=g) * torch.exp2(torch.randint(-12, 12, (200, 1), generator=g).float())
    payload, scale = quantize_blocks(x, recipe.activation_block, E4M3, e8m0=recipe.e8m0)
    assert payload.dtype == E4M3 and bool((torch.frexp(scale)[0] == 0.5).all()), "powers of two"
    real = dequantize_blocks(payload, scale, recipe.activation_block)
    # One rounding to E4M3 of a value in the normal range: |error| ≤ 2^-4 relative; below it,
    # half the subnormal spacing 2^-9 in payload units. amax·s ≥ 224 (256 for MX) per block.
    # MX saturates by design: amax·s < 512, so values above 448/s (≥ 0.875·amax) may lose
    # the excess over it.
    cols = recipe.activation_block[1] or x.shape[1]
    amax = x.abs().reshape(200, -1, cols).amax(-1, keepdim=True).expand(-1, -1, cols).reshape(200, -1)
    bound = 2.0**-4 * x.abs() + 2.0**-10 * amax / 224
    if recipe.e8m0:
        bound = bound + (x.abs() - 0.875 * amax).clamp(min=0)
    assert ((real.double() - x.double()).abs() <= bound.double()).all()


def test_mx_scale_follows_the_ocp_rule():
    # X = 2^(⌊log2 amax⌋ − 8) for E4M3 elements: amax 1.0 → X = 2^-8, s = 256; 448 → 2^0;
    # 500 → 2^0 (500·1 saturates to 448 in the cast); zero or inf → s = 1.
    amax = torch.tensor([1.0, 448.0, 500.0, 0.75, 0.0, float("inf")])
    assert mx_scale(amax).tolist() == [256.0, 1.0, 1.0, 512.0, 1.0, 1.0]
    payload, _ = quantize_blocks(torch.tensor([[500.0] + [1.0] * 31]), (1, 32), E4M3, e8m0=True)
    assert payload.float()[0, 0].item() == 448.0, "MX casts saturate"


@pytest.mark.parametrize("name", FINE)
def test_emulated_gemm_is_the_exact_product_within_fp32_accumulation_and_one_bf16_rounding(name):
    recipe = scaling_recipe(name)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(48, 384, generator=g), torch.randn(80, 384, generator=g) * 1e-3
    a8, sa = quantize_blocks(a, recipe.activation_block, E4M3, e8m0=recipe.e8m0)
    b8, sb = quantize_blocks(b, recipe.weight_block, E4M3, e8m0=recipe.e8m0)
    out = recipe_mm(recipe, a8, sa, recipe.activation_block, b8, sb, recipe.weight_block, native=False)
    a_real = dequantize_blocks(a8, sa, recipe.activation_block)
    b_real = dequantize_blocks(b8, sb, recipe.weight_block)
    exact, total = fp64_product(a_real, b_real.t())
    # Products of ≤ 4-bit significands are exact in FP32; the FP32 sum errs by ≤ γ_{K−1}·Σ|a||b|
    # in any order, then one rounding to BF16 (2^-8 relative).
    assert ((out.double() - exact).abs() <= gemm_error_bound(exact, total, a.shape[1])).all()


@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
@pytest.mark.parametrize("name", FINE)
def test_forward_and_gradients_against_fp64(name, transposed):
    ref = fp64_linear_reference(200, 256, 128, transposed)
    y, x_grad, w_grad = ref.run(lambda x, w: fp8_linear(x, w, weight_transposed=transposed, recipe=name))
    assert snr_db(ref.y, y) >= SNR_FINE_DB
    assert snr_db(ref.x_grad, x_grad) >= SNR_FINE_DB
    assert snr_db(ref.w_grad, w_grad) >= SNR_FINE_DB


def outlier_activations(rows=256, k=512, outliers=(3, 77, 190), factor=1e5, seed=0):
    """Gaussian token rows, a few of them 10^5× the rest (massive activations)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g, dtype=torch.float64)
    x[list(outliers)] *= factor
    return x


@pytest.mark.parametrize("name", FINE)
def test_ordinary_rows_keep_their_snr_beside_massive_activation_rows(name):
    # Per-row (or finer) scales along the token rows: an outlier row changes only its own
    # scales, so the ordinary rows' forward output is the one without outliers, bit for bit;
    # their median SNR is within 1 dB of the no-outlier value (the goal), whereas one
    # scale per tensor flushes them (the test checks tensorwise loses more than 10 dB).
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 512, generator=g, dtype=torch.float64) * 0.05
    ordinary = [r for r in range(256) if r not in (3, 77, 190)]
    snr = {}
    for label, x in (("clean", outlier_activations(factor=1.0)), ("outliers", outlier_activations())):
        for recipe in ("tensorwise", name):
            y = fp8_linear(x.float(), w.float(), recipe=recipe).detach()
            snr[label, recipe] = row_snr_db(x @ w.t(), y)[ordinary].median().item()
            if label == "outliers" and recipe == name:
                assert_bits_equal(
                    y[ordinary], fp8_linear(outlier_activations(factor=1.0).float(), w.float(), recipe=name)[ordinary]
                )
    assert snr["outliers", name] >= snr["clean", name] - 1.0, snr
    assert snr["outliers", "tensorwise"] < snr["clean", "tensorwise"] - 10.0, snr


@pytest.mark.parametrize("name", FINE)
def test_layer_recipe_is_used_by_forward_and_conversion(name):
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    convert_to_fp8(model, recipe=name)
    assert all(isinstance(m, FP8Linear) and m.recipe == name for m in (model[0], model[2]))
    x = torch.randn(64, 256)
    y = model(x)
    y.sum().backward()
    ref = fp8_linear(
        torch.relu(fp8_linear(x, model[0].weight, model[0].bias, recipe=name)),
        model[2].weight,
        model[2].bias,
        recipe=name,
    )
    assert bits_equal(y.detach(), ref.detach())
    assert model[0].weight.grad is not None and torch.isfinite(model[0].weight.grad).all()


def test_tensorwise_layer_is_the_default_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(64, 128, generator=g), torch.randn(96, 128, generator=g)
    assert_bits_equal(fp8_linear(x, w, recipe="tensorwise"), fp8_linear(x, w))


@pytest.mark.parametrize("name, multiple", [("tensorwise", 16), ("rowwise", 16), ("blockwise", 128), ("mxfp8", 32)])
def test_conversion_keeps_layers_off_the_recipe_blocks_in_high_precision(name, multiple, caplog):
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 96), nn.Linear(96, 256))
    with caplog.at_level(logging.WARNING):
        convert_to_fp8(model, recipe=name)
    converted = [isinstance(m, FP8Linear) for m in model]
    assert converted == [True, 96 % multiple == 0, 96 % multiple == 0]
    if 96 % multiple:
        assert f"not a multiple of {multiple}" in model.fp8_skipped_layers["1"]
        assert "blocks" in model.fp8_skipped_layers["1"]


def test_small_gemms_stay_high_precision_unless_module_filter_says_otherwise():
    def build():
        return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2048))

    model = convert_to_fp8(build(), min_gemm_features=1024)
    assert not isinstance(model[0], FP8Linear) and isinstance(model[1], FP8Linear)
    assert "too small" in model.fp8_skipped_layers["0"]
    forced = convert_to_fp8(build(), min_gemm_features=1024, module_filter=lambda m, fqn: True)
    assert isinstance(forced[0], FP8Linear)
    with pytest.raises(ValueError, match="min_gemm_features"):
        convert_to_fp8(build(), min_gemm_features=-1)


def test_recipes_table_is_complete():
    assert list(SCALING_RECIPES) == ["tensorwise", "rowwise", "blockwise", "mxfp8"]
    assert math.lcm(16, 128) == SCALING_RECIPES["blockwise"].dim_multiple


@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
@pytest.mark.parametrize("shape", [(0, 128), (2, 0, 128)], ids=["0x128", "2x0x128"])
@pytest.mark.parametrize("name", list(SCALING_RECIPES))
def test_zero_tokens_give_an_empty_output_and_zero_gradients_as_nn_linear(name, shape, transposed):
    """A layer given no token rows (an expert dispatched none, an emptied micro-batch) returns
    what nn.Linear does: an empty (…, out) output and, in training, weight and bias gradients
    that are empty sums, exactly 0 (no tolerance: nothing is rounded), in eval as well."""
    torch.manual_seed(0)
    w, b = torch.randn(64, 128, dtype=torch.float64), torch.randn(64, dtype=torch.float64)
    x = torch.randn(*shape, dtype=torch.float64)
    ref = nn.functional.linear(x, w, b)  # the FP64 reference: shape (…, 64), no element
    xr = x.float().requires_grad_()
    wr = (w.t().contiguous() if transposed else w).float().requires_grad_()
    br = b.float().requires_grad_()
    y = fp8_linear(xr, wr, br, weight_transposed=transposed, recipe=name)
    y.sum().backward()
    assert y.shape == ref.shape and xr.grad.shape == x.shape
    assert wr.grad is not None and torch.equal(wr.grad, torch.zeros_like(wr))
    assert torch.equal(br.grad, torch.zeros_like(br))
    layer = FP8Linear.from_float(nn.Linear(128, 64), config=fp8_config(name)).eval()
    with torch.no_grad():
        assert layer(x.float()).shape == ref.shape


def test_block_helpers_take_a_tensor_without_rows():
    """quantize/dequantize of an R = 0 operand per block (the finer recipes' casts) keep the
    shapes: a (0, C) payload and a scale per row (none) or per block row (none)."""
    for name in FINE:
        recipe = scaling_recipe(name)
        payload, scale = quantize_blocks(torch.zeros(0, 128), recipe.activation_block, E4M3)
        assert payload.shape == (0, 128) and scale.shape[0] == 0
        assert dequantize_blocks(payload, scale, recipe.activation_block).shape == (0, 128)
