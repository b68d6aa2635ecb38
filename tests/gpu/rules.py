"""Counters for what makes a training step wait on the host, shared by tests/gpu and bench/bench_gpu_ready.py.

A GPU runs a step well when the host only queues kernels: no value read back (a host sync),
no tensor sent from host memory each step (a host→device copy), one compiled graph (no graph
breaks). Each is counted here at the level where it happens, the ATen dispatcher, so CPU runs
show the syncs a GPU run would make:

- host syncs (`DeviceTraffic.syncs`): `aten._local_scalar_dense` (`.item()`, `float(t)`,
  `bool(t)`, a tensor in an `if`), `aten.is_nonzero`, `aten.equal`, `aten.nonzero`,
  `aten.masked_select`, boolean-mask indexing (`t[mask]`: its output size is data-dependent),
  copies from a CUDA tensor to the CPU, and `Tensor.tolist()` / `Tensor.numpy()` (invisible
  to the dispatcher on CPU, where they read memory directly: counted by wrapping them).
- host→device copies (`DeviceTraffic.copies`, meaningful on fake CUDA tensors): `aten._to_copy`
  and `aten.copy_` from a CPU tensor of one or more elements to a CUDA one. Under
  `FakeTensorMode`, `torch.tensor(values, device="cuda")` reaches the dispatcher as
  `aten.lift_fresh` of a CPU tensor followed by `aten._to_copy` to CUDA, so it is counted here.
  A 0-dim CPU tensor handed straight to a CUDA operation is a kernel argument, not a copy.
- graph breaks (`graph_breaks`): dynamo's own counter, after `torch._dynamo.reset()`.
- recompilations (`compiled_run`): graphs dynamo builds after the warm-up steps, with the
  guards that failed (a Python value read while tracing that changed between steps).

Each recorded event names where it came from: the innermost frames of this repository's code
(`hf_lowprec/`, `tests/`, `bench/`), so a failing test points at a file and line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CompiledRun", "DeviceTraffic", "Event", "compiled_run", "count_graph_breaks", "graph_breaks"]

ROOT = Path(__file__).resolve().parents[2]
_OWN_CODE = tuple(str(ROOT / d) + "/" for d in ("hf_lowprec", "tests", "bench"))
# The counting harness itself is never where an event comes from.
_HARNESS = {str(Path(__file__).resolve()), str(Path(__file__).resolve().with_name("fake_cuda.py"))}
aten = torch.ops.aten
# Operations whose result the host must read before it can go on (or whose output size depends
# on the data, which the host must read to allocate it).
_SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.masked_select.default,
}
# What a fake tensor answers in place of a value it does not hold (see `DeviceTraffic`).
_SCALAR_OPS = {
    aten._local_scalar_dense.default: lambda t: (
        True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
    ),
    aten.is_nonzero.default: lambda t: True,
    aten.equal.default: lambda t: True,
}
_COPY_OPS = {aten._to_copy.default, aten.copy_.default}


@dataclasses.dataclass(frozen=True)
class Event:
    """One sync or copy: the operation and the innermost frames of the repository's code."""

    op: str
    where: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.op} at {' <- '.join(self.where) or '(no frame of this repository)'}"


def _where(depth: int = 3) -> tuple[str, ...]:
    """The innermost `depth` frames of this repository's code, else the innermost frame outside torch."""
    stack = [f for f in traceback.extract_stack() if f.filename not in _HARNESS]
    own = [f for f in stack if f.filename.startswith(_OWN_CODE)]
    if own:
        return tuple(f"{Path(f.filename).relative_to(ROOT)}:{f.lineno} {f.name}" for f in reversed(own[-depth:]))
    outside = [f for f in stack if f"{os.sep}torch{os.sep}" not in f.filename]
    return tuple(f"{f.filename}:{f.lineno} {f.name}" for f in outside[-1:])


def _is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _device(t: Any) -> str | None:
    return t.device.type if isinstance(t, torch.Tensor) else None


