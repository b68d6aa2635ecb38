"""Every registered strategy under torch DDP on 2 gloo ranks, against one process, in one launch.

`_ddp_worker.py` trains each strategy DDP carries for 3 steps (2 samples per rank) and, on the
side, the two one-process references on the same global batch of 4: "halves" (rank 1: the two
half batches' gradients accumulated, then halved, which is the gradient DDP's all-reduce forms)
and "whole" (rank 0: the 4 samples in one batch). A refused strategy must be refused before any
step. Losses travel as FP32 bit patterns, compared with `math.isclose` or bit for bit, and a NaN
fails every comparison (checked finite first).
"""

import math
import struct
from pathlib import Path

import pytest
import torch

from hf_lowprec import available_strategies, get_strategy
from hf_lowprec.engines.ddp import ddp_support
from tests.deepspeed._launch import launch
from tests.helpers import e4m3_half_ulp, first_order_bound

HERE = Path(__file__).resolve().parent
STEPS = 3
TOKENS = 4 * 31  # per step: 4 sequences of 32, the first token has no label
E4M3_MAX = 448.0

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    results = launch(HERE / "_ddp_worker.py", out, [])
    assert [r["world_size"] for r in results] == [2, 2]
    tensors = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return results, tensors


def supported() -> list[str]:
    return [n for n in available_strategies() if ddp_support(get_strategy(n)) is None]


def fp8_hooked() -> list[str]:
    """The strategies that replace DDP's all-reduce by their own (FP8-LM's FP8 all-reduce)."""
    return [n for n in supported() if get_strategy(n).ddp_comm_hook() is not None]


def floats(bit_patterns: list[int]) -> list[float]:
    values = [struct.unpack("<f", struct.pack("<i", b))[0] for b in bit_patterns]
    assert all(math.isfinite(v) for v in values), values  # NaN or inf fails here, before any comparison
    return values


def test_every_strategy_trains_under_ddp_or_is_refused_before_training(ranks):
    results, _ = ranks
    assert supported(), "no strategy trains under DDP: this test would check nothing"
    for result in results:
        for name in available_strategies():
            case = result["cases"][name]
            assert "error" not in case, f"{name}:\n{case['error']}"
            if ddp_support(get_strategy(name)) is None:
                assert len(floats(case["losses"])) == STEPS, name
                assert case["hooked"] == (name in fp8_hooked()), name
            else:
                assert case["refused"] and case["message"] == ddp_support(get_strategy(name)), name


def test_ddp_equals_one_process_on_the_same_halves_bit_for_bit(ranks):
    """DDP on 2 ranks averages gradients as fl(g₀/2 + g₁/2): halving is exact (power of two, no
    subnormals at these magnitudes) and a sum of two values is the same in either order, so it is
    fl(g₀ + g₁)/2, what one process forms from the same two half batches accumulated. With equal
    gradients every optimizer (stochastic rounding included: same seed, same stream) steps
    identically: losses and every weight's bits agree, on both ranks. fp16-als averages the
    micro-batches itself (running mean) and sums its loss-scale histogram over the ranks."""
    results, _ = ranks
    exact = [n for n in supported() if n not in fp8_hooked()]
    for name in exact:
        ddp = [r["cases"][name] for r in results]
        halves = ddp[1]["reference"]
        floats(halves["losses"])
        for case in ddp:
            assert case["losses"] == halves["losses"], (name, floats(case["losses"]), floats(halves["losses"]))
            assert case["digest"] == halves["digest"], name


def test_ddp_first_loss_equals_the_whole_batch_within_summation_rounding(ranks):
    """Step 1 has the same weights and data: one process averages 124 per-token FP32 losses in one
    sum, DDP two sums of 62 and their mean. Every per-token loss is positive, so each FP32 sum of
    n terms is within n·2⁻²⁴ relative of the exact one: |Δ| ≤ 2·124·2⁻²⁴·L."""
    results, _ = ranks
    for name in supported():
        ddp = floats(results[0]["cases"][name]["losses"])[0]
        whole = floats(results[0]["cases"][name]["reference"]["losses"])[0]
        assert math.isclose(ddp, whole, rel_tol=2 * TOKENS * 2.0**-24, abs_tol=0.0), (name, ddp, whole)


def test_ddp_later_losses_within_the_first_order_bound_of_the_whole_batch(ranks):
    results, _ = ranks
    for name in supported():
        ddp = floats(results[0]["cases"][name]["losses"])
        reference = results[0]["cases"][name]["reference"]
        whole = floats(reference["losses"])
        for step in range(1, STEPS):
            bound = first_order_bound(reference["norms"], step)
            assert abs(ddp[step] - whole[step]) <= bound, (name, step, ddp, whole, bound)


