"""Every strategy on the five Mixture-of-Experts architectures (hf_lowprec.testing.moe): each
trains; the FP8 strategies run the expert GEMMs in FP8 (the startup report's share) and keep the
routers in high precision; O2's expert weights are scaled FP16 masters with FP8AdamW's E4M3
first moments, which brings model-state memory under 0.45x bf16-mixed's where the experts hold
most parameters (a tiny MoE measured, Qwen3-30B-A3B planned); the router's auxiliary loss is the
FP32 model's, bit for bit; the Trainer resumes an O2 MoE run bit for bit; and a compiled O1 MoE
step is one graph, built once, whatever the routing.

The models are tiny (hidden 64, 8 experts of width 32, top-2, 2 layers, vocabulary 256): every
expert GEMM is a multiple of 16, so the FP8 strategies convert every experts module.
"""

import contextlib
import functools
import itertools
import logging
import math

import pytest
import torch

from hf_lowprec import Trainer
from hf_lowprec.fp8 import FP8Linear
from hf_lowprec.fp8.experts import FP8Experts, expert_weight_names, is_experts_module
from hf_lowprec.fp8.scaled import get_master_scale
from hf_lowprec.memory import model_state_bytes, unwrap_optimizer
from hf_lowprec.optim.fp8_adamw import FP8AdamW
from hf_lowprec.report import describe, format_report
from hf_lowprec.strategies.registry import available_strategies, get_strategy
from hf_lowprec.testing.counted_step import strategy_step
from hf_lowprec.testing.graphs import compiled_run
from hf_lowprec.testing.moe import MOE_ARCHITECTURES, tiny_moe
from tests import helpers
from tests.helpers import VOCAB, TokenBlocks, assert_bits_equal, bits_equal, finite, logged_losses

STRATEGIES = available_strategies()
FP8_STRATEGIES = ("fp8-lm-o1", "fp8-lm-o2", "fp8-lm-o3", "coat")
# Architectures whose causal LM returns the load-balancing loss (DeepSeek-V3 balances with a
# routing bias instead and returns no aux_loss).
AUX_LOSS_ARCHITECTURES = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss")


@pytest.fixture(autouse=True)
def _quiet_fp8_skips():
    # The LM head is skipped on purpose by every FP8 strategy; its warning per test is noise.
    logger = logging.getLogger("hf_lowprec.fp8")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def token_ids(batch: int = 2, seq: int = 16, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


def prepared(name: str, arch: str, **sizes):
    strategy = get_strategy(name)
    model = strategy.prepare_model(tiny_moe(arch, **sizes))
    optimizer = strategy.create_optimizer(model.parameters(), lr=3e-3)
    return strategy, model, optimizer


def moe_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, torch.nn.Module]]:
    """(block name, experts module, router) of every MoE block: the router is the block's
    `gate` (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3) or `router` (gpt-oss)."""
    blocks = []
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if experts is not None and is_experts_module(experts):
            router = getattr(module, "gate", None) or getattr(module, "router", None)
            assert router is not None, f"{name}: no router found"
            blocks.append((name, experts, router))
    return blocks


# --- 1. every strategy trains every architecture -------------------------------------------


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
@pytest.mark.parametrize("name", STRATEGIES)
def test_every_strategy_trains_every_moe_architecture(name, arch):
    torch.manual_seed(0)  # stochastic rounding draws from the global generator
    strategy, model, optimizer = prepared(name, arch)
    experts_before = {
        f"{block}.{w}": getattr(experts, w).detach().clone()
        for block, experts, _ in moe_blocks(model)
        for w in expert_weight_names(experts)
    }
    assert experts_before, f"{arch}: no experts module"
    ids = token_ids()
    losses = []
    for _ in range(6):
        with strategy.forward_context():
            loss = model(input_ids=ids, labels=ids).loss
        losses.append(loss.item())
        strategy.scale_loss(loss).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    finite(losses)
    # Measured from about 5.5: 3.8-3.96 after 5 updates for every strategy, each step lower.
    assert all(b < a for a, b in itertools.pairwise(losses)), f"{name} on {arch}: {losses}"
    assert losses[-1] < losses[0] - 1.0, f"{name} on {arch}: {losses}"
    after = {
        f"{block}.{w}": getattr(experts, w)
        for block, experts, _ in moe_blocks(model)
        for w in expert_weight_names(experts)
    }
    for key, before in experts_before.items():
        assert not bits_equal(before, after[key].detach()), f"{name} on {arch}: {key} never updated"


