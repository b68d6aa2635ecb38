"""Storage formats of optimizer states: how a stored tensor becomes FP32 registers and back (the
codecs, `Format` and its subclasses, and the correctly rounded helpers they share: `root`,
`round_to`, `saturate`). The rules are in docs/algorithms.md §0 (formats), §2 (MCF pairs), §3
(scaled tensors) and §4 (COAT's groups); the blockwise 8-bit format is described on `Blockwise8bit`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..fp8.scaled import format_max, keep_nonzero, pow2_scale
from ..numerics import pow_nonnegative, round_by_bits, sqrt_rn
from .dynamic_maps import MAPS as _MAPS
from .dynamic_maps import dynamic_map, dynamic_map_lookup, map_tensors

__all__ = [
    "Blockwise8bit",
    "Format",
    "GroupFP8",
    "Pair",
    "Plain",
    "Scaled",
    "dynamic_map",
    "dynamic_map_lookup",
    "expansion_exponent",
    "root",
    "round_to",
    "saturate",
]

F32 = torch.float32


def root(x: torch.Tensor) -> torch.Tensor:
    """√x correctly rounded: the hardware root when compiled or on a CUDA device, `numerics.sqrt_rn`
    eagerly elsewhere.

    PyTorch's eager CPU root of FP32 is one ulp off for ~0.7% of inputs; compiled loops and CUDA
    (`-prec-sqrt=true`) round correctly: the exact root everywhere keeps the paths bit-identical.
    A fake tensor (the planner counting a GPU step) takes the GPU's form: one kernel.
    """
    if torch.compiler.is_compiling() or x.device.type == "cuda" or isinstance(x, FakeTensor):
        return torch.sqrt(x)
    return sqrt_rn(x)


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to `dtype` (to nearest even) and widened back to FP32.

    Eagerly a cast there and back. Compiled, for BF16 and FP16, the same bits from integer
    operations (`numerics.round_by_bits`): Inductor in torch 2.11 drops an FP32 → BF16/FP16 →
    FP32 round trip inside a fused kernel (`pointless_convert`; 2.13 keeps it), which would
    silently remove every rounding of TwoSum, Fast2Sum and Kahan's sum.
    """
    if dtype in (torch.bfloat16, torch.float16) and torch.compiler.is_compiling():
        return round_by_bits(x, dtype)
    return x.to(dtype).to(F32)


