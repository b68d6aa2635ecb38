"""Every registered strategy × ZeRO stage 1, 2, 3 on 2 gloo ranks, in one launch.

The ranks run every case of the matrix in turn (a fresh `deepspeed.initialize` each, the
strategy's optimizer as DeepSpeed's client optimizer, so no DeepSpeed op is compiled) and write
what they saw to JSON; the tests below judge it. See `_worker.py` for what each case records.
"""

import json
import math
from pathlib import Path

import pytest

from hf_lowprec import available_strategies, get_strategy
from hf_lowprec.engines.zero import STAGES, zero_support
from tests.deepspeed._launch import launch
from tests.helpers import assert_same_losses, finite, first_order_bound, tiny_gpt2

HERE = Path(__file__).resolve().parent
BF16_WEIGHTS = {
    "collage-plus",
    "collage-light",
    "collage-8bit",
    "bf16-pure",
    "bf16-kahan",
    "bf16-sr",
    "bf16-fp32states",
}
TRAINER_CASE = ("collage-plus", 2, "trainer")
O3_TRAINER_CASE = ("fp8-lm-o3", 2, "trainer")
KAHAN_TRAINER_CASE = ("bf16-kahan", 3, "trainer")  # ZeRO-3: each parameter partitioned
# An inf in one element of rank 0's gradient at step 2: of a dense parameter, or of an FP8 weight
# rank 0 owns (fp8-lm-o3, whose FP8 weights DeepSpeed does not hold).
NONFINITE_CASES = (("collage-plus", 2, "nonfinite", "dense"), ("fp8-lm-o3", 2, "nonfinite", "dense"))
NONFINITE_CASES += (("fp8-lm-o3", 2, "nonfinite", "fp8"),)
TOKENS = 4 * 31  # per step: 4 sequences of 32, the first token has no label


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    cases = [[name, stage] for name in available_strategies() for stage in STAGES]
    cases += [list(TRAINER_CASE), list(O3_TRAINER_CASE), list(KAHAN_TRAINER_CASE), *map(list, NONFINITE_CASES)]
    out = tmp_path_factory.mktemp("zero")
    results = launch(HERE / "_worker.py", out, ["--cases", json.dumps(cases)])
    assert [r["world_size"] for r in results] == [2, 2]
    return results


# Strategies whose ZeRO run cannot equal one process bit for bit after step 1, and why.
LAYOUT_DEPENDENT = {
    "bf16-sr": "its rounding draws one random stream per flat partition, not per parameter",
    "coat": "its FP8 moments' groups of 128 are cut from DeepSpeed's flat partitions",
    "collage-8bit": "its 8-bit blocks of 256 are cut from DeepSpeed's flat partitions",
    "fp8-lm-o3": "its FP8 gradients are all-reduced with a shared scale, not quantized once",
}


def supported():
    return [(n, s) for n in available_strategies() for s in STAGES if zero_support(get_strategy(n), s) is None]


pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def test_every_combination_trains_or_is_refused_before_training(ranks):
    for result in ranks:
        for name in available_strategies():
            for stage in STAGES:
                case = result["cases"][f"{name}/{stage}"]
                assert "error" not in case, f"{name} ZeRO-{stage}:\n{case['error']}"
                if zero_support(get_strategy(name), stage) is None:
                    assert len(finite(case["losses"])) == 4, (name, stage)
                else:
                    assert case["refused"] and f"{name!r}" in case["message"] and f"stage {stage}" in case["message"]
    assert supported(), "no strategy supports ZeRO: the matrix would test nothing"


