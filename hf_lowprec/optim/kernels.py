"""Fused optimizer steps: each update rule written once as a pure function, compiled.

Every kernel here is a pure function of the tensors of ONE parameter (flattened to 1-D) and a
small FP32 vector of per-step scalars. `torch.compile` turns it into one loop that reads each
stored tensor once and writes it once: vectorised C++/OpenMP on CPU, Triton on CUDA, from this
same source. The `torch._foreach_*` implementations in `collage.py`, `bf16.py` and
`fp8_adamw.py` stay the reference, and the fallback where compiling is not possible.

Arithmetic. The kernels reproduce the reference's sequence (spelled out in
`collage.collage_adamw`): moments and Δθ in FP32 registers, each stored value rounded once,
and the error-free transformations (TwoSum, Fast2Sum) in storage-dtype arithmetic, each
operation rounded (`_round`). Two things make that exact under Inductor: the explicit casts are
kept (`emulate_precision_casts`; otherwise a cast to BF16 and back is dropped), and products and
sums are not fused or reassociated (its C++ is built with -ffp-contract=off, no unsafe-math).
The reference avoids the eager ops that fuse a multiply-add on CPU (`lerp`, `addcmul`): with
them, the kernel needed an exact FMA emulation (Dekker's product and TwoSum, ~25 FP32
operations per multiply-add), which halved its speed. So on CPU the compiled step is
bit-identical to the reference. On CUDA, Triton may contract a·b + c into an FMA where eager
CUDA does not: the results then agree within one rounding of each FP32 intermediate (bounds in
the tests).

Threads: Inductor decides whether a loop runs in an OpenMP parallel region from the size hint
of the first call, and with dynamic shapes that graph then serves every later size; a first
call on a small tensor (a bias) would leave the kernel single-threaded for the whole model.
`cpp.dynamic_threads` always opens the parallel region and lets the OpenMP runtime size it.

Layout: per tensor, dynamic shapes. Each parameter is passed as a flat 1-D view, so one
compiled graph (one symbolic length) serves every tensor of every model; no flat buffer.
Measured with `bench/bench_optim.py --layout` (compiled Collage-plus over the 148 tensors of
GPT-2 124M, 2 threads, on a 2-core machine shared with other jobs, load average ~19): 8.4 s
per step per tensor against 6.5 s for one call on a flat buffer of the same size (1.30×). The
gap is a fixed cost per call (Python dispatch and guards, and an OpenMP parallel region whose
threads must be woken on a busy machine), not bandwidth, so it shrinks with tensor size and
load. We still keep the per-tensor layout: a flat buffer needs every parameter and gradient to
be a view of one storage per dtype (DeepSpeed and apex build their own to get that), which
breaks for parameters another framework owns or re-allocates (PEFT adapters, FSDP/ZeRO
partitions, tied weights, autograd allocating `.grad` afresh after `zero_grad(set_to_none)`),
and the optimizer would have to own the model's memory layout. Revisit if the per-call cost
shows up on an idle machine.

Dispatch (`_runnable`): "foreach" always takes the reference; "compiled" requires the
compiled kernel and raises if it cannot be built; "auto" uses it on CPU (with a C++ compiler)
and CUDA (with Triton) and falls back to the reference, logging the reason once, when the
device is unsupported, no compiler is found or compilation fails.

Compile cost: one graph per (kernel, dtypes, device), paid once per process and cached on
disk by Inductor (`TORCHINDUCTOR_CACHE_DIR`; `make` and the tests put it under build/).
"""

from __future__ import annotations

import functools
import logging
import math
import shutil
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

__all__ = [
    "COMPILE_OPTIONS",
    "FUSED_MODES",
    "PARALLEL_MIN_NUMEL",
    "FusedMode",
    "adamw_kernel",
    "check_fused_mode",
    "collage_kernel",
    "compiled_adamw",
    "compiled_coat_adamw",
    "compiled_collage_adamw",
    "compiled_fp8_adamw_step",
    "compiled_kahan_adamw",
    "compiled_stochastic_rounding_adamw",
    "fp8_adamw_scale_kernel",
    "fp8_adamw_store_kernel",
    "kahan_kernel",
    "stochastic_rounding_kernel",
]

