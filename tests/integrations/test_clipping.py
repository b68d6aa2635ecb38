"""The gradient norm the Trainer logs and clips with under BF16-gradient strategies: an FP32 norm, not a BF16 one."""

import pytest
import torch
from accelerate import Accelerator
from transformers import TrainerCallback

from hf_lowprec import PrecisionPlugin, Trainer
from tests.helpers import VOCAB, TokenBlocks, make_args, rounding_bound, tiny_gpt2

N_EMBD = 16


# The largest gradient has VOCAB·N_EMBD elements (the token embedding). Each tensor's norm sums
# squares of BF16 values (exact in FP32) with FP32 additions, all positive, and the norms of the
# tensors are summed the same way: at most (largest tensor + tensors + 4) roundings of FP32's u,
# none cancelling (the two square roots and the squares of the per-tensor norms included).
def norm_tolerance(tensors: int, norm: float) -> float:
    return rounding_bound(torch.float32, VOCAB * N_EMBD + tensors + 4, norm)


class GradientsBeforeTheStep(TrainerCallback):
    """The FP64 norm of the gradients the optimizer is about to step on (clipping has run)."""

    def __init__(self) -> None:
        self.norms: list[float] = []
        self.tensors = 0

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
        self.tensors = len(grads)
        self.norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())


@pytest.mark.parametrize("strategy", ["collage-plus", "bf16-pure"])
@pytest.mark.parametrize("max_grad_norm", [0.0, 1e6])  # measured only (`_get_grad_norm`); clipped by a factor of 1
def test_the_logged_grad_norm_is_the_fp32_norm_of_bf16_gradients(tmp_path, strategy, max_grad_norm):
    seen = GradientsBeforeTheStep()
    args = make_args(tmp_path, strategy, max_steps=3, max_grad_norm=max_grad_norm, save_strategy="no")
    trainer = Trainer(model=tiny_gpt2(n_embd=N_EMBD), args=args, train_dataset=TokenBlocks(), callbacks=[seen])
    trainer.train()
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert len(logged) == len(seen.norms) == 3
    for got, expected in zip(logged, seen.norms):
        tolerance = norm_tolerance(seen.tensors, expected)
        # Any BF16 number is at least this far from the FP64 norm: the test fails on a BF16 norm.
        assert abs(torch.tensor(expected).bfloat16().double().item() - expected) > tolerance, expected
        assert abs(got - expected) <= tolerance, (got, expected, tolerance)


def test_clipping_bf16_gradients_multiplies_them_by_an_fp32_coefficient(tmp_path):
    args = make_args(tmp_path, "collage-plus", max_steps=1, max_grad_norm=0.25, save_strategy="no")
    trainer = Trainer(model=tiny_gpt2(n_embd=N_EMBD), args=args, train_dataset=TokenBlocks())
    model = trainer.model
    ids = TokenBlocks()[0]["input_ids"][None]
    model(input_ids=ids, labels=ids).loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad.clone() for p in params]
    before = torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads])).item()
    norm = trainer._clip_grad_norm(model)
    assert norm.dtype == torch.float32 and before > 0.25  # (clipping acts)
    assert abs(norm.item() - before) <= norm_tolerance(len(grads), before)
    # torch's clipping coefficient, max_norm / (norm + 1e-6) at most 1, in FP32; rounded to BF16 it differs.
    coefficient = (0.25 / (norm + 1e-6)).clamp(max=1.0)
    assert coefficient.bfloat16().float() != coefficient
    for g, p in zip(grads, params):  # each element times the FP32 coefficient, rounded once to BF16
        assert torch.equal(p.grad.view(torch.int16), (g.float() * coefficient).bfloat16().view(torch.int16))


def test_the_accelerate_plugin_clips_bf16_gradients_with_an_fp32_norm():
    plugin, accelerator = PrecisionPlugin("collage-plus"), Accelerator(cpu=True)
    model = tiny_gpt2(n_embd=N_EMBD)
    model, _ = plugin.prepare(accelerator, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = TokenBlocks()[0]["input_ids"][None]
    plugin.backward(accelerator, model(input_ids=ids, labels=ids).loss)
    grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
    expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()
    norm = accelerator.clip_grad_norm_(model.parameters(), 1e6)
    assert norm.dtype == torch.float32
    assert abs(norm.item() - expected) <= norm_tolerance(len(grads), expected), (norm.item(), expected)
