"""One rank of tests/distributed/test_ddp_hook_launches.py (2 gloo ranks), on tiny Llamas of 2 and 4
layers, counted on the paths a GPU takes (`compiling.gpu_paths`, `testing.launches.Launches`):

- fp8-lm-o2 under DDP: each bucket of the FP8 all-reduce hook at the third, steady step (the
  optimizer's FP8 gradient buffers exist): its dtype, the gradients it holds, its launches and the
  most frequent eager operations;
- fp8-lm-o3: `FP8ZeroAdamW.reduce_fp8_gradients` (the FP8 all-reduce of the FP8 weights' gradients
  a DeepSpeed step starts with), its second call.

The result goes to `<out>/rank<r>.json`."""

from __future__ import annotations

import argparse
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaForCausalLM

from hf_lowprec import get_strategy
from hf_lowprec.compiling import gpu_paths
from hf_lowprec.engines.ddp import prepare_ddp
from hf_lowprec.testing.launches import Launches
from tests.deepspeed._launch import finish_rank
from tests.helpers import batches, tiny_llama_config

STEPS = 3
LAYERS = (2, 4)


def counted_buckets(layers: int) -> list[dict]:
    rank = dist.get_rank()
    strategy = get_strategy("fp8-lm-o2", fused="reference")
    model = strategy.prepare_model(LlamaForCausalLM(_config(layers)))
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    # One bucket per dtype whatever the depth (DDP's first bucket is 1 MiB otherwise).
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=64)
    state, hook = strategy.ddp_comm_hook()
    counts: list[dict] = []
    on = [False]  # counting: the last step only

    def counting(state, bucket):
        if not on[0]:
            return hook(state, bucket)
        with gpu_paths(), Launches() as counted:
            future = hook(state, bucket)
        counts.append(
            {
                "dtype": str(bucket.buffer().dtype),
                "gradients": len(bucket.gradients()),
                "launches": counted.total(),
                "graphs": sum(counted.graphs.values()),
                "top": counted.summary(top=8),
            }
        )
        return future

    strategy.ddp_comm_hook = lambda: (state, counting)
    prepare_ddp(strategy, ddp)
    for step, ids in enumerate(batches(STEPS, batch=4)):
        on[0] = step == STEPS - 1
        strategy.train_step(ddp, ids[rank * 2 : rank * 2 + 2], optimizer)
    return counts


def counted_o3_reduction(layers: int) -> dict:
    """fp8-lm-o3's FP8 all-reduce of its FP8 weights' gradients (`FP8ZeroAdamW.reduce_fp8_gradients`,
    what a DeepSpeed step runs first) on the GPU's paths, the second call counted (buffers made)."""
    strategy = get_strategy("fp8-lm-o3", fused="reference")
    model = strategy.prepare_model(LlamaForCausalLM(_config(layers)))
    optimizer = strategy.build_optimizer([{"params": list(model.parameters())}], lr=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):  # the first call makes the optimizer's FP8 gradient buffers
        for p in optimizer.fp8_params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        with gpu_paths(), Launches() as counted:
            optimizer.reduce_fp8_gradients(strategy.scaler, torch.float8_e4m3fn)
        strategy.scaler.update()
    return {"gradients": len(optimizer.fp8_params), "launches": counted.total(), "top": counted.summary(top=8)}


def _config(layers: int):
    config = tiny_llama_config(32)
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    return config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    dist.init_process_group("gloo")
    try:
        with torch.compiler.set_stance("force_eager"):  # the compiled casts' eager source: same bits
            result = {str(n): counted_buckets(n) for n in LAYERS}
            result.update({f"o3 {n}": counted_o3_reduction(n) for n in LAYERS})
    except Exception:
        result = {"error": traceback.format_exc()[-3000:]}
    finish_rank(out, {"world_size": dist.get_world_size(), "buckets": result})


if __name__ == "__main__":
    main()
