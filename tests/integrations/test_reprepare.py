"""One model prepared under one strategy, then under another in the same process (a notebook's
baseline after a run): the second run computes as the same run on a fresh model holding the same
weights, bit for bit; the first strategy's forward wrapper and hooks are gone."""

import pytest
import torch

from hf_lowprec import Trainer
from tests.helpers import TokenBlocks, assert_bits_equal, logged_losses, make_args, tiny_gpt2


def _run(model, strategy, tmp_path, **overrides):
    trainer = Trainer(
        model=model, args=make_args(tmp_path, strategy, max_steps=2, **overrides), train_dataset=TokenBlocks(8)
    )
    trainer.train()
    return logged_losses(trainer)


def _gemm_dtypes(model, ids):
    seen = set()
    handle = model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda m, a, out: seen.add(out.dtype))
    model(input_ids=ids)
    handle.remove()
    return seen


@pytest.mark.parametrize(
    "first, second",
    [("bf16-mixed", "fp32"), ("bf16-mixed", "fp16-mixed"), ("bf16-pure", "fp32"), ("fp16-mixed", "bf16-mixed")],
)
def test_a_model_prepared_again_under_another_strategy_trains_as_a_fresh_one(tmp_path, first, second):
    # Before: bf16-mixed's BF16 autocast forward stayed, so the fp32 and fp16-mixed runs computed in
    # BF16 (step-1 loss 5.002606 against 5.002404); bf16-pure's input cast stayed on the FP32 model.
    model = tiny_gpt2()
    _run(model, first, tmp_path / "first")
    fresh = tiny_gpt2(seed=1)
    fresh.load_state_dict(model.state_dict())  # the same values, in the dtypes the first run left
    fresh.to(next(model.parameters()).dtype)
    assert "_original_forward" not in fresh.__dict__
    again, alone = _run(model, second, tmp_path / "again"), _run(fresh, second, tmp_path / "alone")
    assert again == alone  # every logged loss, bit for bit
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert_bits_equal(a, b)
    ids = TokenBlocks(4, seed=3).ids[:2, :16]
    with torch.no_grad():
        assert _gemm_dtypes(model, ids) == _gemm_dtypes(fresh, ids)
        embeds = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
        assert_bits_equal(model(inputs_embeds=embeds).logits, fresh(inputs_embeds=embeds).logits)


def test_the_plugins_context_hooks_go_when_a_trainer_prepares_the_model_again(tmp_path):
    from hf_lowprec import PrecisionPlugin

    model = tiny_gpt2()
    PrecisionPlugin("bf16-mixed").prepare_model(model)
    assert len(model._forward_pre_hooks) == 1
    fresh = tiny_gpt2(seed=1)
    fresh.load_state_dict(model.state_dict())
    assert _run(model, "fp32", tmp_path / "again") == _run(fresh, "fp32", tmp_path / "alone")
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_a_second_fp16_als_trainer_starts_from_the_initial_loss_scale(tmp_path):
    # Before: it took over the first run's scaler, 2^4 at its first step instead of the initial 2^1.
    def run(model, where):
        trainer = Trainer(
            model=model, args=make_args(tmp_path / where, "fp16-als", max_steps=3), train_dataset=TokenBlocks(16)
        )
        trainer.train()
        return [(h["loss"], h["precision/loss_scale"]) for h in trainer.state.log_history if "loss" in h]

    model = tiny_gpt2()
    run(model, "first")
    fresh = tiny_gpt2(seed=1)
    fresh.load_state_dict(model.state_dict())  # FP16 values, exact in FP32: cast back to the same bits
    assert run(model, "again") == run(fresh, "alone")
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert_bits_equal(a, b)


def test_a_deleted_fp8_trainers_optimizer_is_freed_and_a_kept_one_trains_again(tmp_path):
    # Before: the strategy, reachable from the model's prepared mark, held the optimizer as the owner of
    # the FP8 gradients (BackwardFP8Gradients): its moments and last FP8 gradients, 2x the parameters'
    # bytes here, lived as long as the model.
    import gc
    import weakref

    from hf_lowprec.memory import unwrap_optimizer

    model = tiny_gpt2()
    args = make_args(tmp_path / "kept", "fp8-lm-o2", max_steps=2)
    kept = Trainer(model=model, args=args, train_dataset=TokenBlocks(8))
    kept.train()
    kept.train()  # a later train() on the same Trainer still quantizes into its optimizer
    assert unwrap_optimizer(kept.optimizer).state
    assert model.__dict__["hf_lowprec_prepared"].strategy.backward_grads.owner is unwrap_optimizer(kept.optimizer)
    model = tiny_gpt2()
    trainer = Trainer(
        model=model, args=make_args(tmp_path / "gone", "fp8-lm-o2", max_steps=2), train_dataset=TokenBlocks(8)
    )
    trainer.train()
    optimizer = weakref.ref(unwrap_optimizer(trainer.optimizer))
    del trainer
    gc.collect()
    assert optimizer() is None
    assert model.__dict__["hf_lowprec_prepared"].strategy.backward_grads.owner is None
