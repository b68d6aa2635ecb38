"""Faults injected into Trainer runs: non-finite values, damaged checkpoints, bad options.

- Inf/NaN in a gradient, an activation and the loss, for every registered strategy: no
  parameter, optimizer state or strategy state ever holds a non-finite value, each fault is
  counted (a skipped step, or clipped elements for a strategy that clips overflow), and
  training goes on with the loss still falling.
- A truncated or corrupted checkpoint file, and another strategy's checkpoint: an error that
  names the file and what to do, raised before the model, optimizer or state change.
- The fault matrix: for five strategies, every file of a checkpoint deleted, truncated and
  overwritten in the middle is refused naming the file (or, with `resume_reset`, the part is
  started afresh as documented); the untouched checkpoint continues bit for bit.
- Bad `precision_options` on the command line: a ValueError naming the option, raised while
  the arguments are parsed, for every option of every registered strategy.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import logging
import math
import os
import resource
import shutil
import signal
import sys
import types
import typing
from pathlib import Path

import pytest
import torch
from transformers import HfArgumentParser, TrainerCallback
from transformers.trainer_callback import ExportableState

import hf_lowprec
from hf_lowprec import Trainer, TrainingArguments
from hf_lowprec.checkpoints.complete_save import CheckpointSaveError
from hf_lowprec.checkpoints.resume import MANIFEST, SAVE_MARKER, resolve_resume_checkpoint
from hf_lowprec.processes import autograd_context
from tests import helpers
from tests.helpers import TokenBlocks, assert_same_state, batches, tiny_gpt2

STRATEGIES = hf_lowprec.available_strategies()
STEPS = 12
FAULTS = {3: "gradient", 6: "activation", 9: "loss"}  # 1-based step -> where the fault goes


# Twelve steps at a constant rate, nothing saved unless a test asks.
make_args = functools.partial(
    helpers.make_args, max_steps=STEPS, save_strategy="no", lr_scheduler_type="constant", dataloader_num_workers=0
)


def nonfinite_tensors(obj, where: str) -> list[str]:
    """Names of floating-point tensors (FP8 included) or floats in `obj` holding inf or NaN."""
    if torch.is_tensor(obj):
        if obj.is_floating_point() and not bool(torch.isfinite(obj.float()).all()):
            return [where]
        return []
    if isinstance(obj, float):
        return [] if math.isfinite(obj) else [where]
    if isinstance(obj, dict):
        return [w for k, v in obj.items() for w in nonfinite_tensors(v, f"{where}[{k!r}]")]
    if isinstance(obj, (list, tuple)):
        return [w for i, v in enumerate(obj) for w in nonfinite_tensors(v, f"{where}[{i}]")]
    return []


def fault_counters(strategy) -> float:
    """Skipped steps plus clipped elements: every fault must raise one of them."""
    metrics = strategy.metrics()
    clipped = sum(v for k, v in metrics.items() if "clipped" in k and k.endswith("_total"))
    return metrics["precision/skipped_steps"] + clipped


class FaultyTrainer(Trainer):
    """Injects FAULTS at their steps and records the true loss of every step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.true_losses: list[float] = []
        block = self.model.transformer.h
        block[0].mlp.c_fc.weight.register_hook(self._gradient_fault)
        block[1].mlp.register_forward_hook(self._activation_fault)

    def _fault_now(self, where: str) -> bool:
        return self.model.training and FAULTS.get(self.state.global_step + 1) == where

    def _gradient_fault(self, grad):
        if not self._fault_now("gradient"):
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    def _activation_fault(self, module, inputs, output):
        if not self._fault_now("activation"):
            return output
        output = output.clone()
        output.view(-1)[0] = float("nan")
        return output

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        if model.training:
            self.true_losses.append(loss.item())
            if self._fault_now("loss"):
                loss = loss * float("inf")
        return loss


