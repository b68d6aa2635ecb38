"""FP8 linear layers (docs/algorithms.md §3) against an FP64 reference, and model conversion."""

import copy
import logging
import math

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification, GPT2LMHeadModel
from transformers.pytorch_utils import Conv1D

from hf_lowprec.fp8 import FP8Linear, convert_to_fp8, fp8_linear
from hf_lowprec.testing import snr_db
from tests.fp8_reference import fp64_linear_reference
from tests.helpers import bits, bits_equal, snr_floor_db, tiny_gpt2

# SNR floors from the formats' unit roundoff (`snr_floor_db`): each GEMM operand is rounded
# once (per-tensor scale: Gaussian data lands in the normal range), E[δ²] ≤ u²/3 per operand,
# plus the output's rounding (BF16 at worst, 2^-8). Forward E4M3·E4M3: 25.8 dB; gradients
# E5M2·E4M3: 21.9 dB. Gaussian significands (near log-uniform, E[δ²] ≈ 0.18·u²) give
# ≈ 28.5 and ≈ 24.5 dB, as measured. E5M2 forward operands (one bit coarser) give 24.5 dB
# (one) or 22.5 dB (both) and fail the forward floor.
SNR_FORWARD_DB = snr_floor_db(torch.float8_e4m3fn, torch.float8_e4m3fn, torch.bfloat16)
SNR_GRAD_DB = snr_floor_db(torch.float8_e5m2, torch.float8_e4m3fn, torch.bfloat16)


@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
@pytest.mark.parametrize("shape", [(256, 128, 192), (100, 64, 48)])
def test_forward_and_gradients_against_fp64(transposed, shape):
    ref = fp64_linear_reference(*shape, transposed)
    y, x_grad, w_grad = ref.run(lambda x, w: fp8_linear(x, w, weight_transposed=transposed))
    assert snr_db(ref.y, y) >= SNR_FORWARD_DB
    assert snr_db(ref.x_grad, x_grad) >= SNR_GRAD_DB
    assert snr_db(ref.w_grad, w_grad) >= SNR_GRAD_DB


def test_snr_floor_holds_for_one_rounding_and_fails_for_a_coarser_one():
    # The floor's premise, with torch's own casts: operands scaled by a power of two into the
    # top binade and rounded once to E4M3 clear the forward floor; one operand in E5M2
    # (u = 2^-3, one bit coarser) falls below it, so the floor separates the two.
    g = torch.Generator().manual_seed(0)
    x, w = (
        torch.randn(256, 128, generator=g, dtype=torch.float64),
        torch.randn(192, 128, generator=g, dtype=torch.float64),
    )

    def rounded(t, dtype):
        scale = 2.0 ** math.floor(math.log2(torch.finfo(dtype).max / t.abs().max().item()))
        return (t * scale).to(dtype).double() / scale

    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    assert snr_db(x @ w.t(), rounded(x, e4m3) @ rounded(w, e4m3).t()) >= SNR_FORWARD_DB
    assert snr_db(x @ w.t(), rounded(x, e4m3) @ rounded(w, e5m2).t()) < SNR_FORWARD_DB


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_output_and_gradient_dtypes_follow_the_input(dtype):
    layer = FP8Linear(32, 16).to(dtype)
    nn.init.normal_(layer.weight, std=0.1)
    x = torch.randn(4, 7, 32, dtype=dtype, requires_grad=True)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (4, 7, 16)
    y.float().sum().backward()
    assert x.grad.dtype == dtype and layer.weight.grad.dtype == dtype and layer.bias.grad.dtype == dtype
    # The bias gradient is an exact reduction, not an FP8 one.
    torch.testing.assert_close(layer.bias.grad.float(), torch.full((16,), 28.0))


def test_bad_input_raises_before_work():
    with pytest.raises(ValueError, match="features"):
        fp8_linear(torch.randn(2, 8), torch.randn(4, 16))
    with pytest.raises(ValueError, match="FP32, FP16 or BF16"):
        fp8_linear(torch.randn(2, 16, dtype=torch.float64), torch.randn(4, 16))
    with pytest.raises(ValueError, match="margin"):
        convert_to_fp8(nn.Sequential(nn.Linear(16, 16)), margin=-1)
    with pytest.raises(ValueError, match="module_filter"):
        convert_to_fp8(nn.Sequential(nn.Linear(16, 16)), module_filter="lm_head")


