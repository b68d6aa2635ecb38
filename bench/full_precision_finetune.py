"""What seeding the compensation with the FP32 residual changes in a short finetune.

Run: `python bench/full_precision_finetune.py` (a few minutes on 2 CPU cores). It pretrains the
tiny GPT-2 of `hf_lowprec.data` in FP32 on half of the embedded corpus, then finetunes that FP32
checkpoint on the other half under each strategy, with and without `seed_compensation`, and
compares with the same finetune in FP32:

- start error: ‖W − W₃₂‖/‖W₃₂‖ of `full_precision_state_dict` right after conversion;
- drift: ‖W − W_ref‖/‖W_ref − W₀‖ after the finetune, W_ref the FP32 finetune, i.e. the error
  relative to how far the reference moved (1.0 = as wrong as not training at all);
- the eval loss of the BF16 model after the finetune, and of W loaded into an FP32 model.

A measurement, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path

import torch
from transformers import GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_lowprec import get_strategy
from hf_lowprec.data import build_tokenizer, clm_datasets, tiny_gpt2_config


def batches(dataset, indices: list[int], batch: int, steps: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    picks = torch.tensor(indices)[torch.randint(0, len(indices), (steps, batch), generator=generator)]
    return [dataset.blocks[p] for p in picks]


def train(strategy_name: str, model: GPT2LMHeadModel, data: list[torch.Tensor], lr: float, **options):
    strategy = get_strategy(strategy_name, **options)
    model = strategy.prepare_model(model)
    optimizer = strategy.create_optimizer(model.parameters(), lr=lr, weight_decay=0.0)
    start = strategy.full_precision_state_dict(model, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / len(data))))
    model.train()
    for ids in data:
        strategy.train_step(model, ids, optimizer)
        scheduler.step()
    return strategy, model, optimizer, start


@torch.no_grad()
def eval_loss(model: GPT2LMHeadModel, blocks: torch.Tensor, context=None) -> float:
    model.eval()
    total = 0.0
    for chunk in blocks.split(32):
        if context is not None:
            with context():
                total += model(input_ids=chunk, labels=chunk).loss.item() * len(chunk)
        else:
            total += model(input_ids=chunk, labels=chunk).loss.item() * len(chunk)
    return total / len(blocks)


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(((a[k].double() - b[k].double()) ** 2).sum().item() for k in b if b[k].is_floating_point()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pretrain-steps", type=int, default=600)
    parser.add_argument("--finetune-steps", type=int, default=200)
    parser.add_argument("--lrs", default="1e-4,1e-5")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = build_tokenizer()
    train_ds, eval_ds = clm_datasets(tokenizer)
    half = len(train_ds) // 2
    torch.manual_seed(0)
    pretrained = GPT2LMHeadModel(tiny_gpt2_config(vocab_size=len(tokenizer)))
    _, pretrained, _, _ = train(
        "fp32", pretrained, batches(train_ds, list(range(half)), 16, args.pretrain_steps, 0), 1e-3
    )
    w32 = {k: v.clone() for k, v in pretrained.state_dict().items()}
    print(f"pretrained FP32 for {args.pretrain_steps} steps: eval loss {eval_loss(pretrained, eval_ds.blocks):.4f}")

    finetune = batches(train_ds, list(range(half, len(train_ds))), 16, args.finetune_steps, 1)
    for lr in (float(x) for x in args.lrs.split(",")):
        _, ref_model, _, _ = train("fp32", copy.deepcopy(pretrained), finetune, lr)
        reference = {k: v.clone() for k, v in ref_model.state_dict().items()}
        moved = distance(reference, w32)
        print(
            f"\nfinetune {args.finetune_steps} steps, lr {lr:g} (cosine), FP32 reference eval loss "
            f"{eval_loss(ref_model, eval_ds.blocks):.4f}, moved ‖W_ref − W₀‖ = {moved:.4g}"
        )
        print(f"{'strategy':15s} {'seed':>5s} {'start err':>10s} {'drift':>8s} {'eval (bf16)':>11s} {'eval (W)':>9s}")
        for name in ("collage-plus", "collage-light", "bf16-kahan", "bf16-pure"):
            for seed in (True, False) if name != "bf16-pure" else (False,):
                options = {"seed_compensation": seed} if name != "bf16-pure" else {}
                strategy, model, optimizer, start = train(name, copy.deepcopy(pretrained), finetune, lr, **options)
                full = strategy.full_precision_state_dict(model, optimizer)
                fp32_model = GPT2LMHeadModel(pretrained.config)
                fp32_model.load_state_dict(full)
                print(
                    f"{name:15s} {seed!s:>5s} {distance(start, w32) / distance(w32, {k: 0 * v for k, v in w32.items()}):10.2e} "
                    f"{distance(full, reference) / moved:8.4f} {eval_loss(model, eval_ds.blocks, strategy.forward_context):11.4f} "
                    f"{eval_loss(fp32_model, eval_ds.blocks):9.4f}"
                )


if __name__ == "__main__":
    main()