class Watch(TrainerCallback):
    """After every step: nothing non-finite anywhere, and what the fault counters say."""

    def __init__(self, trainer: FaultyTrainer):
        self.trainer = trainer
        self.counters: list[float] = []
        self.problems: list[str] = []

    def on_step_end(self, args, state, control, **kwargs):
        t = self.trainer
        self.problems += nonfinite_tensors(dict(t.model.named_parameters()), f"step {state.global_step} params")
        self.problems += nonfinite_tensors(t.optimizer.state_dict(), f"step {state.global_step} optimizer")
        self.problems += nonfinite_tensors(t.precision.state_dict(), f"step {state.global_step} strategy")
        self.counters.append(fault_counters(t.precision))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_injected_inf_and_nan_are_counted_and_training_goes_on(tmp_path, strategy):
    # One batch of 4 blocks, repeated: the loss of a working update falls step after step.
    trainer = FaultyTrainer(model=tiny_gpt2(), args=make_args(tmp_path, strategy), train_dataset=TokenBlocks(4))
    watch = Watch(trainer)
    trainer.add_callback(watch)
    trainer.train()

    assert trainer.state.global_step == STEPS
    assert watch.problems == [], f"{strategy}: non-finite values in {watch.problems[:5]}"
    # Every fault moved a counter on its own step, and nothing else did.
    moved = [i + 1 for i, (a, b) in enumerate(zip([0.0, *watch.counters], watch.counters)) if b > a]
    assert moved == sorted(FAULTS), f"{strategy}: counters moved at steps {moved}, faults at {sorted(FAULTS)}"
    # The LR schedule does not advance on a skipped step.
    assert trainer.lr_scheduler.last_epoch == STEPS - trainer.precision.skipped_steps
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged[-1]["precision/skipped_steps"] == trainer.precision.metrics()["precision/skipped_steps"]

    losses = trainer.true_losses
    assert len(losses) == STEPS
    assert all(math.isfinite(x) for step, x in enumerate(losses, 1) if FAULTS.get(step) != "activation")
    # The loss keeps falling past the faults: the last loss is below the one before the last fault.
    last_fault = max(FAULTS)
    assert losses[-1] < losses[last_fault - 2] < losses[0], f"{strategy}: {[round(x, 3) for x in losses]}"


# --- damaged checkpoints and other strategies' checkpoints ----------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A real bf16-pure checkpoint after 2 steps."""
    out = tmp_path_factory.mktemp("saved")
    args = make_args(out, "bf16-pure", max_steps=2, save_strategy="steps", save_steps=2)
    Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenBlocks(8)).train()
    return out / "checkpoint-2"


