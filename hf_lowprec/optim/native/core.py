"""The native kernels' build, their ISA, and the one entry point `step` (see `optim.native`)."""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ..scalars import adamw_scalars as _adamw_scalars
from . import build_lock

__all__ = [
    "ISAS",
    "ISA_ENV",
    "Declaration",
    "adamw_scalars",
    "best_isa",
    "check",
    "declaration",
    "forced_isa",
    "isa",
    "native_unavailable",
    "step",
]

#: Instruction sets the kernels are built for, widest first.
ISAS: tuple[str, ...] = ("avx512_bf16", "avx512", "avx2", "scalar")
_ISA_CODES = {"scalar": 0, "avx2": 1, "avx512": 2, "avx512_bf16": 3}
ISA_ENV = "HF_LOWPREC_CPU_ISA"

_CSRC = Path(__file__).with_name("csrc")
# The reference's operations, written once over a small vector-traits layer and compiled four times,
# each instruction set in its own translation unit (a target pragma), so one build serves every
# x86-64 CPU: AVX-512 with AVX512-BF16, AVX-512 (16 lanes), AVX2 + F16C (8 lanes) and scalar.
# Vector bodies and the scalar tail run one template: results do not depend on the ISA, the thread
# count or an element's position (the tests check every ISA the CPU runs bit for bit). Conversions
# round to nearest even: FP32 -> BF16 with the integer rounding PyTorch's cast uses (NaN -> 0xFFFF
# like its vectorised cast); AVX512-BF16's `vcvtneps2bf16` gives the same bits except on subnormal
# inputs (flushed) and NaN, so that build uses it only for vectors with neither; FP16 with F16C's
# conversions (IEEE); FP8 E4M3/E5M2 with an exact integer rounding, PyTorch's saturation and NaN codes.
_SOURCES = ("bindings.cpp", "isa_scalar.cpp", "isa_avx2.cpp", "isa_avx512.cpp", "isa_avx512bf16.cpp")
# No -std=: the standard torch passes stands (C++20; torch 2.14's headers refuse C++17).
# -ffp-contract=off: no a·b + c fused into an FMA (the references round the product);
# -fno-fast-math: IEEE semantics; -fno-math-errno only lets sqrtf inline as the instruction;
# -fopenmp: `at::parallel_for` is an inline OpenMP region, serial without it. The library it links
# is the libgomp.so.1 that PyTorch has already loaded (same soname), so the kernels share
# PyTorch's thread pool and `torch.set_num_threads`.
_CFLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno", "-fopenmp")
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
    name = "hf_lowprec_native_optim"
    try:
        with build_lock.claim(build_lock.build_directory(name)):  # a killed build's lock: cleared
            module = cpp_extension.load(
                name=name,
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

    The first call builds (or loads the cached build of) the extension: `torch.utils.cpp_extension.load`
    (ninja and a C++20 compiler), cached under `TORCH_EXTENSIONS_DIR` (`make` and the tests put it
    under build/); the sources ship in the wheel (package data `csrc/*`). A missing compiler or a
    failed build does not raise: the reason is returned, for the caller to log once and fall back.
    """
    return _load()[1]


def _module() -> ModuleType:
    module, reason = _load()
    if module is None:
        raise RuntimeError(f"hf_lowprec native optimizer kernels unavailable: {reason}")
    return module


def best_isa() -> str:
    """The widest instruction set this CPU supports ("avx512_bf16", "avx512", "avx2" or "scalar"),
    whatever `HF_LOWPREC_CPU_ISA` says."""
    return _module().best_isa()


def forced_isa() -> str | None:
    """The instruction set `HF_LOWPREC_CPU_ISA` forces (None when unset); ValueError naming the
    valid ones for any other value. Builds nothing: the optimizers check it when they are built."""
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if forced and forced not in _ISA_CODES:
        raise ValueError(f"{ISA_ENV}={forced!r}: choose one of {', '.join(ISAS)} (or unset it)")
    return forced or None


def isa() -> str:
    """The instruction set the kernels run with: `HF_LOWPREC_CPU_ISA` if set, else `best_isa()`
    (each is tested bit for bit). Forcing an ISA the CPU lacks is an error, not a silent fallback."""
    return forced_isa() or best_isa()


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


@dataclasses.dataclass(frozen=True)
class Declaration:
    """A family as the kernels know it: the `native_name` of its m format, v format and rule,
    their options (named prefix_option: "exp_avg_group_size", "exp_avg_sq_margin", …) and the
    tensors the whole call shares (the 8-bit maps).

    In C++ each format and rule is a small struct (decode / encode, read / apply) that one step
    template combines; the formats' layouts pick one of three loops (element-wise; two passes for
    a per-tensor scale; per group). Adding a family takes 2 places: its composition in Python, and
    one line in `csrc/kernels_impl.h`'s `Families` (its tags, and the storage dtypes it runs); a
    new format or rule adds its struct there and its tensors' names in `csrc/bindings.cpp`."""

    m: str
    v: str
    rule: str
    options: Mapping[str, int] = dataclasses.field(default_factory=dict)
    shared: Mapping[str, Sequence[torch.Tensor]] = dataclasses.field(default_factory=dict)


