"""One rank of the sharded-checkpoint fault test (FSDP2, coat: state laid out per shard).

Started by `tests/distributed/test_kill_a_rank.py`. Phases:

- `torn` (2 ranks): train 2 steps, `save_sharded` into `<out>/ckpt`, train 1 more step and save
  again into the same directory with $HF_LOWPREC_TEST_CRASH_AT=`sharded-after-shards@1`: rank 1
  ends after its new shards are written, before the save is complete.
- `check` (2 ranks): fresh models load `<out>/ckpt` (must be the step-2 save: digest compared),
  then rank 0 overwrites 64 bytes in the middle of one `.distcp` shard and every rank must refuse
  the load naming that file, with the model unchanged.
- `one` (1 rank): the same checkpoint loaded by one rank: refused naming the 2 ranks it needs.

Each rank writes `<out>/<phase>-rank<r>.json`.
"""

import argparse
import hashlib
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402

from hf_lowprec import get_strategy  # noqa: E402
from hf_lowprec.checkpoints.manifest import ENV_CRASH_AT  # noqa: E402
from hf_lowprec.engines.fsdp2 import load_sharded, save_sharded, shard_model  # noqa: E402
from tests.helpers import batches, tiny_gpt2  # noqa: E402

STRATEGY = "coat"


def build(seed: int):
    strategy = get_strategy(STRATEGY, fused="reference")
    model = shard_model(strategy, tiny_gpt2(seed))
    return strategy, model, strategy.create_optimizer(model.parameters(), lr=1e-3)


def step(strategy, model, optimizer, ids) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = ids.chunk(world)[rank]
    with strategy.forward_context():
        loss = model(input_ids=ids, labels=ids).loss
    strategy.scale_loss(loss).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def digest(model) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        local = t.to_local() if hasattr(t, "to_local") else t
        h.update(local.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--phase", choices=["torn", "check", "one"], required=True)
    args = parser.parse_args()
    out, ckpt = Path(args.out), Path(args.out) / "ckpt"
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # a rank waiting for a dead one gives up
    rank = dist.get_rank()
    data = batches(3, batch=4)
    result: dict = {}
    if args.phase == "torn":
        strategy, model, optimizer = build(0)
        for ids in data[:2]:
            step(strategy, model, optimizer, ids)
        save_sharded(ckpt, model, optimizer)
        result["digest_step2"] = digest(model)
        (out / f"torn-rank{rank}.json").write_text(json.dumps(result))
        step(strategy, model, optimizer, data[2])
        os.environ[ENV_CRASH_AT] = "sharded-after-shards@1"
        save_sharded(ckpt, model, optimizer)
        result["second_save_returned"] = True
    elif args.phase == "check":
        strategy, model, optimizer = build(5)
        load_sharded(ckpt, model, optimizer)
        result["digest_loaded"] = digest(model)
        if rank == 0:
            shard = sorted(ckpt.glob("*.distcp"))[0]
            data_bytes = bytearray(shard.read_bytes())
            middle = len(data_bytes) // 2
            data_bytes[middle : middle + 64] = bytes(64)
            shard.write_bytes(bytes(data_bytes))
            result["overwritten"] = str(shard)
        dist.barrier()
        fresh = build(7)
        before = digest(fresh[1])
        try:
            load_sharded(ckpt, fresh[1], fresh[2])
            result["refused"] = None
        except ValueError as err:
            result["refused"] = str(err)
        result["unchanged"] = digest(fresh[1]) == before
    else:
        strategy, model, optimizer = build(5)
        try:
            load_sharded(ckpt, model, optimizer)
            result["refused"] = None
        except ValueError as err:
            result["refused"] = str(err)
    (out / f"{args.phase}-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
