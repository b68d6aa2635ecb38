"""Native CPU optimizer kernels: hand-written C++ with explicit SIMD for every AdamW family,
bit-identical to the reference path (docs/numerics.md, "The optimizer step: one AdamW, three paths").

`core` builds them (`native_unavailable` says why it could not), picks the instruction set
(`isa`) and holds the one entry point, `step`: a family's `Declaration` and its tensors by name.
`family_steps` calls it for each family by its own arguments (`adamw_step`, `collage_step`, …).
"""

from .core import (
    ISA_ENV,
    ISAS,
    Declaration,
    Tensors,
    adamw_scalars,
    best_isa,
    check,
    declaration,
    forced_isa,
    isa,
    native_unavailable,
    step,
)
from .family_steps import (
    adamw_step,
    coat_step,
    collage_step,
    eightbit_step,
    fp8_adamw_step,
    kahan_step,
    master_step,
    sr_step,
)

__all__ = [
    "ISAS",
    "ISA_ENV",
    "Declaration",
    "Tensors",
    "adamw_scalars",
    "adamw_step",
    "best_isa",
    "check",
    "coat_step",
    "collage_step",
    "declaration",
    "eightbit_step",
    "fp8_adamw_step",
    "forced_isa",
    "isa",
    "kahan_step",
    "master_step",
    "native_unavailable",
    "sr_step",
    "step",
]
