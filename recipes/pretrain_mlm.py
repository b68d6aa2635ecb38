"""Masked-LM pretraining (BERT, RoBERTa) with a precision strategy.

    python recipes/pretrain_mlm.py --precision_strategy collage-plus --model_type roberta --max_steps 200
    python recipes/pretrain_mlm.py --precision_strategy collage-plus --model_type bert --bert_phase 2 \
        --model_name_or_path runs/pretrain_mlm          # phase 2 continues from the phase-1 output

BERT pretrains in two phases (Devlin et al., 2019, §A.2): most steps at 128 tokens, the rest
at 512, continuing from phase 1. `--bert_phase 1|2` picks `--phase1_seq_length` /
`--phase2_seq_length`; `--max_seq_length` sets the length directly (RoBERTa trains at one
length). The objective is MLM only (15% of tokens, 80/10/10 mask/random/keep), as RoBERTa
and the HF run_mlm example do; BERT's next-sentence prediction is left out.

With no model or data arguments it trains a tiny model of `--model_type` from scratch on the
embedded corpus with the local tokenizer.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from transformers import AutoModelForMaskedLM, DataCollatorForLanguageModeling, set_seed

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


@dataclasses.dataclass
class MLMArguments:
    bert_phase: Literal[1, 2] = dataclasses.field(default=1, metadata={"help": "BERT pretraining phase (1 or 2)."})
    phase1_seq_length: int = dataclasses.field(default=128, metadata={"help": "Sequence length of phase 1."})
    phase2_seq_length: int = dataclasses.field(default=512, metadata={"help": "Sequence length of phase 2."})
    max_seq_length: int | None = dataclasses.field(
        default=None, metadata={"help": "Sequence length, overriding the phase's."}
    )
    mlm_probability: float = dataclasses.field(default=0.15, metadata={"help": "Fraction of tokens to mask."})

    def __post_init__(self) -> None:
        self.bert_phase = int(self.bert_phase)
        if self.bert_phase not in (1, 2):
            raise ValueError(f"--bert_phase must be 1 or 2, got {self.bert_phase}")

    @property
    def seq_length(self) -> int:
        if self.max_seq_length is not None:
            return self.max_seq_length
        return self.phase1_seq_length if self.bert_phase == 1 else self.phase2_seq_length


def main(argv: list[str] | None = None) -> dict:
    model_args, data_args, mlm_args, training_args = parse_args(
        (ModelArguments, TextDataArguments, MLMArguments, TrainingArguments),
        "pretrain_mlm",
        argv,
        model_type="bert",
        num_train_epochs=1.0,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        warmup_steps=10,
        weight_decay=0.01,
        per_device_train_batch_size=16,
        logging_steps=10,
        save_strategy="no",
    )
    setup_logging(training_args)
    set_seed(training_args.seed)
    seq_length = mlm_args.seq_length

    tokenizer = load_tokenizer(model_args, encoder=True)
    # As in BERT, the position table has room for phase 2 from the start, so phase 2 can
    # continue from the phase-1 checkpoint.
    positions = max(seq_length, mlm_args.phase2_seq_length)
    model = load_model(AutoModelForMaskedLM, model_args, tokenizer, default_type="bert", max_length=positions)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and limit - (2 if model.config.model_type == "roberta" else 0) < seq_length:
        raise ValueError(f"the model has {limit} positions, fewer than the sequence length {seq_length}")
    raw = load_text_datasets(data_args, training_args.seed)
    # Blocks hold raw text tokens; the collator masks them. Phase lengths count every token.
    lm = group_texts(
        raw, tokenizer, seq_length, data_args.text_column, training_args=training_args, append_eos=False, labels=False
    )
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=mlm_args.mlm_probability)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=lm["train"],
        eval_dataset=lm["validation"],
        processing_class=tokenizer,
        data_collator=collator,
    )
    train_result = run_training(trainer, training_args)
    trainer.save_model()
    trainer.log_metrics("train", train_result.metrics)
    eval_metrics = trainer.evaluate()
    trainer.log_metrics("eval", eval_metrics)
    return report(
        training_args,
        trainer,
        eval_loss=eval_metrics["eval_loss"],
        seq_length=seq_length,
        model_type=model.config.model_type,
    )


if __name__ == "__main__":
    main()
