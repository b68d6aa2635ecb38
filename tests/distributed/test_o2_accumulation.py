"""fp8-lm-o2 under DDP with gradient accumulation (`_o2_accumulation_worker.py`, 2 gloo ranks, 2
micro-batches): the FP8 weights' gradients accumulate in FP16 at a power of two σ
(`FP8CommState.prescale`) that follows the largest micro-batch, so a later micro-batch 2^16 times
larger than the first does not overflow FP16 (the step was skipped), and one after an all-zero first
micro-batch does not underflow (at σ = 1, 50 to 98 % of the elements were 0). The FP8 gradient the
optimizer holds is the ranks' mean within the all-reduce's rounding, and the single-process sink's
accumulation of the same four micro-batches within both roundings."""

from pathlib import Path

import pytest
import torch

from hf_lowprec import get_strategy
from hf_lowprec.fp8 import FP8Linear
from tests.deepspeed._launch import launch
from tests.distributed._o2_accumulation_worker import CASES, micro_batches
from tests.helpers import e4m3_half_ulp, tiny_gpt2

HERE = Path(__file__).resolve().parent
E4M3_MAX = 448.0

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("o2_accumulation")
    results = launch(HERE / "_o2_accumulation_worker.py", out, [])
    assert [r["world_size"] for r in results] == [2, 2]
    return results, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def fp16_error(grads: torch.Tensor) -> torch.Tensor:
    """Bound on one rank's FP16 accumulation of its micro-batches' gradients `grads` (K × shape) at
    σ, σ·max|gₖ| in (8, 16] for the largest: each product gₖ·σ and each sum rounds once (2⁻¹¹ of
    the value, or half FP16's subnormal step 2⁻²⁵/σ ≤ 2⁻²⁸·max|gₖ|), and each lowering of σ
    multiplies the sum by a power of two (exact, or one rounding under FP16's normal range)."""
    partial = grads.cumsum(0)
    floor = 3 * len(grads) * 2.0**-28 * grads.abs().max()
    return 2.0**-11 * (grads.abs().sum(0) + partial.abs().sum(0)) + floor


def ddp_bound(local: list[torch.Tensor], scale: torch.Tensor) -> torch.Tensor:
    """The existing single-micro-batch bound (tests/distributed/test_o2_small_gradients.py) with
    each rank's FP16 error of its accumulation: E4M3 half-ulps of the two ranks' casts at s/N and of
    their sum, plus the FP16 errors, (1 + 2⁻³) times (they move each cast's half-ulp by 2⁻⁴ of
    themselves), in units of the stored scale s = N·μ·s_g (N = 2, μ = 1)."""
    sent = [g.sum(0) * scale / 2 for g in local]
    fp8 = (sum(e4m3_half_ulp(y) for y in sent) + e4m3_half_ulp(sum(sent))) / scale
    return fp8 + (1 + 2.0**-3) * sum(fp16_error(g) for g in local) / 2


def single_bound(parts: list[torch.Tensor]) -> torch.Tensor:
    """The single-process sink re-quantizes the FP32 sum after each micro-batch at s = 2^k with
    amax·s in (224, 448]: one E4M3 rounding each, max(2⁻⁴|P|, 2⁻¹⁰/s) ≤ max(2⁻⁴|P|, 2⁻¹⁰·amax/224)
    for partial sum P, (1 + 2⁻³) times for the errors before it that move amax and P."""
    partial, total = torch.zeros_like(parts[0]), torch.zeros_like(parts[0])
    for part in parts:
        partial = partial + part
        total += torch.maximum(2.0**-4 * partial.abs(), 2.0**-10 * partial.abs().max() / 224 + 0 * partial)
    return (1 + 2.0**-3) * total


def single_process(factors: tuple[float, float]) -> dict[str, torch.Tensor]:
    """The one-process sink (no process group) on the four micro-batches, each loss halved (the
    ranks' mean): the FP8 gradients its optimizer holds, in real units."""
    strategy = get_strategy("fp8-lm-o2")
    model = strategy.prepare_model(tiny_gpt2())
    _optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)  # kept alive: the sinks hold it weakly
    for k, factor in enumerate(factors):
        for rank in range(2):
            ids = micro_batches(rank)[k]
            with strategy.forward_context():
                (model(input_ids=ids, labels=ids).loss * factor / 2).backward()
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, FP8Linear):
            payload, scale = strategy.backward_grads.stored([m.weight])[0]
            out[name] = payload.double() / scale.double()
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_o2_ddp_accumulation_keeps_the_mean_of_the_micro_batches_within_the_fp8_rounding(ranks, case):
    """Per element, |got − clamp(mean)| within `ddp_bound` (μ starts at 1, so the sum may saturate at
    ±448/s: clamping is 1-Lipschitz), the step not skipped, and |got − clamp(single process)| within
    `ddp_bound` + `single_bound` (the one-process micro-batch gradients are the ranks' halved,
    exactly: halving a loss halves every gradient exactly, and the FP8 GEMMs' scales follow)."""
    results, tensors = ranks
    for result in results:
        assert "error" not in result["cases"][case], result["cases"][case]["error"]
    skipped = [r["cases"][case]["skipped"] for r in results]
    single = single_process(CASES[case])
    worst, worst_single, nonfinite, flushed, nonzero = 0.0, 0.0, 0, 0, 0
    for name, (got, scale) in tensors[0][case]["got"].items():
        other = tensors[1][case]["got"][name][0]
        assert torch.allclose(got, other, rtol=0, atol=0, equal_nan=True), f"{name}: the ranks hold different gradients"
        nonfinite += int((~torch.isfinite(got)).sum())
        local = [t[case]["reference"][name] for t in tensors]
        bound = ddp_bound(local, scale)
        limit = E4M3_MAX / scale
        exact = torch.clamp((local[0].sum(0) + local[1].sum(0)) / 2, -limit, limit)
        worst = max(worst, float(((got - exact).abs() / bound).max()))
        flushed += int(((got == 0) & (exact != 0)).sum())
        nonzero += int((exact != 0).sum())
        halves = [local[r][k] / 2 for k in range(2) for r in range(2)]
        both = bound + single_bound(halves)
        worst_single = max(worst_single, float(((got - torch.clamp(single[name], -limit, limit)).abs() / both).max()))
    print(
        f"{case}: skipped {skipped}, {nonfinite} non-finite elements, {flushed} of {nonzero} nonzero flushed to 0,"
        f" worst error / bound {worst:.3g}, against the single process {worst_single:.3g}"
    )
    assert nonfinite == 0, f"{case}: {nonfinite} non-finite elements in the reduced gradients (an FP16 overflow)"
    assert skipped == [False, False], f"{case}: the step was skipped (an FP16 overflow), worst error / bound {worst}"
    assert worst <= 1, f"{case}: worst error {worst:.3g} times the bound"
    assert worst_single <= 1, f"{case}: {worst_single:.3g} times the bound from the single-process sink"
