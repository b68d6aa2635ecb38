"""The rollout–training mismatch of GRPO/RLOO (hf_lowprec/integrations/rollout.py, docs/rl.md)."""

from __future__ import annotations

import math

import pytest
import torch

from hf_lowprec.integrations.rollout import MISMATCH_METRICS, MismatchMeter, RolloutLogprobs
from hf_lowprec.testing import DeviceTraffic
from hf_lowprec.testing.llama import llama_config


def _reference(train, rollout, mask):
    """The metrics in FP64, from their definitions."""
    delta = (train.double() - rollout.double())[mask]
    ratio = delta.exp()
    return {
        "precision/rollout_logp_diff_mean": delta.abs().mean().item(),
        "precision/rollout_logp_diff_max": delta.abs().max().item(),
        "precision/rollout_ratio_mean": ratio.mean().item(),
        "precision/rollout_ratio_std": ratio.std(unbiased=False).item(),
        "precision/rollout_ratio_min": ratio.min().item(),
        "precision/rollout_ratio_max": ratio.max().item(),
    }


def test_the_meter_matches_its_fp64_definition_over_micro_batches():
    gen = torch.Generator().manual_seed(0)
    batches = []
    for width in (7, 5):  # micro-batches of different completion lengths, padding masked out
        train = -torch.rand(3, width, generator=gen) * 5
        rollout = train + torch.randn(3, width, generator=gen) * 1e-3
        mask = torch.rand(3, width, generator=gen) > 0.3
        batches.append((train, rollout, mask))
    meter = MismatchMeter()
    for batch in batches:
        meter.add(*batch)
    got = meter.read()
    want = _reference(
        torch.cat([b[0].flatten() for b in batches]),
        torch.cat([b[1].flatten() for b in batches]),
        torch.cat([b[2].flatten() for b in batches]),
    )
    assert set(got) == set(MISMATCH_METRICS)
    for name, value in want.items():
        # FP32 sums of ~20 terms of size 1e-3: relative error a few 2^-24; the spread is computed from
        # r − 1 (expm1), so it keeps its digits even where r itself is 1 to 7 places.
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-9), name
    assert meter.read() == {}  # read starts a fresh interval


def test_the_spread_of_ratios_that_move_together_keeps_its_digits():
    """Every ratio shifted by about exp(−0.05), their spread 1e-6: E[(r−1)²] − E[r−1]² in FP32 would
    lose it (2.4e-3 · 2^-24 ≈ 1.4e-10 of cancellation, √ ≈ 1.2e-5). Each r − 1 is rounded once
    (≤ 2^-25 · 0.05 ≈ 1.5e-9) and so is its deviation from the mean: the spread to within 1e-8."""
    gen = torch.Generator().manual_seed(0)
    batches = []
    for width in (9, 6):
        train = -torch.rand(4, width, generator=gen) * 5
        rollout = train + 0.05 + torch.randn(4, width, generator=gen) * 1e-6
        batches.append((train, rollout, torch.rand(4, width, generator=gen) > 0.2))
    meter = MismatchMeter()
    for batch in batches:
        meter.add(*batch)
    got = meter.read(gather=lambda v: torch.cat([v, v]))  # two ranks with the same vector
    want = _reference(*(torch.cat([b[i].flatten() for b in batches] * 2) for i in range(3)))
    assert got["precision/rollout_ratio_std"] == pytest.approx(want["precision/rollout_ratio_std"], abs=1e-8)
    assert want["precision/rollout_ratio_std"] > 5e-7  # the spread measured is the noise's


def test_a_rank_that_measured_nothing_still_joins_the_gather():
    """Under DDP every rank gathers at every training log: a rank with nothing measured in the
    interval (its rollouts all went through a tool loop) sends an empty vector instead of skipping
    the collective, which would hang its peers."""
    measured, idle = MismatchMeter(), MismatchMeter(torch.device("cpu"))
    train = torch.tensor([[-1.0, -2.0]])
    measured.add(train, train - torch.tensor([[0.25, 0.5]]), torch.ones(1, 2, dtype=torch.bool))
    vectors = [measured._sums.clone()]  # what the measuring rank contributes to the gather
    calls = []

    def gather(local):
        calls.append(local.shape)
        return torch.cat([vectors[0], local])

    got = idle.read(gather)
    assert calls == [torch.Size([7])]
    assert got["precision/rollout_logp_diff_max"] == pytest.approx(0.5)
    assert got["precision/rollout_logp_diff_mean"] == pytest.approx(0.375)
    assert got["precision/rollout_ratio_min"] == pytest.approx(math.exp(0.25))


