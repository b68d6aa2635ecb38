"""LoRA (peft) under a precision strategy with hf_lowprec.Trainer. Usage: python examples/lora.py [strategy]

Only the adapter weights are trained, so only they get the strategy's optimizer state; the
frozen base is held in the strategy's compute dtype; `save_model` writes just the adapter.
"""

import sys

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import GPT2LMHeadModel

from hf_lowprec import Trainer, TrainingArguments
from hf_lowprec.data import build_tokenizer, clm_datasets, tiny_gpt2_config

tokenizer = build_tokenizer()
train_ds, _ = clm_datasets(tokenizer, block_size=64)
base = GPT2LMHeadModel(tiny_gpt2_config(vocab_size=len(tokenizer)))
model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj"], task_type="CAUSAL_LM"))
args = TrainingArguments(
    output_dir="runs/lora",
    precision_strategy=(sys.argv[1:] or ["collage-plus"])[0],
    max_steps=30,
    per_device_train_batch_size=8,
    learning_rate=3e-3,
    logging_steps=10,
    report_to="none",
    use_cpu=not torch.cuda.is_available(),
)
trainer = Trainer(model=model, args=args, train_dataset=train_ds)
trainer.train()
trainer.save_model()  # adapter_model.safetensors + adapter_config.json

trainable = {p.dtype for p in model.parameters() if p.requires_grad}
frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
print(f"trainable {trainable}, frozen {frozen}, optimizer states for {len(trainer.optimizer.state)} tensors")
reloaded = PeftModel.from_pretrained(GPT2LMHeadModel(tiny_gpt2_config(vocab_size=len(tokenizer))), "runs/lora")
print("adapter reloaded:", type(reloaded).__name__)