logger = logging.getLogger(__name__)

FusedMode = Literal["auto", "compiled", "foreach"]
FUSED_MODES: tuple[str, ...] = ("auto", "compiled", "foreach")

Tensors = list[torch.Tensor]

# Slots of the per-step scalar vector every AdamW kernel reads.
_W1, _B2, _OMB2, _STEP, _EPS, _DECAY = range(6)


def check_fused_mode(owner: str, fused: str) -> str:
    """Return `fused` if it is a valid mode, else raise naming the valid ones."""
    if fused not in FUSED_MODES:
        raise ValueError(
            f"{owner}: unknown fused={fused!r}; choose 'auto' (compiled kernel where possible), "
            f"'compiled' (require it) or 'foreach' (the reference path)"
        )
    return fused


# --- the kernels: pure functions of one flat parameter -----------------------------------


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to `dtype` (to nearest even) and widened back to FP32 for further arithmetic."""
    return x.to(dtype).to(torch.float32)


def _adamw_registers(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    exp_avg_sq_error: torch.Tensor | None,
    h: torch.Tensor,
) -> torch.Tensor:
    """Store the new moments and return Δθ₃₂: `collage.adamw_moments_` + `adamw_delta`, fused.

    m₃₂ = m + (1 − β1)·(g − m); v₃₂ = min(β2·(v [+ δv]) + ((1 − β2)·g)·g, max_v);
    Δθ₃₂ = fl(−α·λ·θ) + (s·m₃₂)/(√v₃₂ + ε'), all FP32; m, v (and δv = r(v₃₂ − r(v₃₂)))
    stored rounded once in their own dtype.
    """
    v_old = exp_avg_sq.float()
    if exp_avg_sq_error is not None:
        v_old = v_old + exp_avg_sq_error.float()
    m, v, delta = _adamw_math(param.float(), grad.float(), exp_avg.float(), v_old, h, torch.finfo(exp_avg_sq.dtype).max)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if exp_avg_sq_error is not None:
        exp_avg_sq_error.copy_(v - _round(v, exp_avg_sq.dtype))
    return delta


def _adamw_math(
    theta: torch.Tensor, g: torch.Tensor, m_old: torch.Tensor, v_old: torch.Tensor, h: torch.Tensor, max_v: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m₃₂, v₃₂, Δθ₃₂) from FP32 values: the arithmetic of `_adamw_registers`, no loads or stores."""
    m = m_old + h[_W1] * (g - m_old)
    v = v_old * h[_B2] + h[_OMB2] * g * g
    v = torch.clamp(v, max=max_v)
    denominator = torch.sqrt(v) + h[_EPS]
    return m, v, theta * h[_DECAY] + h[_STEP] * m / denominator


def _two_sum(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """TwoSum in `dtype` arithmetic on FP32 registers, the values of `numerics.foreach_two_sum_`.

    s = fl(a + b); bb = fl(s − a); e = (b − bb) + (a − (s − bb)). Only the first two operations
    can round: the last four are exact in round-to-nearest (Knuth's proof of TwoSum, TAOCP vol. 2
    §4.2.2 Thm B), so their `_round` would be the identity and is left out. Rounding costs
    a conversion each way; that is what bounds this kernel's speed on CPU.
    """
    s = _round(a + b, dtype)
    bb = _round(s - a, dtype)
    return s, (b - bb) + (a - (s - bb))


def _fast_two_sum(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Fast2Sum in `dtype` arithmetic (`numerics.foreach_fast_two_sum_`); needs |a| ≥ |b| or a = 0.

    s = fl(a + b); e = b + (a − s), both of the last two operations exact (Dekker).
    """
    s = _round(a + b, dtype)
    return s, b + (a - s)


def collage_kernel(
    param: torch.Tensor,
    param_error: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    exp_avg_sq_error: torch.Tensor | None,
    h: torch.Tensor,
) -> None:
    """One Collage AdamW step (ALGORITHMS.md §2) on one parameter, in place.

    light when `exp_avg_sq_error` is None, plus otherwise: the sequence spelled out in
    `collage.collage_adamw`, then (θ, δθ) ← Grow((θ, δθ), r(Δθ₃₂)) = TwoSum, add, Fast2Sum.
    """
    _grow_(param, param_error, _adamw_registers(param, grad, exp_avg, exp_avg_sq, exp_avg_sq_error, h))


def _grow_(param: torch.Tensor, param_error: torch.Tensor, delta32: torch.Tensor) -> None:
    """(θ, δθ) ← Grow((θ, δθ), r(Δθ₃₂)) in the parameter's dtype: TwoSum, add, Fast2Sum
    (`numerics.foreach_grow_`)."""
    dtype = param.dtype
    s, e = _two_sum(param.float(), _round(delta32, dtype), dtype)
    theta, error = _fast_two_sum(s, _round(param_error.float() + e, dtype), dtype)
    param.copy_(theta)
    param_error.copy_(error)


def adamw_kernel(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, h: torch.Tensor) -> None:
    """`bf16.PlainAdamW` (moments in the parameter's dtype) and `bf16.FP32StatesAdamW` (FP32
    moments): θ ← r(θ + Δθ₃₂), rounded once."""
    param.copy_(param.float() + _adamw_registers(param, grad, exp_avg, exp_avg_sq, None, h))


def kahan_kernel(
    param: torch.Tensor, compensation: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, h: torch.Tensor
) -> None:
    """One `bf16.KahanAdamW` step: y = r(Δθ₃₂ + k), then (θ, k) ← TwoSum(θ, y)."""
    dtype = param.dtype
    y = _round(compensation.float() + _adamw_registers(param, grad, exp_avg, exp_avg_sq, None, h), dtype)
    theta, new_compensation = _two_sum(param.float(), y, dtype)
    param.copy_(theta)
    compensation.copy_(new_compensation)


def _uniform_bits16(numel: int, seed: torch.Tensor, device: torch.device) -> torch.Tensor:
    """16 uniform random bits per element from a counter-based hash of (seed, index).

    Two rounds of multiply-xorshift over index + seed·golden-ratio, kept to 32 bits in int64
    arithmetic with every product below 2^63: no generator state and no buffer, so the
    compiled loop makes its random bits in registers.
    """
    mask = 0xFFFFFFFF
    x = (torch.arange(numel, device=device, dtype=torch.int64) + seed * 0x9E3779B9) & mask
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & mask
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & mask
    x = x ^ (x >> 16)
    return (x >> 16).to(torch.int32)


def stochastic_rounding_kernel(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, h: torch.Tensor, seed: torch.Tensor
) -> None:
    """One `bf16.StochasticRoundingAdamW` step for a BF16 parameter: θ ← SR(θ + Δθ₃₂).

    Adding 16 uniform bits below BF16's significand and truncating rounds up with probability
    (x − ⌊x⌋)/ulp, as `numerics.stochastic_round`; the bits come from `_uniform_bits16`, a
    different stream from the reference's generator (same distribution).
    """
    target = _adamw_registers(param, grad, exp_avg, exp_avg_sq, None, h) + param.float()
    bits = target.view(torch.int32) + _uniform_bits16(param.numel(), seed, param.device)
    rounded = (bits & -65536).view(torch.float32)
    plain = ~torch.isfinite(target) | (target.abs() > torch.finfo(param.dtype).max)
    param.copy_(torch.where(plain, target, rounded))


def _decode_groups(
    payload: torch.Tensor, scale: torch.Tensor, exponent: torch.Tensor, center: torch.Tensor, expand: bool
) -> torch.Tensor:
    """`coat.FP8GroupState.dequantize` of a (groups × G) payload: y = q/s, then sign(y)·|y|^(1/k)·c."""
    y = payload.float() / scale[:, None]
    if expand:
        y = (y.abs().pow(exponent.reciprocal()[:, None]) * center[:, None]).copysign(y)
    return y


def _encode_groups_(
    grouped: torch.Tensor, payload: torch.Tensor, scale: torch.Tensor, exponent: torch.Tensor, center: torch.Tensor,
    expand: bool,
) -> None:  # fmt: skip
    """`coat.quantize_state` of FP32 (groups × G) values into the stored payload and (s, k, c), in place."""
    from hf_lowprec.coat.state import expansion_exponent
    from hf_lowprec.fp8.scaled import format_max

    magnitude = grouped.abs()
    amax = magnitude.amax(dim=1)
    ones = torch.ones_like(amax)
    k, c = ones, ones
    if expand:
        amin = torch.where(magnitude > 0, magnitude, math.inf).amin(dim=1)
        k = expansion_exponent(amax, amin, payload.dtype)
        c = torch.where((amax > 0) & (k > 1), amax.sqrt() * amin.sqrt(), ones)
        magnitude = (magnitude / c[:, None]).pow(k[:, None])
        grouped = magnitude.copysign(grouped)
        amax = magnitude.amax(dim=1)
    limit = format_max(payload.dtype)
    s = torch.where(amax > 0, limit / amax, ones)
    s = torch.where(torch.isfinite(amax), s, math.nan)
    y = grouped * s[:, None]
    payload.copy_(y.clamp(-limit, limit) + (y - y))
    scale.copy_(s)
    exponent.copy_(k)
    center.copy_(c)


def _coat_kernel(
    param: torch.Tensor,
    param_error: torch.Tensor | None,
    grad: torch.Tensor,
    m_payload: torch.Tensor, m_scale: torch.Tensor, m_exponent: torch.Tensor, m_center: torch.Tensor,
    v_payload: torch.Tensor, v_scale: torch.Tensor, v_exponent: torch.Tensor, v_center: torch.Tensor,
    h: torch.Tensor,
    expand: bool,
) -> None:  # fmt: skip
    """One `COATAdamW` step on one parameter, in place: decode m and v (per-group FP8 with
    dynamic range expansion), the FP32 AdamW update, θ ← θ + Δθ₃₂ (FP32 masters) or Grow
    (BF16/FP16 + δθ), and m, v encoded again with fresh per-group (s, k, c).

    Every tensor comes as (groups × G), the group size a static dimension (so the group loops
    are vectorised), the number of groups dynamic; the per-group metadata as (groups,).
    """
    m_old = _decode_groups(m_payload, m_scale, m_exponent, m_center, expand)
    v_old = _decode_groups(v_payload, v_scale, v_exponent, v_center, expand)
    m, v, delta = _adamw_math(param.float(), grad.float(), m_old, v_old, h, torch.finfo(torch.float32).max)
    if param_error is None:
        param.copy_(param.float() + delta)
    else:
        _grow_(param, param_error, delta)
    _encode_groups_(m, m_payload, m_scale, m_exponent, m_center, expand)
    _encode_groups_(v, v_payload, v_scale, v_exponent, v_center, expand)


# FP8AdamW (FP8-LM / MS-AMP O2): slots of its scalar vector, as `fp8_adamw.adamw_update` uses them.
_F_W1, _F_B2, _F_OMB2, _F_STEP, _F_EPS, _F_LR_WD = range(6)


def _fp8_adamw_registers(
    param: torch.Tensor,
    master_scale: torch.Tensor | None,
    grad: torch.Tensor,
    grad_scale: torch.Tensor | None,
    exp_avg: torch.Tensor,
    exp_avg_scale: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    exp_avg_sq_scale: torch.Tensor,
    h: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(θ', m, v) in FP32 real units: dequantize, then `fp8_adamw.adamw_update`.

    The stored moments and the master carry power-of-two scales (`pow2_scale`, exponent within
    ±126), so payload·(1/s) equals the reference's payload/s exactly and costs a multiply per
    element instead of a division. The gradient's scale may carry a clipping factor that is
    not a power of two: it stays a division.
    """
    real = param.float() if master_scale is None else param.float() * (1.0 / master_scale)
    g = grad.float() if grad_scale is None else grad.float() / grad_scale
    m_old = exp_avg.float() * (1.0 / exp_avg_scale)
    m = m_old + h[_F_W1] * (g - m_old)
    v = exp_avg_sq.float() * (1.0 / exp_avg_sq_scale) * h[_F_B2] + h[_F_OMB2] * g * g
    update = h[_F_STEP] * m / (torch.sqrt(v) + h[_F_EPS])
    update = torch.where(h[_F_LR_WD] != 0, update - h[_F_LR_WD] * real, update)
    return real + update, m, v


def fp8_adamw_scale_kernel(
    param: torch.Tensor,
    master_scale: torch.Tensor | None,
    grad: torch.Tensor,
    grad_scale: torch.Tensor | None,
    exp_avg: torch.Tensor,
    exp_avg_scale: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    exp_avg_sq_scale: torch.Tensor,
    h: torch.Tensor,
    margin: int,
) -> torch.Tensor:
    """First pass of the FP8AdamW step: the new scales of m, v and θ, from their amax.

    Recomputing the update in the second pass reads g, m, v, θ again (6 bytes/param) instead of
    writing and re-reading FP32 m, v, θ (24): the scales need the whole tensor's amax first.
    The scales are computed here, once, after the reduction: inside the second pass's loop
    Inductor would evaluate `pow2_scale` (frexp, exp2) for every element.
    """
    new, m, v = _fp8_adamw_registers(param, master_scale, grad, grad_scale, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale, h)
    return torch.stack([_new_scale(exp_avg.dtype, m, margin), _new_scale(exp_avg_sq.dtype, v, margin),
                        _new_scale(param.dtype, new, margin)])  # fmt: skip


def _new_scale(dtype: torch.dtype, real: torch.Tensor, margin: int) -> torch.Tensor:
    """`fp8_adamw._requantize_`'s scale: the power-of-two scale of amax(real); FP32 storage is
    kept unscaled (s = 1)."""
    from hf_lowprec.fp8.scaled import pow2_scale

    if dtype == torch.float32:
        return torch.ones((), dtype=torch.float32, device=real.device)
    return pow2_scale(real.abs().amax(), dtype, margin)


def _store_scaled_(payload: torch.Tensor, scale: torch.Tensor | None, real: torch.Tensor, new_scale: torch.Tensor) -> None:
    """`fp8_adamw._requantize_` with the scale already chosen: payload = saturate(real·s)."""
    from hf_lowprec.fp8.scaled import format_max

    if payload.dtype == torch.float32:
        payload.copy_(real)
    else:
        limit = format_max(payload.dtype)
        scaled = real * new_scale
        payload.copy_(scaled.clamp(-limit, limit) + (scaled - scaled))
    if scale is not None:
        scale.copy_(new_scale)


def fp8_adamw_store_kernel(
    param: torch.Tensor,
    master_scale: torch.Tensor | None,
    grad: torch.Tensor,
    grad_scale: torch.Tensor | None,
    exp_avg: torch.Tensor,
    exp_avg_scale: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    exp_avg_sq_scale: torch.Tensor,
    h: torch.Tensor,
    new_scales: torch.Tensor,
) -> None:
    """Second pass: recompute the update and store m, v and θ with their new scales, in place."""
    new, m, v = _fp8_adamw_registers(param, master_scale, grad, grad_scale, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale, h)
    _store_scaled_(exp_avg, exp_avg_scale, m, new_scales[0])
    _store_scaled_(exp_avg_sq, exp_avg_sq_scale, v, new_scales[1])
    if master_scale is None:
        param.copy_(new)
    else:
        _store_scaled_(param, master_scale, new, new_scales[2])


# --- compilation and dispatch ------------------------------------------------------------


# emulate_precision_casts: see "Arithmetic", cpp.dynamic_threads: see "Threads" above.
COMPILE_OPTIONS = {"emulate_precision_casts": True, "cpp.dynamic_threads": True}
# Tensors below this many elements run a single-threaded build of the kernel (no OpenMP
# region to open and join), the grain below which ATen's own loops stay on one thread.
PARALLEL_MIN_NUMEL = 32768


@functools.cache
def _compiled(kernel: Callable[..., None], parallel: bool = True) -> Callable[..., None]:
    # Module-level cache: one compiled callable per kernel (and threading) for the whole
    # process, so tests and optimizers share graphs (dynamo then recompiles only for new dtypes
    # or devices).
    options = COMPILE_OPTIONS if parallel else {**COMPILE_OPTIONS, "cpp.dynamic_threads": False, "cpp.threads": 1}
    return torch.compile(kernel, dynamic=True, fullgraph=True, options=options)


def _kernel_for(kernel: Callable[..., None], numel: int) -> Callable[..., None]:
    return _compiled(kernel, numel >= PARALLEL_MIN_NUMEL)


def _recompile_budget() -> Any:
    """Dynamo's recompile limit raised around our kernels' calls (entered once per step).

    One graph per combination of parameter, state and gradient dtypes: a process that trains
    several strategies (or FP8AdamW's five state formats) needs more than dynamo's default of 8
    before it would give up on the kernel. Entering the patch costs ~20 µs, so it wraps a
    whole step's calls, not each tensor's.
    """
    return torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT)


_RECOMPILE_LIMIT = 64


_logged: set[str] = set()
_broken: set[tuple[str, str]] = set()


def _log_once(level: int, message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.log(level, message)


@functools.cache
def _compiler_missing(device_type: str) -> str | None:
    """Why the compiled path cannot run on `device_type`, or None if it can."""
    if device_type == "cpu":
        from torch._inductor import config

        compiler = config.cpp.cxx[1] if isinstance(config.cpp.cxx, tuple) and config.cpp.cxx[1] else "g++"
        if not any(shutil.which(c) for c in (compiler, "g++", "c++", "clang++")):
            return "no C++ compiler on PATH"
        return None
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton is not installed"
    return f"device type {device_type!r} has no Inductor backend here"


def _runnable(kernel: Callable[..., None], fused: str, device: torch.device) -> bool:
    """Whether to run `kernel` compiled on `device` under mode `fused` (logs the choice once)."""
    if fused == "foreach":
        return False
    reason = _compiler_missing(device.type)
    if reason is None and (kernel.__name__, device.type) in _broken:
        reason = "compiling it failed earlier in this process"
    if reason is None:
        _log_once(logging.INFO, f"optimizer step: compiled {kernel.__name__} on {device.type}")
        return True
    if fused == "compiled":
        raise RuntimeError(f"fused='compiled' but {reason}; use fused='auto' or 'foreach'")
    _log_once(logging.WARNING, f"optimizer step: {reason}; using the foreach reference instead of {kernel.__name__}")
    return False


def _run(kernel: Callable[..., None], fused: str, *args: torch.Tensor | None) -> bool:
    """Run the compiled kernel; in "auto" mode a compile failure marks it broken and returns False.

    Inductor compiles the whole graph before running it, so a failure leaves the tensors untouched.
    """
    try:
        _kernel_for(kernel, args[0].numel())(*args)
        return True
    except Exception as error:  # any backend failure: fall back, never lose the step
        if fused == "compiled":
            raise
        device = next(a for a in args if a is not None).device
        _broken.add((kernel.__name__, device.type))
        _log_once(logging.WARNING, f"compiling {kernel.__name__} failed ({type(error).__name__}: {error}); using foreach")
        return False


def _each(kernel: Callable[..., None], fused: str, rows: Sequence[Sequence[torch.Tensor | None]]) -> bool:
    """Run `kernel` on each row of per-parameter arguments; False if the caller must fall back.

    Non-contiguous tensors (rare for parameters) go to the reference, which handles any layout.
    """
    if not rows or not _runnable(kernel, fused, rows[0][0].device):
        return False
    if not all(t is None or t.is_contiguous() for row in rows for t in row):
        return False
    with _recompile_budget():
        for index, row in enumerate(rows):
            if not _run(kernel, fused, *(None if t is None else t.detach().view(-1) for t in row)):
                # The first call compiles (a small tensor's single-threaded build may compile
                # later in the step: the same graph, so it does not fail where the other passed).
                if index:
                    raise RuntimeError(f"{kernel.__name__}: compiled step failed after {index} parameters")
                return False
    return True


def _adamw_scalars(
    steps: Sequence[int], device: torch.device, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float
) -> list[torch.Tensor]:
    """One FP32 vector of per-step scalars per parameter (shared between equal steps).

    Computed in FP64 on the host as `collage.adamw_delta` does (bias corrections folded into
    the step size and ε), then rounded once to FP32, as eager ops round a Python scalar.
    """
    tiny = torch.finfo(torch.float32).smallest_normal
    by_step: dict[int, torch.Tensor] = {}
    for t in set(steps):
        sqrt_c2 = math.sqrt(1.0 - beta2**t)
        values = [0.0] * 6
        values[_W1], values[_B2], values[_OMB2] = 1.0 - beta1, beta2, 1.0 - beta2
        values[_STEP] = -lr * sqrt_c2 / (1.0 - beta1**t)
        values[_EPS] = max(eps * sqrt_c2, tiny)
        values[_DECAY] = -lr * weight_decay
        by_step[t] = torch.tensor(values, dtype=torch.float32, device=device)
    return [by_step[t] for t in steps]


def _bf16_or_fp32(*tensors: torch.Tensor) -> bool:
    # FP16 second moments carry a per-tensor scale re-chosen from their amax after each update
    # (`collage.adamw_moments_`), a reduction before the store: those stay on the reference.
    return all(t.dtype in (torch.bfloat16, torch.float32) for t in tensors)


def compiled_collage_adamw(
    params: Tensors, grads: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors, param_errors: Tensors,
    exp_avg_sq_errors: Tensors | None, steps: Sequence[int], *, lr: float, beta1: float, beta2: float,
    eps: float, weight_decay: float, fused: str,
) -> bool:
    """`collage.collage_adamw` through `collage_kernel`; False if the reference must run instead."""
    if not _bf16_or_fp32(params[0], exp_avg_sqs[0]):
        return False
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    scalars = _adamw_scalars(steps, params[0].device, **hyper)
    errors = exp_avg_sq_errors or [None] * len(params)
    return _each(collage_kernel, fused, list(zip(params, param_errors, grads, exp_avgs, exp_avg_sqs, errors, scalars)))


def compiled_adamw(
    params: Tensors, grads: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors, steps: Sequence[int], *,
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, fused: str,
) -> bool:
    """`PlainAdamW` (moments in the parameter's dtype) or `FP32StatesAdamW` (FP32 moments) compiled."""
    if not _bf16_or_fp32(params[0], exp_avg_sqs[0]):
        return False
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    scalars = _adamw_scalars(steps, params[0].device, **hyper)
    return _each(adamw_kernel, fused, list(zip(params, grads, exp_avgs, exp_avg_sqs, scalars)))


def compiled_kahan_adamw(
    params: Tensors, compensations: Tensors, grads: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors,
    steps: Sequence[int], *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, fused: str,
) -> bool:
    """`KahanAdamW`'s step through `kahan_kernel`."""
    if not _bf16_or_fp32(params[0], exp_avg_sqs[0]):
        return False
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    scalars = _adamw_scalars(steps, params[0].device, **hyper)
    return _each(kahan_kernel, fused, list(zip(params, compensations, grads, exp_avgs, exp_avg_sqs, scalars)))


def compiled_stochastic_rounding_adamw(
    params: Tensors, grads: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors, steps: Sequence[int],
    generator: torch.Generator, *, lr: float, beta1: float, beta2: float, eps: float,
    weight_decay: float, fused: str,
) -> bool:
    """`StochasticRoundingAdamW`'s step for BF16 parameters.

    One 31-bit seed per parameter is drawn from `generator`, so the optimizer's checkpointed
    generator state still determines the rest of the run. FP16 parameters return False (the
    reference's two-neighbour rounding is not compiled).
    """
    if params[0].dtype != torch.bfloat16 or exp_avg_sqs[0].dtype != torch.bfloat16:
        return False
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    scalars = _adamw_scalars(steps, params[0].device, **hyper)
    seeds = torch.randint(0, 2**31 - 1, (len(params), 1), generator=generator, device=generator.device)
    seeds = seeds.to(params[0].device)
    rows = [(*row, seed) for row, seed in zip(zip(params, grads, exp_avgs, exp_avg_sqs, scalars), seeds)]
    return _each(stochastic_rounding_kernel, fused, rows)


@functools.cache
def _coat_step(expand: bool) -> Callable[..., None]:
    """`_coat_kernel` with the expansion switch fixed (a constant in the graph)."""

    def coat_kernel(*tensors: torch.Tensor | None) -> None:
        _coat_kernel(*tensors, expand)

    return coat_kernel


def compiled_coat_adamw(
    params: Tensors, grads: Tensors, param_errors: Sequence[torch.Tensor | None], states: Sequence[dict[str, Any]],
    steps: Sequence[int], *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
    group_size: int, expand: bool, fused: str,
) -> bool:  # fmt: skip
    """`COATAdamW`'s step through `_coat_kernel` for parameters of whole groups (`COATAdamW`
    sends a padded one to the reference); False if the reference must run instead."""
    kernel = _coat_step(expand)
    if not params or not _runnable(kernel, fused, params[0].device):
        return False
    moments = [
        [s[f"{key}{field}"] for key in ("exp_avg", "exp_avg_sq") for field in ("", "_scale", "_exponent", "_center")]
        for s in states
    ]
    rows = list(zip(params, param_errors, grads, moments))
    if any(p.numel() % group_size for p in params):
        raise ValueError(f"compiled_coat_adamw: every parameter must hold whole groups of {group_size}")
    if not all(t is None or t.is_contiguous() for p, e, g, m in rows for t in (p, e, g, *m)):
        return False
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    scalars = _adamw_scalars(steps, params[0].device, **hyper)

    def grouped(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        view = t.detach().view(-1, group_size)
        torch._dynamo.mark_static(view, 1)  # the group loop: a constant length, vectorised
        return view

    with _recompile_budget():
        for index, ((param, error, grad, moment), h) in enumerate(zip(rows, scalars)):
            m_payload, m_scale, m_exponent, m_center, v_payload, v_scale, v_exponent, v_center = moment
            args = (
                grouped(param), grouped(error), grouped(grad),
                grouped(m_payload), m_scale, m_exponent, m_center, grouped(v_payload), v_scale, v_exponent, v_center, h,
            )  # fmt: skip
            if not _run(kernel, fused, *args):
                if index:
                    raise RuntimeError(f"coat_kernel: compiled step failed after {index} parameters")
                return False
    return True


def compiled_fp8_adamw_step(
    param: torch.Tensor,
    master_scale: torch.Tensor | None,
    grad: torch.Tensor,
    grad_scale: torch.Tensor | None,
    state: dict,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    margin: int,
    fused: str,
) -> bool:
    """`fp8_adamw.fp8_adamw_param_step` in two compiled passes (amax, then update and store).

    Args:
        master_scale: the scale of a scaled FP16 master (`get_master_scale`), else None.
        grad: the FP8 gradient payload with `grad_scale`, or a plain gradient with None.
        state: the parameter's FP8AdamW state; "step" is incremented only if the step ran here.

    Returns False (nothing changed) when the reference must run instead.
    """
    tensors = (param, master_scale, grad, grad_scale, state["exp_avg"], state["exp_avg_scale"],
               state["exp_avg_sq"], state["exp_avg_sq_scale"])
    if param.numel() == 0 or not _runnable(fp8_adamw_store_kernel, fused, param.device):
        return False
    if not all(t is None or t.is_contiguous() for t in tensors):
        return False
    t = state["step"] + 1
    sqrt_c2 = math.sqrt(1.0 - beta2**t)
    tiny = torch.finfo(torch.float32).smallest_normal
    h = torch.tensor(
        [1.0 - beta1, beta2, 1.0 - beta2, -lr * sqrt_c2 / (1.0 - beta1**t), max(eps * sqrt_c2, tiny), lr * weight_decay],
        dtype=torch.float32, device=param.device,
    )  # fmt: skip
    flat = [None if x is None else (x.detach().view(-1) if x.dim() else x.detach()) for x in tensors]
    try:
        with _recompile_budget():
            new_scales = _kernel_for(fp8_adamw_scale_kernel, param.numel())(*flat, h, margin)
            _kernel_for(fp8_adamw_store_kernel, param.numel())(*flat, h, new_scales)
    except Exception as error:  # the first pass has not written anything yet
        if fused == "compiled":
            raise
        _broken.add((fp8_adamw_store_kernel.__name__, param.device.type))
        _log_once(logging.WARNING, f"compiling the FP8AdamW step failed ({type(error).__name__}: {error}); using foreach")
        return False
    state["step"] = t
    return True