def test_a_masked_out_or_nan_token_counts_as_no_difference():
    meter = MismatchMeter()
    train = torch.tensor([[-1.0, -2.0, -3.0]])
    rollout = torch.tensor([[-1.5, float("nan"), -100.0]])
    meter.add(train, rollout, torch.tensor([[True, True, False]]))
    got = meter.read()
    assert got["precision/rollout_logp_diff_max"] == pytest.approx(0.5)
    assert got["precision/rollout_logp_diff_mean"] == pytest.approx(0.25)  # (0.5 + 0) / 2 tokens
    assert got["precision/rollout_ratio_max"] == pytest.approx(math.exp(0.5))


def test_the_meter_and_the_recorder_never_wait_on_the_device():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(vocab=64, hidden=32, layers=1, heads=2)).eval()
    ids = torch.randint(0, 64, (2, 5))
    meter = MismatchMeter()
    with torch.no_grad(), RolloutLogprobs(model, temperature=0.7) as recorder:
        model(input_ids=ids)  # the prefill: warm-up outside the counted part
        with DeviceTraffic() as traffic:
            model(input_ids=ids[:, -1:])
            logps = recorder.finish(ids)
            meter.add(logps, logps + 1e-3, torch.ones_like(logps, dtype=torch.bool))
    assert not traffic.syncs and not traffic.copies, traffic.summary()


