"""`FP8CommState.prescale`, fp8-lm-o2's transport of an FP8 weight's gradient into DDP's FP16 bucket,
over accumulated micro-batches (no process group needed: it is local to a rank). The bucket
(`p.grad`, summed by autograd) must hold the sum of the micro-batches times the current σ, σ putting
the largest amax so far in (8, 16]; the 2-rank run is tests/distributed/test_o2_accumulation.py."""

import torch

from hf_lowprec.fp8.comm import FP8CommState
from hf_lowprec.fp8.gradients import GradientAutoScaler
from hf_lowprec.fp8.scaled import pow2_scale

FP16_MAX = 65504.0


def _bound(grads: list[torch.Tensor], sigma: float) -> torch.Tensor:
    """FP16 accumulation at σ: each product gₖ·σ, each sum and each rescale of the sum (a power of
    two: exact, or rounded under FP16's normal range) rounds once: 2⁻¹¹ of the value or half the
    subnormal step, 2⁻²⁵, in σ's units."""
    partial = torch.stack(grads).cumsum(0)
    return (
        2.0**-11 * (sum(g.abs() for g in grads) + partial.abs().sum(0)) + 3 * len(grads) * 2.0**-25 / sigma
    ).double()


def test_the_bucket_holds_the_sum_times_the_sigma_of_the_largest_micro_batch():
    """Micro-batches: all zero, tiny (2⁻³⁰), 2⁴⁰ times larger, small again. σ came from the first
    alone: 1 after the zero one (the tiny one flushed to 0 in FP16) and the large one overflowed FP16
    (inf). Now σ is the largest amax's and p.grad/σ is the FP64 sum within FP16's rounding."""
    gen = torch.Generator().manual_seed(0)
    scales = (0.0, 2.0**-30, 2.0**10, 2.0**-20)
    grads = [(torch.randn(64, 32, generator=gen) * s).bfloat16() for s in scales]
    weight = torch.nn.Parameter(torch.zeros(64, 32, dtype=torch.float16))
    state = FP8CommState(GradientAutoScaler())
    for grad in grads:  # as autograd accumulates what the sink returns
        sent = state.prescale(weight, grad).to(weight.dtype)
        weight.grad = sent if weight.grad is None else weight.grad + sent
    sigma = state.prescales[id(weight)]
    exact = sum(g.double() for g in grads)
    assert float(sigma) == float(
        pow2_scale(exact.new_tensor(max(float(g.abs().max()) for g in grads)), torch.float16, 12)
    )
    assert bool(torch.isfinite(weight.grad).all()), "a larger micro-batch overflowed FP16"
    error = (weight.grad.double() / sigma.double() - exact).abs()
    assert bool((error <= _bound([g.double() for g in grads], float(sigma))).all()), float(error.max())
    assert float(state.take_prescale(weight)) == float(sigma) and not state.peaks, "the hook's take keeps state"


def test_a_weight_used_twice_in_one_backward_sends_both_uses_at_one_sigma():
    """Autograd adds a weight's uses in one backward before `p.grad` sees them, out of the sink's
    reach: the use it runs second, 2⁶ times larger, goes at the first's σ (2¹² headroom), so the
    sum is in one σ's units; the next backward's micro-batch then moves the whole sum to its own σ."""
    weight = torch.nn.Parameter(torch.ones(16, dtype=torch.float16))
    state = FP8CommState(GradientAutoScaler())
    gen = torch.Generator().manual_seed(1)
    grads = [(torch.randn(16, generator=gen) * s).bfloat16() for s in (2.0**6, 1.0, 2.0**9)]
    order = []  # the uses in the order backward runs them

    class Use(torch.autograd.Function):
        @staticmethod
        def forward(ctx, w, k):
            ctx.k = k
            return w.float() * 1.0

        @staticmethod
        def backward(ctx, _):
            order.append(ctx.k)
            return state.prescale(weight, grads[ctx.k]), None

    (Use.apply(weight, 0).sum() + Use.apply(weight, 1).sum()).backward()
    assert order == [1, 0], order  # the later use first: the larger one runs second
    first = pow2_scale(grads[order[0]].float().abs().max(), torch.float16, 12)
    assert float(state.prescales[id(weight)]) == float(first)
    exact = grads[0].double() + grads[1].double()
    assert bool(((weight.grad.double() / float(first) - exact).abs() <= _bound(grads[:2], float(first))).all())
    Use.apply(weight, 2).sum().backward()  # the next micro-batch: its own backward
    sigma = float(state.prescales[id(weight)])
    assert sigma == float(pow2_scale(grads[2].float().abs().max(), torch.float16, 12))
    exact = exact + grads[2].double()
    assert bool(((weight.grad.double() / sigma - exact).abs() <= _bound(grads, sigma)).all())
