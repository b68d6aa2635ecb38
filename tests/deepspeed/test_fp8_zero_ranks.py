"""fp8-lm-o3 under DeepSpeed ZeRO-2 on 2 ranks: FP8 storage, export, clipping (see `_o3_worker.py`).

The same worker runs on gloo (CPU, every run) and on NCCL (two CUDA devices, `make gpu-check`):
every tensor of the FP8 ZeRO collectives is made on the parameters' device, which NCCL checks.
"""

import math
from pathlib import Path

import pytest
import torch

from tests.deepspeed._launch import launch

HERE = Path(__file__).resolve().parent
CLIP = 0.05  # far below the tiny model's first gradient norm (≈1.6): clipping is active
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
NCCL = pytest.param(
    "nccl",
    id="nccl",
    marks=[pytest.mark.cuda, pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA devices")],
)

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


@pytest.fixture(scope="module", params=["gloo", NCCL])
def ranks(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"o3_{request.param}")
    results = launch(HERE / "_o3_worker.py", out, ["--clip", str(CLIP), "--backend", request.param])
    for r in results:
        for case in ("train", "clip"):
            assert "error" not in r[case], r[case]["error"]
    return results


def test_non_owned_fp8_weights_take_one_byte(ranks):
    owned = [set(r["train"]["owned"]) for r in ranks]
    names = ranks[0]["train"]["export_fp8_names"]
    assert owned[0].isdisjoint(owned[1]) and owned[0] | owned[1] == set(range(len(names)))
    for r in ranks:
        t = r["train"]
        assert t["non_owned_numel"] > 0
        assert t["non_owned_dtypes"] == ["torch.float8_e4m3fn"]
        # 1 byte per element, half of the FP16 container that held them before.
        assert t["non_owned_bytes"] == t["non_owned_bytes_after_steps"] == t["non_owned_numel"]
        assert 2 * t["non_owned_bytes"] == t["non_owned_bytes_fp16_storage"]


def test_ranks_compute_with_the_same_fp8_weights_after_every_step(ranks):
    assert ranks[0]["train"]["digests"] == ranks[1]["train"]["digests"]
    assert len(ranks[0]["train"]["digests"]) == 3


def test_the_fp8_part_steps_once_per_deepspeed_step(ranks):
    # Two groups: DeepSpeed calls the client optimizer twice per step; the owners' FP8 weights
    # and the groups' parameters must both have taken exactly 3 AdamW steps.
    for r in ranks:
        assert r["clip"]["free"]["calls"] == 2
        assert r["train"]["fp8_steps"] == [3] and r["train"]["group_steps"] == [3]


def test_export_equals_the_owners_masters_for_every_weight(ranks):
    """save_pretrained (rank 0) of `exported_state_dict` after ZeRO-2 on 2 ranks, reloaded by both
    ranks: every FP8 weight equals its owner's FP32 master bit for bit, every other weight the
    trained one; `full_precision_state_dict` gathers the same masters."""
    names = set(ranks[0]["train"]["export_fp8_names"])
    checked = set()
    for r in ranks:
        t = r["train"]
        assert all(t["export_equal_owned"].values()), t["export_equal_owned"]
        assert all(t["full_equal_owned"].values()), t["full_equal_owned"]
        assert t["export_equal_other"]
        checked |= set(t["export_equal_owned"])
        # Without the gather, the weights rank 0 does not own were exported as FP8 values: the
        # error this export removes (E4M3 keeps 4 significant bits).
        assert 2**-7 < t["fp8_export_max_rel_error"] <= 2**-4
    assert checked == names


def test_gradient_clipping_covers_the_fp8_gradients(ranks):
    """`gradient_clipping` C under ZeRO-2 equals the reference clipping of all gradients.

    Two engines from the same model and batch, without and with clipping; the gradients the
    client optimizer updates with on the first step are g (unclipped) and g' (clipped). The
    reference is g' = c·g for every gradient, dense partitions and FP8 ones alike, with
    c = C / (‖g‖ + 1e-6) and ‖g‖ the FP64 norm over both ranks' gradients (each partition and
    each FP8 weight lives on one rank). Tolerance per element 2^-20 relative: the coefficient is
    computed in FP32 from FP32 norms (a few 2^-24), and each gradient is rounded at most three
    times (DeepSpeed's dense clip, our correction, and the division of an FP8 scale).
    DeepSpeed's reported norm (`get_global_grad_norm`) must be ‖g‖ (FP32 sums: 1e-6).
    """
    free_sq = sum(
        sum(x * x for x in r["clip"]["free"]["dense"])
        + sum(x * x for g in r["clip"]["free"]["fp8"].values() for x in g)
        for r in ranks
    )
    norm = math.sqrt(free_sq)
    c = CLIP / (norm + 1e-6)
    assert c < 0.1  # clipping is active
    for r in ranks:
        free, clipped = r["clip"]["free"], r["clip"]["clipped"]
        for run in (free, clipped):
            assert run["engine_norm"] == pytest.approx(norm, rel=1e-6)
        assert free["fp8"] and free["fp8"].keys() == clipped["fp8"].keys()
        pairs = list(zip(free["dense"], clipped["dense"], strict=True))
        pairs += [p for k in free["fp8"] for p in zip(free["fp8"][k], clipped["fp8"][k], strict=True)]
        worst = max(abs(b - c * a) / abs(c * a) for a, b in pairs if a != 0)
        assert worst <= 2**-20, worst
        assert all(b == 0 for a, b in pairs if a == 0)
