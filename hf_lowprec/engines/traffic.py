"""What each engine's collectives carry per strategy, read from the strategies' declarations: the
table of docs/distributed.md, "What moves per collective" (`collectives_markdown`), and the bytes
one rank moves per FSDP2 step (`fsdp2_step_bytes`, which tests/distributed counts against).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ..strategies.registry import available_strategies, get_strategy

if TYPE_CHECKING:
    from ..strategies.interface import PrecisionStrategy

__all__ = ["Traffic", "collectives_markdown", "fsdp2_step_bytes", "traffic"]


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes per parameter element on each collective (None: the engine refuses the strategy)."""

    ddp_all_reduce: float | None
    ddp_how: str
    fsdp2_gather_fp8_weights: float | None
    fsdp2_gather_other: float | None
    fsdp2_reduce_scatter: float | None


def _itemsize(dtype: torch.dtype | None) -> float | None:
    return None if dtype is None else float(dtype.itemsize)


def traffic(strategy: PrecisionStrategy) -> Traffic:
    """The bytes per element `strategy` moves in each collective of DDP and FSDP2.

    - DDP, the gradient all-reduce: the gradients in the dtype backward leaves them in (the
      parameters' under the strategy), or what the strategy's communication hook sends instead
      (`ddp_comm_hook`: FP8-LM's FP8 payload, one byte per element plus one scale per tensor).
    - FSDP2, the all-gather: the policy's `param_dtype` where it casts, else the parameters' own
      dtype; weights a strategy gathers in FP8 (`support.fsdp2_gathers_fp8`, FP8-LM's E4M3
      payload) one byte.
    - FSDP2, the reduce-scatter: the policy's `reduce_dtype`, else the dtype the gradients are
      computed in.
    """
    own = strategy.param_dtype
    ddp_bytes, how = None, ""
    support = strategy.engine_support()
    if support.ddp:
        hook = strategy.ddp_comm_hook()
        if hook is not None and getattr(strategy, "grad_dtype", None) is not None:
            ddp_bytes, how = _itemsize(strategy.grad_dtype), "FP8 payload + 1 FP32 scale per tensor"
        else:
            ddp_bytes, how = _itemsize(own), f"{_name(own)} gradients"
    gather_fp8 = gather_other = reduce = None
    if support.fsdp2:
        policy = strategy.fsdp2_mixed_precision()
        param_dtype = getattr(policy, "param_dtype", None) or own
        gather_other = _itemsize(param_dtype)
        gather_fp8 = 1.0 if support.fsdp2_gathers_fp8 else gather_other
        reduce = _itemsize(getattr(policy, "reduce_dtype", None) or param_dtype)
    return Traffic(ddp_bytes, how, gather_fp8, gather_other, reduce)


def _name(dtype: torch.dtype) -> str:
    return {torch.float32: "FP32", torch.bfloat16: "BF16", torch.float16: "FP16"}.get(dtype, str(dtype))


def fsdp2_step_bytes(strategy: PrecisionStrategy, model: torch.nn.Module, world_size: int) -> dict[str, int]:
    """{"all_gather": bytes, "reduce_scatter": bytes} one rank moves per training step for
    `model` as `fsdp2.shard_model` sharded it (FSDP2 groups: every `FSDPModule`, its parameters
    those not held by a nested one), from `traffic(strategy)`.

    Each group's parameters, padded on dim 0 to a multiple of the world size as FSDP2 pads them,
    are gathered twice per step (forward, then again in backward after resharding; the root
    group, which FSDP2 keeps unsharded after forward, once) and reduce-scattered once.
    tests/distributed counts the same bytes at `torch.distributed.all_gather_single` and
    `reduce_scatter_single` for every strategy FSDP2 trains and compares them."""
    from torch.distributed.fsdp import FSDPModule

    rates = traffic(strategy)
    if rates.fsdp2_gather_other is None:
        raise ValueError(f"precision strategy {strategy.name!r} does not train under FSDP2")
    fp8 = {id(p) for p in _fp8_weights(model)} if strategy.engine_support().fsdp2_gathers_fp8 else set()
    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    nested = {id(p) for m in groups if m is not model for p in m.parameters()}
    gathered = reduced = 0.0
    for module in groups:
        params = [p for p in module.parameters() if module is not model or id(p) not in nested]
        passes = 1 if module is model else 2
        for p in dict.fromkeys(params):  # a tied weight is one parameter
            rows = -(-p.shape[0] // world_size) * world_size
            numel = rows * (p.numel() // max(p.shape[0], 1))
            rate = rates.fsdp2_gather_fp8_weights if id(p) in fp8 else rates.fsdp2_gather_other
            gathered += passes * numel * rate
            if p.requires_grad:
                reduced += numel * rates.fsdp2_reduce_scatter
    return {"all_gather": int(gathered), "reduce_scatter": int(reduced)}


def _fp8_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights FSDP2 gathers in FP8: the FP8 linear layers' and the FP8 experts' 3-D ones."""
    from ..fp8 import FP8Linear
    from ..fp8.experts import FP8Experts, expert_weight_names

    out: list[torch.Tensor] = []
    for m in model.modules():
        if isinstance(m, FP8Linear):
            out.append(m.weight)
        elif isinstance(m, FP8Experts):
            out += [getattr(m, name) for name in expert_weight_names(m)]
    return out


def collectives_markdown() -> str:
    """The table of docs/distributed.md: bytes per element on each collective, per strategy."""

    def cell(value: float | None) -> str:
        return "refused" if value is None else f"{value:g}"

    lines = [
        "| strategy | DDP all-reduce | FSDP2 all-gather: FP8 GEMM weights | FSDP2 all-gather: other | FSDP2 reduce-scatter |",
        "|---|---|---|---|---|",
    ]
    for name in available_strategies():
        t = traffic(get_strategy(name))
        ddp = "refused" if t.ddp_all_reduce is None else f"{t.ddp_all_reduce:g} ({t.ddp_how})"
        gather_fp8 = cell(t.fsdp2_gather_fp8_weights)
        if t.fsdp2_gather_fp8_weights is not None and t.fsdp2_gather_fp8_weights != t.fsdp2_gather_other:
            gather_fp8 += " (E4M3 + 1 FP32 scale per tensor)"
        row = f"| `{name}` | {ddp} | {gather_fp8} | {cell(t.fsdp2_gather_other)} | {cell(t.fsdp2_reduce_scatter)} |"
        lines.append(row)
    return "\n".join(lines) + "\n"