# --- 2. the startup report: FP8 share, experts listed, routers in high precision -----------


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_report_fp8_share_experts_and_routers(arch):
    reference = tiny_moe(arch)
    reference_routers = {block: router for block, _, router in moe_blocks(reference)}
    expected_experts = sorted(f"{block}.experts" for block in reference_routers)
    for name in STRATEGIES:
        strategy, model, optimizer = prepared(name, arch)
        report = describe(strategy, model, optimizer)
        fp8 = report["fp8"]
        assert report["violations"] == [], (name, report["violations"])
        assert fp8["experts_gemm_share"] > 0.15, (name, arch, fp8)  # the experts are counted
        if name in FP8_STRATEGIES:
            assert fp8["weight_gemm_share"] >= 0.95, (name, arch, fp8)
            assert sorted(fp8["experts"]) == expected_experts, (name, arch, fp8["experts"])
            assert not any(".experts" in s for s in fp8["skipped"]), (name, arch, fp8["skipped"])
            text = format_report(report)
            assert f"MoE: {len(expected_experts)} experts modules with FP8 grouped GEMMs" in text, text
        else:
            assert fp8["weight_gemm_share"] == 0, (name, arch, fp8)
            assert fp8["experts"] == [], (name, arch, fp8)
            assert not any(isinstance(m, (FP8Linear, FP8Experts)) for m in model.modules()), name
        blocks = moe_blocks(model)
        assert sorted(f"{b}.experts" for b, _, _ in blocks) == expected_experts
        for block, experts, router in blocks:
            assert isinstance(experts, FP8Experts) == (name in FP8_STRATEGIES), (name, block)
            # The router: its own class, no FP8 module inside, and under the FP8 strategies
            # its FP32 weights exactly as built (no master scale, no cast).
            original = reference_routers[block]
            assert type(router) is type(original), (name, block, type(router))
            assert not any(isinstance(m, (FP8Linear, FP8Experts)) for m in router.modules()), (name, block)
            if name in FP8_STRATEGIES:
                for (pname, p), q in zip(router.named_parameters(), original.parameters()):
                    assert p.dtype == torch.float32, (name, block, pname, p.dtype)
                    assert get_master_scale(p) is None, (name, block, pname)
                    assert_bits_equal(p.detach(), q.detach(), f"{name} {block}.{pname}")


# --- 3. O2: scaled FP16 expert masters, E4M3 moments, model-state memory --------------------


def _one_step(strategy, model, optimizer) -> None:
    strategy_step(strategy, model, optimizer, token_ids())


def test_o2_expert_weights_are_scaled_fp16_masters_with_e4m3_first_moments():
    strategy, model, optimizer = prepared("fp8-lm-o2", "qwen3_moe")
    _one_step(strategy, model, optimizer)
    inner = unwrap_optimizer(optimizer)
    assert isinstance(inner, FP8AdamW), type(inner)
    blocks = moe_blocks(model)
    assert len(blocks) == 2
    for block, experts, router in blocks:
        for w in expert_weight_names(experts):
            p = getattr(experts, w)
            assert p.dtype == torch.float16, (block, w, p.dtype)
            scale = get_master_scale(p)
            assert scale is not None, (block, w)
            assert scale is getattr(experts, w + "_master_scale"), (block, w)
            state = inner.state[p]
            assert state["exp_avg"].dtype == torch.float8_e4m3fn, (block, w, state["exp_avg"].dtype)
            assert state["exp_avg"].shape == p.shape
            assert state["exp_avg_sq"].dtype == torch.float16, (block, w)
            assert p.grad is None, f"{block}.{w}: O2 keeps FP8 gradients in the optimizer, not p.grad"
        for p in router.parameters():
            assert p.dtype == torch.float32 and get_master_scale(p) is None
            assert inner.state[p]["exp_avg"].dtype == torch.float32