def test_partitions_hold_the_strategys_own_dtypes(ranks):
    # Checked on what DeepSpeed holds (the partitions it hands to the client optimizer and
    # that optimizer's state), against the same strategy trained in one process.
    for result in ranks:
        for name, stage in supported():
            case, ref = result["cases"][f"{name}/{stage}"], result["references"][name]
            expected = "torch.bfloat16" if name in BF16_WEIGHTS else "torch.float32"
            assert case["partition_dtypes"] == [expected], (name, stage)
            promised = sorted(str(d) for d in get_strategy(name).promised_param_dtypes())  # one process
            assert ref["param_dtypes"] == promised, (name, stage)
            # fp8-lm-o3 across ranks holds the FP8 weights another rank owns as E4M3 (1 byte).
            across = sorted(promised + (["torch.float8_e4m3fn"] if name == "fp8-lm-o3" else []))
            assert case["model_dtypes"] == across, (name, stage)
            assert case["state_dtypes"] == ref["state_dtypes"], (name, stage)
            assert case["client_is_ours"], (name, stage)
        # Collage's δθ and δv live in the partitioned optimizer state, in BF16.
        plus = result["cases"]["collage-plus/2"]["state_dtypes"]
        assert plus["param_error"] == plus["exp_avg_sq_error"] == ["torch.bfloat16"]
        # FP8-LM O3 keeps O2's state formats on the owners: E4M3 m, FP16 v, FP8 gradients.
        o3 = result["cases"]["fp8-lm-o3/2"]["state_dtypes"]
        assert "torch.float8_e4m3fn" in o3["exp_avg"] and "torch.float16" in o3["exp_avg_sq"]
        assert o3["grad"] == ["torch.float8_e4m3fn"]


def test_state_started_before_deepspeed_moves_onto_the_partitions(ranks):
    # Collage and Kahan seed their compensation with the FP32 → BF16 residual when the optimizer
    # is built; after DeepSpeed partitions the parameters that state must sit on the partitions,
    # all of it: Σ|state| over both ranks equals the one-process figure (FP64 sums of the same
    # BF16 values in another order: 1e-9 relative).
    for name, stage in supported():
        case, ref = ranks[0]["cases"][f"{name}/{stage}"], ranks[0]["references"][name]
        assert case["initial_state_l1"] == pytest.approx(ref["initial_state_l1"], rel=1e-9, abs=0.0), (name, stage)
    seeded = getattr(get_strategy("collage-plus").options, "seed_compensation", False)
    assert (ranks[0]["references"]["collage-plus"]["initial_state_l1"] > 0) == seeded  # the case this guards


def test_checkpoint_continues_exactly_and_ranks_agree(ranks):
    for name, stage in supported():
        cases = [r["cases"][f"{name}/{stage}"] for r in ranks]
        for case in cases:
            assert_same_losses(case["resumed_losses"], case["losses"][2:], (name, stage))
            assert case["resumed_digest"] == case["digest"], (name, stage)
            assert case["resumed_state_dtypes"] == case["state_dtypes"], (name, stage)
        # Every rank computes with the same weights after every step (ZeRO all-gathers them;
        # for fp8-lm-o3 these are the FP8 weights, whose masters live on their owner only).
        assert cases[0]["forward_digests"] == cases[1]["forward_digests"], (name, stage)
        if name != "fp8-lm-o3":
            assert cases[0]["digest"] == cases[1]["digest"], (name, stage)


def test_full_precision_export_gathers_the_partitions(ranks):
    """`save_full_precision` under ZeRO: every parameter's FP32 full precision (θ + δθ, the masters)
    put together from the ranks' partitions is, for every strategy whose update does not depend on
    DeepSpeed's layout, bit for bit what one process's `full_precision_state_dict` holds after the
    same steps on the ranks' two halves; FP32 for every strategy and stage (DeepSpeed's save
    wrote the 16-bit weights, without δθ)."""
    names = dict(tiny_gpt2().named_parameters(remove_duplicate=False))
    for result in ranks:
        for name, stage in supported():
            full = result["cases"][f"{name}/{stage}"]["full_precision"]
            reference = result["references"][name]["halves_full_precision"]
            assert set(full) == set(names), (name, stage, set(names) ^ set(full))
            assert all(v.startswith("torch.float32:") for v in full.values()), (name, stage)
            if name not in LAYOUT_DEPENDENT:
                differ = [k for k in full if full[k] != reference[k]]
                assert not differ, (name, stage, differ)


