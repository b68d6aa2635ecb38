"""`hf-lowprec plan` (issue #69): its inputs checked before any counting, its model state from the
same source as `hf-lowprec memory`, its traffic by engine, and its roofline against every step the
project has measured on a GPU."""

from __future__ import annotations

import json

import pytest

from hf_lowprec.cli import main, memory_plan
from hf_lowprec.planning.communication import communication
from hf_lowprec.planning.gpus import GPUS, MEASURED
from hf_lowprec.planning.roofline import predict_measured
from tests.helpers import TINY_LLAMA as TINY


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch", "4by2048"], "--batch must be SEQUENCESxTOKENS"),
        (["--batch", "0x2048"], "--batch must be SEQUENCESxTOKENS"),
        (["--gpu", "h300"], "unknown GPU 'h300'"),
        (["--gpus", "0"], "--gpus must be at least 1"),
        (["--model", "gpt5"], "--model must be one of"),
        (["--strategies", "fp9"], "--strategies"),
        (["--strategies", ","], "--strategies names no strategy"),
        (["--gpus", "8", "--link-gbps", "0"], "--link-gbps must be a positive bandwidth"),
    ],
)
def test_plan_refuses_bad_input_before_any_work(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "config, message",
    [
        ({"hidden_size": 64, "num_attention_heads": 3}, "not a valid transformers config.json (The hidden size (64)"),
        ({"hidden_size": "64"}, "Field 'hidden_size' expected int"),
        ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
        ({"model_type": "t5", "architectures": None}, "model_type 't5' has no causal-LM class"),
        ({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]}, "not a decoder-only or encoder-only"),
    ],
)
@pytest.mark.parametrize("command", ["plan", "memory"])
def test_a_config_no_model_can_be_built_from_is_a_usage_error(tmp_path, capsys, config, message, command):
    # Tracebacks before: transformers' own validation errors, or a raw tensor error from a worker.
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in {**TINY, **config}.items() if v is not None}))
    with pytest.raises(SystemExit) as exit_:
        main([command, "--model", str(path), "--strategies", "bf16-mixed"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_moe_expert_counts_are_checked(tmp_path, capsys):
    from hf_lowprec.testing.moe import moe_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**moe_config("mixtral", layers=2).to_dict(), "num_experts_per_tok": 9}))
    with pytest.raises(SystemExit):
        main(["memory", "--model", str(path), "--strategies", "bf16-mixed"])
    assert "num_experts_per_tok 9 is more than num_local_experts" in capsys.readouterr().err