def saturate(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y clamped to ±max(dtype), NaN kept NaN and ±inf made NaN (the FP8 cast convention).

    clamp turns ±inf into ±max; adding y − y (0 when finite, NaN otherwise) restores NaN.
    """
    limit = format_max(dtype)
    return y.clamp(-limit, limit) + (y - y)


@dataclasses.dataclass(frozen=True)
class Format:
    """Base of the formats: one stored tensor `prefix`, element-wise.

    A format (a codec) is a small frozen description — hashable, so a compiled step can be built
    once per combination — with these operations over the tensors it stores for one parameter:

        keys(prefix)                 the state keys it owns ("exp_avg", "exp_avg_scale", ...)
        zeros(param)                 the stored tensors of an all-zero state
        decode(*stored)              FP32 values, one per element (the padded length for blocks)
        choose(values, *stored)      what storing FP32 `values` decides (scales), nothing written
        store_(values, chosen, *stored)   store them with what `choose` decided, rounding once
        encode_(values, *stored)     both

    Choosing for every tensor before storing any lets a compiler fuse the reductions, then the stores.

    Element-wise formats see flat 1-D tensors; block formats (`block` > 1) (blocks × block) views,
    payloads flat and padded to whole blocks (the caller pads parameter and gradient with zeros,
    which stay zero and move no block's maximum). Every operation is a pure function of tensors, run
    eagerly (the reference) and compiled (the fast path) with the same bits (roots through `root`).

    The formats, what they store per element, and who uses them:

        Plain(dtype)       the value rounded to dtype          m and v of the BF16 family; FP32
        Scaled(dtype)      payload + one power-of-two scale    FP8AdamW's m and v; FP16 second moments
        Pair(base)         (value, error): ~2p bits (MCF)      Collage-plus's v
        GroupFP8(dtype)    FP8 + per-group (s, k, c)           COAT's m and v (range expansion)
        Blockwise8bit()    8-bit dynamic-map code + absmax     the collage-8bit strategy's m and v
    """

    block: int = dataclasses.field(default=1, init=False)

    suffixes = ("",)
    #: Per stored tensor: whether it has the parameter's elements (flattened or padded with it)
    #: or is stored as it is (scales, block metadata, payloads already padded to whole blocks).
    like_param = (True,)
    #: The format's tag in the native kernels (`optim.native.Declaration`), None: none there.
    native_name: ClassVar[str | None] = None

    def keys(self, prefix: str) -> tuple[str, ...]:
        return tuple(prefix + s for s in self.suffixes)

    def native_options(self, prefix: str) -> dict[str, int]:
        """The native kernels' options of this format stored under `prefix` (named prefix_option)."""
        return {}

    def native_shared(self, prefix: str) -> dict[str, tuple[torch.Tensor, ...]]:
        """Tensors the native kernels read for the whole call (not per parameter)."""
        return {}

    def register_max(self, payload_dtype: torch.dtype) -> float:
        """Largest value the update may hold before `encode_` (v is clamped to it: a square that overflows
        saturates, not inf): FP32's where the encoding handles range (scaled, block), else the dtype's."""
        return torch.finfo(F32).max

    def storage_dtype(self, param: torch.Tensor) -> torch.dtype:
        raise NotImplementedError

    def zeros(self, param: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def decode(self, *stored: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def choose(self, values: torch.Tensor, *stored: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return ()

    def store_(self, values: torch.Tensor, chosen: tuple[torch.Tensor, ...], *stored: torch.Tensor) -> None:
        raise NotImplementedError

    def encode_(self, values: torch.Tensor, *stored: torch.Tensor) -> None:
        self.store_(values, self.choose(values, *stored), *stored)

    def bytes_per_element(self, param_dtype: torch.dtype) -> float:
        """Stored bytes per parameter element (scales and block metadata included)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Plain(Format):
    """The value rounded once to `dtype` (None: the parameter's dtype)."""

    dtype: torch.dtype | None = None

    native_name = "plain"

    def register_max(self, payload_dtype: torch.dtype) -> float:
        return torch.finfo(payload_dtype).max

    def storage_dtype(self, param: torch.Tensor) -> torch.dtype:
        return param.dtype if self.dtype is None else self.dtype

    def zeros(self, param: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (torch.zeros_like(param, dtype=self.storage_dtype(param), memory_format=torch.preserve_format),)

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        return payload.float()

    def store_(self, values: torch.Tensor, chosen: tuple[torch.Tensor, ...], payload: torch.Tensor) -> None:
        payload.copy_(values)

    def bytes_per_element(self, param_dtype: torch.dtype) -> float:
        return (self.dtype or param_dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Scaled(Format):
    """payload = saturate(value·s) in `dtype`, s a power of two re-chosen at every store.

    s = 2^(floor(log2(max(dtype)/amax)) − margin) (`fp8.scaled.pow2_scale`): amax·s lands in
    the format's top binade, so the scaling is exact and only the cast rounds; amax = 0 or
    non-finite gives s = 1, as FP32 storage keeps. Decoding multiplies by 1/s (exact: s = 2^k).
    `keep_nonzero` (v): `fp8.scaled.keep_nonzero`, a positive v never stored as 0: never m/ε.
    """

    dtype: torch.dtype | None = None
    margin: int = 0
    keep_nonzero: bool = False

    suffixes = ("", "_scale")
    like_param = (True, False)
    native_name = "scaled"

    def native_options(self, prefix: str) -> dict[str, int]:
        return {f"{prefix}_margin": self.margin, f"{prefix}_nonnegative": int(self.keep_nonzero)}

    def storage_dtype(self, param: torch.Tensor) -> torch.dtype:
        return param.dtype if self.dtype is None else self.dtype

    def zeros(self, param: torch.Tensor) -> tuple[torch.Tensor, ...]:
        payload = torch.zeros_like(param, dtype=self.storage_dtype(param), memory_format=torch.preserve_format)
        return payload, torch.ones((), dtype=F32, device=param.device)

    def decode(self, payload: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return payload.float() * (1.0 / scale)

    def choose(self, values: torch.Tensor, payload: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(the new scale,) from amax(values); () for FP32 storage (s = 1)."""
        if payload.dtype == F32:
            return ()
        return (pow2_scale(values.abs().amax(), payload.dtype, self.margin),)

    def store_(self, values, chosen, payload, scale) -> None:
        payload.copy_(self.scaled(values, chosen, payload, scale))

    def scaled(self, values, chosen, payload, scale) -> torch.Tensor:
        """Store the chosen scale, return saturate(values·s) in FP32 (`values` for FP32 storage)."""
        if not chosen:
            scale.fill_(1.0)
            return values
        (new_scale,) = chosen
        scale.copy_(new_scale)
        y = saturate(values * new_scale, payload.dtype)
        return keep_nonzero(y, payload.dtype) if self.keep_nonzero else y

    def bytes_per_element(self, param_dtype: torch.dtype) -> float:
        return (self.dtype or param_dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Pair(Format):
    """A multi-component value (v, δv) in `base`'s dtype: v = r(x), δv = r(x − v).

    The pair holds ~2p bits; decoding adds the components in FP32, exact while they span at
    most 24 bits (else off by < 2^-24 relative). With a `Scaled` base both components carry
    its scale (FP16 second moments: FP16 cannot hold a small v unscaled).
    """

    base: Plain | Scaled = Plain()

    @property
    def suffixes(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("", "_error", *self.base.suffixes[1:])

    @property
    def like_param(self) -> tuple[bool, ...]:  # type: ignore[override]
        return (True, True, *self.base.like_param[1:])

    @property
    def native_name(self) -> str | None:  # type: ignore[override]
        return "pair" if isinstance(self.base, Plain) else None  # the kernels pair plain values

    def register_max(self, payload_dtype: torch.dtype) -> float:
        return self.base.register_max(payload_dtype)

    def storage_dtype(self, param: torch.Tensor) -> torch.dtype:
        return self.base.storage_dtype(param)

    def zeros(self, param: torch.Tensor) -> tuple[torch.Tensor, ...]:
        value, *scale = self.base.zeros(param)
        return (value, torch.zeros_like(value), *scale)

    def decode(self, value: torch.Tensor, error: torch.Tensor, *scale: torch.Tensor) -> torch.Tensor:
        total = value.float() + error.float()
        return total * (1.0 / scale[0]) if scale else total

    def choose(self, values, value, error, *scale) -> tuple[torch.Tensor, ...]:
        return self.base.choose(values, value, scale[0]) if scale else ()

    def store_(self, values, chosen, value, error, *scale) -> None:
        stored = self.base.scaled(values, chosen, value, scale[0]) if scale else values
        value.copy_(stored)
        error.copy_(stored - round_to(stored, value.dtype))

    def bytes_per_element(self, param_dtype: torch.dtype) -> float:
        return 2 * self.base.bytes_per_element(param_dtype)


# COAT: k is a multiple of 1/16; the floor keeps R^k at or below the target range.
_K_STEPS = 16


def expansion_exponent(amax: torch.Tensor, amin: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """COAT's k = max(1, floor(log2(F²/2) / log2(amax/amin) · 16) / 16) per group, FP32.

    Args:
        amax: max |x| per group; amin: smallest non-zero |x| per group (any value where amax = 0).
    Groups with amax = 0 or amax/amin ≤ 1 get k = 1.
    """
    target = math.log2(format_max(fp8_dtype) ** 2 / 2)
    log_range = torch.log2(amax.double()) - torch.log2(amin.double())
    usable = (amax > 0) & (log_range > 0)
    raw = torch.floor(target / torch.where(usable, log_range, torch.ones_like(log_range)) * _K_STEPS) / _K_STEPS
    return torch.where(usable, raw.clamp(min=1.0), torch.ones_like(raw)).float()


@dataclasses.dataclass(frozen=True)
class GroupFP8(Format):
    """COAT's state format: FP8 codes with per-group (s, k, c), dynamic range expansion.

    Per group of `group_size` elements, mx = max|x|, mn = the smallest non-zero |x|:
    c = √mx·√mn, k = `expansion_exponent`, y = sign(x)·(|x|/c)^k, q = FP8(y·s), s = F/max|y|;
    decoded x̂ = sign(q)·|q/s|^(1/k)·c. A group with k = 1 stores c = 1 (plain per-group
    scaling); an all-zero group stores s = k = c = 1; inf or NaN makes the group decode to NaN.
    `expand=False` is plain per-group scaling (k = c = 1). (s, k, c) are FP32.

    `keep_nonzero` (v): `fp8.scaled.keep_nonzero`, so v̂ > 0 for v > 0: never m/ε (docs/strategies/coat.md).
    """

    dtype: torch.dtype = torch.float8_e4m3fn
    group_size: int = 128
    expand: bool = True
    keep_nonzero: bool = False

    suffixes = ("", "_scale", "_exponent", "_center")
    like_param = (False, False, False, False)
    native_name = "group_fp8"

    def native_options(self, prefix: str) -> dict[str, int]:
        values = {"group_size": self.group_size, "expand": int(self.expand), "nonnegative": int(self.keep_nonzero)}
        return {f"{prefix}_{key}": value for key, value in values.items()}

    def __post_init__(self) -> None:
        if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size <= 0:
            raise ValueError(f"group_size must be a positive integer, got {self.group_size!r} (COAT uses 128)")
        if self.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {self.dtype}")
        object.__setattr__(self, "block", self.group_size)

    def storage_dtype(self, param: torch.Tensor) -> torch.dtype:
        return self.dtype

    def zeros(self, param: torch.Tensor) -> tuple[torch.Tensor, ...]:
        groups = -(-param.numel() // self.group_size)
        ones = torch.ones(groups, dtype=F32, device=param.device)
        payload = torch.zeros(groups * self.group_size, dtype=self.dtype, device=param.device)
        return payload, ones, ones.clone(), ones.clone()

    def decode(self, payload, scale, exponent, center) -> torch.Tensor:
        y = payload.view(-1, self.group_size).float() / scale[:, None]
        if self.expand:
            inv_k = exponent.reciprocal()[:, None]
            magnitude = y.abs()
            magnitude = torch.where(inv_k == 1.0, magnitude, pow_nonnegative(magnitude, inv_k))
            y = (magnitude * center[:, None]).copysign(y)
        return y

    def choose(self, values, payload, scale, exponent, center) -> tuple[torch.Tensor, ...]:
        """(y, s, k, c): the expanded values (grouped) and each group's statistics."""
        grouped = values.view(-1, self.group_size)
        magnitude = grouped.abs()
        amax = magnitude.amax(dim=1)
        ones = torch.ones_like(amax)
        k, c = ones, ones
        if self.expand:
            amin = torch.where(magnitude > 0, magnitude, math.inf).amin(dim=1)
            k = expansion_exponent(amax, amin, self.dtype)
            # √mx·√mn, not √(mx·mn): the product of two tiny second moments would underflow.
            c = torch.where((amax > 0) & (k > 1), root(amax) * root(amin), ones)
            magnitude = magnitude / c[:, None]
            magnitude = torch.where(k[:, None] == 1.0, magnitude, pow_nonnegative(magnitude, k[:, None]))
            grouped = magnitude.copysign(grouped)
            amax = magnitude.amax(dim=1)
        limit = format_max(self.dtype)
        # s ≤ 2^126 (as pow2_scale's): a decayed amax below F/FLT_MAX gave s = inf, a NaN group.
        s = torch.where(amax > 0, (limit / amax).clamp(max=2.0**126), ones)
        return grouped, torch.where(torch.isfinite(amax), s, math.nan), k, c

    def store_(self, values, chosen, payload, scale, exponent, center) -> None:
        grouped, s, k, c = chosen
        y = saturate(grouped * s[:, None], self.dtype)
        y = keep_nonzero(y, self.dtype) if self.keep_nonzero else y
        payload.view(-1, self.group_size).copy_(y)
        scale.copy_(s)
        exponent.copy_(k)
        center.copy_(c)

    def bytes_per_element(self, param_dtype: torch.dtype) -> float:
        return 1 + 12 / self.group_size


@dataclasses.dataclass(frozen=True)
class Blockwise8bit(Format):
    """8-bit codes into the `dynamic_map` with one FP32 absmax per block of `block_size`.

    Encoding divides a block by its absmax (a = max|x|; an all-zero block keeps a = 0 and codes of
    0) and stores the index of the nearest map value (ties to the lower one); decoding is map[code]·a.
    m uses the signed map, v (never negative) the unsigned one, whose codes are twice as dense; a
    positive v takes code 1 (3.25e-7·a) at least, never 0 (a v of 0 beside an m ≠ 0: update m/ε).
    The layout of the 8-bit AdamW states of Dettmers et al. (2022): 1 byte + 4/256 per element.
    NaN in a block makes its absmax NaN, so the block decodes to NaN.
    """

    signed: bool = True
    block_size: int = 256

    suffixes = ("", "_absmax")
    like_param = (False, False)
    native_name = "blockwise_8bit"

    def native_options(self, prefix: str) -> dict[str, int]:
        nan_code = dynamic_map_lookup(self.signed)[3]
        return {
            f"{prefix}_group_size": self.block_size,
            f"{prefix}_map_nan": nan_code,
            f"{prefix}_nonnegative": int(not self.signed),
        }

    def native_shared(self, prefix: str) -> dict[str, tuple[torch.Tensor, ...]]:
        return {f"{prefix}_map": dynamic_map_lookup(self.signed)[:3]}

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        object.__setattr__(self, "block", self.block_size)

    def storage_dtype(self, param: torch.Tensor) -> torch.dtype:
        return torch.uint8

    def zeros(self, param: torch.Tensor) -> tuple[torch.Tensor, ...]:
        blocks = -(-param.numel() // self.block_size)
        zero_code = _MAPS[self.signed].index(0.0)
        codes = torch.full((blocks * self.block_size,), zero_code, dtype=torch.uint8, device=param.device)
        return codes, torch.zeros(blocks, dtype=F32, device=param.device)

    def decode(self, codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        values, _ = map_tensors(self.signed, codes.device)
        return values[codes.view(-1, self.block_size).long()] * absmax[:, None]

    def choose(self, x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x.view(-1, self.block_size).abs().amax(dim=1),)

    def store_(self, x, chosen, codes, absmax) -> None:
        _, midpoints = map_tensors(self.signed, codes.device)
        grouped = x.view(-1, self.block_size)
        (amax,) = chosen
        normalized = grouped / torch.where(amax > 0, amax, 1.0)[:, None]
        if not self.signed:
            normalized = normalized.clamp(min=0.0)
        index = torch.bucketize(normalized, midpoints)
        index = index if self.signed else torch.where(normalized > 0, index.clamp(min=1), index)
        codes.view(-1, self.block_size).copy_(index.to(torch.uint8))
        absmax.copy_(amax)

    def bytes_per_element(self, param_dtype: torch.dtype) -> float:
        return 1 + 4 / self.block_size
