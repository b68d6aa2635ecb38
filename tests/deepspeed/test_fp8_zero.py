"""fp8-lm-o3 in one process (no DeepSpeed): rank 0 owns every FP8 weight, so O3 is O2 exactly.

The 2-rank ZeRO runs of O3 are in test_zero.py.
"""

import pytest
import torch

import hf_lowprec
from hf_lowprec.integrations.deepspeed import zero_support
from tests.helpers import batches, tiny_gpt2, train_steps


def setup(name):
    strategy = hf_lowprec.get_strategy(name)
    model = strategy.prepare_model(tiny_gpt2())
    return strategy, model, strategy.create_optimizer(model.parameters(), lr=1e-3, weight_decay=0.01)


def test_single_process_o3_is_o2_bit_for_bit():
    data = batches(4)
    s2, m2, o2 = setup("fp8-lm-o2")
    s3, m3, o3 = setup("fp8-lm-o3")
    assert train_steps(s2, m2, o2, data) == train_steps(s3, m3, o3, data)
    for (name, a), b in zip(m2.state_dict().items(), m3.state_dict().values()):
        assert torch.equal(a, b), name
    inner = o3.optimizer
    assert inner.world == 1 and inner.owned == list(range(len(inner.fp8_params)))
    # The FP8 GEMM weights are not in the groups DeepSpeed would partition.
    grouped = {id(p) for g in inner.param_groups for p in g["params"]}
    assert inner.fp8_params and not grouped & {id(p) for p in inner.fp8_params}
    assert s3.metrics()["precision/fp8_grad_mu"] == s2.metrics()["precision/fp8_grad_mu"]


def test_o3_state_carries_masters_and_refuses_another_world_size():
    strategy, model, optimizer = setup("fp8-lm-o3")
    train_steps(strategy, model, optimizer, batches(2))
    state = optimizer.state_dict()
    ours = state["fp8_zero"]
    first = optimizer.optimizer.fp8_params[0]
    payload, scale = ours["masters"][0]
    assert payload.dtype == torch.float16 and torch.equal(payload, first.detach())
    assert ours["states"][0]["exp_avg"].dtype == torch.float8_e4m3fn
    wrong = dict(state, fp8_zero=dict(ours, owners=[i % 2 for i in range(len(ours["owners"]))]))
    with pytest.raises(ValueError, match="same number of ranks"):
        setup("fp8-lm-o3")[2].load_state_dict(wrong)


def test_o3_zero_stages():
    assert zero_support("fp8-lm-o3", 1) is None and zero_support("fp8-lm-o3", 2) is None
    assert "use ZeRO stage 1 or 2" in zero_support("fp8-lm-o3", 3)
