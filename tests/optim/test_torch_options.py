"""The package's AdamW classes built as torch.optim.AdamW is: torch's defaults (weight_decay=1e-2;
`create_optimizer` keeps TrainingArguments' 0.0), and torch's own arguments taken at the values that
change nothing, refused by name (why, and the fix) at the others, as constructor arguments and as
group keys (`hf_lowprec.optim.torch_options`)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from transformers import TrainingArguments

from hf_lowprec import get_strategy
from hf_lowprec.optim import (
    COATAdamW,
    Collage8bitAdamW,
    CollageAdamW,
    FP8AdamW,
    KahanAdamW,
    MasterWeightAdamW,
    PlainAdamW,
    StochasticRoundingAdamW,
)
from hf_lowprec.strategies.interface import PrecisionStrategy
from tests.helpers import assert_bits_equal, bits_equal

CLASSES = {
    cls.__name__: cls
    for cls in (
        PlainAdamW,
        KahanAdamW,
        MasterWeightAdamW,
        StochasticRoundingAdamW,
        CollageAdamW,
        Collage8bitAdamW,
        FP8AdamW,
        COATAdamW,
    )
}
# (argument, value) pairs that would change what the step does, or ask for what it cannot do, and
# the words of the fix each refusal must give.
REFUSED = {
    "amsgrad": (True, "torch.optim.AdamW(amsgrad=True)"),
    "maximize": (True, "negated objective"),
    "foreach": (True, "drop foreach"),
    "capturable": (True, "drop capturable"),
    "differentiable": (True, "torch.optim.AdamW(differentiable=True)"),
    "decoupled_weight_decay": (False, "torch.optim.Adam"),
    "fused": (True, "fused='auto'"),
}
# torch's defaults (and foreach=False), which change nothing here.
ACCEPTED = dict(amsgrad=False, maximize=False, foreach=False, capturable=False, differentiable=False, fused=None)


def _params() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(256, generator=generator).bfloat16().requires_grad_() for _ in range(2)]


@pytest.mark.parametrize("argument", sorted(REFUSED))
@pytest.mark.parametrize("name", sorted(CLASSES))
def test_a_torch_argument_that_would_change_the_step_is_refused_by_name(name, argument):
    # Before: a generic TypeError ("unexpected argument(s) ['maximize']", or Python's own for the
    # families with their own signatures), and for fused=True one about an unknown mode.
    value, fix = REFUSED[argument]
    with pytest.raises(ValueError, match=rf"{name}: {argument}={value!r} \(an argument of torch.optim.AdamW\)") as e:
        CLASSES[name](_params(), lr=1e-3, **{argument: value})
    assert fix in str(e.value)


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_torchs_default_arguments_are_taken_and_change_nothing(name):
    # Before: TypeError. Now the step equals, bit for bit, the one built without them.
    cls = CLASSES[name]
    assert cls(_params(), lr=1e-3, fused=None).fused == "auto"  # torch's default reads as this package's
    plain, given, initial = _params(), _params(), _params()
    hyper = dict(lr=1e-2, weight_decay=0.1, fused="reference")
    ours = cls(given, **hyper, **{k: v for k, v in ACCEPTED.items() if k != "fused"})
    reference = cls(plain, **hyper)
    assert ours.defaults == reference.defaults  # nothing of torch's is kept as an option
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        for a, b in zip(given, plain):
            b.grad = torch.randn(a.shape, generator=generator).bfloat16()
            a.grad = b.grad.clone()
        ours.step()
        reference.step()
    for a, b, b0 in zip(given, plain, initial):
        assert not bits_equal(b.detach(), b0.detach())  # the steps moved θ
        assert_bits_equal(a.detach(), b.detach(), name)


@pytest.mark.parametrize("argument", sorted(set(REFUSED) - {"fused"}))
def test_a_torch_group_key_that_would_change_the_step_is_refused(argument):
    # Before: the key sat in the group, read by nothing (maximize=True minimized without a word).
    value, fix = REFUSED[argument]
    with pytest.raises(ValueError, match=rf"PlainAdamW: {argument}={value!r}") as e:
        PlainAdamW([{"params": _params(), argument: value}], lr=1e-3)
    assert fix in str(e.value)
    optimizer = PlainAdamW(_params()[:1], lr=1e-3)
    with pytest.raises(ValueError, match=rf"{argument}={value!r}"):
        optimizer.add_param_group({"params": _params()[1:], argument: value})
    assert len(optimizer.param_groups) == 1


def test_torchs_group_keys_at_their_defaults_and_this_packages_fused_mode_are_taken():
    group = {"params": _params(), **ACCEPTED, "decoupled_weight_decay": True}
    PlainAdamW([group], lr=1e-3)
    PlainAdamW([{"params": _params(), "fused": "reference"}], lr=1e-3)
    with pytest.raises(ValueError, match=r"fused=True \(an argument of torch.optim.AdamW\)"):
        PlainAdamW([{"params": _params(), "fused": True}], lr=1e-3)


def test_a_misspelt_argument_is_still_a_type_error_naming_it():
    with pytest.raises(TypeError, match=r"CollageAdamW got unexpected argument\(s\) \['maximise'\]"):
        CollageAdamW(_params(), lr=1e-3, maximise=True)


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_the_defaults_are_torchs(name):
    # weight_decay defaulted to 0.0, where the docstring said "as in torch.optim.AdamW" (1e-2).
    theirs = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).defaults
    ours = CLASSES[name](_params()).defaults
    assert {k: ours[k] for k in ("lr", "betas", "eps", "weight_decay")} == {
        k: tuple(theirs[k]) if k == "betas" else theirs[k] for k in ("lr", "betas", "eps", "weight_decay")
    }


def test_plain_adamw_swapped_in_for_torchs_with_only_lr_given_steps_as_torchs_in_fp64():
    # Before: 3.5e-5 from FP64 after one step, 3.9e-4 after eight (the decay lr·λ·θ left out).
    generator = torch.Generator().manual_seed(2)
    ours = [(torch.rand(64, 16, generator=generator) * 2 - 1).requires_grad_() for _ in range(2)]
    reference = [p.detach().double().requires_grad_() for p in ours]
    runs = (ours, PlainAdamW(ours, lr=1e-2, fused="reference")), (reference, torch.optim.AdamW(reference, lr=1e-2))
    for _ in range(8):
        grads = [torch.randn(p.shape, generator=generator) for p in ours]
        for params, optimizer in runs:
            for p, g in zip(params, grads):
                p.grad = g.to(p.dtype)
            optimizer.step()
    # |m̂/√v̂| ≤ 1.04 over 8 steps at β = (0.9, 0.999) (Cauchy–Schwarz), so |Δθ| ≤ lr·(1.04 + λ·1.3) < 0.011
    # and |θ| < 1 + 8·0.011 < 1.3. Each step rounds θ once to FP32 (≤ 2^-24·1.3) and computes Δθ through
    # about 16 FP32 roundings: 8·2^-24·(1.3 + 16·0.011) ≈ 7e-7, so 1e-6. Without the decay the gap
    # is about 8·lr·λ·|θ| ≈ 8e-4·|θ|.
    error = max((p.double() - r).abs().max().item() for p, r in zip(ours, reference))
    assert error <= 1e-6, error


def test_create_optimizer_keeps_training_arguments_default_weight_decay():
    # The Trainer passes args.weight_decay; a loop calling create_optimizer gets the same 0.0 default.
    trainer_default = next(f.default for f in dataclasses.fields(TrainingArguments) if f.name == "weight_decay")
    signature = inspect.signature(PrecisionStrategy.create_optimizer)
    assert signature.parameters["weight_decay"].default == trainer_default == 0.0
    optimizer = get_strategy("bf16-pure", fused="reference").create_optimizer(_params(), lr=1e-3)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.0]