def damaged_copy(checkpoint: Path, tmp_path: Path, name: str, damage: str) -> Path:
    """A copy of `checkpoint` under tmp_path/run with `name` deleted, truncated or overwritten."""
    run = tmp_path / "run"
    copy = run / checkpoint.name
    shutil.copytree(checkpoint, copy)
    if damage == "deleted":
        (copy / name).unlink()
        return copy
    data = bytearray((copy / name).read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:  # "corrupted" / "overwritten": 8 bytes flipped in the middle, the size kept
        middle = len(data) // 2
        data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    (copy / name).write_bytes(bytes(data))
    return copy


def assert_refused_before_any_change(output_dir: Path, strategy: str | None, resume, match: str) -> None:
    trainer = Trainer(model=tiny_gpt2(seed=3), args=make_args(output_dir, strategy), train_dataset=TokenBlocks(8))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        trainer.train(resume_from_checkpoint=resume)
    assert trainer.state.global_step == 0 and trainer.optimizer is None
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(value, before[key]), f"{key} changed before the error"


@pytest.mark.parametrize(
    "name, damage, what",
    [
        ("optimizer.pt", "truncated", "not a complete torch.save archive"),
        ("optimizer.pt", "corrupted", "fails its CRC check"),
        ("model.safetensors", "truncated", "not a complete safetensors file"),
        ("scheduler.pt", "truncated", "not a complete torch.save archive"),
    ],
)
def test_damaged_checkpoint_file_is_named_before_anything_loads(checkpoint, tmp_path, name, damage, what):
    copy = damaged_copy(checkpoint, tmp_path, name, damage)
    (copy / MANIFEST).unlink()  # saved before checkpoints carried a manifest: the archives' own checks
    match = rf"checkpoint file {copy / name} is damaged \(.*{what}.*\)\. Nothing was loaded\. Delete {copy} and resume"
    assert_refused_before_any_change(copy.parent, "bf16-pure", str(copy), match)
    # resume_from_checkpoint=True picks the same (finished, but damaged) checkpoint: same error.
    assert_refused_before_any_change(copy.parent, "bf16-pure", True, match)


def test_damaged_trainer_state_means_an_interrupted_save(checkpoint, tmp_path):
    copy = damaged_copy(checkpoint, tmp_path, "trainer_state.json", "truncated")
    match = rf"{copy} is an incomplete checkpoint \(trainer_state.json is cut short"
    assert_refused_before_any_change(copy.parent, "bf16-pure", str(copy), match)


@pytest.mark.parametrize(
    "strategy, match",
    [
        (
            "collage-plus",
            rf"{MANIFEST} was saved by precision strategy 'bf16-pure', but this run uses "
            r"precision_strategy='collage-plus'; resume with --precision_strategy bf16-pure",
        ),
        (None, r"saved by precision strategy 'bf16-pure', but this run uses no precision strategy"),
    ],
)
def test_another_strategys_checkpoint_is_refused(checkpoint, tmp_path, strategy, match):
    assert_refused_before_any_change(tmp_path, strategy, str(checkpoint), match)


# Each edit of a manifest's JSON, and the problem the refusal must name.
MANIFEST_EDITS = {
    "entry-null": (lambda m: m["files"].update({"optimizer.pt": None}), r"entry 'optimizer.pt' is null, not"),
    "entry-number": (lambda m: m["files"].update({"optimizer.pt": 7}), r"entry 'optimizer.pt' is 7, not"),
    "entry-string": (lambda m: m["files"].update({"scheduler.pt": "x"}), r"entry 'scheduler.pt' is \"x\", not"),
    "bytes-missing": (
        lambda m: m["files"]["optimizer.pt"].pop("bytes"),
        r"entry 'optimizer.pt' has bytes null, not a non-negative",
    ),
    "bytes-negative": (
        lambda m: m["files"]["optimizer.pt"].update(bytes=-1),
        r"entry 'optimizer.pt' has bytes -1, not a non-negative",
    ),
    "bytes-bool": (
        lambda m: m["files"]["optimizer.pt"].update(bytes=True),
        r"entry 'optimizer.pt' has bytes true, not",
    ),
    "crc-too-big": (
        lambda m: m["files"]["optimizer.pt"].update(crc32=2**32),
        r"entry 'optimizer.pt' has crc32 4294967296, not an integer",
    ),
    "path-outside": (
        lambda m: m["files"].update({"../model.safetensors": {"bytes": 1, "crc32": 1}}),
        r"entry '../model.safetensors' is not a path inside",
    ),
    "files-list": (lambda m: m.update(files=[]), r"its files are \[\], not an object of entries"),
    "strategy-number": (lambda m: m.update(strategy=3), "its strategy is 3, not a name or null"),
    "options-list": (lambda m: m.update(options=[1]), r"its options are \[1\], not an object or null"),
    "world-size-zero": (lambda m: m.update(world_size=0), "its world_size is 0, not a positive integer"),
}


@pytest.mark.parametrize("edit", sorted(MANIFEST_EDITS))
def test_a_malformed_manifest_entry_is_refused_naming_the_manifest(checkpoint, tmp_path, edit):
    change, problem = MANIFEST_EDITS[edit]
    copy = tmp_path / "run" / checkpoint.name
    shutil.copytree(checkpoint, copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    change(manifest)
    (copy / MANIFEST).write_text(json.dumps(manifest))
    match = rf"checkpoint file {copy / MANIFEST} is damaged \({problem}.*\)\. Nothing was loaded\. Delete {copy}"
    assert_refused_before_any_change(copy.parent, "bf16-pure", str(copy), match)


def _save_until_the_file_limit(out: Path, message: Path) -> None:
    """Forked child: train with checkpoints every 2 steps; after step 3 the process may write no
    file beyond the midpoint of checkpoint-2's model and optimizer sizes, so checkpoint-4's
    optimizer.pt fails part-way (EFBIG, as a full disk fails with ENOSPC: torch reports both as
    "unexpected pos")."""

    class Limit(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                sizes = [(out / "checkpoint-2" / n).stat().st_size for n in ("model.safetensors", "optimizer.pt")]
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
                resource.setrlimit(resource.RLIMIT_FSIZE, (sum(sizes) // 2, resource.RLIM_INFINITY))

    options = {"fused": "reference"}
    args = make_args(
        out,
        "collage-plus",
        precision_options=options,
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=1,
    )
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenBlocks(8), callbacks=[Limit()])
    try:
        trainer.train()
    except CheckpointSaveError as err:
        message.write_text(str(err))
        os._exit(0)
    os._exit(1)


def test_a_failed_save_names_the_file_the_cause_and_the_intact_checkpoint(tmp_path):
    out, message = tmp_path / "run", tmp_path / "message"
    # A fork where a forked child can run autograd (torch 2.14 refuses it after a backward on fake tensors).
    child = autograd_context([__name__]).Process(target=_save_until_the_file_limit, args=(out, message))
    child.start()
    child.join(600)
    assert child.exitcode == 0, f"the save did not fail with CheckpointSaveError (exit code {child.exitcode})"
    failed, previous = out / "checkpoint-4", out / "checkpoint-2"
    assert message.read_text().startswith(
        f"saving checkpoint {failed} failed while writing {failed / 'optimizer.pt'}: the file exceeds the size this "
        f"process may write (EFBIG). The previous checkpoint {previous} is intact; checkpoint-4 is incomplete"
    ), message.read_text()
    assert (previous / MANIFEST).is_file(), "save_total_limit=1 rotated the last complete checkpoint away"
    resolved, _ = resolve_resume_checkpoint(str(out), True, hf_lowprec.get_strategy("collage-plus", fused="reference"))
    assert resolved == str(previous)


def test_a_save_whose_collective_lost_a_peer_says_so_not_the_disk(tmp_path):
    # gloo's error through a functional collective is a plain RuntimeError: it was reported as a
    # write failure with the free space, "Free space or fix the permissions".
    from hf_lowprec.checkpoints.complete_save import failed_save

    path = tmp_path / "checkpoint-2"
    path.mkdir()
    (path / "config.json").write_text("{}")
    lost = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset by peer")
    message = str(failed_save(str(path), lost))
    assert "another process stopped during the save (RuntimeError: [../third_party/gloo" in message
    assert "Restart every process of the job, then resume" in message and "Free space" not in message
    disk = str(failed_save(str(path), RuntimeError("unexpected pos 128 vs 64")))
    assert "another process" not in disk and "bytes free" in disk and "Free space" in disk


class _Processor:
    """A processing_class whose save_pretrained raises `error` for checkpoint-4 (checkpoint-2 saves)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def save_pretrained(self, directory, **kwargs) -> None:
        if str(directory).endswith("checkpoint-4"):
            raise self.error


class _BrokenState(TrainerCallback, ExportableState):
    """A stateful callback whose state (written into trainer_state.json) fails at checkpoint-4."""

    step = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.step = state.global_step

    def state(self) -> dict:
        if self.step == 4:
            raise KeyError("callback state lost its key")
        return {"args": {}, "attributes": {}}


def _save_failing_at_checkpoint_4(out: Path, processor=None, callbacks=()) -> None:
    args = make_args(out, "collage-plus", max_steps=4, save_strategy="steps", save_steps=2, save_total_limit=1)
    trainer = Trainer(
        model=tiny_gpt2(), args=args, train_dataset=TokenBlocks(8), processing_class=processor, callbacks=[*callbacks]
    )
    trainer.train()


def _skipped_for_checkpoint_2(out: Path) -> None:
    """checkpoint-4 is marked incomplete (marker, no manifest) and a resume picks checkpoint-2."""
    failed, previous = out / "checkpoint-4", out / "checkpoint-2"
    assert (failed / SAVE_MARKER).is_file() and not (failed / MANIFEST).exists()
    assert (previous / MANIFEST).is_file(), "save_total_limit=1 rotated the last complete checkpoint away"
    resolved, _ = resolve_resume_checkpoint(str(out), True, hf_lowprec.get_strategy("collage-plus"))
    assert resolved == str(previous)


@pytest.mark.parametrize("where", ["processing_class", "callback"])
def test_a_save_failing_for_no_disk_reason_raises_its_own_error(tmp_path, where):
    # A ValueError from the processing_class's save_pretrained (a KeyError from a callback's state)
    # was a CheckpointSaveError naming the newest file, the free space, and "Free space or fix the
    # permissions": the stock Trainer raises the error itself, and so does the save now.
    out = tmp_path / "run"
    if where == "processing_class":
        error = ValueError("tokenizer cannot be serialized: bad vocab entry")
        run = functools.partial(_save_failing_at_checkpoint_4, out, processor=_Processor(error))
    else:
        error = KeyError("callback state lost its key")
        run = functools.partial(_save_failing_at_checkpoint_4, out, callbacks=[_BrokenState()])
    with pytest.raises(type(error)) as raised:
        run()
    assert type(raised.value) is type(error) and raised.value.args == error.args
    assert sys.version_info < (3, 11) or raised.value.__notes__ == [
        f"hf_lowprec: checkpoint {out / 'checkpoint-4'} is incomplete (this error stopped its save); "
        "resume_from_checkpoint=True skips it."
    ]
    _skipped_for_checkpoint_2(out)


def test_a_save_failing_with_an_os_error_names_its_file_and_the_disk(tmp_path):
    out = tmp_path / "run"
    named = out / "checkpoint-4" / "tokenizer.json"
    full = OSError(errno.ENOSPC, "No space left on device", str(named))
    with pytest.raises(CheckpointSaveError) as raised:
        _save_failing_at_checkpoint_4(out, processor=_Processor(full))
    assert str(raised.value).startswith(
        f"saving checkpoint {out / 'checkpoint-4'} failed while writing {named}: no space left on the device "
        f"(ENOSPC). The previous checkpoint {out / 'checkpoint-2'} is intact; checkpoint-4 is incomplete"
    ), raised.value
    assert "Free space or fix the permissions" in str(raised.value) and raised.value.__cause__ is full
    _skipped_for_checkpoint_2(out)


def test_a_failed_write_without_a_file_names_none(tmp_path):
    # An OSError without filename (a plain write) named whichever file was newest, though that file
    # can be written; safetensors' error carries its errno only in its message.
    from safetensors import SafetensorError

    from hf_lowprec.checkpoints.complete_save import failed_save

    path = tmp_path / "checkpoint-2"
    path.mkdir()
    (path / "config.json").write_text("{}")
    message = str(failed_save(str(path), OSError(errno.ENOSPC, "No space left on device")))
    assert message.startswith(
        f"saving checkpoint {path} failed (the error names no file): no space left on the device (ENOSPC)."
    ), message
    assert "config.json" not in message and "Free space" in message
    written = SafetensorError("Error while serializing: I/O error: File too large (os error 27)")
    message = str(failed_save(str(path), written))
    assert "failed (the error names no file): the file exceeds the size this process may write (EFBIG)" in message


# --- the fault matrix: every checkpoint file deleted, truncated, overwritten -------------------------
MATRIX_STRATEGIES = ["collage-plus", "fp8-lm-o2", "coat", "fp16-als", "collage-8bit"]
MATRIX_STEPS, MATRIX_SAVE = 3, 2  # checkpoint-2, then one more step to compare against
FILES = [
    "model.safetensors",
    "optimizer.pt",
    "scheduler.pt",
    "rng_state.pth",
    "trainer_state.json",
    "training_args.bin",
    "config.json",
    "generation_config.json",
    MANIFEST,
]
DAMAGES = ["deleted", "truncated", "overwritten"]
# The part `resume_reset` may start afresh when its file is missing or damaged.
PARTS = {"optimizer.pt": "optimizer", "scheduler.pt": "scheduler", "rng_state.pth": "rng"}


def matrix_trainer(output_dir: Path, strategy: str, seed: int = 0, **kw) -> Trainer:
    args = make_args(
        output_dir,
        strategy,
        precision_options={"fused": "reference"},  # the eager step: no kernel to compile for 3 steps
        max_steps=MATRIX_STEPS,
        save_strategy="steps",
        save_steps=MATRIX_SAVE,
        lr_scheduler_type="linear",
        **kw,
    )
    return Trainer(model=tiny_gpt2(seed), args=args, train_dataset=TokenBlocks(16))


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory) -> dict[str, tuple[Path, Trainer]]:
    """Per strategy: checkpoint-2 and the run that wrote it, trained on to step 3 (the reference)."""
    runs = {}
    for strategy in MATRIX_STRATEGIES:
        out = tmp_path_factory.mktemp(strategy)
        trainer = matrix_trainer(out, strategy)
        trainer.train()
        runs[strategy] = (out / f"checkpoint-{MATRIX_SAVE}", trainer)
    return runs


def test_every_checkpoint_file_is_in_the_manifest(saved_runs):
    for strategy, (checkpoint, _) in saved_runs.items():
        manifest = json.loads((checkpoint / MANIFEST).read_text())
        assert sorted(manifest["files"]) == sorted(f for f in FILES if f != MANIFEST), strategy
        assert manifest["strategy"] == strategy
        options = hf_lowprec.get_strategy(strategy, fused="reference").options
        assert manifest["options"] == dataclasses.asdict(options)


def expected_refusal(copy: Path, name: str, damage: str) -> str:
    if name == "trainer_state.json":  # the Trainer writes it last: its damage means an interrupted save
        return rf"{copy} is an incomplete checkpoint \(trainer_state.json is (missing|cut short)"
    what = "missing" if damage == "deleted" else r"damaged \(.*\)"
    if name == MANIFEST:
        what = r"damaged \(unreadable.*\)"
    hint = rf".*resume_reset='{PARTS[name]}'" if name in PARTS else ""
    return rf"checkpoint file {copy / name} is {what}\. Nothing was loaded\. Delete {copy} and resume{hint}"


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGES)
@pytest.mark.parametrize("name", [f for f in FILES if f != MANIFEST])
@pytest.mark.parametrize("strategy", MATRIX_STRATEGIES)
def test_fault_matrix_refuses_naming_the_file(saved_runs, tmp_path, strategy, name, damage):
    copy = damaged_copy(saved_runs[strategy][0], tmp_path, name, damage)
    assert_refused_before_any_change(copy.parent, strategy, str(copy), expected_refusal(copy, name, damage))


@pytest.mark.parametrize("damage", ["truncated", "overwritten"])
def test_a_damaged_manifest_is_refused(saved_runs, tmp_path, damage):
    copy = damaged_copy(saved_runs["coat"][0], tmp_path, MANIFEST, damage)
    assert_refused_before_any_change(copy.parent, "coat", str(copy), expected_refusal(copy, MANIFEST, damage))


def resumed(copy: Path, strategy: str, caplog, **kw) -> Trainer:
    trainer = matrix_trainer(copy.parent, strategy, seed=7, **kw)  # other weights: all must come from the copy
    with caplog.at_level(logging.WARNING, logger="hf_lowprec.checkpoints.resume"):
        trainer.train(resume_from_checkpoint=str(copy))
    assert trainer.state.global_step == MATRIX_STEPS
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("strategy", MATRIX_STRATEGIES)
def test_untouched_checkpoint_continues_bit_for_bit_and_without_manifest_warns(saved_runs, tmp_path, strategy, caplog):
    checkpoint, reference = saved_runs[strategy]
    copy = tmp_path / "run" / checkpoint.name
    shutil.copytree(checkpoint, copy)
    trainer = resumed(copy, strategy, caplog)
    assert "no hf_lowprec_manifest.json" not in caplog.text
    assert_same_state(trainer.model.state_dict(), reference.model.state_dict(), f"{strategy} model")
    assert_same_state(trainer.optimizer.state_dict(), reference.optimizer.state_dict(), f"{strategy} optimizer")
    assert_same_state(trainer.lr_scheduler.state_dict(), reference.lr_scheduler.state_dict(), f"{strategy} scheduler")
    # A checkpoint without the manifest (as saved before manifests existed): one warning, then the same run.
    shutil.rmtree(copy.parent / f"checkpoint-{MATRIX_STEPS}", ignore_errors=True)
    (copy / MANIFEST).unlink()
    caplog.clear()
    trainer = resumed(copy, strategy, caplog)
    warnings = [r for r in caplog.records if MANIFEST in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0].getMessage()
    assert_same_state(trainer.model.state_dict(), reference.model.state_dict(), f"{strategy} model, no manifest")
    assert_same_state(
        trainer.optimizer.state_dict(), reference.optimizer.state_dict(), f"{strategy} optimizer, no manifest"
    )


def optimizer_steps(trainer: Trainer) -> set[int]:
    """The step counts the optimizer holds per parameter (each family stores "step")."""
    return {int(state["step"]) for state in trainer.optimizer.state.values() if "step" in state}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PARTS))
@pytest.mark.parametrize("strategy", MATRIX_STRATEGIES)
def test_resume_reset_starts_the_named_part_afresh(saved_runs, tmp_path, strategy, name, caplog):
    part = PARTS[name]
    copy = damaged_copy(saved_runs[strategy][0], tmp_path, name, "deleted")
    trainer = resumed(copy, strategy, caplog, resume_reset=part)
    assert f"{copy / name} is missing; resume_reset names '{part}'" in caplog.text
    reference = saved_runs[strategy][1]
    # One step after the resume: a fresh optimizer has taken 1 step, a restarted schedule 1 step.
    assert optimizer_steps(trainer) == ({1} if part == "optimizer" else optimizer_steps(reference))
    expected_epoch = 1 if part == "scheduler" else reference.lr_scheduler.last_epoch
    assert trainer.lr_scheduler.last_epoch == expected_epoch
    if part == "rng":  # weights and optimizer came from the checkpoint: the step differs only in data order
        assert trainer.state.global_step == MATRIX_STEPS


# --- bad precision_options from the command line --------------------------------------------------
def parse(tmp_path: Path, strategy: str, options: str):
    parser = HfArgumentParser(TrainingArguments)
    return parser.parse_args_into_dataclasses(
        [
            "--output_dir",
            str(tmp_path),
            "--use_cpu",
            "--precision_strategy",
            strategy,
            "--precision_options",
            options,
        ]
    )


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"lost_arithmetic_metrics": tru', "must be a JSON object"),
        ("[1, 2]", "must be a dict or JSON object"),
        ('"lost_arithmetic_metrics"', "must be a dict or JSON object"),
        ('{"colour": "red"}', r"no option\(s\) \['colour'\]; valid options: .*lost_arithmetic_metrics"),
        ('{"lost_arithmetic_metrics": "true"}', "'lost_arithmetic_metrics' must be true or false"),
        ('{"lost_arithmetic_metrics": null}', "'lost_arithmetic_metrics' must be true or false"),
    ],
)
def test_malformed_options_fail_while_parsing(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        parse(tmp_path, "fp32", text)


def wrong_values(annotation) -> list:
    """JSON values of the wrong type (or out of every range) for an option annotated `annotation`."""
    common = [None, [1], {"a": 1}]
    if annotation is bool:
        return [*common, 1, "true"]
    if annotation is int:
        return [*common, "3", 2.5, True, 10**30, float("inf")]
    if annotation is float:
        return [*common, "0.5", True, float("inf"), float("nan"), 10**400]
    if typing.get_origin(annotation) is typing.Literal:
        return [*common, "no-such-choice", 3]
    return common


def option_cases() -> list[tuple[str, str, object]]:
    cases = []
    for name in STRATEGIES:
        options = hf_lowprec.get_strategy(name).Options
        hints = typing.get_type_hints(options)
        for field in dataclasses.fields(options):
            hint = hints[field.name]
            optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(
                hint
            )
            if optional:  # `X | None` (the rounding seed: None draws it from the run's): None is right
                (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
            cases += [(name, field.name, v) for v in wrong_values(hint) if not (optional and v is None)]
    return cases


def test_every_option_of_every_strategy_rejects_wrong_values(tmp_path):
    failures = []
    for strategy, option, value in option_cases():
        text = json.dumps({option: value})  # inf/nan become Infinity/NaN, which json.loads accepts
        try:
            parse(tmp_path, strategy, text)
        except ValueError as err:
            if option not in str(err):
                failures.append(f"{strategy} {text}: the error does not name the option: {err}")
        except Exception as err:
            failures.append(f"{strategy} {text}: {type(err).__name__}: {err}")
        else:
            failures.append(f"{strategy} {text}: accepted")
    assert not failures, "\n".join(failures)


def huge_values(annotation) -> list:
    if annotation is int and annotation is not bool:
        return [2**62, -(2**62)]
    if annotation is float:
        return [1e308, -1e308, 5e-324]
    return []


def test_huge_option_values_fail_early_or_train(tmp_path):
    """A huge but well-typed value is refused with the option's name, or one step trains finitely."""
    failures = []
    ids = batches(1, batch=2, seq=16)[0]
    for name in STRATEGIES:
        options = hf_lowprec.get_strategy(name).Options
        hints = typing.get_type_hints(options)
        for field in dataclasses.fields(options):
            for value in huge_values(hints[field.name]):
                try:
                    strategy = hf_lowprec.get_strategy(name, **{field.name: value})
                except ValueError as err:
                    if field.name not in str(err):
                        failures.append(f"{name} {field.name}={value}: error does not name it: {err}")
                    continue
                try:
                    model = strategy.prepare_model(tiny_gpt2())
                    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
                    with strategy.forward_context():
                        loss = model(input_ids=ids, labels=ids).loss
                    strategy.scale_loss(loss).backward()
                    optimizer.step()
                except Exception as err:
                    failures.append(f"{name} {field.name}={value}: accepted, then {type(err).__name__}: {err}")
                    continue
                bad = nonfinite_tensors(dict(model.named_parameters()), "params")
                if bad:
                    failures.append(f"{name} {field.name}={value}: accepted, then non-finite {bad[:3]}")
    assert not failures, "\n".join(failures)