@pytest.mark.parametrize("field", ["num_experts_per_tok", "num_experts", "moe_intermediate_size", "head_dim"])
@pytest.mark.parametrize("command", ["plan", "memory"])
def test_a_zero_expert_or_head_size_is_refused_naming_it_before_any_work(tmp_path, capsys, monkeypatch, field, command):
    """Before: `num_experts_per_tok: 0` divided by zero in a counting worker (and `memory` planned
    8 B/param for it), `head_dim: 0` raised from transformers' rotary init, `moe_intermediate_size: 0`
    failed in a GEMM naming no field, and `memory` planned the last two."""
    from hf_lowprec.planning import models
    from hf_lowprec.testing.moe import moe_config

    monkeypatch.setattr(models, "build_model", lambda *a, **k: pytest.fail("built a model"))
    path = tmp_path / "config.json"
    config = moe_config("qwen3_moe", layers=2).to_dict()
    config.pop("num_local_experts", None)  # transformers' alias of num_experts, which it would read instead
    path.write_text(json.dumps({**config, field: 0}))
    with pytest.raises(SystemExit) as exit_:
        main([command, "--model", str(path), "--strategies", "bf16-mixed"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"{field} must be a positive integer, got 0" in err and "Traceback" not in err


def test_a_model_directory_is_read_as_its_config_json(tiny, capsys):
    from pathlib import Path

    assert main(["memory", "--model", str(Path(tiny).parent), "--strategies", "bf16-mixed"]) == 0
    assert "bf16-mixed" in capsys.readouterr().out


def test_sequences_longer_than_learned_positions_are_refused_and_the_default_batch_is_cut(capsys, monkeypatch):
    # gpt2 4x8192 printed a plan of a step that cannot run; bert-base's default 4x2048 crashed.
    with pytest.raises(SystemExit):
        main(["plan", "--model", "gpt2", "--batch", "4x8192"])
    assert "--batch 4x8192: gpt2 holds at most 1024 tokens a sequence" in capsys.readouterr().err
    import hf_lowprec.planning.plan as plan

    seen = []
    monkeypatch.setattr(plan, "plan_rows", lambda model, names, batch, *a: seen.append(batch) or [])
    monkeypatch.setattr(plan, "format_plan", lambda rows, title: title)
    monkeypatch.setattr(plan, "scaling_lines", lambda *a: [])
    main(["plan", "--model", "roberta-base", "--strategies", "bf16-mixed"])
    assert seen == [(4, 512)]
    assert "batch 4x512 per GPU" in capsys.readouterr().out


def test_plan_names_the_peer_rows_for_a_near_miss(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--strategies", "bf16-mixed, torch_amp"])
    assert "Did you mean the peer row 'torch-amp'?" in capsys.readouterr().err


def test_plan_prints_json_rows_whose_model_state_is_hf_lowprec_memory_s(capsys, tiny):
    names = ["bf16-mixed", "fp8-lm-o2"]
    argv = ["plan", "--model", tiny, "--batch", "2x32", "--strategies", ",".join(["torch-amp", *names]), "--json"]
    assert main(argv) == 0
    rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)}
    # The same source, given what the plan prices: an H100 (the default) at 64 tokens a micro-batch.
    memory = {r["strategy"]: r for r in memory_plan(tiny, names, gpu=GPUS["h100"], tokens=64)}
    for name in names:
        assert rows[name]["state_bytes_per_param"] == memory[name]["total"]
        assert rows[name]["bound"] in ("GPU", "host")
        assert rows[name]["step_ms"] > 0 and rows[name]["sent_gb"] == 0
    # torch's recipe holds FP32 weights, gradients and both moments, as bf16-mixed does, and a step
    # count per tensor (bf16-mixed's: 0-dim FP64, 8 B).
    from hf_lowprec.planning.models import build_model

    params = list(dict.fromkeys(build_model(tiny).parameters()))
    n = sum(p.numel() for p in params)
    assert rows["torch-amp"]["state_bytes_per_param"] == memory["bf16-mixed"]["total"]
    assert round(memory["bf16-mixed"]["total"] * n) == 16 * n + 8 * len(params)
    assert rows["bf16-mixed"]["speed_vs_bf16_mixed"] == 1
    # On an H100, 64 tokens through a 64-wide model: no layer is worth its casts (fp8.payoff).
    assert rows["fp8-lm-o2"]["kept_in_bf16"] == [
        "down_proj", "gate_proj", "k_proj", "lm_head", "o_proj", "q_proj", "up_proj", "v_proj"
    ]  # fmt: skip
    # GPT-2's Conv1D layers too: the plan listed only nn.Linear ones, "kept in BF16: lm_head".
    from hf_lowprec.planning.models import rule_options
    from hf_lowprec.planning.plan import _kept_in_bf16

    kept = _kept_in_bf16("fp8-lm-o2", "gpt2", rule_options("fp8-lm-o2", GPUS["h100"], 64))
    assert kept == ["c_attn", "c_fc", "c_proj", "lm_head"]
    # so it holds what bf16-mixed holds, and a few scalars (its gradient scaler and counters)
    assert memory["fp8-lm-o2"]["total"] == pytest.approx(16, rel=1e-3)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Two 2048-wide Llama blocks: at 4x2048 tokens on an H100 FP8 pays on q, o and the MLP."""
    config = {**TINY, "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 16}
    config.update(num_key_value_heads=4, num_hidden_layers=3, max_position_embeddings=2048)
    path = tmp_path_factory.mktemp("wide") / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def _fp8_elements(model, name, tokens):
    """FP8Linear weight elements of `model` as strategy `name` prepares it for an H100 at `tokens`."""
    from hf_lowprec import get_strategy
    from hf_lowprec.fp8 import FP8Linear
    from hf_lowprec.planning.models import build_model, rule_options

    prepared = get_strategy(name, **rule_options(name, GPUS["h100"], tokens)).prepare_model(build_model(model))
    return sum(m.weight.numel() for m in prepared.modules() if isinstance(m, FP8Linear))


def test_fsdp2_reduces_fp8_lm_gradients_in_fp32_and_gathers_only_its_fp8_weights_in_e4m3(tiny, wide):
    """FP8-LM's FP8 all-reduce is a DDP hook: under FSDP2 its gradients reduce in FP32 (its
    policy), its FP8 GEMM weights gather as E4M3 and the rest as BF16 (a layer the rule kept is no
    FP8 weight: the tiny model keeps every one); under DDP, 1 byte per gradient element."""
    from hf_lowprec.planning.plan import plan_rows

    for model, batch in ((tiny, (2, 32)), (wide, (4, 2048))):
        rows = {e: plan_rows(model, ["fp8-lm-o2"], batch, GPUS["h100"], 8, e)[-1] for e in ("ddp", "fsdp2")}
        assert {r["strategy"] for r in rows.values()} == {"fp8-lm-o2"}  # after bf16-mixed, the ratios' row
        params = memory_plan(model, ["fp8-lm-o2"])[0]["num_params"]
        fp8 = _fp8_elements(model, "fp8-lm-o2", batch[0] * batch[1])
        assert (fp8 == 0) == (model == tiny)
        assert rows["ddp"]["sent_gb"] * 1e9 == pytest.approx(2 * 7 / 8 * params * 1)
        # Each block gathered twice a step; the root group (embeddings, norm, LM head) stays gathered: once.
        root = _root_elements(model)
        gathered = 2 * (fp8 * 1 + (params - fp8 - root) * 2) + root * 2
        assert rows["fsdp2"]["sent_gb"] * 1e9 == pytest.approx(7 / 8 * (gathered + params * 4))


def _root_elements(model):
    from hf_lowprec.planning.models import build_model

    built = build_model(model)
    return sum(p.numel() for p in built.parameters()) - sum(p.numel() for p in built.model.layers.parameters())


@pytest.mark.parametrize("name", ["bf16-mixed", "fp8-lm-o2", "collage-plus"])
def test_the_fsdp2_plan_moves_what_the_sharded_model_declares(tiny, one_rank_group, name):
    """The planner's FSDP2 traffic is the bytes `fsdp2_step_bytes` declares for the model as
    `shard_model` shards it (those the 2-rank tests count at the collectives): the root group is
    gathered once a step, the blocks twice (the plan gathered everything twice)."""
    from hf_lowprec import get_strategy
    from hf_lowprec.engines.fsdp2 import shard_model
    from hf_lowprec.engines.traffic import fsdp2_step_bytes
    from hf_lowprec.planning.models import build_model, rule_options
    from hf_lowprec.planning.plan import plan_rows

    row = plan_rows(tiny, [name], (2, 32), GPUS["h100"], 8, "fsdp2")[-1]
    strategy = get_strategy(name, **rule_options(name, GPUS["h100"], 64))
    declared = fsdp2_step_bytes(strategy, shard_model(strategy, build_model(tiny, "cpu")), 1)
    assert row["sent_gb"] * 1e9 == pytest.approx(7 / 8 * (declared["all_gather"] + declared["reduce_scatter"]))


def test_zero2_moves_o3s_fp8_weights_as_fp8_and_the_rest_in_fp32(wide):
    """FP8-LM's own ZeRO: the FP8 weights' gradients all-reduced in FP8 (twice a reduce-scatter's
    bytes), the FP8 weights gathered as bytes; the other parameters are DeepSpeed's FP32 partitions."""
    from hf_lowprec.planning.plan import plan_rows

    rows = {r["strategy"]: r for r in plan_rows(wide, ["fp8-lm-o3"], (4, 2048), GPUS["h100"], 8, "zero2")}
    params = memory_plan(wide, ["fp8-lm-o3"])[0]["num_params"]
    fp8 = _fp8_elements(wide, "fp8-lm-o3", 4 * 2048)
    assert 0 < fp8 < params
    assert rows["fp8-lm-o3"]["sent_gb"] * 1e9 == pytest.approx(7 / 8 * (fp8 * (2 + 1) + (params - fp8) * (4 + 4)))
    assert rows["bf16-mixed"]["sent_gb"] * 1e9 == pytest.approx(7 / 8 * params * (4 + 4))


