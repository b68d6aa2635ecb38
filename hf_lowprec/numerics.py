"""Error-free transformations, multi-component floats and stochastic rounding.

Pure tensor functions with no framework import, used by the low-precision optimizers
(Collage §2.2, §4; docs/algorithms.md §2 and §5). A length-2 *expansion* (hi, lo) stands for the
exact sum hi + lo, both components stored in the same low-precision dtype (BF16 or FP16) with
|lo| ≤ ulp(hi)/2.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .compiling import takes_gpu_path

__all__ = [
    "LOW_PRECISION_DTYPES",
    "abs_max",
    "all_finite",
    "expansion",
    "fast_two_sum",
    "foreach_fast_two_sum_",
    "foreach_grow_",
    "foreach_two_sum_",
    "grow",
    "mul_expansion",
    "nonfinite_flag",
    "pow_nonnegative",
    "round_by_bits",
    "round_to_dtype",
    "sqrt_rn",
    "split",
    "stochastic_round",
    "two_prod",
    "two_sum",
    "widened",
]

LOW_PRECISION_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)

Number = torch.Tensor | float


def abs_max(x: torch.Tensor) -> torch.Tensor:
    """max |x| in x's dtype (0 for an empty tensor); NaN when x holds a NaN.

    max(−min, max) from `torch.aminmax`: one vectorised pass without an |x| temporary
    (negation is exact, and both reductions propagate NaN). On CPU this is about 2× faster
    than `x.abs().amax()` and 5× faster than an inf-norm (`torch._foreach_norm(xs, inf)`).
    """
    if not x.numel():
        return torch.zeros((), dtype=x.dtype, device=x.device)
    low, high = torch.aminmax(x.detach())
    return torch.maximum(-low, high)


# Elements per FP64 slice in `sqrt_rn`: bounds its temporary to 8 MB whatever the tensor's size.
_SQRT_SLICE = 1 << 20


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """√x correctly rounded to nearest (IEEE 754), in x's dtype, as a new tensor.

    PyTorch's eager CPU square root of FP32 tensors is a vectorised library routine that is one
    ulp off for about 0.7% of inputs (measured with torch 2.13 on AVX2 and AVX-512 alike),
    while compiled kernels use the exact hardware instruction. The references root in FP64
    and round once to the dtype: that double rounding is exact for a square root whenever the
    wide format has at least 2p + 2 bits (Figueroa, 1995): 53 ≥ 2·24 + 2. The FP64 root itself
    is exact in PyTorch (checked against Python's `math.sqrt` in the tests). FP64 input is
    rooted as is.
    """
    if x.dtype == torch.float64:
        return torch.sqrt(x)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    for source, target in zip(x.reshape(-1).split(_SQRT_SLICE), out.view(-1).split(_SQRT_SLICE)):
        target.copy_(source.double().sqrt_())
    return out


def nonfinite_flag(tensors: list[torch.Tensor], device: torch.device | str | None = None) -> torch.Tensor:
    """1.0 when some tensor holds inf or NaN, else 0.0: a 0-dim FP32 tensor on the tensors' device
    (`device` when the list is empty), computed without a host sync.

    An inf is a tensor's minimum or maximum, and both propagate NaN, so the extremes from
    `torch.aminmax` decide (5× faster on CPU than the inf-norm that said the same).
    """
    full = [x.detach() for x in tensors if x.numel()]
    if not full:
        where = tensors[0].device if tensors else device
        return torch.zeros((), dtype=torch.float32, device=where if where is not None else "cpu")
    tensors = full
    if takes_gpu_path(tensors[0].device):
        # On a GPU one multi-tensor inf-norm per dtype (max |x|, NaN propagated) replaces two
        # launches per tensor.
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for x in tensors:
            by_dtype.setdefault(x.dtype, []).append(x)
        norms = [torch.stack(torch._foreach_norm(group, float("inf"))).float() for group in by_dtype.values()]
        extremes = torch.cat(norms) if len(norms) > 1 else norms[0]
    else:
        extremes = torch.stack([t.float() for x in tensors for t in torch.aminmax(x)])
    return extremes.isfinite().logical_not().any().to(torch.float32)


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """True when no tensor holds inf or NaN: `nonfinite_flag` read on the host (one sync)."""
    return not bool(nonfinite_flag(tensors))


def _low_dtype(*values: Number) -> torch.dtype:
    for value in values:
        if torch.is_tensor(value):
            return value.dtype
    raise TypeError("at least one argument must be a tensor, so that the result has a dtype")


# Correct rounding: PyTorch computes BF16/FP16 arithmetic in FP32 and rounds the result once more
# to the 16-bit format. For +, −, × of two p-bit numbers that double rounding is innocuous when the
# intermediate precision is at least 2p + 1 bits (24 ≥ 17 for BF16, 24 ≥ 23 for FP16), so each
# operation below is the correctly rounded one that the error-free transformations assume.
def fast_two_sum(a: Number, b: Number) -> tuple[torch.Tensor, torch.Tensor]:
    """Dekker's Fast2Sum: s = fl(a + b) and the exact rounding error e = a + b − s.

    s = fl(a + b); e = fl(b − fl(s − a)). Exact when |a| ≥ |b| or a == 0 (Collage Thm 4.1);
    then |e| ≤ ulp(s)/2. Three operations, no branch. Inputs are never modified.
    """
    s = a + b
    e = b - (s - a)
    return s, e


def two_sum(a: Number, b: Number) -> tuple[torch.Tensor, torch.Tensor]:
    """Knuth's TwoSum: s = fl(a + b) and e = a + b − s exactly, without any ordering condition.

    s = a + b; bb = s − a; e = (a − (s − bb)) + (b − bb). Six operations.
    """
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, e


def grow(x: Number, y: Number, a: Number) -> tuple[torch.Tensor, torch.Tensor]:
    """Collage Algorithm 1: add the float a to the expansion (x, y).

    (u, v) = TwoSum(x, a); (u, v) = Fast2Sum(u, y + v). Collage uses Fast2Sum for the first
    sum too, which needs |x| ≥ |a|; that fails for parameters near zero (θ = 0.000866 and
    Δθ = 0.001007 in BF16 lose the whole rounding error of that step), so the first sum is
    TwoSum (docs/algorithms.md §2). The second keeps Fast2Sum: u = fl(x + a) is either 0 or at
    least as large in exponent as y + v, whose parts are below ulp(x)/2 and ulp(u)/2.
    The only rounding is that of t = y + v, so |(u + v) − (x + y + a)| ≤ 2^-p·|t| ≤
    2^-p·(|y| + ulp(u₁)/2), where u₁ = fl(x + a) and p is the significand width (8 for
    BF16, 11 for FP16).
    """
    s, e = two_sum(x, a)
    return fast_two_sum(s, y + e)


def two_prod(a: Number, b: Number) -> tuple[torch.Tensor, torch.Tensor]:
    """TwoProd: p = fl(a·b) and the error e = fl(a·b − p) for BF16/FP16 operands.

    The exact product of two p-bit significands has at most 2p ≤ 24 bits, so it is exact
    in FP32; the error a·b − p is then exact in FP32 and is rounded once to the input dtype
    (exact too unless it falls below the dtype's subnormal range). A Python scalar operand
    must already be representable in the dtype (e.g. the `hi` of `expansion`).
    """
    dtype = _low_dtype(a, b)
    a32 = a.float() if torch.is_tensor(a) else a
    b32 = b.float() if torch.is_tensor(b) else b
    exact = a32 * b32
    p = exact.to(dtype)
    e = (exact - p.float()).to(dtype)
    return p, e


def mul_expansion(a_hi: Number, a_lo: Number, b_hi: Number, b_lo: Number) -> tuple[torch.Tensor, torch.Tensor]:
    """Product of two expansions (a_hi, a_lo) × (b_hi, b_lo), as an expansion.

    (p, e) = TwoProd(a_hi, b_hi); e += a_hi·b_lo + a_lo·b_hi; return Fast2Sum(p, e)
    (docs/algorithms.md §2, "Mul of expansions"). The a_lo·b_lo term is below the precision kept.
    Each cross term is added with one rounding (its product is exact in FP32), the same
    arithmetic as `torch.add(e, t, alpha=scalar)` in the vectorised optimizer step.
    """
    dtype = _low_dtype(a_hi, a_lo, b_hi, b_lo)
    like = next(v for v in (a_hi, a_lo, b_hi, b_lo) if torch.is_tensor(v))

    def as_tensor(value: Number) -> torch.Tensor:
        return value if torch.is_tensor(value) else torch.tensor(value, dtype=dtype, device=like.device)

    p, e = two_prod(a_hi, b_hi)
    e = torch.addcmul(e, as_tensor(a_hi), as_tensor(b_lo))
    e = torch.addcmul(e, as_tensor(a_lo), as_tensor(b_hi))
    return fast_two_sum(p, e)


def _significand_bits(dtype: torch.dtype) -> int:
    return 1 - int(math.log2(torch.finfo(dtype).eps))


def round_to_dtype(value: float, dtype: torch.dtype) -> float:
    """Round a Python float to the nearest value of `dtype` (ties to even), exactly.

    Unlike `torch.tensor(value, dtype=torch.float64).to(dtype)`, which goes through FP32 and
    can round twice, this rounds the FP64 value once. Overflow follows round-to-nearest:
    values at or beyond max + ulp(max)/2 become ±inf.
    """
    if value == 0.0 or not math.isfinite(value):
        return value
    finfo = torch.finfo(dtype)
    bits = _significand_bits(dtype)
    min_exponent = int(math.log2(finfo.smallest_normal))
    _, exponent = math.frexp(value)  # value = m·2^exponent with 0.5 ≤ |m| < 1
    quantum = math.ldexp(1.0, max(exponent - 1, min_exponent) - bits + 1)
    # value / quantum only shifts the exponent (exact); Python's round() is ties-to-even.
    rounded = round(value / quantum) * quantum
    if abs(rounded) > finfo.max:
        return math.copysign(math.inf, value)
    return float(rounded)


# FP32 significand bits below the last one kept by BF16 (7 kept) and FP16 (10 kept).
_DROPPED_BITS = {torch.bfloat16: 16, torch.float16: 13}


def round_by_bits(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP32 `x` rounded to BF16 or FP16 and widened back: `x.to(dtype).float()` bit for bit,
    from integer operations on |x|'s FP32 pattern (a compiler cannot fold them away as it can
    a cast there and back: `optim.formats.round_to`).

    Round half to even at the last kept bit: add half an ulp less one, plus the kept bit, and
    clear the dropped bits; a carry into the exponent is the right result, up to infinity. NaN
    lanes round a zero and get x back. FP16 has a narrower exponent: below its smallest normal
    2^-14 the spacing is a fixed 2^-24, FP32's spacing at 0.5, so adding and removing 0.5
    rounds there (to even, exactly); from 65520 on (halfway above 65504, the tie going to the
    even 2^16) the value is infinite. The sign is put back last, −0 included.
    """
    dropped = _DROPPED_BITS[dtype]
    nan = torch.isnan(x)
    magnitude = torch.where(nan, 0.0, x.abs())
    bits = magnitude.view(torch.int32)  # at most 0x7F800000: the sums below stay in int32
    bits = (bits + ((1 << (dropped - 1)) - 1) + ((bits >> dropped) & 1)) & -(1 << dropped)
    rounded = bits.view(torch.float32)
    if dtype == torch.float16:
        rounded = torch.where(magnitude < 2.0**-14, (magnitude + 0.5) - 0.5, rounded)
        rounded = torch.where(rounded >= 2.0**16, math.inf, rounded)
    return torch.where(nan, x, torch.copysign(rounded, x))


def expansion(value: float, dtype: torch.dtype) -> tuple[float, float]:
    """Split a constant into a length-2 expansion (hi, lo) of `dtype`.

    hi = round(value), lo = round(value − hi), the difference taken in FP64 against the
    low-precision hi (docs/algorithms.md §2). For BF16, 0.999 → (1.0, −0.00099945068359375):
    the correction Collage needs so that β2·v decays at all. It rounds on the host: conversions
    from FP64 are *not* correctly rounded by PyTorch (FP64 → FP32 → BF16 can round twice).
    """
    hi = round_to_dtype(value, dtype)
    lo = round_to_dtype(value - hi, dtype)
    return hi, lo


def split(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A wide tensor as a length-2 expansion (hi, lo) of `dtype`: hi = x.to(dtype), lo = r(x − hi).

    hi is the plain conversion (what `model.to(dtype)` stores); the difference x − hi is
    exact in FP64 and rounded once, so for FP32 x and BF16 hi + lo keeps about 16 of x's 24
    significand bits (|hi + lo − x| ≤ 2^-p·|x − hi| ≤ 2^-2p·|x|, p = 8) where hi alone keeps 8.
    """
    hi = x.detach().to(dtype)
    lo = (x.detach().double() - hi.double()).to(dtype)
    return hi, lo


def _neighbours(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The values of `dtype` just below and just above each element of FP32 `x`."""
    nearest = x.to(dtype)
    nearest32 = nearest.float()
    down = torch.nextafter(nearest, torch.full_like(nearest, -math.inf))
    up = torch.nextafter(nearest, torch.full_like(nearest, math.inf))
    below = torch.where(nearest32 > x, down, nearest)
    above = torch.where(nearest32 < x, up, nearest)
    return below.float(), above.float()


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round FP32 `x` to BF16 or FP16 up with probability (x − lo)/(hi − lo), else down.

    lo and hi are the neighbouring values of `dtype` around x, so E[SR(x)] = x
    (docs/algorithms.md §5): repeated updates below ulp/2 are absorbed on average instead of
    being lost. BF16 shares FP32's exponent, so adding 16 uniform random bits below the
    BF16 significand and truncating is exactly that; FP16 uses the general two-neighbour
    method. ±inf and NaN pass through unchanged; finite values beyond the dtype's largest
    finite value are rounded to nearest (saturating to ±max or overflowing to ±inf exactly
    as a plain cast would), since there is no upper neighbour to randomise towards.

    Args:
        x: tensor to round; converted to FP32 first.
        dtype: `torch.bfloat16` or `torch.float16`.
        generator: source of randomness, for reproducible runs.
    """
    if dtype not in LOW_PRECISION_DTYPES:
        raise ValueError(f"stochastic_round rounds to torch.bfloat16 or torch.float16, got {dtype}")
    x = x.float()
    if dtype == torch.bfloat16:
        noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
        # Truncating after the add rounds toward zero in magnitude; with the sign-magnitude
        # layout that is the right direction for negative numbers too.
        bits = (x.view(torch.int32) + noise).bitwise_and_(-65536)
        rounded = bits.view(torch.float32).to(dtype)
    else:
        below, above = _neighbours(x, dtype)
        gap = above - below
        probability_up = torch.where(gap > 0, (x - below) / gap, torch.zeros_like(x))
        uniform = torch.rand(x.shape, device=x.device, generator=generator)
        rounded = torch.where(uniform < probability_up, above, below).to(dtype)
    plain = ~torch.isfinite(x) | (x.abs() > torch.finfo(dtype).max)
    return torch.where(plain, x.to(dtype), rounded)


def foreach_fast_two_sum_(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    """In place over lists: (a, b) ← Fast2Sum(a, b), the same arithmetic as `fast_two_sum`.

    Uses fl(a − s) = −fl(s − a) (round-to-nearest is symmetric) so the rounding error can be
    built in the buffers already held: one temporary, four passes.
    """
    s = torch._foreach_add(a, b)
    torch._foreach_sub_(a, s)  # a ← −fl(s − a)
    torch._foreach_add_(b, a)  # b ← fl(b − fl(s − a)) = e
    torch._foreach_copy_(a, s)


def foreach_two_sum_(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    """In place over lists: (a, b) ← TwoSum(a, b), bit-identical to `two_sum`.

    No ordering condition. Uses fl(x − y) = −fl(y − x) to build the error in the buffers
    held: two temporaries, seven passes (Fast2Sum: one temporary, four passes).
    """
    s = torch._foreach_add(a, b)  # s = fl(a + b)
    bb = torch._foreach_sub(s, a)  # bb = fl(s − a)
    torch._foreach_sub_(b, bb)  # b ← fl(b − bb)
    torch._foreach_sub_(bb, s)  # bb ← −fl(s − bb)
    torch._foreach_add_(a, bb)  # a ← fl(a − fl(s − bb))
    torch._foreach_add_(b, a)  # b ← e
    torch._foreach_copy_(a, s)


def foreach_grow_(x: list[torch.Tensor], y: list[torch.Tensor], a: list[torch.Tensor]) -> None:
    """In place over lists: (x, y) ← Grow((x, y), a), bit-identical to `grow`.

    `a` is used as scratch and holds garbage afterwards; pass a copy if it is still needed.
    TwoSum(x, a), one add, Fast2Sum(x, y): twelve passes, two temporaries. Cost of TwoSum
    over Collage's Fast2Sum (measured on 5.2M BF16 elements, one thread, interleaved
    medians): 1.42× for this function, 1.17× for a whole eager Collage-plus step. A fused
    kernel is memory-bound and does the three extra operations in registers.
    """
    foreach_two_sum_(x, a)  # x ← s, a ← e
    torch._foreach_add_(y, a)  # y ← t = fl(y + e)
    foreach_fast_two_sum_(x, y)


# The power x^e of COAT's range expansion, as a fixed sequence of FP32 operations: the eager
# reference, the compiled step and the native kernels evaluate the same sequence, so the three
# agree bit for bit and nothing depends on the thread count or the vector width (PyTorch's own
# `pow` does: its vectorised and scalar loops round differently). log2 by Cephes' single-
# precision polynomial for ln(1 + f), 2^y by a degree-7 Taylor series of e^(f·ln 2); each a few
# FP32 ulps from the exact function (the tests bound the decoded values against FP64).
_LOG_POLY = (
    7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1,
    -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1,
)  # fmt: skip
# 1/5040, 1/720, 1/120, 1/24, 1/6 rounded once to FP32 (as the kernels' `1.0f / 5040.0f`).
_EXP_POLY = tuple(float(torch.tensor(1.0, dtype=torch.float32) / d) for d in (5040.0, 720.0, 120.0, 24.0, 6.0))
_SMALLEST_NORMAL = 1.17549435e-38
_ROUND_SHIFT = 12582912.0  # 1.5·2^23: y + this rounds y to an integer, held in the low bits


def _log2_positive(x: torch.Tensor) -> torch.Tensor:
    """log2(x) for x ≥ 0 (subnormals included; 0 gives −150), FP32, a few ulps."""
    tiny = x < _SMALLEST_NORMAL
    x = torch.where(tiny, x * 8388608.0, x)
    bits = x.view(torch.int32)
    e = ((bits >> 23) - 127).to(torch.float32)
    e = torch.where(tiny, e - 23.0, e)
    m = ((bits & 0x7FFFFF) | 0x3F800000).view(torch.float32)
    big = m > 1.41421356
    m = torch.where(big, m * 0.5, m)
    e = torch.where(big, e + 1.0, e)
    f = m - 1.0
    z = f * f
    p = f * _LOG_POLY[0] + _LOG_POLY[1]
    for c in _LOG_POLY[2:]:
        p = p * f + c
    ln = f + ((p * f) * z - z * 0.5)
    return e + ln * 1.4426950408889634


def _exp2(y: torch.Tensor) -> torch.Tensor:
    """2^y for y clamped to [−125, 126], FP32, a few ulps."""
    y = y.clamp(-125.0, 126.0)
    shifted = y + _ROUND_SHIFT
    n = shifted.view(torch.int32) - 0x4B400000
    z = (y - (shifted - _ROUND_SHIFT)) * 0.69314718
    p = z * _EXP_POLY[0] + _EXP_POLY[1]
    for c in (*_EXP_POLY[2:], 0.5, 1.0, 1.0):
        p = p * z + c
    return (p.view(torch.int32) + (n << 23)).view(torch.float32)


def pow_nonnegative(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """x^e for x ≥ 0 (0 → 0, NaN → NaN) and e > 0, FP32: exp2(e·log2(x)), the sequence the
    native kernels run (not PyTorch's `pow`; a few ulps from the exact power)."""
    r = _exp2(e * _log2_positive(x))
    r = torch.where(x.view(torch.int32) == 0, x, r)
    return torch.where(torch.isnan(x), x, r)


def widened(outputs: Any) -> Any:
    """`outputs` (a tensor, or tuples and lists of them) with 16-bit float tensors made FP32."""
    if torch.is_tensor(outputs):
        return outputs.float() if outputs.dtype in (torch.float16, torch.bfloat16) else outputs
    if type(outputs) in (tuple, list):
        return type(outputs)(widened(o) for o in outputs)
    return outputs
