"""What `hf-lowprec compare` trains, shipped inside the package: causal-LM pretraining.

    python -m hf_lowprec.runner --precision_strategy collage-plus --max_steps 100 --output_dir out

The same Trainer path as the repository's `recipes/pretrain_clm.py` with no model or data argument
(`pretrain_clm`); nothing is downloaded, so it runs from an installed wheel in any directory. Any
`TrainingArguments` flag works; the result files are `write_result`'s, as the recipes write them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys
from typing import Any

import torch

__all__ = [
    "RESULT_MARKER",
    "PRETRAIN_CLM_DEFAULTS",
    "CLMRunArguments",
    "recipe_parser",
    "write_result",
    "pretrain_clm",
    "main",
]

# The line a run prints when it finishes; tests and scripts parse the JSON after it.
RESULT_MARKER = "hf_lowprec-recipe-result:"

# TrainingArguments defaults of causal-LM pretraining (recipes/pretrain_clm.py uses them too).
PRETRAIN_CLM_DEFAULTS: dict[str, Any] = {
    "num_train_epochs": 1.0,
    "learning_rate": 2e-3,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 10,
    "weight_decay": 0.01,
    "per_device_train_batch_size": 16,
    "logging_steps": 10,
    "save_strategy": "no",
}


@dataclasses.dataclass
class CLMRunArguments:
    """The embedded default's shape: tokens per sequence and tokenizer size."""

    block_size: int = dataclasses.field(default=64, metadata={"help": "Tokens per training sequence."})
    vocab_size: int = dataclasses.field(default=1024, metadata={"help": "Size of the locally trained BPE vocabulary."})


def write_result(training_args: Any, trainer: Any | None = None, **metrics: Any) -> dict[str, Any]:
    """Print the result line (main process); write it and the log history to `output_dir`.

    The result holds the strategy, first/final training loss, global step, the strategy's
    counters (`precision.metrics()`), the trainable parameters' elements by dtype and the dtype
    holding most of them, model-state bytes/param,
    the median step time (without the first step, which carries compilation and allocation),
    the world size and distributed backend, then `metrics`. It goes to `recipe_result.json`, the
    log history (every logged step) to `log_history.json`, and the printed line follows
    `RESULT_MARKER`.
    """
    result: dict[str, Any] = {"precision_strategy": training_args.precision_strategy}
    if trainer is not None:
        history = trainer.state.log_history
        losses = [h["loss"] for h in history if "loss" in h]
        if losses:
            result["first_loss"], result["final_loss"] = losses[0], losses[-1]
        result["global_step"] = trainer.state.global_step
        precision = getattr(trainer, "precision", None)
        if precision is not None:
            result.update(precision.metrics())
            from .memory import elements_by_dtype, model_state_bytes

            # Every dtype with its element count, largest first (mixed under FP8 strategies and LoRA).
            trainable = (p for p in trainer.model.parameters() if p.requires_grad)
            result["trainable_param_elements"] = {str(d): n for d, n in elements_by_dtype(trainable).items()}
            result["trainable_param_dtype"] = next(iter(result["trainable_param_elements"]), None)
            if trainer.optimizer is not None:
                result["model_state_bytes_per_param"] = model_state_bytes(trainer.model, trainer.optimizer)["total"]
        step_seconds = getattr(trainer, "step_seconds", None)
        if step_seconds:
            result["median_step_seconds"] = statistics.median(step_seconds[1:] or step_seconds)
        result["world_size"] = training_args.world_size
        accelerator = getattr(trainer, "accelerator", None)
        if accelerator is not None:
            result["distributed_type"] = str(accelerator.distributed_type.value)
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                result["backend"] = torch.distributed.get_backend()
    result.update(metrics)
    if training_args.process_index == 0:
        os.makedirs(training_args.output_dir, exist_ok=True)
        with open(os.path.join(training_args.output_dir, "recipe_result.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
        if trainer is not None:  # the per-step logs, for `hf-lowprec compare`
            with open(os.path.join(training_args.output_dir, "log_history.json"), "w") as f:
                json.dump(trainer.state.log_history, f, default=str)
        print(RESULT_MARKER, json.dumps(result, default=str), flush=True)
    return result


def recipe_parser() -> Any:
    """The command line's parser: `CLMRunArguments` and `TrainingArguments`, with the recipe's defaults."""
    from transformers import HfArgumentParser

    from .integrations.trainer import TrainingArguments

    parser = HfArgumentParser((CLMRunArguments, TrainingArguments))
    parser.set_defaults(
        output_dir=os.path.join("runs", "pretrain_clm"),
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        **PRETRAIN_CLM_DEFAULTS,
    )
    return parser


def _parse(argv: list[str]) -> tuple[CLMRunArguments, Any]:
    return recipe_parser().parse_args_into_dataclasses(args=argv)


def pretrain_clm(argv: list[str] | None = None) -> dict[str, Any]:
    """Train the tiny GPT-2 on the embedded corpus under the command line's strategy; the result.

    `hf_lowprec.Trainer` with the recipe's `TrainingArguments` defaults (`PRETRAIN_CLM_DEFAULTS`,
    which recipes/pretrain_clm.py imports), a tiny GPT-2 built from a config, the byte-level BPE
    tokenizer trained locally on the embedded corpus, and blocks of that corpus (`hf_lowprec.data`):
    `datasets` is not needed."""
    from transformers import GPT2LMHeadModel, default_data_collator, set_seed

    from .data import build_tokenizer, clm_datasets, tiny_gpt2_config
    from .integrations.trainer import Trainer

    run_args, training_args = _parse(sys.argv[1:] if argv is None else argv)
    set_seed(training_args.seed)
    tokenizer = build_tokenizer(run_args.vocab_size)
    train_ds, eval_ds = clm_datasets(tokenizer, block_size=run_args.block_size, seed=training_args.seed)
    config = tiny_gpt2_config(len(tokenizer), n_positions=max(128, run_args.block_size))
    model = GPT2LMHeadModel(config)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )
    train_result = trainer.train()
    trainer.save_model()
    trainer.log_metrics("train", train_result.metrics)
    eval_metrics = trainer.evaluate()
    perplexity = math.exp(min(eval_metrics["eval_loss"], 50.0))
    trainer.log_metrics("eval", {**eval_metrics, "perplexity": perplexity})
    return write_result(training_args, trainer, eval_loss=eval_metrics["eval_loss"], perplexity=perplexity)


def main(argv: list[str] | None = None) -> int:
    """`python -m hf_lowprec.runner [TrainingArguments flags]`."""
    pretrain_clm(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
