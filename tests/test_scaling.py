"""Graphcore ALS and running-mean accumulation on synthetic gradients (docs/algorithms.md §5)."""

import contextlib
import logging
import math

import pytest
import torch

from hf_lowprec.scaling import FP16_MAX, AutomaticLossScaler, RunningMeanGradients, clip_grad_norm_, running_mean_
from tests.helpers import bits_equal

EDGE = 2.0**13
U16 = 2.0**-11  # FP16 unit roundoff (11-bit significand, round to nearest)


class Holder(torch.nn.Module):
    """One FP16 parameter whose gradient the test sets directly."""

    def __init__(self, n=1000):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n, dtype=torch.float16))


def one_step(scaler, grad):
    model = Holder(grad.numel())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler.track(model)
    model.w.grad = grad.to(torch.float16).clone()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    return scaler.get_scale(), model.w.grad


def saturating():
    g = torch.full((1000,), 1.0)
    g[:3] = 2.0**14  # 0.3 % of the elements in the upper bin: far above 1e-7
    return g


def test_saturating_gradients_halve_the_scale():
    scaler = AutomaticLossScaler(init_scale=2.0**10)
    scale, grad = one_step(scaler, saturating())
    assert scale == 2.0**9
    assert scaler.last_upper_share == pytest.approx(3 / 1000)
    # Unscaling divides by a power of two: exact for these normal FP16 values.
    assert bits_equal(grad[:3].double(), torch.full((3,), 2.0**14 / 2.0**10, dtype=torch.float64))


def test_tiny_gradients_grow_the_scale_to_the_cap_and_stop():
    scaler = AutomaticLossScaler()  # init 1, cap 2^15
    trace = [one_step(scaler, torch.full((1000,), 1e-3))[0] for _ in range(20)]
    assert trace[:15] == [2.0**k for k in range(1, 16)]
    assert trace[15:] == [2.0**15] * 5


def test_one_element_in_the_upper_bin_is_above_the_threshold():
    # 1 of 1000 = 1e-3 > 1e-7; a zero threshold halves on any upper-bin element, but an
    # all-lower histogram still doubles.
    scaler = AutomaticLossScaler(init_scale=4.0, threshold=0.0)
    g = torch.zeros(1000)
    g[0] = EDGE  # the edge itself belongs to the upper bin
    assert one_step(scaler, g)[0] == 2.0
    assert one_step(scaler, torch.zeros(1000))[0] == 4.0  # all-zero gradients: share 0, grow


def test_period_is_respected_and_sums_the_histogram():
    scaler = AutomaticLossScaler(init_scale=2.0**6, period=3)
    trace = []
    for step in range(6):
        g = saturating() if step == 1 else torch.full((1000,), 1e-3)
        trace.append(one_step(scaler, g)[0])
    # Steps 0-2 are one period holding one saturated step: halve at its end; steps 3-5 clean: double.
    assert trace == [2.0**6, 2.0**6, 2.0**5, 2.0**5, 2.0**5, 2.0**6]


def test_overflow_is_clipped_not_skipped_and_counted():
    scaler = AutomaticLossScaler(init_scale=4.0)
    model = Holder(4)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler.track(model)
    model.w.grad = torch.tensor([math.inf, -math.inf, 8.0, 0.0], dtype=torch.float16)
    scaler.unscale_(optimizer)
    scaler.unscale_(optimizer)  # a second call in the same step is a no-op
    assert bits_equal(model.w.grad, torch.tensor([FP16_MAX / 4, -FP16_MAX / 4, 2.0, 0.0], dtype=torch.float16))
    scaler.step(optimizer)
    assert torch.isfinite(model.w).all() and model.w[2] == -2.0  # the step happened
    scaler.update()
    assert scaler.get_scale() == 2.0
    assert scaler.last_clipped == 2 and scaler.total_clipped == 2


def test_scale_below_one_clips_the_unscaled_gradient_too():
    scaler = AutomaticLossScaler(init_scale=0.25, min_scale=2.0**-4)
    _, grad = one_step(scaler, torch.tensor([30000.0, 1.0]))
    # 30000 / 0.25 = 120000 does not fit FP16: saturate at 65504, never inf.
    assert grad.tolist() == [FP16_MAX, 4.0]


