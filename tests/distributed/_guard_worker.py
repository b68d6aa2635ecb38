"""One rank of tests/distributed/test_guard_ddp.py: the guard under DDP (2 gloo ranks).

Per strategy: a tiny GPT-2 under `DistributedDataParallel`, each rank its own samples, the guard
on with short windows, a check (`strategy.metrics()`, what the Trainer's logging step calls)
every 2 steps. After DDP's all-reduce, rank 1 alone gets an infinite gradient element at steps
INJECT: both ranks must skip those steps (the skip flag is agreed over the ranks), roll back at
the next check, and end with the same parameters. Results go to `<out>/rank<r>.json`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from hf_lowprec import get_strategy
from hf_lowprec.engines.ddp import prepare_ddp
from tests.helpers import batches, tiny_gpt2

STEPS, INJECT, MICRO = 12, (6, 7), 2
GUARD = {"warmup": 3, "window": 16, "rollback_after": 2, "snapshot_every": 2}
STRATEGIES = ("bf16-mixed", "fp8-lm-o2")


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().float().numpy().tobytes())
    return h.hexdigest()


def run(name: str) -> dict:
    rank = dist.get_rank()
    strategy = get_strategy(name, fused="reference", guard=GUARD)
    model = strategy.prepare_model(tiny_gpt2())
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    prepare_ddp(strategy, ddp)
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    data = batches(STEPS, batch=MICRO * dist.get_world_size())
    first = next(p for p in model.parameters() if p.requires_grad)
    for step, ids in enumerate(data):
        local = ids[rank * MICRO : (rank + 1) * MICRO]
        with strategy.forward_context():
            loss = ddp(input_ids=local, labels=local).loss
        strategy.scale_loss(loss).backward()
        if rank == 1 and step in INJECT:
            first.grad.view(-1)[0] = math.inf  # after the all-reduce: this rank's gradient only
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 2 == 1:
            metrics = strategy.metrics()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return {
        "skipped": metrics["precision/skipped_steps"],
        "rollbacks": metrics["precision/guard_rollbacks"],
        "faulty": metrics["precision/guard_faulty_steps"],
        "actions": [a["action"] for a in strategy.guard.actions],
        "digest": digest(model),
        "finite": finite,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results: dict = {"world_size": dist.get_world_size(), "cases": {}}
    for name in STRATEGIES:
        try:
            results["cases"][name] = run(name)
        except Exception:
            results["cases"][name] = {"error": traceback.format_exc()}
        dist.barrier()
    results["complete"] = True
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
