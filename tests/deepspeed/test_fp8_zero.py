"""fp8-lm-o3 in one process (no DeepSpeed): rank 0 owns every FP8 weight, so O3 is O2 exactly.

The 2-rank ZeRO runs of O3 are in test_zero.py and test_fp8_zero_ranks.py; the tests at the end
emulate DeepSpeed's per-group client calls in one process.
"""

import math
from pathlib import Path

import pytest
import torch

import hf_lowprec
from hf_lowprec import get_strategy
from hf_lowprec.engines.zero import zero_support
from hf_lowprec.fp8.scaled import dequantize
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


@pytest.mark.parametrize("fused", ["reference", "auto"])
def test_o3_steps_its_fp8_weights_through_the_optimizer_core_like_o2(fused):
    """FP8ZeroAdamW's FP8 weights go through the same buckets and fast paths as FP8AdamW's (no
    per-parameter loop): in one process every weight's bits equal O2's, and the same
    implementation ran for the same number of parameter steps."""
    data = batches(3)
    runs = []
    for name in ("fp8-lm-o2", "fp8-lm-o3"):
        strategy = hf_lowprec.get_strategy(name, fused=fused)
        model = strategy.prepare_model(tiny_gpt2())
        optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3, weight_decay=0.01)
        losses = train_steps(strategy, model, optimizer, data)
        runs.append((losses, model.state_dict(), dict(optimizer.optimizer.paths_taken)))
    (losses2, state2, paths2), (losses3, state3, paths3) = runs
    assert all(math.isfinite(v) for v in losses2) and losses2 == losses3
    for name, a in state2.items():
        b = state3[name]
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    assert paths3 == paths2 and sum(paths2.values()) > 0, (paths2, paths3)


def test_o3_state_carries_masters_and_refuses_another_world_size():
    strategy, model, optimizer = setup("fp8-lm-o3")
    train_steps(strategy, model, optimizer, batches(2))
    state = optimizer.state_dict()
    ours = state["fp8_zero"]
    first = optimizer.optimizer.fp8_params[0]
    payload, _scale = ours["masters"][0]
    assert payload.dtype == torch.float16 and torch.equal(payload, first.detach())
    assert ours["states"][0]["exp_avg"].dtype == torch.float8_e4m3fn
    wrong = dict(state, fp8_zero=dict(ours, owners=[i % 2 for i in range(len(ours["owners"]))]))
    with pytest.raises(ValueError, match="same number of ranks"):
        setup("fp8-lm-o3")[2].load_state_dict(wrong)


def test_o3_zero_stages():
    assert zero_support(get_strategy("fp8-lm-o3"), 1) is None and zero_support(get_strategy("fp8-lm-o3"), 2) is None
    assert "use ZeRO stage 1 or 2" in zero_support(get_strategy("fp8-lm-o3"), 3)


class FakeZero:
    """What FP8ZeroAdamW reads from DeepSpeed's ZeRO optimizer: its norm of the partitioned
    gradients (before its clipping) and `clip_grad`."""

    def __init__(self, clip: float) -> None:
        self.clip_grad = clip
        self._global_grad_norm = None


def two_group_o3(clip: float):
    strategy = hf_lowprec.get_strategy("fp8-lm-o3")
    model = strategy.prepare_model(tiny_gpt2())
    named = list(model.named_parameters())
    groups = [
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.01},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = strategy.create_optimizer(groups, lr=1e-3)
    zero = FakeZero(clip)
    optimizer.optimizer.attach_zero(zero)
    return strategy, model, optimizer, zero


def deepspeed_like_step(optimizer, zero) -> None:
    """What DeepSpeed's ZeRO step does around its client: the norm of the dense gradients, its
    own clipping of them by that norm alone, then one client step per group."""
    inner = optimizer.optimizer
    groups = list(inner.param_groups)
    dense = [p.grad for g in groups for p in g["params"] if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in dense]))
    zero._global_grad_norm = norm
    if zero.clip_grad > 0:
        factor = torch.clamp((norm + 1e-6) / zero.clip_grad, min=1.0)
        for g in dense:
            g.mul_(1.0 / factor)
    for group in groups:
        optimizer.param_groups = [group]
        optimizer.step()
    optimizer.param_groups = groups