def test_traffic_per_engine_follows_the_ring_collectives():
    h100, n = GPUS["h100"], 1e9
    ddp = communication("ddp", 8, n, 4.0, 2.0, h100)
    assert ddp.bytes == pytest.approx(2 * 7 / 8 * n * 4)  # an all-reduce of FP32 gradients
    assert ddp.seconds == pytest.approx(ddp.bytes / h100.link)
    fsdp = communication("fsdp2", 64, n, 2.0, 2.0, h100)
    assert fsdp.bytes == pytest.approx(63 / 64 * n * (2 * 2 + 2))  # two gathers, one reduce-scatter
    assert fsdp.seconds == pytest.approx(fsdp.bytes / h100.network)  # past one node
    assert communication("zero2", 1, n, 4.0, 2.0, h100).bytes == 0
    with pytest.raises(ValueError, match="unknown engine"):
        communication("pipeline", 8, n, 4.0, 2.0, h100)


@pytest.mark.parametrize("row", MEASURED, ids=lambda r: f"{r.section}-{r.row}")
def test_the_roofline_is_within_20_percent_of_every_measured_gpu_step(row):
    """Issue #69's goal, on the ledgers kept with the measurements: when a device check disagrees
    by more than 20%, `planning.gpus` is what changes."""
    predicted = predict_measured(row, GPUS[row.gpu]) * 1e3
    assert abs(predicted / row.step_ms - 1) <= 0.2


