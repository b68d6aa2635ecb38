"""`model_state_bytes`: storage counted once, parameters counted by elements (issue 8 #7)."""

from __future__ import annotations

import pytest
import torch

from hf_lowprec.memory import model_state_bytes


def flat_model() -> torch.nn.Module:
    """Two Linear(64, 64) whose parameters (and gradients) are views of one flat buffer each,
    as ZeRO and FSDP lay them out: 2·(64·64 + 64) = 8320 parameters."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    flat, flat_grad = torch.zeros(total), torch.zeros(total)
    offset = 0
    for p in params:
        n = p.numel()
        flat[offset : offset + n].copy_(p.detach().reshape(-1))
        p.data = flat[offset : offset + n].view_as(p)
        p.grad = flat_grad[offset : offset + n].view_as(p)
        offset += n
    return model


def test_views_of_one_flat_buffer_are_counted_by_elements() -> None:
    # Regression: before, one parameter per storage was counted (4096 of 8320, the first
    # weight) and the whole buffer charged to it: 22.3 bytes/param instead of 12.
    model = flat_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad.fill_(1.0)
    optimizer.step()
    measured = model_state_bytes(model, optimizer)
    assert measured["num_params"] == 8320
    # FP32 parameter, FP32 gradient, FP32 momentum: 4 + 4 + 4.
    assert measured["params"] == measured["grads"] == measured["optimizer_states"] == 4.0
    assert measured["total"] == 12.0


def test_a_slice_counts_its_rows_not_the_whole_tensor() -> None:
    # Regression: a 10-row slice of a 1000-row FP32 tensor was charged the whole storage:
    # 4·1000·5/50 = 400 bytes of parameter (200 bytes/param in the layout).
    base = torch.zeros(1000, 5)
    param = torch.nn.Parameter(base[100:110])
    assert param.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    model = torch.nn.Module()
    model.weight = param
    measured = model_state_bytes(model)
    assert measured["num_params"] == 50 and measured["params"] == 4.0
    # Gradient not allocated yet: one FP32 element per parameter.
    assert measured["total"] == 8.0


def test_tied_and_overlapping_parameters_count_each_element_once() -> None:
    base = torch.zeros(100)
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(base[:60])
    model.b = torch.nn.Parameter(base[40:])  # elements 40..59 shared with `a`
    model.c = torch.nn.Parameter(base.view(10, 10)[:, :2])  # strided: covers elements 0..91
    measured = model_state_bytes(model)
    assert measured["num_params"] == 100
    assert measured["params"] == 4.0


def test_no_trainable_parameters_raise() -> None:
    model = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        model_state_bytes(model)


@pytest.mark.parametrize("name", ["bf16-pure", "bf16-mixed", "fp8-lm-o2", "collage-light"])
def test_the_plan_holds_every_byte_the_first_step_leaves(name):
    """The plan counts the 0-dim states the first step creates beside the per-element ones: each
    tensor's step count (FP64, torch AdamW's FP32) and an FP8 gradient's FP32 scale. It read 304 B
    of extra where bf16-pure's optimizer held 38 counts. Every figure is whole bytes: equal, no tolerance."""
    from tests.helpers import planned_and_measured

    planned, measured = planned_and_measured(name)
    n = measured["num_params"]
    assert planned["num_params"] == n
    for key in ("params", "grads", "optimizer_states", "extra"):
        assert round(planned[key] * n) == round(measured[key] * n), (name, key, planned, measured)
