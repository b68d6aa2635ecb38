"""`convert_to_fp8` on models with `torch.nn.utils.parametrize`d layers (weight_norm, spectral_norm,
orthogonal; Wav2Vec2's positional conv): the parametrized layers keep high precision, the rest is
converted, and the model trains under every FP8 strategy."""

import copy
import math

import pytest
import torch
import transformers
from torch import nn

import hf_lowprec
from hf_lowprec.fp8 import FP8Linear
from hf_lowprec.testing import snr_db
from tests.helpers import snr_floor_db

FP8_STRATEGIES = ["fp8-lm-o1", "fp8-lm-o2", "fp8-lm-o3", "coat"]
# The output of one FP8 GEMM (E4M3 operands, BF16 output) and of the two BF16-autocast layers after
# it (BF16 operands and output each): the layers are linear, so each one's relative noise power is
# carried through the next ones unchanged and the powers add (`snr_floor_db`).
E4M3, BF16 = torch.float8_e4m3fn, torch.bfloat16
SNR_THREE_LAYERS_DB = snr_floor_db(E4M3, E4M3, BF16, *[BF16] * 6)


class WeightNormed(nn.Module):
    """A plain Linear, then a weight_norm'd Linear and a weight_norm'd Conv1d (as Wav2Vec2's
    positional conv): `parametrizations.weight` of each is a ParametrizationList, a module."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.plain = nn.Linear(width, width)
        self.normed = nn.utils.parametrizations.weight_norm(nn.Linear(width, width))
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(width, width, 3, padding=1), dim=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.normed(self.plain(x)).transpose(1, 2)).transpose(1, 2)


@pytest.mark.parametrize("name", FP8_STRATEGIES)
def test_weight_normed_layers_keep_high_precision_and_the_model_trains(name):
    """Every FP8 strategy raised `'ParametrizationList' object has no attribute 'dim'` in
    `default_skips` while preparing such a model."""
    torch.manual_seed(0)
    model = WeightNormed()
    x, target = torch.randn(4, 8, 32), torch.randn(4, 8, 32)
    with torch.no_grad():
        reference = copy.deepcopy(model).double()(x.double())
    strategy = hf_lowprec.get_strategy(name)
    prepared = strategy.prepare_model(copy.deepcopy(model))
    assert isinstance(prepared.plain, FP8Linear)
    assert nn.utils.parametrize.is_parametrized(prepared.normed) and isinstance(prepared.normed, nn.Linear)
    assert "subclass of nn.Linear (ParametrizedLinear)" in prepared.fp8_skipped_layers["normed"]
    assert nn.utils.parametrize.is_parametrized(prepared.conv)
    with torch.no_grad(), strategy.forward_context():
        assert snr_db(reference, prepared(x)) >= SNR_THREE_LAYERS_DB

    optimizer = strategy.create_optimizer(prepared.parameters(), lr=1e-2)
    before = {key: p.detach().float().clone() for key, p in prepared.named_parameters()}
    losses = []
    for _ in range(4):
        loss = strategy.train_step(prepared, x, optimizer, loss_fn=lambda m, b: (m(b).float() - target).pow(2).mean())
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    moved = {key for key, p in prepared.named_parameters() if not torch.equal(p.detach().float(), before[key])}
    for key in ("normed.parametrizations.weight.original0", "normed.parametrizations.weight.original1"):
        assert key in moved  # the weight_norm'd layer's g and v train
    assert "conv.parametrizations.weight.original1" in moved and "plain.weight" in moved


def test_a_tiny_wav2vec2_is_converted_under_fp8_lm_o2():
    """Wav2Vec2's positional conv embedding is weight_norm'd: preparing raised in `default_skips`.
    Now its encoder's Linear layers are FP8, the conv keeps its parametrization and the logits stay
    within the FP8 floor of the FP64 model's."""
    config = transformers.Wav2Vec2Config(
        vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16, 16), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForCTC(config).eval()
    audio = torch.randn(2, 800, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = copy.deepcopy(model).double()(input_values=audio.double()).logits
    strategy = hf_lowprec.get_strategy("fp8-lm-o2")
    prepared = strategy.prepare_model(model)
    fp8 = [n for n, m in prepared.named_modules() if isinstance(m, FP8Linear)]
    assert len(fp8) == 13  # the feature projection, and 4 attention + 2 feed-forward GEMMs per layer
    assert nn.utils.parametrize.is_parametrized(prepared.wav2vec2.encoder.pos_conv_embed.conv)
    with torch.no_grad(), strategy.forward_context():
        logits = prepared(input_values=audio).logits
    # The logits come out of at most 9 FP8 GEMMs in series (the feature projection, then q/k/v →
    # out_proj → intermediate → output in each of 2 layers), whose relative noise powers add; the
    # BF16 layers' (2⁻¹⁶ each) are two orders of magnitude below one FP8 GEMM's (2⁻⁸).
    assert snr_db(reference, logits) >= snr_floor_db(E4M3, E4M3, BF16) - 10 * math.log10(9)


@pytest.mark.parametrize("name", ["fp8-lm-o2", "coat"])
def test_preparing_a_spectral_normed_layer_leaves_its_power_iteration_alone(name):
    """spectral_norm computes `weight` at each read in training mode, one power-iteration step that
    writes its `_u` buffer: the conversion reads no parametrized weight, so `_u` is as it was."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.utils.parametrizations.spectral_norm(nn.Linear(64, 64)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hf_lowprec.get_strategy(name).prepare_model(model)
    after = model.state_dict()
    u = [k for k in before if k.endswith("_u")]
    assert u, sorted(before)
    for k in u:
        assert torch.equal(after[k], before[k]), k
