"""Weights written behind the optimizer's back, through the strategies as users do it: a
`model.load_state_dict` before or after the optimizer exists (after a resume or the best model's
load too), weight clipping between steps, `.data` assignments (`vector_to_parameters`),
`resize_token_embeddings` after `prepare_model`. The strategy continues from the written weights
as FP32 AdamW does, exports them, and neither crashes nor mixes in the old weights' δθ or masters.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import TrainerCallback

from hf_lowprec import Trainer, get_strategy
from tests.helpers import VOCAB, TokenBlocks, assert_bits_equal, batches, make_args, tiny_gpt2, train_steps

COMPENSATED = ["collage-light", "collage-plus", "bf16-kahan"]
# Every family whose optimizer keeps more than the weight (a master, δθ, k, an FP8 master's scale)
# or steps 16-bit weights with FP32 states.
HOLDING = [
    "fp16-als",
    "collage-light",
    "collage-plus",
    "collage-8bit",
    "bf16-kahan",
    "bf16-fp32states",
    "fp8-lm-o2",
    "fp8-lm-o3",
    "coat",
]


def _exported(strategy, model, optimizer) -> dict[str, torch.Tensor]:
    return {k: v for k, v in strategy.full_precision_state_dict(model, optimizer).items() if v.is_floating_point()}


def _assert_holds(strategy, model, optimizer, weights: dict[str, torch.Tensor]) -> None:
    """θ is the written FP32 weights rounded once to its dtype (the load's own rounding, the
    nearest the model can hold: |θ − W| ≤ u·|W|), and the export is θ itself: FP32 AdamW would
    hold W, and no δθ or master of the old weights may add to it."""
    exported = _exported(strategy, model, optimizer)
    for key, value in model.state_dict().items():
        if value.is_floating_point():
            assert_bits_equal(value, weights[key].to(value.dtype), key)
            assert_bits_equal(exported[key], value.float(), f"exported {key}")


def _zero_lr_step(strategy, model, optimizer, ids: torch.Tensor) -> None:
    # lr = 0: FP32 AdamW's weights stay exactly where they were written.
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    strategy.train_step(model, ids, optimizer)


@pytest.mark.parametrize("name", ["fp16-als", *COMPENSATED])
def test_weights_loaded_mid_run_are_where_training_continues(name: str) -> None:
    # Before the fix, fp16-als wrote its old masters back at the next step (|θ − W| 0.134) and
    # exported them; Collage and Kahan kept the old δθ (a LayerNorm gain loaded as 1.0 held as 0.998).
    strategy = get_strategy(name, fused="reference")
    model = strategy.prepare_model(tiny_gpt2())
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    data = batches(3)
    train_steps(strategy, model, optimizer, data[:2])
    weights = tiny_gpt2(seed=5).state_dict()
    model.load_state_dict(weights)
    _assert_holds(strategy, model, optimizer, weights)
    assert float(_exported(strategy, model, optimizer)["transformer.ln_f.weight"].min()) == 1.0
    _zero_lr_step(strategy, model, optimizer, data[2])
    _assert_holds(strategy, model, optimizer, weights)


def test_fp16_als_keeps_weights_loaded_after_create_optimizer() -> None:
    # prepare_model → create_optimizer (the masters are seeded there) → load → the first step:
    # before the fix the random initialisation came back at step 1 (|θ − W| 0.133).
    strategy = get_strategy("fp16-als", fused="reference")
    model = strategy.prepare_model(tiny_gpt2())
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    weights = tiny_gpt2(seed=5).state_dict()
    model.load_state_dict(weights)
    _zero_lr_step(strategy, model, optimizer, batches(1)[0])
    _assert_holds(strategy, model, optimizer, weights)


@pytest.mark.parametrize("name", COMPENSATED)
def test_weights_loaded_before_create_optimizer_get_no_stale_residual(name: str) -> None:
    # prepare_model keeps the random init's residual r(w − r(w)); a load before create_optimizer
    # replaced w, so δθ starts at zero (before the fix the export was W + the old residual: 3.1e-4
    # from W, where the BF16 rounding of W is at most 2^-9·|W|).
    strategy = get_strategy(name, fused="reference")
    model = strategy.prepare_model(tiny_gpt2())
    weights = tiny_gpt2(seed=5).state_dict()
    model.load_state_dict(weights)
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    _assert_holds(strategy, model, optimizer, weights)


@pytest.mark.parametrize("name", ["fp16-als", "collage-plus"])
def test_weight_clipping_holds_in_what_the_optimizer_keeps(name: str) -> None:
    # p.clamp_(-c, c) after each step (WGAN clipping, max-norm constraints): the next step starts
    # from the clipped weights and the export is them. Before the fix fp16-als's masters reached
    # 1.0 (every step undid the clip) and Collage exported 0.05017 (the clip + δθ).
    strategy = get_strategy(name, fused="reference")
    model = strategy.prepare_model(tiny_gpt2())
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-2)
    bound = torch.tensor(0.05).to(next(model.parameters()).dtype).item()  # the clip as the dtype holds it
    for ids in batches(3):
        strategy.train_step(model, ids, optimizer)
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-0.05, 0.05)
        exported = _exported(strategy, model, optimizer)
        for key, value in model.state_dict().items():
            if value.is_floating_point():
                assert_bits_equal(exported[key], value.float(), key)
                assert float(exported[key].abs().max()) <= bound, key


@pytest.mark.parametrize("name", ["fp16-als", "collage-plus", "bf16-kahan"])
def test_resize_token_embeddings_after_prepare_model_trains(name: str) -> None:
    # transformers keeps the Parameter and swaps in a larger tensor: the residual kept for the old
    # shape is dropped (δθ 0, the master at the weight) where it crashed before the fix ("residual
    # shape (256, 64) != parameter shape (320, 64)", a size mismatch in fp16-als's master).
    strategy = get_strategy(name, fused="reference")
    model = strategy.prepare_model(tiny_gpt2())
    model.resize_token_embeddings(VOCAB + 64, mean_resizing=False)
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-2)
    inner = optimizer.optimizer
    embedding = model.transformer.wte.weight
    assert embedding.shape == (VOCAB + 64, 64) and model.lm_head.weight is embedding
    assert torch.equal(inner.held_value(embedding), embedding.double())  # nothing of the old shape
    block = model.transformer.h[0].attn.c_attn.weight  # not resized: keeps its seeded value
    assert not torch.equal(inner.held_value(block), block.double())
    before = embedding.detach().clone()
    ids = [torch.cat([b, torch.full((b.shape[0], 4), VOCAB + 10)], 1) for b in batches(2, seq=28)]
    losses = train_steps(strategy, model, optimizer, ids)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert bool((embedding.detach()[VOCAB + 10] != before[VOCAB + 10]).any())  # the new token's row trains


@pytest.mark.parametrize("name", ["fp16-als", "collage-plus"])
def test_fsdp2_shards_restart_only_when_written(name: str, one_rank_group, monkeypatch) -> None:
    # FSDP2 steps each DTensor's local shard: its version counter is the one watched. Training and
    # exports restart nothing (the seeded δθ or masters survive); an edit of the DTensors (weight
    # clipping) restarts every shard.
    from hf_lowprec.engines.fsdp2 import shard_model
    from hf_lowprec.optim.rules import Master, Rule

    restarts = []
    for rule in (Rule, Master):
        original = rule.restart_
        monkeypatch.setattr(
            rule, "restart_", lambda self, p, s, original=original: (restarts.append(p), original(self, p, s))
        )
    strategy = get_strategy(name)
    model = shard_model(strategy, tiny_gpt2())
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    train_steps(strategy, model, optimizer, batches(2))
    exported = _exported(strategy, model, optimizer)
    assert not restarts
    assert any(not torch.equal(exported[k], v.full_tensor().float()) for k, v in model.state_dict().items())
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.05, 0.05)
    exported = _exported(strategy, model, optimizer)
    assert len(restarts) == len(list(model.parameters()))
    for key, value in model.state_dict().items():
        if value.is_floating_point():
            assert_bits_equal(exported[key], value.full_tensor().float(), key)


def _real_weights(model) -> dict[str, torch.Tensor]:
    """The model's floating weights in real units (an FP8 master's payload over its scale), copied."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}


