"""fp16-als and fp16-mixed: Trainer runs, overflow injection, accumulation, options (docs/algorithms.md §5, §6)."""

import io
import math

import pytest
import torch

import hf_lowprec
from hf_lowprec import Trainer, get_strategy
from hf_lowprec.optim import FP32StatesSRAdamW, MasterWeightAdamW
from hf_lowprec.scaling import running_mean_
from tests.helpers import (
    ParameterSnapshots,
    TokenBlocks,
    batches,
    checkpointed_args,
    logged_losses,
    tiny_gpt2,
    train_steps,
)


def setup(name, seed=0, **options):
    strategy = hf_lowprec.get_strategy(name, **options)
    model = strategy.prepare_model(tiny_gpt2(seed))
    optimizer = strategy.create_optimizer(model.parameters(), lr=3e-3, weight_decay=0.01)
    return strategy, model, optimizer


def test_dtypes_and_metrics():
    strategy, model, optimizer = setup("fp16-als")
    train_steps(strategy, model, optimizer, batches(2))
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert {p.grad for p in model.parameters()} == {None}
    state = next(iter(optimizer.state.values()))
    assert {k: v.dtype for k, v in state.items() if torch.is_tensor(v) and k != "step"} == {
        "exp_avg": torch.float32,
        "exp_avg_sq": torch.float32,
        "master": torch.float32,
    }
    metrics = strategy.metrics()
    assert metrics["precision/loss_scale"] == 4.0  # 1 → 2 → 4: tiny gradients double it each step
    assert metrics["precision/upper_bin_share"] == 0.0 and metrics["precision/clipped_elements"] == 0.0

    mixed, model, optimizer = setup("fp16-mixed")
    train_steps(mixed, model, optimizer, batches(1))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert mixed.metrics()["precision/loss_scale"] == 2.0**16


def test_master_weight_adamw_follows_fp32_adamw():
    g = torch.Generator().manual_seed(0)
    weight16 = torch.nn.Parameter((torch.randn(256, generator=g)).half())
    weight32 = torch.nn.Parameter(weight16.detach().float().clone())
    ours = MasterWeightAdamW([weight16], lr=1e-3, weight_decay=0.1)
    reference = torch.optim.AdamW([weight32], lr=1e-3, weight_decay=0.1)
    for _ in range(20):
        grad = (torch.randn(256, generator=g) * 1e-3).half()
        weight16.grad, weight32.grad = grad.clone(), grad.float()
        ours.step()
        reference.step()
    master = ours.state[weight16]["master"]
    # Both step in FP32 with the same formula in a different operation order: a few FP32 ulps
    # of |θ| ≈ 1 per step (2^-23 each), far below the 20·lr = 0.02 the weights moved.
    assert (master - weight32.detach()).abs().max().item() <= 20 * 4 * 2.0**-23 * 4
    assert torch.equal(weight16.detach(), master.half())  # the weight is the master rounded once


def test_full_precision_export_is_the_fp32_master():
    """Regression (issue 21): the master-weight optimizer declared no master, so the metrics and
    `full_precision_state_dict` read the FP16 weight. After 3 steps at lr 1e-5 the weights near
    1 (LayerNorm gains, ulp 2^-10) have not moved while their masters moved by ~3e-5: the
    export must be the master, the weight the master rounded once."""
    strategy = hf_lowprec.get_strategy("fp16-als")
    model = strategy.prepare_model(tiny_gpt2())
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-5)
    inner = optimizer.optimizer
    assert isinstance(inner, MasterWeightAdamW)
    train_steps(strategy, model, optimizer, batches(3))
    full = strategy.full_precision_state_dict(model, optimizer)
    apart = 0.0
    for name, param in model.named_parameters():
        master = inner.state[param]["master"]
        assert master.dtype == torch.float32 and inner.state[param]["step"] == 3
        assert torch.equal(param.detach(), master.half()), name
        assert torch.equal(inner.held_value(param), master.double()), name
        assert torch.equal(inner.full_precision_value(param), master), name
        assert full[name].dtype == torch.float32 and torch.equal(full[name], master), name
        apart = max(apart, (master.double() - param.detach().double()).abs().max().item())
    assert apart > 2e-5  # exporting the FP16 weight would have been this far off


