"""The native step of each AdamW family by its own arguments (tests, benchmarks, direct use).

Each function names its family's declaration (`native.declaration` of its formats and rule) and
passes its tensors by name to `native.step`, the kernels' one entry point; the optimizers go
through `optim.native_dispatch`, which declares any composition the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..formats import Blockwise8bit, GroupFP8, Pair, Plain, Scaled
from ..rules import Grow, Kahan, Master, Nearest, ScaledMaster, StochasticRounding
from .core import Declaration, Tensors, declaration, step

__all__ = [
    "adamw_step",
    "coat_step",
    "collage_step",
    "eightbit_step",
    "fp8_adamw_step",
    "kahan_step",
    "master_step",
    "sr_step",
]


def _declared(m_format: Any, v_format: Any, rule: Any) -> Declaration:
    declared = declaration(m_format, v_format, rule)
    assert isinstance(declared, Declaration), declared
    return declared


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
    """AdamW in place over a bucket: `families.PlainAdamW` (bf16-pure: BF16 θ and moments; FP32 θ
    and moments: bf16-mixed's masters) and `families.FP32StatesAdamW` (BF16/FP16 θ, FP32 moments).

    Per element: m₃₂ = m + ONE_MINUS_BETA1·(g − m); v₃₂ = min(v·BETA2 + (ONE_MINUS_BETA2·g)·g,
    max of v's dtype); Δθ = θ·DECAY + (STEP·m₃₂)/(√v₃₂ + EPS); θ ← r(θ + Δθ); m, v rounded once.

    Dtypes: θ FP32, BF16 or FP16; g FP32, BF16 or FP16; m and v one dtype, FP32 (any θ) or BF16
    (BF16 θ). Every tensor contiguous, on CPU, the parameter's size. `isa` overrides `isa()`.
    """
    named = {"param": params, "grad": grads, "exp_avg": exp_avgs, "exp_avg_sq": exp_avg_sqs}
    step(_declared(Plain(), Plain(), Nearest()), named, scalars, found_inf=found_inf, isa=isa)


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
    """Collage AdamW in place: light when `exp_avg_sq_errors` is None, plus otherwise.

    The AdamW moments (plus: v read as v + δv, then δv ← r(v₃₂ − r(v₃₂))), then
    (θ, δθ) ← Grow((θ, δθ), r(Δθ₃₂)): TwoSum in θ's dtype, δθ + e rounded, Fast2Sum.

    Dtypes: θ and δθ BF16 with moments (and δv) BF16 or FP32, or all FP32; g FP32, BF16 or FP16.
    """
    named = {
        "param": params,
        "param_error": param_errors,
        "grad": grads,
        "exp_avg": exp_avgs,
        "exp_avg_sq": exp_avg_sqs,
    }
    v_format = Plain() if exp_avg_sq_errors is None else Pair()
    if exp_avg_sq_errors is not None:
        named["exp_avg_sq_error"] = exp_avg_sq_errors
    step(_declared(Plain(), v_format, Grow()), named, scalars, found_inf=found_inf, isa=isa)


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
    """`families.KahanAdamW` in place: y = r(Δθ₃₂ + k); (θ, k) ← TwoSum(θ, y).

    Dtypes: θ and k BF16 with moments BF16 or FP32, or FP16 with FP32 moments; g FP32, BF16 or FP16.
    """
    named = {
        "param": params,
        "compensation": compensations,
        "grad": grads,
        "exp_avg": exp_avgs,
        "exp_avg_sq": exp_avg_sqs,
    }
    step(_declared(Plain(), Plain(), Kahan()), named, scalars, found_inf=found_inf, isa=isa)


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
    """Stochastic-rounding AdamW in place for BF16 θ: θ ← SR(θ + Δθ₃₂)
    (`families.StochasticRoundingAdamW`, and `families.FP32StatesSRAdamW` with FP32 moments).

    The random bits of element i of parameter j: two multiply-xorshift rounds over
    (i + seeds[j]·0x9E3779B9) mod 2^32, the top 16 bits (the optimizers' counter-based stream),
    independent of the ISA and the thread count, so the same seeds give the same bits (resume).
    Values that are not finite or beyond BF16's largest finite value are rounded to nearest.

    Dtypes: θ BF16; moments BF16 or FP32; g FP32, BF16 or FP16; `seeds` int64, one per parameter.
    """
    flat_seeds = seeds.reshape(-1)
    named = {"param": params, "grad": grads, "exp_avg": exp_avgs, "exp_avg_sq": exp_avg_sqs}
    named["seed"] = [flat_seeds[i : i + 1] for i in range(flat_seeds.numel())]
    step(_declared(Plain(), Plain(), StochasticRounding()), named, scalars, found_inf=found_inf, isa=isa)


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
    """`families.MasterWeightAdamW` in place: AdamW on the FP32 master θ₃₂ (FP32 moments), then the
    visible weight θ ← r(θ₃₂), one pass.

    Dtypes: θ BF16, FP16 (or FP32); masters and moments FP32; g FP32, BF16 or FP16.
    """
    named = {"param": params, "master": masters, "grad": grads, "exp_avg": exp_avgs, "exp_avg_sq": exp_avg_sqs}
    step(_declared(Plain(), Plain(), Master()), named, scalars, found_inf=found_inf, isa=isa)


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
    m₃₂ = m_old + ONE_MINUS_BETA1·(g − m_old), m_old = m_payload·(1/s_m); v₃₂ = min((v_payload·(1/s_v))·BETA2 +
    (ONE_MINUS_BETA2·g)·g, FP32 max); Δθ = θ·DECAY + (STEP·m₃₂)/(√v₃₂ + EPS); θ' = θ + Δθ.

    Dtypes: θ an FP16 payload with its 0-dim FP32 scale in `master_scales`, or FP32/BF16 with None;
    g FP8 (E4M3/E5M2) with its scale in `grad_scales`, or FP32/BF16/FP16 with None; (m, v) E4M3 and
    FP16, or FP32 and FP32 (stored unscaled, scale 1); every scale a 0-dim FP32 CPU tensor.
    A bucket mixing scaled and plain masters runs as two calls (two declarations).
    """
    moments = (
        (Scaled(exp_avgs[0].dtype, margin), Scaled(exp_avg_sqs[0].dtype, margin, keep_nonzero=True))
        if len(params)
        else ()
    )
    for scaled in (True, False):
        rows = [i for i, s in enumerate(master_scales) if (s is not None) == scaled]
        if not rows:
            continue

        def pick(items: Sequence[Any], rows: list[int] = rows) -> list[Any]:
            return [items[i] for i in rows]

        named = {
            "param": pick(params),
            "grad": pick(grads),
            "grad_scale": pick(grad_scales),
            "exp_avg": pick(exp_avgs),
            "exp_avg_scale": pick(exp_avg_scales),
            "exp_avg_sq": pick(exp_avg_sqs),
            "exp_avg_sq_scale": pick(exp_avg_sq_scales),
        }
        if scaled:
            named["master_scale"] = pick(master_scales)
        rule = ScaledMaster(margin) if scaled else Nearest()
        step(_declared(*moments, rule), named, scalars[rows], found_inf=found_inf, isa=isa)


def _group_fields(state: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if isinstance(state, (tuple, list)):
        return tuple(state)
    return state.payload, state.scale, state.exponent, state.center  # optim.coat_adamw.FP8GroupState


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
    """`coat_adamw.COATAdamW`'s step in place, group by group of `group_size`.

    Per group of m and of v: decode x = sign(y)·|y|^(1/k)·c, y = q/s (expand) or x = q/s; the
    AdamW update (FP32, v clamped to FP32's max); θ ← θ + Δθ₃₂ (FP32 θ) or (θ, δθ) ←
    Grow((θ, δθ), r(Δθ₃₂)) (BF16/FP16 θ); then `optim.coat_adamw.quantize_state` of the new m and v: amax,
    amin (smallest non-zero), k = max(1, ⌊log2(F²/2)/log2(amax/amin)·16⌋/16) (FP64),
    c = √amax·√amin, |x| ← (|x|/c)^k, s = F/amax, q = cast(clamp(x·s) + (x·s − x·s)).
    A last partial group is padded with zeros, as `coat_adamw.quantize_state` pads.

    Numerics: every operation is the reference's (`formats.GroupFP8`, whose powers are
    `numerics.pow_nonnegative`): bit-identical. k itself is FP64 arithmetic on the group's amax
    and amin, as the reference computes it.

    Args:
        param_errors: δθ per BF16/FP16 parameter (its dtype), or None for FP32 parameters.
        exp_avgs, exp_avg_sqs: per parameter a `coat_adamw.FP8GroupState` or a tuple (payload, scale,
            exponent, center): payload float8_e4m3fn for m, float8_e4m3fn or float8_e5m2 for v,
            padded to whole groups; FP32 metadata, one value per group; updated in place.
        group_size: a multiple of 16 up to 1024 (COAT: 128).
    Dtypes: θ FP32, BF16 or FP16; g FP32, BF16 or FP16.
    """
    named: dict[str, Any] = {"param": params, "grad": grads}
    for prefix, states in (("exp_avg", exp_avgs), ("exp_avg_sq", exp_avg_sqs)):
        fields = [_group_fields(s) for s in states]
        for k, suffix in enumerate(GroupFP8.suffixes):
            named[prefix + suffix] = [f[k] for f in fields]
    v_dtype = named["exp_avg_sq"][0].dtype if len(params) else torch.float8_e4m3fn
    rule = Nearest() if param_errors is None else Grow()
    if param_errors is not None:
        named["param_error"] = param_errors
    m_format, v_format = (
        GroupFP8(torch.float8_e4m3fn, group_size, expand),
        GroupFP8(v_dtype, group_size, expand, keep_nonzero=True),
    )
    step(_declared(m_format, v_format, rule), named, scalars, found_inf=found_inf, isa=isa)


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
    """`families.Collage8bitAdamW`'s step in place: blockwise 8-bit m (signed dynamic map) and v
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
    named = {"param": params, "param_error": param_errors, "grad": grads, "exp_avg": m_codes}
    named |= {"exp_avg_absmax": m_absmax, "exp_avg_sq": v_codes, "exp_avg_sq_absmax": v_absmax}
    formats = Blockwise8bit(True, block_size), Blockwise8bit(False, block_size)
    step(_declared(*formats, Grow()), named, scalars, found_inf=found_inf, isa=isa)
