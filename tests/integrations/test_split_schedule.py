"""Trainer checkpoints written by older versions of the package, resumed by this one.

FP8-LM O2 split each param group in two before `unscaled_format` (to 2026-12-06): its checkpoints
hold an optimizer over 3 groups and an LR schedule over 3 where the run now has 2. The optimizer's
groups were merged on load, then the stock Trainer loaded the schedule and failed with a bare
IndexError, the optimizer already changed. Such a checkpoint (written here by the old optimizer
layout, its version fields dropped as older versions wrote none) resumes now, bit for bit, with
one warning that another version saved it.
"""

from __future__ import annotations

import functools
import json
import logging

import pytest
import torch

import hf_lowprec
from hf_lowprec import Trainer
from hf_lowprec.checkpoints.manifest import MANIFEST, file_entry
from tests.helpers import TokenBlocks, assert_bits_equal, checkpointed_args, logged_losses, split_like_before, tiny_gpt2

make_args = functools.partial(checkpointed_args, max_steps=4, save_steps=2)


def _old_layout_run(output_dir) -> Trainer:
    trainer = Trainer(model=tiny_gpt2(0), args=make_args(output_dir, "fp8-lm-o2"), train_dataset=TokenBlocks(16))
    trainer.precision.build_optimizer = split_like_before.__get__(trainer.precision)
    trainer.train()
    return trainer


def _as_written_before_versions(checkpoint) -> None:
    """Drop what this version adds to a checkpoint: the saving version and commit (the optimizer's
    and the manifest's), the manifest listing the rewritten optimizer file."""
    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    for key in ("hf_lowprec_version", "hf_lowprec_commit"):
        del state["hf_lowprec"][key], manifest[key]
    torch.save(state, checkpoint / "optimizer.pt")
    manifest["files"]["optimizer.pt"] = file_entry(str(checkpoint / "optimizer.pt"))
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


def test_a_split_layout_checkpoint_resumes_in_the_trainer_schedule_included(tmp_path, caplog):
    old = _old_layout_run(tmp_path / "old")
    assert len(old.optimizer.param_groups) == 3  # the no-decay group holds no FP8 weight
    checkpoint = tmp_path / "old" / "checkpoint-2"
    assert len(torch.load(checkpoint / "scheduler.pt", weights_only=True)["base_lrs"]) == 3
    _as_written_before_versions(checkpoint)
    resumed = Trainer(model=tiny_gpt2(0), args=make_args(tmp_path / "new", "fp8-lm-o2"), train_dataset=TokenBlocks(16))
    with caplog.at_level(logging.WARNING, logger="hf_lowprec"):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert len(resumed.optimizer.param_groups) == 2
    # The same update rule on the same numbers: steps 3 and 4 equal the uninterrupted old run's, bit for bit.
    assert logged_losses(resumed)[-2:] == logged_losses(old)[-2:]
    for (name, p), q in zip(resumed.model.named_parameters(), old.model.parameters(), strict=True):
        assert_bits_equal(p.detach(), q.detach(), name)
    assert resumed.lr_scheduler.get_last_lr() == old.lr_scheduler.get_last_lr()[::2][:2]
    versions = [r for r in caplog.records if r.name == "hf_lowprec.version"]
    assert len(versions) == 1, [r.getMessage() for r in versions]
    message = versions[0].getMessage()
    assert "before 0.2.0" in message and f"resumed by hf_lowprec {hf_lowprec.__version__}" in message
    assert "bit for bit only within one version" in message


def test_a_schedule_over_other_groups_is_refused_before_anything_loads(tmp_path):
    """A `scheduler.pt` over more groups than the optimizer has, where `optimizer.pt` is not the split
    layout (here: the run's own 2 groups): refused naming both counts and the fix, the optimizer's
    state still empty, where the stock load stopped in `lr_scheduler.load_state_dict` with an IndexError."""
    trainer = Trainer(
        model=tiny_gpt2(0), args=make_args(tmp_path, "fp8-lm-o2", max_steps=2), train_dataset=TokenBlocks(16)
    )
    trainer.train()
    checkpoint = tmp_path / "checkpoint-2"
    schedule = torch.load(checkpoint / "scheduler.pt", weights_only=True)
    assert len(schedule["base_lrs"]) == 2
    schedule = {k: v + v[:1] if isinstance(v, list) else v for k, v in schedule.items()}  # a third group
    torch.save(schedule, checkpoint / "scheduler.pt")
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"]["scheduler.pt"] = file_entry(str(checkpoint / "scheduler.pt"))
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    resumed = Trainer(model=tiny_gpt2(0), args=make_args(tmp_path / "new", "fp8-lm-o2"), train_dataset=TokenBlocks(16))
    with pytest.raises(
        ValueError, match=r"over 3 parameter groups and this run's optimizer has 2.*resume_reset='scheduler'"
    ):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert not resumed.optimizer.state
