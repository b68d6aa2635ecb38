"""`PrecisionPlugin.prepare` refuses an optimizer before it converts any model: a refused prepare
leaves the model as it was, and the corrected retry equals a clean first prepare."""

import pytest
import torch
from accelerate import Accelerator
from transformers import GPT2LMHeadModel

from hf_lowprec import PrecisionPlugin
from hf_lowprec.data import tiny_gpt2_config
from hf_lowprec.fp8 import FP8Linear
from tests.helpers import assert_bits_equal


def tiny() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(tiny_gpt2_config(n_embd=64, n_layer=2, pad_token_id=None))


REFUSED = {
    "SGD": lambda params: torch.optim.SGD(params, lr=1e-3),
    "amsgrad": lambda params: torch.optim.AdamW(params, lr=1e-3, amsgrad=True),
    "L2": lambda params: torch.optim.Adam(params, lr=1e-3, weight_decay=0.1),
}


@pytest.mark.parametrize("name", ["collage-plus", "fp8-lm-o2"])
@pytest.mark.parametrize("refused", sorted(REFUSED))
def test_a_refused_optimizer_leaves_the_model_stock(name: str, refused: str):
    """The refusals came after the conversion: the model held BF16 weights (collage-plus) or FP8Linear
    layers (fp8-lm-o2) after the error, and the retry with AdamW started collage-plus from the rounded
    weights without its seeded residual (max |θ+δθ - FP32 init| 2.44e-4 where a clean prepare holds
    4.69e-7). Now the model is untouched, and the retry's weights and optimizer state equal a clean
    first prepare's bit for bit (the same conversion of the same FP32 weights)."""
    accelerator = Accelerator(cpu=True)
    model = tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises((TypeError, ValueError)):
        PrecisionPlugin(name).prepare(accelerator, model, REFUSED[refused](model.parameters()))
    assert not any(isinstance(m, FP8Linear) for m in model.modules())
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32, n
        assert_bits_equal(p.detach(), before[n], n)

    plugin = PrecisionPlugin(name)
    retried, optimizer = plugin.prepare(accelerator, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    clean_plugin = PrecisionPlugin(name)
    fresh = tiny()
    clean, clean_optimizer = clean_plugin.prepare(accelerator, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3))
    ours = plugin.strategy.full_precision_state_dict(retried, optimizer)
    theirs = clean_plugin.strategy.full_precision_state_dict(clean, clean_optimizer)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert_bits_equal(ours[key], theirs[key], key)