def test_nan_skips_the_step_and_halves_at_once():
    scaler = AutomaticLossScaler(init_scale=8.0, period=100)
    model = Holder(3)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler.track(model)
    model.w.grad = torch.tensor([math.nan, 1.0, 1.0], dtype=torch.float16)
    scaler.unscale_(optimizer)
    assert scaler.step(optimizer) is None
    assert bits_equal(model.w.detach(), torch.zeros(3, dtype=torch.float16))
    scaler.update()
    assert scaler.get_scale() == 4.0  # mid-period, halved anyway


def linear_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False)).half()
    return model


def test_activation_gradients_are_counted():
    # dL/dy = 1e4 ≥ 2^13 on the Linear's output, while dL/dW = 1e4·x = 1 stays in the lower bin.
    x = torch.full((1, 4), 1e-4, dtype=torch.float16)
    scales = {}
    for track in (True, False):
        model = linear_model()
        scaler = AutomaticLossScaler(init_scale=1.0, track_activations=track).track(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        (model(x).float().sum() * 1e4).backward()
        assert model[0].weight.grad.abs().max() < EDGE
        scaler.unscale_(optimizer)
        scaler.update()
        scales[track] = scaler.get_scale()
    assert scales == {True: 0.5, False: 2.0}


def test_activation_overflow_is_clipped_in_backward_and_named_once(caplog):
    model = linear_model()
    scaler = AutomaticLossScaler().track(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.full((1, 4), 2.0**-4, dtype=torch.float16)

    def backward():
        y = model(x)
        # dL/dz = 3e4 fits FP16; dL/dy = 4·3e4 = 1.2e5 overflows to inf in FP16.
        ((y * 4.0).float().sum() * 3e4).backward()

    caplog.set_level(logging.WARNING, logger="hf_lowprec.scaling")
    for step in range(4):
        model.zero_grad()
        if step == 2:
            (model(x).float().sum()).backward()  # a clean step ends the first occurrence
        else:
            backward()
            # Clamped in the hook to 65504, so dL/dW = 65504·2^-4 = 4094, exact in FP16.
            assert bits_equal(model[0].weight.grad, torch.full((4, 4), 4094.0, dtype=torch.float16))
        scaler.unscale_(optimizer)
        scaler.update()
        assert not caplog.records  # a step logs nothing (it would have to wait for the device)
    assert scaler.log_overflows() == ["0"]
    named = [r.getMessage() for r in caplog.records if "overflow" in r.getMessage()]
    # Two episodes (steps 0-1 and step 3), not three: step 1 continues step 0's.
    assert len(named) == 1 and named[0].endswith("in: 0 (2×)"), named
    assert scaler.log_overflows() == [] and len(caplog.records) == 1  # read once


def test_state_dict_round_trip_and_bounds():
    scaler = AutomaticLossScaler(init_scale=8.0, period=2)
    one_step(scaler, saturating())
    state = scaler.state_dict()
    other = AutomaticLossScaler(init_scale=8.0, period=2)
    other.load_state_dict(state)
    for _ in range(3):
        assert one_step(scaler, torch.full((10,), 1e-3))[0] == one_step(other, torch.full((10,), 1e-3))[0]
    assert other.state_dict() == scaler.state_dict()
    with pytest.raises(ValueError, match="outside"):
        AutomaticLossScaler().load_state_dict({**state, "scale": 2.0**20})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"period": 0}, "period"),
        ({"bin_edge": 1e5}, "bin_edge"),
        ({"threshold": 1.0}, "threshold"),
        ({"init_scale": 3.0}, "power of two"),
        ({"init_scale": 2.0**16}, "min_scale <= init_scale <= max_scale"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AutomaticLossScaler(**kwargs)


def test_clip_grad_norm_accumulates_in_fp32_where_torch_overflows():
    def params():
        a = torch.nn.Parameter(torch.zeros(100, dtype=torch.float16))
        b = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
        a.grad = torch.full((100,), 8000.0, dtype=torch.float16)
        b.grad = torch.tensor([0.0, 3.0, -4.0], dtype=torch.float16)
        return [a, b]

    reference = math.sqrt(100 * 8000.0**2 + 25.0)  # FP64
    theirs = params()
    assert torch.isinf(torch.nn.utils.clip_grad_norm_(theirs, 1.0))  # why this function exists
    assert bits_equal(theirs[0].grad, torch.zeros(100, dtype=torch.float16))

    measured = params()
    norm = clip_grad_norm_(measured, math.inf)
    # FP32 sum of 100 equal squares and one sqrt: relative error well under 2^-20.
    assert norm.dtype == torch.float32 and abs(norm.item() - reference) <= 2.0**-20 * reference
    assert bits_equal(measured[0].grad, params()[0].grad)  # max_norm=inf only measures

    clipped = params()
    clip_grad_norm_(clipped, 1.0)
    new_norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in clipped))
    # Each element is rounded once to FP16 after the FP32 multiply: relative error <= 2^-11.
    assert abs(new_norm - 1.0) <= 2.0**-11


