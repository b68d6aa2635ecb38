"""The compiled optimizer step (`hf_lowprec.optim.dispatch`) against the eager reference.

On CPU the compiled step performs exactly the reference's roundings, so the test for every
family is bit-for-bit equality of the parameters and of every state tensor (compared as bit
patterns: FP8 and uint8 payloads, NaN equal to NaN). Any tolerance would hide a dropped
rounding, which moves an error-free transformation's result by a whole ulp. Stochastic
rounding draws its bits from a counter hash seeded by the optimizer's generator, so it is
bit-identical too. Each run asserts from `paths_taken` that the path it names really ran:
a comparison of the reference with itself cannot fail.

Every family steps the same kinds of tensors: one with exact zeros, values near zero (where
|Δθ| > |θ| and TwoSum, not Fast2Sum, is needed) and large values; sizes that are not a
multiple of any block (staged on zero-padded copies); a non-contiguous parameter with a
non-contiguous gradient (staged too); an all-zero gradient; and a finite gradient whose
square overflows FP32 (BF16/FP32) or FP16.

Compile cost: one graph per composition (and per threading build) for the whole process,
with dynamic shapes, so these tests share graphs; new shapes must not recompile
(`test_new_shapes_do_not_recompile`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch

from hf_lowprec import available_strategies, get_strategy
from hf_lowprec.optim import (
    COATAdamW,
    Collage8bitAdamW,
    CollageAdamW,
    Composition,
    FP8AdamW,
    FP32StatesAdamW,
    FP32StatesSRAdamW,
    KahanAdamW,
    MasterWeightAdamW,
    PlainAdamW,
    StochasticRoundingAdamW,
    dispatch,
)
from hf_lowprec.optim.formats import Blockwise8bit, Plain
from hf_lowprec.optim.rules import Nearest
from tests.helpers import tiny_gpt2

pytestmark = pytest.mark.compiles_step

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
HYPER = dict(lr=1e-2, weight_decay=0.1)
# Below `dispatch.PARALLEL_MIN_NUMEL`: the single-threaded build; the non-contiguous one last.
SHAPES = [(48, 33), (257,), (7,)]
NONCONTIGUOUS = (33, 48)  # stored transposed: a (48, 33) view with strides (1, 48)
# Above it: the OpenMP build, checked for a few families (same arithmetic, other loop).
LARGE = (200, 180)

Factory = Callable[[list[torch.Tensor], str], torch.optim.Optimizer]

FAMILIES: dict[str, tuple[torch.dtype, Factory]] = {
    "plain-bf16": (BF16, lambda ps, f: PlainAdamW(ps, **HYPER, fused=f)),
    "plain-fp32": (F32, lambda ps, f: PlainAdamW(ps, **HYPER, fused=f)),
    "plain-fp16": (F16, lambda ps, f: PlainAdamW(ps, **HYPER, fused=f)),
    "fp32-states-bf16": (BF16, lambda ps, f: FP32StatesAdamW(ps, **HYPER, fused=f)),
    "kahan-bf16": (BF16, lambda ps, f: KahanAdamW(ps, **HYPER, fused=f)),
    "kahan-fp16": (F16, lambda ps, f: KahanAdamW(ps, **HYPER, fused=f)),
    "sr-bf16": (BF16, lambda ps, f: StochasticRoundingAdamW(ps, **HYPER, seed=5, fused=f)),
    "sr-fp16": (F16, lambda ps, f: StochasticRoundingAdamW(ps, **HYPER, seed=5, fused=f)),
    "fp32-states-sr-bf16": (BF16, lambda ps, f: FP32StatesSRAdamW(ps, **HYPER, seed=5, fused=f)),
    "fp32-states-sr-fp16": (F16, lambda ps, f: FP32StatesSRAdamW(ps, **HYPER, seed=5, fused=f)),  # fp16-als "sr"
    "master-bf16": (BF16, lambda ps, f: MasterWeightAdamW(ps, **HYPER, fused=f)),
    "master-fp16": (F16, lambda ps, f: MasterWeightAdamW(ps, **HYPER, fused=f)),
    "collage-light-bf16": (BF16, lambda ps, f: CollageAdamW(ps, **HYPER, variant="light", fused=f)),
    "collage-plus-bf16": (BF16, lambda ps, f: CollageAdamW(ps, **HYPER, variant="plus", fused=f)),
    "collage-light-fp16": (F16, lambda ps, f: CollageAdamW(ps, **HYPER, variant="light", fused=f)),
    "collage-plus-fp16": (F16, lambda ps, f: CollageAdamW(ps, **HYPER, variant="plus", fused=f)),
    "collage8bit-bf16": (BF16, lambda ps, f: Collage8bitAdamW(ps, **HYPER, fused=f)),
}
WITH_LARGE = {"collage-plus-bf16", "sr-bf16", "collage8bit-bf16"}


def _params(dtype: torch.dtype, seed: int = 0, shapes=SHAPES, large: bool = False) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=generator).to(dtype) for s in shapes]
    flat = params[0].view(-1)
    flat[:5] = 0.0
    flat[5:40] = (torch.randn(35, generator=generator) * 1e-3).to(dtype)
    flat[40:45] = 3e4
    params.append(torch.randn(NONCONTIGUOUS, generator=generator).to(dtype).t())
    if large:
        params.append(torch.randn(LARGE, generator=generator).to(dtype))
    assert not params[len(shapes)].is_contiguous()
    return [p.requires_grad_() for p in params]


def _grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    """Gradients with an all-zero tensor, a zero element, a finite g whose g² overflows (step 2),
    and a non-contiguous gradient for the non-contiguous parameter."""
    dtype = params[0].dtype
    generator = torch.Generator().manual_seed(1000 + step)
    grads = [
        (torch.randn(p.shape[::-1], generator=generator) * 1e-2).to(dtype).t()
        if not p.is_contiguous()
        else (torch.randn(p.shape, generator=generator) * 1e-2).to(dtype)
        for p in params
    ]
    big = 6e4 if dtype == F16 else 1e30  # (6e4)² overflows FP16; (1e30)² overflows FP32
    grads[0].view(-1)[0] = 0.0
    grads[0].view(-1)[1] = big if step == 2 else 1e-2
    grads[2].zero_()
    return grads


def _run(make: Factory, fused: str, steps: int, params=None, optimizer=None, start: int = 0, dtype=BF16, large=False):
    params = params if params is not None else _params(dtype, large=large)
    optimizer = optimizer if optimizer is not None else make(params, fused)
    for step in range(start, start + steps):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        optimizer.step()
    return params, optimizer


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns: FP8 has no equality kernel, and NaN must equal NaN."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_same_bits(params_a, opt_a, params_b, opt_b) -> None:
    for index, (a, b) in enumerate(zip(params_a, params_b)):
        assert a.dtype == b.dtype and a.stride() == b.stride()
        assert torch.equal(_bits(a.detach()), _bits(b.detach())), (
            f"parameter {index} differs in {(_bits(a.detach()) != _bits(b.detach())).sum().item()} elements"
        )
        state_a, state_b = opt_a.state[a], opt_b.state[b]
        assert state_a.keys() == state_b.keys()
        for key, value in state_a.items():
            other = state_b[key]
            if torch.is_tensor(value):
                assert value.dtype == other.dtype and value.shape == other.shape, f"{key} of {index}"
                assert torch.equal(_bits(value), _bits(other)), f"{key} of parameter {index} differs"
            else:
                assert value == other, key


def _paths(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    return dict(optimizer.paths_taken)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_compiled_step_is_bit_identical_to_the_reference(family):
    dtype, make = FAMILIES[family]
    large = family in WITH_LARGE
    steps = 4
    compiled = _run(make, "compiled", steps, dtype=dtype, large=large)
    reference = _run(make, "reference", steps, dtype=dtype, large=large)
    rows = steps * len(compiled[0])
    assert _paths(compiled[1]) == {"compiled": rows}
    assert _paths(reference[1]) == {"reference": rows}
    _assert_same_bits(*compiled, *reference)
    assert all(torch.isfinite(p).all() for p in compiled[0]), "a finite gradient made a parameter non-finite"
    # The steps did something to every parameter with a non-zero gradient (not a no-op on both).
    for index, (p, p0) in enumerate(zip(compiled[0], _params(dtype, large=large))):
        if index != 2:
            assert not torch.equal(p.detach(), p0.detach()), f"parameter {index} never moved"


def test_auto_runs_the_fastest_path_that_can_run_here():
    """This machine has a C++ compiler: "auto" takes the native kernel where the family has one
    and the compiled step where it has none (FP16 second moments), never the reference."""
    from hf_lowprec.optim import native

    assert dispatch.compiler_missing("cpu") is None
    dtype, make = FAMILIES["collage-plus-fp16"]
    auto = _run(make, "auto", 2, dtype=dtype)
    assert _paths(auto[1]) == {"compiled": 2 * len(auto[0])}
    _assert_same_bits(*auto, *_run(make, "reference", 2, dtype=dtype))
    dtype, make = FAMILIES["kahan-bf16"]
    auto = _run(make, "auto", 2, dtype=dtype)
    fast = "native" if native.native_unavailable() is None else "compiled"
    assert _paths(auto[1]) == {fast: 2 * len(auto[0])}
    _assert_same_bits(*auto, *_run(make, "reference", 2, dtype=dtype))


def test_master_weight_compiled_step_updates_the_master():
    """Regression (issue 21): the fused step of the master-weight optimizer stepped the BF16
    weight and never the master. The master must move, and the weight be the master rounded once."""
    dtype, make = FAMILIES["master-bf16"]
    params = _params(dtype)
    masters0 = [p.detach().float().clone() for p in params]
    params, optimizer = _run(make, "compiled", 3, params=params, dtype=dtype)
    assert _paths(optimizer) == {"compiled": 3 * len(params)}
    for index, (p, master0) in enumerate(zip(params, masters0)):
        master = optimizer.state[p]["master"]
        assert master.dtype == F32
        if index != 2:  # parameter 2 has all-zero gradients (it still decays)
            assert not torch.equal(master, master0), f"master {index} never moved"
        assert torch.equal(p.detach(), master.to(dtype)), f"parameter {index} is not its master rounded"
        assert torch.equal(optimizer.held_value(p), master.double())


@pytest.mark.parametrize("family", ["collage-plus-bf16", "kahan-fp16", "sr-bf16", "master-fp16", "collage8bit-bf16"])
def test_checkpoints_move_between_paths(family):
    """2 steps on one path, state_dict → fresh optimizer on the other path, 2 more steps =
    4 steps on the reference path, bit for bit, in both directions."""
    dtype, make = FAMILIES[family]
    straight = _run(make, "reference", 4, dtype=dtype)
    for first, second in (("compiled", "reference"), ("reference", "compiled")):
        params, optimizer = _run(make, first, 2, dtype=dtype)
        saved = optimizer.state_dict()
        resumed = make(params, second)
        resumed.load_state_dict(saved)
        _run(make, second, 2, params=params, optimizer=resumed, start=2, dtype=dtype)
        assert _paths(optimizer) == {first: 2 * len(params)}
        assert _paths(resumed) == {second: 2 * len(params)}
        _assert_same_bits(params, resumed, *straight)


@pytest.mark.parametrize("family", ["collage-plus-bf16", "sr-fp16", "master-fp16", "collage8bit-bf16"])
def test_tracking_does_not_change_the_trajectory(family):
    """Tracked steps hand Δθ back to the metrics; the parameters and states are the same bits
    as an untracked compiled run, and each record holds `held_value` before and after."""
    dtype, make = FAMILIES[family]
    untracked = _run(make, "compiled", 3, dtype=dtype)
    assert _paths(untracked[1]) == {"compiled": 3 * len(untracked[0])}
    params = _params(dtype)
    optimizer = make(params, "compiled")
    optimizer.track_updates = True
    _run(make, "compiled", 3, params=params, optimizer=optimizer, dtype=dtype)
    _assert_same_bits(*untracked, params, optimizer)
    assert len(optimizer.tracked) == 3 * len(params)
    for record in optimizer.tracked[-len(params) :]:
        assert record.before.dtype == record.after.dtype == torch.float64
        assert record.update.dtype == F32 and record.update.shape == record.param.shape
        assert torch.equal(record.after, optimizer.held_value(record.param))


def test_new_shapes_do_not_recompile():
    """One dynamic-shape graph serves every tensor size: a model of new shapes reuses it."""
    from torch._dynamo.utils import counters

    dtype, make = FAMILIES["collage-plus-bf16"]
    _run(make, "compiled", 1, dtype=dtype)
    before = counters["stats"]["unique_graphs"]
    params = _params(dtype, seed=1, shapes=[(91, 5), (1000,), (3,)])
    optimizer = make(params, "compiled")
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    assert _paths(optimizer) == {"compiled": len(params)}
    assert counters["stats"]["unique_graphs"] == before


@pytest.mark.parametrize(
    ("block", "numels"),
    [(1, (1, 5, 3)), (4, (4, 20, 3)), (1, (4, 9, 3))],
    ids=["one-element-first", "one-block-first", "sizes-equal-by-chance-first"],
)
def test_one_graph_serves_every_size_whatever_the_first_parameter(block, numels):
    """Two habits of dynamic shapes used to compile a second graph at the second parameter:
    dynamo specialises size-1 dimensions (a first parameter of one element or, in a group
    format, of one block: a bias), and duck sizing gives two dimensions one symbol when their
    first sizes are equal (here the parameter and a 4-element tensor stored as it is). One graph
    now serves every row, with the eager values."""
    from torch._dynamo.utils import counters

    def step(param, grad, table, scalars, seed, found_inf=None):
        param.add_(grad * scalars[0] + scalars[1] * param.sum(dim=-1, keepdim=True) + table.sum())
        return param

    def row(numel):
        tensors = [torch.linspace(-1.0, 1.0, numel), torch.full((numel,), 0.5), torch.arange(4.0)]
        return dispatch.ParamStep(tensors, [True, True, False], torch.tensor([2.0, 0.25]), None)

    rows = [row(n) for n in numels]
    expected = []
    for r in rows:
        staged, _ = dispatch._stage(r, block)
        expected.append(step(*[t.clone() for t in staged], r.scalars, None).reshape(-1)[: r.tensors[0].numel()])
    before = counters["stats"]["unique_graphs"]
    dispatch.run_bucket(("one-graph", block, numels), step, block, rows, "compiled", want_updates=False)
    assert counters["stats"]["unique_graphs"] == before + 1
    for r, e in zip(rows, expected):
        assert torch.equal(r.tensors[0], e)


def test_invalid_mode_is_refused_before_any_work():
    with pytest.raises(ValueError, match=r"fused='fast'.*'auto'"):
        CollageAdamW(_params(BF16), fused="fast", weight_decay=0.0)
    with pytest.raises(ValueError, match="fused"):
        get_strategy("collage-plus", fused="yes")


def test_a_bad_cpu_isa_is_refused_when_the_optimizer_is_built(monkeypatch):
    # Before the fix the native kernels read HF_LOWPREC_CPU_ISA at the first step, after the model
    # was prepared and a forward and backward had run.
    monkeypatch.setenv("HF_LOWPREC_CPU_ISA", "avx3")
    match = r"HF_LOWPREC_CPU_ISA='avx3': choose one of avx512_bf16, avx512, avx2, scalar \(or unset it\)"
    for fused in ("auto", "native"):
        with pytest.raises(ValueError, match=match):
            CollageAdamW(_params(BF16), fused=fused, weight_decay=0.0)
    strategy = get_strategy("collage-plus")
    model = strategy.prepare_model(tiny_gpt2())
    forwards = []
    model.register_forward_pre_hook(lambda *args: forwards.append(1))
    with pytest.raises(ValueError, match=match):
        strategy.create_optimizer(model.parameters(), lr=1e-3)
    assert not forwards
    assert (
        CollageAdamW(_params(BF16), fused="reference", weight_decay=0.0).fused == "reference"
    )  # a path that never reads it
    monkeypatch.setenv("HF_LOWPREC_CPU_ISA", " Scalar ")
    assert CollageAdamW(_params(BF16), weight_decay=0.0).fused == "auto"


def test_foreach_is_a_deprecated_name_of_reference():
    with pytest.warns(DeprecationWarning, match="fused='reference'"):
        optimizer = PlainAdamW(_params(BF16), fused="foreach", weight_decay=0.0)
    assert optimizer.fused == "reference"
    _run(None, "foreach", 1, params=optimizer.param_groups[0]["params"], optimizer=optimizer)
    assert _paths(optimizer) == {"reference": len(optimizer.param_groups[0]["params"])}


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)


@pytest.mark.parametrize("name", available_strategies())
@pytest.mark.parametrize(("given", "expected"), [("reference", "reference"), ("compiled", "compiled")])
def test_strategy_option_reaches_the_optimizer(name, given, expected):
    strategy = get_strategy(name, fused=given)
    model = strategy.prepare_model(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.LayerNorm(32)))
    optimizer = strategy.create_optimizer(model.parameters())
    assert _inner(optimizer).fused == expected


@pytest.mark.parametrize("options", [{"weights": "sr"}, {}], ids=["sr", "master"])
def test_fp16_als_passes_the_option_to_both_optimizers(options):
    strategy = get_strategy("fp16-als", fused="reference", **options)
    params = [torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))]
    assert _inner(strategy.create_optimizer(params)).fused == "reference"


@pytest.mark.parametrize(
    "options",
    [{"states": False}, {"states": False, "master_weights": "bf16-collage"}],
    ids=["fp32-master", "bf16-collage"],
)
def test_coat_passes_the_option_to_its_bf16_and_fp32_steps(options):
    strategy = get_strategy("coat", activations=True, fused="reference", **options)
    params = [torch.nn.Parameter(torch.zeros(4, dtype=strategy.param_dtype))]
    assert _inner(strategy.create_optimizer(params)).fused == "reference"


def test_coat_strategy_runs_the_compiled_step_when_asked():
    strategy = get_strategy("coat", fused="compiled")
    params = [torch.nn.Parameter(torch.randn(2, 128))]
    optimizer = strategy.create_optimizer(params)
    params[0].grad = torch.randn(2, 128)
    before = params[0].detach().clone()
    optimizer.step()
    assert _paths(_inner(optimizer)) == {"compiled": 1}
    assert not torch.equal(params[0], before)


# --- when the compiled step cannot run -------------------------------------------------------


@pytest.fixture
def fresh_dispatch(monkeypatch):
    """Forget which messages were logged and which kernels broke, for this test only."""
    monkeypatch.setattr(dispatch, "_logged", set())
    monkeypatch.setattr(dispatch, "_broken", set())


def test_compiled_raises_and_auto_falls_back_with_one_log_line_when_the_compiler_is_missing(
    monkeypatch, caplog, fresh_dispatch
):
    monkeypatch.setattr(dispatch, "compiler_missing", lambda device_type: "no C++ compiler on PATH")
    dtype, make = FAMILIES["collage-plus-fp16"]
    with caplog.at_level(logging.WARNING, logger=dispatch.__name__):
        auto = _run(make, "auto", 3, dtype=dtype)
    lines = [r.getMessage() for r in caplog.records if r.name == dispatch.__name__]
    assert len(lines) == 1 and "no C++ compiler on PATH" in lines[0] and "reference" in lines[0], lines
    assert _paths(auto[1]) == {"reference": 3 * len(auto[0])}
    _assert_same_bits(*auto, *_run(make, "reference", 3, dtype=dtype))
    params = _params(dtype)
    before = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match=r"fused='compiled'.*no C\+\+ compiler on PATH.*fused='auto'"):
        _run(make, "compiled", 1, params=params)
    # Refused before any parameter moved.
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))


def test_auto_falls_back_once_with_a_log_when_compiling_fails(monkeypatch, caplog, fresh_dispatch):
    def broken(key, discard, parallel):
        def fail(*args, **kwargs):
            raise RuntimeError("the backend broke")

        return fail

    monkeypatch.setattr(dispatch, "_compiled_for", broken)
    dtype, make = FAMILIES["collage-plus-fp16"]
    with caplog.at_level(logging.WARNING, logger=dispatch.__name__):
        fallback = _run(make, "auto", 3, dtype=dtype)
    assert sum("the backend broke" in r.getMessage() for r in caplog.records) == 1
    assert _paths(fallback[1]) == {"reference": 3 * len(fallback[0])}
    _assert_same_bits(*fallback, *_run(make, "reference", 3, dtype=dtype))
    with pytest.raises(RuntimeError, match="compiling it failed earlier"):
        _run(make, "compiled", 1, dtype=dtype)
    dispatch._broken.clear()
    with pytest.raises(RuntimeError, match="the backend broke"):
        _run(make, "compiled", 1, dtype=dtype)


def test_first_graph_built_on_a_small_tensor_still_runs_in_parallel():
    """Regression: Inductor chose the OpenMP parallel region from the first call's size hint,
    and the dynamic-shape graph then served every size: a model whose first parameter is a
    bias ran its whole optimizer step on one thread. `cpp.dynamic_threads` keeps the region."""
    from torch._inductor.utils import fresh_cache, run_and_get_code

    from hf_lowprec.optim.adamw import adamw_scalars

    composition = Composition(Plain(), Plain(), Nearest())
    param, grad, m, v = (torch.zeros(7, dtype=BF16) for _ in range(4))
    scalars = torch.tensor(adamw_scalars(1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0))

    def discard(*args):
        composition.step(*args)

    with fresh_cache():
        compiled = torch.compile(discard, dynamic=True, fullgraph=True, options=dispatch.COMPILE_OPTIONS)
        _, code = run_and_get_code(compiled, param, grad, None, m, v, scalars, None)
    assert any("#pragma omp parallel" in c for c in code), "the compiled step has no parallel region"


# --- COATAdamW ---------------------------------------------------------------------------------

# Whole groups of 128 beside parameters whose size is not a multiple of 128 (staged on padded
# copies, both paths); the first holds an all-zero group and a group with one non-zero
# gradient (amin = amax).
COAT_SHAPES = [(6, 128), (257,), (3, 256), (5, 30)]


def _coat_run(fused: str, dtype: torch.dtype, steps: int, **options):
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator).to(dtype)) for s in COAT_SHAPES]
    optimizer = COATAdamW(params, lr=1e-2, weight_decay=0.1, fused=fused, **options)
    for _step in range(steps):
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


# The θ rule (FP32 master, or BF16 with Collage's δθ) and the moments' format are separate pieces
# of the composition: both rules with the default format, and each other format with one rule
# (each compiled COAT graph costs about a minute on two CPU cores).
COAT_COMPILED_CASES = [
    pytest.param(F32, {}, id="expand-fp32-master"),
    pytest.param(BF16, {}, id="expand-bf16-collage"),
    pytest.param(BF16, {"expand": False}, id="plain-bf16-collage"),
    pytest.param(F32, {"exp_avg_sq_format": "e5m2"}, id="v-e5m2-fp32-master"),
]


@pytest.mark.parametrize(("dtype", "options"), COAT_COMPILED_CASES)
def test_compiled_coat_step_is_bit_identical_to_the_reference(dtype, options):
    compiled = _coat_run("compiled", dtype, 3, **options)
    reference = _coat_run("reference", dtype, 3, **options)
    rows = 3 * len(COAT_SHAPES)
    assert _paths(compiled[1]) == {"compiled": rows} and _paths(reference[1]) == {"reference": rows}
    if options.get("expand", True):  # both branches of the expansion ran
        exponents = torch.cat([s["exp_avg_exponent"] for s in compiled[1].state.values()])
        assert (exponents > 1).any() and (exponents == 1).any()
    _assert_same_bits(*compiled, *reference)


# --- FP8AdamW ----------------------------------------------------------------------------------


def _fp8_o2_run(fused: str, steps: int, grad_scale_factor: float = 1.0):
    """FP8AdamW as fp8-lm-o2 drives it: an FP16 master with a per-tensor scale and FP8
    gradients handed over (`set_fp8_grad`), next to an FP32 parameter with FP32 states and a
    plain gradient, and a non-contiguous FP32 parameter with the default E4M3 m and scaled FP16
    v. Includes an all-zero gradient row and an all-zero gradient step."""
    from hf_lowprec.fp8 import pow2_scale, quantize
    from hf_lowprec.fp8.scaled import set_master_scale

    generator = torch.Generator().manual_seed(0)
    real = torch.randn(40, 33, generator=generator) * 0.05
    master_scale = pow2_scale(real.abs().amax(), F16)
    master = quantize(real, master_scale, F16).requires_grad_()
    set_master_scale(master, master_scale)
    gain = torch.randn(300, generator=generator).requires_grad_()
    other = torch.randn(17, 9, generator=generator).t().requires_grad_()
    optimizer = FP8AdamW(
        [{"params": [master, other]}, {"params": [gain], "exp_avg_format": "fp32", "exp_avg_sq_format": "fp32"}],
        lr=1e-2,
        weight_decay=0.1,
        fused=fused,
    )
    for step in range(steps):
        g = torch.randn(master.shape, generator=generator) * 1e-3
        g[0] = 0.0
        scale = pow2_scale(g.abs().amax(), torch.float8_e4m3fn) * grad_scale_factor
        optimizer.set_fp8_grad(master, quantize(g, scale, torch.float8_e4m3fn), scale)
        gain.grad = torch.randn(gain.shape, generator=generator) * 1e-2 * (step != 1)
        other.grad = torch.randn(other.shape, generator=generator) * 1e-2
        optimizer.step()
    return [master, other, gain], optimizer


@pytest.mark.parametrize("grad_scale_factor", [1.0, 0.7], ids=["pow2", "clipped"])
def test_compiled_fp8_adamw_is_bit_identical_to_the_reference(grad_scale_factor):
    """The step multiplies by 1/s for the power-of-two scales of the states and the master
    (exact) but divides by the gradient's scale, which gradient clipping re-encodes with a
    factor that is not a power of two (0.7 here): 1/s would round there."""
    from hf_lowprec.fp8.scaled import get_master_scale

    compiled = _fp8_o2_run("compiled", 3, grad_scale_factor)
    reference = _fp8_o2_run("reference", 3, grad_scale_factor)
    assert _paths(compiled[1]) == {"compiled": 9} and _paths(reference[1]) == {"reference": 9}
    _assert_same_bits(*compiled, *reference)
    assert torch.equal(get_master_scale(compiled[0][0]), get_master_scale(reference[0][0]))
    assert compiled[1].state[compiled[0][0]]["exp_avg"].dtype == torch.float8_e4m3fn
    assert compiled[1].state[compiled[0][0]]["grad"].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("name", ["bf16-pure", "collage-plus", "fp8-lm-o2"])
def test_strategy_option_fused_native_runs_the_native_kernels(name):
    """precision_options={"fused": "native"} reaches the optimizer: every parameter steps natively."""
    import hf_lowprec

    strategy = hf_lowprec.get_strategy(name, fused="native")
    model = strategy.prepare_model(torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 16)))
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    batch = torch.randn(4, 32)
    strategy.train_step(
        model, batch, optimizer, loss_fn=lambda m, x: m(x.to(m[0].weight.dtype)).float().square().mean()
    )
    inner = getattr(optimizer, "optimizer", optimizer)
    assert set(inner.paths_taken) == {"native"} and inner.paths_taken["native"] > 0, dict(inner.paths_taken)


@pytest.mark.parametrize("family", ["plain-fp32"])
def test_on_the_gpu_paths_a_step_is_one_graph_per_chunk_of_rows_with_the_reference_bits(family):
    """A GPU steps a bucket in a few compiled calls, each over a chunk of rows unrolled
    (`compiling.gpu_paths` makes CPU tensors take that path; compiled here by Inductor's C++
    backend): the reference's bits, and one graph launch per chunk. bf16-mixed's family: a
    block format's unrolled graph (the same per-row function) takes minutes to build on two cores."""
    from hf_lowprec.compiling import gpu_paths
    from hf_lowprec.testing.launches import Launches

    dtype, make = FAMILIES[family]
    # Three rows (one staged: non-contiguous; one with a zero gradient): chunks of 2 and 1, small to build.
    with gpu_paths():
        together = _run(make, "compiled", 3, params=_params(dtype, shapes=[(257,), (7,)]))
        with Launches() as counted:
            _run(make, "compiled", 1, *together, start=3)
    reference = _run(make, "reference", 4, params=_params(dtype, shapes=[(257,), (7,)]))
    assert _paths(together[1]) == {"compiled": 4 * len(together[0])}
    _assert_same_bits(*together, *reference)
    # The contiguous rows are one chunk of two, the staged (non-contiguous) one a chunk of its own.
    calls = sum(n for (_, name), n in counted.regions.items() if name.endswith("_rows"))
    assert calls == 2, counted.summary()


