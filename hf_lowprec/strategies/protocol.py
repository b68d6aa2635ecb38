"""`Strategy`: what the strategies' own helper modules call on a strategy, as a protocol.

`interface.PrecisionStrategy` is the one implementation; it imports its helpers (the optimizer
wrapper, `optimizer.py`; adoption, `adopt.py`), so they name this protocol instead of it, and no
import runs in a circle, not even one read by type checkers only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..report import ReportedStrategy

if TYPE_CHECKING:
    from ..guard import Guard

__all__ = ["Strategy"]


class Strategy(ReportedStrategy, Protocol):
    """The report's view of a strategy, plus the step hooks `optimizer.StrategyOptimizer` drives."""

    guard: Guard | None
    measure_next_step: bool

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None: ...
    def process_gradients(self, optimizer: torch.optim.Optimizer) -> torch.Tensor: ...
    def optimizer_step(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> Any: ...
    def count_skip(self, found_inf: torch.Tensor) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def _measure_lost_arithmetic(self, records: list | None, group_count: int) -> None: ...
