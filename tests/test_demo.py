import logging

import pytest
import torch

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


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--strategies", "fp33"], "unknown precision strategy 'fp33'"),
        (["--strategies", "collage_plus"], "Did you mean 'collage-plus'"),
        (["--steps", "0"], "--steps must be at least 1, got 0"),
        (["--batch_size", "-2"], "--batch_size must be at least 1, got -2"),
        (["--lr", "0"], "--lr must be a positive learning rate"),
    ],
)
def test_demo_refuses_bad_arguments_as_usage_errors_before_training(capsys, argv, message):
    # A bare ValueError traceback before; --steps 0 printed a row "trained" in 0 steps.
    with pytest.raises(SystemExit) as exit_:
        demo.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_gives_back_the_thread_count_and_the_transformers_log_level(capsys):
    # main() set torch's intra-op threads and transformers' logger (ERROR) for the rest of the
    # process: the test suite's one pinned thread became --threads for every later test there.
    threads, level = torch.get_num_threads(), logging.getLogger("transformers").level
    demo.main(["--steps", "1", "--batch_size", "1", "--strategies", "fp32", "--threads", str(threads + 1)])
    assert torch.get_num_threads() == threads
    assert logging.getLogger("transformers").level == level
