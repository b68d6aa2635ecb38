"""One rank of tests/distributed/test_guard_trainer_save.py: the guard in a DDP Trainer that saves.

A tiny GPT-2, collage-plus with the guard (rollback after one fault, no scheduled snapshot in the
run), a checkpoint every 3 steps, and a NaN loss at step 5 on both ranks. The Trainer saves the
optimizer's state on rank 0 only; the save must be the snapshot point on every rank, so both roll
back to it and end with the same parameters. Results go to `<out>/rank<r>.json`.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import traceback
from pathlib import Path

import torch.distributed as dist

from hf_lowprec import Trainer, TrainingArguments
from tests.deepspeed._launch import finish_rank
from tests.helpers import TokenBlocks, tiny_gpt2

GUARD = {"window": 8, "warmup": 2, "rollback_after": 1, "snapshot_every": 100, "z_threshold": math.inf}
NAN_AT = 5


def run(out: Path) -> dict:
    args = TrainingArguments(
        output_dir=str(out), precision_strategy="collage-plus",
        precision_options={"fused": "reference", "guard": GUARD}, max_steps=7, save_steps=3,
        save_strategy="steps", per_device_train_batch_size=2, learning_rate=3e-3, logging_steps=1,
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0, ddp_timeout=120,
    )  # fmt: skip
    trainer = Trainer(model=tiny_gpt2(0), args=args, train_dataset=TokenBlocks(32))
    compute_loss = trainer.compute_loss

    def poisoned(*a, **k):
        loss = compute_loss(*a, **k)
        if trainer.state.global_step + 1 == NAN_AT:
            return (loss[0] * float("nan"), *loss[1:]) if isinstance(loss, tuple) else loss * float("nan")
        return loss

    trainer.compute_loss = poisoned
    trainer.train()
    digest = hashlib.sha256()
    for p in trainer.model.parameters():
        digest.update(p.detach().float().numpy().tobytes())
    actions = [[a["action"], a.get("step")] for a in trainer.precision.guard.actions]
    return {"digest": digest.hexdigest()[:16], "actions": actions}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    dist.init_process_group("gloo")
    result: dict = {"world_size": dist.get_world_size()}
    try:
        result["case"] = run(out / "run")
    except Exception:
        result["case"] = {"error": traceback.format_exc()[-2000:]}
    finish_rank(out, result)


if __name__ == "__main__":
    main()
