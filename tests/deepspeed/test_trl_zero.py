"""TRL's DPO and KTO trainers from `hf_lowprec.trl` under DeepSpeed ZeRO on 2 gloo ranks, in one
launch (`_trl_worker.py` runs the cases and records what the trainers held and logged)."""

import json
import math
from pathlib import Path

import pytest

from tests.deepspeed._launch import launch

HERE = Path(__file__).resolve().parent
CASES = ["dpo_precompute_zero2", "kto_precompute_zero2", "dpo_cache_key_zero3", "coat_reference_zero3"]

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("trl")
    out = tmp_path_factory.mktemp("trl_zero")
    results = launch(HERE / "_trl_worker.py", out, ["--cases", json.dumps(CASES)])
    assert [r["world_size"] for r in results] == [2, 2]
    return results


def case(ranks, name):
    found = [r["cases"][name] for r in ranks]
    for result in found:
        assert "error" not in result, result["error"]
    return found


@pytest.mark.parametrize("name", ["dpo_precompute_zero2", "kto_precompute_zero2"])
def test_precomputed_log_probs_without_a_reference_under_zero_2(ranks, name):
    # TRL computes them with a stage-0 engine over the policy, built from the plugin's config: with
    # the strategy's optimizer-only bf16 entries in it, DeepSpeed refused it (collage-plus and every
    # BF16-weight strategy). They are left out for that engine, and back for training's.
    first, second = case(ranks, name)
    assert first["ref_logps"] == second["ref_logps"] and len(first["ref_logps"]) == 8
    assert all(math.isfinite(v) for v in first["ref_logps"])
    assert first["losses"] == second["losses"] and len(first["losses"]) == 2
    assert all(math.isfinite(v) for v in first["losses"])
    assert first["bf16_after"]["bf16_master_weights_and_grads"] is True
    assert first["bf16_after"]["bf16_optimizer_states"] is True


def test_precomputed_log_probs_are_cached_per_reference_under_zero_3(ranks):
    # The cache key was rehashed after TRL had partitioned the reference (ZeRO-3: empty partitions),
    # so two references hashed the same and the second run read the first's log-probs.
    for seen in case(ranks, "dpo_cache_key_zero3"):
        assert seen["first"]["ref_logps"] != seen["other"]["ref_logps"]
        assert seen["first"]["ref_logps"] == seen["again"]["ref_logps"]
        if seen["first"]["hash"] is not None:  # TRL 1.16 keeps its key (1.13 hashes when it precomputes)
            assert seen["first"]["hash"] != seen["other"]["hash"]
            assert seen["first"]["hash"] == seen["again"]["hash"]
            assert seen["first"]["hash"].endswith(f":{seen['first']['strategy']}")  # TRL's hash, then the strategy


def test_coat_freezes_a_reference_in_bf16_under_zero_3(ranks):
    # FP8-block parameters failed at the reference's forward: ZeRO-3 all-gathers them, and gloo
    # has no float8 ("Invalid scalar type").
    first, second = case(ranks, "coat_reference_zero3")
    assert first["frozen"] == second["frozen"] == "bfloat16"  # the startup report's, and what it holds:
    assert first["fp8_layers"] == 0 and first["dtypes"] == ["torch.bfloat16"]
    assert first["losses"] == second["losses"] and len(first["losses"]) == 2
    assert all(math.isfinite(v) for v in first["losses"])
