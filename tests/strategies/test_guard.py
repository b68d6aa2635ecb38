"""The guard (`precision_options={"guard": ...}`, hf_lowprec/guard): options, bit-identity
without a fault, outlier skips, FP8 layers raised on a range fault, the raised (BF16) path's
numerics, flush counts against an explicit E4M3 cast, rollbacks, no host sync, and the guard's
state across a resume.

Single process, CPU, the tests' tiny GPT-2 (2 layers, n_embd 64, vocab 256, no dropout: a run's
bits are its data's), batches of 4 × 32 random tokens, small guard windows.
"""

import copy
import dataclasses
import functools
import io
import logging
import math

import pytest
import torch
from torch import nn
from transformers import GPT2LMHeadModel
from transformers.pytorch_utils import Conv1D

import hf_lowprec
from hf_lowprec.data import tiny_gpt2_config
from hf_lowprec.fp8 import FP8Linear
from hf_lowprec.fp8.fused import counted_input_cast, tensorwise_cast
from hf_lowprec.fp8.raised import RAISED, config_named, count_flushes, flush_counts
from hf_lowprec.fp8.scaled import pow2_scale
from hf_lowprec.fp8.scaling_recipes import fp8_config
from hf_lowprec.guard import GuardConfig
from hf_lowprec.testing import DeviceTraffic
from hf_lowprec.testing.counted_step import strategy_step
from tests.helpers import assert_bits_equal, batches, bits_equal, gamma, tiny_gpt2, unit_roundoff

E4M3 = torch.float8_e4m3fn
SMALL = {"warmup": 5, "window": 16}
BLOCK_LAYERS = [
    f"transformer.h.{i}.{part}" for i in range(2) for part in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
]


def setup(name, guard=False, lr=1e-3, seed=0, **options):
    strategy = hf_lowprec.get_strategy(name, guard=guard, **options)
    model = strategy.prepare_model(tiny_gpt2(seed, n_embd=64, n_positions=32, use_cache=False))
    optimizer = strategy.create_optimizer(model.parameters(), lr=lr, weight_decay=0.01)
    return strategy, model, optimizer


def state_tensors(model, optimizer):
    """(name, tensor) of every parameter, then of every tensor the optimizer holds for it."""
    out = [(n, p.detach()) for n, p in model.named_parameters()]
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        out += [(f"{names[id(p)]}:{k}", v) for k, v in sorted(state.items()) if torch.is_tensor(v)]
    return out


def copies(model, optimizer):
    return [(n, t.clone()) for n, t in state_tensors(model, optimizer)]


def assert_same_state(got, expected, what):
    assert [n for n, _ in got] == [n for n, _ in expected], what
    for (name, a), (_, b) in zip(got, expected):
        assert_bits_equal(a, b, f"{what}: {name}")


def guard_messages(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "hf_lowprec" and r.getMessage().startswith("guard")]


# --- 1. options --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, field",
    [
        ({"windw": 16}, "windw"),
        ({"window": 0}, "window"),
        ({"warmup": -3}, "warmup"),
        ({"rollback_after": 0}, "rollback_after"),
        ({"snapshot_every": 0}, "snapshot_every"),
        ({"max_rollbacks": 0}, "max_rollbacks"),
        ({"window": 2.5}, "window"),
        ({"window": True}, "window"),
        ({"z_threshold": 0.0}, "z_threshold"),
        ({"z_threshold": -1.0}, "z_threshold"),
        ({"max_flushed": 0.0}, "max_flushed"),
        ({"max_flushed": 1.5}, "max_flushed"),
        ({"warmup": 20, "window": 16}, "warmup"),
        ("yes", "guard"),
        (1, "guard"),
        ([True], "guard"),
    ],
)
def test_a_wrong_guard_option_raises_naming_the_field(value, field):
    with pytest.raises(ValueError) as error:
        hf_lowprec.get_strategy("bf16-mixed", guard=value)
    assert field in str(error.value)


def test_guard_true_gives_the_defaults_and_false_none():
    strategy = hf_lowprec.get_strategy("bf16-mixed", guard=True)
    assert strategy.guard.config == GuardConfig()
    defaults = dataclasses.asdict(strategy.guard.config)
    assert defaults == {
        "window": 128,
        "warmup": 20,
        "z_threshold": 6.0,
        "rollback_after": 3,
        "snapshot_every": 50,
        "max_flushed": 0.01,
        "max_rollbacks": 10,
    }
    partial = hf_lowprec.get_strategy("bf16-mixed", guard={"window": 16, "warmup": 5})
    assert partial.guard.config == GuardConfig(window=16, warmup=5)
    assert hf_lowprec.get_strategy("bf16-mixed").guard is None
    assert hf_lowprec.get_strategy("bf16-mixed", guard=False).guard is None


# --- 2. no fault: the same bits ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["bf16-mixed", "fp8-lm-o2", "collage-plus"])
def test_without_a_fault_a_guarded_run_computes_the_same_bits(name):
    data = batches(25)
    runs = {}
    for guard in (False, {**SMALL, "snapshot_every": 4}):
        strategy, model, optimizer = setup(name, guard=guard)
        losses = []
        logged = []
        for i, ids in enumerate(data):
            losses.append(strategy.train_step(model, ids, optimizer).item())
            if i % 5 == 4:  # a Trainer's logging steps
                logged.append(strategy.metrics())
        runs[bool(guard)] = (losses, copies(model, optimizer), logged, strategy)
    (plain_losses, plain_state, _, _), (losses, state, logged, strategy) = runs[False], runs[True]
    assert all(math.isfinite(v) for v in losses)
    assert losses == plain_losses, name
    assert_same_state(state, plain_state, f"{name} guarded vs unguarded")
    last = logged[-1]
    assert last["precision/skipped_steps"] == 0.0
    assert last["precision/guard_outlier_steps"] == 0.0
    assert last["precision/guard_faulty_steps"] == 0.0
    assert last["precision/guard_raised_layers"] == 0.0
    assert last["precision/guard_rollbacks"] == 0.0
    assert strategy.guard.actions == [] and strategy.guard.raised == {}
    assert strategy.guard.steps == len(data)
    if name == "fp8-lm-o2":  # the flush counters ran, and stayed below max_flushed
        assert 0.0 <= last["precision/guard_flushed_max"] <= 0.01
        assert all(m.recipe == "tensorwise" for m in model.modules() if isinstance(m, FP8Linear))


# --- 3. an outlier step is skipped -------------------------------------------------------------