def test_rows_are_chunked_so_that_a_composition_builds_at_most_four_graphs():
    """Full chunks of eight, then halving sizes: the graph sizes one composition ever needs are
    8, 4, 2 and 1, so the build time of a GPU's step does not grow with the model."""
    from hf_lowprec.compiling import ROWS_PER_GRAPH, chunks_of

    assert ROWS_PER_GRAPH == 8
    sizes = set()
    for count in range(1, 300):
        chunks = chunks_of(count)
        assert [i for c in chunks for i in range(c.start, c.stop)] == list(range(count))  # each row once, in order
        lengths = [c.stop - c.start for c in chunks]
        assert lengths == sorted(lengths, reverse=True)
        assert len(chunks) == count // 8 + bin(count % 8).count("1")
        sizes.update(lengths)
    assert sizes == {8, 4, 2, 1}
    assert [c.stop - c.start for c in chunks_of(75)] == [8] * 9 + [2, 1]


def test_many_rows_on_the_gpu_paths_step_chunk_by_chunk_with_the_reference_bits():
    """Thirteen parameters: twelve contiguous in chunks of 8 and 4, the staged (non-contiguous) one
    in a chunk of its own: every row stepped once, the reference's bits, three graph calls a step. Compiled functions run as their eager
    source: the chunking is what is checked, not Inductor (which the test above runs)."""
    from hf_lowprec.compiling import gpu_paths
    from hf_lowprec.testing.launches import Launches

    dtype, make = FAMILIES["plain-fp32"]
    shapes = [(257,)] + [(5 + 3 * i,) for i in range(11)]
    with gpu_paths(), torch.compiler.set_stance("force_eager"):
        chunked = _run(make, "compiled", 2, params=_params(dtype, shapes=shapes))
        with Launches() as counted:
            _run(make, "compiled", 1, *chunked, start=2)
    reference = _run(make, "reference", 3, params=_params(dtype, shapes=shapes))
    assert len(chunked[0]) == 13
    assert _paths(chunked[1]) == {"compiled": 3 * 13}
    _assert_same_bits(*chunked, *reference)
    assert sum(n for (_, name), n in counted.regions.items() if name.endswith("_rows")) == 3, counted.summary()


