"""The compiled fused optimizer steps (`hf_lowprec.optim.kernels`) against the foreach reference.

Where the compiled kernel performs the reference's roundings (every family on CPU), the test is
bit-for-bit equality of parameters and every state tensor: any tolerance would hide a dropped
rounding, which changes an error-free transformation's result by a whole BF16 ulp. Stochastic
rounding uses a different random stream, so it is checked for unbiasedness and bounds.

Compile cost: each kernel compiles once per process (a module-level `torch.compile` with dynamic
shapes), so these tests share graphs; the shapes below differ per test on purpose and must not
trigger a recompile (`test_new_shapes_do_not_recompile`).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from hf_lowprec import get_strategy
from hf_lowprec.optim import (
    COATAdamW,
    CollageAdamW,
    FP32StatesAdamW,
    KahanAdamW,
    PlainAdamW,
    StochasticRoundingAdamW,
    kernels,
)

BF16 = torch.bfloat16
# One tensor above `kernels.PARALLEL_MIN_NUMEL` (the OpenMP build), the rest below it (the
# single-threaded build): both builds are checked against the reference.
SHAPES = [(48, 33), (257,), (7,), (200, 180)]

FAMILIES = {
    "collage-plus": lambda ps, f: CollageAdamW(ps, lr=1e-2, weight_decay=0.1, variant="plus", fused=f),
    "collage-light": lambda ps, f: CollageAdamW(ps, lr=1e-2, weight_decay=0.1, variant="light", fused=f),
    "kahan": lambda ps, f: KahanAdamW(ps, lr=1e-2, weight_decay=0.1, fused=f),
    "plain": lambda ps, f: PlainAdamW(ps, lr=1e-2, weight_decay=0.1, fused=f),
    "fp32-states": lambda ps, f: FP32StatesAdamW(ps, lr=1e-2, weight_decay=0.1, fused=f),
}


def _params(seed: int = 0, shapes=SHAPES) -> list[torch.Tensor]:
    """BF16 parameters with the edges in them: exact zeros, values near zero (|Δθ| > |θ|,
    where Fast2Sum's precondition fails and TwoSum is needed), and large values."""
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=generator).to(BF16) for s in shapes]
    flat = params[0].view(-1)
    flat[:5] = 0.0
    flat[5:40] = (torch.randn(35, generator=generator) * 1e-3).to(BF16)
    flat[40:45] = 3e4
    return [p.requires_grad_() for p in params]


def _grads(step: int, shapes=SHAPES) -> list[torch.Tensor]:
    """Gradients with an all-zero tensor, a zero element, and a finite BF16 g whose g² overflows."""
    generator = torch.Generator().manual_seed(1000 + step)
    grads = [(torch.randn(s, generator=generator) * 1e-2).to(BF16) for s in shapes]
    grads[0].view(-1)[0] = 0.0
    grads[0].view(-1)[1] = 1e30 if step == 2 else 1e-2
    grads[-1].zero_()
    return grads


def _run(make, fused: str, steps: int, params=None, optimizer=None, start: int = 0):
    params = params or _params()
    optimizer = optimizer or make(params, fused)
    for step in range(start, start + steps):
        for p, g in zip(params, _grads(step)):
            p.grad = g
        optimizer.step()
    return params, optimizer


def _assert_same(params_a, opt_a, params_b, opt_b) -> None:
    for index, (a, b) in enumerate(zip(params_a, params_b)):
        assert torch.equal(a, b), f"parameter {index} differs in {(a != b).sum().item()} elements"
        state_a, state_b = opt_a.state[a], opt_b.state[b]
        assert state_a.keys() == state_b.keys()
        for key, value in state_a.items():
            if torch.is_tensor(value):
                assert value.dtype == state_b[key].dtype, key
                assert torch.equal(value, state_b[key]), f"{key} of parameter {index} differs"
            else:
                assert value == state_b[key], key


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_compiled_step_is_bit_identical_to_the_reference(family):
    make = FAMILIES[family]
    compiled = _run(make, "compiled", 4)
    reference = _run(make, "foreach", 4)
    _assert_same(*compiled, *reference)
    assert all(torch.isfinite(p).all() for p in compiled[0]), "a finite gradient made a parameter non-finite"


@pytest.mark.parametrize("family", ["collage-plus", "kahan"])
def test_checkpoints_move_between_paths(family):
    """2 steps on one path, state_dict → fresh optimizer on the other path, 2 more steps =
    4 steps on the reference path, bit for bit, in both directions."""
    make = FAMILIES[family]
    straight = _run(make, "foreach", 4)
    for first, second in (("compiled", "foreach"), ("foreach", "compiled")):
        params, optimizer = _run(make, first, 2)
        saved = optimizer.state_dict()
        resumed = make(params, second)
        resumed.load_state_dict(saved)
        _run(make, second, 2, params=params, optimizer=resumed, start=2)
        _assert_same(params, resumed, *straight)