@pytest.mark.parametrize("name", ["bf16-mixed", "fp32", "fp8-lm-o2"])
def test_an_outlier_step_is_skipped_and_leaves_every_state(name):
    """After warmup, one step whose gradient is 1000× the others' (its loss multiplied by 1000,
    the model's own `output.loss` untouched) is skipped on the device: the parameters and the
    optimizer states are those of a run that never saw that batch, bit for bit. (fp8-lm-o2:
    θ, m, v and the kept FP8 gradients too, and its gradient scaler's μ, clean-step count and
    saturated share, which its gradient processing moved before the guard judged: the guard
    puts them back.)"""
    data = batches(18)
    spike_at = 10  # after 10 accepted steps (warmup 5)

    def loud(model, ids):
        return model(input_ids=ids, labels=ids).loss * 1000.0

    strategy, model, optimizer = setup(name, guard=SMALL)
    for i, ids in enumerate(data):
        if i == spike_at:
            strategy.train_step(model, data[3], optimizer, loss_fn=loud)
            at_spike = strategy.metrics()
            assert at_spike["precision/guard_grad_norm_z"] > SMALL.get("z_threshold", 6.0), at_spike
            assert at_spike["precision/guard_outlier_steps"] == 1.0
        strategy.train_step(model, ids, optimizer)
        if i % 4 == 3:
            strategy.metrics()
    metrics = strategy.metrics()
    assert metrics["precision/guard_outlier_steps"] == 1.0
    assert metrics["precision/skipped_steps"] == 1.0
    assert metrics["precision/guard_faulty_steps"] == 1.0
    assert metrics["precision/guard_rollbacks"] == 0.0

    reference, ref_model, ref_optimizer = setup(name)
    for ids in data:
        reference.train_step(ref_model, ids, ref_optimizer)
    assert_same_state(copies(model, optimizer), copies(ref_model, ref_optimizer), f"{name}: skipped vs never seen")
    if name == "fp8-lm-o2":
        got, expected = strategy.state_dict(), reference.state_dict()
        assert (got["grad_mu"], got["grad_clean_steps"]) == (expected["grad_mu"], expected["grad_clean_steps"])


@pytest.mark.parametrize("name, options", [("bf16-sr", {}), ("fp16-als", {"weights": "sr"})])
def test_a_skipped_step_under_stochastic_rounding_moves_the_rounding_stream_on(name, options):
    """A skipped step (a NaN loss here; an outlier skips through the same flag) leaves θ and every
    optimizer state as a run without that batch has them, bit for bit, but its draw of rounding
    seeds stands, as a taken step's does (the generator lives on the host: holding it back would
    need a sync). The run then rounds with the bits that run would have used one step later: it is
    that run in distribution, not bit for bit (docs/guard.md, Skip). bf16-sr: with the stream put
    where the skip left it, the run without the batch is the skipped run, bit for bit."""
    data = batches(5)
    runs = [setup(name, **options) for _ in range(3)]  # skipped, without the batch, batch taken
    (strategy, model, optimizer), (clean, clean_model, clean_optimizer) = runs[:2]
    for ids in data[:2]:
        for s, m, o in runs:
            s.train_step(m, ids, o)
    strategy.train_step(model, data[4], optimizer, loss_fn=lambda m, ids: m(input_ids=ids, labels=ids).loss * math.nan)
    runs[2][0].train_step(runs[2][1], data[4], runs[2][2])
    assert strategy.metrics()["precision/skipped_steps"] == 1.0
    assert_same_state(copies(model, optimizer), copies(clean_model, clean_optimizer), f"{name}: skipped vs never seen")
    stream = [o.optimizer.state_dict()["generator_states"]["cpu"] for _, _, o in runs]
    assert torch.equal(stream[0], stream[2]) and not torch.equal(stream[0], stream[1])
    if name != "bf16-sr":  # fp16-als: the skip also halved the loss scale (see Skip)
        return
    for ids in data[2:4]:
        strategy.train_step(model, ids, optimizer)
        clean.train_step(clean_model, ids, clean_optimizer)
    later = copies(model, optimizer)
    assert not all(bits_equal(a, b) for a, b in zip(model.parameters(), clean_model.parameters()))
    replay, replay_model, replay_optimizer = setup(name, **options)
    for i, ids in enumerate(data[:4]):
        if i == 2:  # the stream where the skip left it
            replay_optimizer.optimizer._generator(torch.device("cpu")).set_state(stream[0])
        replay.train_step(replay_model, ids, replay_optimizer)
    assert_same_state(copies(replay_model, replay_optimizer), later, f"{name}: skipped vs the stream moved on")


def test_a_loss_level_shift_is_skipped_for_a_few_steps_then_becomes_the_window_s_and_a_spike_is_still_skipped():
    """bf16-mixed on random tokens (a flat loss, ~5.55, spread ~0.015): the model's own loss ×100 at
    one step, then, once that step has left the window, ×1.3 from step SHIFT on (a data switch, a
    curriculum stage; the gradients scale with it). The window takes every finite step, outliers
    included (OLMo-core's), so after k shifted steps of a window of W, with a shift Δ much larger
    than the old spread, mean = old + Δ·k/W and spread = Δ·√(p(1−p)), p = k/W, and the next shifted
    step lies (Δ − Δp)/(Δ√(p(1−p))) = √((W−k)/k) spreads out: skipped while that exceeds z, i.e.
    for k < W/(1+z²), ⌈W/(1+z²)⌉ steps, then accepted (here W 24, z 4: √23 = 4.80 skips the second,
    √11 = 3.32 accepts the third; the old spread and the noise move z by ~0.03). The spike is
    skipped (its z ~ 99·5.55/0.015); it widens the spread for the window it stays in. Before, a
    skipped step never entered the window: every step from the shift on was skipped, for good."""
    window, z = 24, 4.0
    strategy, model, optimizer = setup("bf16-mixed", guard={"warmup": 5, "window": window, "z_threshold": z})
    factor = {"now": 1.0}

    def scaled(module, args, output):  # before the guard's hook: the loss the model reports
        output.loss = output.loss * factor["now"]
        return output

    model.register_forward_hook(scaled, prepend=True)
    spike, shift = 8, 8 + window + 1
    data = batches(shift + 10)
    skipped, loss_z, weights = [], {}, []
    for i, ids in enumerate(data):
        factor["now"] = (100.0 if i == spike else 1.0) * (1.3 if i >= shift else 1.0)
        before = strategy.skipped_steps
        strategy.train_step(model, ids, optimizer)
        if strategy.skipped_steps > before:
            skipped.append(i)
        loss_z[i] = strategy.guard._device_state["last_z"][0].item()
        weights.append(model.transformer.h[0].mlp.c_fc.weight.detach().clone())
    expected = math.ceil(window / (1 + z * z))
    assert expected == 2
    assert skipped == [spike, *range(shift, shift + expected)], (skipped, loss_z)
    assert loss_z[spike] > 1000 and loss_z[shift] > 50, loss_z
    assert loss_z[shift + expected] < z, loss_z  # the new level is the window's
    for i in range(shift + expected, len(data)):  # accepted steps train
        assert not torch.equal(weights[i], weights[i - 1]), i
    metrics = strategy.metrics()
    assert metrics["precision/guard_outlier_steps"] == 1.0 + expected
    assert metrics["precision/skipped_steps"] == 1.0 + expected