def test_rows_of_the_large_size_class_are_stepped_by_graphs_of_their_own(monkeypatch):
    """A graph splits a reduction over a whole tensor by the sizes it was built for: rows of
    LARGE_ROW elements or more get graphs apart from the small ones, so none built on a bias
    reduces a large weight in one block. Same bits as the reference."""
    from hf_lowprec.compiling import LARGE_ROW, gpu_paths
    from hf_lowprec.optim import dispatch
    from hf_lowprec.testing.launches import Launches

    monkeypatch.setattr(dispatch, "_graphs", {})
    dtype, make = FAMILIES["plain-fp32"]
    shapes = [(257,), (7,), (256, 256)]
    assert 256 * 256 >= LARGE_ROW > 257
    with gpu_paths(), torch.compiler.set_stance("force_eager"):
        split = _run(make, "compiled", 1, params=_params(dtype, shapes=shapes))
        with Launches() as counted:
            _run(make, "compiled", 1, *split, start=1)
    reference = _run(make, "reference", 2, params=_params(dtype, shapes=shapes))
    _assert_same_bits(*split, *reference)
    assert {key[-1] for key in dispatch._graphs if key[1].endswith("_rows")} == {True, False}
    # The two small contiguous rows, the large one, the staged (non-contiguous) one.
    assert sum(n for (_, name), n in counted.regions.items() if name.endswith("_rows")) == 3, counted.summary()


