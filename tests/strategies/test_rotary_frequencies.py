"""A strategy's 16-bit model keeps in FP32 the buffers transformers keeps in FP32 when it loads a model
in 16 bits, its rotary frequencies above all (`strategies.casting`): a prepared Llama computes what
`from_pretrained(dtype=...)` computes, and its cos/sin are within a derived bound of FP64's."""

import functools
import math
import tempfile

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_lowprec import available_strategies, get_strategy
from hf_lowprec.strategies.casting import cast_model
from hf_lowprec.testing.llama import llama_config
from hf_lowprec.testing.moe import tiny_moe
from tests.helpers import UNIT_ROUNDOFF, assert_bits_equal

POSITIONS = 512  # far enough for a 16-bit frequency to turn an angle by tenths of a radian


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(llama_config(vocab=256, hidden=64, layers=1, positions=POSITIONS))


def _model(arch: str) -> torch.nn.Module:
    return _llama() if arch == "llama" else tiny_moe(arch)


@functools.cache
def _kept_by_transformers(arch: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The buffers transformers keeps in FP32 when it loads `arch` in `dtype`, with their values."""
    with tempfile.TemporaryDirectory() as stored:
        _model(arch).save_pretrained(stored)
        loaded = AutoModelForCausalLM.from_pretrained(stored, dtype=dtype)
    return {name: b for name, b in loaded.named_buffers() if b.dtype == torch.float32}


@pytest.mark.parametrize("name", available_strategies())
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "deepseek_v3"])
def test_every_strategy_keeps_the_buffers_transformers_keeps_in_fp32(name, arch):
    """The rotary frequencies (every architecture) and DeepSeek-V3's router bias
    (`_keep_in_fp32_modules_strict`) stay FP32, with the values transformers loads."""
    strategy = get_strategy(name)
    dtype = strategy.param_dtype if strategy.param_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    kept = _kept_by_transformers(arch, dtype)
    assert any("rotary" in key for key in kept) and (arch != "deepseek_v3" or any("e_score" in k for k in kept))
    buffers = dict(strategy.prepare_model(_model(arch)).named_buffers())
    for key, value in kept.items():
        assert buffers[key].dtype == torch.float32, (name, key, buffers[key].dtype)
        assert_bits_equal(buffers[key], value, f"{name}: {key}")


def test_a_complex_rotary_buffer_stays_complex():
    """Llama 4's vision rotary embedding holds complex frequencies; `Module.to(torch.bfloat16)`
    would drop their imaginary parts."""

    class VisionRotaryEmbedding(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("freqs_ci", torch.polar(torch.ones(8), torch.linspace(0, 3, 8)))
            self.register_buffer("unused", None)
            self.proj = torch.nn.Linear(4, 4)

    model = torch.nn.Sequential(VisionRotaryEmbedding())
    before = model[0].freqs_ci.clone()
    cast_model(model, torch.bfloat16)
    assert model[0].proj.weight.dtype == torch.bfloat16 and model[0].freqs_ci.dtype == torch.complex64
    assert torch.equal(model[0].freqs_ci, before)


@pytest.mark.parametrize(("name", "dtype"), [("bf16-pure", torch.bfloat16), ("fp16-als", torch.float16)])
def test_the_prepared_model_computes_what_transformers_loaded_in_16_bits_computes(tmp_path, name, dtype):
    _llama().save_pretrained(tmp_path)
    ours = get_strategy(name).prepare_model(AutoModelForCausalLM.from_pretrained(tmp_path))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype)
    ids = torch.randint(0, 256, (1, POSITIONS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_bits_equal(ours(ids).logits, loaded(ids).logits, name)


@pytest.mark.parametrize(("name", "dtype"), [("bf16-pure", torch.bfloat16), ("fp16-als", torch.float16)])
def test_cos_and_sin_are_within_rounding_of_fp64(name, dtype):
    """Bound: the 16-bit output rounds once, |r(c) − c| ≤ u₁₆·|c|; before it, the angle p·f carries
    FP32's error, at most (4 + 1)·2⁻²⁴·p·f from the frequency (a power and a division, transformers'
    formula) and the product, which moves cos and sin by no more than the angle moves, plus FP32's
    own cos/sin (2⁻²³). A frequency stored in 16 bits moves p·f by up to p·f·u₁₆ (more where FP16
    holds it as a subnormal): 0.09 rad at position 511 for f = 10000^(−1/8) in BF16, far outside
    the bound."""
    model = get_strategy(name).prepare_model(_llama())
    rotary = model.model.rotary_emb
    positions = torch.arange(POSITIONS)[None]
    x = torch.zeros(1, POSITIONS, 64, dtype=dtype)
    with torch.no_grad():
        cos, sin = rotary(x, positions)
    config = model.config
    dim = config.hidden_size // config.num_attention_heads
    theta = config.rope_parameters["rope_theta"]
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions[0, :, None].double() * torch.cat([freqs, freqs])[None]
    u16, u32 = UNIT_ROUNDOFF[dtype], UNIT_ROUNDOFF[torch.float32]
    angle_error = 5 * u32 * angles + 2 * u32
    for got, exact in ((cos[0], angles.cos()), (sin[0], angles.sin())):
        bound = u16 * exact.abs() + (1 + u16) * angle_error
        excess = (got.double() - exact).abs() - bound
        assert excess.max() <= 0, (name, excess.max().item(), math.prod(excess.shape))
