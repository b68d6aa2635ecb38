"""FP8-LM strategies O1 and O2 (docs/algorithms.md §3), in the plain training loop of the brief."""

import copy
import io
import math

import pytest
import torch
import transformers

import hf_lowprec
from hf_lowprec.fp8 import AllReduceStats, FP8CommState, FP8Linear, fp8_allreduce_hook, pow2_scale
from hf_lowprec.fp8.linear import get_grad_sink, set_grad_sink
from hf_lowprec.memory import model_state_bytes
from hf_lowprec.optim import FP8AdamW, PlainAdamW
from hf_lowprec.testing import snr_db
from tests.helpers import assert_bits_equal, batches, snr_floor_db, tiny_gpt2
from tests.helpers import train_steps as train

NAMES = ["fp8-lm-o1", "fp8-lm-o2"]


def setup(name, seed=0, lr=3e-3, n_embd=64, **options):
    strategy = hf_lowprec.get_strategy(name, **options)
    model = strategy.prepare_model(tiny_gpt2(seed, n_embd))
    optimizer = strategy.create_optimizer(model.parameters(), lr=lr, weight_decay=0.01)
    return strategy, model, optimizer


@pytest.mark.parametrize(
    "options, match",
    [
        ({"margin": -1}, "margin"),
        ({"margin": 1.5}, "margin"),
        ({"auto_scale_interval": 0}, "auto_scale_interval"),
        ({"auto_scale_threshold": 1.0}, "auto_scale_threshold"),
        ({"grad_format": "fp16"}, "grad_format"),
        ({"exp_avg_sq_format": "int8"}, "exp_avg_sq_format"),
        ({"lost_arithmetic_metrics": "yes"}, "lost_arithmetic_metrics"),
    ],
)
def test_bad_options_raise_before_any_work(options, match):
    with pytest.raises(ValueError, match=match):
        hf_lowprec.get_strategy("fp8-lm-o2", **options)


def test_level_is_fixed_by_the_name_and_validated():
    with pytest.raises(ValueError, match="fixed by the strategy name"):
        hf_lowprec.get_strategy("fp8-lm-o1", level="O2")
    with pytest.raises(ValueError, match="O1"):
        hf_lowprec.get_strategy("fp8-lm-o1", exp_avg_sq_format="e4m3")
    from hf_lowprec.strategies.fp8_lm import FP8LMOptions

    with pytest.raises(ValueError, match="level"):
        FP8LMOptions(level="O3")


@pytest.mark.parametrize("name", NAMES)
def test_model_and_optimizer_layout(name):
    strategy, model, optimizer = setup(name)
    o2 = name.endswith("o2")
    fp8_layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert len(fp8_layers) == 8  # c_attn, c_proj, c_fc, mlp.c_proj in each of 2 blocks
    assert all((m.master_scale is not None) == o2 for m in fp8_layers)
    fp8_weights = {id(m.weight) for m in fp8_layers}
    for n, p in model.named_parameters():
        # O2: FP8 GEMM weights are scaled FP16 masters; LayerNorm, biases, embeddings stay FP32.
        expected = torch.float16 if o2 and id(p) in fp8_weights else torch.float32
        assert p.dtype == expected, f"{n}: {p.dtype}"
    assert set(strategy.promised_param_dtypes()) == ({torch.float32, torch.float16} if o2 else {torch.float32})
    assert isinstance(optimizer.optimizer, FP8AdamW if o2 else PlainAdamW)
    state, hook = strategy.ddp_comm_hook()
    assert isinstance(state, FP8CommState) and state.scaler is strategy.scaler and hook is fp8_allreduce_hook


def test_o2_model_state_is_6_bytes_on_fp8_weights_and_16_on_the_rest():
    strategy, model, optimizer = setup("fp8-lm-o2")
    train(strategy, model, optimizer, batches(1))
    measured = model_state_bytes(model, optimizer)
    fp8 = sum(p.numel() for p in model.parameters() if p.dtype == torch.float16)
    total = sum(p.numel() for p in model.parameters())
    # FP8 GEMM weights: 2 (FP16 master) + 1 (FP8 gradient) + 1 (E4M3 m) + 2 (FP16 v);
    # the others: 4 (FP32 master) + 4 (FP32 gradient) + 8 (FP32 m, v). Plus per-tensor scalars.
    documented = (6 * fp8 + 16 * (total - fp8)) / total
    assert fp8 / total == pytest.approx(0.829, abs=1e-3)  # the tiny test GPT-2
    assert strategy.bytes_per_param == pytest.approx(documented)
    assert documented <= measured["total"] <= documented + 0.01, measured
    assert measured["params"] == pytest.approx((2 * fp8 + 4 * (total - fp8)) / total)
    assert all(p.grad is None for p in model.parameters() if p.dtype == torch.float16), "FP8 gradients only"


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_a_recipe_changes_no_model_state_byte(recipe):
    # The recipe scales the GEMM operands, which live only inside a step: the masters, FP8
    # gradients and FP8AdamW states (and their bytes) are tensorwise's, tensor for tensor.
    states = {}
    for r in ("tensorwise", recipe):
        strategy, model, optimizer = setup("fp8-lm-o2", recipe=r)
        train(strategy, model, optimizer, batches(1))
        layout = [
            (k, v.dtype, tuple(v.shape)) for k, v in optimizer.state_dict()["state"][0].items() if torch.is_tensor(v)
        ]
        states[r] = (model_state_bytes(model, optimizer), layout)
    assert states[recipe] == states["tensorwise"]


