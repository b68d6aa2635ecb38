"""Float model inputs under strategies that train 16-bit weights without autocast: cast to the weights' dtype, labels kept."""

import pytest
import torch
import torch.nn.functional as F
from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

from hf_lowprec import PrecisionPlugin, Trainer, get_strategy
from tests.helpers import make_args, rounding_bound

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
