"""The contract every registered strategy keeps (STYLE.md, Tests)."""

import io
import math

import pytest
import torch

import hf_lowprec
from hf_lowprec.memory import model_state_bytes
from tests.helpers import assert_bits_equal, batches, rounding_bound, tiny_gpt2, train_steps

STRATEGIES = hf_lowprec.available_strategies()


def setup(name, seed=0):
    strategy = hf_lowprec.get_strategy(name)
    model = strategy.prepare_model(tiny_gpt2(seed))
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3, weight_decay=0.01)
    return strategy, model, optimizer


def test_baselines_are_registered():
    assert {"fp32", "bf16-mixed", "bf16-pure"} <= set(STRATEGIES)


@pytest.mark.parametrize("name", STRATEGIES)
def test_param_dtype_and_state_dtypes(name):
    strategy, model, optimizer = setup(name)
    train_steps(strategy, model, optimizer, batches(1))
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    promised = set(strategy.promised_param_dtypes())
    assert dtypes == promised, f"{name}: trainable params are {dtypes}, promised {promised}"
    assert len(optimizer.state) > 0


@pytest.mark.parametrize("name", STRATEGIES)
def test_state_dict_round_trip_continues_bit_for_bit(name):
    data = batches(6)
    strategy, model, optimizer = setup(name)
    train_steps(strategy, model, optimizer, data[:3])

    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    strategy2, model2, optimizer2 = setup(name, seed=123)  # a different init, overwritten by the load
    model2.load_state_dict(saved["model"])
    optimizer2.load_state_dict(saved["optimizer"])
    for (_p1, s1), (_p2, s2) in zip(optimizer.state.items(), optimizer2.state.items()):
        for key in s1:
            if torch.is_tensor(s1[key]):
                assert s2[key].dtype == s1[key].dtype, f"{name}: state {key!r} came back as {s2[key].dtype}"

    losses1 = train_steps(strategy, model, optimizer, data[3:])
    losses2 = train_steps(strategy2, model2, optimizer2, data[3:])
    assert losses1 == losses2
    for (n, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert_bits_equal(a, b, f"{name}: {n} after resume")


@pytest.mark.parametrize("name", STRATEGIES)
def test_loss_goes_down(name):
    strategy, model, optimizer = setup(name)
    for group in optimizer.param_groups:
        group["lr"] = 3e-3
    data = batches(1) * 30
    losses = train_steps(strategy, model, optimizer, data)
    # Memorising one batch of random tokens: from ln(256) ≈ 5.5 any working update drops it well below.
    assert losses[-1] < losses[0] - 1.0, f"{name}: {losses[0]:.3f} -> {losses[-1]:.3f}"


@pytest.mark.parametrize("name", STRATEGIES)
def test_model_state_bytes_matches_documentation(name):
    strategy, model, optimizer = setup(name)
    ids = batches(1)[0]
    with strategy.forward_context():
        loss = model(input_ids=ids, labels=ids).loss
    strategy.scale_loss(loss).backward()
    optimizer.step()
    measured = model_state_bytes(model, optimizer)
    documented = strategy.bytes_per_param
    assert measured["total"] == pytest.approx(documented, abs=0.1), measured


@pytest.mark.parametrize("name", STRATEGIES)
def test_nonfinite_gradients_never_reach_the_weights(name):
    strategy, model, optimizer = setup(name)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = batches(1)[0]
    with strategy.forward_context():
        loss = model(input_ids=ids, labels=ids).loss * float("nan")
    strategy.scale_loss(loss).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    assert optimizer.step_was_skipped
    assert strategy.metrics()["precision/skipped_steps"] == 1.0
    for n, p in model.named_parameters():
        assert_bits_equal(p.detach(), before[n], f"{name}: {n} on a NaN step")
    # The next finite step goes through.
    train_steps(strategy, model, optimizer, batches(1))
    assert not optimizer.step_was_skipped


@pytest.mark.parametrize("name", STRATEGIES)
def test_clip_grad_norm_returns_the_total_norm_like_torch(name):
    strategy, model, optimizer = setup(name)
    ids = batches(1)[0]
    with strategy.forward_context():
        loss = model(input_ids=ids, labels=ids).loss
    strategy.scale_loss(loss).backward()
    strategy.unscale_gradients(optimizer)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params if p.grad is not None]
    # torch's norm: each tensor's sum of squares (one rounding per square, then a cascade
    # summation whose error grows with log2 of the count, not the count), its square root, then
    # the same over the tensors' norms. A sum of non-negative terms over a tree of depth d is
    # within γ_{d+1} (Higham, with the square's rounding); the square root halves the relative
    # error and adds one rounding. Both levels add up.
    dtype = max((g.dtype for g in grads), key=lambda d: torch.finfo(d).eps)
    depth = math.ceil(math.log2(max(g.numel() for g in grads))) + math.ceil(math.log2(len(grads)))
    rel = rounding_bound(dtype, math.ceil((depth + 2) / 2) + 2)
    norm = strategy.clip_grad_norm(params, float("inf"))
    assert torch.is_tensor(norm) and norm.numel() == 1 and torch.isfinite(norm), f"{name}: {norm!r}"
    if len(grads) == len(params):  # every gradient in p.grad (not FP8-LM O2's stored FP8 ones)
        reference = torch.cat([g.double().flatten() for g in grads]).norm().item()
        assert abs(norm.item() - reference) <= rel * reference, f"{name}: {norm.item()} vs FP64 {reference}"
    # Clipping to a quarter of the norm returns the pre-clip norm and leaves a quarter of it
    # (the coefficient max_norm / (norm + 1e-6), one more rounding of every gradient).
    assert abs(strategy.clip_grad_norm(params, norm.item() / 4).item() - norm.item()) <= rel * norm.item()
    expected = norm.item() / 4 * norm.item() / (norm.item() + 1e-6)
    after = strategy.clip_grad_norm(params, float("inf")).item()
    assert abs(after - expected) <= 2 * rel * expected, f"{name}: {after} after clipping to 1/4, not {expected}"