def test_o2_trains_layernorm_gains_at_lr_1e_4():
    """FP32 masters for non-FP8 parameters: a LayerNorm gain at 1.0 takes an update of 1e-4.

    Adam's first step is θ ← θ − lr·(g/(|g| + ε) + λ·θ) (m̂ = g, √v̂ = |g|); computed in FP64
    here. With an FP32 master the error is the rounding of θ + Δθ, half an FP32 ulp at 1.0
    (2^-24), plus FP32 roundings inside Δθ (a few 2^-24 relative to 1e-4: < 1e-10). An FP16
    master (the old O2) cannot move at all: half its ulp at 1.0 is 4.9e-4 > 1e-4.
    """
    lr, wd = 1e-4, 0.01
    _strategy, model, optimizer = setup("fp8-lm-o2", lr=lr)
    gains = [m.weight for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    before = [g.detach().double().clone() for g in gains]
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    grads = [g.grad.double() for g in gains]
    optimizer.step()
    for gain, theta, grad in zip(gains, before, grads):
        assert gain.dtype == torch.float32
        expected = theta - lr * (grad / (grad.abs() + 1e-8) + wd * theta)
        assert (gain.detach().double() - expected).abs().max() <= 2.0**-24 + 1e-10
        assert (gain.detach().double() != theta).all()


def test_o2_masters_are_scaled_from_the_real_values_not_from_their_fp16_rounding():
    """One block's weights ×1e-4 (mostly FP16 subnormals) and one element at 1e5 (beyond FP16's
    65504): the scaled master payload/s_m must hold each real value to FP16's rounding, 2^-11
    relative, wherever the scaled value is an FP16 normal (|w|·s_m ≥ 2^-14). Cast to FP16 first,
    the small ones kept 1% and the large one became inf (a NaN loss, every step skipped)."""
    model = tiny_gpt2()
    small, large = model.transformer.h[0].attn.c_attn.weight, model.transformer.h[1].mlp.c_fc.weight
    with torch.no_grad():
        small.mul_(1e-4)
        large[0, 0] = 1e5
    real = {id(p): p.detach().double().clone() for p in (small, large)}
    hf_lowprec.get_strategy("fp8-lm-o2").prepare_model(model)
    layers = [model.transformer.h[0].attn.c_attn, model.transformer.h[1].mlp.c_fc]
    for layer in layers:
        assert layer.weight.dtype == torch.float16 and torch.isfinite(layer.weight).all()
        scale = layer.master_scale.double()
        w = real[id(layer.weight)]
        normal = w.abs() * scale >= 2.0**-14
        assert normal.float().mean() > 0.99
        rel = ((layer.weight.double() / scale - w).abs() / w.abs())[normal]
        assert rel.max() <= 2.0**-11


def test_o2_makes_frozen_parameters_fp32_but_gemm_weights_and_gives_them_no_master():
    # checkpoints: a frozen parameter of a model loaded in BF16 is made FP32 from its values, as its
    # FP32 load holds it (a frozen block meets FP32 neighbours), and takes no scaled master; a frozen
    # GEMM layer's weight (c_attn, the embedding tied to the LM head) keeps its 16 bits under autocast.
    model = tiny_gpt2().to(torch.bfloat16)
    model.transformer.h[0].attn.c_attn.weight.requires_grad_(False)
    model.transformer.wte.weight.requires_grad_(False)  # tied to the LM head, as GPT-2 ties them
    before = model.transformer.h[0].attn.c_attn.weight.detach().float()
    strategy, model, optimizer = setup_prepared("fp8-lm-o2", model)
    frozen = model.transformer.h[0].attn.c_attn
    assert isinstance(frozen, FP8Linear) and frozen.master_scale is None
    assert frozen.weight.dtype == torch.bfloat16
    assert_bits_equal(frozen.weight.detach().float(), before, "frozen c_attn")
    assert model.transformer.wte.weight.dtype == torch.bfloat16
    assert model.transformer.h[0].ln_1.weight.dtype == torch.float32  # trainable, beside the frozen c_attn
    trained = model.transformer.h[1].attn.c_attn
    assert trained.weight.dtype == torch.float16 and trained.master_scale is not None
    assert model.transformer.ln_f.weight.dtype == torch.float32  # trainable, not FP8: an FP32 master
    train(strategy, model, optimizer, batches(2))
    assert_bits_equal(frozen.weight.detach().float(), before, "frozen c_attn after training")


def setup_prepared(name, model):
    strategy = hf_lowprec.get_strategy(name)
    model = strategy.prepare_model(model)
    params = [p for p in model.parameters() if p.requires_grad]
    return strategy, model, strategy.create_optimizer(params, lr=3e-3)


class _KeptLinear(torch.nn.Linear):
    """An `nn.Linear` subclass: its own forward, so FP8 conversion keeps it in high precision."""


def test_o2_gives_no_scaled_master_to_a_weight_a_kept_layer_shares():
    # The kept layer would read the payload real·s_m (s_m ~ 2^19) as its weight: loss ~1e5.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.ReLU(), _KeptLinear(64, 64, bias=False))
    model[2].weight = model[0].weight
    x = torch.randn(8, 64)
    outputs = {}
    for name in NAMES:
        prepared = hf_lowprec.get_strategy(name).prepare_model(copy.deepcopy(model))
        assert isinstance(prepared[0], FP8Linear) and type(prepared[2]) is _KeptLinear
        assert prepared[0].weight is prepared[2].weight and prepared[0].weight.dtype == torch.float32
        with torch.no_grad():
            outputs[name] = prepared(x)
    assert_bits_equal(outputs["fp8-lm-o2"], outputs["fp8-lm-o1"])


def tiny_t5_with_large_feed_forward_activations():
    """A one-layer T5 v1.1 (gated-GELU) whose encoder wi_0/wi_1 are ×120: the input of `wo` exceeds
    FP16's 65504, as in T5 v1.1 and large checkpoints (why T5 keeps `wo` in FP32)."""
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, dropout_rate=0.0, feed_forward_proj="gated-gelu",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config)
    with torch.no_grad():
        model.encoder.block[0].layer[-1].DenseReluDense.wi_0.weight.mul_(120.0)
        model.encoder.block[0].layer[-1].DenseReluDense.wi_1.weight.mul_(120.0)
    ids = torch.randint(2, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(2, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    return model, {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("name", ["fp8-lm-o2", "fp8-lm-o3"])
def test_o2_gives_an_fp32_master_to_what_the_model_keeps_in_fp32(name, caplog):
    """T5 casts the input of `wo` to `wo.weight.dtype`: an FP16 master made it FP16, activations
    beyond 65504 became inf and the loss NaN (every step skipped). `_keep_in_fp32_modules` layers
    now keep an FP32 master, the input reaches the FP8 cast in BF16, and the loss is FP8's."""
    model, batch = tiny_t5_with_large_feed_forward_activations()
    wo_inputs = []
    reference_model = copy.deepcopy(model).double()
    reference_wo = reference_model.encoder.block[0].layer[-1].DenseReluDense.wo
    hook = reference_wo.register_forward_hook(lambda module, args, out: wo_inputs.append(args[0].abs().max().item()))
    with torch.no_grad():
        reference = reference_model(**batch)
    hook.remove()
    assert wo_inputs[0] > torch.finfo(torch.float16).max  # the case FP16 cannot hold
    strategy = hf_lowprec.get_strategy(name)
    with caplog.at_level("WARNING"):
        prepared = strategy.prepare_model(model)
    feed_forward = prepared.encoder.block[0].layer[-1].DenseReluDense
    assert isinstance(feed_forward.wo, FP8Linear) and feed_forward.wo.weight.dtype == torch.float32
    assert feed_forward.wi_0.weight.dtype == torch.float16  # the other FP8 layers keep scaled FP16 masters
    assert "DenseReluDense.wo keeps an FP32 master, not a scaled FP16 one: the model keeps it in FP32" in caplog.text
    with torch.no_grad(), strategy.forward_context():
        out = prepared(**batch)
    # The logits come out of at most 8 FP8 GEMMs in series (encoder attention and feed-forward,
    # decoder cross-attention and feed-forward, 2 each), whose relative noise powers add.
    floor = snr_floor_db(torch.float8_e4m3fn, torch.float8_e4m3fn, torch.bfloat16) - 10 * math.log10(8)
    assert snr_db(reference.logits, out.logits) >= floor
    # Cross-entropy's gradient in the logits, softmax − one-hot, has an L2 norm ≤ √2, so each of T
    # tokens' losses moves by ≤ √2·‖Δz_t‖ and their mean by ≤ √(2/T)·‖Δz‖ (Cauchy–Schwarz), with
    # ‖Δz‖ ≤ ‖z‖·10^(−floor/20).
    tokens = batch["labels"].numel()
    bound = math.sqrt(2 / tokens) * reference.logits.norm().item() * 10 ** (-floor / 20)
    assert abs(out.loss.item() - reference.loss.item()) <= bound
    optimizer = strategy.create_optimizer(prepared.parameters(), lr=1e-3)
    loss = strategy.train_step(prepared, batch, optimizer, loss_fn=lambda m, b: m(**b).loss)
    assert math.isfinite(loss.item()) and strategy.skipped_steps == 0


ALREADY = "already in the model keep their own configuration"


@pytest.mark.parametrize("name", ["fp8-lm-o1", "fp8-lm-o2", "fp8-lm-o3", "coat"])
@pytest.mark.parametrize("before", ["rowwise", "tensorwise"])
def test_a_model_converted_before_the_strategy_keeps_its_layers_config_with_one_warning(name, before, caplog):
    """Before: FP8Linear layers the user made (`convert_to_fp8(model, recipe=..., margin=3)`) kept
    their recipe and margin under the strategy's other options, with no warning, and the startup
    report printed the options' recipe and margin beside layers that used others. The layers are
    still not re-configured (the user chose their configuration); the strategy warns once."""
    from hf_lowprec.fp8 import convert_to_fp8
    from hf_lowprec.report import describe, format_report

    other = "rowwise" if before == "tensorwise" else "tensorwise"
    options = {} if name == "coat" else {"recipe": other}  # COAT converts with tensorwise, margin 0
    ours = f"recipe {'tensorwise' if name == 'coat' else other}, margin 0"
    theirs = f"recipe {before}, margin 3"
    model = convert_to_fp8(tiny_gpt2(), recipe=before, margin=3)
    made = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert made
    strategy = hf_lowprec.get_strategy(name, **options)
    with caplog.at_level("WARNING"):
        prepared = strategy.prepare_model(model)
    warned = [r.getMessage() for r in caplog.records if ALREADY in r.getMessage()]
    assert len(warned) == 1, warned
    assert f"{len(made)} FP8 layers already in the model" in warned[0]
    assert f"({len(made)} with {theirs})" in warned[0] and f"conversion's ({ours}" in warned[0]
    assert "pass the strategy the recipe and margin" in warned[0] and "let the strategy convert" in warned[0]
    layers = [m for m in prepared.modules() if isinstance(m, FP8Linear)]
    assert layers == made and all((m.config.recipe.name, m.config.margin) == (before, 3) for m in layers)
    report = format_report(describe(strategy, prepared))
    assert f"FP8 layers: {len(made)} converted ({len(made)} with {theirs})" in report, report


@pytest.mark.parametrize("converted", ["by the user, with the same options", "by the strategy"])
def test_fp8_layers_with_the_strategys_config_are_not_warned_about(converted, caplog):
    from hf_lowprec.fp8 import convert_to_fp8
    from hf_lowprec.report import describe, format_report

    model = tiny_gpt2()
    if converted.startswith("by the user"):
        convert_to_fp8(model, recipe="rowwise", margin=3)
    strategy = hf_lowprec.get_strategy("fp8-lm-o2", recipe="rowwise", margin=3)
    with caplog.at_level("WARNING"):
        prepared = strategy.prepare_model(model)
        strategy.prepare_model(prepared)  # prepared again (a second Trainer): still nothing to say
    assert ALREADY not in caplog.text
    count = sum(isinstance(m, FP8Linear) for m in prepared.modules())
    assert f"converted ({count} with recipe rowwise, margin 3)" in format_report(describe(strategy, prepared))


def test_o1_gradients_hold_fp8_values():
    strategy, model, optimizer = setup("fp8-lm-o1")
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    assert float(strategy.process_gradients(optimizer.optimizer)) == 0.0  # 1.0 would skip the step
    grad = model.transformer.h[0].mlp.c_fc.weight.grad
    # Values are FP8 payloads over a power-of-two scale: multiplied back they are exact E4M3.
    scale = pow2_scale(grad.abs().max(), torch.float8_e4m3fn)
    assert torch.equal((grad * scale).to(torch.float8_e4m3fn).float(), grad * scale)


def test_tiny_gpt2_trains_under_o1_and_o2_close_to_fp32():
    data = batches(2) * 12
    final = {}
    for name in ["fp32", *NAMES]:
        strategy, model, optimizer = setup(name)
        losses = train(strategy, model, optimizer, data)
        assert losses[-1] < losses[0] - 1.0, f"{name}: {losses[0]:.3f} -> {losses[-1]:.3f}"
        final[name] = sum(losses[-2:]) / 2
    # Measured after 24 steps (from 5.55): fp32 2.737, O1 2.740, O2 2.758 (FP16 non-FP8
    # parameters), 2.743 (FP32 masters for them); under BF16 autocast for the non-FP8
    # operations: O1 2.749, O2 2.743 (bf16-mixed 2.738), within 0.5% of fp32.
    for name in NAMES:
        assert final[name] <= final["fp32"] + 0.15, final


@pytest.mark.parametrize(
    "name, recipe",
    [(name, "tensorwise") for name in NAMES] + [("fp8-lm-o2", r) for r in ("rowwise", "blockwise", "mxfp8")],
)
def test_checkpoint_carries_mu_and_resumes_bit_for_bit(name, recipe):
    data = batches(5)
    n_embd = 128 if recipe == "blockwise" else 64  # every block layer on 128-blocks
    strategy, model, optimizer = setup(name, auto_scale_interval=4, recipe=recipe, n_embd=n_embd)
    fp8_layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert len(fp8_layers) == 8 and all(m.recipe == recipe for m in fp8_layers)
    train(strategy, model, optimizer, data[:2])
    # A state the run could be in: μ halved once, some clean steps since.
    strategy.scaler.mu, strategy.scaler.clean_steps = 0.5, 3
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert saved["optimizer"]["hf_lowprec"]["grad_mu"] == 0.5

    strategy2, model2, optimizer2 = setup(name, seed=7, auto_scale_interval=4, recipe=recipe, n_embd=n_embd)
    model2.load_state_dict(saved["model"])
    optimizer2.load_state_dict(saved["optimizer"])
    assert (strategy2.scaler.mu, strategy2.scaler.clean_steps) == (0.5, 3)
    assert train(strategy, model, optimizer, data[2:]) == train(strategy2, model2, optimizer2, data[2:])
    assert strategy.scaler.mu == strategy2.scaler.mu == 1.0, "the 4th clean step doubles μ"
    for (key, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert_bits_equal(a, b, key)


def test_metrics_report_mu_and_saturation():
    strategy, model, optimizer = setup("fp8-lm-o2")
    train(strategy, model, optimizer, batches(1))
    metrics = strategy.metrics()
    assert metrics["precision/fp8_grad_mu"] == 1.0
    assert metrics["precision/fp8_grad_saturated_share"] == 0.0
    assert metrics["precision/skipped_steps"] == 0.0


def fp8_weights(model):
    return [p for p in model.parameters() if p.dtype == torch.float16]


def test_o2_gradients_are_fp8_right_after_backward():
    """No full-model FP16 `p.grad` between backward and the step: model state right after
    backward is what it is between steps (7.71 bytes/param here; 9.37 when the FP16 gradients
    waited for the step, i.e. 8.0 instead of 6.0 on the FP8 GEMM weights)."""
    strategy, model, optimizer = setup("fp8-lm-o2")
    train(strategy, model, optimizer, batches(1))
    between = model_state_bytes(model, optimizer)["total"]
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is None for p in fp8_weights(model))
    assert all(optimizer.optimizer.fp8_grad(p) is not None for p in fp8_weights(model))
    assert model_state_bytes(model, optimizer)["total"] == pytest.approx(between, abs=1e-9)


def weight_gradients_from_their_gemms(model, loss_factor):
    """Each FP8 layer's weight gradient as its FP8 GEMM's backward hands it on (BF16), in FP64,
    taken by gradient sinks in place of the strategy's for one backward."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, FP8Linear)}
    kept = {name: get_grad_sink(m.weight) for name, m in layers.items()}
    out = {}
    for name, layer in layers.items():
        set_grad_sink(layer.weight, lambda g, name=name: out.__setitem__(name, g.double()))
    ids = batches(1)[0]
    (model(input_ids=ids, labels=ids).loss * loss_factor).backward()
    for name, layer in layers.items():
        set_grad_sink(layer.weight, kept[name])
    return out


@pytest.mark.parametrize("grad_format", ["e4m3", "e5m2"])
def test_o2_quantizes_small_weight_gradients_from_their_gemm_not_from_fp16(grad_format):
    """Loss x 1e-5 (gradients ~1e-7 and below, under FP16's 2^-14 normal range and often its
    2^-24 floor): O2's stored FP8 gradient is the FP8 rounding of the GEMM's gradient itself.

    With μ = 1 and a power-of-two scale s, each element rounds once: |q - g| ≤ (eps/2)·|g| in
    the normal range plus half the smallest subnormal, (eps·min_normal/2)/s, below it (E4M3:
    2^-4 and 2^-10/s; E5M2: 2^-3 and 2^-17/s). Rounded first to unscaled FP16, 49 to 98 % of the
    elements were 0. Zeros are then only those of FP8's own floor, as under O1: at most O1's
    share plus 0.1 % (O1's FP32 masters round the forward's weights differently; measured 12
    and 12 zeros of 123k).
    """
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[grad_format]
    info = torch.finfo(dtype)
    _strategy, model, optimizer = setup("fp8-lm-o2", grad_format=grad_format)
    reference = weight_gradients_from_their_gemms(model, 1e-5)
    ids = batches(1)[0]
    (model(input_ids=ids, labels=ids).loss * 1e-5).backward()
    o1, model1, optimizer1 = setup("fp8-lm-o1", grad_format=grad_format)
    (model1(input_ids=ids, labels=ids).loss * 1e-5).backward()
    o1.process_gradients(optimizer1.optimizer)
    o1_grads = {name: m.weight.grad for name, m in model1.named_modules() if isinstance(m, FP8Linear)}
    zeros = zeros_o1 = total = 0
    for name, layer in ((n, m) for n, m in model.named_modules() if isinstance(m, FP8Linear)):
        assert layer.weight.grad is None
        payload, scale = optimizer.optimizer.fp8_grad(layer.weight)
        got, exact = payload.double() / scale.double(), reference[name]
        assert exact.abs().max() < 2.0**-14, "the gradients must lie under FP16's normal range"
        bound = info.eps / 2 * exact.abs() + info.eps * info.smallest_normal / 2 / scale.double()
        assert ((got - exact).abs() <= bound).all(), name
        zeros, zeros_o1, total = (
            zeros + int((got == 0).sum()),
            zeros_o1 + int((o1_grads[name] == 0).sum()),
            total + got.numel(),
        )
    assert zeros / total <= zeros_o1 / total + 1e-3, (zeros, zeros_o1, total)


@pytest.mark.parametrize("name", ["fp8-lm-o2", "fp8-lm-o3"])
def test_autograd_grad_through_fp8_layers_leaves_the_steps_as_they_were(name):
    """`torch.autograd.grad` (a saliency map, a gradient penalty) and `backward(inputs=...)` accumulate
    nothing into the weights: the FP8 layers' gradient sinks give those gradients back to autograd
    and store none, so the next steps are those of a run without them, bit for bit."""
    data = batches(3)

    def losses(probe):
        strategy, model, optimizer = setup(name)
        if probe:
            emb = model.transformer.wte(data[0]).detach().requires_grad_(True)
            torch.autograd.grad(model(inputs_embeds=emb, labels=data[0]).loss, emb)
            model(inputs_embeds=emb, labels=data[0]).loss.backward(inputs=[emb])
        return [strategy.train_step(model, x, optimizer).item() for x in data]

    assert losses(True) == losses(False)


def test_autograd_grad_of_an_fp8_weight_is_its_gemm_gradient():
    """`torch.autograd.grad` with respect to an O2 FP8 weight returns its GEMM's gradient (in the
    weight's dtype, as `p.grad` would hold it), not None: the sink leaves it to autograd."""
    _strategy, model, _optimizer = setup("fp8-lm-o2")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    reference = weight_gradients_from_their_gemms(model, 1.0)
    ids = batches(1)[0]
    grads = torch.autograd.grad(model(input_ids=ids, labels=ids).loss, [m.weight for m in layers.values()])
    for (name, layer), grad in zip(layers.items(), grads, strict=True):
        assert torch.equal(grad, reference[name].to(layer.weight.dtype)), name


def micro_batch_gradients(data):
    """Each micro-batch's FP8 GEMM weight gradients, from a model whose backward keeps p.grad."""
    strategy, model, _ = setup("fp8-lm-o2")
    strategy.backward_grads.owner = None
    out = []
    for ids in data:
        model(input_ids=ids, labels=ids).loss.backward()
        out.append([p.grad.double() for p in fp8_weights(model)])
        model.zero_grad(set_to_none=True)
    return out


def test_o2_gradient_accumulation_in_fp8_matches_the_fp64_sum():
    """4 micro-batches accumulated in FP8, one E4M3 rounding of each partial sum P_k.

    Each rounding errs by ≤ 2^-4·|P_k| elementwise in the normal range (plus 2^-10/s below
    it), so ‖error‖ ≤ 2^-4·Σ_k ‖P_k‖; 10 % on top covers the subnormal tail and the drift
    of P_k from its exact value.
    """
    data = batches(4, seed=3)
    reference = micro_batch_gradients(data)
    _strategy, model, optimizer = setup("fp8-lm-o2")
    for ids in data:
        model(input_ids=ids, labels=ids).loss.backward()
    for i, p in enumerate(fp8_weights(model)):
        payload, scale = optimizer.optimizer.fp8_grad(p)
        got = payload.double() / scale.double()
        partials = torch.stack([g[i] for g in reference]).cumsum(0)
        error = (got - partials[-1]).norm()
        bound = 1.1 * 2.0**-4 * sum(partial.norm() for partial in partials)
        assert error <= bound, f"parameter {i}: {error:.3g} > {bound:.3g}"
        assert error > 0  # FP8 did round: the test sees the stored values


def test_o2_clipping_reaches_fp8_gradients_without_rounding_them():
    """Norm over FP8 and FP32 gradients as FP64 computes it; clipping by c divides each FP8
    scale by c, so the gradients become c·g up to two FP32 roundings (2^-23 relative)."""
    strategy, model, optimizer = setup("fp8-lm-o2")
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    inner = optimizer.optimizer
    params = list(model.parameters())

    def gradients():
        out = []
        for p in params:
            stored = inner.fp8_grad(p)
            out.append(p.grad.double() if stored is None else stored[0].double() / stored[1].double())
        return out

    before = gradients()
    norm = torch.cat([g.flatten() for g in before]).norm()
    for c in (0.0135, 3e-4, 1.4e-6):
        measured = strategy.clip_grad_norm(params, c * norm.item())
        assert abs(measured.item() - norm.item()) <= 1e-5 * norm.item()  # FP32 sum of squares
        clipped = gradients()
        coefficient = c * norm.item() / (measured.item() + 1e-6)
        for g0, g1 in zip(before, clipped):
            assert torch.allclose(g1, coefficient * g0, rtol=2.0**-22, atol=0)
            assert ((g1 == 0) == (g0 == 0)).all(), "clipping zeroed FP8 gradients"
        before, norm = clipped, torch.cat([g.flatten() for g in clipped]).norm()
    assert strategy.clip_grad_norm(params, float("inf")).item() == pytest.approx(norm.item(), rel=1e-5)


def test_o2_lost_arithmetic_metrics_are_taken_on_the_masters():
    """FP32 and scaled FP16 masters keep Adam's first step (|Δθ| = lr·|g|/(|g| + ε) ≈ 1e-3):
    what is lost is only where the FP8 gradient is 0 and the update is weight decay alone
    (λ·lr = 1e-5 relative, below half an FP16 ulp, 2^-11): 0.014% measured. The EDQ ratio is 1
    within the masters' rounding (FP16: 2^-11 relative of amax ≈ 0.1·Δθ at worst). Taken on the
    FP16 payloads instead, a doubling scale made the EDQ inf."""
    strategy, model, optimizer = setup("fp8-lm-o2", lr=1e-3, lost_arithmetic_metrics=True)
    strategy.measure_next_step = True
    train(strategy, model, optimizer, batches(1))
    metrics = strategy.metrics()
    assert metrics["precision/imprecision_pct"] < 0.1
    assert abs(metrics["precision/edq_ratio"] - 1.0) < 0.05, metrics


class _MatmulDtypes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the floating operand dtypes of every matrix product (after autocast's casts)."""

    PRODUCTS = frozenset(
        {"mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "_scaled_dot_product_flash_attention_for_cpu"}
    )

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.PRODUCTS:
            self.seen.append((func.overloadpacket.__name__, {a.dtype for a in args if torch.is_tensor(a)}))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", NAMES)
def test_every_matrix_product_runs_in_bf16(name):
    """Outside the FP8 layers (LM head, attention scores and values) the products run under BF16
    autocast as in bf16-mixed; the FP8 layers' own GEMMs take the BF16-widened FP8 payloads
    (exact). Before autocast, the LM head and attention computed in FP32."""
    strategy, model, _ = setup(name)
    assert strategy.compute_dtype == torch.bfloat16
    ids = batches(1)[0]
    with _MatmulDtypes() as mode:
        with strategy.forward_context():
            loss = model(input_ids=ids, labels=ids).loss
        strategy.scale_loss(loss).backward()
    # 2 blocks × (4 FP8 GEMMs + 2 attention products) + the LM head, each in forward and backward.
    assert len(mode.seen) >= 2 * (2 * 6 + 1), mode.seen
    assert all(dtypes == {torch.bfloat16} for _, dtypes in mode.seen), mode.seen
    assert loss.dtype == torch.float32  # the loss itself is FP32 (autocast's rule for cross-entropy)


def _saved_in_first_block(name):
    """Bytes autograd saves inside block 0 of the tiny GPT-2 under `name`'s forward context, by
    dtype, parameters left out (they are saved by reference)."""
    strategy, model, _ = setup(name)
    block = model.transformer.h[0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside, saved = [False], {}
    block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    block.register_forward_hook(lambda *_: inside.__setitem__(0, False))

    def pack(t):
        storage = t.untyped_storage()
        if inside[0] and storage.data_ptr() not in params:
            saved[storage.data_ptr()] = (storage.nbytes(), t.dtype)
        return t

    ids = batches(1)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), strategy.forward_context():
        model(input_ids=ids, labels=ids)
    by_dtype = {}
    for nbytes, dtype in saved.values():
        by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
    return by_dtype


def test_o2_block_saves_fp8_layer_inputs_in_fp8_only_and_the_rest_in_bf16():
    """Per block of the tiny GPT-2 (T = 4·32 tokens, h = 64, 2 heads), measured with
    saved-tensor hooks. FP8: the inputs of c_attn, attn.c_proj, c_fc (h each) and mlp.c_proj
    (4h), 7·h·T bytes, plus the per-step FP8 weights, 12·h² (1 byte per element), exactly; the
    FP8 layers save nothing else (tests/fp8/test_linear.py). The rest is bounded by what the
    non-FP8 operations keep: in FP32 the LayerNorm inputs (the residual stream: 2·4·h·T) with
    their mean and rstd (2·2·4·T), SDPA's log-sum-exp (4·2·32·4), the 8 FP8 scales and their
    reciprocals (kept for backward's GEMMs); in BF16 the q/k/v projection output (3·h·T·2),
    SDPA's output and its head-layout copies of k and v
    (3·h·T·2; the output is also attn.c_proj's input, which SDPA's backward needs) and the
    tanh-GELU's four intermediates (4·4h·T·2). With FP32 compute (before autocast) the GELU
    intermediates alone were twice that; bf16-mixed saves the linear inputs in BF16 and BF16
    copies of the weights, so it saves more in total.
    """
    h, tokens = 64, 4 * 32
    by_dtype = _saved_in_first_block("fp8-lm-o2")
    assert set(by_dtype) <= {torch.float8_e4m3fn, torch.float32, torch.bfloat16}, by_dtype
    assert by_dtype[torch.float8_e4m3fn] == 7 * h * tokens + 12 * h * h
    fp32_bound = 2 * 4 * h * tokens + 2 * 2 * 4 * tokens + 4 * 2 * 32 * 4 + 2 * 8 * 4
    bf16_bound = 3 * h * tokens * 2 + 3 * h * tokens * 2 + 4 * (4 * h * tokens) * 2
    assert by_dtype[torch.float32] <= fp32_bound, by_dtype
    assert by_dtype[torch.bfloat16] <= bf16_bound, by_dtype
    reference = _saved_in_first_block("bf16-mixed")
    assert sum(by_dtype.values()) < sum(reference.values()), (by_dtype, reference)


@pytest.mark.parametrize("name", ["fp8-lm-o1", "fp8-lm-o2"])
@pytest.mark.parametrize("guard", [False, True], ids=["plain", "guard"])
def test_q_k_v_and_gate_up_quantize_their_shared_input_once_with_the_same_bits(monkeypatch, name, guard):
    """A Llama layer under FP8-LM: q, k and v are handed one tensor, gate and up another; each is
    quantized once and saved once (`fp8.linear.share_inputs_within`): four input casts a layer
    where there were seven, and a step's loss, gradients and weights are those with a cast per
    layer, bit for bit (the guard's counted casts too)."""
    from transformers import LlamaForCausalLM

    from hf_lowprec.fp8 import linear
    from tests.helpers import tiny_llama_config

    casts = []
    for cast in ("_quantize_input", "counted_input_cast", "tensorwise_cast_transposed"):
        original = getattr(linear, cast)
        monkeypatch.setattr(linear, cast, lambda *a, _f=original, **k: casts.append(1) or _f(*a, **k))
    options = {"guard": True} if guard else {}
    results = []
    for sharing in (True, False):
        torch.manual_seed(0)
        strategy = hf_lowprec.get_strategy(name, **options)
        model = strategy.prepare_model(LlamaForCausalLM(tiny_llama_config(64)))
        scoped = [m for m in model.modules() if linear._open_scope in m._forward_pre_hooks.values()]
        assert len(scoped) == 2  # the attention and the MLP
        if not sharing:
            for module in scoped:
                module._forward_pre_hooks.clear()
                module._forward_hooks.clear()
        optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
        casts.clear()
        ids = batches(1)[0]
        with strategy.forward_context():
            loss = model(input_ids=ids, labels=ids).loss
        n_casts = len(casts)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        found_inf = strategy.process_gradients(optimizer)
        strategy.optimizer_step(optimizer, found_inf)
        results.append((n_casts, loss.detach(), grads, [p.detach().clone() for p in model.parameters()]))
    (shared_casts, *shared), (own_casts, *own) = results
    assert (shared_casts, own_casts) == (4, 7)
    assert_bits_equal(shared[0], own[0])
    for a, b in zip(shared[1] + shared[2], own[1] + own[2]):
        assert_bits_equal(a, b)
    assert not linear._input_scopes  # every scope closed


def test_allreduce_counts_are_per_logging_interval_and_checkpointed():
    """`precision/fp8_allreduce_underflow`/`_overflow` were the process's totals, never reset nor saved: a run
    resumed from step 2 logged 457 and 0 at step 4 where the uninterrupted one logged 762 and 32. Each log counts
    the all-reduces since the one before; a checkpoint carries the counts not yet logged."""
    keys = ("precision/fp8_allreduce_underflow", "precision/fp8_allreduce_overflow")

    def logged(strategy):
        metrics = strategy.metrics()
        return tuple(metrics.get(key) for key in keys)

    strategy, _, _ = setup("fp8-lm-o2")
    assert logged(strategy) == (None, None)  # no FP8 all-reduce (no DDP): not logged
    # What the DDP hook adds for a bucket of 100 elements, 7 flushed to zero and 2 clipped.
    strategy.comm_state.stats += AllReduceStats(torch.tensor(7), torch.tensor(2), 100)
    assert logged(strategy) == (7.0, 2.0)
    strategy.comm_state.stats += AllReduceStats(torch.tensor(3), torch.tensor(1), 100)
    resumed, _, _ = setup("fp8-lm-o2", seed=1)
    resumed.load_state_dict(strategy.state_dict())
    for run in (strategy, resumed):
        assert logged(run) == (3.0, 1.0)
        assert logged(run) == (0.0, 0.0)  # an interval without underflow or overflow