def test_new_shapes_do_not_recompile():
    """One dynamic-shape graph serves every tensor size: a model of new shapes reuses it."""
    from torch._dynamo.utils import counters

    make = FAMILIES["collage-plus"]
    _run(make, "compiled", 1)
    before = counters["stats"]["unique_graphs"]
    shapes = [(91, 5), (1000,), (3,)]
    params = _params(1, shapes)
    optimizer = make(params, "compiled")
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    assert counters["stats"]["unique_graphs"] == before


def _sr_step(param_value: float, lr: float, numel: int, seed: int) -> torch.Tensor:
    param = torch.full((numel,), param_value, dtype=BF16, requires_grad=True)
    param.grad = torch.ones_like(param)
    StochasticRoundingAdamW([param], lr=lr, eps=0.0, seed=seed, fused="compiled").step()
    return param.detach()


def test_compiled_stochastic_rounding_is_unbiased_and_bounded():
    """θ = 1.5, first step Δθ = −lr exactly (m̂/√v̂ = g/|g| = 1 with ε = 0): the target
    1.5 − 0.3·ulp lies between 1.5 − ulp and 1.5 (ulp = 2^-7). Every element must be one of
    those two, and the mean must be the target: with n = 2^17 Bernoulli(0.3) draws the mean's
    standard deviation is ulp·√(0.21/n) = 0.00127·ulp; we allow 5σ."""
    ulp = 2.0**-7
    lr = 0.3 * ulp
    n = 2**17
    result = _sr_step(1.5, lr, n, seed=0).double()
    assert set(result.unique().tolist()) <= {1.5 - ulp, 1.5}
    target = 1.5 - lr
    sigma = ulp * math.sqrt(0.3 * 0.7 / n)
    assert abs(result.mean().item() - target) <= 5 * sigma
    # Another seed draws another stream; the same seed reproduces it.
    assert not torch.equal(result, _sr_step(1.5, lr, n, seed=1).double())
    assert torch.equal(result, _sr_step(1.5, lr, n, seed=0).double())


def test_compiled_stochastic_rounding_resumes_from_a_checkpoint():
    """The compiled path draws its per-step seeds from the optimizer's generator, whose state is
    checkpointed: save after 2 steps, load into a fresh optimizer, 2 more = 4 straight."""

    def make(ps, fused):
        return StochasticRoundingAdamW(ps, lr=1e-2, weight_decay=0.1, seed=3, fused=fused)

    straight = _run(make, "compiled", 4)
    params, optimizer = _run(make, "compiled", 2)
    resumed = make(params, "compiled")
    resumed.load_state_dict(optimizer.state_dict())
    _run(make, "compiled", 2, params=params, optimizer=resumed, start=2)
    _assert_same(params, resumed, *straight)


def test_compiled_stochastic_rounding_tracks_the_reference_in_distribution():
    """Moments are rounded to nearest on both paths, so they agree bit for bit after one step;
    the parameters differ only by the random draws: each within one BF16 ulp of the other."""
    compiled = _run(lambda ps, f: StochasticRoundingAdamW(ps, lr=1e-2, seed=0, fused=f), "compiled", 1)
    reference = _run(lambda ps, f: StochasticRoundingAdamW(ps, lr=1e-2, seed=0, fused=f), "foreach", 1)
    for a, b in zip(compiled[0], reference[0]):
        state_a, state_b = compiled[1].state[a], reference[1].state[b]
        assert torch.equal(state_a["exp_avg"], state_b["exp_avg"])
        assert torch.equal(state_a["exp_avg_sq"], state_b["exp_avg_sq"])
        ulp = torch.finfo(BF16).eps * torch.maximum(a.detach().abs(), b.detach().abs()).float()
        assert ((a.detach().float() - b.detach().float()).abs() <= ulp).all()


def test_invalid_mode_is_refused_before_any_work():
    with pytest.raises(ValueError, match="fused='fast'.*'auto'"):
        CollageAdamW(_params(), fused="fast")
    with pytest.raises(ValueError, match="fused"):
        get_strategy("collage-plus", fused="yes")


def test_strategy_option_reaches_the_optimizer():
    strategy = get_strategy("collage-light", fused="foreach")
    optimizer = strategy.create_optimizer(_params())
    inner = getattr(optimizer, "optimizer", optimizer)
    assert inner.fused == "foreach"


