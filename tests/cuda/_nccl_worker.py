"""One rank of the NCCL FP8 all-reduce check (run by tests/cuda/test_nccl_allreduce.py).

Usage: RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... python _nccl_worker.py OUT_DIR

fp8-lm-o1 under DDP on cuda:r with the strategy's FP8 communication hook, plus the local
(un-reduced) gradients of the same step for the FP64 reference; saves OUT_DIR/rank{r}.pt.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from hf_lowprec.fp8 import FP8CommState, GradientAutoScaler, fp8_allreduce_hook
from hf_lowprec.testing import checked_strategy


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    strategy = checked_strategy("fp8-lm-o1")  # every layer FP8, however small
    model = strategy.prepare_model(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).to(device))
    local = strategy.prepare_model(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).to(device))
    local.load_state_dict(model.state_dict())
    wrapped = nn.parallel.DistributedDataParallel(model, device_ids=[rank], bucket_cap_mb=0.01)
    # μ = 1/2 keeps the sum of two ranks' payloads inside E4M3's range (as in tests/fp8/test_comm.py).
    state = FP8CommState(GradientAutoScaler(init_mu=0.5))
    wrapped.register_comm_hook(state, fp8_allreduce_hook)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(10 + rank)).to(device)
    wrapped(x).pow(2).mean().backward()
    local(x).pow(2).mean().backward()
    torch.save(
        {
            "reduced": {n: p.grad.double().cpu() for n, p in model.named_parameters()},
            "local": {n: p.grad.double().cpu() for n, p in local.named_parameters()},
            "hook_calls": state.stats.numel,
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