def _assert_continues_from(strategy, model, optimizer, written: dict[str, torch.Tensor]) -> None:
    """After a step at lr 0 (Δθ = ±0: FP32 AdamW keeps every bit of what was written), θ is still
    `written`, bit for bit, and the export is θ: no master or δθ of the weights before the write."""
    exported = _exported(strategy, model, optimizer)
    for key, value in model.state_dict().items():
        if value.is_floating_point():
            assert_bits_equal(value, written[key], key)
            assert_bits_equal(exported[key], value.float(), f"exported {key}")


def _halve_through_data(model, how: str) -> None:
    """Halve every trainable weight by a `.data` assignment, which keeps the version counter."""
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        if how == "p.data":
            for p in params:
                p.data = p.detach() * 0.5
            return
        for dtype in {p.dtype for p in params}:  # one flat vector per dtype, as weight-averaging code keeps
            alike = [p for p in params if p.dtype == dtype]
            torch.nn.utils.vector_to_parameters(torch.nn.utils.parameters_to_vector(alike) * 0.5, alike)


@pytest.mark.parametrize("how", ["vector_to_parameters", "p.data"])
@pytest.mark.parametrize("name", HOLDING)
def test_weights_assigned_through_data_are_where_training_continues(name: str, how: str) -> None:
    # `p.data = x` keeps the parameter's version counter: before the fix the next step wrote
    # fp16-als's old masters back (|θ − written| 0.50) and Collage/Kahan folded the old δθ in (3.9e-3).
    strategy = get_strategy(name, fused="reference")
    model = strategy.prepare_model(tiny_gpt2())
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    data = batches(3)
    train_steps(strategy, model, optimizer, data[:2])
    _halve_through_data(model, how)
    written = _real_weights(model)
    _zero_lr_step(strategy, model, optimizer, data[2])
    _assert_continues_from(strategy, model, optimizer, written)


