"""16-bit matrix products on CPUs without 16-bit GEMM instructions, as FP32 GEMMs rounded once.

Without AVX-512, torch runs BF16 and FP16 products in a scalar loop, 15 to 50 times slower than FP32.
The product of two BF16 (or FP16) numbers is exact in FP32, so an FP32 GEMM of the upcasts rounded
once is a 16-bit GEMM with FP32 accumulation, up to the order of the sum. `HF_LOWPREC_CPU_GEMM`:
unset or `native` (torch's kernels), `fp32` (these, any CPU), `auto` (these without AVX-512; the
test suite's setting); other dtypes keep torch's routine and bits (docs/numerics.md, "16-bit GEMMs").
"""

from __future__ import annotations

import os
import warnings

import torch

__all__ = ["ENV", "install", "install_if_asked", "installed", "wanted"]

ENV = "HF_LOWPREC_CPU_GEMM"
_CHOICES = ("native", "fp32", "auto")
_SIXTEEN = (torch.bfloat16, torch.float16)
_library: torch.library.Library | None = None


def wanted(value: str | None = None) -> bool:
    """Whether `value` (default: the environment's `HF_LOWPREC_CPU_GEMM`) asks for the FP32 GEMMs
    on this CPU; an unknown value raises, naming the valid ones."""
    value = (os.environ.get(ENV, "") if value is None else value).strip().lower() or "native"
    if value not in _CHOICES:
        raise ValueError(f"{ENV}={value!r}: choose one of {', '.join(_CHOICES)} (unset means native)")
    if value == "auto":
        return not torch.cpu._is_avx512_supported()
    return value == "fp32"


def installed() -> bool:
    return _library is not None


def install_if_asked() -> bool:
    """`install()` where `HF_LOWPREC_CPU_GEMM` asks for it; whether the FP32 GEMMs are in place."""
    if wanted():
        install()
    return installed()


def _sixteen(*tensors: torch.Tensor) -> torch.dtype | None:
    dtype = tensors[0].dtype
    return dtype if dtype in _SIXTEEN and all(t.dtype == dtype for t in tensors) else None


def _into(out: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    if out is None:
        return value
    if out.shape != value.shape:
        out.resize_(value.shape)
    return out.copy_(value)


def _product(a: torch.Tensor, b: torch.Tensor, batched: bool) -> torch.Tensor:
    """a·b by torch's own CPU routine (the in-place overload, beta = 0): its bits, any dtype."""
    shape = (*a.shape[:-1], b.shape[-1])
    zeros = a.new_zeros(shape)
    return torch.ops.aten.baddbmm_(zeros, a, b, beta=0) if batched else torch.ops.aten.addmm_(zeros, a, b, beta=0)


def _plus(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta, alpha, batched: bool) -> torch.Tensor:
    shape = (*a.shape[:-1], b.shape[-1])
    acc = bias.expand(shape).to(a.dtype, copy=True)
    update = torch.ops.aten.baddbmm_ if batched else torch.ops.aten.addmm_
    return update(acc, a, b, beta=beta, alpha=alpha)


def _mm(a, b, batched=False, out=None):
    dtype = _sixteen(a, b, *(() if out is None else (out,)))
    if dtype is None:
        return _into(out, _product(a, b, batched))
    return _into(out, _product(a.float(), b.float(), batched).to(dtype))


def _addmm(bias, a, b, beta=1, alpha=1, batched=False, out=None):
    dtype = _sixteen(bias, a, b, *(() if out is None else (out,)))
    if dtype is None:
        return _into(out, _plus(bias, a, b, beta, alpha, batched))
    return _into(out, _plus(bias.float(), a.float(), b.float(), beta, alpha, batched).to(dtype))


def install() -> None:
    """Replace the CPU kernels of `mm`, `bmm`, `addmm`, `baddbmm` (and their `out=` overloads) for
    the rest of the process; idempotent."""
    global _library
    if _library is not None:
        return
    library = torch.library.Library("aten", "IMPL")  # kernels of existing operators
    kernels = {
        "mm": lambda a, b: _mm(a, b),
        "mm.out": lambda a, b, *, out: _mm(a, b, out=out),
        "bmm": lambda a, b: _mm(a, b, batched=True),
        "bmm.out": lambda a, b, *, out: _mm(a, b, batched=True, out=out),
        "addmm": lambda c, a, b, *, beta=1, alpha=1: _addmm(c, a, b, beta, alpha),
        "addmm.out": lambda c, a, b, *, beta=1, alpha=1, out: _addmm(c, a, b, beta, alpha, out=out),
        "baddbmm": lambda c, a, b, *, beta=1, alpha=1: _addmm(c, a, b, beta, alpha, batched=True),
        "baddbmm.out": lambda c, a, b, *, beta=1, alpha=1, out: _addmm(c, a, b, beta, alpha, batched=True, out=out),
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
        for name, kernel in kernels.items():
            library.impl(name, kernel, "CPU")
    _library = library
