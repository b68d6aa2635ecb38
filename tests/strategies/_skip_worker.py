"""One rank of `test_no_sync.py`'s agreement test: a non-finite gradient on rank 1 only.

Each strategy checks its own rank's gradients (as under ZeRO, where each rank holds a
partition); with the data-parallel group set, `process_gradients` MAX-es the flag over the
ranks, so both ranks skip, and neither moves its weights. Results go to `<out>/rank<r>.json`.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402

from hf_lowprec import get_strategy  # noqa: E402

NAMES = ("fp32", "bf16-mixed", "collage-plus", "fp16-mixed", "fp16-als")


def case(name: str, poisoned: bool) -> dict:
    strategy = get_strategy(name)
    torch.manual_seed(0)
    model = strategy.prepare_model(torch.nn.Linear(4, 4))
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-2)
    strategy.set_data_parallel_group(dist.group.WORLD)
    before = [p.detach().clone() for p in model.parameters()]
    with strategy.forward_context():
        # Small enough that fp16-mixed's 2^16 loss scale keeps every FP16 gradient finite.
        loss = model(torch.ones(2, 4, dtype=next(model.parameters()).dtype)).float().sum() * 2.0**-10
    strategy.scale_loss(loss).backward()
    if poisoned and dist.get_rank() == 1:
        model.weight.grad.view(-1)[0] = float("nan")
    strategy.unscale_gradients(optimizer)
    found_inf = strategy.process_gradients(optimizer.optimizer)
    flag = {"dtype": str(found_inf.dtype), "dim": found_inf.dim(), "value": float(found_inf)}
    strategy.optimizer_step(optimizer.optimizer, found_inf)
    moved = any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    scale = strategy.scaler.get_scale() if hasattr(strategy, "scaler") else None
    return {"found_inf": flag, "moved": moved, "scale": scale}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    dist.init_process_group("gloo")
    results = {name: {"clean": case(name, False), "poisoned": case(name, True)} for name in NAMES}
    results["complete"] = True
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
