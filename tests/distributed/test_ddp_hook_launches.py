"""fp8-lm-o2's FP8 all-reduce hook under DDP issues a number of launches per bucket that does not
grow with the weights the bucket holds, nor does fp8-lm-o3's FP8 all-reduce of its FP8 weights'
gradients (`_ddp_hook_launches_worker.py`, 2 gloo ranks, tiny Llamas of 2 and 4 layers, counted on
the paths a GPU takes). Both handed each reduced FP8 gradient to the optimizer with two copies per
weight (O3 also widened each gradient on its own): O2's FP16 bucket took 109 launches with 14
weights, 137 with 28; O3's reduction 95 and 123."""

from pathlib import Path

import pytest

from tests.deepspeed._launch import launch

HERE = Path(__file__).resolve().parent

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    """Each rank's counts (one launch of the worker serves both tests)."""
    results = launch(HERE / "_ddp_hook_launches_worker.py", tmp_path_factory.mktemp("launches"), [])
    assert [r["world_size"] for r in results] == [2, 2]
    for result in results:
        assert "error" not in result["buckets"], result["buckets"]["error"]
    return [result["buckets"] for result in results]


def test_the_fp8_allreduce_hook_launches_per_bucket_do_not_grow_with_its_weights(counted):
    for buckets in counted:
        shallow, deep = ({b["dtype"]: b for b in buckets[n]} for n in ("2", "4"))
        # One FP16 bucket (the FP8 weights' prescaled gradients) and one FP32 bucket, at both depths.
        assert shallow.keys() == deep.keys() == {"torch.float16", "torch.float32"}, (shallow, deep)
        for dtype, bucket in shallow.items():
            assert deep[dtype]["gradients"] > bucket["gradients"], (dtype, bucket, deep[dtype])
            assert deep[dtype]["launches"] == bucket["launches"], (
                f"{dtype} bucket: {bucket['launches']} launches for {bucket['gradients']} gradients, "
                f"{deep[dtype]['launches']} for {deep[dtype]['gradients']}\n{deep[dtype]['top']}"
            )


def test_the_o3_fp8_allreduce_launches_do_not_grow_with_the_weights(counted):
    for buckets in counted:
        shallow, deep = buckets["o3 2"], buckets["o3 4"]
        assert deep["gradients"] > shallow["gradients"], (shallow, deep)
        assert deep["launches"] == shallow["launches"], (shallow, deep["launches"], deep["top"])
