"""The main job on its embedded default: a tiny GPT-2 trained from scratch with each strategy.

    python -m hf_lowprec.demo [--steps 200] [--strategies fp32,bf16-pure]

Prints one table: strategy, final train loss, eval perplexity, median step time, model-state
bytes/param. Everything is built locally (corpus, tokenizer, model), so it runs offline.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time

import torch
import transformers
from transformers import GPT2LMHeadModel, PrinterCallback, TrainerCallback

from .data import build_tokenizer, clm_datasets, tiny_gpt2_config
from .integrations.trainer import Trainer, TrainingArguments
from .memory import model_state_bytes
from .planning.models import quiet
from .strategies.registry import available_strategies, strategy_class

__all__ = ["run_strategy", "main"]


class _StepTimer(TrainerCallback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._start)


def run_strategy(
    strategy: str,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    tokenizer,
    train_ds,
    eval_ds,
    output_dir: str,
    options: dict | None = None,
    config: dict | None = None,
) -> dict[str, float]:
    """Train the tiny GPT-2 under `strategy` (with `options`, its `precision_options`; `config`:
    overrides of `tiny_gpt2_config`) and return its row."""
    transformers.set_seed(seed)
    model = GPT2LMHeadModel(tiny_gpt2_config(vocab_size=len(tokenizer), **(config or {})))
    args = TrainingArguments(
        output_dir=output_dir,
        precision_strategy=strategy,
        precision_options=options,
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size,
        learning_rate=lr,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, steps // 20),
        weight_decay=0.01,
        logging_steps=max(1, steps // 10),
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    timer = _StepTimer()
    trainer = Trainer(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds, callbacks=[timer])
    trainer.remove_callback(PrinterCallback)  # the table below is the output
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    eval_loss = trainer.evaluate()["eval_loss"]
    memory = model_state_bytes(trainer.model, trainer.optimizer)
    return {
        "final_train_loss": losses[-1],
        "eval_perplexity": math.exp(eval_loss),
        "median_step_ms": 1000 * statistics.median(timer.times[1:] or timer.times),
        "bytes_per_param": memory["total"],
        "documented_bytes_per_param": trainer.precision.bytes_per_param,
        "skipped_steps": trainer.precision.skipped_steps,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument(
        "--strategies",
        default=",".join(available_strategies()),
        help="comma-separated strategy names (default: all registered)",
    )
    ns = parser.parse_args(argv)
    names = list(dict.fromkeys(s.strip() for s in ns.strategies.split(",") if s.strip()))
    if not names:
        parser.error("--strategies names no strategy; pass comma-separated names (hf-lowprec list shows them)")
    for name in names:
        try:
            strategy_class(name)  # unknown names fail before any training
        except ValueError as error:
            parser.error(f"--strategies: {error}")
    for flag, value, least in (
        ("--steps", ns.steps, 1),
        ("--batch_size", ns.batch_size, 1),
        ("--threads", ns.threads, 0),
    ):
        if value < least:
            parser.error(f"{flag} must be at least {least}, got {value}")
    if not ns.lr > 0:
        parser.error(f"--lr must be a positive learning rate, got {ns.lr}")
    # The thread count and transformers' logger level are the caller's again on return: main() is
    # also called in-process (tests, notebooks), where they outlived it.
    threads = torch.get_num_threads()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    try:
        with quiet("transformers"):
            return _table(ns, names)
    finally:
        torch.set_num_threads(threads)


def _table(ns: argparse.Namespace, names: list[str]) -> list[dict]:
    """Train each strategy in `names` as `ns` says, printing one row each; the rows."""
    tokenizer = build_tokenizer()
    train_ds, eval_ds = clm_datasets(tokenizer, block_size=64)
    rows = []
    header = f"{'strategy':<18} {'train loss':>10} {'eval ppl':>9} {'step ms':>8} {'bytes/param':>11}"
    print(f"tiny GPT-2, {ns.steps} steps, batch {ns.batch_size}x64 tokens, cosine lr {ns.lr}, seed {ns.seed}")
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as out:
        for name in names:
            row = run_strategy(
                name,
                steps=ns.steps,
                batch_size=ns.batch_size,
                lr=ns.lr,
                seed=ns.seed,
                tokenizer=tokenizer,
                train_ds=train_ds,
                eval_ds=eval_ds,
                output_dir=out,
            )
            row["strategy"] = name
            rows.append(row)
            print(
                f"{name:<18} {row['final_train_loss']:>10.4f} {row['eval_perplexity']:>9.2f} "
                f"{row['median_step_ms']:>8.1f} {row['bytes_per_param']:>11.2f}",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    main()
