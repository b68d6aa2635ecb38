"""The stochastic-rounding seed under the Trainer: drawn from `--seed` unless given, and recorded in the report."""

import json

import pytest
import torch

from hf_lowprec import Trainer
from hf_lowprec.integrations.trainer import REPORT_FILE
from tests.helpers import TokenBlocks, make_args, tiny_gpt2

SR = [("bf16-sr", None), ("fp16-als", {"weights": "sr"})]


def run(tmp_path, strategy, options, seed):
    # The same initial weights, data order (data_seed) and no dropout: only the SR stream can differ.
    out = tmp_path / f"{strategy}-{seed}"
    args = make_args(out, strategy, precision_options=options, seed=seed, data_seed=0, max_steps=2, save_strategy="no")
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenBlocks())
    trainer.train()
    report = json.loads((out / REPORT_FILE).read_text())
    weights = torch.cat([p.detach().float().flatten() for p in trainer.model.parameters()])
    return trainer.optimizer.optimizer.optimizer.seed, report["options"]["seed"], weights


@pytest.mark.parametrize("strategy,options", SR)
def test_runs_of_other_seeds_round_differently_and_the_report_records_the_seed(tmp_path, strategy, options):
    seed0, reported0, weights0 = run(tmp_path, strategy, options, 0)
    seed1, reported1, weights1 = run(tmp_path, strategy, options, 1)
    again, _, weights0_again = run(tmp_path / "again", strategy, options, 0)
    assert (reported0, reported1) == (seed0, seed1) and seed0 != seed1
    assert again == seed0 and torch.equal(weights0.view(torch.int32), weights0_again.view(torch.int32))
    assert not torch.equal(weights0, weights1)  # the rounding bits differ


def test_a_given_seed_wins_over_the_run_seed(tmp_path):
    seeds = [run(tmp_path, "bf16-sr", {"seed": 7}, s)[0] for s in (0, 1)]
    assert seeds == [7, 7]
