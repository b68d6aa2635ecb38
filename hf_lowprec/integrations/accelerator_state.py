"""An Accelerator's `mixed_precision` as `accelerate.PrecisionPlugin` meets it: refused (the strategy owns mixed
precision) with the fix that works where the setting came from, `accelerate launch` or an Accelerator
of this process (Accelerate keeps one `AcceleratorState` per process, which a later Accelerator takes).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["refuse_mixed_precision"]


def refuse_mixed_precision(strategy: str, accelerator: Any) -> None:
    """Raise ValueError, before any work, when `accelerator` computes in mixed precision (`strategy` owns it)."""
    mixed = getattr(accelerator, "mixed_precision", "no")
    if mixed == "no":
        return
    refused = f"precision strategy {strategy!r} owns mixed precision, but the Accelerator has mixed_precision={mixed!r}"
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if launched != "no":
        raise ValueError(
            f"{refused}, from ACCELERATE_MIXED_PRECISION={launched!r}: drop --mixed_precision from accelerate "
            "launch / the config file (or pass Accelerator(mixed_precision='no'))"
        )
    raise ValueError(
        f"{refused}: create it with Accelerator(mixed_precision='no'). Where this Accelerator was created without "
        "mixed_precision, an earlier Accelerator of this process set it: Accelerate keeps one AcceleratorState per "
        "process, a new Accelerator takes it over, and Accelerator(mixed_precision='no') is then refused. Restart "
        "the process (the notebook's kernel), or call accelerate.state.AcceleratorState._reset_state(True) before "
        "creating this Accelerator"
    )
