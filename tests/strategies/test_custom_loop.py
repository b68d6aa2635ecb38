"""A custom loop's habits with a strategy's pieces (`prepare_model`, `create_optimizer`, `train_step`):
clipping over what the optimizer trains, parameters unfrozen mid-run under fp16-als's running mean,
torch's optimizer hooks, a cast after `prepare_model`, and saving the whole model object."""

import io

import pytest
import torch
from transformers import GPT2LMHeadModel

import hf_lowprec
from hf_lowprec.data import tiny_gpt2_config
from hf_lowprec.report import PrecisionPromiseError
from tests.helpers import assert_bits_equal, batches, split_like_before


def tiny(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(
        tiny_gpt2_config(n_embd=64, n_layer=2, pad_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    )


def trained(name: str, steps: int = 3, max_grad_norm: float | None = None, norms: list | None = None):
    strategy = hf_lowprec.get_strategy(name)
    model = strategy.prepare_model(tiny())
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    if norms is not None:  # the gradients' norm as the step takes them, after train_step's clipping
        grads = lambda: [p.grad for p in model.parameters() if p.grad is not None]  # noqa: E731
        optimizer.register_step_pre_hook(lambda *_: norms.append(float(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in grads()])))))  # fmt: skip
    for ids in batches(steps):
        strategy.train_step(model, ids, optimizer, max_grad_norm=max_grad_norm)
    return strategy.full_precision_state_dict(model, optimizer)


def test_o3_clips_its_fp8_weights():
    """fp8-lm-o3 keeps its FP8 weights out of `param_groups` (its own ZeRO partitions): `train_step`'s
    clipping must still cover them (their gradients, FP32 `p.grad` on one process, went to the step
    unclipped: a norm of 1.89 clipped where the gradients' was 2.36). After clipping to C the
    gradients the step takes have a norm of at most C, up to the rounding of the clipped values in
    their dtype: FP16 for the FP8 weights' scaled masters, half an ulp = 2⁻¹¹ relative per element,
    so of the norm too. Unclipped, O3 on one process trains as O2, bit for bit."""
    norms: list[float] = []
    trained("fp8-lm-o3", max_grad_norm=0.05, norms=norms)
    assert len(norms) == 3 and max(norms) <= 0.05 * (1 + 2**-11), norms
    o2, o3 = trained("fp8-lm-o2"), trained("fp8-lm-o3")
    for key in o2:
        assert_bits_equal(o3[key], o2[key], key)


def test_a_parameter_unfrozen_after_prepare_takes_the_running_mean():
    """fp16-als averages micro-batches with hooks (the loss is not divided); a parameter frozen at
    `prepare_model` has none. Unfrozen later, its accumulated gradient must be the mean too (it
    was the sum: 4.000× over 4 micro-batches). Bound, against the always-trainable run's mean:
    the hooks' running mean rounds 3 times per micro-batch and the sum k−1 times plus one
    division, each within half an FP16 ulp of the largest micro-batch gradient: (3k + k)·2⁻¹¹·max|g|."""
    micro = 4
    grads, seen = {}, []
    for frozen_at_prepare in (False, True):
        strategy = hf_lowprec.get_strategy("fp16-als")
        model = tiny()
        block = model.transformer.h[0]
        block.requires_grad_(not frozen_at_prepare)
        model = strategy.prepare_model(model)
        optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
        block.requires_grad_(True)
        weight = block.mlp.c_fc.weight
        if frozen_at_prepare:  # each micro-batch's gradient, as backward hands it (scaled, FP16)
            weight.register_hook(lambda g, s=strategy: seen.append(g.double() / s.scaler.get_scale()))
        for ids in batches(micro):
            with strategy.forward_context():
                loss = model(input_ids=ids, labels=ids).loss
            strategy.scale_loss(loss).backward()
        strategy.unscale_gradients(optimizer)
        grads[frozen_at_prepare] = weight.grad.double()
    assert len(seen) == micro
    largest = torch.stack(seen).abs().amax(dim=0)
    error = (grads[True] - grads[False]).abs()
    assert (error <= 4 * micro * 2.0**-11 * largest).all(), (error / largest).max()
    assert grads[True].norm() / grads[False].norm() == pytest.approx(1.0, abs=0.01)


