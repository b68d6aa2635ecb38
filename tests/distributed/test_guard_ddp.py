"""The guard under DDP (2 gloo ranks, `_guard_worker.py`): a non-finite gradient on one rank only.

Rank 1 alone gets an infinite gradient element after DDP's all-reduce at two steps. The skip
flag is agreed over the ranks, so both ranks skip both steps; the two faulty steps reach the
guard's `rollback_after` (2), so both roll back at the next check, to the same snapshot; and
both end with bit-identical, finite parameters.
"""

from pathlib import Path

import pytest

from tests.deepspeed._launch import launch

HERE = Path(__file__).resolve().parent

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("guard_ddp")
    results = launch(HERE / "_guard_worker.py", out, [])
    assert [r["world_size"] for r in results] == [2, 2]
    return results


@pytest.mark.parametrize("strategy", ["bf16-mixed", "fp8-lm-o2"])
def test_a_nonfinite_gradient_on_one_rank_is_skipped_and_rolled_back_on_both(ranks, strategy):
    cases = [r["cases"][strategy] for r in ranks]
    for rank, case in enumerate(cases):
        assert "error" not in case, f"rank {rank}: {case.get('error')}"
        assert case["skipped"] == 2, f"rank {rank} skipped {case['skipped']} steps, not the 2 injected"
        assert case["faulty"] == 2
        assert case["rollbacks"] == 1 and case["actions"] == ["rollback"], case
        assert case["finite"]
    assert cases[0]["digest"] == cases[1]["digest"], "the ranks' parameters differ after the guard acted"