def test_from_float_shares_parameters_and_state_dict_keys():
    linear, conv = nn.Linear(32, 48), Conv1D(48, 32)
    for module in (linear, conv):
        fp8 = FP8Linear.from_float(module)
        assert fp8.weight is module.weight and fp8.bias is module.bias
        assert fp8.state_dict().keys() == module.state_dict().keys()
        x = torch.randn(3, 32)
        assert snr_db(module(x).detach(), fp8(x).detach()) >= SNR_FORWARD_DB


def test_scaled_fp16_master_weight_is_invisible_to_forward_and_checkpoints():
    layer = FP8Linear.from_float(nn.Linear(64, 32)).half()
    nn.init.normal_(layer.weight, std=1e-3)
    x = torch.randn(5, 64, dtype=torch.float16)
    plain = layer(x)
    real = layer.weight.detach().clone()

    layer.scale_master_weight()
    scale = layer.master_scale.item()
    assert scale > 1 and math.log2(scale) == int(math.log2(scale))
    assert layer.weight.abs().max() > 2**14, "the FP16 payload should use FP16's range"
    # Same real weights → same FP8 weights → bit-identical output.
    assert bits_equal(layer(x), plain)
    exported = layer.state_dict()["weight"]
    assert exported.dtype == torch.float32 and bits_equal(exported, real.float())

    fresh = FP8Linear.from_float(nn.Linear(64, 32)).half()
    fresh.scale_master_weight()
    fresh.load_state_dict(layer.state_dict())
    assert bits_equal(fresh.weight, layer.weight) and bits_equal(fresh.master_scale, layer.master_scale)
    # deepcopy drops tensor attributes on parameters; forward re-links the scale.
    clone = copy.deepcopy(layer)
    assert bits_equal(clone(x), plain)


def _gpt2(init_range: float = 0.1) -> GPT2LMHeadModel:
    # Evaluated: the helper's dropout 0 and GPT-2's 0.1 give the same model.
    return tiny_gpt2(n_positions=64, initializer_range=init_range).eval()


def _bert(init_range: float = 0.1) -> BertForMaskedLM:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
        initializer_range=init_range,
    )
    return BertForMaskedLM(config).eval()


@pytest.mark.parametrize("build", [_gpt2, _bert], ids=["gpt2", "bert"])
def test_converted_model_loss_at_init_matches_bf16(build, caplog):
    # initializer_range 0.1 (not 0.02) gives logits far from uniform, so the loss actually
    # depends on the GEMMs.
    model = build()
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(2))
    reference_keys = model.state_dict().keys()
    with torch.no_grad():
        fp32 = model(input_ids=ids, labels=ids)
        bf16 = copy.deepcopy(model).to(torch.bfloat16)(input_ids=ids, labels=ids)
        with caplog.at_level(logging.WARNING, logger="hf_lowprec.fp8.linear"):
            converted = convert_to_fp8(copy.deepcopy(model))
        fp8 = converted(input_ids=ids, labels=ids)

    per_block = 4 if isinstance(model, GPT2LMHeadModel) else 6
    assert sum(isinstance(m, FP8Linear) for m in converted.modules()) >= 2 * per_block
    assert converted.state_dict().keys() == reference_keys
    head = "lm_head" if isinstance(model, GPT2LMHeadModel) else "cls.predictions.decoder"
    assert f"skipped layer {head}" in caplog.text and "LM head" in caplog.text
    # Measured: |FP8 − BF16| ≤ 0.008 and |FP8 − FP32| ≤ 0.006. The BF16 loss is itself
    # rounded to BF16 (ulp 0.03 near 5.8), hence 0.05 against BF16 and 0.02 against FP32.
    assert abs(fp8.loss.item() - bf16.loss.item()) <= 0.05
    assert abs(fp8.loss.item() - fp32.loss.item()) <= 0.02
    # Logits: measured ≈ 23 dB for FP8 GEMMs through two blocks (BF16: ≈ 42 dB).
    assert snr_db(fp32.logits, fp8.logits) >= 20.0


