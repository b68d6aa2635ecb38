"""Weights written behind the optimizer's back, through the strategies as users do it: a
`model.load_state_dict` before or after the optimizer exists, weight clipping between steps,
`resize_token_embeddings` after `prepare_model`. The strategy continues from the written weights
as FP32 AdamW does, exports them, and neither crashes nor mixes in the old weights' δθ or masters.
"""

from __future__ import annotations

import pytest
import torch

from hf_lowprec import get_strategy
from tests.helpers import VOCAB, assert_bits_equal, batches, tiny_gpt2, train_steps

COMPENSATED = ["collage-light", "collage-plus", "bf16-kahan"]


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
