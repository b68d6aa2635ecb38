"""Kernel launches on the paths a GPU takes (hf_lowprec.testing.launches): the host issues each one
(5–30 µs), so per-tensor work is one compiled graph, not a chain of eager ops (issue #66).

Counted on CPU at the dispatcher: an eager operation that computes is one launch, a call of one of
the package's compiled graphs is one. Counts, not timings: the same on any machine.
"""

import pytest
import torch

from hf_lowprec.fp8.gradients import BackwardFP8Gradients, GradientAutoScaler
from hf_lowprec.fp8.linear import quantize_tensorwise
from hf_lowprec.testing.launches import Launches, launches_of

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_the_counter_counts_kernels_not_views_and_a_compiled_call_once():
    from hf_lowprec.compiling import compiled_region

    x = torch.randn(4, 6)
    with Launches() as counted:
        with counted.phase("a"):
            y = x.view(6, 4).t()[:2].unsqueeze(0)  # views: nothing runs
            y = y + 1  # one kernel
            x.mul_(2)  # one kernel
            x.t().reshape(-1)  # a copy (reshape of a transposed tensor): one kernel
        with counted.phase("b"), compiled_region("g"):
            (x * 3).abs().sum()  # three operations of one compiled graph
    assert counted.eager == {"a": 3}
    assert counted.graphs == {"b": 1}
    assert counted.total() == 4 and counted.total("b") == 1


@pytest.mark.parametrize("master_scale", [None, torch.tensor(0.25)])
def test_an_fp8_operand_is_one_graph(master_scale):
    """amax, scale, cast (and the master's rescale): one graph, no eager launch. Eagerly they were
    about 18 operations per operand (issue #66)."""
    x = torch.randn(64, 32)
    with Launches() as counted:
        quantize_tensorwise(x, E4M3, 0, master_scale)
    assert (counted.total(), dict(counted.graphs)) == (1, {"step": 1}), counted.summary()


class _Owner:
    """What FP8AdamW offers the hook: the stored FP8 gradient of a parameter."""

    def __init__(self):
        self.stored = {}

    def set_fp8_grad(self, param, payload, scale):
        self.stored[id(param)] = (payload.clone(), scale.clone())

    def fp8_grad(self, param):
        return self.stored.get(id(param))


def test_the_gradient_hook_is_one_graph_per_weight_with_accumulation_too():
    """The hook of O2's backward (quantize the weight gradient, add it to a stored one, count what
    saturates): one graph and the scaler's tally, not ~39 eager launches per weight."""
    weight = torch.nn.Parameter(torch.randn(32, 16))
    hooks = BackwardFP8Gradients(GradientAutoScaler(), E5M2)
    hooks.owner = _Owner()
    for accumulated in (False, True):  # the first micro-batch, then one added to it
        weight.grad = torch.randn(32, 16)
        with Launches() as counted:
            hooks._store(weight)
        assert counted.regions == {("step", "_gradient"): 1}, (accumulated, counted.summary())
        # The tally of saturated elements (one add); the owner's copy is the test's own.
        assert counted.eager["step"] <= 3, (accumulated, counted.summary())
        assert weight.grad is None


def test_o2_backward_quantizes_each_weight_gradient_in_one_graph():
    counted = launches_of("fp8-lm-o2", 2, fused="compiled")
    hooked = 2 * 4  # 2 blocks × 4 FP8 linears' weights (biases keep FP32 masters and gradients)
    assert counted.regions[("backward", "_gradient")] == hooked, counted.summary("backward")
    # Nothing quantizes a gradient eagerly anywhere in the step.
    assert not any("frexp" in op for _, op in counted.ops), counted.summary()
