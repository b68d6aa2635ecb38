"""COAT AdamW: both moments in per-group FP8 with dynamic range expansion (COAT §Part 1; docs/algorithms.md §4).

`COATAdamW` is a composition of the AdamW core; `quantize_state` stores one moment on its own,
outside the optimizer, as an `FP8GroupState`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from ..fp8.scaled import format_dtype
from ..numerics import LOW_PRECISION_DTYPES
from .adamw import AdamW, Composition
from .dispatch import FusedMode
from .formats import GroupFP8
from .rules import Grow, Nearest

__all__ = ["COATAdamW", "FP8GroupState", "dequantize_state", "quantize_state"]

_FP8_FORMATS = ("e4m3", "e5m2")


class COATAdamW(AdamW):
    """AdamW with FP8 per-group moments (dynamic range expansion) and FP32 or BF16+δθ masters.

    Args:
        params: FP32 parameters (FP32 masters), or BF16/FP16 parameters (Collage-light δθ).
        lr, betas, eps, weight_decay: as in `torch.optim.AdamW` (decoupled weight decay).
        group_size: elements per quantization group (COAT: 128).
        exp_avg_sq_format: "e4m3" (COAT default) or "e5m2" for v; m is always E4M3.
        expand: dynamic range expansion; False stores plain per-group FP8 (for comparison).
        fused: as `AdamW` ("auto", "native", "compiled", "reference"; same bits).

    m and v are `formats.GroupFP8` (E4M3, groups of 128, fresh per-group s, k, c every step; v
    may be E5M2). The update rule goes by the parameter's dtype: FP32 parameters take
    θ ← θ + Δθ in FP32 (COAT's FP32 masters); BF16/FP16 parameters are kept as the
    Collage-light pair (θ, δθ) and take Grow (`rules.Grow`), which COAT does not offer.

    State per parameter: "step"; for m ("exp_avg") and v ("exp_avg_sq") the FP8 payload (flat,
    padded to whole groups) and FP32 "_scale", "_exponent" (k), "_center" (c) per group;
    "param_error" δθ for BF16/FP16 parameters. All plain tensors, restored in their own dtypes.
    """

    param_dtypes: ClassVar[tuple[torch.dtype, ...] | None] = None
    extra_options: ClassVar[tuple[str, ...]] = ("group_size", "exp_avg_sq_format", "expand")

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        group_size: int = 128,
        exp_avg_sq_format: str = "e4m3",
        expand: bool = True,
        fused: FusedMode = "auto",
        **torch_arguments: Any,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            fused=fused,
            group_size=group_size,
            exp_avg_sq_format=exp_avg_sq_format,
            expand=expand,
            **torch_arguments,
        )

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        size = group["group_size"]
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"COATAdamW: group_size must be a positive integer, got {size!r} (COAT uses 128)")
        if group["exp_avg_sq_format"] not in _FP8_FORMATS:
            raise ValueError(
                f"COATAdamW: exp_avg_sq_format must be 'e4m3' or 'e5m2', got {group['exp_avg_sq_format']!r}"
            )
        if not isinstance(group["expand"], bool):
            raise ValueError(f"COATAdamW: expand must be True or False, got {group['expand']!r}")

    def composition(self, param: torch.Tensor, group: dict[str, Any]) -> Composition:
        size, expand = group["group_size"], group["expand"]
        m = GroupFP8(torch.float8_e4m3fn, size, expand)
        v = GroupFP8(format_dtype(group["exp_avg_sq_format"]), size, expand, keep_nonzero=True)
        return Composition(m, v, Grow() if param.dtype in LOW_PRECISION_DTYPES else Nearest())


@dataclasses.dataclass
class FP8GroupState:
    """One tensor stored in `GroupFP8`, with what decodes it: real = sign(q)·|q / scale|^(1/k)·c.

    Attributes:
        payload: FP8 codes, flat, padded to a multiple of `group_size`.
        scale: FP32 per group, payload = y·scale (y the expanded value).
        exponent: FP32 k per group (1 when not expanded).
        center: FP32 c per group (1 when not expanded).
        shape: shape of the original tensor.
        group_size: elements per group.
        expand: whether the dynamic range expansion was applied.
    """

    payload: torch.Tensor
    scale: torch.Tensor
    exponent: torch.Tensor
    center: torch.Tensor
    shape: tuple[int, ...]
    group_size: int = 128
    expand: bool = True

    @classmethod
    def zeros(
        cls,
        shape: torch.Size | tuple[int, ...],
        *,
        group_size: int = 128,
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
        expand: bool = True,
        device: torch.device | str | None = None,
    ) -> FP8GroupState:
        """The state of an all-zero tensor: zero codes, (s, k, c) = (1, 1, 1)."""
        codec = GroupFP8(fp8_dtype, group_size, expand)
        payload, scale, exponent, center = codec.zeros(torch.empty(math.prod(shape), device=device))
        return cls(payload, scale, exponent, center, tuple(shape), group_size, expand)

    def dequantize(self) -> torch.Tensor:
        """The decoded values, FP32, in the original shape."""
        codec = GroupFP8(self.payload.dtype, self.group_size, self.expand)
        y = codec.decode(self.payload, self.scale, self.exponent, self.center).reshape(-1)
        return y[: math.prod(self.shape)].view(self.shape)

    def nbytes(self) -> int:
        """Bytes held by the codes and the per-group metadata."""
        return sum(t.numel() * t.element_size() for t in (self.payload, self.scale, self.exponent, self.center))


torch.serialization.add_safe_globals([FP8GroupState])


def quantize_state(
    x: torch.Tensor,
    group_size: int = 128,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    expand: bool = True,
) -> FP8GroupState:
    """`x` stored in `GroupFP8(fp8_dtype, group_size, expand)`: flattened, zero-padded to whole groups
    (the format's tests and evidence, and the native `native.coat_step`, use one moment on its own).

    Args:
        x: any floating tensor (the arithmetic is FP32; FP64 inputs are rounded to FP32 first).
        group_size: G, consecutive elements sharing (s, k, c).
        fp8_dtype: torch.float8_e4m3fn (COAT's choice for both moments) or torch.float8_e5m2.
        expand: apply f(x) = sign(x)·(|x|/c)^k before scaling; False is plain per-group scaling.
    """
    codec = GroupFP8(fp8_dtype, group_size, expand)
    if not x.is_floating_point():
        raise ValueError(f"quantize_state takes a floating-point tensor, got {x.dtype}")
    state = FP8GroupState.zeros(
        tuple(x.shape), group_size=group_size, fp8_dtype=fp8_dtype, expand=expand, device=x.device
    )
    flat = torch.zeros(state.payload.numel(), dtype=torch.float32, device=x.device)
    flat[: x.numel()] = x.detach().reshape(-1)
    codec.encode_(flat, state.payload, state.scale, state.exponent, state.center)
    return state


def dequantize_state(state: FP8GroupState) -> torch.Tensor:
    """The FP32 values of `state`, in the shape of the tensor it was made from."""
    return state.dequantize()
