"""Issue #36 for the strategy layer: a training step never waits for the device.

Syncs are counted by `hf_lowprec.testing.DeviceTraffic` (the ATen ops that read device data
on the host: `.item()`, `bool()`, `torch.equal`, `nonzero`, ...), over one full step (forward,
backward, `optimizer.step()`) of GPT-2.
The model is built without a pad token: transformers' own padding check would read `input_ids`
on the host (a model-side sync, not the strategy's). Then: the skip decision is a device
tensor agreed over the ranks, a skipped step leaves θ and every state tensor as they were, the
counters a user reads sync only when read, and fp16-als's hooks do not break the compiled graph.
"""

import io
from pathlib import Path

import pytest
import torch
from transformers import GPT2LMHeadModel

import hf_lowprec
from hf_lowprec.data import tiny_gpt2_config
from hf_lowprec.testing import DeviceTraffic
from tests.helpers import assert_bits_equal, batches

# Everything but FP8-LM and COAT, whose internals another change moves to the device.
STRATEGIES = [n for n in hf_lowprec.available_strategies() if not n.startswith("fp8-lm") and n != "coat"]


def setup(name: str, layers: int = 2, **options):
    strategy = hf_lowprec.get_strategy(name, **options)
    torch.manual_seed(0)
    config = tiny_gpt2_config(n_embd=128, n_layer=layers, pad_token_id=None)
    model = strategy.prepare_model(GPT2LMHeadModel(config))
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3, weight_decay=0.01)
    return strategy, model, optimizer


def step(strategy, model, optimizer, ids, poison: bool = False) -> None:
    with strategy.forward_context():
        loss = model(input_ids=ids, labels=ids).loss
    if poison:
        loss = loss * float("nan")
    strategy.scale_loss(loss).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("layers", [2, 8])
@pytest.mark.parametrize("name", STRATEGIES)
def test_a_training_step_never_syncs(name, layers):
    strategy, model, optimizer = setup(name, layers)
    ids = batches(1)[0]  # 4 × 32
    step(strategy, model, optimizer, ids)  # the first step makes the optimizer state
    with DeviceTraffic() as traffic:
        step(strategy, model, optimizer, ids)
        step(strategy, model, optimizer, ids, poison=True)  # a skipped step does not sync either
    assert not traffic.syncs, f"{name}, {layers} layers:\n{traffic.summary()}"
    assert strategy.skipped_steps == 1 and optimizer.step_was_skipped  # read afterwards: synced then


@pytest.mark.parametrize("name", STRATEGIES)
def test_found_inf_is_a_device_flag_and_a_skip_leaves_every_tensor(name):
    strategy, model, optimizer = setup(name)
    ids = batches(1)[0]
    step(strategy, model, optimizer, ids)
    held = {id(t): t for t in model.parameters()}
    held.update({id(v): v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)})
    before = {key: t.detach().clone() for key, t in held.items()}
    with strategy.forward_context():
        loss = model(input_ids=ids, labels=ids).loss * float("nan")
    strategy.scale_loss(loss).backward()
    strategy.unscale_gradients(optimizer.optimizer)
    found_inf = strategy.process_gradients(optimizer.optimizer)
    assert found_inf.dtype == torch.float32 and found_inf.dim() == 0 and found_inf.item() == 1.0
    strategy.optimizer_step(optimizer.optimizer, found_inf)
    for key, tensor in held.items():
        assert_bits_equal(tensor.detach(), before[key], f"{name}: a tensor changed on a skipped step")


def test_skipped_steps_count_on_the_device_and_old_checkpoints_load():
    strategy, model, optimizer = setup("bf16-mixed")
    ids = batches(1)[0]
    for poison in (True, True, False):
        step(strategy, model, optimizer, ids, poison)
    assert strategy._skipped_on_device.device == ids.device and strategy.skipped_steps == 2
    assert not optimizer.step_was_skipped
    assert optimizer.state_dict()["hf_lowprec"]["skipped_steps"] == 2  # a plain int, as before
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    resumed, resumed_model, resumed_optimizer = setup("bf16-mixed")
    resumed_optimizer.load_state_dict(torch.load(buffer, weights_only=True))
    step(resumed, resumed_model, resumed_optimizer, ids, poison=True)
    assert resumed.skipped_steps == 3 and resumed.metrics()["precision/skipped_steps"] == 3.0


def test_skips_are_logged_at_the_next_metrics_read(caplog):
    strategy, model, optimizer = setup("fp32")
    ids = batches(1)[0]
    with caplog.at_level("WARNING", logger="hf_lowprec"):
        step(strategy, model, optimizer, ids, poison=True)
        step(strategy, model, optimizer, ids, poison=True)
        assert not caplog.records  # the step cannot know on the host
        strategy.metrics()
        strategy.metrics()  # nothing new since
    assert [r.getMessage() for r in caplog.records] == [
        "non-finite gradients: 2 step(s) skipped since the last log (2 so far)"
    ]


def test_non_finite_gradients_on_one_rank_skip_the_step_on_both():
    from tests.deepspeed._launch import launch

    out = Path(__import__("tempfile").mkdtemp())
    results = launch(Path(__file__).with_name("_skip_worker.py"), out, [], timeout=600)
    for name in ("fp32", "bf16-mixed", "collage-plus", "fp16-mixed", "fp16-als"):
        for rank, result in enumerate(results):
            clean, poisoned = result[name]["clean"], result[name]["poisoned"]
            assert clean["found_inf"] == {"dtype": "torch.float32", "dim": 0, "value": 0.0}, (name, rank)
            assert clean["moved"], (name, rank)
            # Only rank 1's gradient holds the NaN; both ranks skip, and keep one loss scale.
            assert poisoned["found_inf"]["value"] == 1.0 and not poisoned["moved"], (name, rank, poisoned)
        assert results[0][name]["poisoned"]["scale"] == results[1][name]["poisoned"]["scale"], name


@pytest.mark.slow
def test_fp16_als_compiled_counts_what_eager_counts():
    """Under `torch.compile` the activation gradients are counted through `_ActivationTally`
    into the probe's gradient instead of tensor hooks: the same histogram, clipped counts and
    scale decisions as eagerly. Its graph breaks are counted against bf16-mixed's in
    tests/gpu/test_compiled.py."""
    import torch._dynamo

    data = batches(3)
    # A low bin edge puts activation and weight gradients in the upper bin: counts to compare.
    options = {"period": 1000, "bin_edge": 2.0**-12}
    states = {}
    for mode in ("eager", "compiled"):
        strategy, model, optimizer = setup("fp16-als", **options)
        torch._dynamo.reset()
        run = model if mode == "eager" else torch.compile(model, backend="aot_eager")
        for ids in data:
            step(strategy, run, optimizer, ids)
        states[mode] = strategy.scaler.state_dict()
    torch._dynamo.reset()
    eager, compiled = states["eager"], states["compiled"]
    assert eager["steps_in_period"] == compiled["steps_in_period"] == 3
    # Every weight and leaf-module output element, three times: exact, whatever the rounding.
    assert eager["period_total"] == compiled["period_total"] > 3 * sum(p.numel() for p in model.parameters())
    # The upper bin may move by the elements that AOT's decompositions round across the edge.
    assert eager["period_upper"] > 0
    assert abs(eager["period_upper"] - compiled["period_upper"]) <= 1e-3 * eager["period_upper"], (eager, compiled)