def test_steps_skipped_during_warmup_leave_the_guard_judging_only_with_history():
    """The first `warmup` steps all non-finite (skipped, as a loss scaler's first steps can be):
    the z-scores wait for `warmup` accepted steps. Judged against an empty window (spread 0)
    every later step was an outlier and the run never trained again (25 of 25 skipped)."""
    strategy, model, optimizer = setup("bf16-mixed", guard={**SMALL, "rollback_after": 1000})
    poison = {"on": False}
    model.transformer.h[0].mlp.c_fc.weight.register_hook(lambda g: g * float("inf") if poison["on"] else g)
    for i, ids in enumerate(batches(20)):
        poison["on"] = i < SMALL["warmup"]
        strategy.train_step(model, ids, optimizer)
    metrics = strategy.metrics()
    assert metrics["precision/skipped_steps"] == float(SMALL["warmup"])
    assert metrics["precision/guard_outlier_steps"] == 0.0
    assert metrics["precision/guard_grad_norm_z"] != 0.0  # judged, once 5 steps were accepted


def test_a_resume_may_change_the_guard_window():
    """guard is a resume-safe option: a resume with another `window` keeps the counters and starts
    the history again (before the fix: IndexError past the saved window's length)."""
    strategy, model, optimizer = setup("bf16-mixed", guard={**SMALL, "window": 16})
    data = batches(20)
    for ids in data[:10]:
        strategy.train_step(model, ids, optimizer)
    resumed, resumed_model, resumed_optimizer = setup("bf16-mixed", guard={**SMALL, "window": 32})
    resumed_model.load_state_dict(model.state_dict())
    resumed_optimizer.load_state_dict(optimizer.state_dict())
    for ids in data[10:]:
        resumed.train_step(resumed_model, ids, resumed_optimizer)
    assert resumed.metrics()["precision/skipped_steps"] == 0.0


# --- 4. a range fault raises the FP8 layers ----------------------------------------------------


ROW_FAULT = 1e6


def row_fault_hooks(model, rows=((0, 3), (1, 17))):
    """Pre-hooks that multiply two token rows of each block layer's input by ROW_FAULT, forward
    hooks that divide the same output rows back."""
    handles = []

    def factor(t):
        f = torch.ones((*t.shape[:-1], 1), dtype=t.dtype)
        for b, s in rows:
            f[b, s] = ROW_FAULT
        return f

    for module in model.modules():
        if isinstance(module, FP8Linear):
            handles.append(module.register_forward_pre_hook(lambda m, args: (args[0] * factor(args[0]),)))
            handles.append(module.register_forward_hook(lambda m, args, out: out / factor(out)))
    return handles


def column_fault_hooks(model, names):
    """Pre-hooks that multiply two feature columns of the named layers' inputs by 1e6: every
    row's amax is then a faulted value, so even a per-row scale flushes the rest."""
    handles = []
    for name, module in model.named_modules():
        if name in names:

            def hook(m, args):
                f = torch.ones(args[0].shape[-1], dtype=args[0].dtype)
                f[:2] = 1e6
                return (args[0] * f,)

            handles.append(module.register_forward_pre_hook(hook))
    return handles


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def raised_run():
    """fp8-lm-o2 under a row fault, then column faults: the phases' records for tests 4 and 9."""
    logger = logging.getLogger("hf_lowprec")
    records, level = Records(), logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        options = {**SMALL, "rollback_after": 1000}
        strategy, model, optimizer = setup("fp8-lm-o2", guard=options)
        data = batches(12)
        for ids in data[:8]:
            strategy.train_step(model, ids, optimizer)
        clean = strategy.metrics()  # zeroes the flush counters
        out = {"clean": clean, "options": options}

        # Phase 1: two faulted steps; what each layer's cast sees is recorded after the fault.
        handles = row_fault_hooks(model)
        expected = {}
        for name, module in model.named_modules():
            if isinstance(module, FP8Linear):

                def record(m, args, name=name):
                    counts = flush_counts(args[0], m.config)
                    expected[name] = expected.get(name, 0) + counts

                handles.append(module.register_forward_pre_hook(record))
        losses = [strategy.train_step(model, ids, optimizer).item() for ids in data[8:10]]
        start = len(records.messages)
        out["first"] = strategy.metrics()
        out["first_messages"] = records.messages[start:]
        out["first_recipes"] = {n: m.recipe for n, m in model.named_modules() if isinstance(m, FP8Linear)}
        out["expected_share"] = {n: float(c[0] / c[1]) for n, c in expected.items()}
        out["faulted_losses"] = losses
        for h in handles:
            h.remove()

        def column_phase(key, layers, ids):
            """Forward with `layers`' input columns faulted, then a check: the guard's answer."""
            handles = column_fault_hooks(model, layers)
            model(input_ids=ids)  # a training forward (the counters skip evaluation's no-grad ones)
            start = len(records.messages)
            out[key] = strategy.metrics()
            out[f"{key}_messages"] = records.messages[start:]
            out[f"{key}_recipes"] = {n: m.recipe for n, m in model.named_modules() if isinstance(m, FP8Linear)}
            return handles

        # Phase 2: the MLP input layers flush even per row: they go on to BF16.
        handles = column_phase("second", [n for n in BLOCK_LAYERS if n.endswith("mlp.c_fc")], data[10])
        for h in handles:
            h.remove()
        buffer = io.BytesIO()
        torch.save(strategy.state_dict(), buffer)
        out["saved_state"] = buffer.getvalue()
        out["saved_optimizer"] = optimizer.state_dict()

        # Phase 3: every remaining layer flushes too: all BF16, and the guard stops.
        handles = column_phase("third", BLOCK_LAYERS, data[11])
        model(input_ids=data[11])
        start = len(records.messages)
        strategy.metrics()
        out["after_stop_messages"] = records.messages[start:]
        for h in handles:
            h.remove()
        out["strategy"], out["model"], out["optimizer"] = strategy, model, optimizer
        yield out
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)