def test_fp8_all_reduce_inside_ddp_is_the_shared_scale_mean(ranks):
    """FP8-LM's hook on DDP's buckets, step 1: every rank receives the same FP8 mean, within one E4M3
    rounding per rank's cast plus one for the sum of the exact mean of the ranks' local
    gradients (per element, in the units of the shared scale s = N·μ·s_g of each parameter), and
    the hook ran on every parameter at every step.

    μ starts at 1 (post-scaling), so the sum of two payloads may exceed the E4M3 maximum and
    saturate at ±448 (counted, and μ halves for the next step): the reference is the exact mean
    clamped to ±448/s. No rank's own payload saturates (s_g is the smallest rank's scale), and
    clamping is 1-Lipschitz, so the rounding bound holds against the clamped mean."""
    results, tensors = ranks
    assert fp8_hooked(), "no strategy registers the FP8 all-reduce: this test would check nothing"
    for name in fp8_hooked():
        for result in results:
            case = result["cases"][name]
            assert case["fp8_reduced_elements"] == STEPS * case["numel"], name
        buckets = [t[name] for t in tensors]
        assert buckets[0], name
        for b0, b1 in zip(*buckets):
            assert torch.equal(b0["reduced"].view(torch.int32), b1["reduced"].view(torch.int32)), name
            assert b0["scales"] is not None, f"{name}: a bucket fell back to one scale"
            s = torch.repeat_interleave(b0["scales"].double(), torch.tensor(b0["numels"]))
            local = b0["local"].double()  # (ranks, elements)
            sent = local * s / local.shape[0]
            bound = (e4m3_half_ulp(sent).sum(0) + e4m3_half_ulp(sent.sum(0))) / s
            exact = torch.minimum(torch.maximum(local.mean(0), -E4M3_MAX / s), E4M3_MAX / s)
            error = (b0["reduced"].double() - exact).abs()
            assert bool((error <= bound * (1 + 1e-6)).all()), (name, float((error / bound).max()))


@pytest.mark.parametrize("case", ["fp8-lm-o2+rowwise"])
def test_an_fp8_recipe_trains_under_ddp_as_one_process_on_the_same_halves(ranks, case):
    """The recipe lives inside the FP8 layers; DDP's FP8 all-reduce sees only gradients: as for
    tensorwise (below), step 1 agrees bit for bit with one process on the same halves, later
    steps within `first_order_bound`, and the ranks end with the same model."""
    results, _ = ranks
    for result in results:
        assert "error" not in result["cases"][case], result["cases"][case]["error"]
    halves = results[1]["cases"][case]["reference"]
    norms = results[0]["cases"][case]["reference"]["norms"]
    for result in results:
        assert result["cases"][case]["hooked"], case
        ddp, one = floats(result["cases"][case]["losses"]), floats(halves["losses"])
        assert result["cases"][case]["losses"][0] == halves["losses"][0], (case, ddp, one)
        for step in range(1, STEPS):
            assert abs(ddp[step] - one[step]) <= first_order_bound(norms, step), (case, step, ddp, one)
    assert results[0]["cases"][case]["digest"] == results[1]["cases"][case]["digest"]


def test_fp8_hooked_losses_against_one_process_on_the_same_halves(ranks):
    """Step 1 sees the same weights and half batches: the losses agree bit for bit. Later steps
    differ by the FP8 all-reduce's rounding (checked per element above) against one per-tensor FP8
    quantization of the accumulated gradient: held to `first_order_bound`."""
    results, _ = ranks
    for name in fp8_hooked():
        halves = results[1]["cases"][name]["reference"]
        norms = results[0]["cases"][name]["reference"]["norms"]
        for result in results:
            ddp = floats(result["cases"][name]["losses"])
            one = floats(halves["losses"])
            assert result["cases"][name]["losses"][0] == halves["losses"][0], (name, ddp, one)  # bits
            for step in range(1, STEPS):
                assert abs(ddp[step] - one[step]) <= first_order_bound(norms, step), (name, step, ddp, one)
        assert results[0]["cases"][name]["digest"] == results[1]["cases"][name]["digest"], name


def test_fp16_als_ranks_agree_on_the_loss_scale(ranks):
    """Only rank 0's activation gradients reach ALS's upper bin: with DDP's group the histogram is
    summed and both ranks halve the scale (16 → 8); alone, rank 1 would double it (→ 32) and the
    ranks' scaled gradients would no longer add up."""
    results, _ = ranks
    assert [r["loss_scale_agreement"]["group"] for r in results] == [8.0, 8.0]
    assert [r["loss_scale_agreement"]["alone"] for r in results] == [8.0, 32.0]
