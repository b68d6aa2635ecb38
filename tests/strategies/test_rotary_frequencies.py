"""A strategy's 16-bit model keeps its rotary frequencies in FP32, as transformers keeps them when it
loads a model in 16 bits (`strategies.casting`): the prepared model computes what
`from_pretrained(dtype=...)` computes, and its cos/sin are within a derived bound of FP64's."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_lowprec import available_strategies, get_strategy
from hf_lowprec.testing.llama import llama_config
from hf_lowprec.testing.moe import tiny_moe
from tests.helpers import UNIT_ROUNDOFF, assert_bits_equal

POSITIONS = 512  # far enough for a 16-bit frequency to turn an angle by tenths of a radian


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(llama_config(vocab=256, hidden=64, layers=1, positions=POSITIONS))


def _rotary_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: b for name, b in model.named_buffers() if "rotary" in name and b.is_floating_point()}


@pytest.mark.parametrize("name", available_strategies())
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_every_strategy_keeps_the_rotary_frequencies_as_they_were(name, arch):
    model = _llama() if arch == "llama" else tiny_moe(arch)
    before = {key: b.clone() for key, b in _rotary_buffers(model).items()}
    assert before, "the model has rotary frequencies to keep"
    prepared = get_strategy(name).prepare_model(model)
    after = _rotary_buffers(prepared)
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert after[key].dtype == torch.float32, (name, key, after[key].dtype)
        assert_bits_equal(after[key], value, f"{name}: {key}")


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
    own cos/sin (2⁻²³). A frequency stored in 16 bits moves p·f by up to p·f·u₁₆: 0.09 rad at
    position 511 for f = 10000^(−1/8), far outside the bound."""
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
