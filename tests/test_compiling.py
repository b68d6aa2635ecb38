"""`hf_lowprec.compiling`: why compiled kernels cannot run on a device, never an exception."""

from __future__ import annotations

import torch.utils._triton as triton_utils

from hf_lowprec.compiling import compiler_missing


def test_a_cuda_build_that_cannot_reach_its_device_gets_a_reason(monkeypatch):
    # A CUDA build of torch on a machine without the driver: Triton's check asks the device
    # for its properties and raises (seen with torch 2.11 under the fake CUDA device of tests/gpu).
    def unreachable() -> bool:
        raise RuntimeError("Found no NVIDIA driver on your system")

    monkeypatch.setattr(triton_utils, "has_triton", unreachable)
    compiler_missing.cache_clear()
    try:
        assert "Found no NVIDIA driver" in compiler_missing("cuda")
    finally:
        compiler_missing.cache_clear()
