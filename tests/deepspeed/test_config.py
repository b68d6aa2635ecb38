"""The DeepSpeed precision entries a strategy owns, the support matrix, the whole-tensor partition report.

No processes: these check the pure logic of `hf_lowprec.engines.zero` (the 2-rank runs are in
test_zero.py).
"""

import base64
import json
import subprocess
import sys

import pytest
import torch

from hf_lowprec import available_strategies, get_strategy
from hf_lowprec.engines.zero import (
    STAGES,
    apply_precision_config,
    precision_config,
    require_deepspeed,
    support_matrix,
    support_matrix_markdown,
    zero_support,
)
from hf_lowprec.partition import assign_whole_tensors, partition_report
from tests.helpers import tiny_gpt2

BF16_WEIGHTS = ["collage-plus", "collage-light", "bf16-pure", "bf16-kahan", "bf16-sr", "bf16-fp32states"]
AUTO = {
    "zero_optimization": {"stage": 2},
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "train_micro_batch_size_per_gpu": "auto",
}


@pytest.mark.parametrize("name", BF16_WEIGHTS)
def test_bf16_weight_strategies_get_bf16_partitions(name):
    config = precision_config(get_strategy(name), AUTO)
    assert config["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    assert config["fp16"]["enabled"] is False
    assert config["zero_allow_untested_optimizer"] is True
    assert config["train_micro_batch_size_per_gpu"] == "auto"  # not ours: left for the Trainer
    assert AUTO["bf16"] == {"enabled": "auto"}  # the caller's dict is not modified


@pytest.mark.parametrize("name", ["fp32", "bf16-mixed"])
def test_fp32_partition_strategies_keep_deepspeed_in_fp32(name):
    config = precision_config(get_strategy(name), {"zero_optimization": {"stage": 3}})
    assert config["bf16"] == {"enabled": False, "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False}
    assert config["fp16"]["enabled"] is False


def test_explicit_agreeing_values_pass():
    config = {**AUTO, "bf16": {"enabled": "true", "bf16_master_weights_and_grads": True}}
    assert precision_config(get_strategy("collage-plus"), config)["bf16"]["enabled"] is True


@pytest.mark.parametrize(
    "name, patch, key",
    [
        ("collage-plus", {"fp16": {"enabled": True}}, "fp16.enabled"),
        (
            "bf16-pure",
            {"bf16": {"enabled": True, "bf16_master_weights_and_grads": False}},
            "bf16.bf16_master_weights_and_grads",
        ),
        ("collage-light", {"bf16": {"enabled": "auto", "bf16_optimizer_states": False}}, "bf16.bf16_optimizer_states"),
        ("bf16-mixed", {"bf16": {"enabled": True}}, "bf16.enabled"),
        ("fp32", {"fp16": {"enabled": True}}, "fp16.enabled"),
        ("collage-plus", {"zero_allow_untested_optimizer": False}, "zero_allow_untested_optimizer"),
        ("collage-plus", {"optimizer": {"type": "AdamW", "params": {}}}, '"optimizer" section'),
        ("collage-plus", {"data_types": {"grad_accum_dtype": "fp32"}}, "data_types.grad_accum_dtype"),
        (
            "collage-plus",
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
            "zero_optimization.offload_optimizer",
        ),
        # DeepSpeed's older names for the two offloads, accepted before and failing inside DeepSpeed.
        ("collage-plus", {"zero_optimization": {"stage": 2, "cpu_offload": True}}, "zero_optimization.cpu_offload"),
        ("bf16-kahan", {"zero_optimization": {"stage": 3, "cpu_offload_param": "true"}}, "cpu_offload_param"),
        # Accepted silently before: a BF16 forward and BF16 reductions the report said were FP32.
        ("fp32", {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, "torch_autocast.enabled=true"),
        ("fp32", {"communication_data_type": "bf16"}, "communication_data_type='bf16'"),
        ("collage-plus", {"communication_data_type": "fp16"}, "communication_data_type='fp16'"),
    ],
)
def test_contradicting_config_is_refused_naming_the_setting(name, patch, key):
    with pytest.raises(ValueError) as err:
        precision_config(get_strategy(name), {**AUTO, **patch})
    assert key in str(err.value) and repr(name) in str(err.value)


@pytest.mark.parametrize("name, enabled", [("fp32", True), ("bf16-mixed", True), ("collage-plus", False)])
def test_the_legacy_bfloat16_section_is_checked_as_deepspeed_reads_it(name, enabled):
    # DeepSpeed reads "bf16", else its old name "bfloat16" (`get_bfloat16_config`). Before the fix a
    # lone "bfloat16" section was not checked: the strategy's "bf16" beside it won, the user's was dropped.
    ours = not enabled
    config = {"zero_optimization": {"stage": 2}, "bfloat16": {"enabled": enabled}}
    with pytest.raises(ValueError, match=rf"sets bfloat16.enabled={enabled}, but precision strategy {name!r} needs"):
        precision_config(get_strategy(name), config)
    with pytest.raises(ValueError, match=r"bfloat16.enabled"):
        apply_precision_config(get_strategy(name), {}, config)
    agreeing = {"zero_optimization": {"stage": 2}, "bfloat16": {"enabled": ours, "immediate_grad_update": True}}
    for out in (precision_config(get_strategy(name), agreeing), apply_precision_config(get_strategy(name), agreeing)):
        assert "bfloat16" not in out and out["bf16"]["enabled"] is ours and out["bf16"]["immediate_grad_update"]
    precision = pytest.importorskip("deepspeed.runtime.precision_config")
    assert (
        precision.get_bfloat16_config(out).enabled is ours and precision.get_bfloat16_config(out).immediate_grad_update
    )


def test_save_full_precision_under_zero3_needs_the_gathered_save():
    # Without the gather, DeepSpeed writes no model file: the FP32 export was computed and dropped.
    # The check reads the config as Accelerate filled it ("auto" resolved from its launch setting)
    # and the model: transformers gathers a PEFT adapter under ZeRO-3 regardless of the setting.
    from hf_lowprec.integrations.model_saving import refuse_unwritten_export

    peft = pytest.importorskip("peft")
    strategy, model = get_strategy("collage-plus", save_full_precision=True), tiny_gpt2()
    zero3 = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}}
    with pytest.raises(
        ValueError, match=r"ZeRO stage 3: .*zero_optimization.stage3_gather_16bit_weights_on_model_save"
    ):
        refuse_unwritten_export(strategy, zero3, model)
    with pytest.raises(ValueError, match="ZeRO stage 3"):
        refuse_unwritten_export(strategy, {"zero_optimization": {"stage": 3}}, model)
    for key in ("stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"):
        refuse_unwritten_export(strategy, {"zero_optimization": {"stage": 3, key: True}}, model)
    refuse_unwritten_export(strategy, {"zero_optimization": {"stage": 2}}, model)
    refuse_unwritten_export(get_strategy("collage-plus"), zero3, model)
    lora = peft.get_peft_model(tiny_gpt2(), peft.LoraConfig(r=2, target_modules=["c_attn"]))
    refuse_unwritten_export(strategy, zero3, lora)


def test_refused_stages_name_a_combination_that_works():
    with pytest.raises(ValueError, match=r"fp8-lm-o3 with ZeRO stage 1 or 2"):
        precision_config(get_strategy("fp8-lm-o2"), AUTO)
    with pytest.raises(ValueError, match=r"stage 0.*runs under ZeRO stage 1 or 2 or 3"):
        precision_config(get_strategy("collage-plus"), {**AUTO, "zero_optimization": {"stage": 0}})
    with pytest.raises(ValueError, match=r"zero_optimization.stage must be"):
        precision_config(get_strategy("collage-plus"), {**AUTO, "zero_optimization": {"stage": 4}})


def test_training_arguments_refuse_a_contradicting_deepspeed_config_before_any_work(tmp_path):
    from hf_lowprec import TrainingArguments

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**AUTO, "fp16": {"enabled": True}}))
    with pytest.raises(ValueError, match=r"fp16.enabled"):
        TrainingArguments(
            output_dir=str(tmp_path), precision_strategy="collage-plus", deepspeed=str(path), use_cpu=True
        )
    with pytest.raises(ValueError, match="ZeRO stage 2"):
        TrainingArguments(output_dir=str(tmp_path), precision_strategy="fp8-lm-o1", deepspeed=dict(AUTO), use_cpu=True)


