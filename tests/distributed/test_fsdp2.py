"""Every strategy that declares FSDP2 support, sharded with `strategy.shard` on 2 gloo ranks.

The ranks run every case in one launch (`_fsdp2_worker.py`: the one-process reference, the
sharded run, a sharded checkpoint and its resumption, the full-precision export) and write what
they saw to JSON; the tests below judge it. Refusals are checked in this process: they must
happen before any work, so they need no process group.
"""

import json
import re
from pathlib import Path

import pytest
import torch

from hf_lowprec import available_strategies, get_strategy
from hf_lowprec.engines.fsdp2 import fsdp2_support, shard_model, support_matrix_markdown
from hf_lowprec.integrations.accelerate import PrecisionPlugin
from tests.deepspeed._launch import launch
from tests.helpers import assert_same_losses, finite, first_order_bound, tiny_gpt2

HERE = Path(__file__).resolve().parent
SUPPORTED = [n for n in available_strategies() if fsdp2_support(get_strategy(n)) is None]
REFUSED = [n for n in available_strategies() if fsdp2_support(get_strategy(n)) is not None]
BF16_FAMILY = {"collage-light", "collage-plus", "bf16-kahan", "bf16-sr", "bf16-pure", "bf16-fp32states"}
PLUGIN_CASE = "collage-plus"
ACCELERATE_CASES = ("collage-plus", "bf16-mixed")


LOSS_SCALED = ("fp16-mixed", "fp16-als")
FP8 = ("fp8-lm-o1", "fp8-lm-o2")  # FP8 all-gather; their losses against one process: test_fsdp2_fp8.py (E4M3 bound)
PER_SHARD = ("coat", "collage-8bit")  # state laid out per shard (groups, blocks), not like the parameter
LONG_CASES = (*LOSS_SCALED, *PER_SHARD)
# Element-wise, deterministic, one dtype per parameter in both runs: FSDP2 forms one process's
# arithmetic exactly (bf16-mixed gathers every weight in BF16 where autocast keeps LayerNorm and
# embeddings FP32; the loss-scaled, stochastic, per-shard and FP8 strategies round differently).
EXACT_CASES = ("fp32", "bf16-pure", "bf16-kahan", "bf16-fp32states", "collage-light", "collage-plus")
KILLED_CASES = ("collage-plus", "fp16-als", "fp8-lm-o2", *PER_SHARD)


def test_declared_supported():
    assert set(SUPPORTED) == BF16_FAMILY | {"bf16-mixed", "fp32", "collage-8bit", "coat", *LOSS_SCALED, *FP8}
    assert fsdp2_support(get_strategy("fp16-als", weights="sr")) is not None


# --- refusals: before any work, naming what works -------------------------------------------------
@pytest.mark.parametrize("name", REFUSED)
def test_refused_strategy_raises_before_touching_the_model(name):
    model = tiny_gpt2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules = [type(m) for m in model.modules()]
    with pytest.raises(ValueError) as err:
        shard_model(get_strategy(name), model)
    message = str(err.value)
    assert f"{name!r}" in message and "FSDP2" in message
    assert all(s in message for s in SUPPORTED)  # names what works instead
    # Nothing converted: same module types, same FP32 values.
    assert [type(m) for m in model.modules()] == modules
    assert all(torch.equal(v, before[k]) and v.dtype == before[k].dtype for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="FSDP2"):
        PrecisionPlugin(name).shard(tiny_gpt2())


def _shard_by_hand(model):
    """What the PyTorch FSDP2 tutorial teaches: `fully_shard` on each block, then on the root."""
    from torch.distributed.fsdp import fully_shard

    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model


@pytest.mark.parametrize("name", available_strategies())
def test_sharding_by_hand_is_refused_at_create_optimizer_naming_shard_model(name, one_rank_group):
    # Before this check: fp16-als and fp8-lm-o1 failed inside the library, o2/o3 inside FSDP's lazy
    # init, and coat, collage-8bit, fp16-mixed trained with numerics shard_model refuses; the
    # supported strategies trained without their MixedPrecisionPolicy or seeded δθ.
    strategy = get_strategy(name)
    model = _shard_by_hand(strategy.prepare_model(tiny_gpt2()))
    with pytest.raises(ValueError, match=r"hf_lowprec\.engines\.fsdp2\.shard_model") as err:
        strategy.create_optimizer(model.parameters(), lr=1e-3)
    assert ("not supported under FSDP2" in str(err.value)) == (name in REFUSED), str(err.value)


