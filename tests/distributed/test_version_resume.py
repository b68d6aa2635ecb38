"""A Trainer resume under FSDP2 (each rank's optimizer file) and DeepSpeed ZeRO-2 (each rank's
partition) of a checkpoint another hf_lowprec version saved: one warning per resume, from the
manifest, on the main process; none for the same version. Each rank warned from its own optimizer
state (two warnings on 2 ranks), and a manifest without a version (saved before 0.2.0) went unsaid.
In the same processes, a custom Accelerate loop's `accelerator.save_state` / `load_state` under
FSDP2 and ZeRO-2: they wrote no manifest, FSDP2's optimizer file dropped the strategy's entry (bf16-sr
resumed off its stochastic-rounding generators), and a load by another version said nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

import hf_lowprec
from tests.deepspeed._launch import launch

HERE = Path(__file__).resolve().parent
LOOPS = ("accelerate-fsdp2", "accelerate-zero2")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("version_resume")
    return out, launch(HERE / "_version_resume_worker.py", out, ["--engines", ",".join(("fsdp2", "zero2", *LOOPS))])


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp2_and_zero_resumes_warn_once_from_the_manifest(ranks):
    tmp_path, ranks = ranks
    for engine, rewritten in (("fsdp2", "hf_lowprec_optimizer.rank"), ("zero2", "zero_pp_rank_")):
        cases = [rank["cases"][engine] for rank in ranks]
        assert all("error" not in case for case in cases), [case.get("error") for case in cases]
        # Every rank's optimizer state recorded the version too, and says 0.1.9 in that case.
        assert sum(rewritten in name for name in cases[0]["0.1.9-rewritten"]) == 2, cases[0]["0.1.9-rewritten"]
        assert [case["same"] for case in cases] == [[], []], engine
        for case, named in (("0.1.9", "hf_lowprec 0.1.9"), ("none", "before 0.2.0")):
            warned = [message for rank in cases for message in rank[case]]
            assert len(warned) == 1 and cases[1][case] == [], (engine, case, warned)
            assert warned[0].startswith(f"checkpoint {tmp_path / f'{engine}-{case}' / 'checkpoint-2'} was saved by")
            assert named in warned[0] and f"resumed by hf_lowprec {hf_lowprec.__version__}" in warned[0]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("loop", LOOPS)
def test_accelerate_save_state_writes_the_manifest_and_load_state_checks_it(ranks, loop):
    tmp_path, ranks = ranks
    cases = [rank["cases"][loop] for rank in ranks]
    assert all("error" not in case for case in cases), [case.get("error") for case in cases]
    engine = loop.removeprefix("accelerate-")
    manifest = cases[0]["manifest"]
    assert manifest is not None, "accelerator.save_state wrote no manifest"
    assert manifest["strategy"] == "bf16-sr" and manifest["world_size"] == 2
    assert manifest["hf_lowprec_version"] == hf_lowprec.__version__
    if engine == "fsdp2":  # each rank's optimizer state with the strategy's entry (its SR generators)
        assert [case["rank_file_entry"] for case in cases] == [True, True]
    # Another number of processes: refused before anything loads, naming both and the fix.
    for case in cases:
        refused = case.get("world-refused", "")
        assert f"{tmp_path / loop / 'world'} was saved by 4 processes, but this run has 2" in refused, refused
        assert "Nothing was loaded" in refused and "--nproc_per_node 4" in refused
    # Another version: one warning, from the manifest, on the main process; every other warning none.
    assert cases[1]["warnings"] == [], cases[1]["warnings"]
    assert len(cases[0]["warnings"]) == 1, cases[0]["warnings"]
    assert cases[0]["warnings"][0].startswith(f"checkpoint {tmp_path / loop / '0.1.9'} was saved by hf_lowprec 0.1.9")
    # The fresh loop (another initialization) continues bit for bit: the SR generators were restored.
    for case in cases:
        assert case["resumed"] == case["losses"][2:], (case["resumed"], case["losses"])