def declaration(m_format: Any, v_format: Any, rule: Any) -> Declaration | str:
    """The declaration of (m format, v format, rule) (`formats.Format`, `rules.Rule`), or why the
    kernels have none (a format or rule without a `native_name`)."""
    names = (m_format.native_name, v_format.native_name, rule.native_name)
    if None in names:
        parts = zip(("m", "v", "rule"), (m_format, v_format, rule), names, strict=True)
        return "no native kernel for " + ", ".join(f"{what} {item!r}" for what, item, name in parts if name is None)
    options = {**m_format.native_options("exp_avg"), **v_format.native_options("exp_avg_sq"), **rule.native_options()}
    shared = {**m_format.native_shared("exp_avg"), **v_format.native_shared("exp_avg_sq")}
    return Declaration(*names, options, shared)


Named = Mapping[str, Sequence[torch.Tensor | None]]


def _arguments(declared: Declaration, tensors: Named) -> tuple:
    named = {name: list(values) for name, values in tensors.items()}
    shared = {name: list(values) for name, values in declared.shared.items()}
    return declared.m, declared.v, declared.rule, dict(declared.options), named, shared


def step(
    declared: Declaration,
    tensors: Named,
    scalars: torch.Tensor,
    *,
    found_inf: torch.Tensor | None = None,
    isa: str | None = None,
) -> None:
    """One AdamW step in place over a bucket of parameters of the declared family.

    The call splits its whole bucket into blocks of 32768 elements and runs them on ATen's
    intra-op pool (`at::parallel_for`: OpenMP in PyTorch's CPU builds, sized by
    `torch.set_num_threads`); a bucket under 32768 elements runs on the calling thread.

    Args:
        declared: the family (`declaration`).
        tensors: per name, one tensor per parameter: "param", "grad", "grad_scale" (None unless
            the gradient is FP8), then the composition's stored names (`optim.adamw.Composition.stored_names`)
            and "seed" for stochastic rounding (one-element int64). Contiguous CPU tensors; a name
            the family does not read is an error, as is a missing one.
        scalars: (n, 6) FP32, one row of `adamw_scalars` per parameter.
        found_inf: None, or a one-element floating CPU tensor: the kernel checks its arguments,
            reads the flag once and, when it is nonzero (NaN included), writes nothing.
        isa: overrides `isa()`.
    """
    _module().step(*_arguments(declared, tensors), scalars, found_inf, _isa_code(isa))


def check(declared: Declaration, tensors: Named, scalars: torch.Tensor, *, isa: str | None = None) -> str | None:
    """Why `step` would refuse these arguments (its first error message), or None."""
    return _module().check(*_arguments(declared, tensors), scalars, _isa_code(isa)) or None