def test_a_chunk_whose_graph_cannot_be_built_leaves_its_rows_to_the_per_row_graphs(monkeypatch, caplog):
    """The graph of eight rows builds and steps, the one of four fails: the rows stepped stay
    stepped once, the rest step one row at a time, the reference's bits, and the log says so once."""
    from hf_lowprec.compiling import gpu_paths
    from hf_lowprec.optim import dispatch

    real = torch.compile

    def compile_refusing_four_rows(fn, **options):
        graph = real(fn, **options)
        if "_rows_" not in fn.__name__:
            return graph

        def refuse_four(rows_args, flags):
            if len(rows_args) == 4:
                raise RuntimeError("no graph of four rows here")
            return graph(rows_args, flags)

        return refuse_four

    monkeypatch.setattr(torch, "compile", compile_refusing_four_rows)
    for name, fresh in (("_graphs", {}), ("_broken", set()), ("_logged", set())):
        monkeypatch.setattr(dispatch, name, fresh)
    dtype, make = FAMILIES["plain-fp32"]
    shapes = [(257,)] + [(5 + 3 * i,) for i in range(11)]
    with gpu_paths(), torch.compiler.set_stance("force_eager"), caplog.at_level(logging.WARNING):
        mixed = _run(make, "compiled", 2, params=_params(dtype, shapes=shapes))
    reference = _run(make, "reference", 2, params=_params(dtype, shapes=shapes))
    assert _paths(mixed[1]) == {"compiled": 2 * 13}
    _assert_same_bits(*mixed, *reference)
    assert sum("one row at a time" in r.message for r in caplog.records) == 1