def test_the_recorder_gives_each_sampled_token_its_log_prob():
    """Greedy decoding of 6 tokens: the recorded log-probs are those of a full forward over the
    final sequence (FP32, no KV-cache effects above FP32 rounding: 1e-5)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(vocab=64, hidden=32, layers=2, heads=2)).eval()
    prompt = torch.randint(0, 64, (3, 4))
    with torch.no_grad(), RolloutLogprobs(model, temperature=2.0) as recorder:
        sequences = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        got = recorder.finish(sequences)
        logits = model(sequences).logits[:, prompt.shape[1] - 1 : -1].double() / 2.0
    want = torch.log_softmax(logits, -1).gather(-1, sequences[:, prompt.shape[1] :, None]).squeeze(-1)
    assert got.shape == (3, 6)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


# --- through TRL --------------------------------------------------------------------------------------

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    from transformers import LlamaForCausalLM

    from hf_lowprec.data import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.padding_side = "left"
    torch.manual_seed(0)
    ids = {k: getattr(tokenizer, k) for k in ("pad_token_id", "eos_token_id", "bos_token_id")}
    config = llama_config(vocab=len(tokenizer), hidden=64, layers=2, positions=128, **ids)
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _trainer(kind, path, tmp_path, strategy, options=None, **overrides):
    from transformers import AutoTokenizer

    import hf_lowprec.trl as hl_trl

    def reward(completions, **kwargs):
        return [len(c) / 10 for c in completions]

    settings = dict(
        output_dir=str(tmp_path),
        precision_strategy=strategy,
        precision_options=options or {},
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        beta=0.04,
        disable_dropout=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    args = getattr(hl_trl, f"{kind}Config")(**{**settings, **overrides})
    prompts = datasets.Dataset.from_dict({"prompt": ["Return the value", "Open a file"] * 4})
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    return getattr(hl_trl, f"{kind}Trainer")(
        model=path,
        reward_funcs=reward,
        args=args,
        train_dataset=prompts,
        eval_dataset=prompts.select(range(4)),
        processing_class=tokenizer,
    )


def _train(kind, path, tmp_path, strategy, **options):
    trainer = _trainer(kind, path, tmp_path, strategy, options)
    trainer.train()
    return trainer, [h for h in trainer.state.log_history if MISMATCH_METRICS[0] in h]


# The mismatch the meter is shown to see: added to the second rollout's log-probs of an FP32 run, whose
# own mismatch is FP32 rounding (< 1e-5), so the logged |Δ| is SHIFT to within that rounding on any CPU.
SHIFT = 0.05


@pytest.mark.parametrize("kind", ["GRPO", "RLOO"])
def test_the_meter_reads_zero_without_a_mismatch_and_the_mismatch_it_is_given(kind, llama_path, tmp_path, monkeypatch):
    """An FP32 run (the KV-cache decode and the full forward differ by FP32 rounding alone) whose
    second rollout's log-probs are shifted by SHIFT: step 1 logs about zero, step 2 logs the shift,
    and both equal the meter's FP64 definition over the inputs it was handed. Machine-independent:
    the mismatch is made by the test, not by one CPU's BF16 rounding (oneDNN's differs per ISA)."""
    finish, add = RolloutLogprobs.finish, MismatchMeter.add
    rollouts, seen = [], []

    def shifted_finish(self, sequences):
        logps = finish(self, sequences)
        rollouts.append(logps)
        return logps + SHIFT if logps is not None and len(rollouts) == 2 else logps

    def recording_add(self, train, rollout, mask):
        seen.append((train.detach().clone(), rollout.clone(), mask.clone()))
        return add(self, train, rollout, mask)

    monkeypatch.setattr(RolloutLogprobs, "finish", shifted_finish)
    monkeypatch.setattr(MismatchMeter, "add", recording_add)
    _, logs = _train(kind, llama_path, tmp_path, "fp32")
    assert len(logs) == 2 and len(seen) == 2  # one measured micro-batch per step, every step logged
    for log, (train, rollout, mask) in zip(logs, seen):
        width = min(train.shape[1], rollout.shape[1])
        want = _reference(train[:, :width], rollout[:, :width], mask[:, :width].bool())
        for name, value in want.items():
            # FP32 sums over < 100 tokens of |Δ| ≤ SHIFT + 1e-5: a few 2^-24 relative (the meter's own test).
            assert log[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    clean, shifted = logs
    # FP32: log-probs of magnitude < 10, each side rounded at 2^-24 relative: well under 1e-5.
    assert clean[MISMATCH_METRICS[1]] < 1e-5
    assert shifted[MISMATCH_METRICS[0]] == pytest.approx(SHIFT, abs=1e-5)
    assert shifted[MISMATCH_METRICS[1]] == pytest.approx(SHIFT, abs=1e-5)
    assert shifted["precision/rollout_ratio_mean"] == pytest.approx(math.exp(-SHIFT), abs=2e-5)


@pytest.mark.parametrize("kind", ["GRPO", "RLOO"])
def test_bf16_rollouts_stay_within_bf16_rounding_of_the_training_forward(kind, llama_path, tmp_path):
    """BF16 decoding may or may not differ from the full forward (on AVX-512-BF16 CPUs the two agree
    to FP32 rounding; on AVX2 they differ by about 1e-3): only the upper bound holds on every machine."""
    _, bf16 = _train(kind, llama_path, tmp_path, "bf16-mixed")
    assert len(bf16) == 2
    worst = max(h[MISMATCH_METRICS[1]] for h in bf16)
    # BF16 logits: each log-prob moves by about |logit|·2^-8; logits here are below 2, so far below 0.1.
    assert 0 <= worst < 0.1
    ratio_spread = max(h["precision/rollout_ratio_std"] for h in bf16)
    assert 0 <= ratio_spread < 0.1


def test_full_forward_rollouts_decode_without_the_kv_cache(llama_path, tmp_path, monkeypatch):
    from transformers import GenerationMixin

    seen = []
    generate = GenerationMixin.generate

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("use_cache"))
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", spy)
    _, logs = _train("GRPO", llama_path, tmp_path, "bf16-mixed", rollout="full_forward")
    assert seen and set(seen) == {False}
    assert logs and all(math.isfinite(h[MISMATCH_METRICS[0]]) for h in logs)


def test_evaluation_rollouts_are_not_measured_nor_make_a_stale_slice_current(llama_path, tmp_path, monkeypatch):
    """Rollouts every 2 steps (steps_per_generation=2), an evaluation after every step: the meter
    takes the first micro-batch after each training rollout (steps 0 and 2), not step 1's slice,
    generated before the update, and nothing of the evaluations."""
    import hf_lowprec.integrations.rollout as rollout

    added = []
    add = rollout.MismatchMeter.add

    def spy(self, *args):
        added.append(trainer.state.global_step if trainer.model.training else "eval")
        return add(self, *args)

    monkeypatch.setattr(rollout.MismatchMeter, "add", spy)
    trainer = _trainer(
        "GRPO",
        llama_path,
        tmp_path,
        "bf16-mixed",
        steps_per_generation=2,
        max_steps=3,
        eval_strategy="steps",
        eval_steps=1,
        per_device_eval_batch_size=4,
    )
    trainer.train()
    assert added == [0, 2]


def test_a_compiled_policy_generates_and_is_measured(llama_path, tmp_path):
    """With `torch_compile=True` the unwrapped model TRL generates with is torch.compile's wrapper,
    whose class has no `generate`: the rollout runs the original module's, and the hook sits on it."""
    trainer = _trainer("GRPO", llama_path, tmp_path, "bf16-mixed")
    trainer.model_wrapped = torch.compile(trainer.model)  # as the Trainer wraps it under torch_compile
    trainer.model.train()
    batch = [{"prompt": p} for p in ["Return the value", "Open a file"] * 2]
    with trainer.precision.forward_context():
        output = trainer._generate_and_score_completions(batch)
    logps = output["hf_lowprec_rollout_logps"]
    assert logps.shape == output["completion_ids"].shape
    assert torch.isfinite(logps).all() and (logps[output["completion_mask"].bool()] < 0).all()
    assert "generate" not in vars(trainer.model_wrapped)  # the patch is gone
