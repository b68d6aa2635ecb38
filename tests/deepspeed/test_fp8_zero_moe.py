"""fp8-lm-o3 (FP8-LM's ZeRO) on a Mixture-of-Experts model, 2 gloo ranks (`_o3_moe_worker.py`):
the experts' fused 3-D weights are distributed whole like the linear weights, stored in E4M3 on
the rank that does not own them, and every rank computes with the same FP8 weights after each step."""

from pathlib import Path

import pytest

from tests.deepspeed._launch import launch

HERE = Path(__file__).resolve().parent

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def test_o3_distributes_and_trains_the_experts(tmp_path):
    ranks = launch(HERE / "_o3_moe_worker.py", tmp_path, [])
    for r in ranks:
        assert "error" not in r, r["error"]
    experts = [n for n in ranks[0]["fp8_names"] if ".experts." in n]
    assert len(experts) == 4  # 2 layers × (gate_up_proj, down_proj)
    owned = [set(r["owned"]) for r in ranks]
    assert owned[0].isdisjoint(owned[1]) and owned[0] | owned[1] == set(ranks[0]["fp8_names"])
    for r in ranks:
        assert r["non_owned_dtypes"] == ["torch.float8_e4m3fn"]
        assert all(0 < loss < 10 for loss in r["losses"])
    assert ranks[0]["digests"] == ranks[1]["digests"] and len(ranks[0]["digests"]) == 3
    # What each rank's experts compute with: the owner's own quantization equals the other
    # rank's FP8 copy (one scale per 3-D weight, the experts' magnitudes 2^1.5 apart).
    assert ranks[0]["forward_digests"] == ranks[1]["forward_digests"]