@pytest.mark.parametrize("name", ["bf16-pure", "fp8-lm-o2"])
def test_dtensor_parameters_outside_fsdp2_are_refused_at_prepare_model_before_any_change(name, one_rank_group):
    # Before: prepare_model cast the DTensor weights to BF16 (bf16-pure) or swapped their layers for
    # FP8Linear (fp8-lm-o2), and create_optimizer refused them later, advising shard_model.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model = tiny_gpt2()
    mesh = init_device_mesh("cpu", (1,))
    for block in model.transformer.h:  # tensor parallelism by hand: the q/k/v projection sharded
        block.attn.c_attn.weight = torch.nn.Parameter(
            distribute_tensor(block.attn.c_attn.weight.data, mesh, [Shard(0)])
        )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    modules = [type(m) for m in model.modules()]
    with pytest.raises(ValueError) as err:
        get_strategy(name).prepare_model(model)
    message = str(err.value)
    assert "'transformer.h.0.attn.c_attn.weight' and 1 more outside FSDP2" in message, message
    assert "tensor parallelism" in message and "not supported" in message and "shard_model" in message
    assert "fully_shard called by hand" not in message
    assert [type(m) for m in model.modules()] == modules
    for n, p in model.named_parameters():  # same types, dtypes and bits
        assert type(p.data) is type(before[n]) and p.dtype == before[n].dtype == torch.float32, n
        bits, kept = (getattr(t, "to_local", lambda t=t: t)().view(torch.int32) for t in (p.detach(), before[n]))
        assert torch.equal(bits, kept), n


def test_shard_model_parameters_build_the_optimizer_of_that_strategy_only(one_rank_group):
    strategy = get_strategy("collage-plus")
    model = shard_model(strategy, tiny_gpt2())
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    assert strategy.train_step(model, torch.arange(16).view(2, 8), optimizer, max_grad_norm=1.0).isfinite()
    with pytest.raises(ValueError, match=r"not sharded for precision strategy 'bf16-pure'.*shard_model"):
        get_strategy("bf16-pure").create_optimizer(model.parameters(), lr=1e-3)


def test_fp16_als_running_mean_accumulation_is_refused_once_sharded(one_rank_group):
    # FSDP2's reduce-scatter replaces the running mean's parameter hooks: accumulation would sum.
    strategy = get_strategy("fp16-als")
    shard_model(strategy, tiny_gpt2())
    strategy.set_gradient_accumulation(1)
    with pytest.raises(ValueError, match="running_mean=False"):
        strategy.set_gradient_accumulation(2)
    plain = get_strategy("fp16-als", running_mean=False)
    shard_model(plain, tiny_gpt2())
    plain.set_gradient_accumulation(2)  # the loop's divided sum, as in one process


def test_mixed_precision_policy_belongs_to_the_strategy():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    with pytest.raises(ValueError, match="owns FSDP2's mixed precision"):
        shard_model(get_strategy("collage-plus"), tiny_gpt2(), mp_policy=MixedPrecisionPolicy())
    assert get_strategy("bf16-mixed").fsdp2_mixed_precision() == MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    )
    assert get_strategy("collage-plus").fsdp2_mixed_precision() == MixedPrecisionPolicy(reduce_dtype=torch.float32)
    assert get_strategy("fp32").fsdp2_mixed_precision() == MixedPrecisionPolicy()


def test_sharding_without_a_process_group_says_how_to_start_one(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="init_process_group"):
        shard_model(get_strategy("collage-plus"), tiny_gpt2())


def test_support_table_has_every_strategy_from_the_declarations():
    table = support_matrix_markdown()
    for name in available_strategies():
        row = next(line for line in table.splitlines() if line.startswith(f"| `{name}` |"))
        assert ("| yes |" in row) == (name in SUPPORTED), row
        support = get_strategy(name).engine_support()
        assert (support.fsdp2_note if name in SUPPORTED else support.fsdp2_refusal) in row


class _Accelerator:
    """What `configure_accelerator` reads of an Accelerator: its state's FSDP plugin."""

    def __init__(self, plugin):
        self.state = type("State", (), {"fsdp_plugin": plugin})()


