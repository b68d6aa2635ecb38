"""Float model inputs under strategies that train 16-bit weights without autocast: cast to the weights' dtype, labels kept."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

from hf_lowprec import PrecisionPlugin, Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, get_strategy
from tests.helpers import assert_bits_equal, make_args, rounding_bound, trainer_arguments

SIXTEEN_BIT_WEIGHTS = ["fp16-als", "collage-plus", "bf16-pure"]


# Three strided convolutions (800 samples → 39 frames) feeding two 32-wide transformer layers.
WAV2VEC2 = dict(vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
CONVOLUTIONS = dict(conv_dim=(16, 16, 16), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16)


def tiny_wav2vec2() -> Wav2Vec2ForCTC:
    torch.manual_seed(0)
    config = Wav2Vec2Config(
        **WAV2VEC2, **CONVOLUTIONS, num_conv_pos_embedding_groups=2, pad_token_id=0, mask_time_prob=0.0
    )
    return Wav2Vec2ForCTC(config)


def audio(n: int = 8) -> list[dict[str, torch.Tensor]]:
    """FP32 `input_values`, as every feature extractor returns them, and CTC labels."""
    g = torch.Generator().manual_seed(0)
    return [
        {"input_values": torch.randn(800, generator=g), "labels": torch.randint(3, 12, (4,), generator=g)}
        for _ in range(n)
    ]


@pytest.mark.parametrize("strategy", SIXTEEN_BIT_WEIGHTS)
def test_wav2vec2_trains_and_evaluates_on_fp32_input_values(tmp_path, strategy):
    # Its first Conv1d met FP32 input_values with 16-bit weights: "Input type (torch.FloatTensor)
    # and weight type (torch.HalfTensor) should be the same".
    args = make_args(tmp_path, strategy, max_steps=2, per_device_train_batch_size=4, save_strategy="no")
    trainer = Trainer(model=tiny_wav2vec2(), args=args, train_dataset=audio(), eval_dataset=audio(4))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))), losses
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert torch.isfinite(torch.tensor(trainer.evaluate()["eval_loss"]))


# Whisper: 8 mel bins × 32 frames, one 16-wide layer each side; decoding starts at token 1, stops at 2.
WHISPER = dict(vocab_size=64, num_mel_bins=8, d_model=16, max_source_positions=16, max_target_positions=32)
WHISPER.update(encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2)
WHISPER.update(encoder_ffn_dim=32, decoder_ffn_dim=32, decoder_start_token_id=1, pad_token_id=0, eos_token_id=2)
WHISPER.update(bos_token_id=1, begin_suppress_tokens=None, suppress_tokens=None)
GENERATED = 6  # generation_max_length, the decoder start token included


def tiny_whisper() -> transformers.WhisperForConditionalGeneration:
    torch.manual_seed(0)
    return transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**WHISPER))


def wav2vec2_to_gpt2() -> transformers.SpeechEncoderDecoderModel:
    """A SpeechEncoderDecoderModel: the Wav2Vec2 encoder above (one layer) and a one-layer GPT-2."""
    torch.manual_seed(0)
    encoder = {**WAV2VEC2, "num_hidden_layers": 1, **CONVOLUTIONS, "num_conv_pos_embedding_groups": 2}
    encoder = Wav2Vec2Config(**encoder, mask_time_prob=0.0)
    decoder = dict(vocab_size=64, n_embd=16, n_layer=1, n_head=2, bos_token_id=1, eos_token_id=2)
    decoder = transformers.GPT2Config(**decoder, add_cross_attention=True)
    config = transformers.SpeechEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.update(dict(decoder_start_token_id=1, pad_token_id=0, eos_token_id=2))
    return transformers.SpeechEncoderDecoderModel(config)


def transcribed(key: str, n: int = 4) -> list[dict[str, torch.Tensor]]:
    """FP32 audio features under `key`, as the feature extractor returns them, and 6 label tokens."""
    g = torch.Generator().manual_seed(0)
    shape = (8, 32) if key == "input_features" else (800,)
    return [{key: torch.randn(shape, generator=g), "labels": torch.randint(3, 64, (6,), generator=g)} for _ in range(n)]


@pytest.mark.parametrize(
    ("model", "key", "strategy"),
    [
        (tiny_whisper, "input_features", "bf16-pure"),
        (tiny_whisper, "input_features", "fp16-als"),
        (wav2vec2_to_gpt2, "input_values", "collage-plus"),
    ],
)
def test_an_encoder_decoder_generates_from_fp32_audio_after_training(tmp_path, model, key, strategy):
    """`generate()` runs an encoder-decoder's encoder itself (`get_encoder()`), not through the
    model's forward and its cast: FP32 features met the 16-bit Conv1d ("Input type (float) and bias
    type (c10::BFloat16) should be the same"), after training and in `predict(predict_with_generate)`.
    The encoder casts them now. The reference is the features cast by hand: the cast is the only
    operation between the two, so the encoder's output, every step's scores and the tokens are the
    same bits (tolerance 0)."""
    arguments = trainer_arguments(tmp_path, precision_strategy=strategy, max_steps=1, save_strategy="no")
    args = Seq2SeqTrainingArguments(**arguments, predict_with_generate=True, generation_max_length=GENERATED)
    trainer = Seq2SeqTrainer(model=model(), args=args, train_dataset=transcribed(key))
    trainer.train()
    model, dtype = trainer.model.eval(), get_strategy(strategy).param_dtype  # no dropout
    features = torch.stack([x[key] for x in transcribed(key)])
    assert next(model.parameters()).dtype == dtype and features.dtype == torch.float32
    with torch.no_grad():
        expected = model.get_encoder()(features.to(dtype)).last_hidden_state
        assert_bits_equal(model.get_encoder()(features).last_hidden_state, expected, "encoder output")
        scored = dict(max_length=GENERATED, output_scores=True, return_dict_in_generate=True)
        by_hand = model.generate(**{key: features.to(dtype)}, **scored).scores
        assert_bits_equal(
            torch.stack(model.generate(**{key: features}, **scored).scores), torch.stack(by_hand), "scores"
        )
        by_hand = model.generate(**{key: features.to(dtype)}, max_length=GENERATED)
        assert_bits_equal(model.generate(**{key: features}, max_length=GENERATED), by_hand, "generated tokens")
    predicted = torch.from_numpy(trainer.predict(transcribed(key)).predictions)
    width = predicted.shape[1]  # padded with pad_token_id 0, as the stock prediction step pads
    assert_bits_equal(predicted, F.pad(by_hand, (0, width - by_hand.shape[1])), "predictions")


def test_the_encoders_cast_adds_no_graph_break_to_a_compiled_forward():
    """The encoder's cast (for `generate()`, above) is Python dynamo does not trace: run inside a
    compiled forward, whose own hook has cast the inputs already, it broke the graph twice. While
    compiling it stands aside: no more breaks than the model with no hook, fed BF16 features."""
    from hf_lowprec.integrations.outputs import narrow_inputs
    from hf_lowprec.testing import count_graph_breaks

    s = get_strategy("bf16-pure")
    features = torch.stack([x["input_features"] for x in transcribed("input_features", 2)])
    decoder_input_ids = torch.tensor([[1, 5, 6], [1, 7, 8]])

    def breaks(narrowed: bool) -> tuple[int, object]:
        model = s.prepare_model(tiny_whisper()).eval()
        model = narrow_inputs(s, model) if narrowed else model
        compiled = torch.compile(model, backend="eager")
        inputs = features if narrowed else features.to(s.param_dtype)
        with torch.no_grad():
            return count_graph_breaks(lambda: compiled(input_features=inputs, decoder_input_ids=decoder_input_ids))

    (hooked, reasons), (baseline, _) = breaks(True), breaks(False)
    assert hooked <= baseline, (hooked, baseline, reasons)


class Regressor(torch.nn.Module):
    """A regression head over float features whose loss compares its prediction with float labels."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(16, 1)
        self.seen: list[tuple[torch.dtype, torch.dtype]] = []

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        self.seen.append((features.dtype, labels.dtype))
        pred = self.proj(features).squeeze(-1)
        return {"loss": F.mse_loss(pred, labels), "logits": pred}


