"""Gradual unfreezing of a 16-bit checkpoint as loaded, under the strategies with FP32 parameters.

A block frozen at `prepare_model` keeps its loaded 16 bits in its GEMM layers (autocast computes
with them either way: a frozen backbone keeps 2 bytes a weight). Unfrozen later, with
`optimizer.add_param_group`, its parameters were stepped in BF16, with no FP32 master: at lr 1e-5
only 15% of h.0.mlp.c_fc.weight's elements moved (the FP32 load: all of them), the rest of the
update rounded away. Now they are made FP32 as the group is added, before they have any optimizer
state (exact: every BF16 value is an FP32 value), and the run is its FP32 load's, bit for bit.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import hf_lowprec
from hf_lowprec.report import PrecisionPromiseError
from tests.helpers import assert_bits_equal, assert_same_losses, batches, tiny_gpt2

BLOCK = "transformer.h.0."


def _run(name: str, model: torch.nn.Module, lr: float = 1e-5) -> tuple[list[float], torch.nn.Module]:
    """Two steps with block h.0 frozen, then h.0 unfrozen (`add_param_group`) and two more steps."""
    for n, p in model.named_parameters():
        p.requires_grad_(not n.startswith(BLOCK))
    strategy = hf_lowprec.get_strategy(name)
    model = strategy.prepare_model(model)
    optimizer = strategy.create_optimizer([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for step, ids in enumerate(batches(4)):
        if step == 2:
            block = model.transformer.h[0].requires_grad_(True)
            optimizer.add_param_group({"params": list(block.parameters())})
        losses.append(strategy.train_step(model, ids, optimizer).item())
    return losses, model


@pytest.mark.parametrize("name", ["bf16-mixed", "fp16-mixed", "fp8-lm-o1", "fp8-lm-o2", "coat"])
def test_a_block_unfrozen_later_trains_as_its_fp32_load(name, caplog):
    loaded = tiny_gpt2().to(torch.bfloat16)  # as from_pretrained of a BF16 checkpoint
    as_fp32 = copy.deepcopy(loaded).float()  # from_pretrained(..., dtype=torch.float32) of it
    start = as_fp32.transformer.h[0].mlp.c_fc.weight.detach().clone()
    with caplog.at_level(logging.INFO, logger="hf_lowprec.strategies.adopt"):
        got, model = _run(name, loaded)
    expected, reference = _run(name, as_fp32)
    # The unfrozen block is FP32, as the FP32 load's; one log line names what was made FP32.
    assert {p.dtype for p in model.transformer.h[0].parameters()} == {torch.float32}
    assert f"{BLOCK}mlp.c_fc.weight" in caplog.text and "made FP32 (exact)" in caplog.text
    # The same values in the same dtypes under the same strategy: the same computation, bit for bit
    # (before, the BF16 run's c_fc weight kept 85% of its elements, off by the whole update).
    assert_same_losses(got, expected, name)
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_bits_equal(p.detach().float(), q.detach().float(), n)
    assert (model.transformer.h[0].mlp.c_fc.weight.detach() != start).float().mean() > 0.99  # every update kept


def test_a_16_bit_parameter_not_kept_at_prepare_is_refused_with_the_fix():
    """A BF16 head added after prepare_model under bf16-mixed was taken by `add_param_group` and stepped
    in BF16; it is refused before the group is added, naming the fix, and trains once prepared again."""
    strategy = hf_lowprec.get_strategy("bf16-mixed")
    model = strategy.prepare_model(tiny_gpt2())
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    head = torch.nn.Linear(64, 3).to(torch.bfloat16)
    with pytest.raises(
        PrecisionPromiseError, match=r"added or cast after prepare_model .*prepare_model\(model\) again"
    ):
        optimizer.add_param_group({"params": list(head.parameters())})
    assert len(optimizer.param_groups) == 1 and head.weight.dtype == torch.bfloat16
    model.extra_head = head
    strategy.prepare_model(model)
    optimizer.add_param_group({"params": list(head.parameters())})
    assert head.weight.dtype == torch.float32


def test_a_parameter_listed_twice_when_unfrozen_is_widened_once():
    # A tied weight listed per module reaches the optimizer twice (torch's AdamW warns and takes it):
    # it is widened once; the second listing raised AttributeError after the first was widened.
    for where in ("add_param_group", "create_optimizer"):
        strategy = hf_lowprec.get_strategy("bf16-mixed")
        model = tiny_gpt2().to(torch.bfloat16)
        for name, p in model.named_parameters():
            p.requires_grad_(not name.startswith("transformer.h.0."))
        model = strategy.prepare_model(model)
        block = model.transformer.h[0]
        rest = [p for p in model.parameters() if p.requires_grad]
        block.requires_grad_(True)
        twice = [*block.parameters(), block.attn.c_attn.weight]
        if where == "add_param_group":
            strategy.create_optimizer(rest, lr=1e-3).add_param_group({"params": twice})
        else:
            strategy.create_optimizer([{"params": rest}, {"params": twice}], lr=1e-3)
        assert all(p.dtype == torch.float32 for p in block.parameters()), where
