"""What a loop written for Accelerate calls besides the plugin's three lines, after `plugin.prepare`:
nested and separately prepared LR schedulers, `accelerator.clip_grad_value_`, `clip_grad_norm_`'s
norm_type, the skipped step Accelerate's scheduler must see, and `accelerator.load_state` of a
checkpoint saved without a strategy."""

from __future__ import annotations

import copy
import logging
import math
import pickle
import warnings

import pytest
import torch
from accelerate import Accelerator
from torch.optim.lr_scheduler import ChainedScheduler, CosineAnnealingLR, ExponentialLR, LinearLR, SequentialLR
from transformers import get_linear_schedule_with_warmup

from hf_lowprec.fp8.cast import widen
from hf_lowprec.integrations.accelerate import PrecisionPlugin
from tests.helpers import batches, tiny_gpt2


def _groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    return [{"params": decay, "weight_decay": 0.01}, {"params": [p for p in model.parameters() if p.dim() < 2]}]


def _after_backward(name):
    """A fresh Accelerator and plugin, the model and optimizer prepared, one backward done."""
    accelerator = Accelerator(cpu=True)
    plugin = PrecisionPlugin(name)
    model = tiny_gpt2()
    model, optimizer = plugin.prepare(accelerator, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    batch = batches(1)[0]
    plugin.backward(accelerator, model(input_ids=batch, labels=batch).loss)
    return accelerator, plugin, model, optimizer


def _fp8_held(optimizer, model):
    """O2's FP8 gradients as (payload, scale), held by FP8AdamW beside `p.grad`."""
    inner = optimizer.optimizer.optimizer  # AcceleratedOptimizer → StrategyOptimizer → FP8AdamW
    return [g for g in (inner.fp8_grad(p) for p in model.parameters()) if g is not None]


def _stock_schedule(model, build, steps=4):
    """Each group's learning rate after each of `steps` steps of torch's AdamW under `build(optimizer)`."""
    reference = torch.optim.AdamW(_groups(model), lr=1e-3)
    schedule = build(reference)
    expected = []
    for _ in range(steps):
        reference.step()
        schedule.step()
        expected.append([g["lr"] for g in reference.param_groups])
    return expected


_COMPOSITES = {
    "sequential": lambda opt: SequentialLR(
        opt, [LinearLR(opt, 0.1, 1.0, total_iters=2), CosineAnnealingLR(opt, T_max=4)], milestones=[2]
    ),
    "chained": lambda opt: ChainedScheduler([LinearLR(opt, 0.1, 1.0, total_iters=2), ExponentialLR(opt, 0.5)]),
}


@pytest.mark.parametrize("kind", sorted(_COMPOSITES))
def test_schedulers_nested_in_a_composite_drive_the_strategys_optimizer(kind):
    # The children of SequentialLR / ChainedScheduler kept the replaced AdamW: lr stuck at 1e-4.
    model = tiny_gpt2()
    expected = _stock_schedule(model, _COMPOSITES[kind])

    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(_groups(model), lr=1e-3)
    model, optimizer, scheduler = PrecisionPlugin("collage-plus").prepare(
        accelerator, model, optimizer, _COMPOSITES[kind](optimizer)
    )
    seen = []
    for _ in range(4):
        optimizer.step()  # no gradients: nothing moves, the schedule is what is tested
        scheduler.step()
        seen.append([g["lr"] for g in optimizer.optimizer.param_groups])
    assert seen == expected
    assert all(child.optimizer is optimizer.optimizer for child in scheduler.scheduler._schedulers)


def test_a_scheduler_prepared_in_a_later_call_follows_the_strategys_optimizer():
    model = tiny_gpt2()
    reference = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = get_linear_schedule_with_warmup(reference, 0, 4)
    expected = []
    for _ in range(3):
        reference.step()
        schedule.step()
        expected.append(reference.param_groups[0]["lr"])

    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, 4)
    model, optimizer = PrecisionPlugin("collage-plus").prepare(accelerator, model, optimizer)
    scheduler = accelerator.prepare(scheduler)  # built on the replaced AdamW, prepared afterwards
    assert scheduler.scheduler.optimizer is optimizer.optimizer and scheduler.optimizers == [optimizer]
    seen = []
    for _ in range(3):
        optimizer.step()
        scheduler.step()
        seen.append(optimizer.optimizer.param_groups[0]["lr"])
    assert seen == expected