def test_layers_fp8_cannot_handle_are_skipped_with_a_named_warning(caplog):
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=128,
        num_labels=3,
    )
    model = BertForSequenceClassification(config)
    model.bert.pooler.dense = nn.Linear(64, 3)  # a layer of the backbone FP8 cannot run
    with caplog.at_level(logging.WARNING, logger="hf_lowprec.fp8.linear"):
        convert_to_fp8(model)
    assert "skipped layer bert.pooler.dense: out_features=3 not a multiple of 16" in caplog.text
    assert type(model.bert.pooler.dense) is nn.Linear and isinstance(
        model.bert.encoder.layer[0].output.dense, FP8Linear
    )

    class Special(nn.Linear):
        pass

    with caplog.at_level(logging.WARNING, logger="hf_lowprec.fp8.linear"):
        convert_to_fp8(nn.Sequential(Special(16, 16)))
    assert "skipped layer 0: it is a subclass of nn.Linear (Special)" in caplog.text


@pytest.mark.parametrize("num_labels", [16, 64])
def test_a_task_models_head_stays_high_precision(num_labels, caplog):
    # Only the LM head (get_output_embeddings) was kept: a classifier's head, as wide as FP8
    # takes, became an FP8 layer.
    config = BertConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128
    )
    config.num_labels = num_labels
    model = BertForSequenceClassification(config)
    with caplog.at_level(logging.WARNING, logger="hf_lowprec.fp8.linear"):
        convert_to_fp8(model)
    assert "skipped layer classifier: it is the task model's output head" in caplog.text
    assert type(model.classifier) is nn.Linear and isinstance(model.bert.pooler.dense, FP8Linear)


class WithEmptyLayers(nn.Module):
    """A trainable layer beside two with a zero dimension (e.g. a head pruned to no classes)."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(64, 64)
        self.no_outputs = nn.Linear(64, 0)
        self.no_inputs = nn.Linear(0, 16)

    def forward(self, x):
        empty = x[:, :0]
        return self.dense(x).pow(2).mean() + self.no_outputs(x).sum() + self.no_inputs(empty).pow(2).mean()


@pytest.mark.parametrize("strategy", ["fp8-lm-o1", "fp8-lm-o2", "coat"])
def test_zero_size_layers_stay_high_precision_and_train(strategy, caplog):
    import hf_lowprec

    torch.manual_seed(0)
    precision = hf_lowprec.get_strategy(strategy)
    with caplog.at_level(logging.WARNING, logger="hf_lowprec.fp8.linear"):
        model = precision.prepare_model(WithEmptyLayers())
    assert "skipped layer no_outputs: it has no elements (in_features=64, out_features=0)" in caplog.text
    assert "skipped layer no_inputs: it has no elements (in_features=0, out_features=16)" in caplog.text
    assert isinstance(model.dense, FP8Linear) and type(model.no_outputs) is nn.Linear
    optimizer = precision.create_optimizer(model.parameters(), lr=1e-3)
    x = torch.randn(8, 64)
    for _ in range(2):
        loss = precision.train_step(model, x, optimizer, loss_fn=lambda m, batch: m(batch))
        assert math.isfinite(loss.item())
    assert precision.skipped_steps == 0


def test_module_filter_replaces_the_default_filter():
    model = _gpt2()
    convert_to_fp8(model, module_filter=lambda module, fqn: fqn.endswith("mlp.c_fc") or fqn == "lm_head")
    converted = sorted(n for n, m in model.named_modules() if isinstance(m, FP8Linear))
    assert converted == ["lm_head", "transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_fc"]
    assert model.lm_head.weight is model.transformer.wte.weight, "tying must survive the swap"


def _saved_during(fn):
    """(result, the tensors autograd saved while `fn` ran)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return out, saved


