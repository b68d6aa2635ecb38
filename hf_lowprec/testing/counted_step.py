"""The training step the GPU rules are counted on: GPT-2 from config (`gpt2`), one strategy step
(`strategy_step`), and the anchor (`anchor_step`), with the counts each takes.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from .graphs import CompiledRun, compiled_run, count_graph_breaks
from .syncs import DeviceTraffic, Event

__all__ = [
    "BATCH",
    "N_EMBD",
    "SEQ",
    "VOCAB",
    "anchor_step",
    "anchor_syncs",
    "gpt2",
    "moe",
    "strategy_compiled_run",
    "strategy_graph_breaks",
    "strategy_step",
    "strategy_syncs",
    "token_batch",
]

N_EMBD, BATCH, SEQ, VOCAB = 128, 4, 32, 1024


def gpt2(n_layer: int, seed: int = 0) -> torch.nn.Module:
    """The GPT-2 the GPU checks train (dropout as in GPT-2's config: it costs no sync).

    As the counts of issue #36 are taken: n_embd 128 (FP8 needs multiples of 16), batch 4×32
    (`token_batch`). `pad_token_id=None`: with a pad token and no attention mask, transformers
    checks the batch for padding with `pad_token_id in input_ids` (a host sync of transformers,
    not of the strategy); a Trainer batch carries its attention mask, and then transformers reads
    that instead (`masking_utils._ignore_causal_mask_sdpa`, also a sync). Neither is the
    package's. With its KV cache on (transformers' default, also in training): without one, transformers
    checks the position ids for packed sequences on the host (`find_packed_sequence_indices`),
    one sync per step that is not this package's."""
    from transformers import GPT2LMHeadModel

    from hf_lowprec.data import tiny_gpt2_config

    torch.manual_seed(seed)
    return GPT2LMHeadModel(tiny_gpt2_config(VOCAB, n_embd=N_EMBD, n_layer=n_layer, n_positions=SEQ, pad_token_id=None))


def moe(n_layer: int, seed: int = 0) -> torch.nn.Module:
    """The Mixture-of-Experts model the GPU checks train beside GPT-2: a tiny Qwen3-MoE
    (`testing.moe`: hidden 64, 8 experts of width 32, top-2) over the checks' vocabulary,
    whose experts run transformers' default `grouped_mm` implementation."""
    from .moe import tiny_moe

    return tiny_moe("qwen3_moe", seed=seed, vocab=VOCAB, layers=n_layer)


MODELS = {"gpt2": gpt2, "moe": moe}


def checked_strategy(name: str, **options: Any) -> Any:
    """Strategy `name` as the checks build it: FP8-LM converts every eligible layer
    (`fp8_layers="all"`), so their tiny models run the FP8 paths on a GPU too, where the rule of
    `hf_lowprec.fp8.payoff` would keep layers that small in BF16."""
    import hf_lowprec
    from hf_lowprec.strategies.registry import strategy_class

    fields = {f.name for f in dataclasses.fields(strategy_class(name)[0].Options)}
    return hf_lowprec.get_strategy(name, **{**({"fp8_layers": "all"} if "fp8_layers" in fields else {}), **options})


def token_batch(device: str | torch.device = "cpu", seed: int = 1) -> torch.Tensor:
    """A BATCH×SEQ batch of random tokens of the checks' vocabulary, on `device`."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator).to(device)


def strategy_step(strategy: Any, model: torch.nn.Module, optimizer: Any, ids: torch.Tensor) -> None:
    """One step as the Trainer drives a strategy: forward context, scaled backward, step, zero_grad."""
    with strategy.forward_context():
        loss = model(input_ids=ids, labels=ids).loss
    strategy.scale_loss(loss).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def anchor_step(
    model: torch.nn.Module, ids: torch.Tensor, plant: Callable[[torch.Tensor], Any] | None = None
) -> Callable[[], None]:
    """One training step of the anchor on `ids`' device, a closure over its optimizer and
    scaler; `plant(loss)` runs after backward.

    The anchor is torch's AMP recipe (autocast, GradScaler, `torch.optim.AdamW(fused=True)`,
    which reads found_inf on the device): the design the strategies follow, and the counters'
    own check."""
    device = ids.device.type
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler(device)

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        if plant is not None:
            plant(loss)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return step


def strategy_syncs(
    name: str, n_layer: int, warmup: int = 2, sharded: bool = False, model: str = "gpt2"
) -> tuple[list[Event], list[Event]]:
    """(host syncs of the first step, of one steady step after `warmup` steps) of `name` on CPU;
    `sharded`: the model sharded with FSDP2 (`shard_model`; a process group must exist);
    `model`: "gpt2" or "moe" (`MODELS`)."""
    from hf_lowprec.engines.fsdp2 import shard_model

    strategy = checked_strategy(name)
    built = MODELS[model](n_layer)
    model = shard_model(strategy, built) if sharded else strategy.prepare_model(built)
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3, weight_decay=0.01)
    ids = token_batch()
    with DeviceTraffic() as first:
        strategy_step(strategy, model, optimizer, ids)
    for _ in range(warmup - 1):
        strategy_step(strategy, model, optimizer, ids)
    with DeviceTraffic() as steady:
        strategy_step(strategy, model, optimizer, ids)
    return first.syncs, steady.syncs


def strategy_compiled_run(name: str, n_layer: int = 2, warmup: int = 2, steady: int = 4, **options: Any) -> CompiledRun:
    """`compiled_run` of `name`'s training step with the prepared model wrapped in
    `torch.compile`, as `transformers.TrainingArguments(torch_compile=True)` wraps it (backend "eager": see
    `strategy_graph_breaks`; guards are dynamo's, decided before any backend runs)."""

    strategy = checked_strategy(name, **options)
    model = strategy.prepare_model(gpt2(n_layer))
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3, weight_decay=0.01)
    compiled = torch.compile(model, backend="eager")
    ids = token_batch()
    return compiled_run(lambda: strategy_step(strategy, compiled, optimizer, ids), warmup, steady)


def strategy_graph_breaks(name: str, n_layer: int = 2, steps: int = 2, model: str = "gpt2") -> tuple[int, Counter]:
    """(graph breaks, reasons) of `steps` training steps of `name` with the prepared model
    wrapped in `torch.compile`, as `transformers.TrainingArguments(torch_compile=True)` wraps it.

    Backend "eager": dynamo decides every graph break while it reads the bytecode, before any
    backend sees a graph, and it traces an `autograd.Function`'s backward itself, so the count
    is the same as under "aot_eager" or "inductor" (measured: bf16-mixed 3 under both "eager"
    and "aot_eager"), at a fraction of the compile time. `model`: "gpt2" or "moe" (`MODELS`).
    """

    strategy = checked_strategy(name)
    model = strategy.prepare_model(MODELS[model](n_layer))
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3, weight_decay=0.01)
    compiled = torch.compile(model, backend="eager")
    ids = token_batch()

    def train() -> None:
        for _ in range(steps):
            strategy_step(strategy, compiled, optimizer, ids)

    return count_graph_breaks(train)


def anchor_syncs(n_layer: int = 2, plant: Callable[[torch.Tensor], Any] | None = None) -> DeviceTraffic:
    """The traffic of the anchor's second step on CPU; `plant(loss)` runs after backward."""
    step = anchor_step(gpt2(n_layer), token_batch(), plant)
    step()
    with DeviceTraffic() as traffic:
        step()
    return traffic
