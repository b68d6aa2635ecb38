"""One rank of a Trainer resume under FSDP2 or DeepSpeed ZeRO-2 (gloo, CPU) from a checkpoint whose
recorded hf_lowprec version is edited: 2 steps saved at step 2, then per case a copy of the
checkpoint resumed for one step. Writes, per case, the hf_lowprec.version warnings this rank logged
to `<out>/rank<r>.json`. The engines "accelerate-fsdp2" and "accelerate-zero2" run a custom
Accelerate loop's save_state / load_state in the same processes (`_accelerate_state_worker`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_lowprec import Trainer
from hf_lowprec.checkpoints.manifest import MANIFEST, file_entry
from tests.deepspeed._launch import finish_rank
from tests.distributed._fsdp2_trainer_resume_worker import FSDP2Trainer
from tests.helpers import TokenBlocks, make_args, tiny_gpt2

CASES = ("same", "0.1.9", "none")  # as saved; every record says 0.1.9; the manifest records none


class Caught(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _retag(value, saved: str) -> bool:
    """Set every "hf_lowprec_version" inside `value` to `saved`; whether one was found."""
    found = False
    if isinstance(value, dict):
        if "hf_lowprec_version" in value:
            value["hf_lowprec_version"], found = saved, True
        for item in value.values():
            found = _retag(item, saved) or found
    elif isinstance(value, (list, tuple)):
        for item in value:
            found = _retag(item, saved) or found
    return found


def edit(checkpoint: Path, case: str) -> list[str]:
    """What `case` says of `checkpoint`'s version (rank 0); the files rewritten."""
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    rewritten = []
    if case == "0.1.9":
        for name in sorted(manifest["files"]):
            if name.endswith(".pt"):
                state = torch.load(checkpoint / name, map_location="cpu", weights_only=False)
                if _retag(state, case):
                    torch.save(state, checkpoint / name)
                    manifest["files"][name] = file_entry(str(checkpoint / name))
                    rewritten.append(name)
        manifest["hf_lowprec_version"] = case
    elif case == "none":
        del manifest["hf_lowprec_version"], manifest["hf_lowprec_commit"]
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    return rewritten


def trainer(engine: str, out: Path, steps: int) -> Trainer:
    extra = (
        {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT"}}
        if engine == "fsdp2"
        else {"deepspeed": {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}}
    )
    args = make_args(
        out, "bf16-sr", max_steps=steps, save_steps=2, save_strategy="steps", per_device_train_batch_size=2, **extra
    )
    cls = FSDP2Trainer if engine == "fsdp2" else Trainer
    return cls(model=tiny_gpt2(0), args=args, train_dataset=TokenBlocks(16))


def run(engine: str, out: Path) -> dict:
    trainer(engine, out / engine, 2).train()
    dist.barrier()
    result = {}
    for case in CASES:
        where = out / f"{engine}-{case}"
        if dist.get_rank() == 0:
            shutil.copytree(out / engine / "checkpoint-2", where / "checkpoint-2")
            result[f"{case}-rewritten"] = edit(where / "checkpoint-2", case)
        dist.barrier()
        caught = Caught()
        logging.getLogger("hf_lowprec.version").addHandler(caught)
        try:
            trainer(engine, where, 3).train(resume_from_checkpoint=str(where / "checkpoint-2"))
        finally:
            logging.getLogger("hf_lowprec.version").removeHandler(caught)
        result[case] = caught.messages
        dist.barrier()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--engines", required=True)
    ns = parser.parse_args()
    dist.init_process_group("gloo")
    out = Path(ns.out)
    torch.set_num_threads(1)
    result = {"cases": {}}
    for engine in ns.engines.split(","):
        try:
            if engine.startswith("accelerate-"):  # a custom Accelerate loop's save_state / load_state
                from tests.distributed._accelerate_state_worker import run as run_loop

                result["cases"][engine] = run_loop(engine.removeprefix("accelerate-"), out)
            else:
                result["cases"][engine] = run(engine, out)
        except Exception:
            result["cases"][engine] = {"error": traceback.format_exc()[-4000:]}
    finish_rank(out, result)
    os._exit(0)


if __name__ == "__main__":
    main()