def test_the_roofline_ranks_the_measured_rows_as_measured():
    for section in {r.section for r in MEASURED}:
        rows = [r for r in MEASURED if r.section == section]
        by_measure = sorted(rows, key=lambda r: r.step_ms)
        by_model = sorted(rows, key=lambda r: predict_measured(r, GPUS[r.gpu]))
        assert [r.row for r in by_model] == [r.row for r in by_measure]


def test_plan_prices_8_64_and_512_gpus_and_finds_where_communication_sets_the_pace(capsys, tiny):
    """Issue #69 item 3: the batch per GPU kept, the step at 8, 64 and 512 GPUs is the longer of
    the counted compute and the engine's traffic at the link crossed (NVLink within a node of 8,
    the network past it); the first GPU count where the traffic is longer is named."""
    from hf_lowprec.hardware import gpu_named
    from hf_lowprec.planning.plan import SCALES, plan_rows

    # A network of 1 MB/s per GPU: every count past one node waits on it, none within.
    gpu = gpu_named("h100", network=1e6)
    row = plan_rows(tiny, ["bf16-mixed"], (2, 32), gpu, 1, "ddp")[0]
    params = memory_plan(tiny, ["bf16-mixed"])[0]["num_params"]
    compute = row["compute_ms"] / 1e3
    for n in SCALES:
        traffic = communication("ddp", n, params, 4.0, 4.0, gpu).seconds
        assert row["step_ms_at_gpus"][n] == pytest.approx(max(compute, traffic) * 1e3)
    assert communication("ddp", 8, params, 4.0, 4.0, gpu).seconds < compute
    assert row["communication_bound_from"] == 16
    # At the H100's own network, the tiny model's traffic never catches up with its step.
    assert plan_rows(tiny, ["bf16-mixed"], (2, 32), GPUS["h100"], 1, "ddp")[0]["communication_bound_from"] is None

    assert (
        main(["plan", "--model", tiny, "--batch", "2x32", "--strategies", "bf16-mixed", "--network-gbps", "0.001"]) == 0
    )
    out = capsys.readouterr().out
    assert "step ms at 8, 64, 512 GPUs" in out
    assert "bf16-mixed" in out and "communication sets the pace from 16 GPUs" in out


