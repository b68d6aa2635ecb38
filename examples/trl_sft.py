"""TRL's SFTTrainer with a precision strategy: the import is the only change. Usage: python examples/trl_sft.py [strategy]"""

import sys

import torch
from datasets import Dataset
from transformers import GPT2LMHeadModel

from hf_lowprec.data import build_tokenizer, embedded_corpus, tiny_gpt2_config
from hf_lowprec.trl import SFTConfig, SFTTrainer  # was: from trl import SFTConfig, SFTTrainer

tokenizer = build_tokenizer()
model = GPT2LMHeadModel(tiny_gpt2_config(vocab_size=len(tokenizer)))
dataset = Dataset.from_dict({"text": embedded_corpus()})
args = SFTConfig(
    output_dir="runs/trl_sft",
    precision_strategy=(sys.argv[1:] or ["collage-plus"])[0],
    max_steps=30,
    per_device_train_batch_size=8,
    learning_rate=1e-3,
    max_length=64,
    logging_steps=10,
    report_to="none",
    use_cpu=not torch.cuda.is_available(),
)
trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
trainer.train()
print("final loss", [h["loss"] for h in trainer.state.log_history if "loss" in h][-1])