@pytest.mark.parametrize("warmup", [0, 2])
def test_a_scheduler_never_prepared_still_sets_the_strategys_learning_rate(warmup):
    # Accelerate's wrapper steps the user's own optimizer, so a scheduler left out of prepare works
    # there; it set the learning rate of the AdamW the strategy replaced (the schedule was lost).
    model = tiny_gpt2()
    expected = _stock_schedule(model, lambda opt: get_linear_schedule_with_warmup(opt, warmup, 5))

    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(_groups(model), lr=1e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, warmup, 5)
    model, prepared = PrecisionPlugin("collage-plus").prepare(accelerator, model, optimizer)
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "lr_scheduler.step() before optimizer.step()" included
        for _ in range(4):
            prepared.step()
            scheduler.step()
            seen.append([g["lr"] for g in prepared.optimizer.param_groups])
    assert seen == expected
    assert scheduler.optimizer is prepared.optimizer
    pickle.loads(pickle.dumps(optimizer))  # the user's AdamW is left as it was
    copy.deepcopy(scheduler)


def test_clip_grad_value_clamps_the_unscaled_gradients():
    # fp16-mixed scales the loss by 2**16: the stock clip_grad_value_ clamped the scaled gradients.
    C = 1e-3
    accelerator, _, model, _ = _after_backward("fp16-mixed")
    accelerator.clip_grad_value_(model.parameters(), C)
    _, plugin, model_b, optimizer_b = _after_backward("fp16-mixed")
    plugin.strategy.unscale_gradients(optimizer_b.optimizer)
    torch.nn.utils.clip_grad_value_(model_b.parameters(), C)
    clamped = 0
    for a, b in zip(model.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
        clamped += int((a.grad.abs() == torch.tensor(C, dtype=a.grad.dtype)).sum())
    assert clamped  # some gradients were above C: the comparison saw clamping


def test_clip_grad_value_past_fp16s_largest_value_clamps_nothing():
    """fp16-als's gradients are FP16: a bound of 1e5 (above 65504) raised "value cannot be converted
    to type c10::Half without overflow". No FP16 value exceeds it: the unscaled gradients, bit for bit."""
    accelerator, _, model, _ = _after_backward("fp16-als")
    accelerator.clip_grad_value_(model.parameters(), 1e5)
    _, plugin, model_b, optimizer_b = _after_backward("fp16-als")
    plugin.strategy.unscale_gradients(optimizer_b.optimizer)
    for a, b in zip(model.parameters(), model_b.parameters(), strict=True):
        assert a.grad.dtype == torch.float16 and torch.equal(a.grad, b.grad)


def test_clip_grad_value_clamps_o2s_fp8_held_gradients():
    C = 1e-3
    accelerator, _, model, optimizer = _after_backward("fp8-lm-o2")
    before = [(widen(payload, torch.float32).clone(), scale.clone()) for payload, scale in _fp8_held(optimizer, model)]
    assert before
    accelerator.clip_grad_value_(model.parameters(), C)
    assert all(p.grad.abs().max() <= C for p in model.parameters() if p.grad is not None)
    after = _fp8_held(optimizer, model)
    clamped = 0
    for (old, old_scale), (payload, scale) in zip(before, after, strict=True):
        assert torch.equal(scale, old_scale)  # the payload is clamped, the scale kept
        # The largest FP8 value v with v / scale <= C, from the format's 256 codes.
        grid = torch.arange(256, dtype=torch.uint8).view(payload.dtype).float()
        bound = C * scale.float()
        limit = grid[grid.isfinite() & (grid <= bound)].max()
        expected = torch.where(old.abs() <= limit, old, old.sign() * limit)
        assert torch.equal(widen(payload, torch.float32), expected)
        clamped += int((old.abs() > limit).sum())
    assert clamped


@pytest.mark.parametrize("name", ["fp16-mixed", "fp8-lm-o2"])
def test_clip_grad_norm_takes_norm_type_inf(name):
    # The strategies' own clipping measured L2 whatever norm_type said.
    accelerator, plugin, model, optimizer = _after_backward(name)
    plugin.strategy.unscale_gradients(optimizer.optimizer)
    peaks = [p.grad.float().abs().max() for p in model.parameters() if p.grad is not None]
    fp8 = _fp8_held(optimizer, model) if name == "fp8-lm-o2" else []
    peaks += [widen(payload, torch.float32).abs().max() / scale for payload, scale in fp8]
    expected = torch.stack(peaks).max()
    max_norm = float(expected) / 4
    assert torch.equal(accelerator.clip_grad_norm_(model.parameters(), max_norm, norm_type=math.inf), expected)
    after = accelerator.clip_grad_norm_(model.parameters(), math.inf, norm_type=math.inf)  # measures only
    # c = max_norm / (norm + 1e-6) lies 1e-6 / norm (> 2**-16 here) below max_norm / norm; O2's FP8
    # values are payload / (scale / c), two FP32 roundings, 2**-23 each, within that margin.
    assert max_norm * (1 - 1e-4) < float(after) <= max_norm
    with pytest.raises(ValueError, match="norm_type 2 or inf"):
        accelerator.clip_grad_norm_(model.parameters(), 1.0, norm_type=1)


def test_a_skipped_step_holds_accelerates_scheduler_and_says_so():
    accelerator = Accelerator(cpu=True)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, 10)
    plugin = PrecisionPlugin("collage-plus")
    model, optimizer, scheduler = plugin.prepare(accelerator, model, optimizer, scheduler)
    rows = []
    for i, batch in enumerate(batches(3)):
        plugin.backward(accelerator, model(input_ids=batch, labels=batch).loss)
        if i == 1:
            next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        rows.append((accelerator.optimizer_step_was_skipped, scheduler.get_last_lr()[0]))
    assert [skipped for skipped, _ in rows] == [False, True, False]
    assert plugin.strategy.skipped_steps == 1
    lrs = [lr for _, lr in rows]
    assert lrs[1] == lrs[0] == 1e-3 * 9 / 10 and lrs[2] == 1e-3 * 8 / 10  # the schedule held at the skip