def test_plan_leaves_out_what_the_engine_refuses_and_says_why(capsys, tiny):
    """A strategy the engine refuses before training (the support matrix) gets no figures under
    it: a line naming the engine's reason instead; every strategy refused is a usage error. On one
    GPU it is planned, and its rows past one machine say the engine refuses it."""
    argv = ["plan", "--model", tiny, "--batch", "2x32", "--gpus", "8"]
    assert main([*argv, "--engine", "zero2", "--strategies", "bf16-mixed,fp8-lm-o2,fp8-lm-o3", "--json"]) == 0
    captured = capsys.readouterr()
    assert [r["strategy"] for r in json.loads(captured.out)] == ["bf16-mixed", "fp8-lm-o3"]
    assert "not planned under zero2 on 8 GPUs: precision strategy 'fp8-lm-o2' is not supported" in captured.err
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--engine", "fsdp2", "--strategies", "fp8-lm-o3"])
    assert exit_.value.code == 2
    assert "refuses every strategy asked for" in capsys.readouterr().err
    assert main(["plan", "--model", tiny, "--batch", "2x32", "--strategies", "fp8-lm-o3"]) == 0
    out = capsys.readouterr().out
    assert "fp8-lm-o3        not under ddp: precision strategy 'fp8-lm-o3' is not supported under torch DDP" in out


def test_plan_ratios_are_to_bf16_mixed_even_unasked(capsys, tiny):
    """The `× bf16-mixed` columns: bf16-mixed is planned first where the strategies lack it."""
    assert main(["plan", "--model", tiny, "--batch", "2x32", "--strategies", "collage-plus,bf16-pure", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["strategy"] for r in rows] == ["bf16-mixed", "collage-plus", "bf16-pure"]
    base = rows[0]
    for r in rows:
        assert r["speed_vs_bf16_mixed"] == pytest.approx(base["step_ms"] / r["step_ms"])
        assert r["memory_vs_bf16_mixed"] == pytest.approx(r["peak_gib"] / base["peak_gib"])


def test_the_fp8_wire_share_counts_the_experts_fp8_weights(tmp_path):
    # The experts' 3-D weights gather (FSDP2) and reduce (O3's ZeRO) as FP8 too: a Mixtral-like
    # model's share was 0 where three quarters of its parameters are FP8 experts.
    from hf_lowprec.fp8.experts import FP8Experts, expert_weight_names
    from hf_lowprec.planning.models import build_model, rule_options
    from hf_lowprec.planning.plan import _fp8_weight_share
    from hf_lowprec.testing.moe import moe_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps(moe_config("qwen3_moe", layers=3).to_dict()))
    from hf_lowprec import get_strategy

    prepared = get_strategy("fp8-lm-o2", fp8_layers="all").prepare_model(build_model(str(path)))
    experts = sum(
        getattr(m, n).numel() for m in prepared.modules() if isinstance(m, FP8Experts) for n in expert_weight_names(m)
    )
    linear = sum(m.weight.numel() for m in prepared.modules() if type(m).__name__ == "FP8Linear")
    params = memory_plan(str(path), ["bf16-mixed"])[0]["num_params"]
    assert experts > 0
    share = _fp8_weight_share("fp8-lm-o2", str(path), rule_options("fp8-lm-o2", None), params)
    assert share == pytest.approx((experts + linear) / params)


TINY_BERT = {
    "model_type": "bert",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    "head",
    [
        {"architectures": ["BertForSequenceClassification"], "num_labels": 1, "problem_type": "regression"},
        {"architectures": ["BertForSequenceClassification"], "num_labels": 3},
        {"architectures": ["BertForTokenClassification"], "num_labels": 5},
    ],
)
def test_plan_gives_a_classification_head_its_own_labels(tmp_path, capsys, head):
    """The GLUE recipe saves a sequence classifier: the counted step gave it the token ids as
    labels, and every batch failed with "size of tensor a (2) must match ... b (64)"."""
    (tmp_path / "config.json").write_text(json.dumps({**TINY_BERT, **head}))
    argv = ["plan", "--model", str(tmp_path), "--batch", "2x16", "--strategies", "collage-plus", "--json"]
    assert main(argv) == 0
    rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["collage-plus"]["step_ms"] > 0