@pytest.mark.parametrize("options", [{"states": False}, {"states": False, "master_weights": "bf16-collage"}],
                         ids=["fp32-master", "bf16-collage"])  # fmt: skip
def test_coat_passes_the_option_to_its_bf16_and_fp32_steps(options):
    strategy = get_strategy("coat", activations=True, fused="foreach", **options)
    params = [torch.nn.Parameter(torch.zeros(4, dtype=strategy.param_dtype))]
    optimizer = strategy.create_optimizer(params)
    assert getattr(optimizer, "optimizer", optimizer).fused == "foreach"


@pytest.mark.parametrize("name", ["fp8-lm-o1", "fp8-lm-o2", "fp8-lm-o3"])
def test_fp8_lm_passes_the_option_to_its_optimizer(name):
    strategy = get_strategy(name, fused="foreach")
    model = strategy.prepare_model(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.LayerNorm(32)))
    optimizer = strategy.create_optimizer(model.parameters())
    assert getattr(optimizer, "optimizer", optimizer).fused == "foreach"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns: FP8 has no equality kernel, and NaN must equal NaN."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_same_bits(params_a, opt_a, params_b, opt_b) -> None:
    for index, (a, b) in enumerate(zip(params_a, params_b)):
        assert torch.equal(_bits(a.detach()), _bits(b.detach())), f"parameter {index} differs"
        for key, value in opt_a.state[a].items():
            other = opt_b.state[b][key]
            if torch.is_tensor(value):
                assert value.dtype == other.dtype and torch.equal(_bits(value), _bits(other)), f"{key} of {index}"
            else:
                assert value == other, key


# Whole groups of 128 (compiled) beside a padded parameter (the reference, in the same step);
# the first holds an all-zero group and a group with one non-zero gradient (amin = amax).
COAT_SHAPES = [(6, 128), (257,), (200, 128), (3, 256)]


def _coat_run(fused: str, dtype: torch.dtype, steps: int, **options):
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator).to(dtype)) for s in COAT_SHAPES]
    optimizer = COATAdamW(params, lr=1e-2, weight_decay=0.1, fused=fused, **options)
    for step in range(steps):
        for index, p in enumerate(params):
            # Groups over 10 decades (k = 1) and over one (k > 1: the expansion's pow and centre).
            decades = (-8, 2) if index % 2 else (-1, 0)
            spread = torch.logspace(*decades, p.numel())[torch.randperm(p.numel(), generator=generator)]
            p.grad = (torch.randn(p.shape, generator=generator) * spread.view(p.shape)).to(dtype)
        first = params[0].grad.view(-1)
        first[:128] = 0
        first[128:256] = 0
        first[200] = 3e-3
        optimizer.step()
    return params, optimizer


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32-master", "bf16-collage"])
@pytest.mark.parametrize("options", [{}, {"expand": False}, {"exp_avg_sq_format": "e5m2"}],
                         ids=["expand", "plain", "v-e5m2"])  # fmt: skip
def test_compiled_coat_step_is_bit_identical_to_the_reference(dtype, options):
    compiled = _coat_run("compiled", dtype, 3, **options)
    if options.get("expand", True):  # both branches of the expansion ran
        exponents = torch.cat([s["exp_avg_exponent"] for s in compiled[1].state.values()])
        assert (exponents > 1).any() and (exponents == 1).any()
    _assert_same_bits(*compiled, *_coat_run("foreach", dtype, 3, **options))


def test_coat_strategy_runs_the_compiled_step_when_asked():
    strategy = get_strategy("coat", fused="compiled")
    params = [torch.nn.Parameter(torch.randn(2, 128))]
    optimizer = strategy.create_optimizer(params)
    assert getattr(optimizer, "optimizer", optimizer).fused == "compiled"
    params[0].grad = torch.randn(2, 128)
    before = params[0].detach().clone()
    optimizer.step()
    assert not torch.equal(params[0], before)


def test_compiled_step_on_fp32_parameters_is_bit_identical():
    """FP32 parameters keep Δθ's FP32 bits, so a one-ulp difference in √v would show here (the
    eager CPU sqrt is not correctly rounded; the reference uses `numerics.sqrt_rn`)."""

    def fp32_params():
        return [p.detach().float().requires_grad_() for p in _params()]

    def run(fused):
        params = fp32_params()
        optimizer = FAMILIES["plain"](params, fused)
        for step in range(3):
            for p, g in zip(params, _grads(step)):
                p.grad = g.float()
            optimizer.step()
        return params, optimizer

    _assert_same(*run("compiled"), *run("foreach"))


