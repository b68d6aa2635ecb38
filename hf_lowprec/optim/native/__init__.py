"""Native CPU optimizer kernels: hand-written C++ with explicit SIMD for every AdamW family.

One AdamW step, written once in C++ over a family's declaration, as the Python core composes
`formats` and `rules`: the m format, the v format and the update rule, each a small C++ struct
(decode / encode, read / apply) that the step template combines; the formats' layouts pick one
of three loops (element-wise; two passes for a per-tensor scale; per group). `step` is the one
entry point: a `Declaration` (the formats' and the rule's `native_name` and options) and the
state tensors by name (`Composition.stored_names`: "exp_avg", "exp_avg_sq_error",
"param_error", …). **Adding a family takes 2 places**: its composition in Python, and one line
in `csrc/kernels_impl.h`'s `Families` (its tags, and the storage dtypes it runs); a new format
or rule adds its struct there and its tensors' names in `csrc/bindings.cpp`. The per-family
functions (`adamw_step`, `collage_step`, …, in `steps`) only name a declaration and call `step`.

The update rules of the optimizers' reference path, operation for operation, written in C++
over a small vector-traits layer and compiled four times: AVX-512 with AVX512-BF16 (its
hardware FP32 -> BF16 rounding where that equals PyTorch's cast: no subnormal or NaN in the
vector), AVX-512 (16 lanes), AVX2 + F16C (8 lanes) and scalar. One build serves every x86-64 CPU: each
instruction set lives in its own translation unit compiled for it (a target pragma), and the
widest one the CPU runs is picked at run time; `HF_LOWPREC_CPU_ISA=avx512_bf16|avx512|avx2|scalar` forces
one (an ISA the CPU lacks is an error, not a silent fallback). Vector bodies and the scalar
tail run one template, so results do not depend on the ISA, the thread count or an element's
position: the tests check every ISA the CPU runs against the references bit for bit.

Results: bit-identical to the reference for every family (AdamW, Collage light/plus, Kahan,
stochastic rounding with the optimizers' counter-based stream, master weights, FP8AdamW, COAT
with and without range expansion: its powers |x|^k and |y|^(1/k) are `numerics.pow_nonnegative`,
a fixed log2/exp2 sequence that the reference runs too).

Arithmetic: every FP32 operation rounded on its own (built with -ffp-contract=off, no fast
math), IEEE square root and division, round-to-nearest-even conversions. FP32 -> BF16 uses
the integer rounding PyTorch's cast uses (NaN -> 0xFFFF like its vectorised cast); AVX512-BF16's
`vcvtneps2bf16` gives the same bits except on subnormal inputs (flushed) and NaN, so the
avx512_bf16 build uses it only for vectors with neither. FP16 uses F16C's
conversions (IEEE), FP8 E4M3/E5M2 an exact integer rounding with PyTorch's saturation and NaN
codes.

Build: `torch.utils.cpp_extension.load` on first use (ninja and a C++17 compiler), cached under
`TORCH_EXTENSIONS_DIR` (`make` and the tests put it under build/); sources are shipped in the
wheel (package data `csrc/*`). A missing compiler or a failed build does not raise here:
`native_unavailable()` returns the reason, for the caller to log once and fall back.

Threads: each call splits its whole bucket into blocks of 32768 elements and runs them on
ATen's intra-op pool (`at::parallel_for`: OpenMP in PyTorch's CPU builds, sized by
`torch.set_num_threads`); a bucket under 32768 elements runs on the calling thread.

Skipped steps: `step` takes `found_inf` (None, or a one-element floating CPU tensor);
the kernel checks its arguments, reads the flag once and, when it is nonzero (NaN included),
returns without writing anything.

Per-parameter scalars: an (n, 6) FP32 CPU tensor, one row per parameter, the optimizers'
per-step scalars: ONE_MINUS_BETA1 = 1 − β1, BETA2 = β2, ONE_MINUS_BETA2 = 1 − β2, STEP = −α·√c2/c1, EPS = max(ε·√c2,
tiny), DECAY = −α·λ with c1 = 1 − β1^t, c2 = 1 − β2^t, computed in FP64 and rounded once
(`adamw_scalars` builds it).
"""

from .core import (
    ISA_ENV,
    ISAS,
    Declaration,
    Tensors,
    _module,  # noqa: F401  (the tests read the build's best_isa through it)
    adamw_scalars,
    check,
    declaration,
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
    "check",
    "coat_step",
    "collage_step",
    "declaration",
    "eightbit_step",
    "fp8_adamw_step",
    "isa",
    "kahan_step",
    "master_step",
    "native_unavailable",
    "sr_step",
    "step",
]
