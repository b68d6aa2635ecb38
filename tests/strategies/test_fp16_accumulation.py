"""fp16-als's running mean where a micro-batch does not reach every parameter: against stock's mean."""

import pytest
import torch
import transformers

import hf_lowprec
from hf_lowprec import Trainer
from tests.distributed._running_mean_worker import TwoHeads, fp64_mean, samples
from tests.helpers import make_args

# FP16's unit roundoff, and half its smallest subnormal (a product below 2⁻¹⁴ rounds absolutely).
U16 = 2.0**-11
SUBNORMAL = 2.0**-25


def check_mean(grads: dict, data: list[dict]) -> None:
    """Each micro-batch's gradient element is one product rounded to FP16 (u = 2⁻¹¹ relative, 2⁻²⁵ absolute
    below FP16's normal range); the running mean's halvings are exact and it rounds their sum once: within
    2u·max|g| + 3·2⁻²⁵ of the FP64 mean. A layer reached by one of two micro-batches at twice the mean is off by
    |g|/2, far outside."""
    reference, largest = fp64_mean(data)
    for name, ref in reference.items():
        got = grads[name].double()
        assert torch.isfinite(got).all(), name
        error = (got - ref).abs()
        assert (error <= 2 * U16 * largest[name] + 3 * SUBNORMAL).all(), (name, float((error / largest[name]).max()))


@pytest.mark.parametrize("use_b", [(1, 0), (0, 1)])
def test_custom_loop_with_declared_micro_batches_takes_stocks_mean(use_b):
    """set_gradient_accumulation(2), each loss divided by 2: `b`'s gradient was its one micro-batch's (2.0× stock)."""
    data = samples(use_b)
    strategy = hf_lowprec.get_strategy("fp16-als")
    model = strategy.prepare_model(TwoHeads())
    optimizer = strategy.create_optimizer(model.parameters(), lr=0.0)
    strategy.set_gradient_accumulation(2)
    for sample in data:
        with strategy.forward_context():
            loss = model(sample["x"], sample["t"], torch.tensor(sample["use_b"]))["loss"]
        strategy.scale_loss(loss / 2).backward()
    strategy.unscale_gradients(optimizer.optimizer)
    strategy.unscale_gradients(optimizer.optimizer)  # the step's own call: once per window
    check_mean({n: p.grad for n, p in model.named_parameters()}, data)


@pytest.mark.slow
def test_trainer_accumulation_takes_stocks_mean(tmp_path):
    """Trainer, gradient_accumulation_steps=2, one sample a micro-batch: `b`'s gradient at the step was 2.0× stock's."""
    seen = {}

    class Grads(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            seen.update({n: p.grad.detach().clone() for n, p in model.named_parameters()})

    # One step over both micro-batches; a clip that clips nothing (it unscales first), weights kept (lr 0).
    overrides = dict(max_steps=1, per_device_train_batch_size=1, max_grad_norm=1e9, learning_rate=0.0)
    args = make_args(tmp_path, "fp16-als", gradient_accumulation_steps=2, remove_unused_columns=False, **overrides)
    trainer = Trainer(model=TwoHeads(), args=args, train_dataset=samples(), callbacks=[Grads()])
    trainer.train()
    assert trainer.precision.scaler.get_scale() == 2.0  # scale 1 at the backward: the gradients are unscaled
    check_mean(seen, samples())