def test_plan_refuses_a_span_head_naming_it_before_counting(tmp_path, capsys, monkeypatch):
    import hf_lowprec.planning.plan

    def no_counting(*args, **kwargs):
        raise AssertionError("counted a step")

    monkeypatch.setattr(hf_lowprec.planning.plan, "plan_rows", no_counting)
    (tmp_path / "config.json").write_text(json.dumps({**TINY_BERT, "architectures": ["BertForQuestionAnswering"]}))
    with pytest.raises(SystemExit):
        main(["plan", "--model", str(tmp_path), "--batch", "2x16", "--strategies", "collage-plus"])
    assert "BertForQuestionAnswering takes span or choice targets" in capsys.readouterr().err


@pytest.fixture(scope="module")
def one_count(tiny):
    from hf_lowprec.planning.counting import count_step

    return count_step("bf16-mixed", tiny, (2, 32), compiled_layers=False)


@pytest.mark.parametrize("engine, stage", [("ddp", 0), ("zero2", 2), ("fsdp2", 3)])
def test_plan_and_memory_give_the_same_model_state_per_gpu_for_every_strategy(
    tiny, one_count, monkeypatch, engine, stage
):
    """`plan --engine E --gpus 8` and `memory --world-size 8 --zero-stage S` (S the stage whose
    shards E holds) agree for every strategy, and both are ZeRO's split by hand: stage 1 and up
    shard optimizer state and extras, 2 and up gradients, 3 the parameters; stages 1 and 2 add
    the rank's flat weight partition, params / 8 (the plan once left it out under ZeRO-2)."""
    import hf_lowprec
    from hf_lowprec.planning import plan

    names = hf_lowprec.available_strategies()
    # The model state does not depend on the step's count: one count stands in for every strategy's.
    monkeypatch.setattr(plan, "start_counts", lambda names, *a, **k: lambda: dict.fromkeys(names, one_count))
    rows = {r["strategy"]: r for r in plan.plan_rows(tiny, names, (2, 32), GPUS["h100"], 8, engine)}
    memory = {r["strategy"]: r for r in memory_plan(tiny, names, 8, stage, GPUS["h100"], 64)}
    for name in names:
        m = memory[name]
        shards = {"params": stage >= 3, "grads": stage >= 2, "optimizer_states": stage >= 1, "extra": stage >= 1}
        by_hand = sum(m[k] / (8 if sharded else 1) for k, sharded in shards.items())
        by_hand += m["params"] / 8 if stage in (1, 2) else 0.0
        memory_gib = m["per_rank_total"] * m["num_params"] / 2**30
        assert rows[name]["model_state_gib"] == pytest.approx(memory_gib, rel=1e-12), name  # float rounding only
        assert memory_gib == pytest.approx(by_hand * m["num_params"] / 2**30, rel=1e-12), name


