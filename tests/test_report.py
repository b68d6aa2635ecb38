"""The startup report, the promise check and the silent-precision guard (hf_lowprec.report)."""

import json
import warnings

import pytest
import torch

import hf_lowprec
from hf_lowprec.report import (
    PrecisionPromiseError,
    SilentPrecisionWarning,
    describe,
    format_report,
    zero_per_rank,
)
from tests.helpers import batches, planned_and_measured, tiny_gpt2, train_steps

STRATEGIES = hf_lowprec.available_strategies()


def _dataset(n=8, seq=32):
    from datasets import Dataset

    ids = torch.cat(batches(2, batch=n // 2, seq=seq)).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def _trainer(tmp_path, model, strategy=None, **kwargs):
    args = hf_lowprec.TrainingArguments(
        output_dir=str(tmp_path),
        precision_strategy=strategy,
        max_steps=kwargs.pop("max_steps", 1),
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        **kwargs,
    )
    return hf_lowprec.Trainer(model=model, args=args, train_dataset=_dataset())


@pytest.mark.parametrize("name", STRATEGIES)
def test_planned_bytes_equal_the_bytes_measured_after_a_step(name):
    # The plan reads the optimizer's own state initialisers; after one real step the live
    # storage must hold exactly that (scales and counters: a few bytes per tensor, < 0.01 B/param here).
    planned, measured = planned_and_measured(name)
    for key in ("params", "optimizer_states", "total"):
        assert planned[key] == pytest.approx(measured[key], abs=0.01), (name, key, planned, measured)


def test_zero_partitioning_of_the_plan():
    plan = {"params": 2.0, "grads": 2.0, "optimizer_states": 4.0, "extra": 4.0, "total": 12.0, "num_params": 10.0}
    assert zero_per_rank(plan, 4, 0)["total"] == 12.0
    # Stages 1 and 2 also hold the rank's flat weight partition (params / 4) beside the whole model.
    assert zero_per_rank(plan, 4, 1)["total"] == 2 + 2 + 8 / 4 + 2 / 4
    assert zero_per_rank(plan, 4, 2)["total"] == 2 + 10 / 4 + 2 / 4
    assert zero_per_rank(plan, 4, 3)["total"] == 12 / 4
    with pytest.raises(ValueError, match="ZeRO stage"):
        zero_per_rank(plan, 4, 5)


def test_zero_2_per_rank_matches_the_measured_deepspeed_runs():
    """docs/benchmarks.md "DeepSpeed ZeRO-2 memory per rank" (2 gloo ranks, tiny GPT-2): 12.0 B/param
    for bf16-mixed and 8.0 for collage-plus; the weight partition left out gave 10.0 and 7.0."""
    bf16_mixed = {"params": 4.0, "grads": 4.0, "optimizer_states": 8.0, "extra": 0.0, "num_params": 1.0}
    collage_plus = {"params": 2.0, "grads": 2.0, "optimizer_states": 4.0, "extra": 4.0, "num_params": 1.0}
    assert zero_per_rank(bf16_mixed, 2, 2)["total"] == 12.0
    assert zero_per_rank(collage_plus, 2, 2)["total"] == 8.0


@pytest.mark.parametrize("name", STRATEGIES)
def test_describe_reports_the_live_dtypes(name):
    strategy = hf_lowprec.get_strategy(name)
    model = strategy.prepare_model(tiny_gpt2())
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    report = describe(strategy, model, optimizer)
    json.dumps(report)  # serialisable as it is written to the output directory
    assert report["strategy"] == name
    assert report["violations"] == []
    live: dict[str, int] = {}  # elements per dtype, counted here
    for p in model.parameters():
        if p.requires_grad:
            name = str(p.dtype).removeprefix("torch.")
            live[name] = live.get(name, 0) + p.numel()
    assert report["trainable_param_dtypes"] == live
    assert list(report["trainable_param_dtypes"]) == sorted(live, key=live.get, reverse=True)  # most first
    assert report["memory"]["total"] == pytest.approx(strategy.bytes_per_param, abs=0.1)
    if strategy.uses_fp8_gemm:
        assert report["fp8"]["converted"] > 0
        assert "lm_head" in report["fp8"]["skipped"]  # the LM head stays high precision, with its reason
    text = format_report(report)
    assert name in text and "bytes/param" in text


def test_the_report_counts_each_optimizer_states_dtypes_over_every_parameter():
    # O2 keeps E4M3 m and FP16 v on its FP8 weights, FP32 on the rest: the report named the first
    # parameter's (the FP32 embedding's) only.
    strategy = hf_lowprec.get_strategy("fp8-lm-o2")
    model = strategy.prepare_model(tiny_gpt2())
    report = describe(strategy, model, strategy.create_optimizer(model.parameters(), lr=1e-3))
    fp8 = sum(m.weight.numel() for m in model.modules() if type(m).__name__ == "FP8Linear")
    rest = sum(p.numel() for p in model.parameters()) - fp8
    states = report["optimizer"]["states"]
    assert states["exp_avg"]["dtypes"] == {"float8_e4m3fn": fp8, "float32": rest}
    assert states["exp_avg_sq"]["dtypes"] == {"float16": fp8, "float32": rest}
    assert states["exp_avg"]["dtype"] == ("float8_e4m3fn" if fp8 > rest else "float32")
    share = f"{max(fp8, rest) / (fp8 + rest):.0%}"
    assert f"exp_avg {states['exp_avg']['dtype']} {share} / " in format_report(report)


@pytest.mark.parametrize("name", ["fp8-lm-o1", "fp8-lm-o2", "bf16-mixed"])
def test_the_report_says_where_each_gradient_is_held_as_the_step_finds_it(name):
    """FP8-LM O1 keeps FP32 `p.grad` (rounded to FP8 values each step), O2 the FP8 GEMM weights'
    gradients in FP8AdamW's "grad" state and FP32 `p.grad` elsewhere: the report said one FP8
    dtype "kept by the optimizer" for every parameter. Read against the live gradients the
    optimizer's step sees, and the bytes of the memory figures."""
    strategy = hf_lowprec.get_strategy(name)
    model = strategy.prepare_model(tiny_gpt2())
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    grads = describe(strategy, model, optimizer)["gradients"]
    inner = optimizer.optimizer
    live: dict = {}

    def seen(opt, args, kwargs):
        for p in model.parameters():
            where, g = (
                ("optimizer state 'grad'", opt.state[p]["grad"]) if "grad" in opt.state[p] else ("p.grad", p.grad)
            )
            counts = live.setdefault(where, {})
            name_ = str(g.dtype).removeprefix("torch.")
            counts[name_] = counts.get(name_, 0) + p.numel()

    inner.register_step_pre_hook(seen)
    train_steps(strategy, model, optimizer, batches(1))
    assert grads["held"] == live
    n = sum(p.numel() for p in model.parameters())
    assert sum(sum(c.values()) for c in live.values()) == n
    report = describe(strategy, model, optimizer)  # after the step: from the state as it is
    assert report["gradients"]["held"] == live
    itemsize = {"float32": 4, "float8_e4m3fn": 1}
    held = sum(itemsize[d] * k for c in live.values() for d, k in c.items())
    assert report["memory"]["grads"] == pytest.approx(held / n, abs=1e-4)
    text = format_report(report)
    assert "kept by the optimizer" not in text
    if name == "fp8-lm-o1":
        assert grads["rounded_to_fp8"] == {"float8_e4m3fn": n}
        assert f"float32 in p.grad ({n:,}), {n:,} of them rounded to float8_e4m3fn each step" in text
    else:
        assert "rounded_to_fp8" not in grads


@pytest.mark.parametrize("name", ["bf16-mixed", "fp16-mixed", "fp8-lm-o1", "bf16-pure"])
def test_the_reported_compute_is_what_each_module_puts_out_in_the_forward(name):
    """Under autocast, a linear layer computes in the low dtype, an embedding or a LayerNorm in
    FP32: the report gave every non-FP8 module the strategy's compute dtype."""
    strategy = hf_lowprec.get_strategy(name)
    model = strategy.prepare_model(tiny_gpt2())
    report = describe(strategy, model, strategy.create_optimizer(model.parameters(), lr=1e-3))
    outputs: dict = {}
    for module in model.modules():
        if list(module.parameters(recurse=False)) and "FP8" not in type(module).__name__:
            module.register_forward_hook(
                lambda m, a, out: outputs.setdefault(type(m).__name__, set()).add(str(out.dtype).removeprefix("torch."))
            )
    with torch.no_grad(), strategy.forward_context():
        model(input_ids=batches(1)[0])
    compute = {r["type"]: r["compute"] for r in report["modules"] if r["type"] in outputs}
    assert set(compute) == set(outputs) >= {"Embedding", "LayerNorm", "Linear"}
    autocast = "" if name == "bf16-pure" else " (autocast)"
    assert compute == {t: [f"{d}{autocast}" for d in sorted(dtypes)] for t, dtypes in outputs.items()}


def test_the_report_counts_a_tied_parameter_once_and_names_its_owner():
    strategy = hf_lowprec.get_strategy("bf16-mixed")
    model = strategy.prepare_model(tiny_gpt2())
    report = describe(strategy, model, strategy.create_optimizer(model.parameters(), lr=1e-3))
    rows = {r["type"]: r for r in report["modules"]}
    assert sum(r["trainable_params"] for r in rows.values()) == report["memory"]["num_params"]
    assert rows["Linear"]["trainable_params"] == 0
    assert rows["Linear"]["tied"] == ["lm_head.weight = transformer.wte.weight"]
    assert "; tied: lm_head.weight = transformer.wte.weight" in format_report(report)


@pytest.mark.parametrize("name", ["bf16-mixed", "collage-plus"])
def test_the_report_reads_the_partitions_deepspeed_put_in_the_optimizers_groups(name):
    # DeepSpeed ZeRO swaps the client optimizer's parameters for flat partitions: counting the
    # states over the model's parameters asked the optimizer for groups they are no longer in.
    from hf_lowprec.memory import unwrap_optimizer

    strategy = hf_lowprec.get_strategy(name)
    model = strategy.prepare_model(tiny_gpt2())
    optimizer = strategy.create_optimizer(model.parameters(), lr=1e-3)
    for group in unwrap_optimizer(optimizer).param_groups:
        group["params"] = [torch.cat([p.detach().reshape(-1) for p in group["params"]]).requires_grad_()]
    report = describe(strategy, model, optimizer, deepspeed_stage=2)
    partitions = sum(p.numel() for g in unwrap_optimizer(optimizer).param_groups for p in g["params"])
    assert sum(report["optimizer"]["states"]["exp_avg"]["dtypes"].values()) == partitions
    assert "note" in report["memory"]


def test_trainer_writes_the_report_and_trains(tmp_path):
    trainer = _trainer(tmp_path, tiny_gpt2(), "collage-plus")
    trainer.train()
    report = json.loads((tmp_path / "precision_report.json").read_text())
    assert report["strategy"] == "collage-plus"
    assert report["optimizer"]["states"]["param_error"]["dtype"] == "bfloat16"
    assert "compensation param_error" in report["master_weights"]
    assert trainer.state.global_step == 1


def test_a_broken_dtype_promise_stops_before_the_first_step(tmp_path, monkeypatch):
    from hf_lowprec.strategies.baselines import BF16Pure

    # Sabotage: the strategy "prepares" the model but leaves it in FP32.
    monkeypatch.setattr(BF16Pure, "prepare_model", lambda self, model: model)
    model = tiny_gpt2()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = _trainer(tmp_path, model, "bf16-pure")
    with pytest.raises(PrecisionPromiseError, match=r"float32.*promises bfloat16"):
        trainer.train()
    assert trainer.state.global_step == 0
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n


def test_an_fp8_strategy_without_fp8_layers_stops(tmp_path, monkeypatch):
    import hf_lowprec.strategies.fp8_lm as fp8_lm

    monkeypatch.setattr(fp8_lm, "convert_to_fp8", lambda model, **kw: model)
    trainer = _trainer(tmp_path, tiny_gpt2(), "fp8-lm-o1")
    with pytest.raises(PrecisionPromiseError, match="no FP8 layer") as raised:
        trainer.train()
    assert trainer.state.global_step == 0
    assert "model.half()" not in str(raised.value)  # the dtype advice is for dtype problems only


@pytest.mark.parametrize("strategy", ["fp8-lm-o1", "fp8-lm-o2", "coat"])
def test_a_model_no_layer_of_which_fp8_can_take_is_refused(tmp_path, strategy):
    # Width 40: no GEMM dimension is a multiple of 16, so every layer stays in high precision.
    # coat's FP8 layers come with its FP8 activations: it trained on in BF16 with no word before.
    trainer = _trainer(tmp_path, tiny_gpt2(n_embd=40), strategy)
    with pytest.raises(PrecisionPromiseError, match="no FP8 layer"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_coat_whose_layers_the_speed_rule_keeps_in_bf16_still_trains_on_its_fp8_states():
    from hf_lowprec.fp8 import FP8Linear
    from hf_lowprec.report import promise_violations

    strategy = hf_lowprec.get_strategy("coat", fp8_gpu="h100", fp8_tokens=512)  # FP8 would not pay at 256 wide
    model = strategy.prepare_model(tiny_gpt2(n_embd=256))
    assert not any(isinstance(m, FP8Linear) for m in model.modules())
    assert promise_violations(strategy, model) == []


def test_the_accelerate_plugin_reports_and_checks():
    from accelerate import Accelerator

    plugin = hf_lowprec.PrecisionPlugin("bf16-kahan")
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = plugin.prepare(Accelerator(cpu=True), model, optimizer)
    assert plugin.report["strategy"] == "bf16-kahan"
    assert plugin.report["optimizer"]["states"]["compensation"]["dtype"] == "bfloat16"


def test_silent_precision_guard_warns_once_for_bf16_weights_under_plain_adamw(tmp_path):
    trainer = _trainer(tmp_path, tiny_gpt2().to(torch.bfloat16), max_steps=2)
    with pytest.warns(SilentPrecisionWarning, match="collage-plus.*bf16-kahan.*bf16-sr.*bf16-mixed") as record:
        trainer.train()
    said = [str(w.message) for w in record if issubclass(w.category, SilentPrecisionWarning)]
    assert len(said) == 1
    # Elements, as it says (it printed the number of tensors, "28 trainable parameter elements").
    elements = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert said[0].startswith(f"{elements:,} trainable parameter elements are bfloat16")


@pytest.mark.parametrize("strategy", [None, "bf16-pure"])
def test_silent_precision_guard_stays_quiet_when_nothing_is_hidden(tmp_path, strategy):
    # FP32 weights lose nothing; a chosen strategy is a visible choice (bf16-pure is reported at startup).
    trainer = _trainer(tmp_path, tiny_gpt2(), strategy)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SilentPrecisionWarning)
        trainer.train()
    assert trainer.state.global_step == 1


def test_multihead_attention_gemms_are_reported_high_precision_and_counted_in_the_fp8_share():
    """nn.MultiheadAttention hands in_proj_weight and out_proj.weight to
    F.multi_head_attention_forward, so no swap reaches them: both are listed as kept high precision
    with that reason (out_proj was listed as 'a subclass of nn.Linear', in_proj not at all), and the
    FP8 share counts them. Hand count per token, d = 64, feed-forward 128: q/k/v 3·64·64 = 12,288,
    out_proj 64·64 = 4,096 (BF16); linear1 and linear2 128·64 each = 16,384 (FP8): share
    16,384 / 32,768 = 0.5 (0.6667 before, the q/k/v GEMM left out of the total)."""
    from torch import nn

    from hf_lowprec.fp8 import FP8Linear, convert_to_fp8
    from hf_lowprec.fp8.experts import weight_gemm_share

    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)))
    layer = model[0]
    assert isinstance(layer.linear1, FP8Linear) and isinstance(layer.linear2, FP8Linear)
    skipped = model.fp8_skipped_layers
    assert set(skipped) == {"0.self_attn", "0.self_attn.out_proj"}, skipped
    assert "in_proj_weight" in skipped["0.self_attn"] and "out_proj.weight" in skipped["0.self_attn.out_proj"]
    assert all("F.multi_head_attention_forward" in reason for reason in skipped.values())
    assert weight_gemm_share(model)["share"] == 16_384 / 32_768
    report = describe(hf_lowprec.get_strategy("fp8-lm-o1"), model)
    assert report["fp8"]["weight_gemm_share"] == 0.5 and report["fp8"]["skipped"] == skipped
    # Separate q/k/v weights (kdim = 32, vdim = 48): 64·64 + 64·32 + 64·48 = 9,216 in BF16, out_proj 4,096.
    cross = convert_to_fp8(nn.Sequential(nn.MultiheadAttention(64, 4, kdim=32, vdim=48), nn.Linear(64, 128)))
    assert "q/k/v_proj_weight" in cross.fp8_skipped_layers["0"]
    assert weight_gemm_share(cross)["share"] == 8_192 / (9_216 + 4_096 + 8_192)


def test_siglip_pooling_head_attention_is_reported_and_counted():
    """SigLIP's attention-pooling head is an nn.MultiheadAttention. Hand count per token, hidden 64,
    MLP 128, 2 layers: each layer's q, k, v, o (4·64·64) and MLP (2·128·64) = 32,768 in FP8; the
    head's MLP 16,384 in FP8, its q/k/v 3·64·64 = 12,288 and out_proj 4,096 in BF16: share
    81,920 / 98,304 = 0.8333 (0.9524 before: the q/k/v GEMM left out)."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(0)
    config = SiglipVisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8
    )
    strategy = hf_lowprec.get_strategy("fp8-lm-o1")
    model = strategy.prepare_model(SiglipVisionModel(config))
    fp8 = describe(strategy, model)["fp8"]
    assert fp8["converted"] == 2 * 6 + 2
    assert set(fp8["skipped"]) == {"head.attention", "head.attention.out_proj"}
    assert fp8["weight_gemm_share"] == round(81_920 / 98_304, 4)