@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
def test_bf16_autocast_only_rounds_the_output(transposed):
    """Under BF16 autocast an FP8 layer computes what it computes without (same FP8 operands,
    same GEMM, same saved tensors: FP8 payloads and their scales, nothing in high precision);
    only the output is rounded to BF16, as autocast rounds `nn.Linear`'s. The GEMM result is
    BF16 already and the bias is added in FP32, so the autocast output is exactly the FP32
    output rounded to BF16, and backward given the same output gradient gives the same
    input and weight gradients bit for bit."""
    layer = FP8Linear(64, 48, weight_transposed=transposed)
    nn.init.normal_(layer.weight, std=0.1)
    nn.init.normal_(layer.bias, std=0.5)
    x = torch.randn(5, 7, 64, generator=torch.Generator().manual_seed(3))
    grad = torch.randn(5, 7, 48, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    runs = []
    for autocast in (False, True):
        xi = x.clone().requires_grad_()
        layer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y, saved = _saved_during(lambda xi=xi: layer(xi))
        y.backward(grad.to(y.dtype))
        runs.append((y, saved, xi.grad, layer.weight.grad, layer.bias.grad))
    (y32, saved32, gx32, gw32, gb32), (y16, saved16, gx16, gw16, gb16) = runs
    assert y32.dtype == torch.float32 and y16.dtype == torch.bfloat16
    assert bits_equal(bits(y16), bits(y32.to(torch.bfloat16)))
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    assert all(t.dtype in fp8 or t.dim() == 0 for t in saved16), [(t.dtype, t.shape) for t in saved16]
    assert len(saved16) == len(saved32) == 6  # x and W payloads, their scales and the scales' reciprocals
    assert all(bits_equal(bits(a), bits(b)) for a, b in zip(saved32, saved16))
    assert bits_equal(gx32, gx16) and bits_equal(gw32, gw16)
    # The bias gradient sums the same 35 values per column in FP32 from FP32 or BF16 storage;
    # only the summation order may differ: |error| ≤ 34·2^-24·Σ|g|.
    bound = 34 * 2.0**-24 * grad.float().abs().sum(dim=(0, 1))
    assert ((gb32 - gb16).abs() <= bound).all()


def _fp8_stored_pair(transposed: bool):
    """An FP8Linear with a scaled FP16 master and a copy holding that master's FP8 weight (1 byte)."""
    from hf_lowprec.fp8.linear import E4M3

    torch.manual_seed(3)
    master = FP8Linear(64, 32, weight_transposed=transposed)
    nn.init.normal_(master.weight, std=0.05)
    master.weight.data = master.weight.data.half()
    master.scale_master_weight()
    stored = copy.deepcopy(master)
    w8, sw = master._fp8_weight()
    stored.weight.data = w8.clone()
    stored.master_scale.copy_(sw)
    assert stored.weight.dtype == E4M3 and stored.weight.element_size() == 1
    return master, stored


@pytest.mark.parametrize("transposed", [False, True])
def test_fp8_stored_weight_computes_as_its_master_and_sends_its_gradient_to_the_sink(transposed):
    from hf_lowprec.fp8.linear import set_grad_sink

    master, stored = _fp8_stored_pair(transposed)
    received = []
    set_grad_sink(stored.weight, received.append)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    y_master, y_stored = master(x), stored(x)
    assert bits_equal(y_master, y_stored)  # the same FP8 weight, used as is
    y_master.square().sum().backward()
    y_stored.square().sum().backward()
    assert stored.weight.grad is None and len(received) == 1  # no 1-byte gradient: the sink has it
    assert bits_equal(received[0].to(master.weight.grad.dtype), master.weight.grad)
    assert bits_equal(stored.bias.grad, master.bias.grad)


def test_fp8_stored_weight_without_a_sink_gets_no_gradient():
    _, stored = _fp8_stored_pair(False)
    stored(torch.randn(4, 64)).sum().backward()
    assert stored.weight.grad is None and stored.bias.grad is not None


def test_fp8_stored_weight_state_dict_round_trip():
    # The state dict holds real values (FP32); loading them into an FP8-stored weight quantizes
    # them as the forward would, which for FP8 values is exact.
    master, stored = _fp8_stored_pair(False)
    state = stored.state_dict()
    assert state["weight"].dtype == torch.float32
    _, fresh = _fp8_stored_pair(False)
    with torch.no_grad():
        fresh.weight.zero_()
    fresh.load_state_dict(state)
    assert bits_equal(fresh.state_dict()["weight"], state["weight"])
    # A master's real values load into an FP8-stored weight as the master's FP8 weight.
    _, other = _fp8_stored_pair(False)
    other.load_state_dict(master.state_dict())
    w8, sw = master._fp8_weight()
    assert bits_equal(other.weight.view(torch.uint8), w8.view(torch.uint8)) and bits_equal(other.master_scale, sw)


def test_moving_the_layer_keeps_the_master_scale_linked():
    from hf_lowprec.fp8.scaled import get_master_scale

    layer, _ = _fp8_stored_pair(False)
    layer.to("meta")  # a device move replaces the buffer (as .cuda() does)
    assert layer.master_scale.device.type == "meta" and get_master_scale(layer.weight) is layer.master_scale


@pytest.mark.parametrize("cast", [nn.Module.half, lambda m: m.to(torch.float16), nn.Module.bfloat16])
def test_a_16_bit_cast_of_the_model_keeps_the_master_scale_in_fp32(cast):
    # .half() cast the FP32 buffer too: a weight below ~1 has a scale past 65504, which became inf;
    # the forward divided by it and save_pretrained wrote zeros for every FP8 layer.
    master, _ = _fp8_stored_pair(False)
    assert master.master_scale > 65504
    real = master.state_dict()["weight"]
    x = torch.randn(4, 64, dtype=torch.float16)
    before = master(x)
    cast(master)
    from hf_lowprec.fp8.scaled import get_master_scale

    assert master.master_scale.dtype == torch.float32 and torch.isfinite(master.master_scale)
    assert get_master_scale(master.weight) is master.master_scale
    # An FP16 master stays as it was; BF16 rounds the scaled payload once (a power-of-two scale).
    expected = real if master.weight.dtype == torch.float16 else real.bfloat16().float()
    assert bits_equal(master.state_dict()["weight"], expected)
    if master.weight.dtype == torch.float16:
        assert bits_equal(master(x), before)


def test_an_fp8_layers_output_can_be_written_in_place():
    # The autograd function returned a view of its own output: autograd forbade `add_` on it
    # (Llama4's MoE block does `shared_expert(h).add_(routed)`), so no FP8 strategy trained Llama4.
    torch.manual_seed(0)
    layer = FP8Linear.from_float(nn.Linear(64, 32))
    x = torch.randn(2, 3, 64, requires_grad=True)
    other = torch.randn(2, 3, 32)
    y = layer(x)
    y.add_(other)
    y.square().sum().backward()
    grads = [t.grad.clone() for t in (x, layer.weight)]
    x.grad = layer.weight.grad = None
    (layer(x) + other).square().sum().backward()
    assert all(bits_equal(a, b.grad) for a, b in zip(grads, (x, layer.weight), strict=True))


def test_compiled_fp8_training_is_the_eager_training_bit_for_bit(name="fp8-lm-o2"):
    """Under torch.compile the FP8 weight is quantized in the graph at every forward and FP8
    payloads widen by the compiler's conversion (no weight cache, no lookup tables: issue #47);
    with the same aten operations ("aot_eager") three training steps give the eager run's losses
    and weights bit for bit: the compiled path changes when the work is done, not its values.
    fp8-lm-o2: scaled FP16 masters, the layer's most involved weight path."""
    import hf_lowprec
    from hf_lowprec.fp8.linear import set_grad_sink
    from tests.helpers import batches

    data = batches(3)
    runs = {}
    for mode in ("eager", "compiled"):
        strategy = hf_lowprec.get_strategy(name)
        model = strategy.prepare_model(tiny_gpt2())
        optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3, weight_decay=0.01)
        torch._dynamo.reset()
        if mode == "eager":
            # Compiled, the layers leave O2's gradient sinks out (eager only: `get_grad_sink`) and the
            # weight gradient comes through FP16 `p.grad` and the post-accumulate hook: the eager
            # run takes that path too, so the two runs do the same arithmetic.
            for p in model.parameters():
                set_grad_sink(p, None)
        run = model if mode == "eager" else torch.compile(model, backend="aot_eager")
        losses = [strategy.train_step(run, ids, optimizer).detach() for ids in data]
        runs[mode] = (losses, [p.detach().clone() for p in model.parameters()])
    torch._dynamo.reset()
    for got, want in zip(runs["compiled"][0] + runs["compiled"][1], runs["eager"][0] + runs["eager"][1]):
        assert bits_equal(got, want), (name, got.flatten()[:4], want.flatten()[:4])


