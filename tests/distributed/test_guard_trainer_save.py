"""A checkpoint save is the guard's snapshot point on every rank of a DDP Trainer
(`_guard_trainer_save_worker.py`, 2 gloo ranks): the Trainer writes the optimizer's state on rank 0
alone, and the rank that did not write it must still roll back to the same snapshot."""

from pathlib import Path

import pytest

from tests.deepspeed._launch import launch

HERE = Path(__file__).resolve().parent

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def test_every_rank_rolls_back_to_the_save_and_the_replicas_stay_equal(tmp_path):
    results = launch(HERE / "_guard_trainer_save_worker.py", tmp_path, [])
    assert [r["world_size"] for r in results] == [2, 2]
    cases = [r["case"] for r in results]
    for rank, case in enumerate(cases):
        assert "error" not in case, f"rank {rank}: {case.get('error')}"
        assert case["actions"] == [["rollback", 5]], f"rank {rank}: {case['actions']}"
    assert cases[0]["digest"] == cases[1]["digest"], "the ranks' parameters differ after the guard acted"
