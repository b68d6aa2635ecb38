"""Scaled low-precision tensors: an FP8 (or FP16) payload plus an FP32 scale (FP8-LM §2).

One convention everywhere in `hf_lowprec.fp8`: real value = payload / scale. Scales are powers of
two chosen from the tensor's absolute maximum (`pow2_scale`), so only the cast to the payload
dtype rounds; casts saturate and keep an overflow visible as NaN (`saturating_cast`). The rules
are docs/algorithms.md §3.
"""

from __future__ import annotations

import dataclasses

import torch

from ..numerics import abs_max
from .cast import widen

__all__ = [
    "FORMATS",
    "FP8WeightCopy",
    "ScaledTensor",
    "count_saturated",
    "dequantize",
    "format_dtype",
    "format_max",
    "fp32_scale",
    "keep_nonzero",
    "pow2_scale",
    "get_fp8_weight_copy",
    "get_master_scale",
    "quantize",
    "quantize_counting",
    "saturated_count",
    "saturating_cast",
    "set_fp8_weight_copy",
    "set_master_scale",
    "tensor_amax",
]

#: Names accepted wherever a storage format is configured (options, optimizer groups).
FORMATS: dict[str, torch.dtype] = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
}

# FP32 exponents stay in the normal range, so a scale and its reciprocal are both finite.
_MAX_EXPONENT = 126


def format_dtype(fmt: str | torch.dtype) -> torch.dtype:
    """The dtype for a format name ("e4m3", "e5m2", "fp16", ...) or a dtype (returned as is)."""
    if isinstance(fmt, torch.dtype):
        if fmt not in FORMATS.values():
            raise ValueError(f"unsupported storage dtype {fmt}; use one of {sorted(FORMATS)}")
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"unknown storage format {fmt!r}; valid formats: {sorted(FORMATS)}")
    return FORMATS[fmt]


def format_max(dtype: torch.dtype) -> float:
    """Largest finite value of `dtype` (448 for E4M3, 57344 for E5M2, 65504 for FP16)."""
    return float(torch.finfo(dtype).max)


# The smallest positive code of each payload dtype (its smallest subnormal).
_SMALLEST_CODE = {
    torch.float8_e4m3fn: 2.0**-9,
    torch.float8_e5m2: 2.0**-16,
    torch.float16: 2.0**-24,
    torch.bfloat16: 2.0**-133,
}


