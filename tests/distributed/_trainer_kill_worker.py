"""One rank of the kill-a-rank Trainer test (DDP or DeepSpeed ZeRO-2, 2 gloo ranks, `save_total_limit=1`).

Started by `tests/distributed/test_trainer_kill.py` through `launch_ranks`. Phases:

- `victim`: trains toward 6 steps, saving every 2; after step 3, $HF_LOWPREC_TEST_CRASH_AT is set
  to `save-rng-state@1`, so rank 1 ends (os._exit) inside the save of checkpoint-4 before its
  `rng_state_1.pth` exists, while rank 0 writes its files and `trainer_state.json` (under
  DeepSpeed both ranks have written their ZeRO partitions of checkpoint-4 by then).
- `resume`: the uninterrupted run (in `reference/`), then a fresh Trainer with other initial
  weights resumed with `resume_from_checkpoint=True` in the victim's directory.

Each rank writes `<out>/<phase>-rank<r>.json`: losses as logged, a digest of the weights and of
the optimizer state, and the resume's warnings.
"""

import argparse
import hashlib
import json
import logging
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from transformers import TrainerCallback  # noqa: E402

from hf_lowprec import Trainer, TrainingArguments  # noqa: E402
from hf_lowprec.checkpoints.manifest import ENV_CRASH_AT  # noqa: E402
from hf_lowprec.memory import unwrap_optimizer  # noqa: E402
from tests.helpers import TokenBlocks, tiny_gpt2  # noqa: E402

STRATEGY = "collage-plus"
MAX_STEPS, SAVE_STEPS, KILLED_AT = 6, 2, 4


# ZeRO-2 on gloo, DeepSpeed in FP32 and the strategy's optimizer (no JIT-built DeepSpeed op).
DEEPSPEED = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 2},
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "steps_per_print": 10**9,
}


def trainer(output_dir: Path, engine: str, seed: int = 0) -> Trainer:
    args = TrainingArguments(
        deepspeed=DEEPSPEED if engine == "deepspeed" else None,
        output_dir=str(output_dir),
        precision_strategy=STRATEGY,
        precision_options={"fused": "reference"},
        max_steps=MAX_STEPS,
        save_steps=SAVE_STEPS,
        save_strategy="steps",
        save_total_limit=1,
        per_device_train_batch_size=2,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=1,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        ddp_timeout=120,  # a rank waiting for a dead one gives up within 2 minutes
    )
    return Trainer(model=tiny_gpt2(seed), args=args, train_dataset=TokenBlocks(16))


class CrashInNextSave(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == KILLED_AT - 1:
            os.environ[ENV_CRASH_AT] = "save-rng-state@1"


def digest(values) -> str:
    h = hashlib.sha256()
    for t in values:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def summary(run: Trainer) -> dict:
    # The strategy's own optimizer (under DeepSpeed: the one stepping this rank's partitions).
    state = unwrap_optimizer(run.optimizer).state_dict()["state"]
    tensors = [v for _, s in sorted(state.items()) for _, v in sorted(s.items()) if torch.is_tensor(v)]
    return {
        "losses": [(h["step"], h["loss"]) for h in run.state.log_history if "loss" in h],
        "weights": digest(run.model.state_dict().values()),
        "optimizer": digest(tensors),
        "scheduler": run.lr_scheduler.state_dict()["last_epoch"],
        "global_step": run.state.global_step,
    }


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--phase", choices=["victim", "resume"], required=True)
    parser.add_argument("--engine", choices=["ddp", "deepspeed"], default="ddp")
    args = parser.parse_args()
    out = Path(args.out)
    rank = int(os.environ["RANK"])
    result: dict = {}
    if args.phase == "victim":
        run = trainer(out / "run", args.engine)
        run.add_callback(CrashInNextSave())
        run.train()
        result["finished"] = True  # not reached by rank 1; rank 0's save must fail
    else:
        reference = trainer(out / "reference", args.engine)
        reference.train()
        result["reference"] = summary(reference)
        warnings = Warnings()
        logging.getLogger("hf_lowprec.checkpoints.resume").addHandler(warnings)
        resumed = trainer(out / "run", args.engine, seed=7)
        resumed.train(resume_from_checkpoint=True)
        result["resumed"] = summary(resumed)
        result["warnings"] = warnings.messages
        result["complete"] = True  # written only after everything above (see exit_is_tolerated)
    (out / f"{args.phase}-rank{rank}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
