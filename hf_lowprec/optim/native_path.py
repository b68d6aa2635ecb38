"""The native CPU path of the dispatch: which compositions `optim.native` runs, and the call.

`optim.native` has one hand-written SIMD kernel per family (C++, AVX-512/AVX2/scalar, built on
first use). This module maps a `Composition` and its dtypes to that kernel, or says why it
cannot run it (`unsupported`), so `fastpath` can fall back to the compiled step. The kernels
follow the reference's operation sequence: bit-identical for every family (COAT's range
expansion included: its powers are `numerics.pow_nonnegative` on every path).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..formats import Blockwise8bit, GroupFP8, Pair, Plain, Scaled
from . import native
from .rules import Grow, Kahan, Master, Nearest, ScaledMaster, StochasticRounding

__all__ = ["native_call", "unsupported"]

F32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16
_E4M3 = torch.float8_e4m3fn


def _plain_moments(composition, m: torch.Tensor, v: torch.Tensor) -> bool:
    return isinstance(composition.m, Plain) and isinstance(composition.v, Plain) and m.dtype == v.dtype


def unsupported(composition, sample) -> str | None:
    """Why the native kernels cannot run `composition` on a row like `sample` (a `ParamStep`), or None."""
    reason = native.native_unavailable()
    if reason is not None:
        return reason
    param, grad, grad_scale, *stored = sample.tensors
    if grad_scale is None and grad.dtype not in (F32, BF16, FP16):
        return f"{grad.dtype} gradients"
    if param.device.type != "cpu":
        return f"the native kernels are for CPU tensors, got {param.device.type}"
    rule, m_format, v_format = composition.rule, composition.m, composition.v
    if grad_scale is not None and not isinstance(rule, (ScaledMaster, Nearest)):
        return "FP8 gradients go through FP8AdamW's kernel only"
    named = dict(zip(composition.stored_names(), stored, strict=True))
    m, v = named["exp_avg"], named["exp_avg_sq"]
    if isinstance(m_format, Blockwise8bit) and isinstance(v_format, Blockwise8bit) and isinstance(rule, Grow):
        if not (m_format.signed and not v_format.signed and m_format.block_size == v_format.block_size):
            return "8-bit states other than (signed m, unsigned v) in blocks of one size"
        if m_format.block_size % 16 or m_format.block_size > 1024:
            return "8-bit block size not a multiple of 16 up to 1024"
        return None if param.dtype in (BF16, FP16) else f"Collage-8bit's kernel takes BF16/FP16 θ, got {param.dtype}"
    if isinstance(m_format, GroupFP8) and isinstance(v_format, GroupFP8) and isinstance(rule, (Grow, Nearest)):
        if m_format.group_size != v_format.group_size or m_format.expand != v_format.expand:
            return "m and v with different group layouts"
        return (
            None
            if m_format.group_size % 16 == 0 and m_format.group_size <= 1024
            else "group size not a multiple of 16 up to 1024"
        )
    if isinstance(m_format, Scaled) and isinstance(v_format, Scaled) and isinstance(rule, (ScaledMaster, Nearest)):
        if (m.dtype, v.dtype) not in ((_E4M3, FP16), (F32, F32)):
            return f"FP8AdamW's kernel stores (E4M3, FP16) or (FP32, FP32) moments, got ({m.dtype}, {v.dtype})"
        if isinstance(rule, Nearest) and param.dtype not in (F32, BF16):
            return f"FP8AdamW's kernel takes a scaled FP16 master or an FP32/BF16 one, got plain {param.dtype}"
        return None
    plus = isinstance(v_format, Pair) and isinstance(v_format.base, Plain)
    if isinstance(rule, Grow) and isinstance(m_format, Plain) and (isinstance(v_format, Plain) or plus):
        usable = m.dtype == v.dtype and (
            (param.dtype == BF16 and m.dtype in (BF16, F32)) or param.dtype == m.dtype == F32
        )
        return None if usable else f"Collage's kernel: {param.dtype} θ with {m.dtype} moments"
    if not _plain_moments(composition, m, v):
        return f"no native kernel for {type(m_format).__name__} m / {type(v_format).__name__} v"
    if isinstance(rule, Nearest):
        return (
            None
            if m.dtype == F32 or (m.dtype == BF16 and param.dtype == BF16)
            else f"{m.dtype} moments, {param.dtype} θ"
        )
    if isinstance(rule, Kahan):
        return None if param.dtype == BF16 or (param.dtype == FP16 and m.dtype == F32) else f"Kahan: {param.dtype} θ"
    if isinstance(rule, StochasticRounding):
        return None if param.dtype == BF16 else f"stochastic rounding into {param.dtype} (BF16 only)"
    if isinstance(rule, Master):
        return None if m.dtype == F32 else "master weights need FP32 moments"
    return f"no native kernel for the {type(rule).__name__} rule"


def native_call(composition, rows: Sequence) -> Callable[[], None]:
    """The native call that steps every row of a bucket (rows already checked by `unsupported`).

    Each row's stored tensors are taken by name (`Composition.stored_names`: "exp_avg",
    "exp_avg_sq_scale", "param_error", …), the one order of a family's slots."""
    params = [r.tensors[0] for r in rows]
    grads = [r.tensors[1] for r in rows]
    names = composition.stored_names()
    stored = [dict(zip(names, r.tensors[3:], strict=True)) for r in rows]

    def each(name: str) -> list:
        return [s[name] for s in stored]

    scalars = torch.stack([r.scalars for r in rows]).cpu()
    rule, m_format = composition.rule, composition.m
    flag = rows[0].found_inf
    m, v = each("exp_avg"), each("exp_avg_sq")
    if isinstance(m_format, Blockwise8bit):
        return lambda: native.eightbit_step(
            params,
            each("param_error"),
            grads,
            m,
            each("exp_avg_absmax"),
            v,
            each("exp_avg_sq_absmax"),
            scalars,
            block_size=m_format.block_size,
            found_inf=flag,
        )
    if isinstance(m_format, GroupFP8):
        groups = m_format.group_size
        errors = each("param_error") if isinstance(rule, Grow) else None
        m_fields = [tuple(s[k] for k in m_format.keys("exp_avg")) for s in stored]
        v_fields = [tuple(s[k] for k in composition.v.keys("exp_avg_sq")) for s in stored]
        return lambda: native.coat_step(
            params,
            errors,
            grads,
            m_fields,
            v_fields,
            scalars,
            group_size=groups,
            expand=m_format.expand,
            found_inf=flag,
        )
    if isinstance(m_format, Scaled):
        masters = each("master_scale") if isinstance(rule, ScaledMaster) else [None] * len(rows)
        return lambda: native.fp8_adamw_step(
            params,
            masters,
            grads,
            [r.tensors[2] for r in rows],
            m,
            each("exp_avg_scale"),
            v,
            each("exp_avg_sq_scale"),
            scalars,
            margin=m_format.margin,
            found_inf=flag,
        )
    if isinstance(rule, Grow):
        errors = each("exp_avg_sq_error") if isinstance(composition.v, Pair) else None
        return lambda: native.collage_step(params, each("param_error"), grads, m, v, errors, scalars, found_inf=flag)
    if isinstance(rule, Kahan):
        return lambda: native.kahan_step(params, each("compensation"), grads, m, v, scalars, found_inf=flag)
    if isinstance(rule, StochasticRounding):
        seeds = torch.stack([r.seed for r in rows]).cpu()
        return lambda: native.sr_step(params, grads, m, v, scalars, seeds, found_inf=flag)
    if isinstance(rule, Master):
        return lambda: native.master_step(params, each("master"), grads, m, v, scalars, found_inf=flag)
    return lambda: native.adamw_step(params, grads, m, v, scalars, found_inf=flag)
