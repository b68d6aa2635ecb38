"""One rank of the FP8 all-reduce tests (run by tests/fp8/test_comm.py, one process per rank).

Usage: RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... python _comm_worker.py OUT_DIR

Runs every scenario in one process group (starting processes dominates the cost) and saves
this rank's results to OUT_DIR/rank{r}.pt.
"""

import math
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import hf_lowprec
from hf_lowprec.fp8 import (
    FP8CommState,
    GradientAutoScaler,
    fp8_allreduce,
    fp8_allreduce_hook,
    postscale_allreduce,
    prescale_allreduce,
)

# Segments with very different magnitudes, each getting its own shared scale.
SEGMENTS = ((4096, 1e-2), (1000, 1e-5), (77, 1.0))


def accuracy_gradient(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.cat([torch.randn(n, generator=g) * scale for n, scale in SEGMENTS])


def skewed_gradient(rank: int, step: int, numel: int = 1 << 16) -> torch.Tensor:
    """The same gradient on every rank up to a skew of 2^-r, spanning 20 binades.

    Perfect correlation makes the sum of the largest payloads Σ 2^-r = 2 − 2^(1−N) times the
    largest one: post-scaling (μ = 1) overflows, while μ = 1/2 provably cannot, and every
    halving of μ below that moves one more binade of small values under the FP8 minimum.
    """
    g = torch.Generator().manual_seed(1000 * step)
    magnitudes = torch.exp2(-20.0 * torch.rand(numel, generator=g))
    return torch.randn(numel, generator=g) * magnitudes * 1e-3 * 2.0**-rank


def accuracy(rank: int, world: int) -> dict:
    # μ = 2^-ceil(log2 N) keeps the sum of N payloads within the FP8 range, so the error is
    # rounding only and can be bounded element by element.
    mu = 2.0 ** -math.ceil(math.log2(world))
    result = fp8_allreduce(accuracy_gradient(rank), numels=[n for n, _ in SEGMENTS], mu=mu)
    return {
        "mu": mu,
        "mean": result.dequantize(),
        "scales": result.scales,
        "payload": result.payload.view(torch.uint8),
        "overflow": result.stats.overflow,
    }


def skew(rank: int, world: int, steps: int = 3) -> dict:
    scaler = GradientAutoScaler()
    mus, stats = [], {}
    for step in range(steps):
        grad = skewed_gradient(rank, step)
        mus.append(scaler.mu)
        ours = fp8_allreduce(grad, mu=scaler.mu)
        scaler.record(ours.stats.overflow, ours.stats.numel)
        scaler.update()
        pre = prescale_allreduce(grad)
        post = postscale_allreduce(grad)
        stats = {
            name: (r.stats.underflow, r.stats.overflow) for name, r in (("ours", ours), ("pre", pre), ("post", post))
        }
    return {"mus": mus, "stats": stats}


def ddp(rank: int, world: int, name: str, steps: int = 4) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))
    strategy = hf_lowprec.get_strategy(name)
    model = strategy.prepare_model(model)
    # A tiny bucket cap splits the model over several buckets, i.e. several hook calls per step.
    wrapped = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    wrapped.register_comm_hook(*strategy.ddp_comm_hook())
    optimizer = strategy.create_optimizer(wrapped.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(7 + rank)  # different data on every rank
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 32, generator=g).to(strategy.param_dtype)
        loss = wrapped(x).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    flat = torch.cat([v.float().flatten() for v in model.state_dict().values()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    return {
        "identical": all(torch.equal(gathered[0], other) for other in gathered),
        "mu": strategy.scaler.mu,
        "losses": losses,
        "hook_calls": strategy.comm_state.stats.numel,
        "skipped": optimizer.step_was_skipped,
    }


def zero_on_rank0_gradient(rank: int, numel: int = 1000) -> torch.Tensor:
    """All zero on rank 0 (an unused parameter there), values ~1e-4 on the others."""
    if rank == 0:
        return torch.zeros(numel)
    return torch.randn(numel, generator=torch.Generator().manual_seed(300 + rank)) * 1e-4


def zero_segments(rank: int, world: int) -> dict:
    # Segments: zero on rank 0 only, then zero on every rank.
    flat = torch.cat([zero_on_rank0_gradient(rank), torch.zeros(16)])
    result = fp8_allreduce(flat, numels=[1000, 16], mu=2.0 ** -math.ceil(math.log2(world)))
    return {"mean": result.dequantize(), "scales": result.scales}


class OneRankBranch(nn.Module):
    """`b` runs on rank 0 only: under DDP its gradient is all zero on every other rank."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h) if use_b else h


def ddp_unused(rank: int, world: int) -> dict:
    """DDP with find_unused_parameters=True and the FP8 hook; local gradients for the reference."""
    torch.manual_seed(0)
    model = OneRankBranch()
    local = OneRankBranch()
    local.load_state_dict(model.state_dict())
    wrapped = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    wrapped.register_comm_hook(FP8CommState(GradientAutoScaler(init_mu=0.5)), fp8_allreduce_hook)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(40 + rank))
    wrapped(x, rank == 0).pow(2).mean().backward()
    local(x, rank == 0).pow(2).mean().backward()
    return {
        "reduced": {n: p.grad.clone() for n, p in model.named_parameters()},
        "local": {n: (torch.zeros_like(p) if p.grad is None else p.grad.clone()) for n, p in local.named_parameters()},
    }


CLIP_FACTORS = (0.0135, 3e-4, 1.4e-6)


def clipped(rank: int, world: int) -> dict:
    """fp8-lm-o1 under DDP: the all-reduced gradient, then clipped by c, then stored as FP8."""
    torch.manual_seed(0)
    strategy = hf_lowprec.get_strategy("fp8-lm-o1")
    model = strategy.prepare_model(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64)))
    wrapped = nn.parallel.DistributedDataParallel(model)
    wrapped.register_comm_hook(*strategy.ddp_comm_hook())
    optimizer = strategy.create_optimizer(wrapped.parameters(), lr=1e-3)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(60 + rank))
    out = {}
    for c in CLIP_FACTORS:
        optimizer.zero_grad()
        wrapped(x).pow(2).mean().backward()
        reduced = {n: p.grad.double().clone() for n, p in model.named_parameters()}
        for p in model.parameters():
            p.grad.mul_(c)  # what clip_grad_norm_ does with coefficient c
        assert float(strategy.process_gradients(optimizer.optimizer)) == 0.0  # 1.0 would skip the step
        out[c] = {n: (reduced[n], p.grad.double().clone()) for n, p in model.named_parameters()}
    return out


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {
        "accuracy": accuracy(rank, world),
        "skew": skew(rank, world),
        "ddp_o1": ddp(rank, world, "fp8-lm-o1"),
        "ddp_o2": ddp(rank, world, "fp8-lm-o2"),
        "zero_segments": zero_segments(rank, world),
        "ddp_unused": ddp_unused(rank, world),
        "clipped": clipped(rank, world),
    }
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
