"""Host syncs per steady step on the paths users run: `hf_lowprec.Trainer` and the Accelerate plugin.

tests/gpu/test_syncs.py counts one strategy step alone. Around it the Trainer and Accelerate hold
their LR scheduler on a skipped step, which they learn by reading the skip flag: the package read
it right after the optimizer step, one sync every step on both paths (4 a Trainer step where the
stock Trainer has 3, 1 a plugin step where stock Accelerate has 0). It is read a step late now
(`integrations.deferred_skip`), so a strategy adds no sync: the Trainer's count is the stock
Trainer's (transformers' own: its NaN filter of the loss, the packed-sequence check), the plugin's 0.
"""

import pytest
import torch
import transformers
from accelerate import Accelerator
from transformers import TrainerCallback, get_linear_schedule_with_warmup

import hf_lowprec
from hf_lowprec import PrecisionPlugin
from hf_lowprec.testing import DeviceTraffic
from hf_lowprec.testing.counted_step import gpt2, token_batch

COUNTED_STEP = 2  # global_step at the counted step's start: two steps warm up (states, scales)


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = token_batch()

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.ids[i % len(self.ids)]
        return {"input_ids": x, "labels": x}


class CountStep(TrainerCallback):
    """`DeviceTraffic` from the counted step's `on_step_begin` to its `on_step_end`."""

    def __init__(self) -> None:
        self.traffic: DeviceTraffic | None = None
        self.counted: DeviceTraffic | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == COUNTED_STEP:
            self.traffic = DeviceTraffic()
            self.traffic.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.traffic is not None:
            self.traffic.__exit__(None, None, None)
            self.counted, self.traffic = self.traffic, None


def trainer_syncs(tmp_path, strategy: str | None, **overrides) -> DeviceTraffic:
    """The counted step of a 4-step Trainer run (`strategy` None: the stock Trainer with `bf16=True`)."""
    common = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=COUNTED_STEP + 2, report_to=[],
        use_cpu=True, save_strategy="no", logging_steps=1000, disable_tqdm=True, **overrides,
    )  # fmt: skip
    count = CountStep()
    if strategy is None:
        args = transformers.TrainingArguments(bf16=True, **common)
        trainer = transformers.Trainer(model=gpt2(2), args=args, train_dataset=TokenDataset(), callbacks=[count])
    else:
        args = hf_lowprec.TrainingArguments(precision_strategy=strategy, **common)
        trainer = hf_lowprec.Trainer(model=gpt2(2), args=args, train_dataset=TokenDataset(), callbacks=[count])
    trainer.train()
    assert count.counted is not None
    return count.counted


CASES = [
    ("bf16-mixed", {}),
    ("fp16-mixed", {}),  # loss scaling: the skip flag also moves the scale, on the device
    ("fp16-mixed", {"max_grad_norm": 0.0}),  # the flag from the strategy's own check, not the clip norm
    ("bf16-mixed", {"gradient_accumulation_steps": 2}),
]


@pytest.mark.parametrize(("strategy", "overrides"), CASES)
def test_a_steady_trainer_step_waits_on_the_device_as_often_as_the_stock_trainer(tmp_path, strategy, overrides):
    stock = trainer_syncs(tmp_path / "stock", None, **overrides)
    ours = trainer_syncs(tmp_path / "ours", strategy, **overrides)
    assert len(ours.syncs) == len(stock.syncs), (
        f"{strategy} {overrides}: {len(ours.syncs)} host syncs in a steady Trainer step, the stock Trainer "
        f"{len(stock.syncs)}:\n{ours.summary()}\nstock:\n{stock.summary()}"
    )


@pytest.mark.parametrize("strategy", ["bf16-mixed", "fp16-mixed"])
def test_a_steady_plugin_step_with_a_prepared_scheduler_never_waits_on_the_device(strategy):
    """The README's loop with `accelerator.prepare(scheduler)`: forward, backward, optimizer and scheduler
    steps, zero_grad. Stock `Accelerator(mixed_precision="bf16")` reads nothing there either."""
    accelerator = Accelerator(cpu=True)
    plugin = PrecisionPlugin(strategy)
    model = gpt2(2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, 1, 10)
    model, optimizer, scheduler = plugin.prepare(accelerator, model, optimizer, scheduler)
    ids = token_batch()

    def step() -> None:
        plugin.backward(accelerator, model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

    for _ in range(COUNTED_STEP):
        step()
    with DeviceTraffic() as counted:
        step()
    assert not counted.syncs, (
        f"{strategy}: {len(counted.syncs)} host syncs in a steady plugin step:\n{counted.summary()}"
    )
    assert not accelerator.optimizer_step_was_skipped  # read after the step: synced then, and still right


@pytest.mark.parametrize("strategy", ["bf16-mixed", "fp16-als"])
def test_a_plugin_step_with_no_scheduler_waits_only_where_the_loop_asks_for_the_skip(strategy):
    """A plugin loop with no scheduler prepared: nothing to hold, so the step reads nothing (stock
    Accelerate without a GradScaler neither); `optimizer_step_was_skipped`, asked, is that step's."""
    accelerator = Accelerator(cpu=True)
    plugin = PrecisionPlugin(strategy)
    model = gpt2(2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = plugin.prepare(accelerator, model, optimizer)
    ids = token_batch()

    def step(poison: bool = False) -> None:
        plugin.backward(accelerator, model(input_ids=ids, labels=ids).loss)
        if poison:  # a NaN (fp16-als clips an inf and takes the step; a NaN it skips, as every strategy)
            next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(COUNTED_STEP):
        step()
    with DeviceTraffic() as counted:
        step()
    assert not counted.syncs, f"{strategy}: {len(counted.syncs)} host syncs in a steady step:\n{counted.summary()}"
    assert not accelerator.optimizer_step_was_skipped
    step(poison=True)
    assert accelerator.optimizer_step_was_skipped
    step()
    assert not accelerator.optimizer_step_was_skipped
