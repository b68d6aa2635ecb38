"""fp16-als's running mean under DDP on 2 gloo ranks, with `no_sync` accumulation: against stock's FP64 mean."""

from pathlib import Path

import pytest
import torch

from tests.deepspeed._launch import launch
from tests.distributed._running_mean_worker import NAMES, fp64_mean, samples

HERE = Path(__file__).resolve().parent
U16 = 2.0**-11  # FP16's unit roundoff
SUBNORMAL = 2.0**-25  # half FP16's smallest subnormal

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


@pytest.mark.parametrize(
    "use_b, sums",
    [("10,01", False), ("11,01", True)],
    ids=["declared-micro-batches", "accelerate-plugin-sums"],
)
def test_a_head_some_micro_batches_skip_takes_the_mean_over_every_micro_batch_on_every_rank(tmp_path, use_b, sums):
    """Head `b` is reached by some micro-batches ("10,01": rank 0's first, rank 1's last). Declared: its gradient
    was each rank's one micro-batch gradient averaged (2.0× stock's mean over the 4 micro-batches). Under the
    plugin's sums ("11,01"), rank 1 rescaled the all-reduced gradient by 1/2 after it and rank 0 did not: the
    ranks stepped on gradients a factor 2 apart. Each rank's mean rounds as in one process (2u·max|g| + 3·2⁻²⁵,
    tests/strategies/test_fp16_accumulation.py); DDP halves (exact) and sums in FP16, one more rounding of at
    most u·max|g| and 2⁻²⁵: 3u·max|g| + 4·2⁻²⁵ (the plugin's sum is the mean over the loss division 2 undone
    per rank, the same). Both ranks step on the same bits."""
    results = launch(HERE / "_running_mean_worker.py", tmp_path, ["--use-b", use_b, *(["--sums"] if sums else [])])
    assert [r["world_size"] for r in results] == [2, 2]
    reference, largest = fp64_mean(samples([int(flag) for flags in use_b.split(",") for flag in flags]))
    for name in NAMES:
        ranks = [torch.tensor(r["grads"][name], dtype=torch.float64) for r in results]
        assert torch.equal(ranks[0].view(torch.int64), ranks[1].view(torch.int64)), name  # the same bits
        assert torch.isfinite(ranks[0]).all(), name
        error = (ranks[0] - reference[name].flatten()).abs()
        bound = 3 * U16 * largest[name].flatten() + 4 * SUBNORMAL
        assert (error <= bound).all(), (name, float((error / largest[name].flatten()).max()))