def test_auto_falls_back_once_with_a_log_when_compiling_fails(monkeypatch, caplog):
    def broken(kernel, parallel=True):
        def fail(*args):
            raise RuntimeError("no compiler here")

        return fail

    monkeypatch.setattr(kernels, "_compiled", broken)
    monkeypatch.setattr(kernels, "_broken", set())
    monkeypatch.setattr(kernels, "_logged", set())
    make = FAMILIES["kahan"]
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        fallback = _run(make, "auto", 3)
    assert sum("no compiler here" in r.getMessage() for r in caplog.records) == 1
    _assert_same(*fallback, *_run(make, "foreach", 3))
    with pytest.raises(RuntimeError, match="compiling it failed earlier"):
        _run(make, "compiled", 1)
    kernels._broken.clear()
    with pytest.raises(RuntimeError, match="no compiler here"):
        _run(make, "compiled", 1)


def test_unsupported_device_falls_back_or_refuses(monkeypatch):
    monkeypatch.setattr(kernels, "_compiler_missing", lambda device_type: "no C++ compiler on PATH")
    make = FAMILIES["plain"]
    _assert_same(*_run(make, "auto", 2), *_run(make, "foreach", 2))
    with pytest.raises(RuntimeError, match="fused='compiled' but no C\\+\\+ compiler"):
        _run(make, "compiled", 1)


def _fp8_o2_run(fused: str, steps: int, grad_scale_factor: float = 1.0):
    """FP8AdamW as fp8-lm-o2 drives it: an FP16 master with a per-tensor scale and FP8
    gradients handed over (`set_fp8_grad`), next to an FP32 parameter with FP32 states and a
    plain gradient (the non-FP8 parameters). Includes an all-zero gradient row and step."""
    from hf_lowprec.fp8 import pow2_scale, quantize
    from hf_lowprec.fp8.scaled import set_master_scale
    from hf_lowprec.optim import FP8AdamW

    generator = torch.Generator().manual_seed(0)
    real = torch.randn(40, 33, generator=generator) * 0.05
    master_scale = pow2_scale(real.abs().amax(), torch.float16)
    master = quantize(real, master_scale, torch.float16).requires_grad_()
    set_master_scale(master, master_scale)
    gain = torch.randn(300, generator=generator).requires_grad_()
    optimizer = FP8AdamW(
        [{"params": [master]}, {"params": [gain], "exp_avg_format": "fp32", "exp_avg_sq_format": "fp32"}],
        lr=1e-2, weight_decay=0.1, fused=fused,
    )  # fmt: skip
    for step in range(steps):
        g = torch.randn(master.shape, generator=generator) * 1e-3
        g[0] = 0.0
        scale = pow2_scale(g.abs().amax(), torch.float8_e4m3fn) * grad_scale_factor
        optimizer.set_fp8_grad(master, quantize(g, scale, torch.float8_e4m3fn), scale)
        gain.grad = torch.randn(gain.shape, generator=generator) * 1e-2 * (step != 1)
        optimizer.step()
    return [master, gain], optimizer


@pytest.mark.parametrize("grad_scale_factor", [1.0, 0.7], ids=["pow2", "clipped"])
def test_compiled_fp8_adamw_is_bit_identical_to_the_reference(grad_scale_factor):
    """The kernel multiplies by 1/s for the power-of-two scales of the states and the master
    (exact) but divides by the gradient's scale, which gradient clipping re-encodes with a
    factor that is not a power of two (0.7 here): 1/s would round there."""
    compiled = _fp8_o2_run("compiled", 3, grad_scale_factor)
    reference = _fp8_o2_run("foreach", 3, grad_scale_factor)
    _assert_same(*compiled, *reference)
    from hf_lowprec.fp8.scaled import get_master_scale

    assert torch.equal(get_master_scale(compiled[0][0]), get_master_scale(reference[0][0]))


def test_kernel_first_compiled_on_a_small_tensor_still_runs_in_parallel():
    """Regression: Inductor chose the OpenMP parallel region from the first call's size hint,
    and the dynamic-shape graph then served every size: a model whose first parameter is a
    bias ran its whole optimizer step on one thread. `cpp.dynamic_threads` keeps the region."""
    from torch._inductor.utils import fresh_cache, run_and_get_code

    tensors = [torch.zeros(7, dtype=BF16) for _ in range(4)]
    scalars = kernels._adamw_scalars([1], torch.device("cpu"), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)[0]
    with fresh_cache():
        compiled = torch.compile(kernels.adamw_kernel, dynamic=True, fullgraph=True, options=kernels.COMPILE_OPTIONS)
        _, code = run_and_get_code(compiled, *tensors, scalars)
    assert any("#pragma omp parallel" in c for c in code), "the compiled step has no parallel region"