def regression_batch(n: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    # Labels in (0, 1) that BF16 and FP16 do not hold: a label rounded to them moves the loss.
    return {"features": torch.randn(n, 16, generator=g), "labels": torch.rand(n, generator=g) / 3}


def fp64_loss(model: Regressor, batch: dict[str, torch.Tensor]) -> float:
    """The MSE in FP64 of the model's own prediction (from its dtype's features) against the FP32 labels."""
    with torch.no_grad():
        weight = next(model.parameters())
        pred = model.proj(batch["features"].to(weight.dtype)).squeeze(-1)
    return F.mse_loss(pred.double(), batch["labels"].double()).item()


# The loss is an FP32 mean of n squared differences of a 16-bit prediction (exact in FP32) and an FP32
# label: one rounding for the difference, one for its square, n for the sum and one for the mean,
# none cancelling (γ of n + 3 roundings, relative). A label rounded to BF16 (2⁻⁹) or FP16 (2⁻¹¹)
# moves the loss by about 2·u·|y|/|pred − y| relative: orders of magnitude above this.
def loss_tolerance(n: int, loss: float) -> float:
    return rounding_bound(torch.float32, n + 3, loss)


@pytest.mark.parametrize("strategy", SIXTEEN_BIT_WEIGHTS)
def test_a_regression_head_gets_its_fp32_labels_and_the_right_loss_in_the_trainer(tmp_path, strategy):
    batch = regression_batch()
    data = [{k: v[i] for k, v in batch.items()} for i in range(8)]
    args = make_args(tmp_path, strategy, max_steps=1, per_device_train_batch_size=8, save_strategy="no")
    trainer = Trainer(model=Regressor(), args=args, train_dataset=data)
    model = trainer.model
    inputs = trainer._prepare_inputs(dict(batch))
    assert inputs["features"].dtype == torch.float32  # the batch as it came; the model's forward narrows it
    with trainer.compute_loss_context_manager():
        loss = trainer.compute_loss(model, inputs).item()
    weight_dtype = get_strategy(strategy).param_dtype
    assert model.seen[-1] == (weight_dtype, torch.float32)
    expected = fp64_loss(model, batch)
    assert abs(loss - expected) <= loss_tolerance(8, expected), (loss, expected)


@pytest.mark.parametrize("strategy", SIXTEEN_BIT_WEIGHTS)
def test_train_step_casts_float_inputs_and_keeps_the_labels(strategy):
    s = get_strategy(strategy)
    model = s.prepare_model(Regressor())
    optimizer = s.create_optimizer(model.parameters(), lr=1e-3)
    batch = regression_batch()
    expected = fp64_loss(model, batch)
    loss = s.train_step(model, dict(batch), optimizer, loss_fn=lambda m, b: m(**b)["loss"]).item()
    assert model.seen[-1] == (s.param_dtype, torch.float32)
    assert abs(loss - expected) <= loss_tolerance(8, expected), (loss, expected)


@pytest.mark.parametrize("strategy", SIXTEEN_BIT_WEIGHTS)
def test_the_accelerate_plugin_casts_float_inputs_and_keeps_the_labels(strategy):
    plugin = PrecisionPlugin(strategy)
    model = plugin.prepare_model(Regressor())
    batch = regression_batch()
    expected = fp64_loss(model, batch)
    loss = model(batch["features"], labels=batch["labels"])["loss"].item()  # positional and keyword
    assert model.seen[-1] == (plugin.strategy.param_dtype, torch.float32)
    assert abs(loss - expected) <= loss_tolerance(8, expected), (loss, expected)


@pytest.mark.parametrize("strategy", ["fp16-als", "bf16-pure"])
def test_an_additive_fp32_mask_keeps_its_minimum_finite_in_the_weights_dtype(strategy):
    """An additive 4-D mask built with FP32's minimum would round to -inf in 16 bits (a fully masked
    row's softmax then NaN); it becomes the 16-bit minimum, the other inputs plainly cast."""
    from hf_lowprec.strategies.inputs import cast_float_inputs

    s = get_strategy(strategy)
    low = torch.finfo(torch.float32).min
    mask = torch.tensor([[[[0.0, low], [low, low]]]])
    values = torch.tensor([1.0, 7e4, -7e4])
    out = cast_float_inputs(s, {"attention_mask": mask, "input_values": values})
    assert out["attention_mask"].dtype == s.param_dtype
    assert torch.isfinite(out["attention_mask"]).all()
    assert out["attention_mask"].float().min() == torch.finfo(s.param_dtype).min
    assert torch.equal(out["input_values"], values.to(s.param_dtype))  # not clamped: the data as it is
    assert torch.softmax(out["attention_mask"].float(), -1).isfinite().all()


@pytest.mark.parametrize(
    ("strategy", "options"), [("coat", {"master_weights": "bf16-collage"}), ("bf16-mixed", {}), ("fp16-als", {})]
)
def test_asking_whether_a_strategy_casts_inputs_leaves_no_autocast_on(strategy, options):
    """COAT with BF16 masters has BF16 weights and an autocast, which its `forward_context()` enters
    as it is made: asking (every `train_step`) left a BF16 autocast on for the rest of the process,
    and later FP16 runs failed in backward (`Unexpected floating ScalarType in at::autocast::prioritize`)."""
    from hf_lowprec.strategies.inputs import computes_without_autocast

    assert not torch.is_autocast_enabled("cpu")
    computes_without_autocast(get_strategy(strategy, **options))
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("name", ["bf16-mixed", "fp16-mixed", "fp8-lm-o2", "coat", "collage-plus"])
def test_a_forward_context_made_and_not_entered_turns_no_autocast_on(name):
    """A strategy's `forward_context()` entered its autocast as it was made, so a caller that made
    one and did not enter it (or entered another first) left autocast on for the process. It is
    entered on `with` only, turns autocast off again on exit, and can be entered again (nested too)."""
    s = get_strategy(name)
    context = s.forward_context()
    assert not torch.is_autocast_enabled("cpu")
    with context:
        on = torch.is_autocast_enabled("cpu")
        with context:
            assert torch.is_autocast_enabled("cpu") == on
        assert torch.is_autocast_enabled("cpu") == on
    assert not torch.is_autocast_enabled("cpu")
    with context:
        assert torch.is_autocast_enabled("cpu") == on
    assert not torch.is_autocast_enabled("cpu")
    assert on == (name != "collage-plus")  # collage-plus computes on its BF16 weights, no autocast