def test_zero_1_and_2_agree_bit_for_bit(ranks):
    # ZeRO 1 and 2 cut the same flat buffer into the same partitions and reduce the same
    # gradients; they differ only in when gradients are partitioned, so the weights agree
    # exactly. (ZeRO-3 shards every parameter separately: its FP32 reductions and the
    # stochastic-rounding stream over the partition differ, so it is held to the checks above.)
    for name in available_strategies():
        if zero_support(get_strategy(name), 1) is None and zero_support(get_strategy(name), 2) is None:
            assert ranks[0]["cases"][f"{name}/1"]["digest"] == ranks[0]["cases"][f"{name}/2"]["digest"], name


def test_model_state_bytes_are_split_across_ranks(ranks):
    for name in ("bf16-mixed", "collage-plus"):
        ref = ranks[0]["references"][name]
        per_rank = [r["cases"][f"{name}/2"]["bytes"] for r in ranks]
        numel = sum(p.numel() for p in tiny_gpt2().parameters())  # the tied LM head counts once
        width = 2 if name in BF16_WEIGHTS else 4
        for b in per_rank:
            # ZeRO-2: every rank holds the whole model, half of the partitions, gradients and states.
            assert b["model"] == numel * width
            assert b["partitions"] == b["grads"] == numel * width // 2
        total_states = sum(b["optimizer_state"] for b in per_rank)
        one_process_states = ref["model_state_bytes"] - 2 * numel * width
        assert total_states == one_process_states, name


def test_trainer_with_a_deepspeed_config_runs_the_strategy(ranks):
    """`TrainingArguments(deepspeed=..., precision_strategy="collage-plus")`: BF16 partitions,
    resume_from_checkpoint continues exactly, save_model writes weights a plain model loads."""
    for result in ranks:
        case = result["cases"]["/".join(map(str, TRAINER_CASE))]
        assert "error" not in case, case["error"]
        assert case["zero_optimizer"] == "DeepSpeedZeroOptimizer"
        assert case["partition_dtypes"] == ["torch.bfloat16"]
        assert case["state_dtypes"]["param_error"] == ["torch.bfloat16"]
        assert len(finite(case["losses"])) == 4
        assert_same_losses(case["resumed_losses"], case["losses"], "trainer resumed at step 2")
        assert case["resumed_digest"] == case["digest"]
        assert case["saved_equal"] and case["saved_dtype"] == "torch.bfloat16"
        # save_full_precision: FP32 θ + δθ as this rank's partitions hold it, casting back to θ
        # (DeepSpeed's save wrote the BF16 weights, widened, and labelled them float32).
        full = case["saved_full"]
        assert full["dtypes"] == ["torch.float32"] and full["config_dtype"] == "float32", full
        assert full["own_partitions_equal"] and full["casts_back"] and full["beyond_bf16"] > 0, full


def test_trainer_resumes_fp8_lm_o3_exactly(ranks):
    """fp8-lm-o3 through the Trainer: each rank's masters and FP8 states come back from its own
    ZeRO checkpoint file. save_model gathers every FP8 weight's master from its owner: the saved
    model holds, on every rank's check, the masters that rank owns and the trained other weights."""
    for rank, result in enumerate(ranks):
        case = result["cases"]["/".join(map(str, O3_TRAINER_CASE))]
        assert "error" not in case, case["error"]
        assert case["partition_dtypes"] == ["torch.float32"]
        assert case["state_dtypes"]["grad"] == ["torch.float8_e4m3fn"]
        assert_same_losses(case["resumed_losses"], case["losses"], "trainer resumed at step 2")
        assert case["resumed_digest"] == case["digest"]
        assert case["saved_dtype"] == "torch.float32"
        assert case["saved_equal"], rank
        # save_full_precision: the masters and the FP32 partitions, labelled float32.
        full = case["saved_full"]
        assert full["dtypes"] == ["torch.float32"] and full["config_dtype"] == "float32", full
        assert full["own_partitions_equal"] and full["trained_equal"], (rank, full)