def test_a_sharing_scope_opens_once_per_module_and_closes_when_its_forward_raises():
    from hf_lowprec.fp8 import linear

    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = FP8Linear(16, 16), FP8Linear(16, 16)

        def forward(self, x):
            self.a(x)
            raise RuntimeError("boom")

    pair = nn.Sequential(Pair(), FP8Linear(16, 16))  # one module with two FP8 layers among its children
    assert linear.share_inputs_within(pair) == 1
    assert linear.share_inputs_within(pair) == 0  # already scoped
    with pytest.raises(RuntimeError, match="boom"):
        pair(torch.randn(2, 16))
    assert not linear._input_scopes


def test_a_sharing_scope_leaves_inference_tensors_to_each_layer():
    """Tensors made under `torch.inference_mode` keep no version counter, so the scope cannot
    tell them apart: each layer quantizes its own (the forward runs, and gives the same output)."""
    from hf_lowprec.fp8 import linear

    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            # Initialised weights: `FP8Linear(...)` alone holds uninitialised memory (NaN at times).
            self.a, self.b = FP8Linear.from_float(nn.Linear(16, 16)), FP8Linear.from_float(nn.Linear(16, 16))

        def forward(self, x):
            return self.a(x) + self.b(x)

    pair = Pair()
    x = torch.randn(2, 16)
    expected = pair(x)
    linear.share_inputs_within(pair)
    with torch.inference_mode():
        out = pair(x.clone())
    assert torch.equal(out, expected)
    assert not linear._input_scopes