@pytest.mark.parametrize("name", hf_lowprec.available_strategies())
def test_engine_support_is_one_frozen_declaration(name):
    # Every engine reads one declaration per strategy (with its options applied); it cannot be
    # changed after the class is defined, and each refused engine says why.
    import dataclasses

    from hf_lowprec.strategies.support import EngineSupport

    support = hf_lowprec.get_strategy(name).engine_support()
    assert isinstance(support, EngineSupport)
    with pytest.raises(dataclasses.FrozenInstanceError):
        support.ddp = not support.ddp
    assert support.ddp_note if support.ddp else support.ddp_refusal
    assert support.fsdp2_note if support.fsdp2 else support.fsdp2_refusal
    assert set(support.zero_stages) <= {0, 1, 2, 3}


@pytest.mark.parametrize(
    ("plain", "changed", "field"),
    [
        (("collage-plus", {}), ("collage-8bit", {}), "zero_stages"),
        (("fp16-als", {}), ("fp16-als", {"weights": "sr"}), "fsdp2"),
        (("fp8-lm-o1", {}), ("fp8-lm-o2", {"recipe": "rowwise"}), "fsdp2_note"),
    ],
)
def test_engine_support_follows_the_options_that_change_it(plain, changed, field):
    # collage-8bit: ZeRO 1/2 only; fp16-als weights="sr": no FSDP2; O2 and finer recipes: a longer note.
    before = getattr(hf_lowprec.get_strategy(plain[0], **plain[1]).engine_support(), field)
    after = getattr(hf_lowprec.get_strategy(changed[0], **changed[1]).engine_support(), field)
    assert before != after


@pytest.mark.parametrize(
    ("declared", "missing"),
    [
        ({"ddp": False}, "ddp_refusal"),
        ({"fsdp2": True}, "fsdp2_note"),
        ({"zero_stages": (1,)}, "zero_note"),
        ({"zero_stages": (4,)}, "stages are"),
        ({"fsdp2_gathers_fp8": True}, "fsdp2 must be True"),
    ],
)
def test_an_engine_support_declaration_that_cannot_be_printed_fails_at_once(declared, missing):
    from hf_lowprec.strategies.support import EngineSupport

    with pytest.raises(ValueError, match=missing):
        EngineSupport(**declared)
