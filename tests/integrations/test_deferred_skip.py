"""A skipped step's LR schedule held a step late (`integrations.deferred_skip`): the same bits as
reading the skip flag at once, which the Trainer and the Accelerate plugin did after every optimizer
step (a host sync each step; tests/gpu/test_trainer_syncs.py counts them).

Each run has a non-finite gradient at its third optimizer step under a warmup + linear schedule.
The reference reads the flag at once, as the code before the deferral did (its two functions, in
place of the deferral's): Accelerate's flag is `StrategyOptimizer.step_was_skipped` right after
the step, so the scheduler never steps on the skip. Losses, the LR each
step used, the parameters and the scheduler's state must be equal bit for bit; the LRs must also be
the schedule's own formula at the count of steps not skipped (independent of both runs).
"""

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from transformers import TrainerCallback, get_linear_schedule_with_warmup

import hf_lowprec.integrations.accelerate as accelerate_module
import hf_lowprec.integrations.trainer as trainer_module
from hf_lowprec import PrecisionPlugin, Trainer
from hf_lowprec.integrations.optimizer_arguments import find_strategy_optimizer
from tests.helpers import TokenBlocks, assert_bits_equal, assert_same_state, batches, make_args, tiny_gpt2

ROOT = Path(__file__).resolve().parents[2]
LR, WARMUP, STEPS, NAN_STEP = 3e-3, 2, 6, 2  # NAN_STEP: the optimizer steps before the skipped one


def scheduled_lr(k: int) -> float:
    """transformers' linear schedule with warmup after `k` scheduler steps, as LambdaLR computes it."""
    if k < WARMUP:
        return LR * (float(k) / float(max(1, WARMUP)))
    return LR * max(0.0, float(STEPS - k) / float(max(1, STEPS - WARMUP)))


# The LR each optimizer step uses: the schedule counts only the steps not skipped before it.
HELD_LRS = [scheduled_lr(i - (i > NAN_STEP)) for i in range(STEPS)]


class NaNAtThirdStep(Trainer):
    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        return loss * float("nan") if self.state.global_step == NAN_STEP and model.training else loss


class UsedLRs(TrainerCallback):
    """The groups' LR right after each optimizer step, before the scheduler steps: the LR it used."""

    def __init__(self) -> None:
        self.lrs: list[list[float]] = []

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.lrs.append([g["lr"] for g in optimizer.param_groups])


def trainer_read_at_once(optimizer, trainer) -> None:
    """`PrecisionCallback.on_optimizer_step` before the deferral."""
    inner = find_strategy_optimizer(optimizer)
    if inner is not None and hasattr(optimizer, "_is_overflow"):
        optimizer._is_overflow = inner.step_was_skipped


def plugin_read_at_once(wrapper, schedulers, optimizer, *args) -> None:
    """The plugin's optimizer post-hook before the deferral."""
    wrapper._is_overflow = optimizer.step_was_skipped


def trainer_run(tmp_path, strategy: str, callbacks=(), **overrides) -> tuple[Trainer, UsedLRs]:
    args = make_args(
        tmp_path, strategy, max_steps=STEPS, lr_scheduler_type="linear", warmup_steps=WARMUP, learning_rate=LR,
        **{"save_strategy": "no", **overrides},
    )  # fmt: skip
    used = UsedLRs()
    trainer = NaNAtThirdStep(model=tiny_gpt2(), args=args, train_dataset=TokenBlocks(), callbacks=[*callbacks, used])
    trainer.train()
    return trainer, used


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def assert_same_run(got: Trainer, expected: Trainer) -> None:
    assert losses(got) == losses(expected) and len(losses(got)) == STEPS  # == fails on NaN
    for (name, a), b in zip(got.model.named_parameters(), expected.model.parameters(), strict=True):
        assert_bits_equal(a, b, name)
    assert_same_state(got.lr_scheduler.state_dict(), expected.lr_scheduler.state_dict(), "scheduler")


@pytest.mark.parametrize("strategy", ["bf16-mixed", "fp16-mixed"])
def test_trainer_holds_the_schedule_of_a_skipped_step_as_reading_the_flag_at_once(tmp_path, strategy, monkeypatch):
    deferred, deferred_lrs = trainer_run(tmp_path / "deferred", strategy)
    monkeypatch.setattr(trainer_module, "note_trainer_skip", trainer_read_at_once)
    at_once, at_once_lrs = trainer_run(tmp_path / "at_once", strategy)
    assert deferred.precision.skipped_steps == at_once.precision.skipped_steps == 1
    assert deferred_lrs.lrs == at_once_lrs.lrs
    assert [lrs[0] for lrs in deferred_lrs.lrs] == HELD_LRS
    assert_same_run(deferred, at_once)
    assert deferred.lr_scheduler.last_epoch == STEPS - 1  # resolved at the end: the skip not counted