@pytest.fixture(scope="module")
def stock_checkpoint(tmp_path_factory):
    """`accelerator.save_state` of a loop without a precision strategy, after one step."""
    accelerator = Accelerator(cpu=True)
    model = tiny_gpt2()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(_groups(model), lr=1e-3))
    batch = batches(1)[0]
    accelerator.backward(model(input_ids=batch, labels=batch).loss)
    optimizer.step()
    path = tmp_path_factory.mktemp("stock")
    accelerator.save_state(str(path))
    return path


@pytest.mark.parametrize("name", ["collage-plus", "fp16-als"])
def test_load_state_of_a_stock_checkpoint_is_refused(stock_checkpoint, name):
    # collage-plus crashed with KeyError('variant'); fp16-als loaded, its loss scaler's state lost.
    accelerator = Accelerator(cpu=True)
    model = tiny_gpt2()
    model, optimizer = PrecisionPlugin(name).prepare(accelerator, model, torch.optim.AdamW(_groups(model), lr=3e-3))
    before = {
        i: {k: torch.as_tensor(v).clone() for k, v in s.items()} for i, s in optimizer.state_dict()["state"].items()
    }
    with pytest.raises(ValueError, match="no 'hf_lowprec' entry: it was saved without a precision strategy") as error:
        accelerator.load_state(str(stock_checkpoint))
    assert f"precision strategy {name!r}" in str(error.value) and "model.safetensors" in str(error.value)
    after = optimizer.state_dict()["state"]  # the optimizer is as prepare left it
    assert before.keys() == after.keys() and [g["lr"] for g in optimizer.param_groups] == [3e-3, 3e-3]
    assert all(torch.equal(v, torch.as_tensor(after[i][k])) for i, s in before.items() for k, v in s.items())