def test_o2s_fp8_weight_held_between_steps_on_a_gpu_is_in_memory_and_the_counted_resident_bytes(tiny):
    """On the GPU path FP8-LM O2's optimizer step writes each FP8 GEMM weight's E4M3 copy, which
    the layer keeps until its next forward: 1 B a weight on top of the 6 B of its state. `memory`
    with a GPU named and the count's resident bytes hold it, as two real CPU steps on the GPU path
    (`compiling.gpu_paths`) measure it; on the CPU path nothing is held and `memory` without a GPU
    stays the live model state, to the byte."""
    import contextlib
    import dataclasses

    import torch

    import hf_lowprec
    from hf_lowprec.compiling import gpu_paths
    from hf_lowprec.fp8 import FP8Linear
    from hf_lowprec.fp8.scaled import get_fp8_weight_copy
    from hf_lowprec.planning.counting import count_step, phased_step
    from hf_lowprec.planning.models import build_model
    from hf_lowprec.planning.resident import resident_bytes

    class NoLedger:
        def phase(self, name):
            return contextlib.nullcontext()

    # A GPU the FP8 rule's table lacks: every layer converted, as the live model below.
    gpu = dataclasses.replace(GPUS["h100"], name="a GPU of no table")
    held, resident, planned = {}, {}, {}
    for on_gpu in (False, True):
        torch.manual_seed(0)
        strategy = hf_lowprec.get_strategy("fp8-lm-o2", fp8_layers="all")
        model = strategy.prepare_model(build_model(tiny, device="cpu"))
        optimizer = strategy.create_optimizer([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        ids = torch.randint(0, 512, (2, 32))
        with gpu_paths() if on_gpu else contextlib.nullcontext():
            for _ in range(2):
                phased_step(NoLedger(), strategy, model, optimizer, ids, 1.0)
        copies = [c for c in map(get_fp8_weight_copy, model.parameters()) if c is not None]
        held[on_gpu] = sum(c.payload.untyped_storage().nbytes() + c.scale.untyped_storage().nbytes() for c in copies)
        resident[on_gpu] = resident_bytes(model, optimizer)
        (plan,) = memory_plan(tiny, ["fp8-lm-o2"], gpu=gpu if on_gpu else None)
        planned[on_gpu] = round(plan["total"] * plan["num_params"])
    fp8_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, FP8Linear))
    # An E4M3 weight (1 B each) and its FP32 scale per FP8 layer on the GPU path, none on a CPU.
    layers = sum(isinstance(m, FP8Linear) for m in model.modules())
    assert held == {False: 0, True: fp8_weights + 4 * layers}
    assert resident[True] - resident[False] == held[True]
    assert planned[True] - planned[False] == fp8_weights  # the scales: 4 B a layer, not planned
    # The count runs the GPU path: its resident bytes are the live model's there.
    assert count_step("fp8-lm-o2", tiny, (2, 32), compiled_layers=False).resident_bytes == resident[True]


def test_the_ddp_peak_holds_its_gradient_buckets_the_parameters_bytes_once_more(tiny, one_count, monkeypatch):
    """torch's DDP (the package leaves `gradient_as_bucket_view` off) keeps flat bucket buffers in
    the parameters' dtypes beside `p.grad`: past one GPU the peak per GPU holds the trainable
    parameters' bytes once more, summed here from the prepared model (FP32 for bf16-mixed, BF16
    for bf16-pure, FP16 masters and FP32 rest for fp8-lm-o2)."""
    import hf_lowprec
    from hf_lowprec.planning import plan
    from hf_lowprec.planning.models import build_model, rule_options

    names = ["bf16-mixed", "bf16-pure", "fp8-lm-o2"]
    monkeypatch.setattr(plan, "start_counts", lambda names, *a, **k: lambda: dict.fromkeys(names, one_count))
    peaks = {
        n: {r["strategy"]: r["peak_gib"] for r in plan.plan_rows(tiny, names, (2, 32), GPUS["h100"], n)} for n in (1, 8)
    }
    for name in names:
        prepared = hf_lowprec.get_strategy(name, **rule_options(name, GPUS["h100"], 64)).prepare_model(
            build_model(tiny)
        )
        buckets = sum(p.numel() * p.element_size() for p in prepared.parameters() if p.requires_grad)
        assert (peaks[8][name] - peaks[1][name]) * 2**30 == pytest.approx(buckets, rel=1e-9), name  # float sums


