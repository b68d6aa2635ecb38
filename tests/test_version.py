"""The version and commit a checkpoint records, and the warning when another version resumes it.

Update rules changed under one version number (0.1.0 from 2026-11-22 to 2026-12-07: the
collage-plus tie rule, the bf16-sr seeds), so a resumed run could differ from an uninterrupted
one in the last bits with no sign of why. Both the manifest and the optimizer state now name
the saving version and commit; a resume by another version (or of a state that names none)
logs one warning.
"""

from __future__ import annotations

import logging
import pathlib
import subprocess

import pytest

import hf_lowprec
from hf_lowprec.checkpoints.manifest import read_manifest, write_manifest
from hf_lowprec.version import git_commit
from tests.helpers import tiny_gpt2

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_package_and_its_metadata_name_one_version():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] == hf_lowprec.__version__


def test_the_commit_is_the_checkouts_head():
    if not (ROOT / ".git").exists():
        pytest.skip("not run from a git checkout")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert git_commit() == head.stdout.strip()


def test_the_manifest_names_the_saving_version_and_commit(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x")
    write_manifest(str(tmp_path), ["a.bin"], strategy="bf16-sr")
    manifest = read_manifest(str(tmp_path))
    assert manifest["hf_lowprec_version"] == hf_lowprec.__version__
    assert manifest["hf_lowprec_commit"] == git_commit()


def _optimizer():
    strategy = hf_lowprec.get_strategy("bf16-sr")
    model = strategy.prepare_model(tiny_gpt2(0, n_embd=16))
    return strategy.create_optimizer(model.parameters(), lr=1e-3)


@pytest.mark.parametrize("saved", ["same", "0.1.0", None])
def test_a_resume_by_another_version_warns_once(saved, caplog):
    state = _optimizer().state_dict()
    ours = state["hf_lowprec"]
    assert ours["hf_lowprec_version"] == hf_lowprec.__version__ and ours["hf_lowprec_commit"] == git_commit()
    if saved is None:  # written before the version was recorded
        del ours["hf_lowprec_version"], ours["hf_lowprec_commit"]
    elif saved != "same":
        ours["hf_lowprec_version"] = saved
    with caplog.at_level(logging.WARNING, logger="hf_lowprec"):
        _optimizer().load_state_dict(state)
    warned = [r.getMessage() for r in caplog.records if r.name == "hf_lowprec.version"]
    if saved == "same":
        assert warned == []
        return
    assert len(warned) == 1
    named = "hf_lowprec 0.1.0" if saved else "before 0.2.0"
    assert named in warned[0] and f"resumed by hf_lowprec {hf_lowprec.__version__}" in warned[0]
    assert "bit for bit only within one version" in warned[0]
