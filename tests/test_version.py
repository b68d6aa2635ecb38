"""The version and commit a checkpoint records, and the warning when another version resumes it.

Update rules changed under one version number (0.1.0 from 2026-11-22 to 2026-12-07: the
collage-plus tie rule, the bf16-sr seeds), so a resumed run could differ from an uninterrupted
one in the last bits with no sign of why. Both the manifest and the optimizer state now name
the saving version and commit; a resume by another version (or of a state that names none)
logs one warning.
"""

from __future__ import annotations

import logging
import os
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


# --- every resume path: one warning per resume, from the manifest where there is one -------------------


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "hf_lowprec.version"]


def _say_version(checkpoint, saved, files=()) -> None:
    """Rewrite the version `checkpoint`'s manifest (and the optimizer states in `files`) records as
    `saved` ("same": as written, None: removed, as before 0.2.0); the manifest lists the files anew."""
    import json
    import os

    import torch

    from hf_lowprec.checkpoints.manifest import MANIFEST, file_entry

    if saved == "same":
        return
    path = os.path.join(checkpoint, MANIFEST)
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    for name in files:
        state = torch.load(os.path.join(checkpoint, name), weights_only=True)
        _set(state["hf_lowprec"], saved)
        torch.save(state, os.path.join(checkpoint, name))
        manifest["files"][name] = file_entry(os.path.join(checkpoint, name))
    _set(manifest, saved)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(manifest, f)


def _set(record: dict, saved) -> None:
    if saved is None:
        record.pop("hf_lowprec_version"), record.pop("hf_lowprec_commit")
    else:
        record["hf_lowprec_version"] = saved


@pytest.fixture(scope="module")
def bf16_sr_checkpoint(tmp_path_factory):
    """A bf16-sr Trainer run of 2 steps, saved at step 2."""
    from hf_lowprec import Trainer
    from tests.helpers import TokenBlocks, make_args

    out = tmp_path_factory.mktemp("versions")
    args = make_args(out, "bf16-sr", max_steps=2, save_steps=2, save_strategy="steps", per_device_train_batch_size=4)
    Trainer(model=tiny_gpt2(0), args=args, train_dataset=TokenBlocks(8)).train()
    return out / "checkpoint-2"


def _resume(source, tmp_path, caplog, **overrides):
    import shutil

    from hf_lowprec import Trainer
    from tests.helpers import TokenBlocks, make_args

    checkpoint = tmp_path / "checkpoint-2"
    shutil.copytree(source, checkpoint)
    args = make_args(tmp_path, "bf16-sr", max_steps=3, save_strategy="no", per_device_train_batch_size=4, **overrides)
    trainer = Trainer(model=tiny_gpt2(0), args=args, train_dataset=TokenBlocks(8))
    return trainer, checkpoint


@pytest.mark.parametrize("saved", ["same", "0.1.9", None])
@pytest.mark.parametrize("how", ["whole", "manifest only", "optimizer reset", "model only"])
def test_every_trainer_resume_warns_once_from_the_manifest(bf16_sr_checkpoint, tmp_path, caplog, saved, how):
    # A resume that loads no optimizer state (resume_reset='optimizer' on a missing optimizer.pt,
    # a save_only_model checkpoint) said nothing of another version; one that did said it from
    # optimizer.pt only, the manifest unread.
    import os

    trainer, checkpoint = _resume(
        bf16_sr_checkpoint,
        tmp_path,
        caplog,
        resume_reset={"optimizer reset": "optimizer", "model only": "optimizer,scheduler,rng"}.get(how),
    )
    _say_version(checkpoint, saved, files=["optimizer.pt"] if how == "whole" else [])
    if how in ("optimizer reset", "model only"):
        import json

        from hf_lowprec.checkpoints.manifest import MANIFEST

        gone = ["optimizer.pt"] if how == "optimizer reset" else ["optimizer.pt", "scheduler.pt", "rng_state.pth"]
        manifest = json.loads((checkpoint / MANIFEST).read_text())
        for name in gone:
            os.remove(checkpoint / name)
            if how == "model only":
                del manifest["files"][name]
        manifest["model_only"] = how == "model only" or manifest.get("model_only", False)
        (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="hf_lowprec"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    warned = _warnings(caplog)
    if saved == "same":
        assert warned == []
        return
    assert len(warned) == 1, warned
    named = "hf_lowprec 0.1.9" if saved else "before 0.2.0"
    assert warned[0].startswith(f"checkpoint {checkpoint} was saved by") and named in warned[0]
    assert f"resumed by hf_lowprec {hf_lowprec.__version__}" in warned[0]


def test_each_train_call_is_one_resume(bf16_sr_checkpoint, tmp_path, caplog):
    # The check happens per resume: a second train(resume_from_checkpoint=...) warns again, once.
    trainer, checkpoint = _resume(bf16_sr_checkpoint, tmp_path, caplog)
    _say_version(checkpoint, "0.1.9", files=["optimizer.pt"])
    with caplog.at_level(logging.WARNING, logger="hf_lowprec"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert len(_warnings(caplog)) == 2


@pytest.mark.parametrize("saved", ["same", "0.1.9"])
def test_accelerate_load_state_warns_once(tmp_path, caplog, saved):
    import torch
    from accelerate import Accelerator

    from hf_lowprec.integrations.accelerate import PrecisionPlugin
    from tests.helpers import batches

    def prepared():
        accelerator, model = Accelerator(cpu=True), tiny_gpt2(0)
        return accelerator, *PrecisionPlugin("bf16-sr").prepare(
            accelerator, model, torch.optim.AdamW(model.parameters())
        )

    accelerator, model, optimizer = prepared()
    ids = batches(1)[0]
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    accelerator.save_state(str(tmp_path))
    state = torch.load(tmp_path / "optimizer.bin", weights_only=True)
    if saved != "same":
        _set(state["hf_lowprec"], saved)
    torch.save(state, tmp_path / "optimizer.bin")
    # A save without the manifest (before save_state wrote one): the version is read from the optimizer state.
    os.remove(tmp_path / "hf_lowprec_manifest.json")
    accelerator, model, optimizer = prepared()
    with caplog.at_level(logging.WARNING, logger="hf_lowprec"):
        accelerator.load_state(str(tmp_path))
    assert len(_warnings(caplog)) == (0 if saved == "same" else 1)


@pytest.mark.parametrize("saved", ["same", "0.1.9", None])
def test_load_sharded_warns_once_from_the_manifest(tmp_path, caplog, one_rank_group, saved):
    from hf_lowprec.engines.fsdp2 import load_sharded, save_sharded, shard_model

    def sharded():
        strategy = hf_lowprec.get_strategy("bf16-sr")
        model = shard_model(strategy, tiny_gpt2(0, n_embd=16))
        return model, strategy.create_optimizer(model.parameters(), lr=1e-3)

    save_sharded(tmp_path / "saved", *sharded())
    _say_version(tmp_path / "saved", saved)
    with caplog.at_level(logging.WARNING, logger="hf_lowprec"):
        load_sharded(tmp_path / "saved", *sharded())
    warned = _warnings(caplog)
    assert len(warned) == (0 if saved == "same" else 1), warned
    if warned:
        assert warned[0].startswith(f"sharded checkpoint {tmp_path / 'saved'} was saved by")