def _zero_lr(optimizer) -> None:
    # `initial_lr` too: the schedule a later train() builds starts from it.
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] = 0.0


class _EarliestIsBest(TrainerCallback):
    """The metric `earliest` makes the first evaluation the best: the best model is not the last one."""

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metrics["eval_earliest"] = -float(state.global_step)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp16-als", "collage-plus", "bf16-kahan"])
def test_weights_loaded_after_the_best_model_are_where_training_continues(name: str, tmp_path) -> None:
    # load_best_model_at_end loads the best checkpoint's optimizer state; a load before the next
    # train() was then not seen: fp16-als went back to the best checkpoint (|θ − W| 0.138), Collage
    # and Kahan added its δθ (a LayerNorm gain loaded as 1.0 held as 0.996).
    every_2 = {"save_strategy": "steps", "save_steps": 2, "eval_strategy": "steps", "eval_steps": 2}
    best = {"load_best_model_at_end": True, "metric_for_best_model": "earliest", "greater_is_better": True}
    args = make_args(tmp_path, name, max_steps=4, precision_options={"fused": "reference"}, **every_2, **best)
    data, evaluated = TokenBlocks(16), TokenBlocks(8, seed=3)
    trainer = Trainer(
        model=tiny_gpt2(), args=args, train_dataset=data, eval_dataset=evaluated, callbacks=[_EarliestIsBest()]
    )
    trainer.train()
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-2")
    trainer.model.load_state_dict(tiny_gpt2(seed=5).state_dict())
    written = _real_weights(trainer.model)
    _zero_lr(trainer.optimizer)
    trainer.args.max_steps, trainer.args.load_best_model_at_end = 5, False
    trainer.args.eval_strategy = trainer.args.save_strategy = "no"
    trainer.train()
    assert trainer.state.global_step == 5
    _assert_continues_from(trainer.precision, trainer.model, trainer.optimizer, written)


class _LoadsAtTrainBegin(TrainerCallback):
    """Loads other weights and puts every group at lr 0 in `on_train_begin` (after a resume's loads)."""

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        model.load_state_dict(tiny_gpt2(seed=5).state_dict())
        self.written = _real_weights(model)
        _zero_lr(optimizer)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp16-als", "collage-plus"])
def test_weights_loaded_at_train_begin_of_a_resume_are_where_training_continues(name: str, tmp_path) -> None:
    # Before the fix the checkpoint's masters came back at the first step (fp16-als: |θ − W| 0.138).
    make = functools.partial(
        make_args, tmp_path, name, lr_scheduler_type="constant", precision_options={"fused": "reference"}
    )
    Trainer(model=tiny_gpt2(), args=make(max_steps=2, save_steps=2), train_dataset=TokenBlocks(16)).train()
    writer = _LoadsAtTrainBegin()
    trainer = Trainer(
        model=tiny_gpt2(), args=make(max_steps=3, save_strategy="no"), train_dataset=TokenBlocks(16), callbacks=[writer]
    )
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert trainer.state.global_step == 3
    _assert_continues_from(trainer.precision, trainer.model, trainer.optimizer, writer.written)


@pytest.mark.parametrize("name", ["fp16-als", "collage-plus"])
def test_weights_loaded_at_train_begin_of_a_fresh_run_are_where_training_continues(name: str, tmp_path) -> None:
    # Accelerate loads the optimizer's state_dict() back as it wraps it, which forgot the versions
    # recorded when create_optimizer seeded the masters/δθ: the prepared model's masters came back.
    writer = _LoadsAtTrainBegin()
    args = make_args(tmp_path, name, max_steps=1, save_strategy="no", precision_options={"fused": "reference"})
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenBlocks(4), callbacks=[writer])
    trainer.train()
    assert trainer.state.global_step == 1
    _assert_continues_from(trainer.precision, trainer.model, trainer.optimizer, writer.written)