@pytest.mark.slow
class _BlockwiseV(PlainAdamW):
    """A block format at its simplest: v in 8-bit blocks of 256, m and θ as they are (the staging
    is the format's, whatever the rest of the family; collage-8bit's whole step is checked row by
    row in `test_compiled_step_is_bit_identical_to_the_reference`, and its graph over rows took
    six minutes to build on two AVX2 cores)."""

    def composition(self, param, group):
        return Composition(Plain(), Blockwise8bit(signed=False), Nearest())


def test_a_block_formats_graph_over_every_row_stages_inside_it_with_the_reference_bits(caplog):
    """A blockwise state on a GPU's path: the rows that are not whole blocks (257 and 7 elements
    in blocks of 256) or not contiguous are padded and written back inside the graph over all rows
    (they were three eager launches per tensor and step: issue #66), which Inductor must build (a
    failure would step row by row, with a warning); the reference's bits."""
    from hf_lowprec.compiling import gpu_paths
    from hf_lowprec.testing.launches import Launches

    def make(params, fused):
        return _BlockwiseV(params, **HYPER, fused=fused)

    with gpu_paths(), caplog.at_level(logging.WARNING):
        together = _run(make, "compiled", 2, params=_params(BF16, shapes=[(257,), (7,)]))
        for p, g in zip(together[0], _grads(together[0], 2)):
            p.grad = g
        with Launches() as counted:
            together[1].step()
    reference = _run(make, "reference", 3, params=_params(BF16, shapes=[(257,), (7,)]))
    assert not caplog.records, caplog.text
    _assert_same_bits(*together, *reference)
    assert _paths(together[1]) == {"compiled": 3 * len(together[0])}
    # Two chunks: the flat rows (257 and 7 elements), the (48, 33) one (a rank of its own).
    assert sum(n for (_, name), n in counted.regions.items() if name.endswith("_rows")) == 2, counted.summary()
    staging = [op for (_, op) in counted.ops if "pad" in op or "copy" in op or "zeros" in op]
    assert not staging, counted.summary()  # no eager staging copies or write-backs


