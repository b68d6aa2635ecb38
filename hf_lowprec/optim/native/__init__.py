"""Native CPU optimizer kernels: hand-written C++ with explicit SIMD for every AdamW family.

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

Skipped steps: every entry point takes `found_inf` (None, or a one-element floating CPU tensor);
the kernel checks its arguments, reads the flag once and, when it is nonzero (NaN included),
returns without writing anything.

Per-parameter scalars: an (n, 6) FP32 CPU tensor, one row per parameter, the optimizers'
per-step scalars: ONE_MINUS_BETA1 = 1 − β1, BETA2 = β2, ONE_MINUS_BETA2 = 1 − β2, STEP = −α·√c2/c1, EPS = max(ε·√c2,
tiny), DECAY = −α·λ with c1 = 1 − β1^t, c2 = 1 − β2^t, computed in FP64 and rounded once
(`adamw_scalars` builds it).
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ..scalars import adamw_scalars as _adamw_scalars

__all__ = [
    "ISAS",
    "adamw_scalars",
    "adamw_step",
    "coat_step",
    "collage_step",
    "eightbit_step",
    "fp8_adamw_step",
    "isa",
    "kahan_step",
    "master_step",
    "native_unavailable",
    "sr_step",
]

#: Instruction sets the kernels are built for, widest first.
ISAS: tuple[str, ...] = ("avx512_bf16", "avx512", "avx2", "scalar")
_ISA_CODES = {"scalar": 0, "avx2": 1, "avx512": 2, "avx512_bf16": 3}
ISA_ENV = "HF_LOWPREC_CPU_ISA"

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = ("bindings.cpp", "isa_scalar.cpp", "isa_avx2.cpp", "isa_avx512.cpp", "isa_avx512bf16.cpp")
# -ffp-contract=off: no a·b + c fused into an FMA (the references round the product);
# -fno-fast-math: IEEE semantics; -fno-math-errno only lets sqrtf inline as the instruction;
# -fopenmp: `at::parallel_for` is an inline OpenMP region, serial without it. The library it links
# is the libgomp.so.1 that PyTorch has already loaded (same soname), so the kernels share
# PyTorch's thread pool and `torch.set_num_threads`.
_CFLAGS = ("-O3", "-std=c++17", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno", "-fopenmp")
_LDFLAGS = ("-fopenmp",)

Tensors = Sequence[torch.Tensor]


@functools.cache
def _load() -> tuple[ModuleType | None, str | None]:
    """(extension module, None), or (None, why it cannot be built). Built once per process."""
    if os.name != "posix" or not any(m in (os.uname().machine or "") for m in ("x86_64", "AMD64")):
        return None, f"the native kernels are x86-64 only (this machine: {os.uname().machine})"
    compiler = os.environ.get("CXX", "c++")
    if not shutil.which(compiler) and not shutil.which("g++"):
        return None, f"no C++ compiler on PATH ({compiler!r}, 'g++')"
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return None, "ninja is not installed (torch.utils.cpp_extension needs it: pip install ninja)"
    try:
        module = cpp_extension.load(
            name="hf_lowprec_native_optim",
            sources=[str(_CSRC / s) for s in _SOURCES],
            extra_cflags=list(_CFLAGS),
            extra_ldflags=list(_LDFLAGS),
            extra_include_paths=[str(_CSRC)],
            verbose=False,
        )
    except Exception as error:  # any build failure: report it, never raise from here
        return None, f"building the native optimizer kernels failed ({type(error).__name__}: {error})"
    return module, None


def native_unavailable() -> str | None:
    """Why the native kernels cannot run here (no compiler, build failed, not x86-64), or None.

    The first call builds (or loads the cached build of) the extension.
    """
    return _load()[1]


def _module() -> ModuleType:
    module, reason = _load()
    if module is None:
        raise RuntimeError(f"hf_lowprec native optimizer kernels unavailable: {reason}")
    return module


def isa() -> str:
    """The instruction set the kernels run with: `HF_LOWPREC_CPU_ISA` if set, else the widest one
    this CPU supports ("avx512_bf16", "avx512", "avx2" or "scalar"; each is tested bit for bit)."""
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if forced:
        if forced not in _ISA_CODES:
            raise ValueError(f"{ISA_ENV}={forced!r}: choose one of {', '.join(ISAS)} (or unset it)")
        return forced
    return _module().best_isa()


def _isa_code(isa_name: str | None) -> int:
    name = isa() if isa_name is None else isa_name
    if name not in _ISA_CODES:
        raise ValueError(f"unknown ISA {name!r}; choose one of {', '.join(ISAS)}")
    return _ISA_CODES[name]


def adamw_scalars(
    steps: Sequence[int], *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float
) -> torch.Tensor:
    """The (n, 6) FP32 CPU tensor of per-parameter scalars for steps `steps` (1-based): one row of
    `optim.scalars.adamw_scalars` per step (FP64 on the host, bias corrections folded into STEP and
    EPS), rounded once to FP32."""
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    return torch.tensor([_adamw_scalars(t, **hyper) for t in steps], dtype=torch.float32).reshape(len(steps), 6)


def _flat(tensors: Tensors) -> list[torch.Tensor]:
    return [t.detach().view(-1) if t.is_contiguous() else t.detach() for t in tensors]


def adamw_step(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    scalars: torch.Tensor,
    *,
    found_inf: torch.Tensor | None = None,
    isa: str | None = None,
) -> None:
    """AdamW in place over a bucket: `PlainAdamW` (bf16-pure: BF16 θ and moments; FP32 θ and
    moments: bf16-mixed's masters) and `FP32StatesAdamW` (BF16/FP16 θ, FP32 moments).

    Per element: m₃₂ = m + ONE_MINUS_BETA1·(g − m); v₃₂ = min(v·BETA2 + (ONE_MINUS_BETA2·g)·g,
    max of v's dtype); Δθ = θ·DECAY + (STEP·m₃₂)/(√v₃₂ + EPS); θ ← r(θ + Δθ); m, v rounded once.

    Dtypes: θ FP32, BF16 or FP16; g FP32, BF16 or FP16; m and v one dtype, FP32 (any θ) or BF16
    (BF16 θ). Every tensor contiguous, on CPU, the parameter's size. `isa` overrides `isa()`.
    """
    _module().adamw_step(
        _flat(params), _flat(grads), _flat(exp_avgs), _flat(exp_avg_sqs), scalars, found_inf, _isa_code(isa)
    )


def collage_step(
    params: Tensors,
    param_errors: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    exp_avg_sq_errors: Tensors | None,
    scalars: torch.Tensor,
    *,
    found_inf: torch.Tensor | None = None,
    isa: str | None = None,
) -> None:
    """Collage AdamW in place: light when `exp_avg_sq_errors` is None,
    plus otherwise.

    The AdamW moments (plus: v read as v + δv, then δv ← r(v₃₂ − r(v₃₂))), then
    (θ, δθ) ← Grow((θ, δθ), r(Δθ₃₂)): TwoSum in θ's dtype, δθ + e rounded, Fast2Sum.

    Dtypes: θ and δθ BF16 with moments (and δv) BF16 or FP32, or all FP32; g FP32, BF16 or FP16.
    """
    errors = None if exp_avg_sq_errors is None else _flat(exp_avg_sq_errors)
    flat = (_flat(t) for t in (params, param_errors, grads, exp_avgs, exp_avg_sqs))
    _module().collage_step(*flat, errors, scalars, found_inf, _isa_code(isa))


def _with_rule_tensors(
    kernel: str, params, rule_tensors, grads, exp_avgs, exp_avg_sqs, scalars, found_inf, isa
) -> None:
    """Call `kernel`, whose rule keeps one tensor per parameter (a compensation, a master)."""
    flat = (_flat(t) for t in (params, rule_tensors, grads, exp_avgs, exp_avg_sqs))
    getattr(_module(), kernel)(*flat, scalars, found_inf, _isa_code(isa))


def kahan_step(
    params: Tensors,
    compensations: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    scalars: torch.Tensor,
    *,
    found_inf: torch.Tensor | None = None,
    isa: str | None = None,
) -> None:
    """`KahanAdamW` in place: y = r(Δθ₃₂ + k); (θ, k) ← TwoSum(θ, y).

    Dtypes: θ and k BF16 with moments BF16 or FP32, or FP16 with FP32 moments; g FP32, BF16 or FP16.
    """
    _with_rule_tensors("kahan_step", params, compensations, grads, exp_avgs, exp_avg_sqs, scalars, found_inf, isa)


def sr_step(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    scalars: torch.Tensor,
    seeds: torch.Tensor,
    *,
    found_inf: torch.Tensor | None = None,
    isa: str | None = None,
) -> None:
    """Stochastic-rounding AdamW in place for BF16 θ: θ ← SR(θ + Δθ₃₂) (`StochasticRoundingAdamW`,
    and `FP32StatesSRAdamW` with FP32 moments).

    The random bits of element i of parameter j: two multiply-xorshift rounds over
    (i + seeds[j]·0x9E3779B9) mod 2^32, the top 16 bits (the optimizers' counter-based stream),
    independent of the ISA and the thread count, so the same seeds give the same bits (resume). Values that are not finite
    or beyond BF16's largest finite value are rounded to nearest.

    Dtypes: θ BF16; moments BF16 or FP32; g FP32, BF16 or FP16; `seeds` int64, one per parameter.
    """
    flat = (_flat(t) for t in (params, grads, exp_avgs, exp_avg_sqs))
    _module().sr_step(*flat, scalars, seeds.reshape(-1), found_inf, _isa_code(isa))


def master_step(
    params: Tensors,
    masters: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    scalars: torch.Tensor,
    *,
    found_inf: torch.Tensor | None = None,
    isa: str | None = None,
) -> None:
    """`MasterWeightAdamW` in place: AdamW on the FP32 master θ₃₂ (FP32 moments), then the
    visible weight θ ← r(θ₃₂), one pass.

    Dtypes: θ BF16, FP16 (or FP32); masters and moments FP32; g FP32, BF16 or FP16.
    """
    _with_rule_tensors("master_step", params, masters, grads, exp_avgs, exp_avg_sqs, scalars, found_inf, isa)


def fp8_adamw_step(
    params: Tensors,
    master_scales: Sequence[torch.Tensor | None],
    grads: Tensors,
    grad_scales: Sequence[torch.Tensor | None],
    exp_avgs: Tensors,
    exp_avg_scales: Tensors,
    exp_avg_sqs: Tensors,
    exp_avg_sq_scales: Tensors,
    scalars: torch.Tensor,
    *,
    margin: int = 0,
    found_inf: torch.Tensor | None = None,
    isa: str | None = None,
) -> None:
    """`fp8_adamw.fp8_adamw_param_step` in place over a bucket (the step counts are the caller's).

    Two passes over each tensor, as the compiled path: pass 1 computes the new (θ, m, v) and their
    amax (an integer max of |x|'s bits, NaN above inf, per block then per tensor); the new
    power-of-two scales follow from the amax (`fp8.scaled.pow2_scale`, margin `margin`); pass 2
    recomputes the values and stores them saturated with the new scales, and the scale tensors
    are updated last. Recomputing reads g, m, v, θ again (6 bytes/param for the FP8-LM formats)
    instead of writing and re-reading FP32 m, v, θ (24): bit-identical to the reference. An
    unscaled master (FP32/BF16) needs no amax, so its pass 1 forms only m and v (no root or
    division). Why not one pass: a payload stored with a predicted scale (the previous step's)
    cannot be corrected exactly when the amax crosses a binade (saturated or FP8-subnormal
    codes lost bits) and the old inputs are overwritten by then; an exact one-pass step would
    need double-buffered states (5 more bytes per parameter) — not done here.

    Per element: θ = θ_payload·(1/s_θ) (scaled FP16 master) or θ; g = g_payload/s_g (FP8) or g;
    m₃₂ = m_old + ONE_MINUS_BETA1·(g − m_old), m_old = m_payload·(1/s_m); v₃₂ = (v_payload·(1/s_v))·BETA2 +
    (ONE_MINUS_BETA2·g)·g; u = (STEP·m₃₂)/(√v₃₂ + EPS), u ← u + DECAY·θ when DECAY ≠ 0; θ' = θ + u.

    Dtypes: θ an FP16 payload with its 0-dim FP32 scale in `master_scales`, or FP32/BF16 with None;
    g FP8 (E4M3/E5M2) with its scale in `grad_scales`, or FP32/BF16/FP16 with None; (m, v) E4M3 and
    FP16, or FP32 and FP32 (stored unscaled, scale 1); every scale a 0-dim FP32 CPU tensor.
    """
    flat_scales = [None if s is None else s.detach() for s in master_scales]
    grad_scales = [None if s is None else s.detach() for s in grad_scales]
    m, v = _flat(exp_avgs), _flat(exp_avg_sqs)
    moments = (m, list(exp_avg_scales), v, list(exp_avg_sq_scales))
    _module().fp8_adamw_step(
        _flat(params), flat_scales, _flat(grads), grad_scales, *moments, scalars, margin, found_inf, _isa_code(isa)
    )


def _group_fields(state: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if isinstance(state, (tuple, list)):
        payload, scale, exponent, center = state
    else:  # coat.state.FP8GroupState
        payload, scale, exponent, center = state.payload, state.scale, state.exponent, state.center
    return payload.detach().view(-1), scale.detach(), exponent.detach(), center.detach()


def coat_step(
    params: Tensors,
    param_errors: Tensors | None,
    grads: Tensors,
    exp_avgs: Sequence[Any],
    exp_avg_sqs: Sequence[Any],
    scalars: torch.Tensor,
    *,
    group_size: int = 128,
    expand: bool = True,
    found_inf: torch.Tensor | None = None,
    isa: str | None = None,
) -> None:
    """`COATAdamW`'s step in place, group by group of `group_size`.

    Per group of m and of v: decode x = sign(y)·|y|^(1/k)·c, y = q/s (expand) or x = q/s; the
    AdamW update (FP32, v clamped to FP32's max); θ ← θ + Δθ₃₂ (FP32 θ) or (θ, δθ) ←
    Grow((θ, δθ), r(Δθ₃₂)) (BF16/FP16 θ); then `coat.quantize_state` of the new m and v: amax,
    amin (smallest non-zero), k = max(1, ⌊log2(F²/2)/log2(amax/amin)·16⌋/16) (FP64),
    c = √amax·√amin, |x| ← (|x|/c)^k, s = F/amax, q = cast(clamp(x·s) + (x·s − x·s)).
    A last partial group is padded with zeros, as `quantize_state` pads.

    Numerics: every operation is the reference's (`formats.GroupFP8`, whose powers are
    `numerics.pow_nonnegative`): bit-identical. k itself is FP64 arithmetic on the group's amax
    and amin, as the reference computes it.

    Args:
        param_errors: δθ per BF16/FP16 parameter (its dtype), or None for FP32 parameters.
        exp_avgs, exp_avg_sqs: per parameter an `FP8GroupState` or a tuple (payload, scale,
            exponent, center): payload float8_e4m3fn for m, float8_e4m3fn or float8_e5m2 for v,
            padded to whole groups; FP32 metadata, one value per group; updated in place.
        group_size: a multiple of 16 up to 1024 (COAT: 128).
    Dtypes: θ FP32, BF16 or FP16; g FP32, BF16 or FP16.
    """
    m = [_group_fields(s) for s in exp_avgs]
    v = [_group_fields(s) for s in exp_avg_sqs]
    errors = None if param_errors is None else _flat(param_errors)
    _module().coat_step(
        _flat(params),
        errors,
        _flat(grads),
        *([list(f) for f in zip(*m)] if m else [[]] * 4),
        *([list(f) for f in zip(*v)] if v else [[]] * 4),
        scalars,
        group_size,
        expand,
        found_inf,
        _isa_code(isa),
    )


def eightbit_step(
    params: Tensors,
    param_errors: Tensors,
    grads: Tensors,
    m_codes: Tensors,
    m_absmax: Tensors,
    v_codes: Tensors,
    v_absmax: Tensors,
    scalars: torch.Tensor,
    *,
    block_size: int = 256,
    found_inf: torch.Tensor | None = None,
    isa: str | None = None,
) -> None:
    """`Collage8bitAdamW`'s step in place: blockwise 8-bit m (signed dynamic map) and v
    (unsigned), Collage's Grow on BF16/FP16 θ and δθ, block by block of `block_size`.

    Per block: decode m = map[code]·absmax (and v), the AdamW update (FP32, v clamped to FP32's
    max), (θ, δθ) ← Grow((θ, δθ), r(Δθ₃₂)); then `formats.Blockwise8bit.encode_` of the new m
    and v: a = max|x|, x/(a > 0 ? a : 1) (v clamped at 0), the nearest map value's index (ties
    to the lower: `torch.bucketize` over the midpoints, here through
    `formats.dynamic_map_lookup`), absmax = a. A last partial block runs its padding as the
    reference pads it (θ = g = 0). Bit-identical to the reference.

    Dtypes: θ and δθ BF16 or FP16; g FP32, BF16 or FP16; codes uint8 padded to whole blocks;
    absmax FP32, one per block. `block_size`: a multiple of 16 up to 1024.
    """
    from ...formats import dynamic_map_lookup

    *m_map, m_nan = dynamic_map_lookup(True)
    *v_map, v_nan = dynamic_map_lookup(False)
    _module().eightbit_step(
        _flat(params),
        _flat(param_errors),
        _flat(grads),
        _flat(m_codes),
        [a.detach() for a in m_absmax],
        _flat(v_codes),
        [a.detach() for a in v_absmax],
        scalars,
        block_size,
        m_map,
        m_nan,
        v_map,
        v_nan,
        found_inf,
        _isa_code(isa),
    )
