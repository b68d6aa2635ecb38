"""DDP's construction broadcast is not a weight written outside the optimizer (`_ddp_broadcast_worker.py`,
2 gloo ranks): no master or compensation restarts, and the optimizer created before or after the wrap
holds the same values."""

from pathlib import Path

import pytest

from tests.deepspeed._launch import launch

HERE = Path(__file__).resolve().parent

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def test_the_wrap_restarts_nothing_in_either_order(tmp_path):
    results = launch(HERE / "_ddp_broadcast_worker.py", tmp_path, [])
    assert [r["world_size"] for r in results] == [2, 2]
    for rank, result in enumerate(results):
        for key, case in result["cases"].items():
            assert "error" not in case, f"rank {rank} {key}: {case.get('error')}"
            assert case["restarts"] == {}, f"rank {rank} {key}: DDP's broadcast restarted {case['restarts']}"
        for name in ("fp16-als", "collage-plus"):
            before, after = (result["cases"][f"{name} optimizer_first={first}"]["held"] for first in (False, True))
            assert before == after, f"rank {rank} {name}: the held values depend on the order of wrap and optimizer"
    assert results[0]["cases"] == results[1]["cases"]
