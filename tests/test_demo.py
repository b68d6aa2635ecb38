import pytest

from hf_lowprec import demo


def test_demo_prints_one_row_per_strategy(capsys):
    rows = demo.main(["--steps", "3", "--batch_size", "2", "--strategies", "fp32,bf16-pure"])
    assert [r["strategy"] for r in rows] == ["fp32", "bf16-pure"]
    assert rows[0]["bytes_per_param"] == pytest.approx(16.0, abs=0.1)
    assert rows[1]["bytes_per_param"] == pytest.approx(8.0, abs=0.1)
    for r in rows:
        assert r["eval_perplexity"] > 1.0 and r["median_step_ms"] > 0.0
    out = capsys.readouterr().out
    assert "strategy" in out and "bf16-pure" in out


def test_demo_rejects_an_unknown_strategy_before_training():
    with pytest.raises(ValueError, match="unknown precision strategy 'fp33'"):
        demo.main(["--strategies", "fp33"])