def test_torch_optimizer_hooks_run_on_the_strategy_optimizer():
    """`register_step_pre_hook` and friends raised TypeError (plain dicts) and never ran."""
    strategy = hf_lowprec.get_strategy("collage-plus")
    model = strategy.prepare_model(tiny())
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    calls = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append(("pre", opt is optimizer)))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append(("post", opt is optimizer)))
    optimizer.register_state_dict_pre_hook(lambda opt: calls.append(("sd_pre", True)))
    optimizer.register_state_dict_post_hook(lambda opt, sd: {**sd, "mine": 7})
    optimizer.register_load_state_dict_pre_hook(lambda opt, sd: {k: v for k, v in sd.items() if k != "mine"})
    optimizer.register_load_state_dict_post_hook(lambda opt: calls.append(("load_post", True)))
    strategy.train_step(model, batches(1)[0], optimizer)
    assert calls == [("pre", True), ("post", True)]
    state = optimizer.state_dict()
    assert state["mine"] == 7 and "hf_lowprec" in state
    optimizer.load_state_dict(state)  # the load pre-hook drops the key the inner optimizer does not know
    assert calls[2:] == [("sd_pre", True), ("load_post", True)]


@pytest.mark.parametrize("name, cast", [("fp32", torch.bfloat16), ("collage-plus", torch.float16)])
def test_a_cast_after_prepare_model_is_refused_before_the_first_step(name, cast):
    """What the Trainer and the Accelerate plugin refuse at startup (`check_promises`) a custom
    loop's `train_step` refuses too: it trained silently in the cast dtype."""
    strategy = hf_lowprec.get_strategy(name)
    model = strategy.prepare_model(tiny())
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    model.to(cast)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PrecisionPromiseError, match="cast after it"):
        strategy.train_step(model, batches(1)[0], optimizer)
    for p, q in zip(model.parameters(), before, strict=True):
        assert_bits_equal(p.detach(), q, "a refused step changed a weight")


@pytest.mark.parametrize("name", ["coat", "fp16-als"])
def test_the_whole_prepared_model_saves_with_torch_save(name):
    """`torch.save(model)`: COAT's instance forwards and fp16-als's activation hooks were bound
    methods and closures, which do not pickle."""
    strategy = hf_lowprec.get_strategy(name)
    model = strategy.prepare_model(tiny())
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    ids = batches(1)[0]
    strategy.train_step(model, ids, optimizer)
    model.eval()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad(), strategy.forward_context():
        assert_bits_equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits, "logits after torch.load")


def _o2_run(build=None, state=None, steps=(0, 4)):
    strategy = hf_lowprec.get_strategy("fp8-lm-o2")
    if build is not None:
        strategy.build_optimizer = build.__get__(strategy)
    model = strategy.prepare_model(tiny())
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if p.dim() <= 1]
    optimizer = strategy.create_optimizer([{"params": rest, "weight_decay": 0.0}, {"params": decay}], weight_decay=0.1)
    if state is not None:
        optimizer.load_state_dict(state[1])
        model.load_state_dict(state[0])
    for ids in batches(steps[1])[steps[0] :]:
        strategy.train_step(model, ids, optimizer)
    return strategy, model, optimizer


def test_fp8_lm_keeps_the_users_groups_and_trains_as_before():
    """O2 split each group in two (FP8 GEMM weights; the rest with FP32 states): `LambdaLR` with one
    lambda per group and `param_groups[i]` saw other groups than the user's. The groups are kept
    now and the formats chosen per parameter: the same steps, bit for bit, and a state saved in
    the split layout resumes and continues bit for bit."""
    _, model, optimizer = _o2_run()
    assert len(optimizer.param_groups) == 2
    torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda s: 1.0, lambda s: 0.5])
    _, old_model, old_optimizer = _o2_run(split_like_before)
    assert len(old_optimizer.param_groups) == 3  # the no-decay group holds no FP8 weight
    for (name, p), q in zip(model.state_dict().items(), old_model.state_dict().values(), strict=True):
        assert_bits_equal(p, q, name)
    # Saved after 2 steps in the old layout, resumed in the new one: 2 more steps equal the old 4.
    _, half_model, half_optimizer = _o2_run(split_like_before, steps=(0, 2))
    saved = ({k: v.clone() for k, v in half_model.state_dict().items()}, half_optimizer.state_dict())
    _, resumed, resumed_optimizer = _o2_run(state=saved, steps=(2, 4))
    assert len(resumed_optimizer.param_groups) == 2
    for (name, p), q in zip(resumed.state_dict().items(), old_model.state_dict().values(), strict=True):
        assert_bits_equal(p, q, f"resumed {name}")


@pytest.mark.parametrize("name", ["fp8-lm-o2", "fp8-lm-o3"])
def test_a_group_added_later_keeps_fp32_states_for_what_is_not_an_fp8_weight(name):
    """`add_param_group` (unfreezing norms mid-run) took the FP8 weights' formats for every
    parameter: E4M3 m and FP16 v on LayerNorm gains (9e-3 from FP64 where FP32 states give 3e-6)."""
    strategy = hf_lowprec.get_strategy(name)
    model = strategy.prepare_model(tiny())
    norms = [p for n, p in model.named_parameters() if ".ln_" in n]
    optimizer = strategy.create_optimizer([p for n, p in model.named_parameters() if ".ln_" not in n], lr=1e-3)
    optimizer.add_param_group({"params": norms})
    strategy.train_step(model, batches(1)[0], optimizer)
    for p in norms:
        state = optimizer.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32


