"""`PrecisionPlugin.prepare` refuses an optimizer before it converts any model: a refused prepare
leaves the model as it was, and the corrected retry equals a clean first prepare."""

import pytest
import torch
from accelerate import Accelerator
from transformers import GPT2LMHeadModel

from hf_lowprec import PrecisionPlugin
from hf_lowprec.data import tiny_gpt2_config
from hf_lowprec.fp8 import FP8Linear
from tests.helpers import assert_bits_equal, batches


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


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate's process-wide state reset before and after: the test sets mixed precision in it."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def _steps(accelerator: Accelerator) -> list[torch.Tensor]:
    model = tiny()
    plugin = PrecisionPlugin("collage-plus")
    model, optimizer = plugin.prepare(accelerator, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for ids in batches(2):
        plugin.backward(accelerator, model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_an_earlier_accelerators_mixed_precision_is_refused_with_the_fix_that_works(
    fresh_accelerate_state, monkeypatch
):
    """A stock Accelerator(mixed_precision="bf16") earlier in the process (a notebook's baseline cell):
    a new Accelerator() takes its state, and the refusal advised Accelerator(mixed_precision='no'), which
    Accelerate then refuses. Now it names the earlier Accelerator and the fix that works, and that fix
    (AcceleratorState._reset_state(True) before the Accelerator) trains as a first Accelerator does, bit for bit."""
    from accelerate.state import AcceleratorState

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    first = _steps(Accelerator(cpu=True))
    AcceleratorState._reset_state(True)
    Accelerator(cpu=True, mixed_precision="bf16")
    inherited = Accelerator(cpu=True)
    assert inherited.mixed_precision == "bf16"
    model = tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected = r"mixed_precision='bf16'.*an earlier Accelerator of this process set it.*_reset_state\(True\)"
    with pytest.raises(ValueError, match=expected):
        PrecisionPlugin("collage-plus").prepare(inherited, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32, n
        assert_bits_equal(p.detach(), before[n], n)
    with pytest.raises(ValueError, match="already been initialized"):  # the advice it gave before
        Accelerator(cpu=True, mixed_precision="no")
    AcceleratorState._reset_state(True)
    again = Accelerator(cpu=True)
    assert again.mixed_precision == "no"
    for i, (a, b) in enumerate(zip(_steps(again), first, strict=True)):
        assert_bits_equal(a, b, f"parameter {i}")


def test_a_launched_mixed_precision_is_refused_naming_the_launch(fresh_accelerate_state, monkeypatch):
    """`accelerate launch --mixed_precision bf16` sets ACCELERATE_MIXED_PRECISION: the fix is the launch's."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    model = tiny()
    with pytest.raises(ValueError, match=r"from ACCELERATE_MIXED_PRECISION='bf16': drop --mixed_precision"):
        PrecisionPlugin("collage-plus").prepare(Accelerator(cpu=True), model, torch.optim.AdamW(model.parameters()))