# --- running-mean accumulation ----------------------------------------------------------
def micro_batch_gradients(n=8, size=4096, magnitude=3e4, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Same sign, large: a plain FP16 sum of 8 passes 65504 after 3 micro-batches.
    return [(magnitude * (0.5 + 0.5 * torch.rand(size, generator=g))).half() for _ in range(n)]


def test_running_mean_does_not_overflow_where_the_sum_does():
    grads = micro_batch_gradients()
    total = torch.zeros_like(grads[0])
    mean = torch.zeros_like(grads[0])
    for k, g in enumerate(grads, start=1):
        total += g
        running_mean_(mean, g, k)
    assert torch.isinf(total).any()
    reference = torch.stack([g.double() for g in grads]).mean(0)
    # Each step rounds three times (the (k-1)/k product, g/k and the sum), each error at most
    # u·max|g| (u = 2^-11); the error carried from step k-1 shrinks by (k-1)/k, so
    # |M_N - mean| <= 3·N·u·max|g| is a safe bound (about 0.7 % here; a sum would be inf).
    bound = 3 * len(grads) * U16 * float(reference.abs().max())
    assert float((mean.double() - reference).abs().max()) <= bound
    assert float(mean.abs().max()) <= max(float(g.abs().max()) for g in grads)


def test_running_mean_hooks_match_the_function_and_reset():
    grads = micro_batch_gradients(n=4, size=64, magnitude=1.0)
    model = Holder(64)
    accumulator = RunningMeanGradients().attach(model)
    expected = torch.zeros(64, dtype=torch.float16)
    for _window in range(2):  # the second window starts after zero_grad(set_to_none=False) + reset
        for k, g in enumerate(grads, start=1):
            accumulator.new_window()  # a micro-batch (a forward of an attached model does this)
            (model.w.float() * g.float()).sum().backward()  # dL/dw = g exactly
            running_mean_(expected, g, k)
        assert bits_equal(model.w.grad, expected)
        model.zero_grad(set_to_none=False)
        accumulator.reset()


def test_running_mean_adds_a_second_backward_within_one_micro_batch():
    """Two backward passes after one forward (a main and an auxiliary loss) are one micro-batch's
    gradient, summed as autograd sums it: the second averaged in halved it (M₂ = (g+h)/2). Next
    micro-batch, the running mean of the windows' sums, bit for bit as `running_mean_` forms it."""
    g, h, n = micro_batch_gradients(n=3, size=64, magnitude=1.0)
    model = Holder(64)
    accumulator = RunningMeanGradients().attach(model)
    with pytest.raises(NotImplementedError):
        model()  # a forward of the attached model starts the micro-batch (Holder has no forward)
    for grad in (g, h):
        (model.w.float() * grad.float()).sum().backward()
    first = g + h  # autograd's FP16 sum
    assert bits_equal(model.w.grad, first)
    accumulator.new_window()
    (model.w.float() * n.float()).sum().backward()
    assert bits_equal(model.w.grad, running_mean_(first.clone(), n, 2))


def test_running_mean_hook_clamps_opposite_infinities():
    model = Holder(1)
    RunningMeanGradients().attach(model)
    for sign in (1.0, -1.0):
        (model.w.float() * sign * 1e6).sum().backward()  # dL/dw = ±1e6 → ±inf in FP16
    assert model.w.grad.item() == 0.0  # (65504 − 65504)/2, not inf − inf = NaN


def test_running_mean_k_starts_at_one():
    with pytest.raises(ValueError, match="counts from 1"):
        running_mean_(torch.zeros(1), torch.ones(1), 0)


def test_the_smallest_scale_unscales_in_fp32_without_rounding_its_inverse_to_inf():
    # At scale 2^-16 the inverse 2^16 exceeds FP16's 65504: the product is formed in FP32 and
    # rounded once. ×2^16 is exact; FP16's smallest subnormal 2^-24 becomes 2^-8, 0.5 becomes
    # 32768, and 1.0 → 65536 does not fit: saturated at 65504, not inf.
    scaler = AutomaticLossScaler(init_scale=2.0**-16, min_scale=2.0**-16)
    _, grad = one_step(scaler, torch.tensor([2.0**-24, 0.5, 1.0, -(2.0**-10)]))
    assert grad.tolist() == [2.0**-8, 32768.0, FP16_MAX, -64.0]
    assert scaler.get_scale() == 2.0**-15  # the histogram (taken before unscaling) has no upper bin: doubled


def _tallied_steps(gpu: bool, compiled: bool):
    """Two steps of an FP16 model whose activation and weight gradients hold values in both bins,
    beyond ±65504, ±inf and (second step) a NaN, at scales 1/4 and 1/8: the gradients, the scaler's
    tallies and state after each, on the GPU's form (`compiling.gpu_paths`: one compiled graph per
    activation hook and one over every weight gradient; `compiled` False runs them as their eager
    source) or the CPU's (eager per-tensor ops)."""
    from hf_lowprec.compiling import gpu_paths

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).half()
    # An edge FP16 cannot hold (9000.3 rounds to 9000, a gradient below): both forms compare with the rounded one.
    scaler = AutomaticLossScaler(init_scale=0.25, min_scale=2.0**-4, bin_edge=9000.3).track(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(3, 8).half()
    upstream = torch.tensor([[3e4, -1.0, 9000.0, 1.0], [7e4, 0.5, -2.0, 1e-3], [-1.0, 2.0, 0.25, -6e4]])
    seen = []
    stance = contextlib.nullcontext() if compiled else torch.compiler.set_stance("force_eager")
    with stance, gpu_paths() if gpu else contextlib.nullcontext():
        for step in range(3):
            optimizer.zero_grad(set_to_none=True)
            out = model(x)
            (out.float() * upstream).sum().backward()
            model[0].bias.grad[:3] = torch.tensor([math.inf, -math.inf, 6e4])
            if step == 1:
                model[2].weight.grad[0, 0] = math.nan
            scaler.unscale_(optimizer)
            seen += [p.grad.clone() for p in model.parameters()]
            seen += [scaler._step.clone(), scaler._clipped.clone(), scaler._nan.clone()]
            scaler.update()
            seen += [torch.tensor(v) for k, v in scaler.state_dict().items() if k != "overflowing"]
            seen += [scaler._overflowing.clone(), scaler._new_episodes.clone(), scaler._nan.clone()]
    return seen


def test_the_gpu_form_of_als_gives_the_cpu_forms_bits_and_tallies(caplog, monkeypatch):
    """Eagerly and compiled (Inductor's C++ backend here; Triton on CUDA), the GPU's form of the
    tallies, clamps and unscaling: the CPU form's gradients, counts, NaN flag and scale, bit for bit.
    The case clips activation and weight gradients, so a lost count or clamp shows. A compile
    failure would fall back to the eager source with a warning: none is logged."""
    from hf_lowprec import compiling

    caplog.set_level(logging.WARNING)
    cpu = _tallied_steps(gpu=False, compiled=False)
    per_step = len(cpu) // 3  # 4 gradients, the step's counts, clipped rows and NaN flag, 7 state values, 3 more
    clipped, nan_flag = cpu[5], (cpu[6], cpu[per_step + 6])
    assert clipped.sum() > 0 and cpu[4][0] > 0 and nan_flag == (0, 1)  # clips, the upper bin, NaN on step 2
    assert cpu[2 * per_step - 1] == 0 and cpu[2 * per_step - 2].sum() > 0  # the flag reset; episodes counted
    ran = []
    real = compiling._run_compiled

    def spy(fn, *args):
        ran.append(fn.__name__)
        return real(fn, *args)

    for compiled in (False, True):
        monkeypatch.setattr(compiling, "_run_compiled", spy)
        gpu = _tallied_steps(gpu=True, compiled=compiled)
        assert len(gpu) == len(cpu)
        for index, (a, b) in enumerate(zip(gpu, cpu)):
            # A NaN gradient skips its step and is not kept: Inductor's clamp may write another
            # NaN payload than the eager op's. Everything else, NaN positions included, bit for bit.
            nan = a.isnan() if a.is_floating_point() else None
            if nan is not None and nan.any():
                assert torch.equal(nan, b.isnan()), (compiled, index)
                a, b = a.masked_fill(nan, 0), b.masked_fill(nan, 0)
            assert bits_equal(a, b), (compiled, index, a, b)
    assert not [r for r in caplog.records if "compiling" in r.getMessage()], caplog.text
    assert {"tally_activation", "unscale_half_together", "decide_scale"} <= set(ran), ran
    assert not compiling._broken, compiling._broken


def _running_mean_windows(gpu: bool, compiled: bool):
    """p.grad after each of three accumulation windows of an FP16 parameter whose micro-batch
    gradients overflow FP16 (±1e6 → ±inf, then clamped by the hook) with a +inf and a −inf
    micro-batch meeting, a second backward within one micro-batch, named micro-batch indices with
    one skipped, and `to_sums`; on the GPU's form (`compiling.gpu_paths`: one compiled graph per
    hook call; `compiled` False runs it as its eager source) or the CPU's (eager ops)."""
    from hf_lowprec.compiling import gpu_paths

    gen = torch.Generator().manual_seed(0)
    grads = [3e4 * (2 * torch.rand(64, generator=gen) - 1) for _ in range(4)]
    grads[0][:8], grads[1][:8], grads[2][4:12] = 1e6, -1e6, 7e4  # +inf, −inf, beyond ±65504
    model = Holder(64)
    accumulator = RunningMeanGradients().attach(model)
    seen = []
    stance = contextlib.nullcontext() if compiled else torch.compiler.set_stance("force_eager")
    with stance, gpu_paths() if gpu else contextlib.nullcontext():
        for window in range(3):
            if window == 1:
                accumulator.micro_batch(None)
            for index, g in enumerate(grads[: 3 if window < 2 else 2], start=1):
                if window == 1 and index == 2:
                    continue  # micro-batch 2 does not reach the parameter: M rescaled by 1/3 at index 3
                accumulator.micro_batch(index if window == 1 else None)
                accumulator.new_window()
                (model.w.float() * g).sum().backward()
                if window == 0 and index == 2:
                    (model.w.float() * grads[3]).sum().backward()  # a second backward: the same micro-batch
            if window > 0:
                accumulator.to_sums(model.parameters(), 4)
            seen.append(model.w.grad.clone())
            model.zero_grad(set_to_none=window == 1)
            accumulator.reset()
            accumulator.micro_batch(None)
    return seen, grads


def test_the_gpu_form_of_the_running_mean_hook_gives_the_cpu_forms_bits():
    """Eagerly and compiled (Inductor's C++ backend here; Triton on CUDA), the hook's one graph per
    call (clamp, rescale of M, g/k: `running_mean_hook_step`) gives the CPU form's gradients bit for
    bit, where +inf and −inf micro-batches meet as 0 (not NaN) and clamped values average."""
    from hf_lowprec import compiling

    cpu, grads = _running_mean_windows(gpu=False, compiled=False)
    clamped = [g.half().double().clamp(-FP16_MAX, FP16_MAX) for g in grads]
    # Window 1: M_3 = (c(g1) + c(g2) + c(g4) + c(g3)) / 3, each c FP16-rounded and clamped. Every
    # micro-batch rounds three times (the rescale, g/k, the sum), each error at most u·65504: over
    # four added gradients, 3·4·u·65504 bounds the error.
    reference = (clamped[0] + clamped[1] + clamped[3] + clamped[2]) / 3
    # (A NaN fails the bound too: +inf and −inf unclamped would meet as NaN in the first eight.)
    assert float((cpu[0].double() - reference).abs().max()) <= 3 * 4 * U16 * FP16_MAX
    for compiled in (False, True):
        gpu, _ = _running_mean_windows(gpu=True, compiled=compiled)
        for window, (a, b) in enumerate(zip(gpu, cpu, strict=True)):
            assert bits_equal(a, b), (compiled, window, a, b)
    assert not compiling._broken, compiling._broken


def test_each_running_mean_hook_call_is_one_launch_on_the_gpu_form():
    """Per parameter and micro-batch, the hook's clamp, rescale of M and g/k are one compiled graph
    on a GPU (none eager): they were one to three eager launches (clamp, mul_, div: issue #66)."""
    from hf_lowprec.compiling import gpu_paths
    from hf_lowprec.testing.launches import Launches

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).half()
    x = torch.randn(3, 8).half()
    plain = []
    with torch.compiler.set_stance("force_eager"), gpu_paths():
        for attached in (False, True):
            if attached:
                accumulator = RunningMeanGradients().attach(model)
            model.zero_grad(set_to_none=True)
            for micro_batch in range(3):
                loss = model(x).float().sum()
                with Launches() as counted:
                    loss.backward()
                if not attached:
                    plain.append(counted.total())
                    continue
                assert counted.total() - plain[micro_batch] == 4, counted.summary()  # one call per parameter
                assert counted.regions == {("step", "running_mean_hook_step"): 4}, counted.summary()
    assert accumulator.params()
