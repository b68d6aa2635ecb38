"""A compiled model is one graph, built once: no strategy adds graph breaks to what bf16-mixed
has (issue #36), and none makes dynamo build a new graph after the warm-up steps (issue #47).

The prepared model is wrapped in `torch.compile` as `TrainingArguments(torch_compile=True)`
does and trained two warm-up steps, then four steady steps (GPT-2, 2 and 3 layers), with
dynamo's settings left at their defaults; dynamo's own counters are read after a reset. The
backend is "eager" (see `hf_lowprec.testing.counted_step.strategy_graph_breaks` for why the count is the
backend's; guards are dynamo's too). bf16-mixed's breaks come from transformers' GPT-2 itself
(logger calls), which no strategy can remove; anything beyond them is the strategy's code.

A graph built in a steady step is a recompilation: some Python value read while tracing (a
module global bumped by the optimizer step, a cache dict, a flag) changed between steps, so
a guard failed. On a GPU each one is a full compilation inside the training step, and after
dynamo's recompile limit the forward silently runs eagerly: the FP8 strategies paid 24–30×
bf16-mixed's compiled step that way before #47. A graph per layer (a guard on something each
layer holds differently) shows as warm-up graphs that grow from 2 to 3 layers beyond bf16-mixed's;
3 layers, not 8: the same checks, at a third of the compile time (issue #65).
"""

import functools

import pytest
import torch

import hf_lowprec
from hf_lowprec.testing import compiled_run, count_graph_breaks, strategy_compiled_run, strategy_graph_breaks

STRATEGIES = hf_lowprec.available_strategies()


@functools.cache
def run(name: str, n_layer: int):
    return strategy_compiled_run(name, n_layer)


@pytest.mark.parametrize("n_layer", [1, 2])
@pytest.mark.parametrize("name", STRATEGIES)
def test_compiled_once_with_no_more_graph_breaks_than_bf16_mixed(name, n_layer):
    result = run(name, n_layer)
    assert result.new_graphs == 0, (
        f"{name}, {n_layer} layers: dynamo built {result.new_graphs} graphs in 4 steady steps (goal 0); "
        f"guards that failed:\n{result.recompiles_summary()}"
    )
    baseline = run("bf16-mixed", n_layer).breaks
    listed = "\n".join(f"  {n}x {reason.splitlines()[0][:200]}" for reason, n in result.break_reasons.most_common())
    assert result.breaks <= baseline, f"{name}: {result.breaks} graph breaks, bf16-mixed {baseline}:\n{listed}"
    if n_layer == 2:
        per_layer = result.warmup_graphs - run(name, 1).warmup_graphs
        baseline_per_layer = run("bf16-mixed", 2).warmup_graphs - run("bf16-mixed", 1).warmup_graphs
        assert per_layer <= baseline_per_layer, (
            f"{name}: {per_layer} more graphs for one more layer (bf16-mixed {baseline_per_layer})"
        )


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_moe_model_compiles_with_no_graph_break(name):
    """A tiny Qwen3-MoE (`testing.counted_step.moe`) compiled, two steps: no graph break under any
    strategy, as under bf16-mixed (issue #67). COAT broke the graph at every RMSNorm (its
    backward re-ran the layer through `torch.autograd.grad`; now `torch.func.vjp`)."""
    breaks, reasons = strategy_graph_breaks(name, 2, model="moe")
    listed = "\n".join(f"  {n}x {reason.splitlines()[0][:200]}" for reason, n in reasons.most_common())
    assert breaks == 0, f"{name}: {breaks} graph breaks in a compiled MoE step:\n{listed}"


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise", "mxfp8"])
def test_each_recipe_compiles_once_with_no_more_graph_breaks_than_tensorwise(recipe):
    result = strategy_compiled_run("fp8-lm-o2", 2, recipe=recipe)
    assert result.new_graphs == 0, (
        f"{recipe}: {result.new_graphs} graphs in steady steps:\n{result.recompiles_summary()}"
    )
    baseline = run("fp8-lm-o2", 2).breaks
    listed = "\n".join(f"  {n}x {reason.splitlines()[0][:200]}" for reason, n in result.break_reasons.most_common())
    assert result.breaks <= baseline, f"{recipe}: {result.breaks} graph breaks, tensorwise {baseline}:\n{listed}"


def test_the_counter_sees_a_planted_break():
    def step(x):
        y = x * 2
        print("a Python side effect dynamo cannot put in a graph")
        return y + 1

    compiled = torch.compile(step, backend="eager")
    breaks, _ = count_graph_breaks(lambda: compiled(torch.ones(3)))
    assert breaks >= 1


# The defect #47 removed, planted: a module-level step counter, bumped by the optimizer step
# and read in the forward.
_planted_step = 0


class _ReadsTheStep(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return y * 2 if _planted_step % 1000 == 0 else y  # always y: only the read matters


def test_the_counter_sees_a_per_step_global_read_in_the_forward():
    global _planted_step
    model = _ReadsTheStep()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(4, 16)

    def step() -> None:
        global _planted_step
        compiled(x).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        _planted_step += 1

    _planted_step = 1
    result = compiled_run(step, warmup=2, steady=4)
    assert result.new_graphs == 4, result
    assert any("_planted_step" in r for r in result.recompile_reasons), result.recompile_reasons


@pytest.mark.parametrize("name", ["fp8-lm-o2", "coat"])
def test_the_trainer_with_torch_compile_builds_its_graphs_once(tmp_path, name):
    """`TrainingArguments(torch_compile=True)` through `hf_lowprec.Trainer` (which compiles the
    model through Accelerate): no graph is built after the second optimizer step."""
    from torch._dynamo.utils import counters, guard_failures
    from transformers import TrainerCallback

    from hf_lowprec import Trainer, TrainingArguments
    from tests.helpers import TokenBlocks, tiny_gpt2, trainer_arguments

    graphs_after_step: list[int] = []

    class CountGraphs(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            graphs_after_step.append(counters["stats"]["unique_graphs"])

    args = TrainingArguments(
        **trainer_arguments(
            tmp_path, precision_strategy=name, torch_compile=True, torch_compile_backend="eager", max_steps=6
        )
    )
    torch._dynamo.reset()
    counters.clear()
    guard_failures.clear()
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenBlocks(), callbacks=[CountGraphs()])
    trainer.train()
    assert len(graphs_after_step) == 6
    assert graphs_after_step[0] > 0, "the model was not compiled"
    reasons = [str(r).splitlines()[0] for failures in guard_failures.values() for r in failures]
    assert graphs_after_step[-1] == graphs_after_step[1], (graphs_after_step, reasons)