class DeviceTraffic(TorchDispatchMode):
    """Records the host syncs and host→device copies of everything run inside it.

    Use as `with DeviceTraffic() as traffic: step()`, then read `traffic.syncs`,
    `traffic.copies` (lists of `Event`) or `traffic.summary()`. Enter it after (inside) a
    `FakeTensorMode`, so it sees the fake CUDA tensors.

    Args:
        stand_in: on fake tensors, which hold no values, answer a value read by the host with
            1 (True, 1.0: "finite", "no overflow", a unit scale) instead of failing, so a step
            that still syncs runs on and its later syncs and copies are counted too.
    """

    def __init__(self, stand_in: bool = False) -> None:
        super().__init__()
        self.stand_in = stand_in
        self.syncs: list[Event] = []
        self.copies: list[Event] = []
        self._patches = contextlib.ExitStack()

    def __enter__(self) -> DeviceTraffic:
        # Dynamo refuses to run compiled code under a user dispatch mode (and the package's
        # compiled kernels would then fall back to eager for good): run every `torch.compile`d
        # function as its eager source instead, whose operations this mode then sees.
        self._patches.enter_context(torch.compiler.set_stance("force_eager"))
        super().__enter__()
        for name in ("tolist", "numpy"):
            self._patches.enter_context(_wrap_tensor_method(name, self.syncs))
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._patches.close()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNC_OPS:
            self.syncs.append(Event(str(func), _where()))
            if self.stand_in and func in _SCALAR_OPS and _is_fake(args[0]):
                return _SCALAR_OPS[func](args[0])
        elif func is aten.index.Tensor and any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            self.syncs.append(Event("aten.index.Tensor (boolean mask)", _where()))
        elif func in _COPY_OPS:
            source = args[1] if func is aten.copy_.default else args[0]
            target = _device(args[0]) if func is aten.copy_.default else str(kwargs.get("device", source.device))
            target = torch.device(target).type if target else None
            if source.device.type == "cpu" and target == "cuda" and source.numel() > 0:
                self.copies.append(Event(f"{func} host->device {tuple(source.shape)}", _where()))
            elif source.device.type == "cuda" and target == "cpu":
                self.syncs.append(Event(f"{func} device->host {tuple(source.shape)}", _where()))
        return func(*args, **kwargs)

    def summary(self, events: list[Event] | None = None) -> str:
        """One line per distinct event, most frequent first: `3× aten.… at file:line …`."""
        counts = Counter(str(e) for e in (self.syncs if events is None else events))
        return "\n".join(f"{n}x {e}" for e, n in counts.most_common())


