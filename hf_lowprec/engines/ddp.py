"""torch DDP for precision strategies: which strategies it carries (read from the strategy class's
`support` declaration: `ddp`, `ddp_refusal`, `ddp_note`), and `prepare_ddp`, the one call a loop
makes on a DDP-wrapped model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from ..distributed import written_without_change
from ..strategies.registry import available_strategies, get_strategy

if TYPE_CHECKING:
    from ..strategies.interface import PrecisionStrategy

__all__ = ["check_ddp_support", "ddp_support", "prepare_ddp", "support_matrix_markdown"]


def ddp_support(strategy: PrecisionStrategy) -> str | None:
    """None when `strategy` trains under torch DDP with its numerics, else the refusal message
    (why, and what works instead)."""
    support = strategy.engine_support()
    if support.ddp:
        return None
    return f"precision strategy {strategy.name!r} is not supported under torch DDP: {support.ddp_refusal}"


def check_ddp_support(strategy: PrecisionStrategy) -> None:
    """Raise ValueError with `ddp_support`'s message when the strategy is refused."""
    message = ddp_support(strategy)
    if message is not None:
        raise ValueError(message)


def prepare_ddp(strategy: PrecisionStrategy, wrapped: torch.nn.Module) -> None:
    """On a `DistributedDataParallel` model: refuse a strategy DDP does not carry, hand the
    strategy DDP's process group (fp16-als sums its loss-scale histogram over it), and register
    its communication hook once (FP8-LM's FP8 all-reduce). Anything else is left as is.

    The Trainer and `hf_lowprec.PrecisionPlugin` call it before the first backward."""
    if not isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        return
    check_ddp_support(strategy)
    if not getattr(wrapped, "_hf_lowprec_broadcast_taken", False):  # once per wrap: later writes are the user's
        # DDP's construction broadcast the parameters in place, values unchanged: no weight written
        # outside the optimizer (its masters and compensations, and the residuals kept for it, stay).
        written_without_change(wrapped.module.parameters())
        wrapped._hf_lowprec_broadcast_taken = True
    strategy.set_data_parallel_group(wrapped.process_group)
    hook = strategy.ddp_comm_hook()
    if hook is not None and not getattr(wrapped, "_hf_lowprec_hooked", False):
        wrapped.register_comm_hook(*hook)
        wrapped._hf_lowprec_hooked = True


def support_matrix_markdown(names: Iterable[str] | None = None) -> str:
    """The DDP column of the support matrix as a markdown table, from the same declarations."""
    names = available_strategies() if names is None else list(names)
    lines = ["| strategy | DDP | under DDP |", "|---|---|---|"]
    for name in names:
        support = get_strategy(name).engine_support()
        lines.append(
            f"| `{name}` | {'yes' if support.ddp else 'no'} | {support.ddp_note if support.ddp else support.ddp_refusal} |"
        )
    return "\n".join(lines) + "\n"