def test_a_range_fault_raises_every_block_layer_to_rowwise(raised_run):
    run = raised_run
    assert run["clean"]["precision/guard_raised_layers"] == 0.0
    assert run["clean"]["precision/guard_flushed_max"] <= 0.01
    assert all(math.isfinite(v) for v in run["faulted_losses"])
    assert sorted(run["first_recipes"]) == sorted(BLOCK_LAYERS)
    assert run["first_recipes"] == dict.fromkeys(BLOCK_LAYERS, "rowwise")
    assert run["first"]["precision/guard_raised_layers"] == float(len(BLOCK_LAYERS))
    messages = [m for m in run["first_messages"] if m.startswith("guard") and ": raise " in m]
    assert len(messages) == len(BLOCK_LAYERS), run["first_messages"]
    skips = [m for m in run["first_messages"] if ": skip " in m]
    # Steps 9 and 10 (8 clean ones before them), numbered as the Trainer's global_step after each.
    assert len(skips) == 1 and "step(s) 9–10" in skips[0] and "flushed" in skips[0], run["first_messages"]
    for name in BLOCK_LAYERS:
        (line,) = [m for m in messages if f" {name}:" in m]
        share = run["expected_share"][name]
        assert share > 0.5, (name, share)  # most of the other rows' values were flushed
        assert "raise" in line and "tensorwise → rowwise" in line and "flushed" in line, line
        assert f"flushed {share:.1%}" in line, (line, share)
    assert run["first"]["precision/guard_flushed_max"] == pytest.approx(max(run["expected_share"].values()))


def test_a_fault_that_rowwise_still_flushes_raises_to_bf16_then_the_guard_stops(raised_run):
    run = raised_run
    second = run["second_recipes"]
    assert {n: r for n, r in second.items() if n.endswith("mlp.c_fc")} == {
        n: RAISED for n in BLOCK_LAYERS if n.endswith("mlp.c_fc")
    }
    assert {n: r for n, r in second.items() if not n.endswith("mlp.c_fc")} == {
        n: "rowwise" for n in BLOCK_LAYERS if not n.endswith("mlp.c_fc")
    }
    assert run["second"]["precision/guard_raised_layers"] == float(len(BLOCK_LAYERS))
    lines = [m for m in run["second_messages"] if m.startswith("guard")]
    assert len(lines) == 2 and all("rowwise → bf16" in m for m in lines), lines
    assert not any("stop" in m for m in lines)
    assert run["third_recipes"] == dict.fromkeys(BLOCK_LAYERS, RAISED)
    third = [m for m in run["third_messages"] if m.startswith("guard")]
    assert len(third) == 7 and "stop" in third[-1] and "BF16" in third[-1], third
    assert run["strategy"].guard.stopped
    assert not [m for m in run["after_stop_messages"] if m.startswith("guard")]


def test_a_step_whose_casts_flush_is_skipped_and_the_run_goes_on_from_weights_that_never_saw_it():
    """Issue #68: the steps between a range fault and the raise trained on flushed inputs. Now a
    step in which any FP8 layer flushed more than `max_flushed` of its inputs is skipped on the
    device (counted as faulty, named in the log), with no rollback: its update never happened.
    Tensorwise → rowwise at the next check; rowwise still flushes this fault in the weight
    gradient's column casts, so those steps are skipped too until the next check raises the
    layers to BF16; from then on the run trains, and the flushed share logged at the next check
    is the BF16 layers' own, 0 (it stayed at the last FP8 figure once the guard stopped)."""
    logger = logging.getLogger("hf_lowprec")
    records, level = Records(), logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        strategy, model, optimizer = setup("fp8-lm-o2", guard=SMALL)
        data = batches(16)
        for ids in data[:8]:
            strategy.train_step(model, ids, optimizer)
        clean = strategy.metrics()

        # The step's state: θ and the optimizer's moments (not its FP8 gradient buffer and that
        # buffer's scale, which every backward rewrites), and the gradient scaler's μ and count.
        def kept():
            tensors = [
                (n, t.clone()) for n, t in state_tensors(model, optimizer) if not n.endswith((":grad", ":grad_scale"))
            ]
            scaler = {k: v for k, v in strategy.state_dict().items() if k.startswith("grad_")}
            return tensors, scaler

        before = kept()
        row_fault_hooks(model)
        with torch.no_grad():  # an evaluation between steps: its flushed casts are not the step's
            model(input_ids=data[0])
        assert all(m.flush_now is None for m in model.modules() if isinstance(m, FP8Linear))
        assert strategy.guard._flushes[1].sum().item() == 0
        for ids in data[8:11]:
            strategy.train_step(model, ids, optimizer)
        assert_same_state(kept()[0], before[0], "after 3 flushing steps")
        assert kept()[1] == before[1]
        first = strategy.metrics()
        recipes = {n: m.recipe for n, m in model.named_modules() if isinstance(m, FP8Linear)}
        for ids in data[11:13]:  # rowwise: the column casts still flush
            strategy.train_step(model, ids, optimizer)
        assert_same_state(kept()[0], before[0], "after 2 steps at rowwise")
        second = strategy.metrics()
        for ids in data[13:16]:  # BF16: trains
            strategy.train_step(model, ids, optimizer)
        third = strategy.metrics()
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    assert clean["precision/guard_faulty_steps"] == 0.0
    assert first["precision/guard_flushing_steps"] == 3.0 and first["precision/guard_faulty_steps"] == 3.0
    assert first["precision/guard_outlier_steps"] == 0.0 and first["precision/guard_rollbacks"] == 0.0
    assert recipes == dict.fromkeys(BLOCK_LAYERS, "rowwise")
    assert second["precision/guard_flushing_steps"] == 5.0 and second["precision/guard_rollbacks"] == 0.0
    assert second["precision/guard_flushed_max"] > 0.01  # at rowwise, what raised them to BF16
    assert {n: m.recipe for n, m in model.named_modules() if isinstance(m, FP8Linear)} == dict.fromkeys(
        BLOCK_LAYERS, RAISED
    )
    assert third["precision/guard_flushing_steps"] == 5.0 and third["precision/guard_flushed_max"] == 0.0
    changed = [n for (n, a), (_, b) in zip(kept()[0], before[0]) if not torch.equal(a, b)]
    assert changed, "the run did not train once every layer was BF16"
    skips = [m for m in records.messages if ": skip " in m]
    assert len(skips) == 2 and "step(s) 9–11" in skips[0] and "step(s) 12–13" in skips[1], skips
    assert not any(": rollback " in m for m in records.messages), records.messages