def test_accelerate_fsdp2_config_gets_the_strategys_policy_and_refusals(monkeypatch):
    from accelerate import FullyShardedDataParallelPlugin

    from hf_lowprec.engines.fsdp2 import configure_accelerator
    from tests.distributed._fsdp2_worker import fsdp2_config_env

    for key, value in fsdp2_config_env().items():  # as `accelerate launch --config_file recipes/configs/fsdp2.yaml`
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.mixed_precision_policy is None
    configure_accelerator(get_strategy("bf16-mixed"), _Accelerator(plugin))
    assert plugin.mixed_precision_policy == get_strategy("bf16-mixed").fsdp2_mixed_precision()
    with pytest.raises(ValueError, match="owns FSDP2's mixed precision"):  # the user's policy differs
        configure_accelerator(get_strategy("collage-plus"), _Accelerator(plugin))
    with pytest.raises(ValueError, match="'fp8-lm-o3' is not supported under FSDP2"):
        configure_accelerator(get_strategy("fp8-lm-o3"), _Accelerator(FullyShardedDataParallelPlugin()))
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ValueError, match="fsdp_version: 2"):
        configure_accelerator(get_strategy("collage-plus"), _Accelerator(FullyShardedDataParallelPlugin()))


# TrainingArguments with `fsdp` writes this variable into the process's environment (for Accelerate):
# set here through monkeypatch so that the test leaves the environment as it found it.
FSDP_ARGUMENTS_WRITE = ("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")


def test_trainer_fsdp_checks_strategy_and_version_before_any_work(tmp_path, monkeypatch):
    from hf_lowprec import TrainingArguments

    monkeypatch.setenv(*FSDP_ARGUMENTS_WRITE)  # put back (unset) after the test
    from hf_lowprec.engines.fsdp2 import refuse_full_precision_save

    def args(name, version, **options):
        return TrainingArguments(
            output_dir=str(tmp_path),
            precision_strategy=name,
            precision_options=options or None,
            fsdp="full_shard",
            fsdp_config={"fsdp_version": version},
            use_cpu=True,
        )

    assert args("collage-plus", 2).precision_strategy == "collage-plus"
    for name in REFUSED:
        with pytest.raises(ValueError, match=f"{name!r} is not supported under FSDP2"):
            args(name, 2)
    with pytest.raises(ValueError, match="fsdp_version"):
        args("collage-plus", 1)
    # The FP32 export is gathered onto rank 0: a save on each node's first rank would have none
    # on several nodes; on one node that rank is rank 0.
    assert args("collage-plus", 2, save_full_precision=True).precision_strategy == "collage-plus"

    def on_each_node():
        return TrainingArguments(
            output_dir=str(tmp_path),
            precision_strategy="collage-plus",
            precision_options={"save_full_precision": True},
            save_on_each_node=True,
            fsdp="full_shard",
            fsdp_config={"fsdp_version": 2},
            use_cpu=True,
        )

    assert on_each_node().save_on_each_node
    monkeypatch.setenv("WORLD_SIZE", "4")  # two nodes of two ranks, as torchrun sets them
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"save_on_each_node=True under FSDP on several nodes: .* Drop save_on"):
        refuse_full_precision_save(get_strategy("collage-plus", save_full_precision=True), True)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # a launcher that does not say: maybe several nodes
    with pytest.raises(ValueError, match="on several nodes"):
        refuse_full_precision_save(get_strategy("collage-plus", save_full_precision=True), True)
    refuse_full_precision_save(get_strategy("collage-plus", save_full_precision=True), False)
    refuse_full_precision_save(get_strategy("collage-plus"), True)


def test_a_bad_fsdp_config_is_refused_naming_the_setting_and_the_fix(tmp_path, monkeypatch):
    # Before the fix: a bare `invalid literal for int()` and a bare FileNotFoundError.
    from hf_lowprec import TrainingArguments

    monkeypatch.setenv(*FSDP_ARGUMENTS_WRITE)  # put back (unset) after the test

    def args(fsdp_config):
        return TrainingArguments(
            output_dir=str(tmp_path),
            precision_strategy="collage-plus",
            fsdp="full_shard",
            fsdp_config=fsdp_config,
            use_cpu=True,
        )

    fix = r"runs under FSDP2: pass fsdp_config=\{'fsdp_version': 2\}"
    for version in ("two", 3, True, None, [2]):
        with pytest.raises(
            ValueError, match=rf"fsdp_config fsdp_version must be 1 or 2, got {re.escape(repr(version))}; .*{fix}"
        ):
            args({"fsdp_version": version})
    missing = str(tmp_path / "missing.json")
    with pytest.raises(
        ValueError, match=rf"fsdp_config={re.escape(repr(missing))} cannot be read as a JSON file \(FileNotFound"
    ):
        args(missing)
    broken = tmp_path / "broken.json"
    broken.write_text("{fsdp_version: 2")
    with pytest.raises(
        ValueError, match=r"cannot be read as a JSON file \(JSONDecodeError.*pass the path of an existing"
    ):
        args(str(broken))
    written = tmp_path / "fsdp.json"
    written.write_text('{"fsdp_version": "2"}')
    assert args(str(written)).precision_strategy == "collage-plus"


