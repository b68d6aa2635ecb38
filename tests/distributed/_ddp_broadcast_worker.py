"""One rank of tests/distributed/test_ddp_broadcast.py: a custom DDP loop (2 gloo ranks) wraps the
model in `DistributedDataParallel`, whose construction broadcasts every parameter in place with the
values it holds, before or after `create_optimizer`. That is no weight written outside the optimizer:
fp16-als keeps its FP32 masters and Collage its seeded residuals (no `restart_`), and both orders
hold the same values after 3 steps. Results go to `<out>/rank<r>.json`."""

from __future__ import annotations

import argparse
import collections
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from hf_lowprec import get_strategy
from hf_lowprec.engines.ddp import prepare_ddp
from hf_lowprec.optim import rules
from tests.deepspeed._launch import finish_rank
from tests.helpers import batches, tiny_gpt2

restarts: collections.Counter = collections.Counter()


def _counting(restart):
    def counted(self, param, state):
        restarts[type(self).__name__] += 1
        return restart(self, param, state)

    return counted


for rule in [c for c in vars(rules).values() if isinstance(c, type) and issubclass(c, rules.Rule)]:
    if "restart_" in vars(rule):
        rule.restart_ = _counting(vars(rule)["restart_"])


def run(name: str, optimizer_first: bool) -> dict:
    rank = dist.get_rank()
    restarts.clear()
    strategy = get_strategy(name, fused="reference")
    model = strategy.prepare_model(tiny_gpt2())
    if optimizer_first:
        optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    prepare_ddp(strategy, ddp)
    if not optimizer_first:
        optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    for ids in batches(3, batch=4):
        local = ids[rank * 2 : rank * 2 + 2]
        with strategy.forward_context():
            loss = ddp(input_ids=local, labels=local).loss
        strategy.scale_loss(loss).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    held = strategy.full_precision_state_dict(model, optimizer)
    return {"restarts": dict(restarts), "held": {k: v.double().sum().item() for k, v in held.items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    dist.init_process_group("gloo")
    result: dict = {"world_size": dist.get_world_size(), "cases": {}}
    for name in ("fp16-als", "collage-plus"):
        for optimizer_first in (False, True):
            key = f"{name} optimizer_first={optimizer_first}"
            try:
                result["cases"][key] = run(name, optimizer_first)
            except Exception:
                result["cases"][key] = {"error": traceback.format_exc()[-2000:]}
            dist.barrier()
    finish_rank(out, result)


if __name__ == "__main__":
    main()
