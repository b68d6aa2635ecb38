"""The found-inf flag of the optimizer core: `step(found_inf=flag)` decided on the device.

For every family and every path (reference, compiled, native where the family has a kernel):
a step given a nonzero flag leaves θ and every state tensor bit for bit as they were and does
not advance the step count; a zero flag steps exactly as no flag does (the device-side FP64
scalars equal the host's); a run with a skipped step in the middle continues as if the step had
never been asked for, also through a checkpoint saved after the skip. Stochastic rounding is the
documented exception there: a skipped step still draws its seeds, so it is compared against a
run that consumed the same draws (its resume is still checked bit for bit).

Off the CPU, a step of each family makes no copy from the host to the device and no host sync
(`aten._local_scalar_dense`): the dispatch mode below counts them (on the meta device: see there).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_lowprec import optim
from hf_lowprec.optim import native

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
# Sizes: element-wise tails, and more than one 256-element block (8-bit) or 128-group (COAT).
SIZES = (7, 300, 1025)

# family: (dtype of θ, optimizer factory)
FAMILIES = {
    "bf16-pure": (BF16, lambda ps, **kw: optim.PlainAdamW(ps, **kw)),
    "fp16-pure": (FP16, lambda ps, **kw: optim.PlainAdamW(ps, **kw)),
    "fp32": (FP32, lambda ps, **kw: optim.PlainAdamW(ps, **kw)),
    "fp32-states": (BF16, lambda ps, **kw: optim.FP32StatesAdamW(ps, **kw)),
    "kahan": (BF16, lambda ps, **kw: optim.KahanAdamW(ps, **kw)),
    "stochastic-rounding": (BF16, lambda ps, **kw: optim.StochasticRoundingAdamW(ps, seed=5, **kw)),
    "collage-light": (BF16, lambda ps, **kw: optim.CollageAdamW(ps, variant="light", **kw)),
    "collage-plus": (BF16, lambda ps, **kw: optim.CollageAdamW(ps, variant="plus", **kw)),
    "master-weights": (FP16, lambda ps, **kw: optim.MasterWeightAdamW(ps, **kw)),
    "collage-8bit": (BF16, lambda ps, **kw: optim.Collage8bitAdamW(ps, **kw)),
    "fp8-adamw": (FP32, lambda ps, **kw: optim.FP8AdamW(ps, **kw)),
    "coat-fp32": (FP32, lambda ps, **kw: optim.COATAdamW(ps, **kw)),
    "coat-bf16": (BF16, lambda ps, **kw: optim.COATAdamW(ps, **kw)),
}
PATHS = ["reference", "compiled", "native"]


def _params(dtype: torch.dtype, device: str = "cpu") -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=generator) for n in SIZES]
    return [p.to(device=device, dtype=dtype).requires_grad_() for p in params]


def _grads(step: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(p.shape, generator=generator) * 1e-2).to(p.dtype) for p in params]


def _optimizer(family: str, path: str):
    dtype, make = FAMILIES[family]
    params = _params(dtype)
    optimizer = make(params, fused=path, **HYPER)
    return params, optimizer


def _supported(family: str, path: str) -> None:
    if path == "native":
        assert native.native_unavailable() is None, native.native_unavailable()
    if path == "native" and family == "fp16-pure":
        pytest.skip("no native kernel for FP16 θ with a scaled FP16 v (the dispatch raises for fused='native')")


def _run(optimizer, params, step: int, flag: float | None) -> None:
    for p, g in zip(params, _grads(step, params)):
        p.grad = g
    found_inf = None if flag is None else torch.tensor(flag)
    optimizer.step(found_inf=found_inf)


def _snapshot(optimizer, params) -> list:
    """Every parameter and state value (tensors cloned), in a fixed order."""
    out = []
    for p in params:
        out.append(("param", p.detach().clone()))
        for key, value in sorted(optimizer.state[p].items()):
            out.append((key, value.clone() if torch.is_tensor(value) else value))
    return out


def _assert_same(actual: list, expected: list) -> None:
    assert [k for k, _ in actual] == [k for k, _ in expected]
    for (key, a), (_, e) in zip(actual, expected):
        if key == "step":
            assert float(a) == float(e), f"step {a} != {e}"
        else:
            assert a.dtype == e.dtype and a.shape == e.shape, key
            # Bit for bit, NaN payloads included.
            assert torch.equal(a.reshape(-1).view(torch.uint8), e.reshape(-1).view(torch.uint8)), f"{key} differs"


@pytest.mark.compiles_step
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_flagged_step_changes_nothing_and_a_clear_flag_steps_as_none(family, path):
    _supported(family, path)
    params, optimizer = _optimizer(family, path)
    plain_params, plain = _optimizer(family, path)
    for step in range(2):
        _run(optimizer, params, step, 0.0)  # a clear flag: device-side step counts and scalars
        _run(plain, plain_params, step, None)  # no flag: host counts and scalars, as before
    _assert_same(_snapshot(optimizer, params), _snapshot(plain, plain_params))
    before = _snapshot(optimizer, params)
    for flag in (1.0, float("inf"), float("nan")):
        _run(optimizer, params, 2, flag)
        _assert_same(_snapshot(optimizer, params), before)
    assert sum(optimizer.paths_taken.values()) == 5 * len(params)
    assert set(optimizer.paths_taken) == {path}


@pytest.mark.compiles_step
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_skipped_step_then_resume_continues_bit_for_bit(family, path):
    """Steps 0, 1, (2 skipped), checkpoint, 3, 4 in a fresh optimizer == steps 0, 1, 3, 4 (for
    stochastic rounding: a run that drew one more set of seeds at step 2)."""
    _supported(family, path)
    params, optimizer = _optimizer(family, path)
    _run(optimizer, params, 0, None)  # a host step count first: the flag turns it into a tensor
    _run(optimizer, params, 1, 0.0)
    _run(optimizer, params, 2, 1.0)
    saved = copy.deepcopy(optimizer.state_dict())
    saved_params = [p.detach().clone() for p in params]

    expected_params, expected = _optimizer(family, path)
    for step in (0, 1):
        _run(expected, expected_params, step, None)
    if optimizer.composition(params[0], optimizer.param_groups[0]).rule.needs_seed:
        expected._generator(torch.device("cpu")).set_state(optimizer._generator(torch.device("cpu")).get_state())

    resumed_params, resumed = _optimizer(family, path)
    with torch.no_grad():
        for p, value in zip(resumed_params, saved_params):
            p.copy_(value)
    resumed.load_state_dict(saved)
    for step in (3, 4):
        _run(optimizer, params, step, 0.0)
        _run(resumed, resumed_params, step, 0.0)
        _run(expected, expected_params, step, None)
    _assert_same(_snapshot(resumed, resumed_params), _snapshot(optimizer, params))
    _assert_same(_snapshot(expected, expected_params), _snapshot(optimizer, params))
    assert all(float(optimizer.state[p]["step"]) == 4 for p in params)


def test_a_bad_flag_is_refused_before_any_work():
    params, optimizer = _optimizer("bf16-pure", "reference")
    for p, g in zip(params, _grads(0, params)):
        p.grad = g
    before = _snapshot(optimizer, params)
    for bad in (1.0, torch.zeros(2), torch.zeros((), dtype=torch.int64)):
        with pytest.raises(TypeError, match="found_inf must be a 0-dim floating tensor"):
            optimizer.step(found_inf=bad)
    _assert_same(_snapshot(optimizer, params), before)


# --- no host→device copy, no host sync, off the CPU ---------------------------------------------
# The device is "meta": a device without host-visible data, as CUDA is. FakeTensorMode CUDA
# tensors would be closer, but this CPU-only torch cannot `copy_` them (a CUDA device guard is
# entered before the fake mode sees the op); the optimizer's code branches on `device.type ==
# "cpu"` only, so meta runs the CUDA code. Reading a meta value raises: a sync cannot hide.


class _HostTraffic(TorchDispatchMode):
    """Counts copies from the host to the device, and host syncs (reading a device value)."""

    def __init__(self):
        super().__init__()
        self.copies: list[str] = []
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            self.syncs.append(name)
        elif func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            source = args[1] if func is torch.ops.aten.copy_.default else args[0]
            target = args[0].device if func is torch.ops.aten.copy_.default else kwargs.get("device")
            target = source.device if target is None else torch.device(target)
            if source.device.type == "cpu" and target.type != "cpu":
                self.copies.append(f"{name} {tuple(source.shape)}")
        return func(*args, **kwargs)


@pytest.mark.parametrize("flagged", [False, True], ids=["no-flag", "flag"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_device_step_makes_no_host_copy_and_no_sync(family, flagged):
    dtype, make = FAMILIES[family]
    device = torch.device("meta")
    params = [torch.zeros(n, dtype=dtype, device=device, requires_grad=True) for n in SIZES]
    optimizer = make(params, fused="reference", **HYPER)
    if optimizer.composition(params[0], optimizer.param_groups[0]).rule.needs_seed:
        optimizer._generators[str(device)] = _DeviceGenerator()  # no generator on meta: fresh draws stand in
    found_inf = torch.zeros((), device=device) if flagged else None
    for _ in range(2):  # the first step creates the state and the format constants
        for p in params:
            p.grad = torch.zeros(p.shape, dtype=dtype, device=device)
        traffic = _HostTraffic()
        with traffic:
            optimizer.step(found_inf=found_inf)
    assert optimizer.paths_taken["reference"] == 2 * len(params)
    assert traffic.copies == [], f"host-to-device copies in a step: {traffic.copies}"
    assert traffic.syncs == [], f"host syncs in a step: {traffic.syncs}"


class _DeviceGenerator:
    device = torch.device("meta")


@pytest.fixture(autouse=True)
def _randint_without_device_generator(monkeypatch):
    original = torch.randint

    def randint(*args, generator=None, **kwargs):
        return original(*args, generator=None if isinstance(generator, _DeviceGenerator) else generator, **kwargs)

    monkeypatch.setattr(torch, "randint", randint)