def test_load_state_of_a_stock_checkpoint_loads_where_the_strategy_takes_adamws_state(stock_checkpoint, caplog):
    accelerator = Accelerator(cpu=True)
    model = tiny_gpt2()
    model, optimizer = PrecisionPlugin("bf16-mixed").prepare(accelerator, model, torch.optim.AdamW(_groups(model)))
    with caplog.at_level(logging.WARNING):
        accelerator.load_state(str(stock_checkpoint))
    assert "no 'hf_lowprec' entry" in caplog.text and "starts afresh" in caplog.text
    saved = torch.load(stock_checkpoint / "optimizer.bin", weights_only=True)
    loaded = optimizer.state_dict()
    assert saved["state"].keys() == loaded["state"].keys()
    for index, state in saved["state"].items():
        assert torch.equal(loaded["state"][index]["exp_avg"], state["exp_avg"])


def _accumulate_and_clip(name, clip, every):
    """Two steps of two micro-batches, clipping (at a bound that clips nothing) on every micro-step
    or, as Accelerate's docs do, only where `accelerator.sync_gradients`: the weights and the norms."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    plugin = PrecisionPlugin(name)
    model = tiny_gpt2()
    model, optimizer = plugin.prepare(accelerator, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    norms = []
    for ids in batches(4):
        with accelerator.accumulate(model):
            plugin.backward(accelerator, model(input_ids=ids, labels=ids).loss)
            if every or accelerator.sync_gradients:
                if clip == "norm":
                    norms.append(accelerator.clip_grad_norm_(model.parameters(), 1e6))
                else:
                    accelerator.clip_grad_value_(model.parameters(), 1e6)
            optimizer.step()
            optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()], norms


@pytest.mark.parametrize(("name", "clip"), [("fp16-mixed", "norm"), ("fp16-mixed", "value"), ("fp16-als", "norm")])
def test_clipping_on_a_micro_step_that_does_not_sync_leaves_the_gradients_alone(name, clip):
    # Unscaled on the first micro-step, the gradients took the second's scaled ones on top:
    # fp16-mixed's sync-step norms were 49809 and 52324 (not 1.04, 0.93), its weights 0.0079 off.
    weights, norms = _accumulate_and_clip(name, clip, every=False)
    weights_every, norms_every = _accumulate_and_clip(name, clip, every=True)
    assert all(torch.equal(a, b) for a, b in zip(weights, weights_every, strict=True))
    if clip == "norm":
        assert len(norms) == 2 and len(norms_every) == 4
        assert all(torch.equal(a, b) for a, b in zip(norms, norms_every[1::2], strict=True))
        # A micro-step's norm is that of the (unscaled) gradients so far: of the order of the step's.
        assert all(0.1 < float(n) < 10 for n in norms_every)


@pytest.mark.parametrize("name", ["fp16-mixed", "fp16-als"])
@pytest.mark.parametrize("how", ["one call", "two calls", "create_optimizer"])
def test_a_second_optimizer_is_refused_under_a_loss_scaling_strategy(name, how):
    # One scaler, updated at each optimizer step and unscaling once per step: a second model's
    # gradients were clipped still scaled (norm 96142, not 1.47) or unscaled by a scale grown since.
    accelerator = Accelerator(cpu=True)
    plugin = PrecisionPlugin(name)
    model_a, model_b = tiny_gpt2(seed=0), tiny_gpt2(seed=1)
    optimizer_a = torch.optim.AdamW(model_a.parameters(), lr=1e-3)
    optimizer_b = torch.optim.AdamW(model_b.parameters(), lr=1e-3)
    refused = pytest.raises(ValueError, match=r"one optimizer per PrecisionPlugin.*BF16 strategy")
    if how == "one call":
        with refused:
            plugin.prepare(accelerator, model_a, model_b, optimizer_a, optimizer_b)
        assert {p.dtype for p in model_a.parameters()} == {torch.float32}  # refused before any work
        return
    plugin.prepare(accelerator, model_a, optimizer_a)
    plugin.prepare(accelerator, optimizer_a)  # the same optimizer again is no second one
    with refused:
        if how == "two calls":
            plugin.prepare(accelerator, model_b, optimizer_b)
        else:
            plugin.create_optimizer(model_b.parameters(), lr=1e-3)
    assert {p.dtype for p in model_b.parameters()} == {torch.float32}


def test_two_optimizers_still_train_under_a_strategy_that_scales_nothing():
    accelerator = Accelerator(cpu=True)
    model_a, model_b = tiny_gpt2(seed=0), tiny_gpt2(seed=1)
    prepared = PrecisionPlugin("bf16-mixed").prepare(
        accelerator,
        model_a,
        model_b,
        torch.optim.AdamW(model_a.parameters(), lr=1e-3),
        torch.optim.AdamW(model_b.parameters(), lr=1e-3),
    )
    assert len(prepared) == 4


@pytest.mark.parametrize("name", ["fp16-als", "collage-plus", "fp16-mixed"])
def test_accelerator_autocast_computes_a_head_on_the_outputs_in_the_compute_dtype(name):
    """A head applied to the model's (FP32) hidden states inside `accelerator.autocast()`, as stock
    `Accelerator(mixed_precision="bf16")` computes it in BF16: 16-bit-weight strategies (fp16-als,
    collage-plus) raised "expected m1 and m2 to have the same dtype", fp16-mixed ran it in FP32.
    Now the strategy's compute dtype; a forward run inside computes as outside, bit for bit, and
    `AutocastKwargs(enabled=False)` turns autocast off as stock. Run in a fresh process, as a user
    runs a loop: in one suite worker the forward saw the outer autocast (state another test left)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = f"from tests.integrations.test_accelerate_routing import _head_check; _head_check({name!r})"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


