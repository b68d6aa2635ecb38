"""One rank of the TRL-under-DeepSpeed tests: DPO and KTO cases in one launch (gloo, CPU).

Started by `tests/deepspeed/test_trl_zero.py` through `_launch.launch`. Each case builds TRL
trainers from `hf_lowprec.trl` with a DeepSpeed config and records what they hold and log:
`precompute_ref_log_probs=True` without a reference under ZeRO-2, its cache key under ZeRO-3
with two different references, and coat's frozen reference under ZeRO-3. Results go to
`<out>/rank<r>.json`, with "complete": true at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import datasets  # noqa: E402
import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402

import hf_lowprec.trl as hl_trl  # noqa: E402
from hf_lowprec.fp8.blocks import FrozenBlockFP8Linear  # noqa: E402
from tests.helpers import PAIRS, left_padded_tokenizer, tiny_lm, trl_args  # noqa: E402

PRE = {"precompute_ref_log_probs": True}
UNPAIRED = {
    "prompt": ["Return the", "Open a"],
    "completion": [" value of x", " reading for file"],
    "label": [True, False],
}


def ds_config(stage: int) -> dict:
    return {
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
    }


def on_disk(columns: dict, path: Path) -> datasets.Dataset:
    """Four copies of `columns` saved by rank 0 and loaded by every rank (TRL caches precomputed
    log-probs beside a dataset's files, under a key of its fingerprint and the model hash)."""
    if dist.get_rank() == 0:
        datasets.Dataset.from_dict({k: v * 4 for k, v in columns.items()}).save_to_disk(str(path))
    dist.barrier()
    return datasets.load_from_disk(str(path))


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def precompute_without_reference(kind: str, out: Path, tok) -> dict:
    """ZeRO-2, collage-plus, ref_model=None: TRL builds a stage-0 engine over the policy."""
    data = on_disk(PAIRS if kind == "DPO" else UNPAIRED, out / "data")
    args = trl_args(f"{kind}Config", out, "collage-plus", max_length=32, max_steps=2, deepspeed=ds_config(2), **PRE)
    trainer = getattr(hl_trl, f"{kind}Trainer")(model=tiny_lm(tok), args=args, train_dataset=data, processing_class=tok)
    column = "ref_chosen_logps" if kind == "DPO" else "ref_logps"
    bf16 = trainer.accelerator.state.deepspeed_plugin.deepspeed_config["bf16"]
    trainer.train()
    return {"ref_logps": list(trainer.train_dataset[column]), "losses": losses(trainer), "bf16_after": bf16}


def precompute_cache_key(out: Path, tok) -> dict:
    """ZeRO-3, collage-plus, three DPO trainers into one output directory over one dataset:
    references of seed 0, 5, 0. The reference's engine is built in TRL's `__init__`."""
    data = on_disk(PAIRS, out / "data")
    seen = {}
    for run, seed in (("first", 0), ("other", 5), ("again", 0)):
        args = trl_args("DPOConfig", out, "collage-plus", max_length=32, deepspeed=ds_config(3), **PRE)
        trainer = hl_trl.DPOTrainer(
            model=tiny_lm(tok), ref_model=tiny_lm(tok, seed=seed), args=args, train_dataset=data, processing_class=tok
        )
        logps = list(trainer.train_dataset["ref_chosen_logps"])
        seen[run] = {
            "hash": getattr(trainer, "_precompute_model_hash", None),  # (TRL 1.13 keeps none)
            "strategy": repr(trainer.precision),
            "ref_logps": logps,
        }
        del trainer
    return seen


def coat_frozen_reference(out: Path, tok) -> dict:
    """ZeRO-3, coat, a passed reference: frozen to FP8 blocks, ZeRO-3 would all-gather float8."""
    data = datasets.Dataset.from_dict({k: v * 2 for k, v in PAIRS.items()})
    args = trl_args("DPOConfig", out, "coat", max_length=32, max_steps=2, deepspeed=ds_config(3))
    trainer = hl_trl.DPOTrainer(
        model=tiny_lm(tok), ref_model=tiny_lm(tok, seed=0), args=args, train_dataset=data, processing_class=tok
    )
    trainer.train()
    reference = trainer.ref_model.module  # TRL's ZeRO-3 engine around it
    return {
        "frozen": trainer.hf_lowprec_frozen_models["reference"]["storage"],
        "fp8_layers": sum(isinstance(m, FrozenBlockFP8Linear) for m in reference.modules()),
        "dtypes": sorted({str(p.dtype) for p in reference.parameters()}),
        "losses": losses(trainer),
    }


CASES = {
    "dpo_precompute_zero2": lambda out, tok: precompute_without_reference("DPO", out, tok),
    "kto_precompute_zero2": lambda out, tok: precompute_without_reference("KTO", out, tok),
    "dpo_cache_key_zero3": precompute_cache_key,
    "coat_reference_zero3": coat_frozen_reference,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True, help="JSON list of case names (CASES)")
    args = parser.parse_args()
    out = Path(args.out)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    results: dict = {"world_size": dist.get_world_size(), "cases": {}}
    path = out / f"rank{rank}.json"
    tok = left_padded_tokenizer()

    def flush(complete: bool = False) -> None:
        results["complete"] = complete
        path.write_text(json.dumps(results, indent=1))

    for name in json.loads(args.cases):
        try:
            case = CASES[name](out / name, tok)
        except Exception:  # recorded, so the test shows which case failed and why
            case = {"error": traceback.format_exc()}
        results["cases"][name] = case
        flush()
        dist.barrier()
    flush(complete=True)
    dist.barrier()


if __name__ == "__main__":
    main()
