"""Causal-LM (GPT) pretraining with a precision strategy.

    python recipes/pretrain_clm.py --precision_strategy collage-plus --max_steps 200
    accelerate launch --config_file recipes/configs/ddp.yaml recipes/pretrain_clm.py --precision_strategy collage-plus

With no model or data arguments it trains a tiny GPT-2 from scratch on the embedded corpus
with the local tokenizer. The real thing: `--model_name_or_path gpt2` (continue training) or
`--config_name gpt2` (from scratch), `--dataset_name wikitext --dataset_config_name
wikitext-103-raw-v1` or `--train_file corpus.txt`. Any `TrainingArguments` flag works.
"""

from __future__ import annotations

import dataclasses
import math

from transformers import AutoModelForCausalLM, default_data_collator, set_seed

from common import (
    ModelArguments,
    TextDataArguments,
    group_texts,
    load_model,
    load_text_datasets,
    load_tokenizer,
    parse_args,
    report,
    run_training,
    setup_logging,
)
from hf_lowprec import Trainer, TrainingArguments
from hf_lowprec.runner import PRETRAIN_CLM_DEFAULTS


@dataclasses.dataclass
class CLMArguments:
    block_size: int = dataclasses.field(default=64, metadata={"help": "Tokens per training sequence."})


def main(argv: list[str] | None = None) -> dict:
    model_args, data_args, clm_args, training_args = parse_args(
        (ModelArguments, TextDataArguments, CLMArguments, TrainingArguments),
        "pretrain_clm",
        argv,
        **PRETRAIN_CLM_DEFAULTS,
    )
    setup_logging(training_args)
    set_seed(training_args.seed)

    tokenizer = load_tokenizer(model_args)
    model = load_model(AutoModelForCausalLM, model_args, tokenizer, default_type="gpt2", max_length=clm_args.block_size)
    raw = load_text_datasets(data_args, training_args.seed)
    lm = group_texts(
        raw,
        tokenizer,
        clm_args.block_size,
        data_args.text_column,
        training_args=training_args,
        append_eos=True,
        labels=True,
    )

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=lm["train"],
        eval_dataset=lm["validation"],
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )
    train_result = run_training(trainer, training_args)
    trainer.save_model()
    trainer.log_metrics("train", train_result.metrics)
    eval_metrics = trainer.evaluate()
    perplexity = math.exp(min(eval_metrics["eval_loss"], 50.0))
    trainer.log_metrics("eval", {**eval_metrics, "perplexity": perplexity})
    return report(training_args, trainer, eval_loss=eval_metrics["eval_loss"], perplexity=perplexity)


if __name__ == "__main__":
    main()
