"""Fast FP8 conversions (hf_lowprec.fp8.cast) give exactly PyTorch's casts, bit for bit."""

import pytest
import torch

from hf_lowprec.fp8 import cast, quantize_counting, quantize_gradient
from hf_lowprec.fp8.scaled import format_max, pow2_scale, tensor_amax
from tests.helpers import bits, bits_equal

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
WIDE = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", WIDE)
def test_widen_gives_the_cast_of_every_code(fp8, dtype):
    codes = torch.arange(256, dtype=torch.uint8).view(fp8)  # ±0, subnormals, max, NaN (and E5M2 ±inf)
    assert bits_equal(bits(cast.widen(codes, dtype)), bits(codes.to(dtype)))
    grid = codes[torch.randperm(256, generator=torch.Generator().manual_seed(0))].view(16, 16)
    for layout in (grid, grid.t(), grid[:, ::2], grid.t()[1:]):  # contiguous, transposed, strided
        out = cast.widen(layout, dtype)
        assert out.shape == layout.shape and bits_equal(bits(out), bits(layout.to(dtype)))


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", WIDE)
def test_widen_two_codes_at_a_time_gives_the_cast_of_every_pair(fp8, dtype):
    """16-bit results are looked up a byte pair at a time: all 65536 pairs, and an odd size
    (the single-code table for the last byte's layout)."""
    first, second = torch.meshgrid(torch.arange(256), torch.arange(256), indexing="ij")
    pairs = torch.stack([first, second], dim=-1).reshape(-1).to(torch.uint8).view(fp8)
    assert bits_equal(bits(cast.widen(pairs, dtype)), bits(pairs.to(dtype)))
    odd = pairs[:255]
    assert bits_equal(bits(cast.widen(odd, dtype)), bits(odd.to(dtype)))


def test_widen_leaves_other_dtypes_to_the_plain_cast():
    x = torch.randn(5, 3)
    assert bits_equal(cast.widen(x, torch.bfloat16), x.to(torch.bfloat16))


def fp8_test_values(fp8: torch.dtype) -> torch.Tensor:
    """Every finite FP8 value, the midpoints between neighbours (exact ties for round-to-nearest-even),
    and the FP32 numbers one ulp on either side of each midpoint, with both signs."""
    values = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    values = values[values.isfinite() & (values >= 0)].unique().double()
    mids = ((values[1:] + values[:-1]) / 2).float()  # exact in FP32: 4 significant bits at most
    near = torch.cat([mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e9))])
    out = torch.cat([values.float(), near])
    return torch.cat([out, -out])


@pytest.mark.parametrize("fp8", FP8)
def test_scale_to_fp8_rounds_like_the_eager_cast_and_like_fp64(fp8):
    """Compiled and eager casts agree bit for bit on ties and their neighbours; and against FP64:
    the payload is the FP8 value nearest to x·s (ties to even), so its error is at most half the
    spacing between the two FP8 neighbours of x·s."""
    y = fp8_test_values(fp8)
    for factor in (1.0, 2.0**-3, 2.0**5):
        x = y / factor  # exact: powers of two
        scale = torch.tensor(factor)
        got = cast.scale_to_fp8(x, scale, fp8)
        assert bits_equal(bits(got), bits((x * scale).to(fp8)))
        grid = torch.arange(256, dtype=torch.uint8).view(fp8).double()
        grid = grid[grid.isfinite()].unique()
        target = (x.double() * factor).unsqueeze(1)
        distance = (grid.unsqueeze(0) - target).abs().min(dim=1).values
        assert bits_equal((got.double() - target.squeeze(1)).abs(), distance)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", WIDE)
