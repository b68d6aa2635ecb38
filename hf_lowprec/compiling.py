"""Whether `torch.compile` can build kernels on a device here (shared by every compiled path)."""

from __future__ import annotations

import functools
import shutil

__all__ = ["compiler_missing"]


@functools.cache
def compiler_missing(device_type: str) -> str | None:
    """Why compiled kernels cannot run on `device_type`, or None if they can."""
    if device_type == "cpu":
        from torch._inductor import config

        compiler = config.cpp.cxx[1] if isinstance(config.cpp.cxx, tuple) and config.cpp.cxx[1] else "g++"
        if not any(shutil.which(c) for c in (compiler, "g++", "c++", "clang++")):
            return "no C++ compiler on PATH"
        return None
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        try:
            usable = has_triton()
        except RuntimeError as error:  # a CUDA build of torch asked about a device it cannot reach
            return f"Triton cannot inspect the CUDA device ({error})"
        return None if usable else "Triton is not installed"
    return f"device type {device_type!r} has no Inductor backend here"