def test_trainer_saves_full_precision_under_zero_3(ranks):
    """bf16-kahan under ZeRO-3 through the Trainer: resume continues exactly, and save_model with
    `save_full_precision` writes FP32 θ + compensation gathered from every rank's shards (the
    ranks without DeepSpeed's gathered 16-bit weights write nothing), casting back to the BF16
    weights the plain save wrote."""
    for rank, result in enumerate(ranks):
        case = result["cases"]["/".join(map(str, KAHAN_TRAINER_CASE))]
        assert "error" not in case, case["error"]
        assert case["zero_optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
        assert_same_losses(case["resumed_losses"], case["losses"], "trainer resumed at step 2")
        full = case["saved_full"]
        assert full["dtypes"] == ["torch.float32"] and full["config_dtype"] == "float32", full
        assert full["own_partitions_equal"] and full["casts_back"] and full["beyond_bf16"] > 0, (rank, full)


def test_every_supported_combination_against_one_process(ranks):
    """Every strategy × stage the table says yes to, against the same strategy in one process.

    Step 1 sees the same weights and data: bit for bit the loss of one process on the ranks' two
    halves (both combine the halves' FP32 means as fl(l₀ + l₁)/2), and within summation rounding
    of one process on the whole batch (124 positive per-token FP32 losses in one sum or in two
    sums of 62: each within n·2⁻²⁴ relative, |Δ| ≤ 2·124·2⁻²⁴·L). Later steps: bit for bit the
    halves' run for every strategy whose update is element-wise and deterministic (the reduced
    gradient fl(g₀ + g₁)/2 is the accumulated one, and an element-wise update does not care that
    DeepSpeed flattens the partitions; neither run clips, see the worker); for the strategies in
    `LAYOUT_DEPENDENT` and against the whole batch, within `first_order_bound` of the whole-batch
    run's gradient norms."""
    assert supported()
    for result in ranks:
        for name, stage in supported():
            zero = finite(result["cases"][f"{name}/{stage}"]["losses"])
            ref = result["references"][name]
            whole, halves = finite(ref["losses"]), finite(ref["halves_losses"])
            assert zero[0] == halves[0], (name, stage, zero, halves)
            assert math.isclose(zero[0], whole[0], rel_tol=2 * TOKENS * 2.0**-24, abs_tol=0.0), (name, stage)
            if name not in LAYOUT_DEPENDENT:  # the same arithmetic on the same values: every step
                assert zero == halves, (name, stage, zero, halves)
            for step in range(1, len(zero)):
                bound = first_order_bound(ref["norms"], step)
                assert abs(zero[step] - halves[step]) <= bound, (name, stage, step, zero, halves, bound)
                assert abs(zero[step] - whole[step]) <= bound, (name, stage, step, zero, whole, bound)


def test_a_nonfinite_gradient_on_one_rank_skips_the_step_on_both(ranks):
    """An inf in one element of rank 0's gradient at step 2 (of a dense parameter; of an FP8 weight
    rank 0 owns under fp8-lm-o3): both ranks skip the step (DeepSpeed's own skip where its
    gradient norm sees the inf, the strategy's where only it holds the gradient), no weight,
    optimizer state or strategy state changes, the strategy counts the skip either way, and
    steps 3 and 4 equal bit for bit a run that never saw batch 2 (fp8-lm-o3: no FP8 gradient of the skipped batch is added to step 3's)."""
    for case_key in NONFINITE_CASES:
        key = "/".join(map(str, case_key))
        cases = [r["cases"][key] for r in ranks]
        for case in cases:
            assert "error" not in case, case["error"]
            # fp8-lm-o3 with the inf in an FP8 weight's gradient: the skipped step zeroes the FP8
            # gradient it was handed (so no NaN reaches a checkpoint), a state change that the next
            # step overwrites; weights and the forward must not change, and steps 3 and 4 must equal
            # the clean run bit for bit (below).
            allowed = ["state"] if case_key[-1] == "fp8" else []
            assert case["changed"] in ([], allowed), (key, case["changed"])
            # Counted once by the strategy (precision/skipped_steps) whoever skipped it: DeepSpeed's
            # own skip never reaches the client optimizer, and went uncounted.
            assert case["skipped"]["strategy"] == 1 and case["skipped"]["deepspeed"] in (0, 1), (key, case["skipped"])
            assert_same_losses(case["losses"], case["clean_losses"], key)
            assert case["digest"] == case["clean_digest"], key
        assert cases[0]["skipped"] == cases[1]["skipped"], key