def test_a_base64_config_is_read_as_accelerate_reads_it(tmp_path):
    """A base64-encoded JSON config (which Accelerate's HfDeepSpeedConfig and the stock arguments
    accept) is read, filled and checked like the same config given as a dict."""
    from hf_lowprec import TrainingArguments

    def encoded(config):
        return base64.urlsafe_b64encode(json.dumps(config).encode()).decode()

    config = precision_config(get_strategy("collage-plus"), encoded(AUTO))
    assert config == precision_config(get_strategy("collage-plus"), AUTO)
    with pytest.raises(ValueError, match=r"fp16.enabled"):
        precision_config(get_strategy("collage-plus"), encoded({**AUTO, "fp16": {"enabled": True}}))
    args = TrainingArguments(
        output_dir=str(tmp_path), precision_strategy="collage-plus", deepspeed=encoded(AUTO), use_cpu=True
    )
    assert args.hf_deepspeed_config.config["zero_optimization"]["stage"] == 2
    with pytest.raises(ValueError, match=r"neither a file, a JSON object nor base64-encoded JSON"):
        precision_config(get_strategy("collage-plus"), "not a config")


def test_support_matrix_covers_every_registered_strategy_from_one_source():
    matrix = support_matrix()
    assert sorted(matrix) == available_strategies()
    table = support_matrix_markdown()
    rows = {line.split("|")[1].strip().strip("`"): line for line in table.splitlines()[2:]}
    assert sorted(rows) == available_strategies()
    for name, row in matrix.items():
        cells = [c.strip() for c in rows[name].split("|")[2:5]]
        assert cells == ["yes" if row[s] is None else "no" for s in STAGES]
        assert {row[s] is None for s in STAGES} == {True} or name not in BF16_WEIGHTS
        for stage in STAGES:
            assert row[stage] == zero_support(get_strategy(name), stage)


