"""A model prepared by one strategy and handed to another, or to a Trainer with none
(`strategies.prepared`): refused before any work where the first conversion bound FP8 layers or
hooks to it, prepared again (or trained as any model) where it only cast; under an equal strategy
(a second Trainer, the plugin again, another strategy object in a custom loop): left as it is, and
trains as the model prepared once."""

import copy
import io

import pytest
import torch
from transformers import GPT2LMHeadModel

import hf_lowprec
from hf_lowprec import Trainer
from hf_lowprec.data import tiny_gpt2_config
from hf_lowprec.fp8 import FP8Linear
from hf_lowprec.report import SilentPrecisionWarning
from tests.helpers import TokenBlocks, assert_bits_equal, batches, bits_equal, make_args


def tiny(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(
        tiny_gpt2_config(n_embd=64, n_layer=2, pad_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    )


def master_scales(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: m.master_scale.clone() for n, m in model.named_modules() if isinstance(m, FP8Linear)}


@pytest.mark.parametrize("second", ["fp32", "collage-plus", "coat"])
def test_another_strategy_refuses_an_fp8_lm_o2_model(second: str):
    """fp8-lm-o2's FP8Linear layers hold FP16 masters scaled by 2^19: fp32, collage-plus and coat
    trained that payload as a weight, and moved the real weight by lr/2^19 (1.9e-8 after 10 steps at
    lr 1e-3, where a fresh model's moved 9.5e-3). Now refused, naming fp8-lm-o2 and the fix, before
    anything of the model changes."""
    model = hf_lowprec.get_strategy("fp8-lm-o2").prepare_model(tiny())
    scales = master_scales(model)
    assert scales and all(float(s) > 1.0 for s in scales.values())  # the scaled masters the test is about
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"prepared already under precision strategy 'fp8-lm-o2'.*fresh model"):
        hf_lowprec.get_strategy(second).prepare_model(model)
    for name, p in model.named_parameters():
        assert p.dtype == before[name].dtype
        assert_bits_equal(p.detach(), before[name], name)
    for name, s in master_scales(model).items():
        assert_bits_equal(s, scales[name], name)


def test_other_options_and_a_prepared_module_are_refused():
    """The same name with other options converts otherwise (fp16-als's running-mean hooks stay on the
    model); a model holding a module whose conversion bound FP8 layers to it is refused too, naming it."""
    model = hf_lowprec.get_strategy("fp16-als").prepare_model(tiny())
    with pytest.raises(ValueError, match=r"running_mean=True.*running_mean=False"):
        hf_lowprec.get_strategy("fp16-als", running_mean=False).prepare_model(model)
    outer = torch.nn.ModuleDict({"inner": hf_lowprec.get_strategy("fp8-lm-o2").prepare_model(tiny())})
    with pytest.raises(ValueError, match="module 'inner' was prepared already under precision strategy 'fp8-lm-o2'"):
        hf_lowprec.get_strategy("fp32").prepare_model(outer)


def test_a_cast_is_prepared_again_by_any_strategy():
    """fp32, bf16-mixed and the BF16-weight strategies only cast (Collage's residuals stay with its
    optimizer): their model may be prepared again under another strategy or options, as before marks
    existed (a notebook's fp32 run, then bf16-mixed, then fp8-lm-o1), and wrapped in an outer module."""
    model = tiny()
    for name, options in [("fp32", {}), ("bf16-mixed", {}), ("fp8-lm-o1", {})]:
        assert hf_lowprec.get_strategy(name, **options).prepare_model(model) is model
    assert any(isinstance(m, FP8Linear) for m in model.modules())  # fp8-lm-o1 converted it
    bf16 = hf_lowprec.get_strategy("collage-plus").prepare_model(tiny())
    hf_lowprec.get_strategy("collage-plus", seed_compensation=False).prepare_model(bf16)
    outer = torch.nn.ModuleDict({"inner": bf16})
    assert hf_lowprec.get_strategy("fp32").prepare_model(outer) is outer
    assert {p.dtype for p in outer.parameters()} == {torch.float32}


@pytest.mark.parametrize("name", ["fp8-lm-o2", "collage-plus", "fp16-als"])
def test_preparing_again_under_an_equal_strategy_changes_nothing(name: str):
    """Prepared twice, by the same strategy object or by an equal one: fp8-lm-o2's second prepare
    reset every master scale from 2^19 to 1.0 (a final loss of 5.5518 where once gave 5.5505 after
    10 steps), collage-plus lost its seeded residuals. Now the second prepare is a no-op and three
    steps of the second object train bit for bit as the model prepared once."""
    data = batches(3)

    def run(times: int) -> list[torch.Tensor]:
        strategy = hf_lowprec.get_strategy(name)
        model = strategy.prepare_model(tiny())
        if times == 2:
            assert strategy.prepare_model(model) is model  # the same object again (the plugin)
            strategy = hf_lowprec.get_strategy(name)  # an equal one (a second Trainer)
            assert strategy.prepare_model(model) is model
        optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
        for ids in data:
            strategy.train_step(model, ids, optimizer)
        return [p.detach().clone() for p in model.parameters()] + list(master_scales(model).values())

    once, twice = run(1), run(2)
    assert len(once) == len(twice)
    for i, (a, b) in enumerate(zip(once, twice, strict=True)):
        assert_bits_equal(b, a, f"tensor {i}")


def test_a_copied_or_saved_prepared_model():
    """`copy.deepcopy` of a prepared model keeps its mark without the strategy object (the original's
    hooks and scalers are not the copy's): another strategy is refused; `torch.save` of the whole model
    still works, and the same strategy is refused too, its conversion state not saved."""
    model = hf_lowprec.get_strategy("fp8-lm-o2").prepare_model(tiny())
    with pytest.raises(ValueError, match="'fp8-lm-o2'"):
        hf_lowprec.get_strategy("fp32").prepare_model(copy.deepcopy(model))
    with pytest.raises(ValueError, match="copied or pickled"):
        hf_lowprec.get_strategy("fp8-lm-o2").prepare_model(copy.deepcopy(model))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with pytest.raises(ValueError, match="'fp8-lm-o2'"):
        hf_lowprec.get_strategy("bf16-mixed").prepare_model(loaded)
    with pytest.raises(ValueError, match="copied or pickled"):  # its scalers and hooks stayed with the strategy object
        hf_lowprec.get_strategy("fp8-lm-o2").prepare_model(loaded)
    copied = copy.deepcopy(hf_lowprec.get_strategy("collage-plus").prepare_model(tiny()))
    assert hf_lowprec.get_strategy("collage-plus").prepare_model(copied) is copied  # a cast: nothing bound


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _moved(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    """The parameters whose bits changed; every parameter finite (a NaN is not a move)."""
    assert all(torch.isfinite(p).all() for p in model.parameters())
    return [n for n, p in model.named_parameters() if not bits_equal(p.detach(), before[n])]


@pytest.mark.parametrize("first", ["fp8-lm-o2", "fp16-als"])
def test_a_trainer_without_a_strategy_refuses_a_model_whose_conversion_bound_layers_or_hooks(tmp_path, first):
    """A model trained by `hf_lowprec.Trainer(precision_strategy="fp8-lm-o2")`, then handed to a Trainer
    with precision_strategy=None (a notebook's "now the baseline"), trained 3 steps with 8 of its 28
    parameters bit-identical (every FP8 GEMM weight: its gradients went, through fp8-lm-o2's
    post-accumulate-grad hooks, to the first trainer's optimizer), with no error. fp16-als's scaler and
    running-mean hooks stay on its model too (a stock Trainer's third loss with gradient_accumulation_steps=2:
    77.8 with them, 26.8 with them removed from the same model). Now refused in
    __init__, naming the strategy and both fixes, before anything of the model changes; by keyword,
    positionally, and from model_init."""
    trainer = Trainer(model=tiny(), args=make_args(tmp_path / "first", first, max_steps=2), train_dataset=TokenBlocks())
    trainer.train()
    model = trainer.model
    before = _params(model)
    expected = (
        rf"prepared under precision strategy '{first}', and this Trainer has no precision_strategy.*"
        rf"precision_strategy='{first}'.*save_pretrained.*from_pretrained"
    )
    args = make_args(tmp_path / "second", None, max_steps=1)
    with pytest.raises(ValueError, match=expected):
        Trainer(model=model, args=args, train_dataset=TokenBlocks())
    with pytest.raises(ValueError, match=expected):
        Trainer(model, args, train_dataset=TokenBlocks())
    with pytest.raises(ValueError, match=expected):
        Trainer(model_init=lambda: model, args=args, train_dataset=TokenBlocks())
    with pytest.raises(ValueError, match=rf"module 'inner' was prepared under precision strategy '{first}'"):
        Trainer(model=torch.nn.ModuleDict({"inner": model}), args=args)
    assert _moved(model, before) == []


def test_the_refusals_fixes_train_every_parameter(tmp_path):
    """The two ways out the refusal names: the same strategy takes the prepared model over, and a
    save_pretrained / from_pretrained copy is a plain FP32 model (the real weights, master / 2^k:
    exact) that a Trainer without a strategy trains, every one of its 28 parameters moving in a step."""
    trainer = Trainer(
        model=tiny(), args=make_args(tmp_path / "first", "fp8-lm-o2", max_steps=2), train_dataset=TokenBlocks()
    )
    trainer.train()
    real = {
        n: m.weight.detach().float() / m.master_scale.float()
        for n, m in trainer.model.named_modules()
        if isinstance(m, FP8Linear)
    }
    assert len(real) == 8  # (a power-of-two scale: the division is exact)
    trainer.model.save_pretrained(tmp_path / "saved")
    again = Trainer(
        model=trainer.model, args=make_args(tmp_path / "again", "fp8-lm-o2", max_steps=1), train_dataset=TokenBlocks()
    )
    before = _params(again.model)
    again.train()
    assert len(_moved(again.model, before)) == len(before) == 28
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "saved")
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    assert not any(isinstance(m, FP8Linear) for m in loaded.modules())
    for name, weight in real.items():
        assert_bits_equal(loaded.get_submodule(name).weight.detach(), weight, name)
    before = _params(loaded)
    plain = Trainer(model=loaded, args=make_args(tmp_path / "plain", None, max_steps=1), train_dataset=TokenBlocks())
    plain.train()
    assert len(_moved(loaded, before)) == len(before) == 28


def test_a_trainer_without_a_strategy_takes_a_cast_model(tmp_path):
    """A model collage-plus only cast (BF16 weights, nothing bound to it) is a model as any other: a Trainer
    without a strategy takes it (with its SilentPrecisionWarning about BF16 weights under a plain AdamW)."""
    model = hf_lowprec.get_strategy("collage-plus").prepare_model(tiny())
    with pytest.warns(SilentPrecisionWarning, match="bfloat16"):
        Trainer(model=model, args=make_args(tmp_path, None, max_steps=1), train_dataset=TokenBlocks()).train()
