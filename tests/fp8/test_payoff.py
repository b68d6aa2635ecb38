"""FP8 where it pays (issue #67, item 3; docs/strategies/fp8-lm.md "Where FP8 pays"): the rule's roofline,
checked against the device times derived by hand; the layers and experts modules FP8-LM keeps in
BF16 on a named GPU, reported with both times; no rule where FP8 is emulated."""

from __future__ import annotations

import dataclasses
import logging
from unittest import mock

import pytest
import torch
from torch import nn

import hf_lowprec
from hf_lowprec.fp8 import FP8Linear, convert_to_fp8
from hf_lowprec.fp8.experts import FP8Experts
from hf_lowprec.fp8.payoff import CAST_BYTES, CAST_KERNELS, PayoffRule, payoff_rule, training_gemms
from hf_lowprec.hardware import GPUS, cuda_gpu
from hf_lowprec.report import describe, format_report
from hf_lowprec.testing.moe import moe_config

H100 = GPUS["h100"]


def test_a_compute_bound_layer_pays_half_its_gemm_time_less_the_casts():
    """8192 tokens through a 8192×8192 layer: each of the three GEMMs is 2·m·k·n FLOPs and, at
    this size, limited by FLOPs (its operands are 3·64 MiB against 1.1 TFLOP). So BF16 takes
    3 · 2mkn / (0.7 · 989 TFLOPS) and FP8 takes half of that (1979 TFLOPS peak) plus the casts:
    6 bytes per element of x, W and dy at 0.8 · 3.35 TB/s, and six kernels at their floor."""
    m = k = n = 8192
    payoff = training_gemms(m, k, n, H100)
    bf16 = 3 * 2 * m * k * n / (0.7 * 989e12)
    casts = 6 * (m * k + n * k + m * n) / (0.8 * 3.35e12) + 6 * 2.5e-6
    assert (CAST_BYTES, CAST_KERNELS) == (6, 6)
    assert payoff.bf16_s == pytest.approx(bf16, rel=1e-12)
    assert payoff.fp8_s == pytest.approx(bf16 * 989 / 1979 + casts, rel=1e-12)
    assert payoff.pays and 0.5 < payoff.fp8_s / payoff.bf16_s < 0.65


def test_a_small_layer_never_pays_and_the_decision_follows_the_gpu():
    """A 256×256 layer moves more in its casts than its GEMMs save at any token count; a
    2048→1024 projection sits at the edge: it loses on an H100 (3.35 TB/s for the casts) and
    wins on an H200 (4.8 TB/s), the same GEMM rates."""
    for tokens in (1024, 8192, 1 << 20):
        assert not training_gemms(tokens, 256, 256, H100).pays
    assert not training_gemms(8192, 2048, 1024, H100).pays
    assert training_gemms(8192, 2048, 1024, GPUS["h200"]).pays


