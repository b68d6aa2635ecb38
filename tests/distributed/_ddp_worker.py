"""One rank of the DDP tests: every registered strategy under torch DDP, in one launch.

Started by `tests/distributed/test_ddp.py` through `tests/deepspeed/_launch.py` (RANK/WORLD_SIZE
processes, gloo). The ranks take every strategy in turn:

- a strategy DDP carries trains `STEPS` steps as `DistributedDataParallel` (each rank its half of
  the global batch, `hf_lowprec.engines.ddp.prepare_ddp` registers the strategy's hook);
  meanwhile rank 0 trains the one-process reference on the whole batch ("whole") and rank 1 the
  one-process reference on the same batch as two accumulated halves, each loss halved ("halves",
  whose gradient is DDP's: fl(g₀/2 + g₁/2)). FP8-LM's hook is wrapped to record, on the first
  step, each bucket's local gradient, the reduced one and the shared scales;
- a refused strategy must be refused by `prepare_ddp` on a DDP model, before any step.

Losses are the global batch's (FP32 sum of the ranks' means, halved), kept as FP32 bit patterns
so NaN survives JSON. Results go to `<out>/rank<r>.json` with "complete": true at the end.
"""

import argparse
import hashlib
import json
import struct
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from hf_lowprec import available_strategies, get_strategy  # noqa: E402
from hf_lowprec.engines.ddp import ddp_support, prepare_ddp  # noqa: E402
from tests.helpers import accumulated_halves, batches, fp32_gradient_norms, tiny_gpt2  # noqa: E402

STEPS = 3
MICRO = 2  # samples per rank per step; the references take both ranks' samples
LR = 1e-3
WEIGHT_DECAY = 0.01