# --- 9. the guard's state survives a resume ----------------------------------------------------


@pytest.mark.parametrize("order", ["load_after_prepare", "load_before_prepare", "optimizer_state"])
def test_a_resumed_run_raises_the_same_layers_again(raised_run, order, caplog):
    saved = torch.load(io.BytesIO(raised_run["saved_state"]), weights_only=True)
    expected = raised_run["second_recipes"]
    assert saved["guard"]["raised"] == expected
    options = raised_run["options"]
    strategy = hf_lowprec.get_strategy("fp8-lm-o2", guard=options)
    model = tiny_gpt2(5, n_embd=64, n_positions=32, use_cache=False)
    with caplog.at_level(logging.INFO, logger="hf_lowprec"):
        if order == "load_before_prepare":
            strategy.load_state_dict(saved)
            model = strategy.prepare_model(model)
        else:
            model = strategy.prepare_model(model)
        optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3, weight_decay=0.01)
        if order == "load_after_prepare":
            strategy.load_state_dict(saved)
        elif order == "optimizer_state":
            optimizer.load_state_dict(raised_run["saved_optimizer"])
    recipes = {n: m.recipe for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert recipes == expected
    assert strategy.guard.raised == expected
    assert strategy.guard.steps == saved["guard"]["steps"]
    assert strategy.metrics()["precision/guard_raised_layers"] == float(len(expected))
    assert any("resumed with the layers it raised" in r.getMessage() for r in caplog.records)
    # The layers run as raised: a step trains, and a BF16 layer's cast is no longer counted.
    loss = strategy.train_step(model, batches(1, seed=9)[0], optimizer)
    assert math.isfinite(loss.item())
    counted = dict(zip(strategy.guard.layers, strategy.guard._flushes[1].tolist()))
    for name, recipe in expected.items():  # a layer still in FP8 counts its casts, a BF16 one none
        assert (counted[name] == [0, 0]) == (recipe == RAISED), (name, recipe, counted[name])


# --- 5. the raised (BF16) path -----------------------------------------------------------------


def _reference(layer_kind, x, w, b, g):
    """FP64 output and gradients, and Σ|a||b| magnitudes of each, for y = x·Wᵀ + b (Linear)
    or x·W + b (Conv1D)."""
    x, w, b, g = (t.double() for t in (x, w, b, g))
    wt = w.t() if layer_kind == "linear" else w  # in × out
    y = x @ wt + b
    dx = g @ wt.t()
    dw_io = x.t() @ g  # in × out
    dw = dw_io.t() if layer_kind == "linear" else dw_io
    mag_y = x.abs() @ wt.abs()
    mag_dx = g.abs() @ wt.abs().t()
    mag_dw_io = x.abs().t() @ g.abs()
    mag_dw = mag_dw_io.t() if layer_kind == "linear" else mag_dw_io
    return (y, dx, dw, g.sum(0)), (mag_y, mag_dx, mag_dw, g.abs().sum(0))


def _bf16_gemm_bound(mag, n):
    """|computed − exact| of one BF16 GEMM element with FP32 accumulation over n terms:
    both operands rounded to BF16 once (each product within (2u + u²)·|a||b| of the exact one),
    the n-term FP32 sum (γₙ of FP32 on Σ|â||b̂| ≤ (1+u)²·Σ|a||b|), and the result rounded to BF16
    once (u on a value within (1 + 3u)·Σ|a||b|):
        |err| ≤ (2u + u² + γₙ·(1+u)² + u·(1 + 3u + γₙ))·Σ|a||b| ≤ (3u + 5u² + 2γₙ)·Σ|a||b|."""
    u = unit_roundoff(torch.bfloat16)
    return (3 * u + 5 * u * u + 2 * gamma(n)) * mag


@pytest.mark.parametrize("layer_kind", ["linear", "conv1d"])
def test_the_raised_path_is_a_bf16_gemm_with_fp32_accumulation(layer_kind):
    torch.manual_seed(0)
    n_in, n_out, rows = 64, 48, 4 * 8
    base = nn.Linear(n_in, n_out) if layer_kind == "linear" else Conv1D(n_out, n_in)
    with torch.no_grad():
        base.weight.normal_()
        base.bias.normal_()
    layer = FP8Linear.from_float(base)
    assert layer.weight_transposed == (layer_kind == "conv1d")
    x = torch.randn(4, 8, n_in)
    g = torch.randn(4, 8, n_out)
    u32 = unit_roundoff(torch.float32)

    def run(recipe):
        layer.set_config(config_named(layer.config, recipe))
        xi = x.clone().requires_grad_()
        layer.weight.grad = layer.bias.grad = None
        y = layer(xi)
        y.backward(g)
        return y.detach(), xi.grad, layer.weight.grad, layer.bias.grad

    y, dx, dw, db = run(RAISED)
    assert y.dtype == dx.dtype == dw.dtype == db.dtype == torch.float32
    (ry, rdx, rdw, rdb), (my, mdx, mdw, mdb) = _reference(
        layer_kind, x.reshape(rows, n_in), base.weight, base.bias, g.reshape(rows, n_out)
    )
    # The forward adds the FP32 bias to the BF16 GEMM result in FP32: one more FP32 rounding.
    bound_y = _bf16_gemm_bound(my, n_in) + 2 * u32 * (my + base.bias.detach().double().abs())
    bounds = {
        "output": (y.reshape(rows, n_out), ry, bound_y),
        "input grad": (dx.reshape(rows, n_in), rdx, _bf16_gemm_bound(mdx, n_out)),
        "weight grad": (dw, rdw, _bf16_gemm_bound(mdw, rows)),
        # The bias gradient is an FP32 sum of the FP32 output gradients: γ_rows of FP32.
        "bias grad": (db, rdb, gamma(rows) * mdb),
    }
    for what, (got, exact, bound) in bounds.items():
        err = (got.double() - exact).abs()
        assert (err <= bound).all(), f"{layer_kind} {what}: max err/bound {(err / bound).max():.3g}"
        assert err.max() > 0 or what == "bias grad"  # rounded, not computed in FP32 or wider
    # Tighter, element by element: against the exact GEMM of the operands rounded to BF16 (in FP64,
    # where a product of two BF16 values and these sums are exact to far below FP32), what is left
    # is the FP32 accumulation (γₙ·Σ|â||b̂|, counted twice for slack) and one rounding of the
    # result to BF16 (u·|s|), plus for the output the FP32 bias addition (u_fp32·(|s| + |b|), twice).
    u = unit_roundoff(torch.bfloat16)
    rounded = [t.to(torch.bfloat16) for t in (x.reshape(rows, n_in), base.weight.detach(), g.reshape(rows, n_out))]
    (sy, sdx, sdw, _), (hy, hdx, hdw, _) = _reference(layer_kind, *rounded[:2], torch.zeros(n_out), rounded[2])
    b64 = base.bias.detach().double()
    emulated = {
        "output": (
            y.reshape(rows, n_out),
            sy + b64,
            u * sy.abs() + 2 * gamma(n_in) * hy + 2 * u32 * (sy.abs() + b64.abs()),
        ),
        "input grad": (dx.reshape(rows, n_in), sdx, u * sdx.abs() + 2 * gamma(n_out) * hdx),
        "weight grad": (dw, sdw, u * sdw.abs() + 2 * gamma(rows) * hdw),
    }
    for what, (got, exact, bound) in emulated.items():
        err = (got.double() - exact).abs()
        assert (err <= bound).all(), f"{layer_kind} {what} vs BF16 operands: max err/bound {(err / bound).max():.3g}"
    # The bound tells BF16 from FP8: the layer's tensorwise FP8 path exceeds it.
    y8, _, _, _ = run("tensorwise")
    assert ((y8.reshape(rows, n_out).double() - ry).abs() > bound_y).any()


def test_an_fp8_lm_o2_model_with_every_layer_raised_trains():
    """O2's FP8 weights are scaled FP16 masters whose gradients go to FP8AdamW as FP8 (in
    backward): the raised path must hand the real weight's gradient on the same way."""
    strategy, model, optimizer = setup("fp8-lm-o2", lr=3e-3)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert sorted(layers) == sorted(BLOCK_LAYERS)
    for layer in layers.values():
        assert layer.master_scale is not None and layer.weight.dtype == torch.float16
        layer.set_config(config_named(layer.config, RAISED))
    before = {n: (m.weight.detach().clone(), m.master_scale.clone()) for n, m in layers.items()}
    data = batches(2, seed=3)
    losses = [strategy.train_step(model, data[i % 2], optimizer).item() for i in range(20)]
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-2:]) / 2 < losses[0] - 0.5, losses
    assert strategy.skipped_steps == 0
    for name, layer in layers.items():
        real_before = before[name][0].float() / before[name][1]
        real_after = layer.weight.detach().float() / layer.master_scale
        assert (real_after - real_before).abs().max() > 1e-3, f"{name} never moved: its gradient was lost"


