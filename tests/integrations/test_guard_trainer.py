"""The guard through `hf_lowprec.Trainer`, as a user runs it: the option, its logs, and a resume
in the middle of a fault.

fp8-lm-o2 with `precision_options={"guard": ...}`; from step 3 every block linear layer's input
gets two token rows ×1e6, divided back at its output (the model's function is unchanged, the
FP8 input casts flush the other values). The guard raises those layers at its first check after
the fault (logging every 2 steps), to rowwise, then (its weight-gradient cast still flushes) to BF16. A checkpoint at step 6 holds the raised layers; a run resumed
from it re-raises them and ends bit for bit where the uninterrupted run ends.
"""

import json

import pytest
from transformers import TrainerCallback

import hf_lowprec
from hf_lowprec.fp8 import FP8Linear
from tests.helpers import TokenBlocks, assert_bits_equal, make_args, tiny_gpt2

GUARD = {"warmup": 2, "window": 16}
FAULT_AT, STEPS = 3, 10


class RangeFault(TrainerCallback):
    """Two token rows ×1e6 into every FP8 layer's input from step FAULT_AT, divided back."""

    def __init__(self) -> None:
        self.on = False

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        for module in model.modules():
            if isinstance(module, FP8Linear):
                module.register_forward_pre_hook(self.into)
                module.register_forward_hook(self.out)

    def on_step_begin(self, args, state, control, **kwargs):
        self.on = state.global_step >= FAULT_AT

    def into(self, module, args):
        if self.on:
            x = args[0].clone()
            x[:, :2] = x[:, :2] * 1e6
            return (x,)
        return None

    def out(self, module, args, output):
        if self.on:
            y = output.clone()
            y[:, :2] = y[:, :2] / 1e6
            return y
        return None


def trainer(out, **overrides):
    args = make_args(
        out,
        "fp8-lm-o2",
        precision_options=json.dumps({"guard": GUARD, "fused": "reference"}),
        max_steps=STEPS,
        logging_steps=2,
        save_steps=6,
        **overrides,
    )
    return hf_lowprec.Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenBlocks(), callbacks=[RangeFault()])


def recipes(model) -> dict[str, str]:
    return {n: m.recipe for n, m in model.named_modules() if isinstance(m, FP8Linear)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("guard_full")
    t = trainer(out)
    t.train()
    return t, out


def test_the_guard_raises_the_flushing_layers_and_says_so(uninterrupted):
    t, out = uninterrupted
    raised = recipes(t.model)
    assert raised and all(r != "tensorwise" for r in raised.values()), raised
    logs = [h for h in t.state.log_history if "precision/guard_raised_layers" in h]
    assert logs and logs[-1]["precision/guard_raised_layers"] == len(raised)
    before = [h for h in logs if h["step"] < FAULT_AT]
    assert before and all(h["precision/guard_raised_layers"] == 0 for h in before)
    manifest = json.loads((out / "checkpoint-6" / "hf_lowprec_manifest.json").read_text())
    assert set(manifest["guard"]["raised"]) == set(raised)
    actions = [a["action"] for a in manifest["guard"]["actions"]]
    assert "skip" in actions and set(actions) <= {"skip", "raise", "stop"}, actions
    # The steps whose casts flushed were skipped (issue #68), all of them from the fault on.
    flushed = [a for a in manifest["guard"]["actions"] if a["action"] == "skip" and "flushed" in a["why"]]
    assert flushed and all(a["step"] > FAULT_AT for a in flushed), manifest["guard"]["actions"]
    # Named as the Trainer numbers them (as the "step" of the check that names them is): the fault
    # begins in the step started at global_step FAULT_AT, which is step FAULT_AT + 1.
    first = int(flushed[0]["what"].split("step(s) ")[1].split("–")[0].split(":")[0])
    assert first == FAULT_AT + 1, flushed
    last = int(flushed[0]["what"].split("step(s) ")[1].split(":")[0].split("–")[-1].split(",")[-1])
    assert last == flushed[0]["step"], flushed  # the check at the end of the step it names last


def test_a_resume_mid_fault_re_raises_the_layers_and_continues_bit_for_bit(uninterrupted, tmp_path, caplog):
    full, out = uninterrupted
    resumed = trainer(tmp_path)
    with caplog.at_level("INFO", logger="hf_lowprec"):
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-6"))
    assert "resumed with the layers it raised before" in caplog.text
    assert recipes(resumed.model) == recipes(full.model)
    for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert_bits_equal(a.detach(), b.detach(), name)


def test_a_resume_with_the_guard_off_says_so_once(uninterrupted, tmp_path, caplog):
    """The manifest's check and the optimizer state's load both compare the saved options: the
    change was logged by each."""
    _, out = uninterrupted
    args = make_args(
        tmp_path, "fp8-lm-o2", precision_options=json.dumps({"fused": "reference"}), max_steps=7, save_strategy="no"
    )
    resumed = hf_lowprec.Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenBlocks())
    with caplog.at_level("INFO", logger="hf_lowprec"):
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-6"))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resuming with guard=False")]
    assert len(lines) == 1, lines


def test_the_short_last_step_of_an_epoch_is_judged_by_its_loss_not_its_micro_batch_count(tmp_path):
    """Under gradient accumulation the Trainer's micro-batch losses are shares of the step's loss
    (each over the step's `num_items_in_batch`): dividing their sum by the micro-batch count judged
    full steps at about L/3 and the epoch's one-micro-batch last step at L, a loss z of 310 and a
    healthy step skipped every epoch. Their sum is judged: nothing is skipped."""
    args = make_args(
        tmp_path,
        "collage-plus",
        precision_options={"guard": {"warmup": 2, "window": 16}},
        per_device_train_batch_size=4,
        gradient_accumulation_steps=3,
        num_train_epochs=1,
        max_steps=-1,
        logging_steps=1,
        save_strategy="no",
    )
    trainer = hf_lowprec.Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenBlocks(52))
    trainer.train()
    assert trainer.state.global_step == 5  # 13 micro-batches: four steps of 3, the last of 1
    assert trainer.precision.metrics()["precision/skipped_steps"] == 0.0
    z = [h["precision/guard_loss_z"] for h in trainer.state.log_history if "precision/guard_loss_z" in h]
    assert z and max(abs(v) for v in z) < 6.0, z
