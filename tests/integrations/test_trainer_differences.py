"""The README's table of what a strategy changes in the Trainer says what the strategy does."""

import pytest

from hf_lowprec import get_strategy
from hf_lowprec.integrations.trainer_differences import stock_differences
from tests.helpers import batches, tiny_gpt2

SKIPS = "a step with inf/NaN gradients is skipped and counted"
CLIPS = "an inf gradient is clipped to ±65504 and the step taken"


@pytest.mark.parametrize("name", ["fp16-als", "fp16-mixed", "collage-plus", "bf16-mixed"])
def test_the_row_on_an_inf_gradient_says_whether_the_step_is_skipped(name):
    strategy = get_strategy(name)
    model = strategy.prepare_model(tiny_gpt2(n_embd=16))
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    ids = batches(1)[0]
    with strategy.forward_context():
        loss = model(input_ids=ids, labels=ids).loss
    strategy.scale_loss(loss).backward()
    model.lm_head.weight.grad[0, 0] = float("inf")
    optimizer.step()
    said = stock_differences(name)
    assert (SKIPS in said) == optimizer.step_was_skipped, said
    assert any(d.startswith(CLIPS) for d in said) == (not optimizer.step_was_skipped), said
