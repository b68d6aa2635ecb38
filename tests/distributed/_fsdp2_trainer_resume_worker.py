"""One rank of a Trainer under FSDP2 (Accelerate's path, forced on CPU as `_fsdp2_worker` does):
per strategy, 4 steps with a checkpoint at step 2, then a new Trainer resumed from it; writes the
losses and a digest of the full weights of both runs to `<out>/rank<r>.json`."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_lowprec import Trainer, TrainingArguments
from tests.helpers import batches, tiny_gpt2


class FSDP2Trainer(Trainer):
    def create_accelerator_and_postprocess(self) -> None:
        from accelerate import FullyShardedDataParallelPlugin
        from accelerate.utils import DistributedType

        super().create_accelerator_and_postprocess()
        self.accelerator.state.distributed_type = DistributedType.FSDP
        self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        self.is_fsdp_enabled = True


def digest(trainer) -> str:
    h = hashlib.sha256()
    for name, value in sorted(trainer.model.state_dict().items()):
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        h.update(name.encode() + value.detach().float().numpy().tobytes())
    return h.hexdigest()


def run(name: str, out: Path) -> dict:
    rows = [{"input_ids": r, "labels": r} for ids in batches(8, batch=4, seed=1) for r in ids]

    def make() -> Trainer:
        args = TrainingArguments(
            output_dir=str(out / name),
            precision_strategy=name,
            fsdp="full_shard",
            fsdp_config={"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT"},
            use_cpu=True,
            per_device_train_batch_size=2,
            max_steps=4,
            save_steps=2,
            learning_rate=1e-3,
            weight_decay=0.01,
            lr_scheduler_type="linear",
            warmup_steps=1,
            max_grad_norm=1.0,
            logging_steps=1,
            report_to=[],
            disable_tqdm=True,
            seed=0,
        )
        return FSDP2Trainer(model=tiny_gpt2(), args=args, train_dataset=rows)

    def losses(trainer) -> list[float]:
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    whole = make()
    whole.train()
    result = {"losses": losses(whole), "digest": digest(whole)}
    dist.barrier()
    resumed = make()
    resumed.train(resume_from_checkpoint=str(out / name / "checkpoint-2"))
    result.update(resumed_losses=losses(resumed), resumed_digest=digest(resumed))
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--names", required=True)
    ns = parser.parse_args()
    dist.init_process_group("gloo")
    rank, out = dist.get_rank(), Path(ns.out)
    torch.set_num_threads(1)
    result = {"cases": {}}
    for name in ns.names.split(","):
        try:
            result["cases"][name] = run(name, out)
        except Exception:
            result["cases"][name] = {"error": traceback.format_exc()[-4000:]}
    result["complete"] = True
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