def test_stochastic_rounding_weights_train_and_resume_bit_for_bit():
    data = batches(1) * 12
    strategy, model, optimizer = setup("fp16-als", weights="sr", seed=3)
    assert strategy.bytes_per_param == 12.0
    assert isinstance(optimizer.optimizer, FP32StatesSRAdamW)
    first = train_steps(strategy, model, optimizer, data[:6])
    # After the steps, every parameter has FP32 moments and no master (the 12 bytes/param).
    states = [optimizer.state[p] for p in model.parameters()]
    assert len(states) == len(list(model.parameters())) and all(states)
    for state in states:
        # The step count, when a tensor, is the 0-dim FP64 device counter of a skippable step.
        assert {k: v.dtype for k, v in state.items() if torch.is_tensor(v) and k != "step"} == {
            "exp_avg": torch.float32,
            "exp_avg_sq": torch.float32,
        }
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    strategy2, model2, optimizer2 = setup("fp16-als", seed=9, weights="sr")
    model2.load_state_dict(saved["model"])
    optimizer2.load_state_dict(saved["optimizer"])
    assert strategy2.scaler.get_scale() == strategy.scaler.get_scale() == 2.0**6
    rest = train_steps(strategy, model, optimizer, data[6:])
    assert train_steps(strategy2, model2, optimizer2, data[6:]) == rest
    assert rest[-1] < first[0] - 1.0, (first, rest)  # memorising one batch: well below ln(256)


def test_running_mean_under_a_loop_that_divides_the_loss():
    """Two micro-batches with the loss divided by 2 (as the Trainer does): p.grad is M_2 of the
    full micro-batch gradients, the same FP16 arithmetic as `running_mean_`, bit for bit."""
    data = batches(2)

    def scaled_grads(ids, divisor):
        strategy, model, _ = setup("fp16-als")
        strategy.set_gradient_accumulation(divisor)
        strategy.scale_loss(model(input_ids=ids, labels=ids).loss / divisor).backward()
        return [p.grad.clone() for p in model.parameters()]

    singles = [scaled_grads(ids, 1) for ids in data]
    strategy, model, _ = setup("fp16-als")
    strategy.set_gradient_accumulation(2)
    for ids in data:
        strategy.scale_loss(model(input_ids=ids, labels=ids).loss / 2).backward()
    for p, g1, g2 in zip(model.parameters(), *singles):
        expected = running_mean_(g1.clone(), g1, 1)
        assert torch.equal(p.grad, running_mean_(expected, g2, 2))


def test_options_are_checked_before_any_work():
    with pytest.raises(ValueError, match="weights"):
        hf_lowprec.get_strategy("fp16-als", weights="fp32")
    with pytest.raises(ValueError, match="power of two"):
        hf_lowprec.get_strategy("fp16-als", init_scale=3.0)
    with pytest.raises(ValueError, match="period"):
        hf_lowprec.get_strategy("fp16-als", period=0)
    with pytest.raises(ValueError, match="growth_interval"):
        hf_lowprec.get_strategy("fp16-mixed", growth_interval=0)
    # fp16-mixed's scale is checked as fp16-als's is: a power of two, small enough to train.
    with pytest.raises(ValueError, match="init_scale must be a power of two"):
        hf_lowprec.get_strategy("fp16-mixed", init_scale=1e30)
    with pytest.raises(ValueError, match=r"init_scale must be at most 2\*\*24.*every step would be skipped"):
        hf_lowprec.get_strategy("fp16-mixed", init_scale=2.0**40)


@pytest.mark.parametrize("name", ["fp16-als", "fp16-mixed"])
def test_refused_under_deepspeed_with_a_reason(name, tmp_path):
    from hf_lowprec import TrainingArguments
    from hf_lowprec.engines.zero import zero_support

    for stage in (1, 2, 3):
        message = zero_support(get_strategy(name), stage)
        assert message is not None and "no FP16" in message and "bf16-mixed" in message
    # Refused when the arguments are built, before any model or process group exists.
    config = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}
    with pytest.raises(ValueError, match=r"not supported under DeepSpeed ZeRO stage 2.*no FP16"):
        TrainingArguments(output_dir=str(tmp_path), precision_strategy=name, use_cpu=True, deepspeed=config)


