"""The optimizer a Trainer ends up with at train() start, wherever it came from (a subclass's override of
`create_optimizer`, an assignment to `trainer.optimizer`, a class before the mixin), under the rule of
`optimizers=`: `fp32`, `bf16-mixed`, `fp16-mixed` wrap it in the strategy's step before Accelerate
prepares it; the strategies with their own optimizer refuse it before any step."""

import pytest
import torch
import transformers

from hf_lowprec import Trainer, TrainingArguments
from hf_lowprec.integrations.optimizer_arguments import find_strategy_optimizer
from hf_lowprec.strategies.interface import StrategyOptimizer
from tests.helpers import ParameterSnapshots, TokenBlocks, assert_bits_equal, finite, tiny_gpt2, trainer_arguments


def _two_groups(model: torch.nn.Module) -> torch.optim.AdamW:
    """Plain torch AdamW with a layer-wise LR: the first block at a tenth of the rest's."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return torch.optim.AdamW(
        [
            {"params": [p for n, p in named if ".h.0." in n], "lr": 3e-4},
            {"params": [p for n, p in named if ".h.0." not in n], "lr": 3e-3},
        ],
        weight_decay=0.0,
    )


class LayerWise(Trainer):
    """The layer-wise LR override transformers' docs suggest: a plain torch optimizer."""

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = _two_groups(self.model)
        return self.optimizer