def test_experts_at_the_0_9b_moe_shape_keep_bf16_and_at_deepseek_v3_s_run_fp8():
    """Issue #67's two shapes, 8,192 tokens on an H200: 64 experts of width 512 at top-4 (512
    tokens an expert) cannot pay; DeepSeek-V3's experts (hidden 7168, width 2048, 8 on a GPU,
    2,048 tokens each at top-8 from 2,048 tokens) can."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    def experts(hidden, width, count, top_k):
        config = moe_config("qwen3_moe", hidden=hidden, intermediate=width, experts=count, top_k=top_k)
        with torch.device("meta"):
            module = Qwen3MoeExperts(config)
        module.config = config
        return module

    h200 = GPUS["h200"]
    small = PayoffRule(h200, 8192).experts(experts(1024, 512, 64, 4))
    assert not small.pays, small
    large = PayoffRule(h200, 2048).experts(experts(7168, 2048, 8, 8))
    assert large.pays and large.fp8_s < 0.8 * large.bf16_s, large


class _Layers(nn.Module):
    def __init__(self):
        super().__init__()
        self.wide = nn.Linear(4096, 4096)
        self.narrow = nn.Linear(256, 256)


def test_the_strategy_keeps_what_would_not_pay_and_the_report_names_it_with_both_times(caplog):
    strategy = hf_lowprec.get_strategy("fp8-lm-o1", fp8_gpu="h100")
    with caplog.at_level(logging.INFO, logger="hf_lowprec.fp8"):
        model = strategy.prepare_model(_Layers())
    assert isinstance(model.wide, FP8Linear) and type(model.narrow) is nn.Linear
    # A decision, not a problem: logged as information, never as a warning.
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    text = format_report(describe(strategy, model))
    assert "rule: FP8 where it pays on H100 SXM (h100) at 8192 tokens" in text
    assert "kept narrow: FP8 would not pay on H100 SXM at 8192 tokens a micro-batch" in text
    assert " µs in BF16 and " in text and "fp8_layers='all' converts it" in text
    everything = hf_lowprec.get_strategy("fp8-lm-o1", fp8_layers="all").prepare_model(_Layers())
    assert isinstance(everything.narrow, FP8Linear)
    with pytest.raises(ValueError, match=r"never reads option\(s\) \['fp8_gpu'\]"):  # "all" prices nothing
        hf_lowprec.get_strategy("fp8-lm-o1", fp8_gpu="h100", fp8_layers="all")


def test_a_module_filter_overrides_the_rule():
    model = convert_to_fp8(_Layers(), module_filter=lambda m, fqn: True, rule=PayoffRule(H100, 8192))
    assert isinstance(model.narrow, FP8Linear) and isinstance(model.wide, FP8Linear)


def test_a_tiny_moe_keeps_its_experts_in_bf16_on_a_gpu_and_converts_them_where_fp8_is_emulated():
    from hf_lowprec.testing.moe import tiny_moe

    kept = hf_lowprec.get_strategy("fp8-lm-o2", fp8_gpu="h200").prepare_model(tiny_moe("qwen3_moe"))
    assert not any(isinstance(m, FP8Experts) for m in kept.modules())
    assert any("FP8 would not pay on H200" in r for n, r in kept.fp8_skipped_layers.items() if n.endswith("experts"))
    # No CUDA device here: the default prices nothing and converts every eligible module.
    emulated = hf_lowprec.get_strategy("fp8-lm-o2").prepare_model(tiny_moe("qwen3_moe"))
    assert any(isinstance(m, FP8Experts) for m in emulated.modules())
    assert emulated.fp8_rule.startswith("no CUDA device: FP8 GEMMs are emulated")


@pytest.mark.parametrize(
    "device, key, note",
    [
        ("NVIDIA H100 80GB HBM3", "h100", "FP8 where it pays on H100 SXM"),
        ("NVIDIA H200", "h200", "FP8 where it pays on H200 SXM"),
        ("NVIDIA L4", None, "no figures for NVIDIA L4"),
        ("NVIDIA A100-SXM4-80GB", "a100", "has no FP8 GEMMs (they are emulated)"),
    ],
)
def test_the_rule_reads_the_gpu_this_process_runs_on(device, key, note):
    with (
        mock.patch("torch.cuda.is_available", return_value=True),
        mock.patch("torch.cuda.get_device_name", return_value=device),
    ):
        name, entry = cuda_gpu()
        rule, line = payoff_rule()
    assert name == device and entry is (GPUS[key] if key else None)
    assert note in line
    assert (rule is not None) == (key in ("h100", "h200"))


def test_a_gpu_with_other_numbers_changes_the_decision():
    slow_casts = dataclasses.replace(H100, bandwidth=H100.bandwidth / 100)
    assert training_gemms(8192, 4096, 4096, H100).pays
    assert not training_gemms(8192, 4096, 4096, slow_casts).pays


@pytest.mark.parametrize(
    "options, message",
    [
        ({"fp8_gpu": "h300"}, "fp8_gpu must be one of ['a100', 'b200', 'h100', 'h200']"),
        ({"fp8_layers": "some"}, "option 'fp8_layers' must be one of ['pays', 'all'], got 'some'"),
        ({"fp8_tokens": 0}, "fp8_tokens must be >= 1"),
        ({"fp8_tokens": 8192.0}, "option 'fp8_tokens' must be an integer"),
    ],
)
def test_bad_rule_options_are_refused_by_name(options, message):
    with pytest.raises(ValueError) as error:
        hf_lowprec.get_strategy("fp8-lm-o2", **options)
    assert message in str(error.value)


def test_coat_takes_the_same_rule_and_keeps_fp8_states_for_the_kept_layers():
    strategy = hf_lowprec.get_strategy("coat", fp8_gpu="h100")
    model = strategy.prepare_model(_Layers())
    assert isinstance(model.wide, FP8Linear) and type(model.narrow) is nn.Linear
    assert model.fp8_rule.startswith("FP8 where it pays on H100 SXM")
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    model.narrow(torch.randn(4, 256)).sum().backward()
    model.wide(torch.randn(4, 4096)).sum().backward()
    optimizer.step()
    state = optimizer.state[model.narrow.weight]
    assert any(t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for t in state.values() if torch.is_tensor(t))


def _saved_state(options):
    strategy = hf_lowprec.get_strategy("fp8-lm-o1", **options)
    model = strategy.prepare_model(_Layers())
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    return optimizer.state_dict()


def test_a_resume_that_would_keep_other_layers_in_bf16_is_refused_with_the_options_that_fit():
    """The rule's options may change on resume; the layers it keeps may not (the optimizer's state
    follows them). A checkpoint saved before the rule (every layer FP8) resumes as it was here,
    where no GPU is priced."""
    priced = _saved_state({"fp8_gpu": "h100"})
    assert priced["hf_lowprec"]["fp8_layout"] == {"gpu": "h100", "tokens": 8192, "kept": ["narrow"]}
    here = hf_lowprec.get_strategy("fp8-lm-o1")  # no CUDA device: every layer FP8
    optimizer = here.create_optimizer(here.prepare_model(_Layers()).parameters(), lr=1e-3)
    with pytest.raises(ValueError) as error:
        optimizer.load_state_dict(priced)
    assert "saved with 1 layers kept in BF16 by the FP8 layer rule (h100)" in str(error.value)
    assert 'precision_options {"fp8_gpu": "h100", "fp8_tokens": 8192}' in str(error.value)
    same = hf_lowprec.get_strategy("fp8-lm-o1", fp8_gpu="h100", fp8_tokens=4096)  # still keeps `narrow`
    same.create_optimizer(same.prepare_model(_Layers()).parameters(), lr=1e-3).load_state_dict(priced)
    # Saved before the rule existed: no layout, none of its options.
    old = _saved_state({})
    del old["hf_lowprec"]["fp8_layout"]
    for key in ("fp8_layers", "fp8_gpu", "fp8_tokens"):
        del old["hf_lowprec"]["options"][key]
    optimizer.load_state_dict(old)
    kept = hf_lowprec.get_strategy("fp8-lm-o1", fp8_gpu="h100")
    with pytest.raises(ValueError) as error:
        kept.create_optimizer(kept.prepare_model(_Layers()).parameters(), lr=1e-3).load_state_dict(old)
    assert 'precision_options {"fp8_layers": "all"}' in str(error.value)