def test_a_bucket_whose_graph_over_all_rows_cannot_be_built_steps_row_by_row(monkeypatch, caplog):
    """A backend that cannot build the unrolled graphs (an option its Inductor lacks, say): the
    per-row compiled graphs step the bucket instead, with the same bits, and the log says so once."""
    from hf_lowprec.compiling import gpu_paths
    from hf_lowprec.optim import dispatch

    real = torch.compile

    def compile_refusing_rows(fn, **options):
        if "_rows_" in fn.__name__:

            def refuse(*args, **kwargs):
                raise RuntimeError("no graph over all rows here")

            return refuse
        return real(fn, **options)

    monkeypatch.setattr(torch, "compile", compile_refusing_rows)
    for name, fresh in (("_graphs", {}), ("_broken", set()), ("_logged", set())):
        monkeypatch.setattr(dispatch, name, fresh)
    dtype, make = FAMILIES["plain-fp32"]
    # Compiled functions run as their eager source: the fallback is what is checked, not Inductor.
    with gpu_paths(), torch.compiler.set_stance("force_eager"), caplog.at_level(logging.WARNING):
        per_row = _run(make, "compiled", 2, params=_params(dtype, shapes=[(257,), (7,)]))
    reference = _run(make, "reference", 2, params=_params(dtype, shapes=[(257,), (7,)]))
    assert _paths(per_row[1]) == {"compiled": 2 * len(per_row[0])}
    _assert_same_bits(*per_row, *reference)
    assert sum("one row at a time" in r.message for r in caplog.records) == 1