def test_readme_shows_the_generated_table():
    page = (HERE.parents[1] / "docs" / "distributed.md").read_text()
    assert support_matrix_markdown() in page, "regenerate with `make readme`"


# --- training on 2 gloo ranks ---------------------------------------------------------------------
TRAINER_CASES = SUPPORTED
# save_full_precision through the Trainer's FSDP2: both state dict types (the sharded one writes no
# model file stock), an expansion (θ + δθ) and FP32 masters behind FP8 layers.
EXPORT_CASES = [("collage-plus", "FULL_STATE_DICT"), ("fp8-lm-o2", "SHARDED_STATE_DICT")]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    cases = [[name, "train"] for name in SUPPORTED] + [["collage-plus", "skip"], [PLUGIN_CASE, "plugin"]]
    cases += [[name, "skip"] for name in LOSS_SCALED] + [[name, "long"] for name in LONG_CASES]
    cases += [[name, "gpt2-small-bytes"] for name in SUPPORTED]
    cases += [[name, "accelerate"] for name in ACCELERATE_CASES] + [[name, "trainer"] for name in TRAINER_CASES]
    cases += [[name, "unclipped"] for name in EXACT_CASES]
    cases += [[name, f"trainer-export-{kind}"] for name, kind in EXPORT_CASES]
    results = launch(HERE / "_fsdp2_worker.py", tmp_path_factory.mktemp("fsdp2"), ["--cases", json.dumps(cases)])
    assert [r["world_size"] for r in results] == [2, 2]
    for result in results:
        for key, case in result["cases"].items():
            assert "error" not in case, f"{key}:\n{case['error']}"
    return results


@pytest.mark.slow
@pytest.mark.multiproc
def test_parameters_are_dtensor_shards_in_the_strategys_dtype(ranks):
    for result in ranks:
        for name in SUPPORTED:
            case, ref = result["cases"][f"{name}/train"], result["references"][name]
            assert case["param_types"] == ["DTensor"], name
            assert case["param_dtypes"] == ref["param_dtypes"], name
            assert len(case["losses"]) == 4