def test_plan_and_memory_mark_a_run_its_first_step_would_refuse(capsys, tiny):
    """64 wide at 2x32 tokens on an H100: fp8-lm-o2 keeps every layer in BF16, so its first step
    refuses the run; plan and memory printed an ordinary row. The reason is the promise check's
    own (`report.promise_violations`) on the model built for real."""
    import hf_lowprec
    from hf_lowprec.planning.models import build_model
    from hf_lowprec.report import promise_violations

    strategy = hf_lowprec.get_strategy("fp8-lm-o2", fp8_gpu="h100", fp8_tokens=64)
    (expected,) = promise_violations(strategy, strategy.prepare_model(build_model(tiny, device="cpu")))
    argv = ["plan", "--model", tiny, "--batch", "2x32", "--strategies", "fp8-lm-o2"]
    assert main([*argv, "--json"]) == 0
    rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["fp8-lm-o2"]["refused"] == expected and rows["bf16-mixed"]["refused"] is None
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert next(line for line in out.splitlines() if line.startswith("fp8-lm-o2 ")).endswith("refused: no FP8 layer")
    assert f"the run would be refused before its first step: {expected}" in out
    memory = ["memory", "--model", tiny, "--strategies", "bf16-mixed,fp8-lm-o2"]
    assert main([*memory, "--gpu", "h100", "--batch", "2x32"]) == 0
    out = capsys.readouterr().out
    assert next(line for line in out.splitlines() if line.startswith("fp8-lm-o2 ")).endswith("refused: no FP8 layer")
    assert f"fp8-lm-o2: the run would be refused before its first step: {expected}" in out
    # Without a GPU every layer 64 wide converts: nothing refused.
    assert main(memory) == 0
    assert "refused" not in capsys.readouterr().out


def test_the_kept_list_of_a_model_with_a_dense_first_block_names_its_experts(tmp_path):
    """DeepSeek-V3 with its first block dense: the plan's "kept in BF16" was read from the model cut
    to one block, which holds no experts, while the refusal on the same line (the whole model) named
    them. The list is the names the whole model, built for real, keeps."""
    import hf_lowprec
    from hf_lowprec.planning.models import build_model, rule_options
    from hf_lowprec.planning.plan import _kept_in_bf16
    from hf_lowprec.testing.moe import moe_config

    path = tmp_path / "config.json"
    moe_config("deepseek_v3", layers=3, first_k_dense_replace=1).to_json_file(str(path))
    options = rule_options("fp8-lm-o2", GPUS["h100"], 64)
    prepared = hf_lowprec.get_strategy("fp8-lm-o2", **options).prepare_model(build_model(str(path), device="cpu"))
    whole = sorted({n.split(".")[-1] for n in prepared.fp8_skipped_layers})
    assert "experts" in whole
    assert _kept_in_bf16("fp8-lm-o2", str(path), options) == whole


def _vision_language_configs():
    import transformers as tf

    text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=32)
    llava = tf.LlavaConfig(
        vision_config={**vision, "patch_size": 8, "model_type": "clip_vision_model"},
        text_config={**text, "model_type": "llama"},
        image_token_index=255,
    )
    qwen2_vl = tf.Qwen2VLConfig(
        text_config={**text, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, patch_size=4, in_channels=3),
    )
    llava.architectures, qwen2_vl.architectures = ["LlavaForConditionalGeneration"], ["Qwen2VLForConditionalGeneration"]
    return {"LlavaConfig": llava, "Qwen2VLConfig": qwen2_vl}


@pytest.mark.parametrize("kind", ["LlavaConfig", "Qwen2VLConfig"])
@pytest.mark.parametrize("command", ["plan", "memory"])
def test_a_vision_language_config_is_refused_naming_the_text_config_before_any_work(tmp_path, capsys, kind, command):
    """`plan` ended in a bare StopIteration from a worker (the depth is text_config's), while
    `memory` planned LLaVA whole; the counted step feeds token ids only, so its vision tower never runs."""
    config = _vision_language_configs()[kind]
    config.to_json_file(str(tmp_path / "config.json"))
    with pytest.raises(SystemExit) as exit_:
        main([command, "--model", str(tmp_path), "--strategies", "bf16-mixed"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"{kind} holds a language model (text_config) and models beside it (vision_config)" in err
    assert "pass the language model's config" in err and "Traceback" not in err
    if kind == "LlavaConfig":  # the fix named: its text_config, saved alone, is planned
        config.text_config.architectures = ["LlamaForCausalLM"]
        config.text_config.to_json_file(str(tmp_path / "config.json"))
        assert main(["memory", "--model", str(tmp_path), "--strategies", "bf16-mixed"]) == 0
