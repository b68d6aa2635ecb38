"""The optimizers' CUDA steps (compiled Triton kernels where the family has one) against the CPU
step, which is the reference path: the compiled CPU kernels are bit-identical to the eager
reference (tests/optim/test_fastpath.py), so CPU = reference.

From identical parameters, states and gradients, three steps on each device. On CUDA, Triton may
contract a·b + c into an FMA and order the FP32 register arithmetic differently, so
Δθ = lr·(m̂/(√v̂+ε) + λθ) differs by a few FP32 roundings of a ratio of order 1 (≤ lr·2^-16
with a wide margin), and each stored parameter by at most one rounding of its dtype per step
(also where stochastic rounding draws different random bits). Bound after n steps, per element:
n·(ulp(θ) + lr·2^-16). A wrong kernel (a dropped compensation, a wrong bias correction) moves
elements by about lr = 1e-2, hundreds of ulps at these magnitudes.
"""

import pytest
import torch

from hf_lowprec.optim import CollageAdamW, FP8AdamW, FP32StatesAdamW, KahanAdamW, PlainAdamW, StochasticRoundingAdamW
from tests.cuda.conftest import requires_cuda

LR, STEPS = 1e-2, 3
FAMILIES = {
    "collage-plus": (torch.bfloat16, lambda ps: CollageAdamW(ps, lr=LR, weight_decay=0.1, variant="plus")),
    "collage-light": (torch.bfloat16, lambda ps: CollageAdamW(ps, lr=LR, weight_decay=0.1, variant="light")),
    "kahan": (torch.bfloat16, lambda ps: KahanAdamW(ps, lr=LR, weight_decay=0.1)),
    "plain-bf16": (torch.bfloat16, lambda ps: PlainAdamW(ps, lr=LR, weight_decay=0.1)),
    "plain-fp32": (torch.float32, lambda ps: PlainAdamW(ps, lr=LR, weight_decay=0.1)),
    "fp32-states": (torch.bfloat16, lambda ps: FP32StatesAdamW(ps, lr=LR, weight_decay=0.1)),
    "stochastic-rounding": (torch.bfloat16, lambda ps: StochasticRoundingAdamW(ps, lr=LR, weight_decay=0.1, seed=0)),
    "fp8-adamw": (torch.float16, lambda ps: FP8AdamW(ps, lr=LR, weight_decay=0.1)),
}
SHAPES = [(64, 48), (1000,), (7,)]


def ulp(t: torch.Tensor) -> torch.Tensor:
    """Spacing of t's dtype at |t| (the subnormal spacing near zero), in FP64."""
    info = torch.finfo(t.dtype)
    exponent = torch.frexp(t.double().abs().clamp(min=info.smallest_normal))[1]
    return torch.ldexp(torch.full_like(t, info.eps, dtype=torch.float64), exponent - 1)


def run(family: str, device: str) -> list[torch.Tensor]:
    dtype, build = FAMILIES[family]
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g).mul_(0.1).to(dtype).to(device).requires_grad_() for s in SHAPES]
    optimizer = build(params)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).mul_(1e-2).to(dtype).to(device)
        optimizer.step()
    return [p.detach().cpu() for p in params]


@pytest.mark.parametrize("family", [pytest.param(f, marks=requires_cuda) for f in FAMILIES])
def test_cuda_step_matches_the_cpu_reference(family):
    for ref, got in zip(run(family, "cpu"), run(family, "cuda")):
        assert got.dtype == ref.dtype
        bound = STEPS * (ulp(ref) + LR * 2.0**-16)
        err = (got.double() - ref.double()).abs()
        assert (err <= bound).all(), f"{family}: worst error/bound {(err / bound).max().item():.2f}"
