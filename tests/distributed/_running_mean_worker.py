"""One rank of fp16-als's running mean under DDP: 2 micro-batches per rank (`no_sync` for the first), a head
that some of them reach (`--use-b`); each rank writes its gradients.

Also the model, samples and FP64 reference that `tests/strategies/test_fp16_accumulation.py` shares.
Started by `tests/distributed/test_ddp_running_mean.py` through `tests/deepspeed/_launch.py`.
"""

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from hf_lowprec import get_strategy  # noqa: E402
from hf_lowprec.engines.ddp import prepare_ddp  # noqa: E402

NAMES = ("a.weight", "a.bias", "b.weight", "b.bias")


class TwoHeads(torch.nn.Module):
    """Linear losses: dL/dW = t xᵀ, one product per element; head `b` only where `use_b` is set."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 4)
        self.b = torch.nn.Linear(8, 4)

    def forward(self, x, t, use_b, labels=None):
        h = x.to(self.a.weight.dtype)
        loss = (self.a(h).float() * t).sum()
        if bool(use_b.reshape(-1)[0]):
            loss = loss + (self.b(h).float() * t).sum()
        return {"loss": loss}


def samples(use_b=(1, 0)) -> list[dict]:
    """One-sample micro-batches of FP16-exact values (the gradients' only roundings are FP16's)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for flag in use_b:
        x, t = torch.randn(8, generator=g).half().float(), torch.randn(4, generator=g).half().float()
        out.append({"x": x, "t": t, "use_b": flag})
    return out


def fp64_mean(data: list[dict]) -> tuple[dict, dict]:
    """Stock accumulation in FP64: the mean over `data`'s micro-batches (0 where `b` is unused), and each
    element's largest micro-batch gradient."""
    mean = {n: torch.zeros((4, 8) if n.endswith("weight") else (4,), dtype=torch.float64) for n in NAMES}
    largest = {n: torch.zeros_like(v) for n, v in mean.items()}
    for sample in data:
        x, t = sample["x"].double(), sample["t"].double()
        for head in ("a", "b") if sample["use_b"] else ("a",):
            for name, g in ((f"{head}.weight", torch.outer(t, x)), (f"{head}.bias", t)):
                mean[name] += g / len(data)
                largest[name] = torch.maximum(largest[name], g.abs())
    return mean, largest


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sums", action="store_true", help="as the Accelerate plugin: the loop takes the sum")
    parser.add_argument("--use-b", default="10,01", help="per rank, whether each micro-batch reaches `b`")
    options = parser.parse_args()
    out = Path(options.out)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = samples([int(flag) for flags in options.use_b.split(",") for flag in flags])[2 * rank : 2 * rank + 2]
    strategy = get_strategy("fp16-als")
    model = strategy.prepare_model(TwoHeads())
    wrapped = DistributedDataParallel(model, find_unused_parameters=True)
    prepare_ddp(strategy, wrapped)
    optimizer = strategy.create_optimizer(wrapped.parameters(), lr=0.0)
    strategy.set_gradient_accumulation(2, sums=options.sums)
    for index, sample in enumerate(data):
        with wrapped.no_sync() if index == 0 else contextlib.nullcontext():
            with strategy.forward_context():
                loss = wrapped(sample["x"], sample["t"], torch.tensor(sample["use_b"]))["loss"]
            strategy.scale_loss(loss / 2).backward()
    strategy.unscale_gradients(optimizer.optimizer)
    grads = {n: p.grad.double().flatten().tolist() for n, p in model.named_parameters()}
    result = {"world_size": dist.get_world_size(), "grads": grads, "complete": True}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
