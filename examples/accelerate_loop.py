"""A hand-written Accelerate training loop; the three lines marked `hf_lowprec` apply the strategy.

python examples/accelerate_loop.py collage-plus
accelerate launch --config_file recipes/configs/ddp.yaml examples/accelerate_loop.py collage-plus
"""

import sys

import torch
from accelerate import Accelerator
from transformers import GPT2LMHeadModel, get_cosine_schedule_with_warmup

from hf_lowprec.data import build_tokenizer, clm_datasets, tiny_gpt2_config
from hf_lowprec.integrations.accelerate import PrecisionPlugin

strategy = (sys.argv[1:] or ["collage-plus"])[0]
accelerator = Accelerator(cpu=not torch.cuda.is_available())
tokenizer = build_tokenizer()
train_ds, _ = clm_datasets(tokenizer, block_size=64)
loader = torch.utils.data.DataLoader(train_ds, batch_size=8, shuffle=True)
model = GPT2LMHeadModel(tiny_gpt2_config(vocab_size=len(tokenizer)))
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
# Accelerate steps a prepared scheduler once per process, so the schedule counts every process.
scheduler = get_cosine_schedule_with_warmup(
    optimizer, num_warmup_steps=5, num_training_steps=40 * accelerator.num_processes
)

plugin = PrecisionPlugin(strategy)  # hf_lowprec
model, optimizer, loader, scheduler = plugin.prepare(accelerator, model, optimizer, loader, scheduler)  # hf_lowprec

model.train()
for step, batch in zip(range(40), loader):
    loss = model(**batch).loss
    plugin.backward(accelerator, loss)  # hf_lowprec
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    if step % 10 == 0 or step == 39:
        accelerator.print(
            f"step {step:2d}  loss {loss.item():.4f}  lr {scheduler.get_last_lr()[0]:.2e}  {plugin.metrics()}"
        )
accelerator.print(
    f"{strategy}: {accelerator.num_processes} process(es), parameters in {next(model.parameters()).dtype}"
)