@contextlib.contextmanager
def _wrap_tensor_method(name: str, events: list[Event]) -> Iterator[None]:
    original = getattr(torch.Tensor, name)

    def recorded(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        events.append(Event(f"Tensor.{name}", _where()))
        return original(self, *args, **kwargs)

    setattr(torch.Tensor, name, recorded)
    try:
        yield
    finally:
        setattr(torch.Tensor, name, original)


def graph_breaks() -> int:
    """Graph breaks dynamo has counted since the last `torch._dynamo.reset()` (all reasons)."""
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def count_graph_breaks(run: Callable[[], Any]) -> tuple[int, Counter]:
    """(breaks, reasons) of `run()` from a clean dynamo state: `torch._dynamo.reset()` first."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    run()
    reasons = Counter(torch._dynamo.utils.counters["graph_break"])
    return sum(reasons.values()), reasons


# --- the training step the checks count -----------------------------------------------------
# GPT-2 from config, as the counts are taken: n_embd 128 (FP8 needs multiples of 16),
# batch 4×32. `pad_token_id=None`: with a pad token and no attention mask, transformers checks
# the batch for padding with `pad_token_id in input_ids` (a host sync of transformers, not of
# the strategy); a Trainer batch carries its attention mask, and then transformers reads that
# instead (`masking_utils._ignore_causal_mask_sdpa`, also a sync). Neither is the package's.
N_EMBD, BATCH, SEQ, VOCAB = 128, 4, 32, 1024


def gpt2(n_layer: int, seed: int = 0) -> torch.nn.Module:
    """The GPT-2 the GPU checks train (dropout as in GPT-2's config: it costs no sync)."""
    from transformers import GPT2LMHeadModel

    from hf_lowprec.data import tiny_gpt2_config

    torch.manual_seed(seed)
    return GPT2LMHeadModel(tiny_gpt2_config(VOCAB, n_embd=N_EMBD, n_layer=n_layer, n_positions=SEQ, pad_token_id=None))


def token_batch(device: str | torch.device = "cpu", seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator).to(device)


def strategy_step(strategy: Any, model: torch.nn.Module, optimizer: Any, ids: torch.Tensor) -> None:
    """One step as the Trainer drives a strategy: forward context, scaled backward, step, zero_grad."""
    with strategy.forward_context():
        loss = model(input_ids=ids, labels=ids).loss
    strategy.scale_loss(loss).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def strategy_syncs(name: str, n_layer: int, warmup: int = 2, sharded: bool = False) -> tuple[list[Event], list[Event]]:
    """(host syncs of the first step, of one steady step after `warmup` steps) of `name` on CPU;
    `sharded`: the model sharded with FSDP2 (`shard_model`; a process group must exist)."""
    import hf_lowprec
    from hf_lowprec.engines.fsdp2 import shard_model

    strategy = hf_lowprec.get_strategy(name)
    model = shard_model(strategy, gpt2(n_layer)) if sharded else strategy.prepare_model(gpt2(n_layer))
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3, weight_decay=0.01)
    ids = token_batch()
    with DeviceTraffic() as first:
        strategy_step(strategy, model, optimizer, ids)
    for _ in range(warmup - 1):
        strategy_step(strategy, model, optimizer, ids)
    with DeviceTraffic() as steady:
        strategy_step(strategy, model, optimizer, ids)
    return first.syncs, steady.syncs


@dataclasses.dataclass(frozen=True)
class CompiledRun:
    """What dynamo did while a compiled model trained: graph breaks in the warm-up steps, and
    the graphs it built (recompilations) in the steady steps after them, with dynamo's reasons
    (the guards that failed, one line each)."""

    breaks: int
    break_reasons: Counter
    new_graphs: int
    recompile_reasons: tuple[str, ...]

    def recompiles_summary(self) -> str:
        return "\n".join(f"  {r}" for r in self.recompile_reasons) or "  (no reason recorded)"


def compiled_run(step: Callable[[], Any], warmup: int = 2, steady: int = 4) -> CompiledRun:
    """Run `step()` `warmup` + `steady` times from a clean dynamo state, with dynamo's settings
    as they are (a recompile limit raised to hide a per-step graph would hide the defect).

    The first steps may build graphs (the forward, then the backward, a graph for a shape met
    once); from step `warmup + 1` on, every graph dynamo makes is a recompilation: a guard
    failed because some value read while tracing changed between steps.
    """
    from torch._dynamo.utils import counters, guard_failures

    torch._dynamo.reset()
    counters.clear()
    guard_failures.clear()
    for _ in range(warmup):
        step()
    breaks = Counter(counters["graph_break"])
    graphs = counters["stats"]["unique_graphs"]
    guard_failures.clear()
    for _ in range(steady):
        step()
    reasons = tuple(
        f"{getattr(code, 'co_name', code)}: {str(reason).splitlines()[0][:300]}"
        for code, failures in guard_failures.items()
        for reason in failures
    )
    return CompiledRun(sum(breaks.values()), breaks, counters["stats"]["unique_graphs"] - graphs, reasons)


def strategy_compiled_run(name: str, n_layer: int = 2, warmup: int = 2, steady: int = 4, **options: Any) -> CompiledRun:
    """`compiled_run` of `name`'s training step with the prepared model wrapped in
    `torch.compile`, as `TrainingArguments(torch_compile=True)` wraps it (backend "eager": see
    `strategy_graph_breaks`; guards are dynamo's, decided before any backend runs)."""
    import hf_lowprec

    strategy = hf_lowprec.get_strategy(name, **options)
    model = strategy.prepare_model(gpt2(n_layer))
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3, weight_decay=0.01)
    compiled = torch.compile(model, backend="eager")
    ids = token_batch()
    return compiled_run(lambda: strategy_step(strategy, compiled, optimizer, ids), warmup, steady)


def strategy_graph_breaks(name: str, n_layer: int = 2, steps: int = 2) -> tuple[int, Counter]:
    """(graph breaks, reasons) of `steps` training steps of `name` with the prepared model
    wrapped in `torch.compile`, as `TrainingArguments(torch_compile=True)` wraps it.

    Backend "eager": dynamo decides every graph break while it reads the bytecode, before any
    backend sees a graph, and it traces an `autograd.Function`'s backward itself, so the count
    is the same as under "aot_eager" or "inductor" (measured: bf16-mixed 3 under both "eager"
    and "aot_eager"), at a fraction of the compile time.
    """
    import hf_lowprec

    strategy = hf_lowprec.get_strategy(name)
    model = strategy.prepare_model(gpt2(n_layer))
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3, weight_decay=0.01)
    compiled = torch.compile(model, backend="eager")
    ids = token_batch()

    def train() -> None:
        for _ in range(steps):
            strategy_step(strategy, compiled, optimizer, ids)

    return count_graph_breaks(train)


def anchor_syncs(n_layer: int = 2, plant: Callable[[torch.Tensor], Any] | None = None) -> DeviceTraffic:
    """The anchor, torch's AMP recipe (autocast, GradScaler, `AdamW(fused=True)`, which reads
    found_inf on the device): the traffic of its second step; `plant(loss)` runs after backward."""
    model = gpt2(n_layer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    ids = token_batch()

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        if plant is not None:
            plant(loss)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    step()
    with DeviceTraffic() as traffic:
        step()
    return traffic
