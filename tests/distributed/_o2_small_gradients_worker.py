"""One rank of tests/distributed/test_o2_small_gradients.py: fp8-lm-o2 under DDP (2 gloo ranks) with
the loss multiplied by 1e-5, so that the FP8 layers' weight gradients lie under FP16's normal range.
Each rank records its FP8 layers' weight gradients as their GEMMs hand them on (gradient sinks on the
unwrapped model, one backward, in FP64), then one DDP backward, and the FP8 gradients the optimizer
holds after it. Tensors go to `<out>/rank<r>.pt`, the result to `<out>/rank<r>.json`."""

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

LOSS_FACTOR = 1e-5


def run(out: Path) -> dict:
    rank = dist.get_rank()
    strategy = get_strategy("fp8-lm-o2")
    model = strategy.prepare_model(tiny_gpt2())
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    prepare_ddp(strategy, ddp)
    local = batches(1, batch=4)[0][rank * 2 : rank * 2 + 2]
    layers = {name: m for name, m in model.named_modules() if isinstance(m, FP8Linear)}
    kept = {name: get_grad_sink(m.weight) for name, m in layers.items()}
    reference: dict[str, torch.Tensor] = {}
    for name, layer in layers.items():
        set_grad_sink(layer.weight, lambda g, name=name: reference.__setitem__(name, g.double()))
    with strategy.forward_context():
        (model(input_ids=local, labels=local).loss * LOSS_FACTOR).backward()
    for name, layer in layers.items():
        set_grad_sink(layer.weight, kept[name])
    with strategy.forward_context():
        (ddp(input_ids=local, labels=local).loss * LOSS_FACTOR).backward()
    got = {}
    for name, layer in layers.items():
        stored = strategy.backward_grads.stored([layer.weight])
        if stored:  # the reduced FP8 gradient, stored by the hook
            got[name] = (stored[0][0].double() / stored[0][1].double(), stored[0][1].double())
        else:  # what the hook wrote into the bucket, and its scale
            got[name] = (layer.weight.grad.double(), strategy.comm_state.grad_scales[id(layer.weight)].double())
    strategy.process_gradients(optimizer.optimizer)
    freed = all(layer.weight.grad is None for layer in layers.values())
    torch.save({"reference": reference, "got": got}, out / f"rank{rank}.pt")
    return {"freed": freed}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    dist.init_process_group("gloo")
    try:
        result = run(out)
    except Exception:
        result = {"error": traceback.format_exc()[-3000:]}
    finish_rank(out, {"world_size": dist.get_world_size(), **result})


if __name__ == "__main__":
    main()