def test_scale_to_fp8_takes_every_input_dtype_and_keeps_nan(fp8, dtype):
    x = torch.randn(37, 19, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[3, 4] = float("nan")
    scale = pow2_scale(tensor_amax(x[x.isfinite()]), fp8)
    got = cast.scale_to_fp8(x, scale, fp8)
    assert got.shape == x.shape and got.dtype == fp8
    assert bits_equal(bits(got), bits((x.float() * scale).to(fp8)))
    assert got[3, 4].float().isnan()
    assert cast.scale_to_fp8(torch.empty(0, 8, dtype=dtype), scale, fp8).shape == (0, 8)


def test_tensor_amax_is_the_max_of_abs_including_nan_and_signed_zero():
    for x in (torch.tensor([-3.0, 2.0]), torch.tensor([-0.0, 0.0]), torch.tensor([1.0, float("-inf")])):
        assert torch.equal(tensor_amax(x), x.abs().amax())  # in value: the amax of [-0, 0] may be -0
    assert tensor_amax(torch.tensor([1.0, float("nan"), -5.0])).isnan()
    assert tensor_amax(torch.empty(0)) == 0


@pytest.mark.parametrize("fp8", FP8)
def test_has_nan_reads_every_code_like_the_cast(fp8):
    """Every code, alone or beside the largest finite code of either sign, in any position."""
    values = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    is_nan = values.isnan()
    assert int(is_nan.sum()) == {torch.float8_e4m3fn: 2, torch.float8_e5m2: 6}[fp8]
    largest = (values.abs() == format_max(fp8)).nonzero().flatten().tolist()
    assert len(largest) == 2
    for code in range(256):
        for neighbour in [0, *largest]:
            for where in (0, 7, 12):
                payload = torch.full((13,), neighbour, dtype=torch.uint8)
                payload[where] = code
                assert cast.has_nan(payload.view(fp8)) == bool(is_nan[code]), (code, neighbour, where)
    # A transposed payload and an empty one; infinities (E5M2) are not NaN.
    grid = torch.zeros(6, 4, dtype=torch.uint8)
    grid[5, 0] = 0xFF
    assert cast.has_nan(grid.view(fp8).t()) and not cast.has_nan(grid[:5].view(fp8).t())
    assert not cast.has_nan(torch.empty(0, dtype=fp8))
    if fp8 == torch.float8_e5m2:
        assert not cast.has_nan(torch.tensor([float("inf"), -float("inf")]).to(fp8))


@pytest.mark.parametrize("mu", [1.0, 0.5, 0.75])
def test_gradient_quantization_fast_path_equals_the_counting_path(mu):
    """With μ ≤ 1 and a finite amax nothing can saturate (amax·s ≤ μ·max): the plain cast gives
    quantize_counting's payload (up to the sign of zero, which it drops) and the count is 0."""
    g = torch.randn(300, 70, generator=torch.Generator().manual_seed(2)) * 1e-3
    g[0, :5] = 0.0
    payload, scale, saturated = quantize_gradient(g, mu, torch.float8_e4m3fn)
    reference, count = quantize_counting(g, scale, torch.float8_e4m3fn)
    assert int(saturated) == int(count) == 0
    assert bits_equal(payload.float(), reference.float())
    assert (payload.float().abs() <= format_max(torch.float8_e4m3fn)).all()


def test_gradient_quantization_counts_saturation_when_mu_exceeds_one():
    g = torch.zeros(1000)
    g[:3] = torch.tensor([1.0, 0.9, 0.1])
    # μ = 2: 1.0 and 0.9 scale past 448, 0.1 does not.
    _, _, saturated = quantize_gradient(g, 2.0, torch.float8_e4m3fn)
    assert int(saturated) == 2
    # A non-finite amax gives scale μ and the counting path, even at μ = 1: the finite elements
    # above the FP8 maximum count (they decide whether μ halves on a skipped step).
    g[:3] = torch.tensor([1000.0, 900.0, 0.1])
    g[5] = float("inf")
    payload, scale, saturated = quantize_gradient(g, 1.0, torch.float8_e4m3fn)
    assert scale == 1.0 and int(saturated) == 2
    assert payload[5].float().isnan() and payload[0].float() == 448.0


@pytest.mark.parametrize("fp8", FP8)
def test_dequantize_of_fp8_payloads_is_the_plain_cast_divided(fp8):
    """dequantize widens FP8 by table lookup: the same FP32 values as payload.float() / s."""
    from hf_lowprec.fp8 import dequantize

    payload = torch.arange(256, dtype=torch.uint8).view(fp8)
    scale = torch.tensor(2.0**-5)
    assert bits_equal(bits(dequantize(payload, scale)), bits(payload.float() / scale))
    groups = torch.tensor([2.0**3, 2.0**-7, 1.0, 0.5])
    grouped = dequantize(payload, groups, group_size=64)
    assert bits_equal(bits(grouped), bits((payload.float().view(4, 64) / groups[:, None]).view(-1)))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [2.0**-7, 3.0 * 2.0**5], ids=["pow2", "clipped"])
def test_unscale_into_gives_dequantize_for_every_code(fp8, dtype, scale):
    """O1 writes FP8 gradients back with `unscale_into`: every code (NaN included, compared as
    NaN), a power-of-two scale and one that clipping leaves non-power-of-two, FP32 and BF16
    targets, contiguous (compiled) and transposed (eager fallback): the bits of `dequantize`."""
    from hf_lowprec.fp8.scaled import dequantize

    payload = torch.arange(256, dtype=torch.uint8).repeat(3).view(fp8).view(48, 16)
    scale = torch.tensor(scale)
    expected = dequantize(payload, scale, dtype)
    for target in (torch.empty(48, 16, dtype=dtype), torch.empty(16, 48, dtype=dtype).t()):
        cast.unscale_into(target, payload, scale)
        nan = expected.isnan()
        assert bits_equal(target.isnan(), nan)
        assert bits_equal(bits(target)[~nan], bits(expected)[~nan])  # -0 and +0 told apart
