"""Parameters written outside the optimizer's step (a `load_state_dict`, weight clipping, a re-init).

FP32 AdamW continues from whatever the weight holds. The families whose state completes the
parameter (δθ of Collage, Kahan's k, the FP32 master) must too: a written parameter restarts that
state (compensation zero, master at the weight) before the next step or export, on every path
(reference, compiled, native). In normal training, after a skipped step and after a resume in
either order, nothing restarts, so the run keeps its bits.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_lowprec import optim
from hf_lowprec.optim import native
from hf_lowprec.optim.rules import Master, Rule
from tests.helpers import assert_bits_equal

BF16, FP16 = torch.bfloat16, torch.float16
HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
SIZES = (7, 300)  # an element-wise tail, and more than one 256-element block (8-bit)

# family: (dtype of θ, optimizer factory, the state key restarted and its restart value)
FAMILIES = {
    "master-weights": (FP16, lambda ps, **kw: optim.MasterWeightAdamW(ps, **kw), "master"),
    "collage-light": (BF16, lambda ps, **kw: optim.CollageAdamW(ps, variant="light", **kw), "param_error"),
    "collage-plus": (BF16, lambda ps, **kw: optim.CollageAdamW(ps, variant="plus", **kw), "param_error"),
    "kahan": (BF16, lambda ps, **kw: optim.KahanAdamW(ps, **kw), "compensation"),
    "collage-8bit": (BF16, lambda ps, **kw: optim.Collage8bitAdamW(ps, **kw), "param_error"),
}
PATHS = ["reference", "compiled", "native"]


def _trained(family: str, path: str, steps: int = 3):
    """Parameters of the family's dtype and its optimizer after `steps` steps (found-inf flags clear)."""
    if path == "native":
        assert native.native_unavailable() is None, native.native_unavailable()
    dtype, make, _ = FAMILIES[family]
    generator = torch.Generator().manual_seed(0)
    params = [(torch.randn(n, generator=generator) * 0.1).to(dtype).requires_grad_() for n in SIZES]
    optimizer = make(params, fused=path, **HYPER)
    for step in range(steps):
        _step(optimizer, params, step)
    return params, optimizer


def _step(optimizer, params, step: int, found_inf: float | None = 0.0) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=generator) * 1e-2).to(p.dtype)
    optimizer.step(found_inf=None if found_inf is None else torch.tensor(found_inf))


def _written(params) -> list[torch.Tensor]:
    """Other weights of the same shapes (a load), some elements ±1 (LayerNorm-like: exact in BF16 and FP16)."""
    generator = torch.Generator().manual_seed(7)
    values = [(torch.rand(p.shape, generator=generator) - 0.5).to(p.dtype) for p in params]
    for value in values:
        value[:3] = torch.tensor([1.0, -1.0, 1.0])
    return values


def _write(params, values) -> None:
    with torch.no_grad():
        for p, value in zip(params, values):
            p.copy_(value)  # what `Module.load_state_dict` does


def _assert_same_run(optimizer, params, expected, expected_params) -> None:
    """θ and every state tensor bit for bit those of `expected` (the step counts aside)."""
    for p, e in zip(params, expected_params):
        assert_bits_equal(p.detach(), e.detach(), "θ")
        for name, value in expected.state[e].items():
            if torch.is_tensor(value) and name != "step":
                assert_bits_equal(optimizer.state[p][name], value, name)


@pytest.mark.compiles_step
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_next_step_starts_from_a_written_parameter(family: str, path: str) -> None:
    params, optimizer = _trained(family, path)
    if family != "master-weights":  # a compensation to restart (the master differs from any write)
        assert all(bool(optimizer.state[p][FAMILIES[family][2]].ne(0).any()) for p in params)
    values = _written(params)
    _write(params, values)
    # Right after the write the optimizer holds the written weights (what a full-precision save
    # exports): before the fix, the old masters (|old − written| up to 0.6 here) or θ + the old δθ.
    for p, value in zip(params, values):
        assert_bits_equal(optimizer.full_precision_value(p), value.float(), "exported")
    # A step with lr = 0 (Δθ = ±0): FP32 AdamW keeps the written weights exactly; so must θ and the
    # held value (before the fix the master rule wrote the old weights back into θ).
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    _step(optimizer, params, 3)
    for p, value in zip(params, values):
        assert_bits_equal(p.detach(), value, "θ after the step")
        assert torch.equal(optimizer.held_value(p), value.double())
    assert set(optimizer.paths_taken) == {path}


@pytest.mark.compiles_step
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_written_parameter_steps_as_its_restarted_state(family: str, path: str) -> None:
    """With lr > 0: bit for bit the step of an optimizer handed the same moments and the restarted
    state (compensation 0, master = the weight), as stock AdamW keeps m and v over a load."""
    params, optimizer = _trained(family, path)
    values = _written(params)
    _write(params, values)
    key = FAMILIES[family][2]
    expected_params = [v.clone().requires_grad_() for v in values]
    expected = FAMILIES[family][1](expected_params, fused=path, **HYPER)
    for p, e in zip(params, expected_params):
        state = copy.deepcopy(optimizer.state[p])
        state[key] = e.detach().float() if key == "master" else torch.zeros_like(state[key])
        expected.state[e] = state
    for step in (3, 4):
        _step(optimizer, params, step)
        _step(expected, expected_params, step)
    _assert_same_run(optimizer, params, expected, expected_params)


@pytest.fixture
def no_restart(monkeypatch):
    """Every restart raises: what runs without one keeps the bits it had before restarts existed."""

    def refuse(self, param, state):
        raise AssertionError(f"{type(self).__name__}.restart_ ran in normal training")

    for rule in (Rule, Master):
        monkeypatch.setattr(rule, "restart_", refuse)


