"""The guard's rollbacks across a resume, through `hf_lowprec.Trainer`: a checkpoint save is a
snapshot point, so a run resumed from a checkpoint rolls back to the state the uninterrupted run
rolls back to, and ends bit for bit where it ends (docs/guard.md, "In the logs and the checkpoint").

collage-plus, every step logged (a check), a checkpoint every 3 steps, `rollback_after` 1 and
`snapshot_every` 3; the loss is made NaN in step 1 (before any snapshot), in step 4 (right after
checkpoint-3, before any check of the resumed run) and in step 8 (after checkpoint-6 and a fault-free check).
"""

import math

import pytest
import torch

import hf_lowprec
from tests.helpers import TokenBlocks, assert_bits_equal, assert_same_state, checkpointed_args, tiny_gpt2

# No z-score limit: the NaN steps are the only faults (a window of a few steps makes outliers of chance).
GUARD = {"window": 8, "warmup": 2, "rollback_after": 1, "snapshot_every": 3, "z_threshold": math.inf}
STEPS, NAN_STEPS = 10, (1, 4, 8)  # steps as the log numbers them: the first is 1


def trainer(out, seed=0):
    """A guarded Trainer whose loss is NaN in the steps NAN_STEPS, recording each step's loss."""
    args = checkpointed_args(out, "collage-plus", precision_options={"guard": GUARD}, max_steps=STEPS)
    t = hf_lowprec.Trainer(model=tiny_gpt2(seed), args=args, train_dataset=TokenBlocks(48))
    t.losses = {}
    compute_loss, training_step = t.compute_loss, t.training_step

    def poisoned_loss(*a, **k):
        loss = compute_loss(*a, **k)
        if t.state.global_step + 1 in NAN_STEPS:  # the step under way is global_step + 1
            loss = (loss[0] * float("nan"), *loss[1:]) if isinstance(loss, tuple) else loss * float("nan")
        return loss

    def recorded_step(*a, **k):
        loss = training_step(*a, **k)
        t.losses[t.state.global_step + 1] = loss.detach().clone()
        return loss

    t.compute_loss, t.training_step = poisoned_loss, recorded_step
    return t


def rollbacks(t) -> list[tuple[int, str]]:
    return [(a["step"], a["what"]) for a in t.precision.guard.actions if a["action"] == "rollback"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run with no resume, and its folder (checkpoints 3, 6 and 9): every step's loss recorded."""
    out = tmp_path_factory.mktemp("guard_resume_full")
    full = trainer(out)
    full.train()
    assert sorted(full.losses) == list(range(1, STEPS + 1))
    return full, out


def test_a_save_is_the_snapshot_a_rollback_returns_to(uninterrupted):
    """Each NaN step after a save is rolled back at its check to the state of the checkpoint before
    it (steps 3 and 6), not to a snapshot the run took at a check (step 2, or 5 in the old
    schedule). Step 1's finds no snapshot: Accelerate's `prepare` reads the optimizer's state dict
    before the first step (a round trip to place it on the device), which is no save."""
    t, _ = uninterrupted
    assert [(step, what.split("(step ")[1].split(")")[0]) for step, what in rollbacks(t)] == [(4, "3"), (8, "6")]


@pytest.mark.parametrize(
    "checkpoint",
    [
        3,  # the first step after the resume faults: before the fix, no snapshot existed, no rollback
        6,  # a fault-free check comes first: before the fix, it snapshotted step 7, not 6
    ],
)
def test_a_resumed_run_rolls_back_as_the_uninterrupted_one_and_ends_bit_for_bit(uninterrupted, tmp_path, checkpoint):
    full, out = uninterrupted
    resumed = trainer(tmp_path, seed=7)  # another init: every bit must come from the checkpoint
    resumed.train(resume_from_checkpoint=str(out / f"checkpoint-{checkpoint}"))
    assert rollbacks(resumed) == rollbacks(full)
    assert sorted(resumed.losses) == list(range(checkpoint + 1, STEPS + 1))
    for step, loss in resumed.losses.items():
        assert step in NAN_STEPS or torch.isfinite(loss), f"step {step}: loss {loss}"
        assert_bits_equal(loss, full.losses[step], f"loss of step {step}")
    for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert_bits_equal(a.detach(), b.detach(), name)
    assert_same_state(resumed.optimizer.state_dict(), full.optimizer.state_dict(), "optimizer state")
