"""Device fixtures for the GPU checks (`make gpu-check` runs `pytest -m cuda`).

Tests take a `device` fixture: the CPU instance runs in `make test` and exercises the same code;
the CUDA instance carries the `cuda` marker and is skipped (reported as skipped) without a GPU.
"""

import pytest
import torch

from tests.helpers import requires_cuda

CUDA = pytest.param("cuda", marks=requires_cuda, id="cuda")


@pytest.fixture(params=["cpu", CUDA])
def device(request) -> torch.device:
    return torch.device(request.param)