@pytest.mark.compiles_step
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_normal_training_never_restarts(family: str, path: str, no_restart) -> None:
    # Steps, a skipped step (found_inf set: θ written back as it was), exports between steps and
    # a step without a flag: the optimizer's own writes, on every path, are recognised as its own.
    params, optimizer = _trained(family, path, steps=2)
    optimizer.track_updates = True  # the lost-arithmetic records read the held values after the step
    _step(optimizer, params, 2, found_inf=1.0)
    for p in params:
        optimizer.full_precision_value(p)
    _step(optimizer, params, 3, found_inf=None)
    _step(optimizer, params, 4)
    assert sum(optimizer.paths_taken.values()) == 5 * len(params)


@pytest.mark.parametrize("model_first", [True, False])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_resume_keeps_the_state_whichever_it_loads_first(family: str, model_first: bool, no_restart) -> None:
    # A resume writes the weights and loads the state that completes them: in either order the
    # next steps continue bit for bit (`load_state_dict` takes the weights as the state's).
    params, optimizer = _trained(family, "reference")
    saved_state = copy.deepcopy(optimizer.state_dict())
    saved = [p.detach().clone() for p in params]
    for step in (3, 4):
        _step(optimizer, params, step)

    resumed_params, resumed = _trained(family, "reference", steps=1)  # other weights and state
    if model_first:
        _write(resumed_params, saved)
    resumed.load_state_dict(saved_state)
    if not model_first:
        _write(resumed_params, saved)
    resumed.watch_parameter_values()  # both loaded (what the Trainer calls): nothing counts as written
    for step in (3, 4):
        _step(resumed, resumed_params, step)
    _assert_same_run(resumed, resumed_params, optimizer, params)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_write_after_a_state_round_trip_or_a_watched_resume_is_seen(family: str) -> None:
    # Accelerate loads `state_dict()` back as it wraps the optimizer, and the Trainer watches the
    # weights once a resume loaded model and state: before the fix either left the record empty, so
    # a write before the next step was undone (the old masters or θ + the old δθ came back).
    for watched in (False, True):
        params, optimizer = _trained(family, "reference")
        if watched:
            optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
            optimizer.watch_parameter_values()
        else:
            optimizer.load_state_dict(optimizer.state_dict())
        values = _written(params)
        with torch.no_grad():
            for p, value in zip(params, values):
                p.data = value.clone()  # a `.data` assignment keeps the version counter
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        _step(optimizer, params, 3)
        for p, value in zip(params, values):
            assert_bits_equal(p.detach(), value, f"θ after the step (watched={watched})")
            assert torch.equal(optimizer.held_value(p), value.double())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_load_of_its_own_state_as_copies_keeps_the_record(family: str) -> None:
    # Accelerate moves `state_dict()` to its device before loading it back: on a CPU run under FSDP2
    # `tensor.to("cpu:0")` copies. Copies with the state's bits, none of it written since, restore
    # nothing: before the fix they cleared the record and the write below was undone.
    params, optimizer = _trained(family, "reference")
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    values = _written(params)
    _write(params, values)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    _step(optimizer, params, 3)
    for p, value in zip(params, values):
        assert_bits_equal(p.detach(), value, "θ after the step")
        assert torch.equal(optimizer.held_value(p), value.double())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_checkpoint_loaded_into_its_own_state_in_place_resumes_bit_for_bit(family: str, no_restart) -> None:
    # torch.distributed.checkpoint (`load_sharded`) writes the weights and the tensors of
    # `state_dict()` in place, then loads that dict: the optimizer's own tensors, but a checkpoint's
    # values. Before the fix that load kept the record of the weights before the resume, so the
    # loaded weights counted as written and their masters/δθ restarted (not bit for bit).
    params, optimizer = _trained(family, "reference")
    saved_state = copy.deepcopy(optimizer.state_dict())
    saved = [p.detach().clone() for p in params]
    for step in (3, 4):
        _step(optimizer, params, step)

    resumed_params, resumed = _trained(family, "reference", steps=1)
    target = resumed.state_dict()
    _write(resumed_params, saved)
    with torch.no_grad():
        for index, state in target["state"].items():
            for key, value in state.items():
                if torch.is_tensor(value):
                    value.copy_(saved_state["state"][index][key])
    resumed.load_state_dict(target)
    for step in (3, 4):
        _step(resumed, resumed_params, step)
    _assert_same_run(resumed, resumed_params, optimizer, params)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_save_then_resume_in_one_process_continues_bit_for_bit(family: str, no_restart) -> None:
    # A custom loop saves (`state_dict()`, as `accelerator.save_state`) and, with no step between,
    # resumes from that checkpoint in the same process: the weights first, then the state read back
    # (bits equal to what `state_dict()` handed out). Before the fix that load counted as the
    # optimizer's own state, so the weights loaded first counted as written and their masters/δθ
    # restarted (collage-plus 7.8e-3 off the uninterrupted run after three steps).
    params, optimizer = _trained(family, "reference")
    reference_params, reference = _trained(family, "reference")
    saved_state = copy.deepcopy(optimizer.state_dict())  # what a checkpoint file gives back
    _write(params, [p.detach().clone() for p in params])  # the model's weights loaded first
    optimizer.load_state_dict(saved_state)
    for step in (3, 4):
        _step(optimizer, params, step)
        _step(reference, reference_params, step)
    _assert_same_run(optimizer, params, reference, reference_params)