@pytest.mark.slow
@pytest.mark.parametrize("name, options", [("fp16-als", None), ("fp16-mixed", None)])
def test_trainer_save_and_resume_bit_for_bit(tmp_path, name, options):
    kw = dict(gradient_accumulation_steps=2, per_device_train_batch_size=2, precision_options=options)
    trainer = Trainer(model=tiny_gpt2(), args=checkpointed_args(tmp_path, name, **kw), train_dataset=TokenBlocks())
    trainer.train()
    full = logged_losses(trainer)
    assert len(full) == 6 and full[-1][1] < full[0][1]
    assert "precision/loss_scale" in trainer.state.log_history[0]
    resumed = Trainer(
        model=tiny_gpt2(seed=7), args=checkpointed_args(tmp_path, name, **kw), train_dataset=TokenBlocks()
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert logged_losses(resumed) == full
    assert resumed.precision.scaler.get_scale() == trainer.precision.scaler.get_scale()
    for a, b in zip(trainer.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_overflow_injection_in_trainer_is_clipped_not_skipped(tmp_path):
    args = checkpointed_args(tmp_path, "fp16-als", max_steps=10, save_strategy="no", max_grad_norm=1.0)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenBlocks())
    weight = trainer.model.transformer.h[0].mlp.c_fc.weight

    def overflow(grad):
        # On the 4th optimizer step, 100 elements of this FP16 weight gradient overflow.
        if trainer.state.global_step == 3:
            grad = grad.clone()
            grad.view(-1)[:50] = math.inf
            grad.view(-1)[50:100] = -math.inf
        return grad

    weight.register_hook(overflow)
    snap = ParameterSnapshots()
    trainer.add_callback(snap)
    trainer.train()
    snapshots = snap.taken
    logs = [h for h in trainer.state.log_history if "loss" in h]
    scales = [h["precision/loss_scale"] for h in logs]
    clipped = [h["precision/clipped_elements"] for h in logs]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert all(h["precision/skipped_steps"] == 0.0 for h in logs)
    # The norm of the clipped gradients, 10·65504/8 = 81880 plus the ordinary ones (~1), is
    # measured in FP32: torch's FP16 norm would be inf and would zero every gradient.
    assert all(math.isfinite(h["grad_norm"]) for h in logs)
    assert logs[3]["grad_norm"] == pytest.approx(81880.0, rel=1e-3)
    # The injected step overflowed, was clipped to ±65504 and still updated every weight...
    assert clipped == [0.0, 0.0, 0.0, 100.0] + [0.0] * 6
    assert not any(torch.equal(a, b) for a, b in zip(snapshots[2], snapshots[3]))
    # ...and the scale dropped there, then grew back past its pre-injection value.
    assert scales[:4] == [2.0, 4.0, 8.0, 4.0]
    assert scales[-1] > scales[2]


def test_accelerate_plugin_with_fp16_als_accumulates_and_clips_in_fp32():
    from accelerate import Accelerator

    from hf_lowprec.integrations.accelerate import PrecisionPlugin

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    plugin = PrecisionPlugin("fp16-als")
    torch.manual_seed(0)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = plugin.prepare(accelerator, model, optimizer)
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    data = batches(4)
    for ids in data:
        with accelerator.accumulate(model):
            plugin.backward(accelerator, model(input_ids=ids, labels=ids).loss)
            if accelerator.sync_gradients:
                norm = plugin.clip_grad_norm_(accelerator, model.parameters(), 1.0)
                assert norm.dtype == torch.float32 and math.isfinite(norm.item())
            optimizer.step()
            optimizer.zero_grad()
    # Two optimizer steps from scale 1, and the loss division undone for the running mean.
    assert plugin.strategy.scaler.get_scale() == 4.0
    assert plugin.strategy._loss_divisor == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("loaded", [torch.float32, torch.bfloat16])
def test_a_weight_beyond_fp16s_range_is_refused_before_anything_is_cast(loaded):
    # 1e5 rounds to inf in FP16 (largest finite 65504; 65520 and up round to inf): the model would
    # train on as NaN losses with every step skipped. 65280 (exact in BF16 and FP16) is kept.
    model = tiny_gpt2().to(loaded)
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[0, 0] = 1e5
        model.transformer.ln_f.weight[0] = 65280.0
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(
        ValueError,
        match=r"FP16 cannot hold.*transformer\.h\.1\.mlp\.c_fc\.weight \(largest \|value\| (1e\+05|9\.984e\+04)\)\.",
    ) as refused:
        get_strategy("fp16-als").prepare_model(model)
    assert "ln_f" not in str(refused.value)
    assert all(torch.equal(p, before[n]) and p.dtype == loaded for n, p in model.named_parameters())
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[0, 0] = 65280.0
    prepared = get_strategy("fp16-als").prepare_model(model)
    assert all(torch.isfinite(p).all() for p in prepared.parameters())


@pytest.mark.parametrize("name", ["fp16-als", "fp16-mixed"])
def test_a_custom_loop_backward_without_the_loss_scale_is_refused(name):
    # `loss.backward()` instead of `strategy.scale_loss(loss).backward()`: the step would divide
    # the true gradients by the scale. The step refuses, names the fix, and moves nothing; a step
    # after a scaled backward goes on as before.
    strategy, model, optimizer = setup(name)
    ids = batches(1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    with strategy.forward_context():
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    with pytest.raises(RuntimeError, match=r"strategy\.scale_loss\(loss\)\.backward\(\)"):
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    optimizer.zero_grad(set_to_none=True)
    strategy.train_step(model, ids, optimizer)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("name", ["fp16-als", "fp16-mixed"])
def test_one_scaled_backward_steps_two_optimizers(name):
    # Each optimizer steps once on the scaled backward; a second step of the same optimizer with
    # no scaled backward since is refused.
    strategy = hf_lowprec.get_strategy(name)
    model = strategy.prepare_model(tiny_gpt2())
    blocks = set(model.transformer.h.parameters())
    first = strategy.create_optimizer([p for p in model.parameters() if p in blocks], lr=1e-3)
    second = strategy.create_optimizer([p for p in model.parameters() if p not in blocks], lr=1e-3)
    ids = batches(1)[0]
    for _ in range(2):
        with strategy.forward_context():
            loss = model(input_ids=ids, labels=ids).loss
        strategy.scale_loss(loss).backward()
        first.step()
        second.step()
    with pytest.raises(RuntimeError, match="did not go through the loss scale"):
        first.step()


@pytest.mark.parametrize("name", ["fp16-als", "fp16-mixed"])
@pytest.mark.parametrize("set_to_none", [False, True])
def test_a_step_with_no_backward_steps_as_stock(name, set_to_none):
    """`zero_grad(set_to_none=False)` then `step()` with no backward: stock AdamW steps on the zero
    gradients (weight decay, momentum); fp16-als and fp16-mixed raised "gradients came from a backward
    that did not go through the loss scale" (none ran), and fp16-mixed with set_to_none=True failed
    in GradScaler ("No inf checks were recorded"). Now the step equals one on the zeros of a scaled
    backward of 0·loss, bit for bit (None gradients: no parameter moves, as torch's); the scaler is
    left as it was, and the next backward's step equals that run's."""

    def run(idle):
        strategy, model, optimizer = setup(name)
        ids = batches(3, seed=7)
        for i in range(3):
            if i != 1 or not idle:
                loss = model(input_ids=ids[i], labels=ids[i]).loss
                strategy.scale_loss(loss * (0.0 if i == 1 else 1.0)).backward()
            scale = float(strategy.scaler.get_scale())
            optimizer.step()
            if i == 1 and idle:
                assert float(strategy.scaler.get_scale()) == scale  # no update
            optimizer.zero_grad(set_to_none=set_to_none)
            yield [p.detach().clone() for p in model.parameters()]

    first, idle, after = run(idle=True)
    _, zeros, after_zeros = run(idle=False)
    for w0, w1, w0z, w2, w2z in zip(first, idle, zeros, after, after_zeros):
        assert torch.equal(w1, w0 if set_to_none else w0z)
        if name == "fp16-mixed" and not set_to_none:  # (fp16-als's scale moved on in the 0·loss run)
            assert torch.equal(w2, w2z)