def _high_lr_run(name: str, seed: int, steps: int = 8) -> tuple[list[float], list[float]]:
    """(losses, pre-clip gradient norms) of issue #67's run: Mixtral from config (2 layers, hidden
    64, 8 experts, top-2), `steps` steps of batch 8 drawn from 8 sequences of 32 tokens, AdamW at
    lr 1e-2 constant, no weight decay."""
    strategy = get_strategy(name)
    model = strategy.prepare_model(tiny_moe("mixtral", seed=0, hidden=64, experts=8, top_k=2, layers=2))
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-2, weight_decay=0.0)
    sequences = torch.randint(0, VOCAB, (8, 32), generator=torch.Generator().manual_seed(seed))
    draws = torch.Generator().manual_seed(seed + 100)
    losses, norms = [], []
    for _ in range(steps):
        ids = sequences[torch.randint(0, 8, (8,), generator=draws)]
        with strategy.forward_context():
            loss = model(input_ids=ids, labels=ids).loss
        strategy.scale_loss(loss).backward()
        strategy.unscale_gradients(unwrap_optimizer(optimizer))
        norm = strategy.clip_grad_norm([p for g in optimizer.param_groups for p in g["params"]], float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        norms.append(float(norm))
    return losses, norms


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_o2_trains_mixtral_at_a_high_learning_rate_as_bf16_mixed_does(seed):
    """Issue #67: fp8-lm-o2 once spiked at step 8 of this run (loss 3.97 → 5.70, gradient norm 20.5)
    where bf16-mixed moved 4.03 → 4.35. Same weights and batches under both: at every step o2's
    loss is within 15% of bf16-mixed's and its gradient norm at most twice bf16-mixed's largest.
    Today's runs differ by at most 4% in loss (o2 above) and 1.5× in norm (3 seeds, 8 and 16
    steps measured); the spike was +31% and 20.5."""
    reference, reference_norms = _high_lr_run("bf16-mixed", seed)
    losses, norms = _high_lr_run("fp8-lm-o2", seed)
    assert all(math.isfinite(x) for x in losses + norms), (losses, norms)
    ratios = [a / b for a, b in zip(losses, reference)]
    assert max(ratios) <= 1.15, (losses, reference)
    assert max(norms) <= 2 * max(reference_norms), (norms, reference_norms)


def test_o2_model_state_of_an_experts_heavy_moe_is_under_045_of_bf16_mixed():
    # 16 experts of width 64: the expert weights are 87% of the 453k parameters.
    sizes = dict(experts=16, intermediate=64)
    measured = {}
    for name in ("bf16-mixed", "fp8-lm-o2"):
        strategy, model, optimizer = prepared(name, "qwen3_moe", **sizes)
        _one_step(strategy, model, optimizer)
        measured[name] = model_state_bytes(model, optimizer)
        planned = describe(strategy, model, optimizer)["memory"]
        assert planned["total"] == pytest.approx(measured[name]["total"], abs=1e-3), (name, planned, measured[name])
        if name == "fp8-lm-o2":
            total = sum(p.numel() for p in model.parameters())
            experts = sum(getattr(e, w).numel() for _, e, _ in moe_blocks(model) for w in expert_weight_names(e))
            fp8 = sum(p.numel() for p in model.parameters() if get_master_scale(p) is not None)
    assert experts / total > 0.85, experts / total
    # FP16 master 2 + FP8 gradient 1 + E4M3 m 1 + FP16 v 2 on the FP8 GEMM weights (experts and
    # attention projections); 16 on the rest.
    documented = (6 * fp8 + 16 * (total - fp8)) / total
    o2, bf16 = measured["fp8-lm-o2"]["total"], measured["bf16-mixed"]["total"]
    assert documented <= o2 <= documented + 0.01, (documented, measured)
    assert o2 <= 0.45 * bf16, f"fp8-lm-o2 {o2:.3f} B/param, bf16-mixed {bf16:.3f} ({o2 / bf16:.3f}x)"


@pytest.mark.slow
def test_o2_plan_for_qwen3_30b_a3b_is_under_045_of_bf16_mixed():
    from hf_lowprec.cli import memory_plan

    rows = {row["strategy"]: row for row in memory_plan("qwen3-30b-a3b", ["bf16-mixed", "fp8-lm-o2"])}
    o2, bf16 = rows["fp8-lm-o2"], rows["bf16-mixed"]
    assert o2["num_params"] == bf16["num_params"] > 30e9
    assert o2["total"] <= 0.45 * bf16["total"], (o2, bf16)


# --- 4. the router's auxiliary loss ----------------------------------------------------------


def _router_inputs_recorded(model):
    """Forward pre-hooks on every router recording its input; (inputs by block, handles)."""
    seen, handles = {}, []
    for block, _, router in moe_blocks(model):
        handles.append(router.register_forward_pre_hook(lambda m, args, block=block: seen.__setitem__(block, args[0])))
    return seen, handles


def _router_inputs_replaced(model, inputs):
    """Forward pre-hooks feeding every router `inputs[block]` instead of its own input."""
    return [
        router.register_forward_pre_hook(lambda m, args, block=block: (inputs[block], *args[1:]))
        for block, _, router in moe_blocks(model)
    ]


@pytest.mark.parametrize("arch", AUX_LOSS_ARCHITECTURES)
def test_router_aux_loss_is_the_fp32_models_bit_for_bit(arch):
    """The model returns `aux_loss` (the load-balancing loss of the routers' logits, which it
    adds to `loss` times `router_aux_loss_coef`) and `router_logits`. The FP8 attention and
    experts change the hidden states that reach the routers, so the whole models' aux losses
    differ by FP8 rounding; what conversion must not change is the router and the aux loss
    computed from it. So the FP32 model's routers are fed the hidden states the FP8 model's
    routers saw: the router logits and the aux loss are then the same bits, with the FP8
    strategy's forward context (BF16 autocast) and without it."""
    coef = 0.02
    fp32 = tiny_moe(arch, output_router_logits=True, router_aux_loss_coef=coef)
    strategy = get_strategy("fp8-lm-o1")
    model = strategy.prepare_model(tiny_moe(arch, output_router_logits=True, router_aux_loss_coef=coef))
    assert all(isinstance(e, FP8Experts) for _, e, _ in moe_blocks(model))
    ids = token_ids(batch=2, seq=32)
    for context in (strategy.forward_context, contextlib.nullcontext):
        seen, handles = _router_inputs_recorded(model)
        with torch.no_grad(), context():
            out = model(input_ids=ids, labels=ids)
        for h in handles:
            h.remove()
        handles = _router_inputs_replaced(fp32, seen)
        with torch.no_grad(), context():
            ref = fp32(input_ids=ids, labels=ids)
        for h in handles:
            h.remove()
        where = f"{arch}, {context.__name__}"
        assert out.aux_loss is not None and torch.isfinite(out.aux_loss), where
        assert len(out.router_logits) == len(ref.router_logits) == len(seen) == 2, where
        for i, (a, b) in enumerate(zip(out.router_logits, ref.router_logits)):
            assert_bits_equal(a, b, f"{where}: router logits of layer {i}")
        assert_bits_equal(out.aux_loss, ref.aux_loss, f"{where}: aux_loss")
        # The loss the FP8 model trains on carries the aux term: loss = LM loss + coef · aux_loss.
        with torch.no_grad(), context():
            lm_only = model(input_ids=ids, labels=ids, output_router_logits=False)
        assert lm_only.aux_loss is None
        assert_bits_equal(out.loss, lm_only.loss + coef * out.aux_loss, f"{where}: loss")


# --- 5. the Trainer resumes an O2 MoE run bit for bit ---------------------------------------


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_hub_format_state_dict_converts_back_to_the_models_keys_bit_for_bit(arch):
    """What `save_pretrained` writes (per-expert keys where the architecture has a conversion:
    all but gpt-oss) comes back as the model's own state dict (hf_lowprec.checkpoints.converted,
    which the Trainer's resume uses: the stock resume loads it without conversion and drops
    every expert weight, transformers#48805)."""
    from transformers.core_model_loading import revert_weight_conversion

    from hf_lowprec.checkpoints.converted import to_model_keys

    model = tiny_moe(arch)
    own = model.state_dict()
    hub = revert_weight_conversion(model, dict(own))
    assert (set(hub) == set(own)) == (arch == "gpt_oss"), sorted(set(hub) - set(own))[:4]
    back = to_model_keys(model, hub)
    assert set(back) == set(own)
    for key, value in own.items():
        assert_bits_equal(back[key], value, key)


make_args = functools.partial(
    helpers.make_args,
    save_steps=3,
    save_strategy="steps",
    lr_scheduler_type="cosine",
    warmup_steps=1,
    weight_decay=0.01,
)


@pytest.mark.slow
def test_trainer_o2_moe_resumes_bit_for_bit(tmp_path):
    def run(seed, **kw):
        trainer = Trainer(
            model=tiny_moe("qwen3_moe", seed=seed),
            args=make_args(tmp_path, "fp8-lm-o2"),
            train_dataset=TokenBlocks(),
        )
        trainer.train(**kw)
        return trainer

    trainer = run(0)
    full = logged_losses(trainer)
    assert len(full) == 6
    finite([loss for _, loss in full])
    blocks = moe_blocks(trainer.model)
    assert blocks and all(isinstance(e, FP8Experts) for _, e, _ in blocks)
    assert all(
        getattr(e, w).dtype == torch.float16 and get_master_scale(getattr(e, w)) is not None
        for _, e, _ in blocks
        for w in expert_weight_names(e)
    )
    resumed = run(7, resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert logged_losses(resumed) == full
    # The state dict (real values of the scaled masters) and the stored payloads and scales.
    for (key, a), b in zip(trainer.model.state_dict().items(), resumed.model.state_dict().values()):
        assert_bits_equal(a, b, key)
    for (key, a), b in zip(trainer.model.named_parameters(), resumed.model.parameters()):
        assert_bits_equal(a.detach(), b.detach(), key)
    for (_, a, _), (_, b, _) in zip(blocks, moe_blocks(resumed.model)):
        for w in expert_weight_names(a):
            assert_bits_equal(get_master_scale(getattr(a, w)), get_master_scale(getattr(b, w)), w)


# --- 6. torch.compile: one graph, built once, whatever the routing --------------------------


@pytest.mark.slow
def test_compiled_o1_moe_step_is_one_graph_built_once_across_routings():
    """As tests/gpu/test_compiled.py checks GPT-2 (`strategy_compiled_run`), on qwen3_moe with
    a new random batch every step: 2 warm-up steps, 4 steady ones. Before each step the eager
    model (the same module) records the per-expert token counts the step will route, so the
    routing is seen to differ from step to step."""
    import hf_lowprec

    strategy = hf_lowprec.get_strategy("fp8-lm-o1")
    model = strategy.prepare_model(tiny_moe("qwen3_moe"))
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3, weight_decay=0.01)
    # The "eager" backend, counting the graphs dynamo hands it for the model (dynamo's own
    # unique_graphs also counts the package's compiled cast kernels run eagerly outside it).
    model_graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs) -> object:
        model_graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=backend)
    data = iter([token_ids(batch=4, seq=32, seed=s) for s in range(6)])
    counts = []

    def step() -> None:
        ids = next(data)
        with torch.no_grad(), strategy.forward_context():
            logits = model(input_ids=ids, output_router_logits=True).router_logits
        counts.append(
            tuple(
                tuple(torch.bincount(torch.topk(layer.float(), 2, dim=-1).indices.flatten(), minlength=8).tolist())
                for layer in logits
            )
        )
        strategy_step(strategy, compiled, optimizer, ids)

    result = compiled_run(step, warmup=2, steady=4)
    assert len(counts) == 6 and len(set(counts)) == 6, f"the batches route alike: {counts}"
    listed = "\n".join(f"  {n}x {r.splitlines()[0][:200]}" for r, n in result.break_reasons.most_common())
    assert result.breaks == 0, f"{result.breaks} graph breaks:\n{listed}"
    assert result.new_graphs == 0, (
        f"dynamo built {result.new_graphs} graphs in 4 steady steps; guards that failed:\n{result.recompiles_summary()}"
    )
    assert len(model_graphs) == 1, f"{len(model_graphs)} graphs of the model in 6 steps"