def test_clipping_leaves_out_what_the_optimizer_does_not_train():
    """fp16-mixed unscales the optimizer's gradients only: a trainable parameter outside the
    optimizer keeps a 2^16-scaled gradient, which `train_step`'s clipping must not count (a first
    version did: norm 102,511, the trained gradients clipped to 1.7e-7). The trained norm here is
    below the bound: the step takes the gradients unclipped, bit for bit."""
    seen = {}
    for clip in (None, 1.0):
        strategy = hf_lowprec.get_strategy("fp16-mixed")
        model = strategy.prepare_model(tiny())
        optimizer = strategy.create_optimizer(model.transformer.ln_f.parameters(), lr=1e-3)

        def unscaled(opt, *_, c=clip, m=model, st=strategy):  # the gradients as the update takes them
            st.unscale_gradients(opt.optimizer)  # (once a step: the step's own call does nothing)
            seen[c] = m.transformer.ln_f.weight.grad.clone()

        optimizer.register_step_pre_hook(unscaled)
        strategy.train_step(model, batches(1)[0], optimizer, max_grad_norm=clip)
    assert seen[None].norm() < 1.0
    assert_bits_equal(seen[1.0], seen[None], "the clipped step's gradient")


@pytest.mark.parametrize("name", ["fp8-lm-o1", "fp8-lm-o2"])
def test_train_step_refuses_a_model_fp8_converts_nothing_as_the_trainer_does(name):
    """Widths FP8 does not take (40: no GEMM dimension a multiple of 16): every layer stays BF16.
    The Trainer refuses that run (`check_promises`); the custom loop did not and trained plain BF16
    autocast under the FP8 name. Now its first `train_step` raises the same error before any step:
    the weights are untouched. A model FP8 does convert trains through the same call."""
    torch.manual_seed(0)
    strategy = hf_lowprec.get_strategy(name)
    model = strategy.prepare_model(GPT2LMHeadModel(tiny_gpt2_config(n_embd=40, n_layer=1, n_head=2, pad_token_id=None)))
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    refusal = f"{name!r} computes linear layers in FP8, but the model has no FP8 layer"
    with pytest.raises(PrecisionPromiseError, match=refusal):
        strategy.train_step(model, batches(1)[0], optimizer)
    for k, v in model.state_dict().items():
        assert_bits_equal(v, before[k], k)
    converted = hf_lowprec.get_strategy(name)
    model = converted.prepare_model(tiny())
    optimizer = converted.create_optimizer(model.parameters(), lr=1e-3)
    assert torch.isfinite(converted.train_step(model, batches(1)[0], optimizer))


def test_a_sharded_state_without_the_strategys_entry_loads_with_a_warning(one_rank_group, caplog):
    """torch's FSDP2 optimizer state dict (what Accelerate saves) keeps state and groups only: it
    loads, the strategy's own state starting afresh, where an unsharded stock state is refused."""
    import logging

    from hf_lowprec.engines.fsdp2 import shard_model

    strategy = hf_lowprec.get_strategy("collage-plus")
    model = shard_model(strategy, tiny())
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    strategy.train_step(model, batches(1)[0], optimizer)
    state = optimizer.state_dict()
    state.pop("hf_lowprec")
    with caplog.at_level(logging.WARNING):
        optimizer.load_state_dict(state)
    assert "this FSDP2 optimizer state has no 'hf_lowprec' entry" in caplog.text


def test_a_sharded_state_saved_with_split_fp8_groups_is_refused(one_rank_group, tmp_path):
    """A torch.distributed.checkpoint save of O2's old split layout numbers its states FP8 weights
    first: loaded by index into the kept groups it raised a size mismatch, or loaded the wrong
    parameter's moments where shapes agree. Refused, nothing loaded."""
    from hf_lowprec.engines.fsdp2 import load_sharded, save_sharded, shard_model

    runs = []
    for build in (split_like_before, None):
        strategy = hf_lowprec.get_strategy("fp8-lm-o2")
        if build is not None:
            strategy.build_optimizer = build.__get__(strategy)
        model = shard_model(strategy, tiny())
        decay = [p for p in model.parameters() if p.dim() > 1]
        rest = [p for p in model.parameters() if p.dim() <= 1]
        optimizer = strategy.create_optimizer([{"params": rest, "weight_decay": 0.0}, {"params": decay}])
        strategy.train_step(model, batches(1)[0], optimizer)
        runs.append((model, optimizer))
    save_sharded(tmp_path / "old", *runs[0])
    with pytest.raises(ValueError, match="split each group in two, and its states are numbered in that order"):
        load_sharded(tmp_path / "old", *runs[1])
