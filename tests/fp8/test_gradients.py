"""FP8 gradients with automatic scaling μ (FP8-LM §2.1; docs/algorithms.md §3)."""

import contextlib
import io
import itertools
import math

import pytest
import torch

from hf_lowprec.fp8 import GradientAutoScaler, dequantize, quantize_gradient

E4M3 = torch.float8_e4m3fn


def gradients(seed: int, n: int = 3, numel: int = 4096) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) * 10.0 ** -(i + 2) for i in range(n)]


def one_step(scaler: GradientAutoScaler, grads: list[torch.Tensor]) -> float:
    """Quantize a step's gradients at the current μ, as the strategies do, then update μ."""
    for grad in grads:
        _, _, saturated = quantize_gradient(grad, scaler.mu, E4M3)
        scaler.record(saturated, grad.numel())
    return scaler.update()


def test_quantize_gradient_scale_and_error():
    grad = gradients(0, n=1)[0]
    payload, scale, saturated = quantize_gradient(grad, 1.0, E4M3)
    assert payload.dtype == E4M3 and saturated.item() == 0
    assert math.log2(scale.item()) == int(math.log2(scale.item()))
    assert 224 < (grad.abs().max() * scale).item() <= 448
    normal = grad.abs() * scale >= 2**-6
    rel = ((dequantize(payload, scale) - grad).abs() / grad.abs())[normal]
    assert rel.max() <= 2**-4  # half an ulp of a 4-bit significand


def test_saturation_halves_mu_on_the_next_step():
    # μ = 2 doubles every value past the top binade: about half of a Gaussian's tail
    # beyond amax/2 saturates, far above 0.001 %.
    scaler = GradientAutoScaler(init_mu=2.0, interval=3)
    assert one_step(scaler, gradients(1)) == 1.0
    assert scaler.last_saturated_share > 1e-5
    assert scaler.clean_steps == 0


def test_interval_clean_steps_double_mu():
    scaler = GradientAutoScaler(init_mu=0.5, interval=3)
    assert [one_step(scaler, gradients(s)) for s in range(3)] == [0.5, 0.5, 1.0]
    assert scaler.clean_steps == 0
    # μ = 1 never saturates with per-tensor amax scales: the next doubling needs 3 more steps.
    assert [one_step(scaler, gradients(s)) for s in range(3, 6)] == [1.0, 1.0, 2.0]
    assert one_step(scaler, gradients(6)) == 1.0


def test_threshold_is_a_share_not_a_count():
    scaler = GradientAutoScaler(init_mu=1.0, interval=1000)
    scaler.record(torch.tensor(10), 1_000_000)  # 1e-5 exactly: not above the threshold
    assert scaler.update() == 1.0 and scaler.clean_steps == 1
    scaler.record(torch.tensor(11), 1_000_000)
    assert scaler.update() == 0.5 and scaler.clean_steps == 0


def test_state_round_trip_continues_identically():
    scaler = GradientAutoScaler(init_mu=2.0, interval=4)
    for s in range(3):
        one_step(scaler, gradients(s))
    buffer = io.BytesIO()
    torch.save(scaler.state_dict(), buffer)
    buffer.seek(0)
    resumed = GradientAutoScaler(interval=4)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert (resumed.mu, resumed.clean_steps) == (scaler.mu, scaler.clean_steps) == (1.0, 2)
    assert [one_step(scaler, gradients(s)) for s in range(3, 8)] == [
        one_step(resumed, gradients(s)) for s in range(3, 8)
    ]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"init_mu": 0.0}, "init_mu"),
        ({"interval": 0}, "interval"),
        ({"threshold": 1.5}, "threshold"),
        ({"init_mu": 4.0, "max_mu": 2.0}, "max_mu"),
    ],
)
def test_bad_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GradientAutoScaler(**kwargs)


def test_bad_saved_state_raises():
    with pytest.raises(ValueError, match="mu"):
        GradientAutoScaler().load_state_dict({"mu": float("inf"), "clean_steps": 0})


def test_the_gpu_path_updates_mu_in_one_compiled_graph_with_the_eager_bits():
    """On a GPU the update (tally, share, halving, doubling, a skipped step) is one compiled graph
    (`compiling.gpu_paths` sends these CPU tensors down that path, and Inductor compiles it for
    real here): the same μ, clean-step count and share as the eager rule, step by step, over
    steps that halve μ, double it, and are skipped."""
    from hf_lowprec.compiling import compiler_missing, gpu_paths
    from hf_lowprec.testing.launches import Launches

    if compiler_missing("cpu"):
        pytest.skip(f"no compiler for Inductor's CPU kernels here: {compiler_missing('cpu')}")
    # (saturated counts of two plain records, of one flagged record, the flag)
    steps = [(0, 0, 0.0), (7, 0, 0.0), (0, 5, 1.0), (0, 0, 0.0), (0, 0, 0.0), (0, 9, 0.0), (0, 0, 1.0), (1, 0, 0.0)]
    scalers = {"eager": GradientAutoScaler(init_mu=1.0, interval=2), "gpu": GradientAutoScaler(init_mu=1.0, interval=2)}
    seen = {"eager": [], "gpu": []}
    for plain, flagged_count, flag_value in steps:
        for path, scaler in scalers.items():
            flag = torch.tensor(flag_value)
            with gpu_paths() if path == "gpu" else contextlib.nullcontext():
                scaler.record(torch.tensor(plain), 100_000)
                scaler.record(torch.tensor(0), 100_000)
                scaler.record(torch.tensor(flagged_count), 100_000, unless=flag)
                mu = scaler.update(unless=flag)
            seen[path].append((mu.item(), scaler.clean_steps, scaler.last_saturated_share))
    assert seen["gpu"] == seen["eager"]
    mus = [m for m, _, _ in seen["eager"]]
    pairs = list(itertools.pairwise(mus))
    assert any(b < a for a, b in pairs) and any(b > a for a, b in pairs)  # it halved and doubled
    assert seen["eager"][2] == seen["eager"][1]  # the skipped step kept μ, the count and the share
    scaler = scalers["gpu"]
    with gpu_paths(), Launches() as counted:
        scaler.record(torch.tensor(0), 100_000, unless=torch.tensor(0.0))
        scaler.update(unless=torch.tensor(0.0))
    assert (counted.total(), dict(counted.graphs)) == (1, {"step": 1}), counted.summary()