# A user's change to the LR between the skipped step and the next: every group's `lr` set before the
# next step, or the scheduler's `base_lrs` scaled after the skipped one ("drop the LR" callbacks).
NEW_LR, BASE_SCALE = LR / 64, 0.125  # powers of two: the scaled schedule is the formula's over 8, exactly
WRITTEN_LRS = {
    # Stock: the skipped step's scheduler step never happens, so each write stays until the scheduler writes.
    "group lr": [*HELD_LRS[: NAN_STEP + 1], NEW_LR, *HELD_LRS[NAN_STEP + 2 :]],
    "base_lrs": [*HELD_LRS[: NAN_STEP + 2], *(lr * BASE_SCALE for lr in HELD_LRS[NAN_STEP + 2 :])],
}


class WritesTheLR(TrainerCallback):
    def __init__(self, what: str) -> None:
        self.what = what

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if self.what == "group lr" and state.global_step == NAN_STEP + 1:  # before the step after the skip
            for group in optimizer.param_groups:
                group["lr"] = NEW_LR

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        if self.what == "base_lrs" and state.global_step == NAN_STEP + 1:  # the skipped step's end
            lr_scheduler.base_lrs = [lr * BASE_SCALE for lr in lr_scheduler.base_lrs]


@pytest.mark.parametrize("strategy", ["bf16-mixed", "collage-plus"])
@pytest.mark.parametrize("what", list(WRITTEN_LRS))
def test_a_callbacks_lr_change_after_a_skipped_step_stays(tmp_path, strategy, what, monkeypatch):
    """The skipped step's scheduler step is taken back, the callback's write kept: the LRs are those of a
    run whose skipped step's scheduler step never happens (reading the flag at once), bit for bit."""
    deferred, deferred_lrs = trainer_run(tmp_path / "deferred", strategy, callbacks=[WritesTheLR(what)])
    monkeypatch.setattr(trainer_module, "note_trainer_skip", trainer_read_at_once)
    at_once, at_once_lrs = trainer_run(tmp_path / "at_once", strategy, callbacks=[WritesTheLR(what)])
    assert deferred.precision.skipped_steps == at_once.precision.skipped_steps == 1
    assert [lrs[0] for lrs in deferred_lrs.lrs] == WRITTEN_LRS[what]
    assert deferred_lrs.lrs == at_once_lrs.lrs
    assert_same_run(deferred, at_once)


def _resumed_run(output_dir: str, checkpoint: str, result: str) -> None:
    """Run in a fresh process: resume the run of `test_trainer_resumes_...` from `checkpoint`."""
    args = make_args(
        output_dir, "fp16-mixed", max_steps=STEPS, lr_scheduler_type="linear", warmup_steps=WARMUP, learning_rate=LR,
        save_strategy="steps", save_steps=NAN_STEP + 1,
    )  # fmt: skip
    used = UsedLRs()
    trainer = NaNAtThirdStep(model=tiny_gpt2(seed=7), args=args, train_dataset=TokenBlocks(), callbacks=[used])
    trainer.train(resume_from_checkpoint=checkpoint)
    torch.save({"params": dict(trainer.model.named_parameters()), "lrs": used.lrs, "losses": losses(trainer)}, result)


