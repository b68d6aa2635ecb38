"""Weights written before the next step under FSDP2 (2 gloo ranks, `_fsdp2_written_worker.py`): a
callback's `on_train_begin` write in a fresh Trainer run and after a resume, a write after
`PrecisionPlugin.prepare` on Accelerate's FSDP2 and after `load_sharded`. The next step starts from
the written weights, as FP32 AdamW does, where fp16-als's FP32 masters and collage-plus's δθ undid
the write; a sharded checkpoint still resumes bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.deepspeed._launch import launch

HERE = Path(__file__).resolve().parent
NAMES = ("fp16-als", "collage-plus")
WRITES = ("trainer-fresh", "trainer-resume", "loop-accelerate", "loop-resume")
# The unit roundoff of each strategy's weights: loading FP32 weights W rounds them once to the
# nearest, |θ − W| ≤ u·|W|, and FP32 AdamW at lr 0 keeps θ as written.
UNIT_ROUNDOFF = {"fp16-als": torch.finfo(torch.float16).eps / 2, "collage-plus": torch.finfo(torch.bfloat16).eps / 2}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2-written")
    return launch(HERE / "_fsdp2_written_worker.py", out, ["--names", ",".join(NAMES)])


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("write", WRITES)
@pytest.mark.parametrize("name", NAMES)
def test_weights_written_before_the_next_step_are_where_fsdp2_continues(ranks, name: str, write: str) -> None:
    # Before the fix, the optimizer's load of its own state at Accelerate's wrap (and the state moved
    # onto the shards) forgot which weights had been written, and load_sharded recorded none: after a
    # step at lr 0, fp16-als was 0.134 from W (its masters came back; W's FP16 rounding is 3.05e-5)
    # and collage-plus 3.6e-4 (the old δθ added; W's BF16 rounding 2.4e-4).
    for rank, result in enumerate(ranks):
        case = result["cases"][f"{name}/{write}"]
        assert "error" not in case, case.get("error")
        assert case["kept_written"], f"rank {rank}: θ is not what the write left ({case})"
        assert case["gap"] == case["rounding"] <= UNIT_ROUNDOFF[name] * case["largest"], case


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", NAMES)
def test_a_sharded_checkpoint_still_resumes_bit_for_bit(ranks, name: str) -> None:
    # load_sharded writes the state in place (torch.distributed.checkpoint) and then loads it into the
    # optimizer: a checkpoint's load, not the optimizer's own state handed back; its masters and δθ stay.
    for result in ranks:
        case = result["cases"][f"{name}/loop-resume-exact"]
        assert "error" not in case, case.get("error")
        assert case["resumed_bit_for_bit"]
