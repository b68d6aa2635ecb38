"""Kill and resume: a Trainer run SIGKILLed in a child process resumes bit for bit.

For every registered strategy a child process (forked, so it pays no imports, where a forked
child can run autograd: `hf_lowprec.processes.autograd_context`) trains with
checkpoints every 2 steps and is SIGKILLed while it writes checkpoint-4, after checkpoint-2
was complete. `resume_from_checkpoint=True` must skip the half-written checkpoint-4 with a
warning, resume from checkpoint-2, and end where an uninterrupted run ends: the same
parameters, optimizer state (strategy state included), scheduler state and losses, bit for
bit. The child and this process run on the same machine with the same settings, so the
comparison is exact. The other places a kill can land (between checkpoints, before the
optimizer file, in the middle of it) are covered for fp32, where a run is cheapest.

Options on resume: a run that changes an option deciding the saved state's layout or meaning
is refused naming each change and its saved value; a safe change (what is measured, a new
stochastic-rounding seed) is applied, and the startup report shows it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import transformers

import hf_lowprec
from hf_lowprec import Trainer, TrainingArguments
from hf_lowprec.processes import autograd_context
from tests import helpers
from tests.helpers import TokenBlocks, assert_same_state, batches, logged_losses, tiny_gpt2, train_steps

STRATEGIES = hf_lowprec.available_strategies()
MAX_STEPS, SAVE_STEPS, KILLED_AT = 6, 2, 4  # checkpoints at 2, 4, 6; killed while writing checkpoint-4
CHILD_TIMEOUT = 300.0


# Saves every SAVE_STEPS under a cosine schedule with warm-up and weight decay: all state that resumes.
make_args = functools.partial(
    helpers.make_args,
    max_steps=MAX_STEPS,
    save_steps=SAVE_STEPS,
    save_strategy="steps",
    lr_scheduler_type="cosine",
    warmup_steps=1,
    weight_decay=0.01,
    dataloader_num_workers=0,
)


def make_trainer(output_dir: Path, strategy: str, seed: int = 0) -> Trainer:
    # 16 examples, 4 a step: the run crosses epochs, so resuming must restore the sampler's RNG too.
    return Trainer(model=tiny_gpt2(seed), args=make_args(output_dir, strategy), train_dataset=TokenBlocks(16))


# --- the child ------------------------------------------------------------------------------------
def _pause(ready: Path) -> None:
    ready.write_text("paused")
    time.sleep(CHILD_TIMEOUT)
    os._exit(3)  # never reached: the parent kills the child first


def _victim(output_dir: Path, strategy: str, where: str, ready: Path, threads: int) -> None:
    """Train in this child and stop at `where`, announcing it through `ready`."""
    torch.set_num_threads(threads)  # a fork server's child has its own setting: the parent's is compared
    killed_dir = f"checkpoint-{KILLED_AT}"
    save, save_to_json = torch.save, transformers.TrainerState.save_to_json

    def cut_in_half(path: str) -> None:  # what a kill in the middle of writing `path` leaves
        data = Path(path).read_bytes()
        Path(path).write_bytes(data[: len(data) // 2])

    def pausing_save(obj, f, *args, **kwargs):
        path = str(f)
        if killed_dir in path and path.endswith("optimizer.pt") and where in ("before-optimizer", "mid-optimizer"):
            if where == "before-optimizer":
                _pause(ready)
            save(obj, f, *args, **kwargs)
            cut_in_half(path)
            _pause(ready)
        return save(obj, f, *args, **kwargs)

    def pausing_save_to_json(state, json_path):
        save_to_json(state, json_path)
        if killed_dir in str(json_path) and where == "mid-state":
            cut_in_half(json_path)
            _pause(ready)

    class Between(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if where == "between-checkpoints" and state.global_step == KILLED_AT - 1:
                _pause(ready)

    torch.save = pausing_save  # this process is the child: the patches die with it
    transformers.TrainerState.save_to_json = pausing_save_to_json
    trainer = make_trainer(output_dir, strategy)
    trainer.add_callback(Between())
    trainer.train()
    os._exit(4)  # finished without reaching the pause: the parent reports it


def start_victim(output_dir: Path, strategy: str, where: str):
    """Start the child that trains and pauses at `where`; `kill_when_paused` ends it."""
    ready = output_dir.parent / f"{output_dir.name}.paused"
    context = autograd_context([__name__])
    child = context.Process(target=_victim, args=(output_dir, strategy, where, ready, torch.get_num_threads()))
    child.start()
    return child, ready, f"{strategy} paused at {where!r}"


def kill_when_paused(victim) -> None:
    child, ready, what = victim
    deadline = time.monotonic() + CHILD_TIMEOUT
    while not ready.exists() and child.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = child.is_alive()
    if alive:
        os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert ready.exists(), f"{what}: the child never got there (exit code {child.exitcode})"
    assert alive and child.exitcode == -signal.SIGKILL, f"{what}: child exit code {child.exitcode}"


def reference_while_the_victim_runs(tmp_path: Path, strategy: str, where: str) -> Trainer:
    """Kill the child at `where`; the uninterrupted run trains here meanwhile (2 cores in use)."""
    victim = start_victim(tmp_path / "run", strategy, where)
    try:
        reference = make_trainer(tmp_path / "reference", strategy)
        reference.train()
    finally:
        kill_when_paused(victim)
    return reference


# --- comparisons ----------------------------------------------------------------------------------


def assert_resumed_equals_uninterrupted(resumed: Trainer, reference: Trainer, strategy: str) -> None:
    assert resumed.state.global_step == reference.state.global_step == MAX_STEPS
    assert logged_losses(resumed) == logged_losses(reference), strategy
    assert len(logged_losses(reference)) == MAX_STEPS
    assert_same_state(resumed.model.state_dict(), reference.model.state_dict(), f"{strategy} model")
    assert_same_state(resumed.optimizer.state_dict(), reference.optimizer.state_dict(), f"{strategy} optimizer")
    assert_same_state(resumed.lr_scheduler.state_dict(), reference.lr_scheduler.state_dict(), f"{strategy} scheduler")


def resume(output_dir: Path, strategy: str, caplog) -> Trainer:
    # A different initialisation: everything must come from the checkpoint.
    trainer = make_trainer(output_dir, strategy, seed=7)
    with caplog.at_level(logging.WARNING, logger="hf_lowprec.checkpoints.resume"):
        trainer.train(resume_from_checkpoint=True)
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_killed_while_saving_resumes_from_the_last_complete_checkpoint(tmp_path, strategy, caplog):
    reference = reference_while_the_victim_runs(tmp_path, strategy, "mid-state")
    partial = tmp_path / "run" / f"checkpoint-{KILLED_AT}"
    # Everything but the last file was written, and it is the highest-numbered checkpoint:
    # transformers' get_last_checkpoint (the stock resume_from_checkpoint=True) picks it.
    assert (partial / "optimizer.pt").exists() and (partial / "model.safetensors").exists()
    assert max(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == partial.name

    resumed = resume(tmp_path / "run", strategy, caplog)
    assert f"skipping incomplete checkpoint {partial}" in caplog.text
    assert resumed.state.log_history[0]["step"] == 1  # steps 1-2 come from checkpoint-2's history
    assert_resumed_equals_uninterrupted(resumed, reference, strategy)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["between-checkpoints", "before-optimizer", "mid-optimizer"])
def test_every_kill_point_resumes_bit_for_bit(tmp_path, where, caplog):
    strategy = "fp32"
    reference = reference_while_the_victim_runs(tmp_path, strategy, where)
    resumed = resume(tmp_path / "run", strategy, caplog)
    if where == "between-checkpoints":
        assert "skipping" not in caplog.text
    else:
        assert f"skipping incomplete checkpoint {tmp_path / 'run' / f'checkpoint-{KILLED_AT}'}" in caplog.text
    assert_resumed_equals_uninterrupted(resumed, reference, strategy)


def test_an_explicitly_named_incomplete_checkpoint_is_refused(tmp_path):
    partial = tmp_path / "checkpoint-4"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"")
    trainer = make_trainer(tmp_path, "fp32")
    with pytest.raises(ValueError, match=r"checkpoint-4 is an incomplete checkpoint \(trainer_state.json is missing\)"):
        trainer.train(resume_from_checkpoint=str(partial))
    with pytest.raises(ValueError, match="holds no complete checkpoint-N directory"):
        trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 0


# --- options on resume ----------------------------------------------------------------------------
def options_trainer(output_dir: Path, strategy: str, seed: int = 0, **options) -> Trainer:
    args = TrainingArguments(
        output_dir=str(output_dir),
        precision_strategy=strategy,
        precision_options={"fused": "reference", **options},  # eager steps: nothing to compile
        max_steps=3,
        save_steps=2,
        save_strategy="steps",
        per_device_train_batch_size=4,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    return Trainer(model=tiny_gpt2(seed), args=args, train_dataset=TokenBlocks(16))


@pytest.fixture(scope="module")
def coat_checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("coat")
    options_trainer(out, "coat").train()
    return out / "checkpoint-2"


@pytest.mark.parametrize(
    "options, match",
    [
        (
            {"exp_avg_sq_format": "e5m2", "group_size": 64},
            r"this run changes exp_avg_sq_format='e5m2' \(saved: 'e4m3'\), group_size=64 \(saved: 128\).*"
            r'Resume with the saved values \(precision_options \{"exp_avg_sq_format": "e4m3", "group_size": 128\}\)',
        ),
        ({"states": False}, r"this run changes states=False \(saved: True\)"),
    ],
)
def test_resuming_with_other_options_is_refused_naming_each(coat_checkpoint, tmp_path, options, match):
    trainer = options_trainer(tmp_path, "coat", seed=3, **options)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"hf_lowprec_manifest.json was saved by precision strategy 'coat' .*{match}"):
        trainer.train(resume_from_checkpoint=str(coat_checkpoint))
    # Without a manifest (saved before there was one) the options come from optimizer.pt, still before any load.
    copy = tmp_path / "checkpoint-2"
    shutil.copytree(coat_checkpoint, copy)
    (copy / "hf_lowprec_manifest.json").unlink()
    with pytest.raises(ValueError, match=rf"optimizer.pt was saved by precision strategy 'coat' .*{match}"):
        trainer.train(resume_from_checkpoint=str(copy))
    assert trainer.state.global_step == 0 and trainer.optimizer is None
    assert all(torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())


def test_a_safe_option_change_is_applied_and_reported(coat_checkpoint, tmp_path):
    trainer = options_trainer(tmp_path, "coat", seed=3, lost_arithmetic_metrics=True)
    trainer.train(resume_from_checkpoint=str(coat_checkpoint))
    report = json.loads((tmp_path / "precision_report.json").read_text())
    assert report["options"]["lost_arithmetic_metrics"] is True
    assert "precision/edq" in trainer.state.log_history[-2], "the metrics the option turns on were measured"


def test_a_custom_loop_refuses_changed_options_and_applies_a_new_seed():
    saved = hf_lowprec.get_strategy("coat")
    model = saved.prepare_model(tiny_gpt2())
    optimizer = saved.create_optimizer(model.parameters(), lr=1e-3)
    train_steps(saved, model, optimizer, batches(1))
    other = hf_lowprec.get_strategy("coat", group_size=64)
    resumed = other.create_optimizer(other.prepare_model(tiny_gpt2()).parameters(), lr=1e-3)
    with pytest.raises(ValueError, match=r"this optimizer state was saved .*group_size=64 \(saved: 128\)"):
        resumed.load_state_dict(optimizer.state_dict())

    # bf16-sr: the seed only picks the stochastic-rounding stream, so a new one takes over.
    sr = hf_lowprec.get_strategy("bf16-sr", seed=1)
    model = sr.prepare_model(tiny_gpt2())
    optimizer = sr.create_optimizer(model.parameters(), lr=1e-3)
    train_steps(sr, model, optimizer, batches(2))
    reseeded = hf_lowprec.get_strategy("bf16-sr", seed=5)
    resumed = reseeded.create_optimizer(reseeded.prepare_model(tiny_gpt2()).parameters(), lr=1e-3)
    resumed.load_state_dict(optimizer.state_dict())
    state = resumed.optimizer._generator(torch.device("cpu")).get_state()
    assert torch.equal(state, torch.Generator().manual_seed(5).get_state()), "the new seed's stream, from its start"
