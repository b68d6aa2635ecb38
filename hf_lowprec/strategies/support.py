"""Where a strategy trains with its numerics: one frozen declaration per strategy class,
`support = EngineSupport(...)`, the one source the engines' refusals, `hf_lowprec.engines.traffic`
and the README's support matrix read. A strategy whose support depends on its options
(collage-8bit's blocks, fp16-als's `weights="sr"`) overrides
`interface.PrecisionStrategy.engine_support` and returns `dataclasses.replace(support, ...)`.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

__all__ = ["EngineSupport", "check_sharded_parameters", "refuse_dtensors_outside_fsdp2"]

ZERO_STAGES = (0, 1, 2, 3)


@dataclasses.dataclass(frozen=True)
class EngineSupport:
    """The engines a strategy trains under with its numerics, each tested by the suite.

    Args:
        ddp: trains under torch DDP (tests/distributed); `engines.ddp.check_ddp_support`
            refuses the others before training.
        ddp_note: one line for the support matrix: how the gradients are averaged over ranks.
        ddp_refusal: why DDP is refused, naming what works instead.
        zero_stages: the DeepSpeed ZeRO stages that keep the numerics (tests/deepspeed);
            `engines.zero` refuses the others before training.
        zero_note: one line for the support matrix: what the ZeRO partitions hold.
        zero_refusal: why the other stages are refused, naming what works instead.
        fsdp2: trains under FSDP2 (`engines.fsdp2.shard_model`, tests/distributed);
            `engines.fsdp2` refuses the others before any work.
        fsdp2_note: one line for the support matrix: what the FSDP2 shards hold.
        fsdp2_refusal: why FSDP2 is refused, naming what works instead.
        fsdp2_gathers_fp8: FSDP2 all-gathers the FP8 GEMM weights as FP8, one byte per element
            (`engines.traffic` counts what each collective moves from it).
    """

    ddp: bool = True
    ddp_note: str = "DDP's all-reduce: each rank's gradient divided by the world size, summed in its own dtype"
    ddp_refusal: str = ""
    zero_stages: tuple[int, ...] = ()
    zero_note: str = ""
    zero_refusal: str = "it has not been verified under DeepSpeed ZeRO; train it with DDP (no DeepSpeed)"
    fsdp2: bool = False
    fsdp2_note: str = ""
    fsdp2_refusal: str = "it has not been verified under FSDP2; train it with DDP"
    fsdp2_gathers_fp8: bool = False

    def __post_init__(self) -> None:
        # A declaration the support matrix or a refusal could not print is a mistake in the
        # strategy's class: fail when the class is defined, not when a user hits the engine.
        unknown = [s for s in self.zero_stages if s not in ZERO_STAGES]
        if unknown:
            raise ValueError(f"zero_stages {self.zero_stages}: stages are {ZERO_STAGES}")
        missing = [
            field
            for field, needed in (
                ("ddp_note", self.ddp),
                ("ddp_refusal", not self.ddp),
                ("zero_note", bool(self.zero_stages)),
                ("zero_refusal", len(self.zero_stages) < len(ZERO_STAGES)),
                ("fsdp2_note", self.fsdp2),
                ("fsdp2_refusal", not self.fsdp2),
            )
            if needed and not getattr(self, field)
        ]
        if missing:
            raise ValueError(f"EngineSupport needs {', '.join(missing)} for what it declares")
        if self.fsdp2_gathers_fp8 and not self.fsdp2:
            raise ValueError("fsdp2_gathers_fp8 declares an FSDP2 all-gather, so fsdp2 must be True")


class _Declaring(Protocol):
    """What `check_sharded_parameters` reads of a strategy (`interface.PrecisionStrategy`, which
    imports this module: described here, not imported)."""

    @property
    def name(self) -> str: ...
    def engine_support(self) -> EngineSupport: ...


def check_sharded_parameters(strategy: _Declaring, params: list[torch.Tensor]) -> None:
    """Refuse FSDP2 parameters that `hf_lowprec.engines.fsdp2` did not shard for this strategy.

    Sharding by hand (`fully_shard` on the prepared model) skips what `engines.fsdp2.shard_model` does: the
    refusal of a strategy whose numerics would differ on shards, the strategy's
    `MixedPrecisionPolicy` and the move of seeded state onto the shards. Training would fail
    inside the library or silently differ from one process, so `create_optimizer` stops here,
    before any work."""
    from ..distributed import DTensor, sharded_by

    sharded = [p for p in params if isinstance(p, DTensor)]
    if not sharded:
        return
    support = strategy.engine_support()
    if not support.fsdp2:
        raise ValueError(
            f"create_optimizer got FSDP2 (DTensor) parameters, and precision strategy {strategy.name!r} is not "
            f"supported under FSDP2 (fully_shard): {support.fsdp2_refusal}. "
            "hf_lowprec.engines.fsdp2.shard_model(strategy, model) refuses it the same way before sharding"
        )
    by_hand = [p for p in sharded if sharded_by(p) != strategy.name]
    if by_hand:
        raise ValueError(
            f"create_optimizer got {len(by_hand)} FSDP2 (DTensor) parameters that were not sharded for "
            f"precision strategy {strategy.name!r} (fully_shard called by hand, or for another strategy). "
            "Shard with hf_lowprec.engines.fsdp2.shard_model(strategy, model), which converts the model, applies the "
            "strategy's MixedPrecisionPolicy and moves its seeded state onto the shards; pass the unsharded model"
        )


def refuse_dtensors_outside_fsdp2(model: torch.nn.Module) -> None:
    """Refuse DTensor parameters that no FSDP2 module holds (tensor parallelism, `distribute_tensor`
    by hand), before the strategy prepares the model: no strategy's numerics are verified on them."""
    from ..distributed import DTensor

    sharded = [(n, p) for n, p in model.named_parameters() if isinstance(p, DTensor)]
    if not sharded:  # the common case; no FSDP import
        return
    from torch.distributed.fsdp import FSDPModule

    held = {id(p) for m in model.modules() if isinstance(m, FSDPModule) for p in m.parameters()}
    outside = [n for n, p in sharded if id(p) not in held]
    if outside:
        more = f" and {len(outside) - 1} more" if len(outside) > 1 else ""
        raise ValueError(
            f"prepare_model got DTensor parameter {outside[0]!r}{more} outside FSDP2: DTensor parameters "
            "(tensor parallelism, distribute_tensor) outside FSDP2 are not supported. Supported: plain tensor "
            "parameters, trained in one process, under DDP or DeepSpeed ZeRO, or sharded by FSDP2 with "
            "hf_lowprec.engines.fsdp2.shard_model(strategy, model) (or Accelerate's or the Trainer's FSDP2); "
            "pass the model with plain tensor parameters"
        )
