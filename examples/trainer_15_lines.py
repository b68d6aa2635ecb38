"""hf_lowprec.Trainer in 15 lines: a tiny GPT-2 on the embedded corpus. Usage: python examples/trainer_15_lines.py [strategy]"""

import sys

import torch
from transformers import GPT2LMHeadModel

from hf_lowprec import Trainer, TrainingArguments
from hf_lowprec.data import build_tokenizer, clm_datasets, tiny_gpt2_config

tokenizer = build_tokenizer()
train_ds, eval_ds = clm_datasets(tokenizer, block_size=64)
model = GPT2LMHeadModel(tiny_gpt2_config(vocab_size=len(tokenizer)))
args = TrainingArguments(
    output_dir="runs/trainer_15_lines",
    precision_strategy=(sys.argv[1:] or ["collage-plus"])[0],
    max_steps=60,
    per_device_train_batch_size=16,
    learning_rate=2e-3,
    logging_steps=20,
    report_to="none",
    use_cpu=not torch.cuda.is_available(),
)
trainer = Trainer(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds)
trainer.train()
print("eval loss", trainer.evaluate()["eval_loss"])
