"""A Trainer resume under FSDP2 (each rank's optimizer file) and DeepSpeed ZeRO-2 (each rank's
partition) of a checkpoint another hf_lowprec version saved: one warning per resume, from the
manifest, on the main process; none for the same version. Each rank warned from its own optimizer
state (two warnings on 2 ranks), and a manifest without a version (saved before 0.2.0) went unsaid."""

from __future__ import annotations

from pathlib import Path

import pytest

import hf_lowprec
from tests.deepspeed._launch import launch

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp2_and_zero_resumes_warn_once_from_the_manifest(tmp_path):
    pytest.importorskip("deepspeed")
    ranks = launch(HERE / "_version_resume_worker.py", tmp_path, ["--engines", "fsdp2,zero2"])
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
