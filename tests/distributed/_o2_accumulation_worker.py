"""One rank of tests/distributed/test_o2_accumulation.py: fp8-lm-o2 under DDP (2 gloo ranks), one
optimizer step of two accumulated micro-batches (the first under `no_sync`), each loss multiplied
by its case's factor. Each rank records its FP8 layers' weight gradients of both micro-batches as
their GEMMs hand them on (gradient sinks on the unwrapped model, in FP64), then runs the DDP
micro-batches and keeps the FP8 gradients the optimizer holds and the step's skip flag. Tensors
go to `<out>/rank<r>.pt`, the result to `<out>/rank<r>.json`."""

from __future__ import annotations

import argparse
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from hf_lowprec import get_strategy
from hf_lowprec.engines.ddp import prepare_ddp
from hf_lowprec.fp8 import FP8Linear
from hf_lowprec.fp8.linear import get_grad_sink, set_grad_sink
from tests.deepspeed._launch import finish_rank
from tests.helpers import batches, tiny_gpt2

# The loss factors of the two micro-batches: the second's gradients 2^16 times the first's
# (FP16 held 2^12), and a first micro-batch whose gradients are all zero before small ones.
CASES = {"larger_later": (1.0, 2.0**16), "zero_first": (0.0, 1e-5)}


def micro_batches(rank: int) -> list[torch.Tensor]:
    """This rank's two micro-batches of 2 samples (micro-batch k of rank r: rows 2r, 2r + 1 of batch k)."""
    return [ids[rank * 2 : rank * 2 + 2] for ids in batches(2, batch=4)]


def run_case(factors: tuple[float, float], rank: int) -> tuple[dict, dict]:
    strategy = get_strategy("fp8-lm-o2")
    model = strategy.prepare_model(tiny_gpt2())
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    prepare_ddp(strategy, ddp)
    data = micro_batches(rank)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, FP8Linear)}
    kept = {name: get_grad_sink(m.weight) for name, m in layers.items()}
    reference: dict[str, list[torch.Tensor]] = {name: [] for name in layers}
    for name, layer in layers.items():
        set_grad_sink(layer.weight, lambda g, name=name: reference[name].append(g.double()))
    for ids, factor in zip(data, factors):
        with strategy.forward_context():
            (model(input_ids=ids, labels=ids).loss * factor).backward()
    for name, layer in layers.items():
        set_grad_sink(layer.weight, kept[name])
    for k, (ids, factor) in enumerate(zip(data, factors)):
        with ddp.no_sync() if k == 0 else torch.enable_grad(), strategy.forward_context():
            (ddp(input_ids=ids, labels=ids).loss * factor).backward()
    got = {}
    for name, layer in layers.items():
        stored = strategy.backward_grads.stored([layer.weight])
        payload, scale = stored[0] if stored else (None, None)
        got[name] = (payload.double() / scale.double(), scale.double())
    skipped = strategy.process_gradients(optimizer.optimizer)
    tensors = {"reference": {n: torch.stack(r) for n, r in reference.items()}, "got": got}
    return tensors, {"skipped": bool(skipped), "mu": strategy.scaler.mu}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result: dict = {"world_size": dist.get_world_size(), "cases": {}}
    tensors = {}
    for case, factors in CASES.items():
        try:
            tensors[case], result["cases"][case] = run_case(factors, rank)
        except Exception:
            result["cases"][case] = {"error": traceback.format_exc()[-3000:]}
        dist.barrier()
    torch.save(tensors, out / f"rank{rank}.pt")
    finish_rank(out, result)


if __name__ == "__main__":
    main()