def test_device_scalar_rows_are_one_graph_with_the_hosts_bits_whatever_the_lr():
    """The scalars of a step whose count lives on the device (`scalars.device_scalar_rows`, after
    a flagged step) are one compiled graph (issue #66: they were about twenty eager launches per
    bucket and step), with `adamw_scalars`' bits computed on the host in FP64, for every step and
    hyper-parameters, and an lr or β1 that changes every step (a schedule) compiles nothing new
    after the first change."""
    from torch._dynamo.utils import counters

    from hf_lowprec.optim.scalars import adamw_scalars, device_scalar_rows

    for lr, beta1, beta2, eps, decay in [(1e-3, 0.9, 0.999, 1e-8, 0.01), (3e-4, 0.8, 0.95, 1e-6, 0.1)]:
        steps = [torch.tensor(float(t), dtype=torch.float64) for t in range(0, 5000, 97)]
        hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=decay)
        rows = device_scalar_rows(steps, **hyper)
        for t, row in zip(steps, rows):
            host = torch.tensor(adamw_scalars(int(t) + 1, **hyper), dtype=torch.float32)
            assert torch.equal(row.view(torch.int32), host.view(torch.int32)), (int(t), row, host)
    steps = [torch.tensor(3.0, dtype=torch.float64)] * 4
    device_scalar_rows(steps, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    device_scalar_rows(steps, lr=2e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    before = counters["stats"]["unique_graphs"]
    # OneCycleLR's momentum cycle moves β1 with lr every step: one graph still (12 graphs in 12
    # steps before, then the recompile limit and eager operations).
    for lr, beta1 in ((3e-3, 0.9), (4e-3, 0.87), (5e-4, 0.93), (1e-3, 0.85)):
        row = device_scalar_rows(steps, lr=lr, beta1=beta1, beta2=0.999, eps=1e-8, weight_decay=0.0)[0]
        host = adamw_scalars(4, lr=lr, beta1=beta1, beta2=0.999, eps=1e-8, weight_decay=0.0)
        assert torch.equal(row, torch.tensor(host, dtype=torch.float32))
    assert counters["stats"]["unique_graphs"] == before
    # Buckets of any size share the graph: 40 sizes compile nothing new (a list of counts was
    # guarded on its length, and the 33rd size in a process hit the recompile limit).
    from hf_lowprec import compiling
    from hf_lowprec.optim.scalars import _device_scalar_table

    for n in range(2, 42):
        rows = device_scalar_rows([torch.tensor(float(n), dtype=torch.float64)] * n, **hyper)
        assert len(rows) == n and torch.equal(rows[-1], torch.tensor(adamw_scalars(n + 1, **hyper)).float())
    assert counters["stats"]["unique_graphs"] <= before + 1  # n = 2's shape
    assert _device_scalar_table not in compiling._broken


def test_combo_rows_builds_the_graphs_over_rows_with_pointwise_combo_kernels(monkeypatch):
    """`combo_rows()` (the device check's second bf16-mixed row): the graphs over rows are built
    with Inductor's pointwise combo kernels, each row with its own block sizes where this torch has
    the option, under a code object of their own (the default's graphs stay as they were), and step
    with the reference's bits; outside it the default's options, no combo kernels."""
    from hf_lowprec.compiling import gpu_paths
    from hf_lowprec.optim import dispatch

    built = {}
    real = torch.compile

    def recording(fn, **kwargs):
        built[fn.__name__] = kwargs.get("options", {})
        return real(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", recording)
    for name, fresh in (("_graphs", {}), ("_broken", set()), ("_logged", set())):
        monkeypatch.setattr(dispatch, name, fresh)
    dtype, make = FAMILIES["plain-fp32"]
    with gpu_paths(), torch.compiler.set_stance("force_eager"):
        default = _run(make, "compiled", 2, params=_params(dtype))
        with dispatch.combo_rows():
            combo = _run(make, "compiled", 2, params=_params(dtype))
    reference = _run(make, "reference", 2, params=_params(dtype))
    rows = {name: options for name, options in built.items() if "_rows_" in name}
    with_combo = {name for name in rows if name.endswith("_combo")}
    assert with_combo and len(with_combo) < len(rows), sorted(rows)
    for name, options in rows.items():
        assert bool(options.get("combo_kernels")) == (name in with_combo), (name, options)
        if name in with_combo:
            assert options.get("combo_kernels_pointwise_only", True), options
    assert not dispatch._combo  # the context restores the default
    _assert_same_bits(*combo, *reference)
    _assert_same_bits(*default, *reference)
