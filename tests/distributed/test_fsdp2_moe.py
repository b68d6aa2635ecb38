"""FSDP2 on Mixture-of-Experts models (issue #56, item 3): the FP8 experts' 3-D weights all-gather
as E4M3 with their whole tensor's scale, as the FP8 linear weights do (`hf_lowprec.fp8.sharded_weight`),
O2's expert masters stay scaled FP16 shards, and every FSDP2 strategy trains (one gloo rank: FSDP2's
collectives and the strategies' agreements run as on many ranks)."""

from __future__ import annotations

import pytest
import torch

from hf_lowprec.engines.fsdp2 import shard_model
from hf_lowprec.fp8 import grouped
from hf_lowprec.fp8.scaled import get_master_scale
from hf_lowprec.strategies.registry import get_strategy
from hf_lowprec.testing.moe import tiny_moe


def _train(name: str, steps: int = 4) -> tuple[list[float], torch.nn.Module]:
    strategy = get_strategy(name)
    model = shard_model(strategy, tiny_moe("qwen3_moe"))
    optimizer = strategy.create_optimizer(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        with strategy.forward_context():
            loss = model(input_ids=ids, labels=ids).loss
        strategy.scale_loss(loss).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("name", ["fp8-lm-o1", "fp8-lm-o2", "coat", "bf16-mixed"])
def test_fsdp2_trains_moe(one_rank_group, name):
    losses, _ = _train(name)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.5


def test_fsdp2_gathers_expert_weights_in_fp8(one_rank_group, monkeypatch):
    gathered: list[torch.dtype] = []
    original = grouped._fp8_weight

    def spy(recipe, weight, *args):
        if hasattr(weight, "fp8"):
            gathered.append(weight.fp8()[0].dtype)
        return original(recipe, weight, *args)

    monkeypatch.setattr(grouped, "_fp8_weight", spy)
    _, model = _train("fp8-lm-o2", steps=2)
    # Two layers × (gate_up, down) per forward, two forwards: every expert GEMM took the E4M3 gather.
    assert gathered == [torch.float8_e4m3fn] * 8
    experts = model.model.layers[0].mlp.experts
    for name in ("gate_up_proj", "down_proj"):
        param = getattr(experts, name)
        local = param.to_local()
        assert getattr(local, "_data", local).dtype == torch.float16  # the scaled FP16 master shard
        assert get_master_scale(param) is not None
