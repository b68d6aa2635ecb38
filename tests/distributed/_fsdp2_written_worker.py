"""One rank of tests/distributed/test_fsdp2_written_weights.py: weights written before the next step
under FSDP2 (2 gloo ranks), the way users write them, then one step at lr 0.

Cases, per strategy: `trainer-fresh` (a callback's `on_train_begin` write in a fresh Trainer run,
after Accelerate's wrap-time load of the optimizer's own state), `trainer-resume` (the same write
after `resume_from_checkpoint`), `loop-accelerate` (`PrecisionPlugin.prepare` on Accelerate's FSDP2,
then a write), `loop-resume` (`load_sharded` of a checkpoint, then a write) and `loop-resume-exact`
(`load_sharded` and no write: the steps after it as the uninterrupted run's). Each records the
largest |θ − W| over the weights after the step (W: the written FP32 weights), and whether θ is
still what the write left, bit for bit; results go to `<out>/rank<r>.json`.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import TrainerCallback

from hf_lowprec import TrainingArguments, get_strategy
from hf_lowprec.engines.fsdp2 import load_sharded, save_sharded, shard_model
from hf_lowprec.integrations.accelerate import PrecisionPlugin
from tests.deepspeed._launch import finish_rank
from tests.distributed._fsdp2_trainer_resume_worker import FSDP2Trainer
from tests.distributed._fsdp2_worker import forced_fsdp2_accelerator
from tests.helpers import TokenBlocks, batches, rank_rows, tiny_gpt2

MICRO = 2


def full(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()


def weights(model) -> dict[str, torch.Tensor]:
    return {name: full(p) for name, p in model.named_parameters()}


def write(model) -> dict[str, torch.Tensor]:
    """`model.load_state_dict` of other weights (tiny_gpt2(seed=5), FP32), each one a DTensor sharded
    as the parameter is; returns W, the FP32 weights written."""
    written = dict(tiny_gpt2(seed=5).named_parameters())
    live = dict(model.named_parameters())
    state = {
        name: distribute_tensor(written[name].detach().to(p.dtype), p.device_mesh, p.placements)
        for name, p in live.items()
    }
    model.load_state_dict(state, strict=False)
    return {name: written[name].detach().clone() for name in live}


def measured(model, written: dict[str, torch.Tensor], held: dict[str, torch.Tensor]) -> dict:
    """The largest |θ − W| after the step and whether θ is what the write left (`held`), bit for bit."""
    after = weights(model)
    gap = max(float((after[n].double() - written[n].double()).abs().max()) for n in after)
    rounding = max(float((held[n].double() - written[n].double()).abs().max()) for n in after)
    same = all(torch.equal(after[n], held[n]) for n in after)
    largest = max(float(w.abs().max()) for w in written.values())
    return {"gap": gap, "rounding": rounding, "largest": largest, "kept_written": same}


def zero_lr(optimizer) -> None:
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        if "initial_lr" in group:
            group["initial_lr"] = 0.0


class WritesAtTrainBegin(TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.written = write(model)
        self.held = weights(model)
        zero_lr(optimizer)


def trainer(name: str, out: Path, **overrides) -> FSDP2Trainer:
    args = TrainingArguments(
        output_dir=str(out),
        precision_strategy=name,
        fsdp="full_shard",
        fsdp_config={"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT"},
        use_cpu=True,
        per_device_train_batch_size=MICRO,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        **overrides,
    )
    return FSDP2Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenBlocks(16))


def run_trainer_fresh(name: str, out: Path) -> dict:
    writer = WritesAtTrainBegin()
    run = trainer(name, out / f"{name}-fresh", max_steps=1, save_strategy="no")
    run.add_callback(writer)
    run.train()
    return measured(run.model, writer.written, writer.held)


def run_trainer_resume(name: str, out: Path) -> dict:
    trainer(name, out / f"{name}-resume", max_steps=2, save_steps=2).train()
    dist.barrier()
    writer = WritesAtTrainBegin()
    run = trainer(name, out / f"{name}-resume", max_steps=3, save_strategy="no")
    run.add_callback(writer)
    run.train(resume_from_checkpoint=str(out / f"{name}-resume" / "checkpoint-2"))
    return measured(run.model, writer.written, writer.held)


def step(strategy, model, optimizer, ids: torch.Tensor) -> None:
    ids = rank_rows(ids, MICRO)
    with strategy.forward_context():
        loss = model(input_ids=ids, labels=ids).loss
    strategy.scale_loss(loss).backward()
    strategy.unscale_gradients(optimizer.optimizer)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_loop_accelerate(name: str, _out: Path) -> dict:
    accelerator = forced_fsdp2_accelerator()
    plugin = PrecisionPlugin(name)
    model = tiny_gpt2()
    model, optimizer = plugin.prepare(accelerator, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    written = write(model)
    held = weights(model)
    zero_lr(optimizer)
    ids = rank_rows(batches(1, batch=MICRO * 2)[0], MICRO)
    loss = model(input_ids=ids, labels=ids).loss
    plugin.backward(accelerator, loss)
    optimizer.step()
    optimizer.zero_grad()
    return measured(model, written, held)


def build(name: str, seed: int):
    strategy = get_strategy(name)
    model = shard_model(strategy, tiny_gpt2(seed))
    return strategy, model, strategy.create_optimizer(model.parameters(), lr=1e-3)


def run_loop_resume(name: str, out: Path, exact: bool = False) -> dict:
    data = batches(4, batch=MICRO * 2)
    strategy, model, optimizer = build(name, 0)
    for ids in data[:2]:
        step(strategy, model, optimizer, ids)
    ckpt = out / f"{name}-loop-{exact}"
    save_sharded(ckpt, model, optimizer)
    for ids in data[2:]:
        step(strategy, model, optimizer, ids)
    uninterrupted = weights(model)
    strategy, model, optimizer = build(name, 5)
    load_sharded(ckpt, model, optimizer)
    if exact:
        for ids in data[2:]:
            step(strategy, model, optimizer, ids)
        after = weights(model)
        return {"resumed_bit_for_bit": all(torch.equal(after[n], uninterrupted[n]) for n in after)}
    written = write(model)
    held = weights(model)
    zero_lr(optimizer)
    step(strategy, model, optimizer, data[2])
    return measured(model, written, held)


CASES = {
    "trainer-fresh": run_trainer_fresh,
    "trainer-resume": run_trainer_resume,
    "loop-accelerate": run_loop_accelerate,
    "loop-resume": run_loop_resume,
    "loop-resume-exact": lambda name, out: run_loop_resume(name, out, exact=True),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--names", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    ns = parser.parse_args()
    dist.init_process_group("gloo")
    out = Path(ns.out)
    torch.set_num_threads(1)
    result: dict = {"cases": {}}
    for name in ns.names.split(","):
        for case in ns.cases.split(","):
            try:
                result["cases"][f"{name}/{case}"] = CASES[case](name, out)
            except Exception:
                result["cases"][f"{name}/{case}"] = {"error": traceback.format_exc()[-4000:]}
            dist.barrier()
    finish_rank(out, result)
    os._exit(0)


if __name__ == "__main__":
    main()