# --- 6. flush counts against an explicit E4M3 cast ---------------------------------------------


def _flushed_by_cast(x, scale):
    """Non-zero inputs whose E4M3 payload of x·s (cast to nearest even) is ±0."""
    payload = (x.float() * scale).to(E4M3).view(torch.uint8)
    return int(((payload & 0x7F) == 0)[x != 0].sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flush_counts_match_an_explicit_e4m3_cast(dtype):
    torch.manual_seed(0)
    x = torch.randn(32, 64)
    x[x.abs() < 0.05] = 0.0  # some zeros: not counted either way
    x[5] *= 1e6
    x[20] *= 1e6
    x = x.to(dtype)
    nonzero = int((x != 0).sum())
    others = int((x != 0).sum()) - int((x[[5, 20]] != 0).sum())

    tensorwise = flush_counts(x, fp8_config("tensorwise", 0))
    assert tensorwise.tolist()[1] == nonzero
    s = pow2_scale(x.float().abs().amax(), E4M3)
    assert tensorwise[0].item() == _flushed_by_cast(x, s)
    assert tensorwise[0].item() > 0.9 * others  # most values of the other rows

    # Rowwise casts x twice: per token row for the forward GEMM (the huge rows flush nothing
    # there) and per feature column for the weight gradient (where they set every column's scale).
    rowwise = flush_counts(x, fp8_config("rowwise", 0))
    s_rows = pow2_scale(x.float().abs().amax(dim=-1, keepdim=True), E4M3)
    s_cols = pow2_scale(x.float().abs().amax(dim=0, keepdim=True), E4M3)
    assert _flushed_by_cast(x, s_rows) == 0
    assert rowwise.tolist() == [_flushed_by_cast(x, s_cols), 2 * nonzero]
    assert rowwise[0].item() > 0.9 * others

    margin = flush_counts(x, fp8_config("tensorwise", 2))  # a margin of 2 binades scales by 1/4: more flush
    assert margin[0].item() == _flushed_by_cast(x, pow2_scale(x.float().abs().amax(), E4M3, 2))
    assert margin[0].item() >= tensorwise[0].item()


def test_flush_counts_at_the_rounding_boundary():
    """|x·s| exactly 2⁻¹⁰ (half the smallest subnormal) rounds to 0 (ties to even); one ulp
    above rounds to 2⁻⁹. The count must follow the cast there too."""
    amax = torch.tensor(448.0)  # s = 1
    s = pow2_scale(amax, E4M3)
    assert s.item() == 1.0
    half = 2.0**-10
    x = torch.tensor([448.0, half, half * (1 + 2**-23), half * (1 - 2**-24), 2.0**-9, -half])
    by_cast = _flushed_by_cast(x, s)
    assert by_cast == 3  # the two ties and the value below them
    assert flush_counts(x.reshape(1, -1), fp8_config("tensorwise", 0))[0].item() == by_cast
    assert counted_input_cast(x.reshape(1, -1), 0, False)[3][0].item() == by_cast


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise", "mxfp8"])
def test_the_compiled_count_of_a_finer_recipe_is_the_reference_count(recipe):
    """`count_flushes` (one compiled graph per watched layer's forward) gives exactly
    `flush_counts`' integers, for inputs with a few rows 1e6 larger, in FP32 and BF16."""
    config = fp8_config(recipe, 0)
    x = torch.randn(4, 32, 128, generator=torch.Generator().manual_seed(3))
    x[0, :2] *= 1e6
    for each in (x, x.to(torch.bfloat16)):
        expected = flush_counts(each, config)
        assert count_flushes(each, config).tolist() == expected.tolist() and expected[0] > 0


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise", "mxfp8"])
def test_a_watched_layer_given_zero_tokens_counts_nothing(recipe):
    """A zero-token training forward (an expert dispatched no token) under the guard: no input is
    cast, so the layer's counts are [0 flushed, 0 cast], and the counting functions say the same."""
    layer = FP8Linear.from_float(nn.Linear(128, 128), config=fp8_config(recipe))
    layer.train()
    layer.watch_flushes = True
    x = torch.zeros(0, 128, requires_grad=True)
    layer(x).sum().backward()
    assert layer.flush_now.tolist() == [0, 0]
    assert flush_counts(x, layer.config).tolist() == [0, 0]
    assert count_flushes(x, layer.config).tolist() == [0, 0]


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tensorwise_input_cast_counts_its_flushes_and_casts_as_before(transposed, dtype):
    """`counted_input_cast` (the cast a watched tensorwise layer makes, issue #68): the payload,
    its transpose and the scale bit for bit those of `tensorwise_cast`, and the counts those of
    `flush_counts`, for inputs with a few rows 1e6 larger."""
    x = torch.randn(96, 128, generator=torch.Generator().manual_seed(4))
    x[x.abs() < 0.05] = 0.0
    x[[3, 50]] *= 1e6
    x = x.to(dtype)
    x8, x8_t, sx, counts = counted_input_cast(x, 0, transposed)
    ref8, ref_s = tensorwise_cast(x, E4M3, 0)
    assert torch.equal(x8.view(torch.uint8), ref8.view(torch.uint8)) and torch.equal(sx, ref_s)
    if transposed:
        assert x8_t.is_contiguous() and torch.equal(x8_t.view(torch.uint8), ref8.t().view(torch.uint8))
    else:
        assert x8_t is None
    expected = flush_counts(x, fp8_config("tensorwise", 0))
    assert counts.tolist() == expected.tolist() and expected[0] > 0.9 * (expected[1] - 2 * 128)


@pytest.mark.parametrize("way", ["whole model", "a submodule", "checkpointed layers", "two micro-batches"])
def test_every_step_is_judged_on_its_own_flush_counts_whatever_the_loop_calls(way):
    """The layers leave their counts, the guard collects them after the model's forward; a
    loop that calls a submodule (the backbone, then a loss of its own) is judged on the counts
    its layers left, a recomputed forward (gradient checkpointing) is not counted twice, and two
    micro-batches are summed. The share judged is `flush_counts`' of what the layers saw."""
    strategy, model, optimizer = setup("fp8-lm-o2", guard=SMALL)
    ids = batches(2)
    if way == "checkpointed layers":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    row_fault_hooks(model)
    seen = {}
    for name, module in model.named_modules():
        if isinstance(module, FP8Linear):

            def record(m, args, name=name):
                if torch.is_grad_enabled() and not torch._C._current_graph_task_id() >= 0:  # not a recompute
                    seen[name] = seen.get(name, 0) + flush_counts(args[0], m.config)

            module.register_forward_pre_hook(record)

    def backbone_loss(model, batch):
        return model.transformer(input_ids=batch).last_hidden_state.float().square().mean()

    loss_fn = backbone_loss if way == "a submodule" else None
    if way == "two micro-batches":
        with strategy.forward_context():
            for batch in ids:
                strategy.scale_loss(model(input_ids=batch, labels=batch).loss / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
    else:
        strategy.train_step(model, ids[0], optimizer, loss_fn=loss_fn)
    counted = strategy.guard._flushes[1].tolist()
    assert counted == [seen[name].tolist() for name in strategy.guard.layers]
    # The fault flushed most inputs (a layer behind a flushed one may see zeros only: not counted).
    assert sum(c[0] for c in counted) > 0.5 * sum(c[1] for c in counted), counted
    assert strategy.metrics()["precision/guard_flushing_steps"] == 1.0


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_watched_layer_leaves_its_counts_and_computes_the_same_bits(recipe):
    """A watched layer's training forward leaves `flush_counts` of its input in `flush_now` and
    gives the unwatched layer's output and gradients bit for bit; no count under no_grad."""
    torch.manual_seed(0)
    linear = nn.Linear(128, 64)
    plain, watched = (FP8Linear.from_float(copy.deepcopy(linear), config=fp8_config(recipe, 0)) for _ in range(2))
    watched.watch_flushes = True
    x = torch.randn(2, 48, 128)
    x[0, :2] *= 1e6
    outs = []
    for layer in (plain, watched):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.float().square().sum().backward()
        outs.append((y, xi.grad, layer.weight.grad))
    for a, b in zip(*outs):
        assert torch.isfinite(a).all() and torch.equal(a, b)
    assert plain.flush_now is None
    assert watched.flush_now.tolist() == flush_counts(x, watched.config).tolist()
    watched.flush_now = None
    with torch.no_grad():
        watched(x)
    assert watched.flush_now is None


# --- 7. rollback -------------------------------------------------------------------------------


def test_a_storm_of_non_finite_steps_rolls_back_to_the_snapshot_then_stops_at_the_limit(caplog):
    """fp16-mixed, inf put into one gradient by a hook: each such step is skipped and halves
    the loss scale. rollback_after of them since the snapshot restore the parameters, the
    optimizer state and the loss scale of the snapshot step; after max_rollbacks the guard stops."""
    options = {**SMALL, "snapshot_every": 4, "rollback_after": 3, "max_rollbacks": 1}
    strategy, model, optimizer = setup("fp16-mixed", guard=options, init_scale=2.0**8)
    poison = {"on": False}
    target = model.transformer.h[0].mlp.c_fc.weight
    target.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")) if poison["on"] else g)
    data = batches(24)
    feed = iter(data)

    def steps(n, poisoned=False):
        poison["on"] = poisoned
        for _ in range(n):
            strategy.train_step(model, next(feed), optimizer)
        poison["on"] = False

    steps(6)
    first = strategy.metrics()  # no fault yet: this check takes the snapshot (step 6)
    assert first["precision/skipped_steps"] == 0.0, "natural overflows would make the test meaningless"
    at_snapshot = copies(model, optimizer)
    scaler_at_snapshot = strategy.state_dict()["loss_scaler"]
    steps(3)  # clean steps after the snapshot: what the rollback undoes
    moved = copies(model, optimizer)
    steps(3, poisoned=True)
    assert_same_state(copies(model, optimizer), moved, "skipped steps")
    assert strategy.state_dict()["loss_scaler"]["scale"] == scaler_at_snapshot["scale"] / 8
    with caplog.at_level(logging.WARNING, logger="hf_lowprec"):
        metrics = strategy.metrics()
    (line,) = guard_messages(caplog)
    assert "rollback" in line and "(step 6)" in line and "3 faulty step(s)" in line, line
    assert metrics["precision/guard_rollbacks"] == 1.0
    assert metrics["precision/guard_faulty_steps"] == 3.0
    assert metrics["precision/loss_scale"] == scaler_at_snapshot["scale"]
    assert_same_state(copies(model, optimizer), at_snapshot, "rolled back")
    assert strategy.state_dict()["loss_scaler"] == scaler_at_snapshot
    assert strategy.skipped_steps == 3  # the counters are not rolled back
    assert strategy.guard.steps == 12

    # The run goes on from the snapshot; a second storm finds the limit (max_rollbacks 1).
    caplog.clear()
    steps(2)
    moved = copies(model, optimizer)
    steps(3, poisoned=True)
    with caplog.at_level(logging.WARNING, logger="hf_lowprec"):
        metrics = strategy.metrics()
    (line,) = guard_messages(caplog)
    assert "stop" in line and "max_rollbacks" in line, line
    assert metrics["precision/guard_rollbacks"] == 1.0
    assert_same_state(copies(model, optimizer), moved, "no rollback after the limit")
    # ... and acts no more.
    caplog.clear()
    steps(3, poisoned=True)
    with caplog.at_level(logging.WARNING, logger="hf_lowprec"):
        metrics = strategy.metrics()
    assert guard_messages(caplog) == []
    # A stopped guard neither judges nor counts: the run goes on as an unguarded one (the
    # strategy still skips the non-finite steps itself).
    assert metrics["precision/guard_rollbacks"] == 1.0 and metrics["precision/guard_faulty_steps"] == 6.0
    assert strategy.skipped_steps == 9


# --- 8. no host sync in a guarded step ---------------------------------------------------------


@pytest.mark.parametrize("name", ["bf16-mixed", "fp8-lm-o2"])
def test_a_steady_guarded_step_never_syncs(name):
    """As tests/strategies/test_no_sync.py counts them (`DeviceTraffic`): one steady step of GPT-2
    (n_embd 128, 2 layers, no pad token), here past the guard's warmup, so the z-scores, the
    window and the flush counters all run.

    The model keeps GPT-2's default `use_cache=True`, as there: without a cache, transformers 5.24
    checks the position ids for packed sequences (`masking_utils.find_packed_sequence_indices`
    reads `.all()` on the host), a model-side sync of every strategy, guard or not."""
    strategy = hf_lowprec.get_strategy(name, guard={"warmup": 2, "window": 4})
    torch.manual_seed(0)
    model = strategy.prepare_model(GPT2LMHeadModel(tiny_gpt2_config(n_embd=128, n_layer=2, pad_token_id=None)))
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3, weight_decay=0.01)
    ids = batches(1)[0]
    for _ in range(3):
        strategy_step(strategy, model, optimizer, ids)
    assert strategy.guard.steps == 3 >= strategy.guard.config.warmup
    with DeviceTraffic() as traffic:
        strategy_step(strategy, model, optimizer, ids)
    assert not traffic.syncs, f"{name} guarded:\n{traffic.summary()}"
    assert strategy.guard.steps == 4
    with DeviceTraffic() as check:  # the counter sees the check's reads (where syncs belong)
        strategy.metrics()
    assert check.syncs


def test_a_model_compiled_whole_is_guarded_with_no_break_or_recompile_of_its_own():
    """`torch.compile(model)` traces the guard's hook that collects the layers' flush counts:
    the guarded run breaks where the unguarded one does (transformers' own logging) and builds no
    graph after its warm-up steps, and the counts arrive. (Its two sums were once two tensors,
    which the compiler allocated as one: aot_autograd refused the run.) aot_autograd and dynamo are
    what decide breaks, recompiles and that refusal, so the graphs run as aot_eager's: Inductor's
    code generation for a whole FP8 model would add minutes and nothing this test checks."""
    from hf_lowprec.testing.graphs import compiled_run

    ids = batches(1)[0]
    runs = {}
    for guard in (False, {**SMALL, "warmup": 1}):  # judging starts (its graph) within the warm-up steps
        strategy, model, optimizer = setup("fp8-lm-o2", guard=guard)
        compiled = torch.compile(model, backend="aot_eager")
        step = functools.partial(strategy.train_step, compiled, ids, optimizer, max_grad_norm=1.0)
        runs[bool(guard)] = compiled_run(step)
    assert runs[True].breaks == runs[False].breaks, (runs[True].break_reasons, runs[False].break_reasons)
    assert runs[True].new_graphs == 0, runs[True].recompiles_summary()
    counted = strategy.guard._flushes[1].tolist()
    assert len(counted) == len(strategy.guard.layers) and all(nonzero > 0 for _, nonzero in counted), counted


def test_gathering_flush_counts_stays_compiled_for_any_number_of_layers(monkeypatch):
    """`judging.gather` takes one count per watched layer, a list whose length its graph is
    guarded on: a process that guards models of more depths than dynamo's recompile limit per
    function (32 here; 2 in this test, so that four depths show it) keeps one compiled graph per
    depth, with exact sums. Before, the depth past the limit failed to compile and the gather ran
    its eager operations for good."""
    from hf_lowprec import compiling
    from hf_lowprec.guard import judging

    monkeypatch.setattr(compiling, "_RECOMPILE_LIMIT", 2)
    monkeypatch.setattr(compiling, "_broken", {})
    for layers in (1, 2, 3, 4):
        flushes = torch.zeros(2, layers, 2)
        counts = [torch.tensor([float(i), float(i + layers)]) for i in range(layers)]
        judging.gather(flushes, counts)
        judging.gather(flushes, counts)
        expected = 2 * torch.stack(counts)
        assert torch.equal(flushes[0], expected) and torch.equal(flushes[1], expected), layers
    assert not compiling._broken, compiling._broken


def test_one_accepted_step_is_no_spread_to_judge_by():
    """`warmup: 1` judged the second step against a window of one value: a spread of 0, clamped at
    FP32's tiniest, so a gradient norm 2.5% above the first (1.609 against 1.570) lay ~1e36 spreads
    out and healthy steps were skipped, each kept out of the window. Judging needs two accepted steps."""
    strategy, model, optimizer = setup("collage-plus", guard={"warmup": 1, "window": 16})
    for ids in batches(2):
        strategy.train_step(model, ids, optimizer)
    assert strategy.metrics()["precision/skipped_steps"] == 0.0