def bits(value: torch.Tensor | float) -> int:
    """The FP32 bit pattern of an FP32 scalar (NaN and ±0 kept apart, JSON-safe)."""
    return struct.unpack("<i", struct.pack("<f", float(value)))[0]


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(str(t.dtype).encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# Cases beyond the registered names: "strategy+recipe", an FP8-LM strategy with an FP8 recipe.
RECIPE_CASES = ("fp8-lm-o2+rowwise",)


def build(name: str):
    # The eager optimizer step: the same arithmetic as the compiled one on CPU (tests/optim),
    # without compiling a step per strategy and run (minutes on two cores).
    name, _, recipe = name.partition("+")
    strategy = get_strategy(name, fused="reference", **({"recipe": recipe} if recipe else {}))
    model = strategy.prepare_model(tiny_gpt2())
    return strategy, model


def optimizer_for(strategy, params):
    return strategy.create_optimizer(params, lr=LR, weight_decay=WEIGHT_DECAY)


def whole(name: str, data) -> dict:
    """One process, the whole global batch per step."""
    strategy, model = build(name)
    optimizer = optimizer_for(strategy, model.parameters())
    losses, norms = [], []
    for ids in data:
        norms.append(fp32_gradient_norms(strategy, model, optimizer, ids))
        losses.append(bits(strategy.train_step(model, ids, optimizer)))
    return {"losses": losses, "norms": norms, "digest": digest(model)}


def halves(name: str, data) -> dict:
    """One process, each global batch as the ranks' two halves, accumulated then halved: the
    gradient DDP's all-reduce forms (`tests.helpers.accumulated_halves`)."""
    strategy, model = build(name)
    optimizer = optimizer_for(strategy, model.parameters())
    losses = accumulated_halves(strategy, model, optimizer, data)
    return {"losses": [bits(v) for v in losses], "digest": digest(model)}


def recording_hook(strategy, record: list, recording: dict):
    """The strategy's FP8 hook, appending each bucket's local and reduced gradient and the shared
    scales to `record` while `recording["on"]` (the first step), in FP32 and real units: fp8-lm-o2's
    FP8 weights send their gradient times a power of two σ (`FP8CommState.prescale`; dividing by it
    is exact) and the hook stores their reduced FP8 gradient in the optimizer, zeroing the bucket."""
    state, hook = strategy.ddp_comm_hook()

    def recorded(state, bucket):
        params, numels = bucket.parameters(), [g.numel() for g in bucket.gradients()]
        one = torch.ones(())
        sigmas = torch.stack([state.prescales.get(id(p), one).float() for p in params])
        local = bucket.buffer().detach().float() / torch.repeat_interleave(sigmas, torch.tensor(numels))
        future = hook(state, bucket)
        if recording["on"]:
            reduced, scales = bucket.buffer().detach().float().clone(), []
            for p, part in zip(params, reduced.split(numels)):
                stored = strategy.backward_grads.stored([p]) if state.store is not None else []
                if stored:
                    part.copy_(stored[0][0].float().flatten() / stored[0][1])
                scales.append(stored[0][1] if stored else state.grad_scales.get(id(p)))
            record.append(
                {
                    "local": local,
                    "reduced": reduced,
                    "numels": numels,
                    "scales": None if any(s is None for s in scales) else torch.stack(scales).float(),
                }
            )
        return future

    return state, recorded


def distributed(name: str, data) -> dict:
    strategy, model = build(name)
    wrapped = DistributedDataParallel(model)
    buckets: list = []
    recording = {"on": True}
    if strategy.ddp_comm_hook() is not None:
        hooked = recording_hook(strategy, buckets, recording)
        strategy.ddp_comm_hook = lambda: hooked
    prepare_ddp(strategy, wrapped)
    optimizer = optimizer_for(strategy, wrapped.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for ids in data:
        local = ids[rank * MICRO : (rank + 1) * MICRO]
        loss = strategy.train_step(wrapped, local, optimizer).float().reshape(1)
        dist.all_reduce(loss)
        losses.append(bits(loss[0] / world))
        recording["on"] = False
    gathered = []
    for b in buckets:  # every rank's local gradient of the bucket, for the reference mean
        copies = [torch.empty_like(b["local"]) for _ in range(world)]
        dist.all_gather(copies, b["local"])
        gathered.append({**b, "local": torch.stack(copies)})
    stats = getattr(getattr(strategy, "comm_state", None), "stats", None)
    return {
        "losses": losses,
        "digest": digest(model),
        "hooked": getattr(wrapped, "_hf_lowprec_hooked", False),
        "fp8_reduced_elements": None if stats is None else stats.numel,
        "buckets": gathered,
        "numel": sum(p.numel() for p in model.parameters()),
    }


def refused(name: str) -> dict:
    strategy, model = build(name)
    try:
        prepare_ddp(strategy, DistributedDataParallel(model))
    except ValueError as err:
        return {"refused": True, "message": str(err)}
    return {"refused": False, "error": "prepare_ddp accepted a refused strategy"}


def loss_scale_agreement() -> dict:
    """fp16-als's loss scaler when only rank 0's activation gradients reach the upper bin: with
    the data-parallel group (what `prepare_ddp` sets) both ranks halve the scale; alone, each
    rank decides from its own half (rank 0 halves, rank 1 doubles)."""
    out = {}
    for label, group in (("group", dist.group.WORLD), ("alone", None)):
        strategy = get_strategy("fp16-als", init_scale=2.0**4)
        layer = strategy.prepare_model(torch.nn.Linear(4, 4))
        if group is not None:
            strategy.set_data_parallel_group(group)
        big = strategy.options.bin_edge * (4.0 if dist.get_rank() == 0 else 2.0**-20)
        strategy.scale_loss(layer(torch.ones(1, 4, dtype=torch.float16)).float().sum() * big).backward()
        strategy.scaler.update()
        out[label] = strategy.scaler.get_scale()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = batches(STEPS, batch=MICRO * world)
    results: dict = {"world_size": world, "cases": {}}
    tensors: dict = {}
    path = out / f"rank{rank}.json"
    for name in [*available_strategies(), *RECIPE_CASES]:
        start = time.time()
        try:
            if ddp_support(get_strategy(name.partition("+")[0])) is not None:
                case = refused(name)
            else:
                case = distributed(name, data)
                tensors[name] = case.pop("buckets")
                case["reference"] = whole(name, data) if rank == 0 else halves(name, data)
        except Exception:  # recorded, so the test shows which strategy failed and why
            case = {"error": traceback.format_exc()}
        case["seconds"] = round(time.time() - start, 2)
        results["cases"][name] = case
        path.write_text(json.dumps(results, indent=1))
        dist.barrier()
    results["loss_scale_agreement"] = loss_scale_agreement()
    torch.save(tensors, out / f"rank{rank}.pt")
    results["complete"] = True
    path.write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