@pytest.mark.slow
@pytest.mark.multiproc
def test_every_state_component_is_sharded_like_its_parameter_in_its_one_process_dtype(ranks):
    for result in ranks:
        for name in SUPPORTED:
            case, ref = result["cases"][f"{name}/train"], result["references"][name]
            assert case["state_dtypes"] == ref["state_dtypes"], name
            assert case["state_layout"]["not"] == 0 and case["state_layout"]["sharded_like_param"] > 0, name
            assert (case["state_layout"]["per_shard"] > 0) == (name in PER_SHARD), name
        plus = result["cases"]["collage-plus/train"]["state_dtypes"]
        assert plus["param_error"] == plus["exp_avg_sq_error"] == ["torch.bfloat16"]
        assert result["cases"]["bf16-kahan/train"]["state_dtypes"]["compensation"] == ["torch.bfloat16"]
        assert result["cases"]["bf16-fp32states/train"]["state_dtypes"]["exp_avg"] == ["torch.float32"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_compiled_optimizer_step_runs_on_the_shards(ranks):
    # fused="auto" falls back to the foreach reference silently where a kernel cannot run; on the
    # shards every parameter's step of the first 2 steps must have run compiled.
    for result in ranks:
        for name in SUPPORTED:
            case = result["cases"][f"{name}/train"]
            # The fast path (native or compiled) stepped every shard, the reference none.
            assert case["compiled_runs"] == 2 * case["updated_params"], (name, case["compiled_runs"])
            assert case["reference_runs"] == 0, (name, case["reference_runs"])


@pytest.mark.slow
@pytest.mark.multiproc
def test_seeded_compensation_moves_onto_the_shards(ranks):
    # Collage and Kahan start δθ at the FP32 → BF16 residual; after sharding, the two ranks'
    # shards hold all of it: Σ|state| over ranks equals the one-process figure (FP64 sums of the
    # same BF16 values in another order: 1e-9 relative).
    for name in SUPPORTED:
        case, ref = ranks[0]["cases"][f"{name}/train"], ranks[0]["references"][name]
        assert case["initial_state_l1"] == pytest.approx(ref["initial_state_l1"], rel=1e-9, abs=0.0), name
    assert ranks[0]["references"]["collage-plus"]["initial_state_l1"] > 0  # the case this guards


@pytest.mark.slow
@pytest.mark.multiproc
def test_losses_match_one_process_within_the_data_parallel_bound(ranks):
    """FSDP2 (2 ranks × 2 samples) vs one process (4 samples), same data, seed and clipping.

    Step 1 sees identical weights and data: the batch-mean loss agrees to the BF16 forward's
    rounding, |Δ| ≤ 2^-8 relative (bf16-mixed differs most: FSDP2 gathers every weight in
    BF16, where autocast keeps LayerNorm and biases FP32; measured 1.8e-5 relative). Later
    steps differ by data parallelism (each rank's half-batch gradient is rounded and the halves
    averaged, where one process rounds the full-batch gradient once) and by the order the global
    clip norm sums the shards: two AdamW runs from the same weights, held to `first_order_bound`
    (each weight moves at most lr·(U·q + λ·|w|) per step, times the one-process run's gradient
    L1 norms; derived from Adam's update bound, not from a measured gap). Without clipping the
    deterministic updates equal one process bit for bit
    (`test_unclipped_element_wise_updates_equal_one_process_bit_for_bit`).
    """
    from tests.distributed._fsdp2_worker import LR

    for result in ranks:
        for name in (n for n in SUPPORTED if n not in FP8):
            sharded, ref = result["cases"][f"{name}/train"]["losses"], result["references"][name]
            sharded, one = finite(sharded), finite(ref["losses"])
            assert abs(sharded[0] - one[0]) <= 2**-8 * abs(one[0]), (name, sharded, one)
            for step in range(1, len(one)):
                bound = first_order_bound(ref["grad_norms"], step, lr=LR)
                assert abs(sharded[step] - one[step]) <= bound, (name, step, sharded, one, bound)


@pytest.mark.slow
@pytest.mark.multiproc
def test_gradient_clipping_uses_the_global_norm(ranks):
    # torch.nn.utils.clip_grad_norm_ on DTensor gradients reduces over the shards: at step 1
    # (same weights, same data) the pre-clip norm is the one-process norm up to the gradients'
    # rounding (BF16: each element within 2^-7 relative; the norm no further), and both ranks see it.
    norms = [[r["cases"][f"{n}/train"]["norms"] for n in SUPPORTED] for r in ranks]
    assert norms[0] == norms[1]
    for name in SUPPORTED:
        sharded = ranks[0]["cases"][f"{name}/train"]["norms"][0]
        one = ranks[0]["references"][name]["norms"][0]
        assert one > 1.0  # above MAX_NORM: clipping acts
        assert abs(sharded - one) <= 2**-7 * one, (name, sharded, one)


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank(ranks):
    for result in ranks:
        case = result["cases"]["collage-plus/skip"]
        assert case["skipped"] and case["skipped_steps"] == 1 and case["unchanged"], case


@pytest.mark.slow
@pytest.mark.multiproc
def test_loss_scaler_agrees_across_ranks_on_a_nonfinite_shard(ranks):
    # A NaN in rank 1's shard only: both ranks skip and both scalers halve (fp16-mixed's
    # found-inf and fp16-als's NaN count are all-reduced), so the scales stay equal.
    for name in LOSS_SCALED:
        cases = [r["cases"][f"{name}/skip"] for r in ranks]
        for case in cases:
            assert case["skipped"] and case["skipped_steps"] == 1 and case["unchanged"], (name, case)
            assert case["scale"] == case["initial_scale"] / 2, (name, case)


@pytest.mark.slow
@pytest.mark.multiproc
def test_newly_sharded_strategies_track_one_process_over_20_steps(ranks):
    """FSDP2 vs one process over 20 steps. Under FSDP2 each rank's half-batch gradient is
    formed apart and the halves averaged in FP32: the arithmetic of one process accumulating the
    same two micro-batches (exact halvings in FP32), up to the order in which the global clip
    norm sums the shards and, for per-shard states, the groups a shard pads. Held to
    `first_order_bound` of the one-process run's gradient norms at every step (derived from
    Adam's update bound) plus the forward's BF16 rounding of the loss (2^-8 relative, all the
    first step has); NaN fails (tensor comparisons); and the loss falls."""
    from tests.distributed._fsdp2_worker import LR

    for result in ranks:
        for name in LONG_CASES:
            case = result["cases"][f"{name}/long"]
            sharded, one = (torch.tensor(case[k], dtype=torch.float64) for k in ("sharded", "one"))
            assert len(sharded) == len(one) == 20, name
            bounds = torch.tensor(
                [first_order_bound(case["grad_norms"], k, lr=LR) for k in range(20)], dtype=torch.float64
            )
            bounds += 2.0**-8 * one.abs()
            assert ((sharded - one).abs() <= bounds).all(), (name, case, bounds)
            assert sharded[-1] < sharded[0], name  # it trains


@pytest.mark.slow
@pytest.mark.multiproc
def test_sharded_checkpoint_resumes_bit_for_bit(ranks):
    for name in SUPPORTED:
        cases = [r["cases"][f"{name}/train"] for r in ranks]
        for case in cases:
            assert_same_losses(case["resumed_losses"], case["losses"][2:], name)
            assert case["resumed_digest"] == case["digest"], name
            assert case["resumed_state_dtypes"] == case["state_dtypes"], name
        assert cases[0]["digest"] == cases[1]["digest"], name  # the gathered model, on both ranks


@pytest.mark.slow
@pytest.mark.multiproc
def test_full_precision_export_is_gathered_onto_rank_0(ranks):
    for name in SUPPORTED:
        zero, one = (r["cases"][f"{name}/train"] for r in ranks)
        ref = ranks[0]["references"][name]
        # Before training: exactly the one-process export (θ + seeded δθ, or the FP32 weights).
        assert zero["export_digest_before"] == ref["export_digest_before"], name
        assert one["export_keys_before"] == 0 and one["export"]["keys"] == 0, name
        # After training: every key, each FP32 value rounding back to the parameter and within
        # 2 FP32 ulp of θ + δθ gathered from the shards (rounded once, ties moved towards θ).
        assert zero["export"]["keys"] == len(tiny_gpt2().state_dict()), name
        assert zero["export"]["exact"], name


@pytest.mark.slow
@pytest.mark.multiproc
def test_model_state_bytes_per_rank_are_one_process_split_by_world(ranks):
    """Per rank ≤ 1.05 × (one process / world) + what cannot be sharded (0-dim scales; step
    counters are Python ints). The tiny GPT-2's dims are even, so the split is exact here."""
    world = len(ranks)
    for name in SUPPORTED:
        one = ranks[0]["references"][name]["bytes"]
        one_total = one["params"] + one["grads"] + one["states"]
        for result in ranks:
            b = result["cases"][f"{name}/train"]["bytes"]
            assert b["params"] + b["grads"] + b["states"] <= 1.05 * one_total / world + b["unshardable"], (name, b, one)
            if name not in PER_SHARD:  # else each shard pads its last group or block
                assert b["states"] * world == one["states"], name
            assert b["states"] <= 1.05 * one["states"] / world, (name, b, one)  # the optimizer's own bytes


@pytest.mark.slow
@pytest.mark.multiproc
def test_unclipped_shards_equal_one_process_bit_for_bit(ranks):
    """Without clipping, FSDP2 on 2 ranks is one process accumulating the ranks' two halves, bit
    for bit, after every one of 4 steps, for every element-wise deterministic strategy: the FP32
    reduce-scatter forms fl(g₀ + g₁)/2 exactly as the accumulation (halving is exact), and an
    element-wise update does not care where a shard ends. The clipped runs above differ only
    through the order in which the two global norms are summed."""
    for result in ranks:
        for name in EXACT_CASES:
            case = result["cases"][f"{name}/unclipped"]
            assert len(case["sharded_digests"]) == 4, name
            assert case["sharded_digests"] == case["one_digests"], name


@pytest.mark.slow
@pytest.mark.multiproc
def test_bytes_at_each_collective_are_the_declared_ones(ranks):
    """docs/distributed.md's table of what moves per collective (`hf_lowprec.engines.traffic`),
    checked where it happens: the bytes every `all_gather_single` and `reduce_scatter_single`
    moved in two training steps, counted at torch.distributed's functions, equal twice the
    declared bytes per step of the same sharded model, for every strategy FSDP2 trains."""
    for result in ranks:
        for name in SUPPORTED:
            case = result["cases"][f"{name}/train"]
            declared = {k: 2 * v for k, v in case["declared_per_step"].items()}
            assert case["moved_two_steps"] == declared, (name, case["moved_two_steps"], declared)
    fp8, bf16 = (ranks[0]["cases"][f"{n}/train"]["moved_two_steps"] for n in ("fp8-lm-o2", "bf16-mixed"))
    assert fp8["all_gather"] < 0.6 * bf16["all_gather"]  # measured 0.55 on this 64-wide model


@pytest.mark.slow
@pytest.mark.multiproc
def test_gpt2_small_model_state_bytes_per_rank(ranks):
    """The same bound on a GPT-2-small-shaped model (124M parameters, meta device), whose
    vocabulary (50257 rows) does not split evenly: rank 0 holds one row more of the embedding."""
    world = len(ranks)
    for name in SUPPORTED:
        one = ranks[0]["cases"][f"{name}/gpt2-small-bytes"]["one"]
        assert one["num_params"] == 124_439_808
        one_total = one["params"] + one["grads"] + one["states"]
        # The prepared strategy's figure (O2's depends on the model: 6 bytes on FP8 GEMM weights,
        # 16 elsewhere); collage-8bit's 8.03 is given to 2 decimals.
        documented = one["bytes_per_param"]
        assert abs(one_total / one["num_params"] - documented) <= (0.005 if name == "collage-8bit" else 0.0), name
        for result in ranks:
            b = result["cases"][f"{name}/gpt2-small-bytes"]["rank"]
            assert b["params"] + b["grads"] + b["states"] <= 1.05 * one_total / world + b["unshardable"], (name, b, one)
        total = sum(r["cases"][f"{name}/gpt2-small-bytes"]["rank"]["states"] for r in ranks)
        if name not in PER_SHARD:  # else each shard pads its last group or block
            assert total == one["states"], name  # every state element on exactly one rank


@pytest.mark.slow
@pytest.mark.multiproc
def test_precision_plugin_shards_the_same_way(ranks):
    for result in ranks:
        plugin, direct = result["cases"][f"{PLUGIN_CASE}/plugin"], result["cases"][f"{PLUGIN_CASE}/train"]
        assert_same_losses(plugin["losses"], direct["losses"][:2], "plugin")
        assert plugin["digest"] == direct["digest_step2"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_accelerate_fsdp2_path_trains_like_strategy_shard(ranks):
    """`PrecisionPlugin.prepare` under Accelerate's FSDP2 (forced on CPU, see
    `forced_fsdp2_accelerator` in the worker): Accelerate shards with the strategy's policy, the
    seeded δθ moves onto the shards Accelerate swapped into the optimizer (Σ|state| over ranks as
    in one process, one state per parameter), and the weights after 2 steps equal those of
    `strategy.shard` bit for bit (Accelerate groups the embeddings differently; the element-wise
    numerics are the same)."""
    for result in ranks:
        for name in ACCELERATE_CASES:
            case, direct = result["cases"][f"{name}/accelerate"], result["cases"][f"{name}/train"]
            assert case["policy"] == case["strategy_policy"], name
            assert case["states"] == case["params"], name  # no state left on the unsharded tensors
            assert case["state_layout"]["not"] == 0, name
            assert case["state_dtypes"] == direct["state_dtypes"], name
            assert case["initial_state_l1"] == pytest.approx(
                result["references"][name]["initial_state_l1"], rel=1e-9, abs=0.0
            ), name
            assert_same_losses(case["losses"], direct["losses"][:2], name)
            assert case["digest"] == direct["digest_step2"], name
    assert ranks[0]["cases"]["collage-plus/accelerate"]["initial_state_l1"] > 0  # the seeded case


@pytest.mark.slow
@pytest.mark.multiproc
def test_trainer_fsdp2_trains_like_shard_model_bit_for_bit(ranks):
    """`TrainingArguments(fsdp="full_shard", fsdp_config={"fsdp_version": 2}, precision_strategy=...)`
    on Accelerate's FSDP2 path (forced on CPU: Accelerate takes it only on accelerators, see
    `forced_fsdp2_accelerator`) against the custom loop with `shard_model` on the same per-rank
    batches: the same policy, shards and arithmetic, so equal loss bits and weights after 2 steps."""
    for result in ranks:
        for name in TRAINER_CASES:
            case = result["cases"][f"{name}/trainer"]
            assert case["policy"] == case["strategy_policy"], name
            assert case["param_types"] == ["DTensor"] and case["state_layout"]["not"] == 0, name
            # Built before Accelerate shards the model, the optimizer still gives each parameter
            # its formats (FP8-LM O2: E4M3 m and FP16 v on the scaled masters).
            assert case["state_dtypes"] == case["loop_state_dtypes"], name
            trainer, loop = (torch.tensor(case[k], dtype=torch.float64) for k in ("losses", "loop_losses"))
            assert len(trainer) == 2 and torch.equal(trainer.view(torch.int64), loop.view(torch.int64)), (name, case)
            assert case["digest"] == case["loop_digest"], name


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_trainers_fsdp2_save_full_precision_writes_the_loops_fp32_export(ranks):
    """`precision_options={"save_full_precision": True}` under the Trainer's FSDP2 wrote the 16-bit
    weights FSDP gathers (then was refused): rank 0 now writes every weight as the strategy's
    optimizer holds it, gathered from the shards, bit for bit the custom loop's
    `full_precision_state_dict` after the same steps (the Trainer's steps are the loop's, above)."""
    for name, kind in EXPORT_CASES:
        zero = ranks[0]["cases"][f"{name}/trainer-export-{kind}"]
        assert zero["loop_keys"] == len(tiny_gpt2().state_dict()), (name, kind)
        assert zero["written_dtypes"] == ["torch.float32"] and zero["config_dtype"] == "float32", (name, kind)
        assert zero["missing"] == [] and zero["unequal"] == [], (name, kind)
        assert ranks[1]["cases"][f"{name}/trainer-export-{kind}"]["loop_keys"] == 0, (name, kind)
        # The model file is in the folder when save_model pushes it (the sharded stock save pushed none).
        assert len(zero["pushed"]) == 1 and "model.safetensors" in zero["pushed"][0], (name, kind)
        # A checkpoint gathers the export only where it writes it: the full state dict's model file
        # (one per checkpoint), never under the sharded one (rank 0 gathered it and dropped it).
        assert zero["checkpoints"] == ["checkpoint-1", "checkpoint-2"], (name, kind)
        assert zero["gathers_in_training"] == (2 if kind == "FULL_STATE_DICT" else 0), (name, kind)


@pytest.mark.slow
@pytest.mark.multiproc
def test_killed_job_resumes_bit_for_bit_in_new_processes(ranks, tmp_path):
    """One launch trains 2 steps of each case, writes sharded checkpoints and ends at once
    (`os._exit`, no teardown); a second launch of new processes loads them into models of
    another initialization and trains steps 3 and 4: losses and weights equal the
    uninterrupted run's (bit for bit: the same arithmetic on the same shards)."""
    ckpt = ["--ckpt", str(tmp_path / "ckpt")]
    cases = {mode: json.dumps([[name, mode] for name in KILLED_CASES]) for mode in ("killed", "resumed")}
    killed = launch(HERE / "_fsdp2_worker.py", tmp_path / "killed", ["--cases", cases["killed"], *ckpt])
    resumed = launch(HERE / "_fsdp2_worker.py", tmp_path / "resumed", ["--cases", cases["resumed"], *ckpt])
    for first, second, whole in zip(killed, resumed, ranks):
        for name in KILLED_CASES:
            uninterrupted = whole["cases"][f"{name}/train"]
            before, after = first["cases"][f"{name}/killed"], second["cases"][f"{name}/resumed"]
            assert "error" not in before and "error" not in after, (before, after)
            assert_same_losses(before["losses"], uninterrupted["losses"][:2], f"{name} killed")
            assert_same_losses(after["losses"], uninterrupted["losses"][2:], f"{name} resumed")
            assert after["digest"] == uninterrupted["digest"], name


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_trainers_fsdp2_checkpoint_resumes_bit_for_bit(tmp_path):
    """Accelerate's FSDP optimizer checkpoint keeps `state` and `param_groups` only: collage-plus's
    resume crashed (its seeded δθ still keyed by the unsharded parameters), COAT's per-group FP8
    moments came back as rank 0's on both ranks, fp16-als lost its loss scaler. Each rank's own
    optimizer file beside it resumes steps 3 and 4 as the uninterrupted run, bit for bit."""
    names = ["collage-plus", "coat", "fp16-als"]
    for result in launch(HERE / "_fsdp2_trainer_resume_worker.py", tmp_path, ["--names", ",".join(names)]):
        for name in names:
            case = result["cases"][name]
            assert "error" not in case, case.get("error")
            assert case["resumed_losses"] == case["losses"] and len(case["losses"]) == 4, name
            assert case["resumed_digest"] == case["digest"], name


def test_the_trainers_fsdp2_checkpoint_at_another_world_size_is_refused_unless_the_optimizer_is_reset(tmp_path):
    # Accelerate's own file would reshard the DTensor states but give every rank rank 0's
    # per-shard state (COAT's groups): refused, naming both ways on.
    from types import SimpleNamespace

    from hf_lowprec.checkpoints.fsdp2_trainer import load_trainer_optimizer, rank_optimizer_file

    for rank in range(2):
        torch.save({"state": {}, "param_groups": []}, rank_optimizer_file(str(tmp_path), rank, 2))
    optimizer = SimpleNamespace(strategy=None, optimizer=SimpleNamespace(init_states=lambda: None))
    trainer = SimpleNamespace(
        _hf_lowprec_adopted=True, args=SimpleNamespace(process_index=0, world_size=4), optimizer=optimizer
    )
    with pytest.raises(ValueError, match=r"each of its 2 processes .* this run has 4\. Nothing was loaded"):
        load_trainer_optimizer(trainer, str(tmp_path), set())
    assert load_trainer_optimizer(trainer, str(tmp_path), {"optimizer"}) is False  # the Trainer's reset path
