"""Host syncs per training step: 0 for every strategy (issue #36), counted by `hf_lowprec.testing.syncs`.

A host sync (`.item()`, `bool(t)`, a data-dependent output size, a copy to the CPU) makes the
host wait for the GPU to drain its queue; one per step is enough to leave the GPU idle while
Python runs. These tests count them on CPU, where the same dispatcher operations run: one full
step (forward under the strategy's context, scaled backward, the strategy's optimizer step,
zero_grad) of GPT-2 from config at 2 and 8 layers, after two warm-up steps. The first step
may build state (optimizer states, FP8 scales, a compiled kernel): it is reported by
bench/bench_gpu_ready.py, not asserted here. `fused="auto"` is left as the strategies default
to: on CPU it picks the native C++ step, whose kernel reads its flags in C++ without a
dispatcher operation, hence without a sync.

The anchors check the counter itself: torch's own GradScaler with its fused AdamW (the design
the strategies follow) counts 0, and a planted `.item()` is counted once, at its line.
"""

import pytest
import torch

import hf_lowprec
from hf_lowprec import get_strategy
from hf_lowprec.engines.fsdp2 import fsdp2_support
from hf_lowprec.testing import DeviceTraffic, anchor_syncs, strategy_syncs

STRATEGIES = hf_lowprec.available_strategies()


@pytest.mark.parametrize("n_layer", [2, 8])
@pytest.mark.parametrize("name", STRATEGIES)
def test_a_steady_step_never_waits_on_the_device(name, n_layer):
    _, syncs = strategy_syncs(name, n_layer)
    listed = "\n".join(f"  {s}" for s in syncs)
    assert not syncs, f"{name}, {n_layer} layers: {len(syncs)} host syncs in one steady step (goal 0):\n{listed}"


@pytest.mark.parametrize("name", [n for n in STRATEGIES if fsdp2_support(get_strategy(n)) is None])
def test_fsdp2_adds_no_host_sync(name, one_rank_group):
    """Under FSDP2 (`shard_model`) a steady step still never waits on the device: the skip flag
    and loss-scaler decisions are all-reduced as device tensors, FP8-LM's weight and gradient
    scales agreed in one all-reduce of a device vector, nothing read back on the host."""
    _, syncs = strategy_syncs(name, 2, sharded=True)
    listed = "\n".join(f"  {s}" for s in syncs)
    assert not syncs, f"{name} under FSDP2: {len(syncs)} host syncs in one steady step (goal 0):\n{listed}"


# The one strategy whose experts keep FP32 GEMMs (fp32, the reference): torch's only fast grouped
# GEMM on a GPU is BF16, and any other dtype runs group by group from offsets read on the host,
# once per grouped GEMM (`testing.syncs`). No other sync is allowed. fp16-als paid them too until
# its FP16 experts took BF16 grouped GEMMs (`grouped_experts`).
WIDE_EXPERTS = {"fp32"}


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_steady_moe_step_never_waits_on_the_device(name):
    """A tiny Qwen3-MoE (`testing.counted_step.moe`: 2 MoE layers, transformers' default
    `grouped_mm` experts) under every strategy: no host sync (issue #67). bf16-mixed and
    fp16-mixed ran FP32 grouped GEMMs before (12 syncs a step on a GPU at this size)."""
    _, syncs = strategy_syncs(name, 2, model="moe")
    listed = "\n".join(f"  {s}" for s in syncs)
    if name in WIDE_EXPERTS:
        others = [s for s in syncs if not s.op.startswith("aten._grouped_mm")]
        assert len(syncs) == 12 and not others, f"{name}: {len(syncs)} host syncs in a MoE step:\n{listed}"
    else:
        assert not syncs, f"{name}: {len(syncs)} host syncs in one steady MoE step (goal 0):\n{listed}"


def test_the_anchor_torch_amp_with_fused_adamw_has_no_sync():
    traffic = anchor_syncs()
    assert not traffic.syncs, traffic.summary()


def test_the_counter_counts_a_planted_item_at_its_line():
    traffic = anchor_syncs(plant=lambda loss: loss.item())  # the planted sync
    assert len(traffic.syncs) == 1, traffic.summary()
    (event,) = traffic.syncs
    assert event.op == "aten._local_scalar_dense.default"
    line = test_the_counter_counts_a_planted_item_at_its_line.__code__.co_firstlineno + 1
    assert event.where[0] == f"tests/gpu/test_syncs.py:{line} <lambda>", event


def test_the_counter_sees_every_kind_of_sync():
    x = torch.randn(8)
    kinds = [
        lambda: x.sum().item(),
        lambda: bool(x.sum() > 0),
        lambda: torch.equal(x, x),
        lambda: x.nonzero(),
        lambda: x[x > 0],
        lambda: x.tolist(),
        lambda: x.numpy(),
        lambda: 1 if (x > 0).all() else 0,
    ]
    for kind in kinds:
        with DeviceTraffic() as traffic:
            kind()
        assert len(traffic.syncs) == 1, traffic.summary()
    with DeviceTraffic() as traffic:  # device-side work only: nothing to count
        torch.where(x > 0, x, 0).mul_(2).sum()
    assert not traffic.syncs, traffic.summary()