def keep_nonzero(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A second moment's y = v·s before its cast to `dtype`: a non-zero |y| below the smallest code d
    (E4M3 2^-9, E5M2 2^-16, FP16 2^-24, BF16 2^-133), which would round to 0 or d, made ±d: v̂ ≥ v,
    never 0 for v > 0 (a stored v of 0 beside an m that is not would make AdamW's update m/ε).
    FP32 storage: y unchanged."""
    if dtype not in _SMALLEST_CODE:
        return y
    d = _SMALLEST_CODE[dtype]
    return torch.where(y != 0, y.abs().clamp(min=d).copysign(y), y)


def tensor_amax(x: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
    """max |x| in FP32: a scalar, or one value per group of `group_size` elements."""
    if group_size is None:
        return abs_max(x).float()
    return _grouped(x.detach(), group_size).abs().amax(dim=1).float()


def pow2_scale(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """s = 2^(floor(log2(max(dtype) / amax)) − margin), elementwise over `amax`.

    amax·s lands in (max/2^(margin+1), max/2^margin]; a power of two makes the scaling itself
    exact, so only the cast to the payload dtype rounds. Callers apply one scale per tensor or
    one per group of `group_size` consecutive elements (row-major; `tensor_amax`).
    The exponent comes from `torch.frexp`, which is exact: log2 rounding could put amax·s one
    ulp above the format maximum. amax = 0 or non-finite gives s = 1 (nothing to scale, or
    nothing a scale could fix). The exponent is clamped to ±126 so s and 1/s stay finite.
    """
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    amax = amax.float()
    usable = (amax > 0) & torch.isfinite(amax)
    ratio = format_max(dtype) / torch.where(usable, amax, torch.ones_like(amax))
    # For wide formats (FP32) the ratio can overflow; clamping keeps frexp's exponent meaningful.
    ratio = ratio.clamp_(max=torch.finfo(torch.float32).max)
    # frexp: ratio = m·2^e with m in [0.5, 1), so floor(log2(ratio)) = e − 1 exactly.
    _, exponent = torch.frexp(ratio)
    exponent = (exponent - 1 - margin).clamp(-_MAX_EXPONENT, _MAX_EXPONENT).float()
    return torch.where(usable, torch.exp2(exponent), torch.ones_like(amax))


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, group_size: int | None = None) -> torch.Tensor:
    """payload = saturate(x·s) cast to `dtype`; inf/NaN become NaN.

    Args:
        x: the real values (any floating dtype; the product is formed in FP32).
        scale: scalar, or one value per group when `group_size` is given.
        dtype: payload dtype (FP8 or a 16-bit float).
    """
    return saturating_cast(_apply_scale(x, scale, group_size, multiply=True), dtype)


def quantize_counting(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` plus the number of elements it clipped (see `count_saturated`), in one pass over x·s."""
    y = _apply_scale(x, scale, group_size, multiply=True)
    return saturating_cast(y, dtype), saturated_count(y, dtype)


def count_saturated(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, group_size: int | None = None
) -> torch.Tensor:
    """Number of finite elements with |x·s| > max(dtype), i.e. clipped by `quantize` (int64 tensor).

    Elements exactly at the maximum are not counted: they were represented, not clipped.
    """
    return saturated_count(_apply_scale(x, scale, group_size, multiply=True), dtype)


def dequantize(
    payload: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, group_size: int | None = None
) -> torch.Tensor:
    """real = payload / s, returned in `dtype` (the division is done in FP32)."""
    return _apply_scale(payload, scale, group_size, multiply=False).to(dtype)


def saturating_cast(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y (already scaled) cast to `dtype`, clamped to its finite range; NaN and ±inf become NaN.

    Finite values beyond the maximum become ±max (E4M3 has no infinity, and PyTorch's CPU and CUDA
    casts disagree on overflow), while inf and NaN become NaN so that an overflow upstream stays
    visible to the non-finite-gradient check.
    """
    limit = format_max(dtype)
    # clamp turns ±inf into ±max; adding y − y (0 when finite, NaN otherwise) restores NaN
    # for them in two cheap passes instead of an isfinite mask.
    return y.clamp(-limit, limit).add_(y - y).to(dtype)


def saturated_count(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """How many finite elements of the scaled y exceed `dtype`'s maximum (what the cast clips)."""
    magnitude = y.abs()
    return ((magnitude > format_max(dtype)) & (magnitude != float("inf"))).sum()


def _grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size <= 0 or x.numel() % group_size:
        raise ValueError(
            f"group_size must be a positive divisor of the tensor size, got {group_size} for {x.numel()} elements"
        )
    return x.reshape(-1, group_size)


def _apply_scale(x: torch.Tensor, scale: torch.Tensor, group_size: int | None, *, multiply: bool) -> torch.Tensor:
    # x.float() aliases an FP32 input, so every product here is out of place. FP8 payloads are
    # widened by table lookup (`cast.widen`, the same values as .float(), several times faster).
    scale = scale.to(device=x.device, dtype=torch.float32)
    if group_size is None:
        wide = widen(x, torch.float32)
        return wide * scale if multiply else wide / scale
    groups = widen(_grouped(x, group_size), torch.float32)
    out = groups * scale[:, None] if multiply else groups / scale[:, None]
    return out.reshape(x.shape)


@dataclasses.dataclass
class ScaledTensor:
    """A payload and its scale: real value = payload / scale.

    A convenience bundle: optimizer state holds payload and scale as plain tensors, so it loads
    with `torch.load(weights_only=True)`; this class is registered as a safe global for the same
    reason.

    Attributes:
        payload: low-precision values (FP8, FP16, ...), any shape.
        scale: FP32 scalar, or one value per group of `group_size` consecutive elements.
        group_size: None for one scale per tensor.
    """

    payload: torch.Tensor
    scale: torch.Tensor
    group_size: int | None = None

    @classmethod
    def quantize(
        cls,
        x: torch.Tensor,
        fmt: str | torch.dtype = "e4m3",
        *,
        margin: int = 0,
        group_size: int | None = None,
        scale: torch.Tensor | None = None,
    ) -> ScaledTensor:
        """Quantize `x` with the power-of-two amax scale (or the given `scale`)."""
        dtype = format_dtype(fmt)
        if scale is None:
            scale = pow2_scale(tensor_amax(x, group_size), dtype, margin)
        return cls(quantize(x, scale, dtype, group_size), scale.float(), group_size)

    @classmethod
    def zeros(
        cls,
        shape: torch.Size | tuple[int, ...],
        fmt: str | torch.dtype = "e4m3",
        *,
        group_size: int | None = None,
        device: torch.device | str | None = None,
    ) -> ScaledTensor:
        """All-zero payload with unit scale(s)."""
        dtype = format_dtype(fmt)
        payload = torch.zeros(shape, dtype=dtype, device=device)
        groups = () if group_size is None else (_grouped(payload, group_size).shape[0],)
        return cls(payload, torch.ones(groups, device=device), group_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The real values in `dtype`."""
        return dequantize(self.payload, self.scale, dtype, self.group_size)

    @property
    def shape(self) -> torch.Size:
        return self.payload.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.payload.dtype

    def nbytes(self) -> int:
        """Bytes held by payload and scale."""
        return self.payload.numel() * self.payload.element_size() + self.scale.numel() * self.scale.element_size()


torch.serialization.add_safe_globals([ScaledTensor])


# --- scaled master weights ------------------------------------------------------------
# FP8-LM O2 keeps the master weight *as* the model weight: an FP16 payload with a per-tensor
# scale (no second full-size copy). The module that consumes the weight (FP8Linear) owns the
# scale as a buffer and links it to its parameter under this attribute, so that the
# optimizer (FP8AdamW) can read and update it. The link is re-established on every forward
# because deepcopy and Module.to() drop or replace it.
_MASTER_SCALE_ATTR = "_hf_lowprec_master_scale"


def set_master_scale(param: torch.Tensor, scale: torch.Tensor | None) -> None:
    """Declare that `param` holds payload = real·scale (None: it holds the real values)."""
    if scale is None:
        if hasattr(param, _MASTER_SCALE_ATTR):
            delattr(param, _MASTER_SCALE_ATTR)
        return
    setattr(param, _MASTER_SCALE_ATTR, scale)


def fp32_scale(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """A master scale moved by a module's `.to()` (`after`, from `before`): `after` where it is
    still FP32, else `before` moved to `after`'s device in FP32 (a cast to FP16 made it inf)."""
    return after if after.dtype == torch.float32 else before.to(device=after.device, dtype=torch.float32)


def get_master_scale(param: torch.Tensor) -> torch.Tensor | None:
    """The FP32 scale of a scaled master weight, or None when `param` holds real values."""
    return getattr(param, _MASTER_SCALE_ATTR, None)


# --- the forward's FP8 weight, written by the optimizer step -------------------------------
# An FP8 layer that runs eagerly on a GPU links the E4M3 weight it cast to its scaled master
# under this attribute; FP8AdamW then writes the next one in the kernel that stores the master
# (`optim.rules.ScaledMasterFP8`) and records which master state it is the cast of
# (`mark_written`), and the layer takes it at the next forward instead of casting again.
_FP8_COPY_ATTR = "_hf_lowprec_fp8_weight"


@dataclasses.dataclass(eq=False)
class FP8WeightCopy:
    """payload = E4M3(real·scale) of a scaled master, as the layer's tensorwise cast with
    `margin` gives it, and which state of the master it is the cast of (`source`: the storage
    and version of the master and of its scale, taken when the layer cast it or the optimizer
    wrote it). Any other write to either (a loaded checkpoint, a rollback, an in-place edit, a
    swapped `.data`) makes `holds` false. `used`: a forward took it since the optimizer last
    wrote it (a model that no longer runs eagerly lets it go)."""

    payload: torch.Tensor
    scale: torch.Tensor
    margin: int
    source: tuple = ()
    used: bool = True

    def mark_cast(self, master: torch.Tensor) -> FP8WeightCopy:
        """The layer cast the copy from `master` as it is now."""
        self.source, self.used = _state_of(master), True
        return self

    def mark_written(self, master: torch.Tensor) -> None:
        """The optimizer wrote the copy from the master it just stored."""
        self.source, self.used = _state_of(master), False

    def holds(self, master: torch.Tensor) -> bool:
        """Whether the copy is the cast of `master` as it is now."""
        return self.source == _state_of(master)


def _state_of(master: torch.Tensor) -> tuple:
    scale = get_master_scale(master)
    return master.device, master.data_ptr(), master._version, scale.data_ptr(), scale._version


def set_fp8_weight_copy(param: torch.Tensor, copy: FP8WeightCopy | None) -> None:
    """Link `copy` to the master `param` (None: unlink)."""
    if copy is None:
        if hasattr(param, _FP8_COPY_ATTR):
            delattr(param, _FP8_COPY_ATTR)
        return
    setattr(param, _FP8_COPY_ATTR, copy)


def get_fp8_weight_copy(param: torch.Tensor) -> FP8WeightCopy | None:
    """The FP8 weight linked to the master `param` (`set_fp8_weight_copy`), or None."""
    return getattr(param, _FP8_COPY_ATTR, None)
