"""Section `rl` of the device check (bench/device_check.py): an RL step's three models on the device.

A GRPO step with a KL term holds the policy, a frozen reference and a frozen reward model. The
three are Llama-shaped, from config: hidden 1024, intermediate 2816, 8 layers, 16 heads (8
key/value heads), vocabulary 32000: 0.20 B parameters each, the reward model with a one-output
score head. Per row: the models built on the device from seed 0, the policy prepared by the
strategy, the reference and the reward model frozen as `hf_lowprec.trl` freezes them
(`integrations.frozen`), then per step the reference's and the reward model's forward (no grad)
and the policy's forward, backward and optimizer step on batch 4 × 512. Two warm-up steps, three
timed ones. Columns: the frozen models' bytes per parameter in their decoder blocks,
`torch.cuda.max_memory_allocated` since the models were built, step time; ratios to the first
row, bf16-mixed. The row "fp8-lm-o2, frozen as policy" is the behaviour before the frozen models
kept their forward's precision.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

from device_check_e2e import timed_steps
from device_common import Report, cuda_or_say, measured_rows

ROWS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("bf16-mixed", "bf16-mixed", {}),
    ("fp16-als", "fp16-als", {}),
    ("collage-plus", "collage-plus", {}),
    ("fp8-lm-o2", "fp8-lm-o2", {}),
    ("fp8-lm-o2, frozen as policy", "fp8-lm-o2", {"frozen_models": "policy"}),
)
BATCH, SEQ, WARMUP, TIMED = 4, 512, 2, 3


def rl_config(smoke: bool) -> Any:
    from hf_lowprec.testing.llama import llama_config

    if smoke:
        config = llama_config(vocab=512, hidden=128, layers=2, pad_token_id=0)
    else:
        config = llama_config(
            vocab=32000, hidden=1024, intermediate=2816, layers=8, heads=16, positions=SEQ, pad_token_id=0
        )
    config.use_cache = False  # a training step's forwards build no KV cache
    return config


def measure(label: str, name: str, options: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    import hf_lowprec
    from hf_lowprec.integrations.frozen import FROZEN_ATTR, freeze_model

    cuda = args.device == "cuda"
    batch, seq = (2, 32) if args.smoke else (BATCH, SEQ)
    warmup, timed = (1, 2) if args.smoke else (WARMUP, TIMED)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    config = rl_config(args.smoke)
    torch.manual_seed(0)
    with torch.device(args.device):
        policy = LlamaForCausalLM(config)
        reference = copy.deepcopy(policy)
        scorer = copy.deepcopy(config)
        scorer.num_labels = 1
        reward = LlamaForSequenceClassification(scorer)
    strategy = hf_lowprec.get_strategy(name, **options)
    # Each frozen model gets its own strategy object, as hf_lowprec.trl does.
    reference = freeze_model(hf_lowprec.get_strategy(name, **options), reference.eval(), "reference")
    reward = freeze_model(hf_lowprec.get_strategy(name, **options), reward.eval(), "reward")
    policy = strategy.prepare_model(policy)
    optimizer = strategy.create_optimizer(policy.parameters(), lr=1e-5, weight_decay=0.0)
    ids = torch.randint(1, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)

    def step() -> Any:
        with torch.no_grad(), strategy.forward_context():
            ref_logits = reference(input_ids=ids).logits
            score = reward(input_ids=ids).logits
        with strategy.forward_context():
            logits = policy(input_ids=ids).logits
        logps = torch.log_softmax(logits.float(), -1)
        kl = (logps - torch.log_softmax(ref_logits.float(), -1)).exp().mean()
        loss = -(score.float().mean() * logps.mean()) + 0.04 * kl
        strategy.scale_loss(loss).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    warm, seconds, loss = timed_steps(step, warmup, timed, cuda)
    facts = {role: m.__dict__[FROZEN_ATTR] for role, m in (("reference", reference), ("reward", reward))}
    return {
        "row": label,
        "parameters": sum(p.numel() for p in policy.parameters()),
        "reference B/param": facts["reference"]["blocks_bytes_per_param"],
        "reward B/param": facts["reward"]["blocks_bytes_per_param"],
        "frozen GiB": sum(f["bytes"] for f in facts.values()) / 2**30,
        "peak GiB": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
        "step ms": 1e3 * seconds / timed,
        "warm-up s": warm,
        "loss": loss.float().item(),
    }


def run_rl(args: argparse.Namespace, context: dict[str, Any]) -> None:

    columns = ["row", "reference B/param", "reward B/param", "frozen GiB", "peak GiB", "memory × bf16-mixed"]
    columns += ["step ms", "× bf16-mixed", "warm-up s", "loss", "note"]
    title = "RL step: policy + frozen reference + frozen reward, Llama-shaped 0.20 B each, batch 4×512, eager"
    report = Report(args.out, "rl", title + (" (smoke: toy sizes)" if args.smoke else ""), columns, context)
    if not cuda_or_say(args, report):
        return
    base: dict[str, Any] | None = None
    for _, result in measured_rows(report, ROWS, measure, args, reserve=5):
        if base is None:
            base = result
            report.note(f"{result['parameters'] / 1e9:.2f} B parameters per model")
        row = {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items() if k != "parameters"}
        row["memory × bf16-mixed"] = round(result["peak GiB"] / base["peak GiB"], 3)
        row["× bf16-mixed"] = round(base["step ms"] / result["step ms"], 3)
        report.add(row)
    report.finish()
