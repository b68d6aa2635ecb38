"""Graph breaks under `torch.compile`: no strategy adds any to what bf16-mixed has (issue #36).

The prepared model is wrapped in `torch.compile` as `TrainingArguments(torch_compile=True)`
does, and trained two steps (2 layers); dynamo's own counter is read after a reset. The
backend is "eager" (see `tests.gpu.rules.strategy_graph_breaks` for why the count is the
backend's). bf16-mixed's breaks come from transformers' GPT-2 itself (logger calls), which no
strategy can remove; anything beyond them is the strategy's code in the forward or backward.
"""

import functools

import pytest

import hf_lowprec
from tests.gpu.rules import strategy_graph_breaks

STRATEGIES = hf_lowprec.available_strategies()


@functools.cache
def baseline() -> int:
    return strategy_graph_breaks("bf16-mixed")[0]


# Strategies not at the goal yet (an expected failure, not a skip: the count is still measured
# and printed). Empty since COAT's layers differentiate with aten kernels and fp16-als counts
# through a probe gradient; a strategy that regresses must be fixed, not listed.
NOT_YET_ONE_GRAPH: set[str] = set()
CASES = [
    pytest.param(name, marks=pytest.mark.xfail(reason="graph breaks above bf16-mixed's: see NOT_YET_ONE_GRAPH"))
    if name in NOT_YET_ONE_GRAPH
    else name
    for name in STRATEGIES
]


@pytest.mark.parametrize("name", CASES)
def test_no_more_graph_breaks_than_bf16_mixed(name):
    breaks, reasons = strategy_graph_breaks(name)
    listed = "\n".join(f"  {n}x {reason.splitlines()[0][:200]}" for reason, n in reasons.most_common())
    assert breaks <= baseline(), f"{name}: {breaks} graph breaks, bf16-mixed {baseline()}:\n{listed}"


def test_the_counter_sees_a_planted_break():
    import torch

    def step(x):
        y = x * 2
        print("a Python side effect dynamo cannot put in a graph")
        return y + 1

    from tests.gpu.rules import count_graph_breaks

    compiled = torch.compile(step, backend="eager")
    breaks, _ = count_graph_breaks(lambda: compiled(torch.ones(3)))
    assert breaks >= 1