def _head_check(name: str) -> None:
    from accelerate.utils import AutocastKwargs

    accelerator = Accelerator(cpu=True)
    plugin = PrecisionPlugin(name)
    model = tiny_gpt2()
    model, _ = plugin.prepare(accelerator, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = batches(1)[0]
    out = model(input_ids=ids, labels=ids, output_hidden_states=True)
    hidden = out.hidden_states[-1]
    assert hidden.dtype == torch.float32
    head = accelerator.unwrap_model(model).lm_head
    autocasting = []  # inside the forward: the strategy's own context (an autocast for fp16-mixed only)
    # Seen right after the plugin's pre-hook entered it (hooks run in order; run as Python, as the plugin's).
    accelerator.unwrap_model(model).register_forward_pre_hook(
        torch.compiler.disable(lambda module, args: autocasting.append(torch.is_autocast_enabled("cpu")))
    )
    with accelerator.autocast():
        assert head(hidden).dtype == plugin.strategy.compute_dtype
        assert torch.equal(model(input_ids=ids, labels=ids).loss, out.loss)
    assert autocasting == [name == "fp16-mixed"]
    with plugin.autocast():
        assert head(hidden).dtype == plugin.strategy.compute_dtype
    if name == "fp16-mixed":  # FP32 weights: autocast off computes in FP32
        with accelerator.autocast(AutocastKwargs(enabled=False)):
            assert head(hidden).dtype == torch.float32