@pytest.mark.parametrize("master", [False, True])
def test_an_evaluation_under_inference_mode_leaves_training_to_run(master):
    """A forward under `torch.inference_mode` (an evaluation before training) quantizes the weight
    without caching it: an inference tensor in the cache could not be saved for the next training
    forward's backward (it raised). The training step then gives the gradient it gives without
    that evaluation."""
    torch.manual_seed(0)
    dense = nn.Linear(32, 16).half() if master else nn.Linear(32, 16)
    grads = []
    for evaluate in (True, False):
        layer = FP8Linear.from_float(copy.deepcopy(dense))
        if master:
            layer.scale_master_weight()
        x = torch.randn(4, 32, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
        if evaluate:
            with torch.inference_mode():
                evaluated = layer(x)
            assert layer._weight_cache is None
        out = layer(x)
        if evaluate:
            assert torch.equal(out, evaluated)
        out.float().sum().backward()
        grads.append(layer.weight.grad)
    assert torch.equal(*grads)


@pytest.mark.parametrize("master", [False, True])
def test_an_eval_mode_forward_casts_the_weight_as_it_is_now(master):
    """In eval mode the weight is cast at every forward and nothing is cached: a write through
    `.data` (an EMA swap, a weight load) bumps no version the training cache's key sees, and before
    this an evaluation after training computed with the cached old weight (logits moved by 0.0).
    In training mode the cache stands within the step, and `forget_weight_cast` drops it."""
    torch.manual_seed(0)
    dense = nn.Linear(32, 16).half() if master else nn.Linear(32, 16)
    layer = FP8Linear.from_float(dense)
    if master:
        layer.scale_master_weight()
    x = torch.randn(4, 32, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    layer(x).float().sum().backward()  # training mode: the cast is cached for the step
    cached = layer._weight_cache
    layer.eval()
    with torch.no_grad():
        before = layer(x)
        layer.weight.data.mul_(0.5).add_(layer.weight.data.flip(0), alpha=0.25)  # a new weight
        after = layer(x)
        assert layer._weight_cache is cached  # eval mode stores nothing
        layer.forget_weight_cast()
        fresh = layer(x)  # the reference: a layer with no cache at all
    assert torch.equal(after, fresh) and not torch.equal(after, before)
    # Eval mode with autograd on (a loop training a model `from_pretrained` left in eval mode)
    # caches as training does.
    layer(x).float().sum().backward()
    assert layer._weight_cache is not cached and layer._weight_cache is not None
    layer.train()
    layer._weight_cache = cached
    with torch.no_grad():
        assert torch.equal(layer(x), before)  # training mode: the step's cast, until forgotten
        layer.forget_weight_cast()
        assert torch.equal(layer(x), fresh)
