"""The startup warning for FP16 strategies on CPUs whose FP16 GEMMs are slow (decided by a timed probe)."""

from __future__ import annotations

import logging
import math

import pytest

import hf_lowprec
from hf_lowprec import Trainer, hardware, report
from tests.helpers import TokenBlocks, checkpointed_args, tiny_gpt2


@pytest.fixture
def probe(monkeypatch):
    """Replace the timed probe by a fixed ratio; record how often it is asked; forget earlier warnings."""
    calls: list[str] = []

    def fake(ratio: float):
        def slowdown(device: str = "cpu", *args, **kwargs) -> float:
            calls.append(device)
            return ratio

        monkeypatch.setattr(hardware, "fp16_gemm_slowdown", slowdown)

    monkeypatch.setattr(report, "_SLOW_FP16_WARNED", set())
    fake.calls = calls
    return fake


def prepared(name: str):
    strategy = hf_lowprec.get_strategy(name)
    return strategy, strategy.prepare_model(tiny_gpt2())


@pytest.mark.parametrize("name", ["fp16-als", "fp16-mixed"])
def test_fp16_strategies_warn_where_the_probe_measures_slow_fp16_gemms(probe, name):
    probe(190.0)
    text = report.slow_fp16_warning(*prepared(name))
    assert text is not None
    assert f"{name!r} computes in FP16" in text and "~190x slower than BF16" in text
    assert "'bf16-mixed'" in text and "'collage-plus'" in text
    assert probe.calls == ["cpu"]


@pytest.mark.parametrize("name", ["fp16-als", "fp16-mixed"])
def test_no_warning_where_fp16_gemms_are_fast(probe, name):
    probe(hardware.SLOW_FP16_RATIO * 0.9)
    assert report.slow_fp16_warning(*prepared(name)) is None
    assert probe.calls == ["cpu"]


def test_a_cpu_without_fp16_matmuls_is_named_as_such(probe):
    probe(math.inf)
    assert "cannot run FP16 matmuls at all" in report.slow_fp16_warning(*prepared("fp16-als"))


@pytest.mark.parametrize("name", ["bf16-mixed", "collage-plus", "fp32"])
def test_other_strategies_never_run_the_probe(probe, name):
    probe(190.0)
    assert report.slow_fp16_warning(*prepared(name)) is None
    assert probe.calls == []


def test_said_once_per_process(probe, caplog):
    probe(190.0)
    strategy, model = prepared("fp16-als")
    with caplog.at_level(logging.WARNING, logger="hf_lowprec.report"):
        assert report.warn_slow_fp16_once(strategy, model) is not None
        assert report.warn_slow_fp16_once(strategy, model) is None
    assert [r.levelno for r in caplog.records if "computes in FP16" in r.getMessage()] == [logging.WARNING]


@pytest.mark.parametrize("ratio, warned", [(190.0, True), (1.0, False)])
def test_the_trainer_startup_report_says_it(probe, caplog, tmp_path, ratio, warned):
    probe(ratio)
    args = checkpointed_args(tmp_path, "fp16-mixed", max_steps=1, save_strategy="no")
    with caplog.at_level(logging.WARNING, logger="hf_lowprec.report"):
        Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenBlocks(n=8)).train()
    said = [r for r in caplog.records if "computes in FP16" in r.getMessage()]
    assert len(said) == int(warned)


def test_the_probe_times_real_matmuls_once_per_process():
    hardware.fp16_gemm_slowdown.cache_clear()
    ratio = hardware.fp16_gemm_slowdown("cpu", (64, 32, 64), 2)
    assert ratio > 0 and not math.isnan(ratio)
    assert hardware.fp16_gemm_slowdown("cpu", (64, 32, 64), 2) == ratio
    assert hardware.fp16_gemm_slowdown.cache_info().hits == 1
    assert hardware.fp16_gemm_slowdown("meta") == 1.0  # only CPUs are probed
    hardware.fp16_gemm_slowdown.cache_clear()