def test_trainer_resumes_from_a_checkpoint_saved_right_after_a_skipped_step(tmp_path):
    """The checkpoint after the skipped third step holds the schedule as it stands after the skip
    (saved before the flag's next read would be a step ahead); resumed in a fresh process, the run
    equals the uninterrupted one bit for bit."""
    full, used = trainer_run(tmp_path, "fp16-mixed", save_strategy="steps", save_steps=NAN_STEP + 1)
    checkpoint = tmp_path / f"checkpoint-{NAN_STEP + 1}"
    saved = torch.load(checkpoint / "scheduler.pt", weights_only=True)
    assert saved["last_epoch"] == NAN_STEP and saved["_last_lr"] == [HELD_LRS[NAN_STEP + 1]] * len(saved["base_lrs"])
    optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert [g["lr"] for g in optimizer["param_groups"]] == [HELD_LRS[NAN_STEP + 1]] * len(optimizer["param_groups"])
    result = tmp_path / "resumed.pt"
    code = (
        "from tests.integrations.test_deferred_skip import _resumed_run; "
        f"_resumed_run({str(tmp_path)!r}, {str(checkpoint)!r}, {str(result)!r})"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    resumed = torch.load(result, weights_only=True)
    assert resumed["lrs"] == used.lrs[NAN_STEP + 1 :]
    assert resumed["losses"] == losses(full)  # the checkpoint's log history, then the resumed steps
    for name, p in full.model.named_parameters():
        assert_bits_equal(resumed["params"][name], p, name)


def plugin_run(strategy: str, accumulation: int, write: str | None = None) -> dict:
    """The README's plugin loop with `accelerator.prepare(scheduler)`, under `accumulation` micro-batches;
    `write` (a key of WRITTEN_LRS): the LR written after the skipped step's `scheduler.step()`."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    # Accelerate's own default (True) is dropped from its plugin's kwargs, which then read False: set it.
    accelerator.gradient_state.plugin_kwargs["adjust_scheduler"] = accumulation > 1
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = get_linear_schedule_with_warmup(optimizer, WARMUP, STEPS)
    plugin = PrecisionPlugin(strategy)
    model, optimizer, scheduler = plugin.prepare(accelerator, model, optimizer, scheduler)
    inner = optimizer.optimizer
    used: list[list[float]] = []
    inner.register_step_post_hook(lambda o, *a: used.append([g["lr"] for g in o.param_groups]))
    run_losses = []
    for i, ids in enumerate(batches(STEPS * accumulation)):
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            run_losses.append(loss.item())
            plugin.backward(accelerator, loss * float("nan") if i // accumulation == NAN_STEP else loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if write == "group lr" and i == NAN_STEP:
            for group in inner.param_groups:
                group["lr"] = NEW_LR
        elif write == "base_lrs" and i == NAN_STEP:
            scheduler.scheduler.base_lrs = [lr * BASE_SCALE for lr in scheduler.scheduler.base_lrs]
    return {
        "losses": run_losses,
        "lrs": used,
        "skipped": plugin.strategy.skipped_steps,
        "params": [p.detach().clone() for p in model.parameters()],
        "scheduler": scheduler.state_dict(),  # read through Accelerate's wrapper: resolves the last step
        "micro_steps_counted": scheduler.scheduler._step_count - scheduler.scheduler.last_epoch - 1,
    }


@pytest.mark.parametrize("accumulation", [1, 2])
def test_plugin_loop_holds_the_schedule_of_a_skipped_step_as_reading_the_flag_at_once(accumulation, monkeypatch):
    """Under gradient accumulation Accelerate adds each micro-step to the scheduler's `_step_count`
    (OneCycleLR reads it): those stay when the skipped step's scheduler step is taken back."""
    deferred = plugin_run("fp16-mixed", accumulation)
    monkeypatch.setattr(accelerate_module, "note_accelerate_skip", plugin_read_at_once)
    at_once = plugin_run("fp16-mixed", accumulation)
    assert deferred["skipped"] == at_once["skipped"] == 1
    assert deferred["losses"] == at_once["losses"] and len(deferred["losses"]) == STEPS * accumulation
    assert deferred["lrs"] == at_once["lrs"] and [lrs[0] for lrs in deferred["lrs"]] == HELD_LRS
    for a, b in zip(deferred["params"], at_once["params"], strict=True):
        assert_bits_equal(a, b)
    assert_same_state(deferred["scheduler"], at_once["scheduler"], "scheduler")
    # Each optimizer step's first micro-step, counted by Accelerate (on the skipped step's next one too).
    assert deferred["micro_steps_counted"] == STEPS * (accumulation - 1)


@pytest.mark.parametrize("what", list(WRITTEN_LRS))
def test_plugin_loop_keeps_an_lr_change_after_a_skipped_step(what, monkeypatch):
    """As the Trainer's: the skipped step's scheduler step taken back, the loop's own write kept."""
    deferred = plugin_run("fp16-mixed", 1, write=what)
    monkeypatch.setattr(accelerate_module, "note_accelerate_skip", plugin_read_at_once)
    at_once = plugin_run("fp16-mixed", 1, write=what)
    assert deferred["skipped"] == at_once["skipped"] == 1
    assert [lrs[0] for lrs in deferred["lrs"]] == WRITTEN_LRS[what] and deferred["lrs"] == at_once["lrs"]
    for a, b in zip(deferred["params"], at_once["params"], strict=True):
        assert_bits_equal(a, b)
    assert_same_state(deferred["scheduler"], at_once["scheduler"], "scheduler")


def test_accelerate_save_state_right_after_a_skipped_step_holds_the_schedule(tmp_path):
    """`accelerator.save_state` reads the scheduler and the optimizer through their `state_dict()`,
    which first take back the skipped step's scheduler step: the files hold the held schedule."""
    accelerator = Accelerator(cpu=True)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    plugin = PrecisionPlugin("bf16-mixed")
    model, optimizer, scheduler = plugin.prepare(
        accelerator, model, optimizer, get_linear_schedule_with_warmup(optimizer, WARMUP, STEPS)
    )
    for i, ids in enumerate(batches(NAN_STEP + 1)):
        loss = model(input_ids=ids, labels=ids).loss
        plugin.backward(accelerator, loss * float("nan") if i == NAN_STEP else loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    accelerator.save_state(str(tmp_path))
    saved = torch.load(tmp_path / "scheduler.bin", weights_only=False)
    assert saved["last_epoch"] == NAN_STEP and saved["_last_lr"] == [HELD_LRS[NAN_STEP + 1]]
    groups = torch.load(tmp_path / "optimizer.bin", weights_only=False)["param_groups"]
    assert [g["lr"] for g in groups] == [HELD_LRS[NAN_STEP + 1]]
    assert accelerator.optimizer_step_was_skipped


def test_a_loop_without_a_prepared_scheduler_gives_each_steps_flag():
    """No scheduler Accelerate holds: nothing to take back later, so Accelerate's flag is this step's,
    read only where asked (here after both steps: each keeps its own)."""
    accelerator = Accelerator(cpu=True)
    plugin = PrecisionPlugin("bf16-mixed")
    model = tiny_gpt2()
    model, optimizer = plugin.prepare(accelerator, model, torch.optim.AdamW(model.parameters(), lr=LR))
    flags = []
    for i, ids in enumerate(batches(2)):
        loss = model(input_ids=ids, labels=ids).loss
        plugin.backward(accelerator, loss * float("nan") if i == 1 else loss)
        optimizer.step()
        flags.append(optimizer._is_overflow)
        optimizer.zero_grad()
    assert [bool(f) for f in flags] == [False, True]


class _WarmupHoldingALock:
    """A schedule function that keeps a handle (a lock, a logger, a file): its state cannot be deep-copied."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __call__(self, k: int) -> float:
        return scheduled_lr(k) / LR


def test_a_schedule_whose_state_cannot_be_deep_copied_is_held_all_the_same():
    accelerator = Accelerator(cpu=True)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _WarmupHoldingALock())
    plugin = PrecisionPlugin("fp16-mixed")
    model, optimizer, scheduler = plugin.prepare(accelerator, model, optimizer, scheduler)
    used: list[float] = []
    optimizer.optimizer.register_step_post_hook(lambda o, *a: used.append(o.param_groups[0]["lr"]))
    for i, ids in enumerate(batches(STEPS)):
        loss = model(input_ids=ids, labels=ids).loss
        plugin.backward(accelerator, loss * float("nan") if i == NAN_STEP else loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    assert plugin.strategy.skipped_steps == 1
    assert used == HELD_LRS


# --- an evaluation at an epoch's end ------------------------------------------------------------------
# Three epochs of two optimizer steps; the last step of epochs 2 and 3 is skipped. The Trainer asks for the
# epoch's evaluation in `on_epoch_end`, after the skipped step's `on_step_end`: the skip is still pending.
EPOCH_STEPS, EPOCHS, EPOCH_SKIPS = 2, 3, (4, 6)  # EPOCH_SKIPS: the skipped optimizer steps, counted from 1


class EvaluatedEachEpoch(Trainer):
    """Non-finite losses at EPOCH_SKIPS; each evaluation records the LR the next step is to use (the groups'
    and the scheduler's) and reports the step count as `eval_loss`: a metric that gets worse every time."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        return loss * float("nan") if self.state.global_step + 1 in EPOCH_SKIPS and model.training else loss

    def evaluate(self, *args, **kwargs):
        self.evaluated.append(([g["lr"] for g in self.optimizer.param_groups], self.lr_scheduler.state_dict()))
        return {"eval_loss": float(self.state.global_step)}


def epoch_run(tmp_path, strategy: str, scheduler: str, **kwargs) -> tuple[EvaluatedEachEpoch, UsedLRs]:
    args = make_args(
        tmp_path, strategy, max_steps=-1, num_train_epochs=EPOCHS, learning_rate=LR, lr_scheduler_type=scheduler,
        eval_strategy="epoch", metric_for_best_model="loss", save_strategy="no", **kwargs,
    )  # fmt: skip
    used = UsedLRs()
    data = TokenBlocks(n=4 * EPOCH_STEPS)  # per_device_train_batch_size 4: EPOCH_STEPS steps an epoch
    trainer = EvaluatedEachEpoch(
        model=tiny_gpt2(), args=args, train_dataset=data, eval_dataset=TokenBlocks(n=4), callbacks=[used]
    )
    trainer.evaluated = []
    trainer.train()
    assert trainer.precision.skipped_steps == len(EPOCH_SKIPS)
    return trainer, used


@pytest.mark.parametrize("strategy", ["fp16-als", "collage-plus"])
def test_a_plateau_cut_at_an_epoch_evaluation_after_a_skipped_step_stays(tmp_path, strategy):
    """ReduceLROnPlateau steps on the evaluation's metric only, so a skipped step leaves it alone (stock). The
    metric gets worse at every evaluation after the first: with patience 0 each one halves the LR. The
    cut at epoch 2's evaluation (its last step skipped) is used by epoch 3's steps; the one at epoch 3's
    (the run's last step skipped) is the LR the run ends with, `best` the first evaluation's metric."""
    factor = 0.5
    trainer, used = epoch_run(
        tmp_path, strategy, "reduce_lr_on_plateau", lr_scheduler_kwargs={"factor": factor, "patience": 0}
    )
    cuts = [max(0, step // EPOCH_STEPS - 1) for step in range(EPOCHS * EPOCH_STEPS)]  # evaluations before, less 1
    assert [lrs[0] for lrs in used.lrs] == [LR * factor**n for n in cuts]
    assert [g["lr"] for g in trainer.optimizer.param_groups] == [LR * factor ** (EPOCHS - 1)] * len(used.lrs[0])
    plateau = trainer.lr_scheduler.state_dict()
    assert plateau["best"] == float(EPOCH_STEPS) and plateau["num_bad_epochs"] == 0  # reset by the last cut


def test_an_epoch_evaluation_after_a_skipped_step_reads_the_held_schedule(tmp_path):
    """What an epoch's evaluation reads (the groups' LR, the scheduler's state) is what the next step uses:
    the linear schedule at the count of steps not skipped, as when the flag is read at once."""
    trainer, used = epoch_run(tmp_path, "bf16-mixed", "linear")
    total = EPOCHS * EPOCH_STEPS

    def linear(done: int) -> tuple[int, float]:  # transformers' linear schedule (no warmup) after `done` steps
        steps = done - sum(s <= done for s in EPOCH_SKIPS)  # the scheduler steps: those not skipped
        return steps, LR * max(0.0, float(total - steps) / float(total))

    assert [lrs[0] for lrs in used.lrs] == [linear(done)[1] for done in range(total)]
    for epoch, (lrs, state) in enumerate(trainer.evaluated, start=1):
        steps, expected = linear(epoch * EPOCH_STEPS)
        assert lrs == [expected] * len(lrs) and state["_last_lr"] == lrs and state["last_epoch"] == steps, epoch


class WrapsStepEnd(NaNAtThirdStep):
    """A Trainer whose `callback_handler.on_step_end` another tool replaced with a plain function."""

    def train(self, *args, **kwargs):
        original = self.callback_handler.on_step_end
        self.callback_handler.on_step_end = lambda a, s, c: original(a, s, c)
        return super().train(*args, **kwargs)


def test_a_replaced_on_step_end_still_holds_the_schedule(tmp_path):
    args = make_args(
        tmp_path, "bf16-mixed", max_steps=STEPS, lr_scheduler_type="linear", warmup_steps=WARMUP, learning_rate=LR,
        save_strategy="no",
    )  # fmt: skip
    used = UsedLRs()
    trainer = WrapsStepEnd(model=tiny_gpt2(), args=args, train_dataset=TokenBlocks(), callbacks=[used])
    trainer.train()
    _, expected_lrs = trainer_run(tmp_path / "plain", "bf16-mixed")
    assert trainer.precision.skipped_steps == 1 and used.lrs == expected_lrs.lrs