class InfOnce(LayerWise):
    """An inf loss, hence inf gradients, at the second optimizer step."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        return loss * float("inf") if self.state.global_step == 1 and model.training else loss


def _args(tmp_path, strategy, **overrides):
    base = trainer_arguments(
        tmp_path, **{"max_steps": 3, "save_strategy": "no", "lr_scheduler_type": "linear", **overrides}
    )
    return TrainingArguments(**base, precision_strategy=strategy)


def _chain(optimizer) -> list:
    chain = []
    while optimizer is not None:
        chain.append(optimizer)
        optimizer = getattr(optimizer, "optimizer", None)
    return chain


@pytest.mark.parametrize("strategy", ["fp16-mixed", "bf16-mixed"])
def test_an_overridden_create_optimizer_trains_as_the_same_optimizer_passed_in(tmp_path, strategy):
    # It stepped outside the strategy: fp16-mixed on loss-scaled gradients (grad_norm 1.5, 81623.6, inf).
    override = LayerWise(model=tiny_gpt2(), args=_args(tmp_path / "a", strategy), train_dataset=TokenBlocks(12))
    model = tiny_gpt2()
    passed = Trainer(model=model, args=_args(tmp_path / "b", strategy), train_dataset=TokenBlocks(12),
                     optimizers=(_two_groups(model), None))  # fmt: skip
    override.train()
    passed.train()
    chain = _chain(override.optimizer)
    assert [type(o) for o in chain[1:]] == [StrategyOptimizer, torch.optim.AdamW]
    assert chain[0].optimizer is override.lr_scheduler.optimizer.optimizer  # Accelerate's, the scheduler's
    assert [g["lr"] for g in chain[2].param_groups] == [g["lr"] for g in _chain(passed.optimizer)[2].param_groups]
    assert override.state.log_history[:-1] == passed.state.log_history[:-1]  # (the last: the run's timing)
    finite([h["loss"] for h in override.state.log_history if "loss" in h])
    for (name, a), b in zip(override.model.named_parameters(), passed.model.parameters()):
        assert_bits_equal(a.detach(), b.detach(), name)


def test_an_overridden_create_optimizer_skips_a_step_with_inf_gradients_under_bf16_mixed(tmp_path):
    trainer = InfOnce(model=tiny_gpt2(), args=_args(tmp_path, "bf16-mixed"), train_dataset=TokenBlocks(12))
    snap = ParameterSnapshots()
    trainer.add_callback(snap)
    trainer.train()
    before, skipped, after = snap.taken
    assert all(torch.equal(a, b) for a, b in zip(before, skipped))  # step 2 skipped
    assert not all(torch.equal(a, b) for a, b in zip(skipped, after))
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert [h["precision/skipped_steps"] for h in trainer.state.log_history if "loss" in h] == [0.0, 1.0, 1.0]
    assert trainer.lr_scheduler.last_epoch == 2  # the schedule did not advance on the skipped step


@pytest.mark.parametrize("strategy", ["collage-plus", "fp16-als"])
def test_an_overridden_create_optimizer_is_refused_before_any_step(tmp_path, strategy):
    # collage-plus ran torch's AdamW on its BF16 weights; fp16-als went NaN at step 2.
    trainer = LayerWise(model=tiny_gpt2(), args=_args(tmp_path, strategy), train_dataset=TokenBlocks(12))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(ValueError, match=r"LayerWise\.create_optimizer \(an override\) gave the Trainer a torch"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


class StrategyGroups(Trainer):
    """The refusal's fix: the same groups through the strategy's optimizer."""

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = self.precision.create_optimizer(_two_groups(self.model).param_groups, lr=1.0)
        return self.optimizer


def test_the_strategys_optimizer_over_your_groups_trains(tmp_path):
    trainer = StrategyGroups(model=tiny_gpt2(), args=_args(tmp_path, "collage-plus"), train_dataset=TokenBlocks(12))
    trainer.train()
    inner = find_strategy_optimizer(trainer.optimizer)
    assert [g["initial_lr"] for g in inner.param_groups] == [3e-4, 3e-3]
    finite([h["loss"] for h in trainer.state.log_history if "loss" in h])


@pytest.mark.parametrize("strategy", ["collage-plus", "fp16-als"])
def test_an_optimizer_assigned_after_construction_is_refused(tmp_path, strategy):
    trainer = Trainer(model=tiny_gpt2(), args=_args(tmp_path, strategy), train_dataset=TokenBlocks(12))
    trainer.optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match=r"an assignment to trainer\.optimizer after construction gave the Trainer"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_an_optimizer_assigned_after_construction_is_wrapped_under_bf16_mixed(tmp_path):
    trainer = Trainer(model=tiny_gpt2(), args=_args(tmp_path, "bf16-mixed"), train_dataset=TokenBlocks(12))
    trainer.optimizer = assigned = torch.optim.AdamW(trainer.model.parameters(), lr=1e-3)
    trainer.train()
    assert [type(o) for o in _chain(trainer.optimizer)[1:]] == [StrategyOptimizer, torch.optim.AdamW]
    assert _chain(trainer.optimizer)[2] is assigned


class _BuildsFirst(transformers.Trainer):
    def create_optimizer(self, model=None):
        self.optimizer = self.optimizer or torch.optim.SGD(self.model.parameters(), lr=1e-3)
        return self.optimizer


class BeforeTheMixin(_BuildsFirst, Trainer):
    """Its `create_optimizer` comes before the mixin's in the MRO, out of the mixin's reach."""


@pytest.mark.parametrize("strategy", ["bf16-mixed", "collage-plus"])
def test_an_optimizer_from_a_class_before_the_mixin_is_refused_at_train_begin(tmp_path, strategy):
    trainer = BeforeTheMixin(model=tiny_gpt2(), args=_args(tmp_path, strategy), train_dataset=TokenBlocks(12))
    with pytest.raises(ValueError, match=r"optimizer at train\(\) start, torch\.optim\.sgd\.SGD, is outside it"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_a_second_train_call_steps_the_overrides_strategy_optimizer(tmp_path):
    trainer = LayerWise(model=tiny_gpt2(), args=_args(tmp_path, "bf16-mixed", max_steps=2), train_dataset=TokenBlocks())
    trainer.train()
    first = find_strategy_optimizer(trainer.optimizer)
    trainer.train()  # the override returns Accelerate's wrapper of the first call: wrapped once again
    assert [o for o in _chain(trainer.optimizer) if isinstance(o, StrategyOptimizer)] == [first]
    assert {int(s["step"]) for s in first.state_dict()["state"].values()} == {4}