def captured_step(clip: float, data):
    strategy, model, optimizer, zero = two_group_o3(clip)
    inner = optimizer.optimizer
    calls = []

    seen = set()

    def hook(opt, *_):
        # Once per client call (DeepSpeed's group): a nested super().step() of a hooked
        # FP8AdamW.step runs the instance's hooks again.
        key = id(opt.param_groups[0]["params"][0])
        if key in seen:
            return
        seen.add(key)
        dense = [
            p.grad.double().reshape(-1).clone() for g in opt.param_groups for p in g["params"] if p.grad is not None
        ]
        fp8 = [dequantize(*opt.fp8_grad(p), torch.float64).reshape(-1) for p in opt.fp8_params if opt.fp8_grad(p)]
        calls.append(dense + fp8)

    inner.register_step_pre_hook(hook)
    with strategy.forward_context():
        loss = model(input_ids=data, labels=data).loss
    loss.backward()
    deepspeed_like_step(optimizer, zero)
    return torch.cat([g for call in calls for g in call]), len(calls), float(zero._global_grad_norm), inner


def test_clipping_under_zero_covers_the_fp8_gradients_and_steps_fp8_once():
    """DeepSpeed calls the client once per group; the FP8 part (reduction, clipping coefficient,
    update) runs once, and the clipped gradients equal c·g for every gradient, dense and FP8,
    with c = C/(‖g‖ + 1e-6) over all of them (FP64 reference; 2^-20 relative: an FP32
    coefficient from FP32 norms, at most three roundings per gradient). The 2-rank version
    under real DeepSpeed is in test_fp8_zero_ranks.py."""
    data = batches(1)[0]
    free, calls, free_norm, inner = captured_step(0.0, data)
    clipped, _, clipped_norm, _ = captured_step(0.05, data)
    assert calls == 2
    assert all(inner.state[p]["step"] == 1 for p in inner.fp8_params)
    norm = float(torch.linalg.vector_norm(free))
    assert free_norm == pytest.approx(norm, rel=1e-6) and clipped_norm == pytest.approx(norm, rel=1e-6)
    c = 0.05 / (norm + 1e-6)
    assert c < 0.1
    nonzero = free != 0
    rel = ((clipped - c * free).abs()[nonzero] / (c * free).abs()[nonzero]).max()
    assert rel <= 2**-20 and torch.all(clipped[~nonzero] == 0)


def test_the_docs_say_clipping_under_zero_covers_the_fp8_gradients():
    """docs/distributed.md describes the clipping the test above checks (it once said the FP8
    weights' gradients were left unclipped under DeepSpeed)."""
    text = " ".join((Path(__file__).resolve().parents[2] / "docs" / "distributed.md").read_text().split())
    assert "not the FP8 weights' gradients" not in text
    assert "which the FP8 gradients take too (`FP8ZeroAdamW.clip_coefficient`)" in text


@pytest.mark.parametrize("noted", [False, True], ids=["unnoted", "noted-before-the-inf"])
def test_a_skipped_step_is_skipped_by_every_group_and_counted_once(noted):
    strategy, model, optimizer, zero = two_group_o3(0.0)
    data = batches(1)[0]
    with strategy.forward_context():
        model(input_ids=data, labels=data).loss.backward()
    if noted:  # a loop's finite pre-clip norm, noted before the gradient went bad: not the step's flag
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        strategy.note_grad_norm(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])), model.parameters())
    inner = optimizer.optimizer
    # A group's gradient (one process quantizes the FP8 weights' gradients in backward, flagging them there).
    next(p for g in inner.param_groups for p in g["params"] if p.grad is not None).grad.view(-1)[0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    deepspeed_like_step(optimizer, zero)
    assert strategy.skipped_steps == 1 and optimizer.step_was_skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not inner.fp8_grads()  # nothing left to leak into the next step


def test_after_load_state_dict_the_fp8_part_still_runs_once_per_step():
    # DeepSpeed's resume replaces the group dicts (torch's load_state_dict): the FP8 part must
    # still recognise the first group's call and follow the new groups' learning rates.
    strategy, model, optimizer, zero = two_group_o3(0.0)
    data = batches(2)
    for ids in data[:1]:
        with strategy.forward_context():
            model(input_ids=ids, labels=ids).loss.backward()
        deepspeed_like_step(optimizer, zero)
        optimizer.zero_grad(set_to_none=True)
    optimizer.load_state_dict(optimizer.state_dict())
    inner = optimizer.optimizer
    for group in optimizer.param_groups:
        group["lr"] = 0.0  # a scheduler writing into the new dicts: the FP8 weights follow
    before = [p.detach().clone() for p in inner.fp8_params]
    with strategy.forward_context():
        model(input_ids=data[1], labels=data[1]).loss.backward()
    deepspeed_like_step(optimizer, zero)
    assert all(inner.state[inner.fp8_params[i]]["step"] == 2 for i in inner.owned)
    assert all(torch.equal(a, b) for a, b in zip(before, inner.fp8_params))  # lr 0 (weight decay × lr = 0)
