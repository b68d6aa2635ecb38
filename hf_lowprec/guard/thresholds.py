"""The guard's thresholds: `GuardConfig`, and `guard_config`, which reads the `guard` option."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["GuardConfig", "guard_config"]


@dataclasses.dataclass(frozen=True)
class GuardConfig:
    """Thresholds of the guard (what each does: `watch.Guard`; docs/guard.md, "Options"). Defaults
    follow OLMo-core's skip-step optimizer (a window of 128 steps, 6 spreads)."""

    window: int = 128
    warmup: int = 20
    z_threshold: float = 6.0
    rollback_after: int = 3
    snapshot_every: int = 50
    max_flushed: float = 0.01
    max_rollbacks: int = 10

    def __post_init__(self) -> None:
        for name in ("window", "warmup", "rollback_after", "snapshot_every", "max_rollbacks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"guard option {name!r} must be a positive integer, got {value!r}")
        for name, low, high in (("z_threshold", 0.0, math.inf), ("max_flushed", 0.0, 1.0)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not low < value <= high:
                raise ValueError(f"guard option {name!r} must be a number in ({low}, {high}], got {value!r}")
        if self.warmup > self.window:
            raise ValueError(f"guard option 'warmup' ({self.warmup}) must not exceed 'window' ({self.window})")


def guard_config(value: Any) -> GuardConfig | None:
    """The `guard` option as a config: False → off, True → defaults, a dict → its fields.
    Anything else, or an unknown field, raises an error naming the valid fields."""
    if value is False:
        return None
    if value is True:
        return GuardConfig()
    if isinstance(value, dict):
        fields = {f.name for f in dataclasses.fields(GuardConfig)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(f"guard has no option(s) {unknown}; valid: {sorted(fields)}")
        return GuardConfig(**value)
    raise ValueError(
        f"option 'guard' must be true, false or a dict of {sorted(GuardConfig.__annotations__)}, got {value!r}"
    )