def test_missing_deepspeed_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(ImportError, match=r"install the `deepspeed` extra .*\.\[deepspeed\]"):
        require_deepspeed()


def test_module_imports_without_deepspeed():
    code = (
        "import sys; sys.modules['deepspeed'] = None; import hf_lowprec.engines.zero as d; "
        "print(len(d.support_matrix()), d.precision_config(d.get_strategy('collage-plus'), {'zero_optimization': {'stage': 2}})['bf16']['enabled'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split()[-1] == "True"


# --- whole-tensor distribution ------------------------------------------------------------------
def gpt2_small_shapes() -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(FP8 GEMM weights, other parameters) of GPT-2 small (124M): 12 layers, d=768, vocab 50257."""
    d, layers = 768, 12
    gemm = [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)] * layers
    other = [(50257, d), (1024, d)] + [(d,), (d,), (3 * d,), (d,), (d,), (d,), (4 * d,), (d,)] * layers + [(d,), (d,)]
    return gemm, other


@pytest.mark.parametrize("world", [4, 8])
def test_gpt2_small_fp8_weights_balance_within_the_greedy_bound(world):
    gemm, other = gpt2_small_shapes()
    assert sum(a * b for a, b in gemm) == 84_934_656  # 12 × (3 + 1 + 4 + 4)·768²
    # An O3 owner keeps an FP16 master, an FP8 m and an FP16 v: 5 bytes per element.
    report = partition_report(gemm, world, bytes_per_element=5)
    assert sum(report.bytes_per_rank) == 5 * 84_934_656 and sum(report.tensors_per_rank) == 48
    assert report.lower_bound <= max(report.bytes_per_rank) <= report.greedy_bound
    # The 48 GEMM weights come in 4 sizes whose counts divide by 4 and 8: greedy is exact here.
    assert report.max_min_ratio == 1.0
    # Whole tensors of the full parameter list would not balance: the 38.6M-element embedding
    # alone exceeds T/N and its rank gets nothing else (max/min 1.36 on 4 ranks, 3.24 on 8) —
    # why the non-FP8 parameters go through DeepSpeed's flat partitioning instead.
    everything = partition_report(gemm + other, world, bytes_per_element=5)
    assert everything.lower_bound <= max(everything.bytes_per_rank) <= everything.greedy_bound
    assert max(everything.bytes_per_rank) == 5 * 50257 * 768 > sum(everything.bytes_per_rank) / world
    assert everything.tensors_per_rank[everything.owners[gemm.__len__()]] == 1


def test_greedy_bound_is_attained_by_its_worst_case():
    # Two ranks, sizes 3,3,2,2,2: greedy gives {3,2,2}=7 vs {3,2}=5 while 6/6 is optimal;
    # the bound T/N + (1 − 1/N)·s = 6 + 1.5 = 7.5 holds.
    report = partition_report([3, 3, 2, 2, 2], 2)
    assert report.bytes_per_rank == (7, 5)
    assert report.bytes_per_rank[0] <= report.greedy_bound == 7.5


def test_assignment_edges():
    assert assign_whole_tensors([5, 1, 7], 1) == [0, 0, 0]  # one process: rank 0 owns everything
    assert assign_whole_tensors([], 4) == []
    assert assign_whole_tensors([4, 4, 4, 4], 2) == [0, 1, 0, 1]  # ties: earlier tensor, lower rank
    assert assign_whole_tensors([0, 0, 9], 2) == [1, 1, 0]  # zero-size tensors still get an owner
    report = partition_report([1, 1], 4)
    assert report.tensors_per_rank == (1, 1, 0, 0) and report.max_min_ratio == float("inf")
    with pytest.raises(ValueError, match="world_size"):
        assign_whole_tensors([1], 0)
    with pytest.raises(ValueError, match=">= 0"):
        assign_whole_tensors([-1], 2)


# --- framework glue: the config a launcher already filled --------------------------------------
def fake_accelerator(config: dict, mismatches: list[str]):
    from types import SimpleNamespace

    hf_config = SimpleNamespace(config=config, mismatches=mismatches, _dtype=torch.float32)
    return SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(hf_ds_config=hf_config))), hf_config


def test_configure_accelerator_fills_a_launcher_config_and_drops_flag_mismatches(tmp_path, monkeypatch):
    from hf_lowprec.engines.zero import configure_accelerator

    monkeypatch.delenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", raising=False)
    # Accelerate filled bf16.enabled=False from mixed_precision="no"; transformers then compared
    # it with --bf16 (off): both are the strategy's to decide.
    filled = {
        "zero_optimization": {"stage": 2},
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "train_micro_batch_size_per_gpu": 4,
    }
    accelerator, hf_config = fake_accelerator(
        filled, ["- ds bf16.enabled=True vs hf bf16=False", "- ds other=1 vs hf x=2"]
    )
    configure_accelerator(get_strategy("collage-plus"), accelerator)
    assert filled["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    assert hf_config.mismatches == ["- ds other=1 vs hf x=2"] and hf_config._dtype == torch.bfloat16
    # The file `accelerate launch` names is the user's own config: its explicit values are checked.
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**AUTO, "bf16": {"enabled": False}}))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
    accelerator, _ = fake_accelerator({"zero_optimization": {"stage": 2}, "bf16": {"enabled": False}}, [])
    with pytest.raises(ValueError, match=r"bf16.enabled=False"):
        configure_accelerator(get_strategy("collage-plus"), accelerator)


def test_agreeing_communication_and_autocast_entries_pass():
    precision_config(get_strategy("collage-plus"), {**AUTO, "communication_data_type": "bf16"})
    precision_config(get_strategy("collage-plus"), {**AUTO, "communication_data_type": "fp32"})  # wider: fine
    precision_config(get_strategy("bf16-mixed"), {**AUTO, "communication_data_type": "fp32", "torch_autocast": {}})


def test_flags_accelerate_filled_from_its_launched_mixed_precision_are_the_strategys(monkeypatch):
    # `accelerate launch` with mixed_precision: bf16 and an inline ZeRO config: Accelerate wrote
    # bf16.enabled=True, which bf16-mixed (FP32 partitions) was refused for as if the user had.
    from hf_lowprec.engines.zero import configure_accelerator

    monkeypatch.delenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", raising=False)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    filled = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    accelerator, _ = fake_accelerator(filled, [])
    configure_accelerator(get_strategy("bf16-mixed"), accelerator)
    assert filled["bf16"]["enabled"] is False
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # not launched with one: the value is the user's
    accelerator, _ = fake_accelerator({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}, [])
    with pytest.raises(ValueError, match=r"bf16.enabled=True"):
        configure_accelerator(get_strategy("bf16-mixed"), accelerator)


def test_configure_accelerator_without_deepspeed_is_a_no_op():
    from types import SimpleNamespace

    from hf_lowprec.engines.zero import configure_accelerator, move_state_to_partitions

    configure_accelerator(get_strategy("collage-plus"), SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=None)))
    assert move_state_to_partitions(None) == 0
    assert move_state_to_partitions(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)) == 0
