"""The frozen models beside the policy (TRL's reference, reward and teacher models) through
`hf_lowprec.trl`: what they hold after training, which ones are frozen when TRL builds them, the
`frozen_models="policy"` and `sync_ref_model` exceptions, the log-probabilities a frozen reference
computes against FP64, the startup report and the PPO path (integrations/frozen.py)."""

from __future__ import annotations

import copy
import itertools
import json
import logging
import math
from typing import ClassVar

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from transformers.pytorch_utils import Conv1D  # noqa: E402

import hf_lowprec.trl as hl_trl  # noqa: E402
from hf_lowprec.fp8.blocks import BLOCK, FrozenBlockFP8Linear  # noqa: E402
from hf_lowprec.fp8.linear import FP8Linear  # noqa: E402
from hf_lowprec.integrations.frozen import FROZEN_ATTR, frozen_footprint  # noqa: E402
from hf_lowprec.report import format_report  # noqa: E402
from tests.helpers import (  # noqa: E402  # noqa: E402
    PAIRS,
    assert_bits_equal,
    left_padded_tokenizer,
    no_activation_checkpointing,
    ppo_trainer,
    tiny_lm,
    tiny_scorer,
    trl_args,
    unit_roundoff,
)

E4M3 = torch.float8_e4m3fn
# The tiny GPT-2's decoder blocks: 2 layers of 4 Conv1D (c_attn, attn.c_proj, c_fc, mlp.c_proj).
BLOCK_LINEARS = 8
PROMPTS = {"prompt": ["Return the", "Open a file"]}


@pytest.fixture(scope="module")
def tokenizer():
    return left_padded_tokenizer()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokenizer):
    """A tiny policy and a tiny reward model saved with the tokenizer, for TRL to load by path."""
    root = tmp_path_factory.mktemp("saved")
    for name, model in (("lm", tiny_lm(tokenizer)), ("rm", tiny_scorer(tokenizer))):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return {"lm": str(root / "lm"), "rm": str(root / "rm")}


def dpo(tmp_path, tokenizer, strategy, model, ref_model=None, **overrides):
    args = trl_args("DPOConfig", tmp_path, strategy, max_length=32, **overrides)
    return hl_trl.DPOTrainer(
        model=model,
        ref_model=ref_model,
        args=args,
        train_dataset=datasets.Dataset.from_dict(PAIRS),
        processing_class=tokenizer,
    )


def param_dtypes(model):
    return {p.dtype for p in model.parameters()}


def block_fp8_bytes_per_param(model):
    """Bytes per parameter of a model frozen in FP8 blocks, from the format alone: 1 byte per E4M3
    element, 4 per FP32 scale (one per started 128×128 block), 2 per BF16 element elsewhere; the
    input/output embedding (GPT-2 ties them) left out, scales not counted as parameters."""
    edge = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is edge  # tied
    stored = params = 0
    for module in model.modules():
        if isinstance(module, FrozenBlockFP8Linear):
            rows, cols = module.weight.shape
            blocks = math.ceil(rows / BLOCK[0]) * math.ceil(cols / BLOCK[1])
            assert module.weight.dtype == E4M3 and module.weight_scale_inv.dtype == torch.float32
            assert module.weight_scale_inv.numel() == blocks
            stored += rows * cols + 4 * blocks
            params += rows * cols
            others = [module.bias] if module.bias is not None else []
        else:
            others = list(module.parameters(recurse=False))
        for p in others:
            if p is not edge:
                assert p.dtype == torch.bfloat16
                stored += 2 * p.numel()
                params += p.numel()
    return stored / params


# ---------------------------------------------------------------------------------------------
# a reference passed in, through training, and the startup report
# ---------------------------------------------------------------------------------------------

# (strategy, what the reference's parameters hold, the stored facts' "storage")
PASSED_REFERENCE = [
    ("fp32", torch.float32, "float32"),
    ("bf16-mixed", torch.bfloat16, "bfloat16"),
    ("collage-plus", torch.bfloat16, "bfloat16"),
    ("fp16-mixed", torch.float16, "float16"),
    ("fp8-lm-o2", E4M3, "fp8-blocks"),
    ("coat", E4M3, "fp8-blocks"),
]


@pytest.mark.parametrize("strategy, held, storage", PASSED_REFERENCE, ids=[p[0] for p in PASSED_REFERENCE])
def test_a_passed_reference_holds_its_forward_precision_through_dpo_training(
    tmp_path, tokenizer, caplog, strategy, held, storage
):
    policy, reference = tiny_lm(tokenizer), tiny_lm(tokenizer)
    # The one step must update the policy: FP16's first loss scale (2^16) overflows this DPO
    # loss's gradients under TRL 1.13 and 1.14, and the scaler rightly skips that step.
    options = {"init_scale": 2.0**8} if strategy == "fp16-mixed" else None
    trainer = dpo(tmp_path, tokenizer, strategy, policy, reference, precision_options=options)
    assert trainer.ref_model is reference  # frozen in place, before TRL's __init__
    frozen = {name: p.detach().clone() for name, p in reference.named_parameters()}
    trained = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    with caplog.at_level(logging.INFO, logger="hf_lowprec.integrations.trainer"):
        trainer.train()
    assert trainer.state.global_step == 1 and trainer.precision.skipped_steps == 0
    assert any(not torch.equal(trained[n], p) for n, p in trainer.model.named_parameters())  # the policy moved
    for name, p in reference.named_parameters():  # the reference did not
        assert not p.requires_grad and p.grad is None
        assert_bits_equal(p.detach(), frozen[name], name)

    footprint = frozen_footprint(reference)
    per_param = footprint["blocks_bytes_per_param"]
    if held == E4M3:
        converted = [m for m in reference.transformer.h.modules() if isinstance(m, FrozenBlockFP8Linear)]
        assert len(converted) == BLOCK_LINEARS
        assert not any(isinstance(m, Conv1D) for m in reference.modules())
        # The LM head is not converted: a BF16 nn.Linear tied to the BF16 input embedding.
        head = reference.lm_head
        assert type(head) is nn.Linear and head.weight is reference.transformer.wte.weight
        assert head.weight.dtype == torch.bfloat16
        assert param_dtypes(reference) == {E4M3, torch.float32, torch.bfloat16}  # FP32: the block scales only
        assert per_param == pytest.approx(block_fp8_bytes_per_param(reference), rel=1e-12)
        assert per_param <= 1.1  # 1 byte + 4 bytes per 128×128 block + the BF16 norms, biases, positions
    else:
        assert param_dtypes(reference) == {held}  # no FP32 parameter under the 16-bit strategies
        assert per_param == held.itemsize  # exactly 4.0 under fp32, 2.0 under the 16-bit strategies

    facts = trainer.hf_lowprec_frozen_models
    assert set(facts) == {"reference"} and facts["reference"] is reference.__dict__[FROZEN_ATTR]
    assert facts["reference"]["role"] == "reference" and facts["reference"]["storage"] == storage
    report = json.loads((tmp_path / "precision_report.json").read_text())
    written = report["frozen_models"]["reference"]
    assert written["storage"] == storage
    assert written["bytes"] == footprint["bytes"] and written["blocks_bytes_per_param"] == per_param
    line = (
        f"  frozen reference model: {per_param:.2f} bytes/param in its decoder blocks ({storage}), "
        f"{footprint['bytes'] / 1e6:.1f} MB in all"
    )
    assert line in format_report(report).splitlines()
    assert any(line in record.getMessage().splitlines() for record in caplog.records)  # logged at startup


# ---------------------------------------------------------------------------------------------
# the frozen models TRL builds from names
# ---------------------------------------------------------------------------------------------


def assert_frozen_fp8(model, role, linears=BLOCK_LINEARS):
    facts = model.__dict__[FROZEN_ATTR]
    assert facts["role"] == role and facts["storage"] == "fp8-blocks" and facts["fp8_layers"] == linears
    blocks = [m for m in model.modules() if isinstance(m, FrozenBlockFP8Linear)]
    assert len(blocks) == linears and not any(p.requires_grad for p in model.parameters())
    assert param_dtypes(model) == {E4M3, torch.float32, torch.bfloat16}
    assert {p.dtype for m in blocks for p in m.parameters(recurse=False)} == {E4M3, torch.float32, torch.bfloat16}


def assert_frozen_16bit(model, role, dtype=torch.bfloat16):
    facts = model.__dict__[FROZEN_ATTR]
    assert facts["role"] == role and facts["storage"] == str(dtype).removeprefix("torch.")
    assert param_dtypes(model) == {dtype} and not any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("kind, strategy", [("DPO", "bf16-mixed"), ("KTO", "fp8-lm-o2")])
def test_the_reference_trl_loads_from_the_policy_path_is_frozen(tmp_path, tokenizer, saved, kind, strategy):
    if kind == "DPO":
        trainer = dpo(tmp_path, tokenizer, strategy, saved["lm"])
    else:
        data = {"prompt": ["Return the", "Open a"], "completion": [" value of x", " reading for file"]}
        trainer = hl_trl.KTOTrainer(
            model=saved["lm"],
            args=trl_args("KTOConfig", tmp_path, strategy, max_length=32),
            train_dataset=datasets.Dataset.from_dict({**data, "label": [True, False]}),
            processing_class=tokenizer,
        )
    reference = trainer.ref_model
    assert reference is not None and reference is not trainer.model
    if strategy == "bf16-mixed":
        assert_frozen_16bit(reference, "reference")
        assert param_dtypes(trainer.model) == {torch.float32}  # the policy keeps its FP32 masters
    else:
        assert_frozen_fp8(reference, "reference")
        assert any(isinstance(m, FP8Linear) for m in trainer.model.modules())  # the policy: FP8 GEMMs
    assert set(trainer.hf_lowprec_frozen_models) == {"reference"}
    trainer.train()
    assert trainer.state.global_step == 1 and trainer.ref_model is reference


def reward_length(completions, **kwargs):
    return [len(c) / 10 for c in completions]


@pytest.mark.parametrize("kind, strategy", [("GRPO", "fp8-lm-o2"), ("RLOO", "bf16-mixed"), ("GRPO", "coat")])
def test_grpo_and_rloo_freeze_the_reference_and_a_reward_model_given_by_path(
    tmp_path, tokenizer, saved, kind, strategy
):
    args = trl_args(
        f"{kind}Config",
        tmp_path,
        strategy,
        beta=0.04,  # GRPO's default 0 builds no reference
        num_generations=2,
        max_completion_length=8,
        **no_activation_checkpointing(),
    )
    trainer = getattr(hl_trl, f"{kind}Trainer")(
        model=saved["lm"],
        reward_funcs=[saved["rm"], reward_length],
        args=args,
        train_dataset=datasets.Dataset.from_dict(PROMPTS),
        processing_class=tokenizer,
    )
    reference, reward = trainer.ref_model, trainer.reward_funcs[0]
    assert trainer.reward_funcs[1] is reward_length
    if strategy == "bf16-mixed":
        assert_frozen_16bit(reference, "reference")
        assert_frozen_16bit(reward, "reward")
    else:
        assert_frozen_fp8(reference, "reference")
        # The scorer's decoder blocks; its 64→1 score head, outside the blocks, stays 16-bit.
        assert_frozen_fp8(reward, "reward", BLOCK_LINEARS)
        assert type(reward.score) is nn.Linear and reward.score.weight.dtype == torch.bfloat16
        assert type(reference.lm_head) is nn.Linear and reference.lm_head.weight.dtype == torch.bfloat16
    # Two reward functions: the model is the first, the function has no entry.
    assert set(trainer.hf_lowprec_frozen_models) == {"reference", "reward[0]"}
    assert trainer.hf_lowprec_frozen_models["reward[0]"] is reward.__dict__[FROZEN_ATTR]
    trainer.train()
    assert trainer.state.global_step == 1
    assert trainer.ref_model is reference and trainer.reward_funcs[0] is reward
    assert "rewards/reward_length/mean" in trainer.state.log_history[0]


@pytest.mark.parametrize("strategy", ["bf16-mixed", "fp8-lm-o2"])
def test_the_distillation_teacher_loaded_by_path_is_frozen(tmp_path, tokenizer, saved, strategy):
    trainer = hl_trl.DistillationTrainer(
        model=saved["lm"],
        teacher_model=saved["lm"],
        args=trl_args("DistillationConfig", tmp_path, strategy, max_completion_length=4),
        train_dataset=datasets.Dataset.from_dict(PROMPTS),
        processing_class=tokenizer,
    )
    teacher = trainer.teacher_model
    if strategy == "bf16-mixed":
        assert_frozen_16bit(teacher, "teacher")
    else:
        assert_frozen_fp8(teacher, "teacher")
    assert set(trainer.hf_lowprec_frozen_models) == {"teacher"}
    if strategy == "bf16-mixed":
        trainer.train()
        assert trainer.state.global_step == 1 and math.isfinite(trainer.state.log_history[0]["loss"])


# ---------------------------------------------------------------------------------------------
# the old behaviour on request, and a reference that follows the policy
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["fp8-lm-o2", "bf16-mixed"])
def test_frozen_models_policy_prepares_the_reference_like_the_policy(tmp_path, tokenizer, strategy):
    reference = tiny_lm(tokenizer)
    trainer = dpo(
        tmp_path, tokenizer, strategy, tiny_lm(tokenizer), reference, precision_options={"frozen_models": "policy"}
    )
    assert not any(isinstance(m, FrozenBlockFP8Linear) for m in reference.modules())
    assert not any(p.requires_grad for p in reference.parameters())
    facts = trainer.hf_lowprec_frozen_models["reference"]
    assert facts["storage"] == "as the policy"
    if strategy == "fp8-lm-o2":
        # As the policy: FP8Linear layers over FP16 scaled masters, the LM head FP32.
        assert sum(isinstance(m, FP8Linear) for m in reference.modules()) == BLOCK_LINEARS
        assert param_dtypes(reference) == param_dtypes(trainer.model) == {torch.float16, torch.float32}
    else:
        assert param_dtypes(reference) == {torch.float32} and facts["blocks_bytes_per_param"] == 4.0


@pytest.mark.parametrize("strategy", ["bf16-mixed", "fp8-lm-o2", "collage-plus"])
def test_sync_ref_model_keeps_the_reference_as_trl_built_it_and_syncs_it(tmp_path, tokenizer, saved, strategy):
    # TRL's sync mixed each policy parameter as stored: fp8-lm-o2's FP16 master times its scale (the
    # reference's linear weights came out 2¹⁹ times too large), Collage's θ without δθ. The mix is
    # of the weights the strategy's optimizer holds, as `full_precision_state_dict` exports them.
    alpha = 0.5
    trainer = dpo(
        tmp_path,
        tokenizer,
        strategy,
        saved["lm"],
        sync_ref_model=True,
        ref_model_sync_steps=1,
        ref_model_mixup_alpha=alpha,
    )
    reference = trainer.ref_model
    assert FROZEN_ATTR not in reference.__dict__ and trainer.hf_lowprec_frozen_models == {}
    assert param_dtypes(reference) == {torch.float32}  # as TRL loads it
    before = {name: p.detach().clone() for name, p in reference.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 1
    full = trainer.precision.full_precision_state_dict(trainer.model, trainer.optimizer)
    # After the step the reference is (1 − α)·itself + α·policy. α = 1/2 scales exactly, so each
    # element is one FP32 addition away: relative error ≤ u = 2⁻²⁴ of the exact sum.
    u = unit_roundoff(torch.float32)
    moved = 0
    for name, p in reference.named_parameters():
        expected = before[name].double() * (1 - alpha) + full[name].double() * alpha
        assert ((p.double() - expected).abs() <= u * expected.abs()).all(), name
        moved += int(not torch.equal(before[name], p))
    assert moved > 0


def test_sync_ref_model_refuses_a_frozen_reference_and_a_strategy_it_cannot_read(tmp_path, tokenizer):
    # A reference a first trainer froze to FP8 blocks failed at step 1 inside TRL (no mul_ on E4M3).
    reference = tiny_lm(tokenizer)
    dpo(tmp_path, tokenizer, "fp8-lm-o2", tiny_lm(tokenizer), reference)
    with pytest.raises(ValueError, match=r"frozen already by precision_strategy='fp8-lm-o2'.*fresh copy"):
        dpo(tmp_path, tokenizer, "fp8-lm-o2", tiny_lm(tokenizer), reference, sync_ref_model=True)
    # fp8-lm-o3's masters live with the ranks that own them: refused before any model changes.
    fresh = tiny_lm(tokenizer)
    with pytest.raises(ValueError, match="sync_ref_model=True with precision_strategy='fp8-lm-o3'"):
        dpo(tmp_path, tokenizer, "fp8-lm-o3", tiny_lm(tokenizer), fresh, sync_ref_model=True)
    assert FROZEN_ATTR not in fresh.__dict__


UNPAIRED = {
    "prompt": ["Return the", "Open a"],
    "completion": [" value of x", " reading for file"],
    "label": [True, False],
}


@pytest.mark.parametrize(
    "kind, strategy", [("DPO", "fp8-lm-o2"), ("DPO", "bf16-mixed"), ("DPO", "fp16-als"), ("KTO", "collage-plus")]
)
def test_precomputed_reference_log_probs_of_a_lora_policy_are_its_own_at_step_0(tmp_path, tokenizer, kind, strategy):
    # The reference is the policy with its adapter off (LoRA B starts at 0: the same function). TRL
    # precomputes its log-probs in __init__; before the strategy has prepared the model they were
    # FP32 numbers against FP8/BF16/FP16 ones in training, and step 0's rewards were not 0 (fp8-lm-o2:
    # 1.5e-3). Computed as training computes them, they are the same bits: rewards exactly 0.
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], task_type="CAUSAL_LM")
    data = datasets.Dataset.from_dict(PAIRS if kind == "DPO" else UNPAIRED)
    args = trl_args(f"{kind}Config", tmp_path, strategy, max_length=32, precompute_ref_log_probs=True)
    trainer = getattr(hl_trl, f"{kind}Trainer")(
        model=tiny_lm(tokenizer),
        args=args,
        train_dataset=data,
        eval_dataset={"held": data},
        processing_class=tokenizer,
        peft_config=lora,
    )
    assert trainer.ref_model is None
    columns = {"ref_chosen_logps", "ref_rejected_logps"} if kind == "DPO" else {"ref_logps", "ref_KL_logps"}
    for dataset in (trainer.train_dataset, trainer.eval_dataset["held"]):
        assert columns <= set(dataset.column_names)
    trainer.train()
    logged = next(entry for entry in trainer.state.log_history if "loss" in entry)
    rewards = {key: value for key, value in logged.items() if key.startswith("rewards/") and "accurac" not in key}
    assert rewards and all(value == 0 for value in rewards.values()), rewards
    if kind == "DPO":  # -log σ(0)
        assert logged["loss"] == pytest.approx(math.log(2), abs=1e-6)


@pytest.mark.parametrize("strategy", ["fp8-lm-o2", "bf16-mixed"])
def test_sync_ref_model_keeps_a_passed_reference_as_passed(tmp_path, tokenizer, strategy):
    # Frozen to FP8 blocks, the reference would make TRL's sync fail (no mul_ on an E4M3 tensor).
    reference = tiny_lm(tokenizer)
    trainer = dpo(tmp_path, tokenizer, strategy, tiny_lm(tokenizer), reference, sync_ref_model=True)
    assert FROZEN_ATTR not in reference.__dict__ and trainer.hf_lowprec_frozen_models == {}
    assert param_dtypes(reference) == {torch.float32}
    assert not any(isinstance(m, FrozenBlockFP8Linear) for m in reference.modules())


# ---------------------------------------------------------------------------------------------
# what the frozen reference computes, against FP64
# ---------------------------------------------------------------------------------------------


class _Perturbations(TorchFunctionMode):
    """In an FP64 forward, multiplies each result that depends on the weights by (1 + e), e a zero
    leaf: ∂f/∂e = a·∂f/∂a, the first-order change of f when a is rounded with relative error e.

    Results that copy or select values without rounding (views, copies, gathers) are left alone."""

    EXACT: ClassVar[set[str]] = {
        "clone",
        "contiguous",
        "to",
        "dropout",
        "embedding",
        "cat",
        "stack",
        "reshape",
        "expand",
        "where",
    }

    def __init__(self):
        super().__init__()
        self.leaves = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if (
            isinstance(out, torch.Tensor)
            and out.dtype == torch.float64
            and out.requires_grad
            and out._base is None
            and name not in self.EXACT
            and not any(out is a for a in args)
        ):
            e = torch.zeros_like(out, requires_grad=True)
            self.leaves.append(e)
            out = out * (1 + e)
        return out


def token_logprobs(logits, ids):
    """log p(token t+1 | ..t), in FP64 from the model's logits."""
    return logits[:, :-1].double().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]


def trained_like(tokenizer, seed=0):
    """The tiny LM with weights 5× GPT-2's initial scale and random biases and norm gains, as a
    trained model's (at initialisation the biases are 0 and the gains 1, both exact in BF16, and the
    log-probs all sit near −log V whatever the weights)."""
    model = tiny_lm(tokenizer, seed, initializer_range=0.1).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))
            elif p.dim() == 1:  # a LayerNorm's gain
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=generator))
    return model


def rounding_sigmas(model, ids, weight_error_sq):
    """Per token: σ of its log-probability's error when every intermediate result is rounded to
    BF16 and every weight w is stored with E[δw²] = `weight_error_sq(name, w)`, from the FP64 model.

    A round to nearest leaves δ uniform in ±ulp/2 ≤ ±u·|a|, so E[δ²] ≤ u²·a²/3 (u = 2⁻⁸ for BF16);
    to first order the error is Σⱼ gⱼ·δⱼ with gⱼ = ∂logp/∂aⱼ, and the δⱼ are independent and zero
    mean, so Var = Σⱼ gⱼ²·E[δⱼ²]. Results the BF16 forward computes in FP32 are counted too (an
    upper bound). The FP64 model runs eager attention: the same function as SDPA, with the
    rounding points of the BF16 kernel (scores, probabilities, output) as separate results."""
    u = unit_roundoff(torch.bfloat16)
    model64 = copy.deepcopy(model).double().eval()
    model64.config._attn_implementation = "eager"
    params = dict(model64.named_parameters())
    with _Perturbations() as mode:
        logits = model64(input_ids=ids).logits
    logp = token_logprobs(logits, ids)  # in FP64 from the logits in the run measured too: no rounding
    assert len(mode.leaves) > 30  # every layer's results are perturbed, not just the logits
    var = torch.zeros_like(logp)
    for index in itertools.product(*map(range, logp.shape)):
        grads = torch.autograd.grad(logp[index], [*mode.leaves, *params.values()], retain_graph=True)
        acts, weights = grads[: len(mode.leaves)], grads[len(mode.leaves) :]
        total = u * u / 3 * sum(g.square().sum() for g in acts)
        total += sum((g.square() * weight_error_sq(name, params[name])).sum() for name, g in zip(params, weights))
        var[index] = total
    return logp.detach(), var.sqrt()


def bf16_weights(name, w):
    return unit_roundoff(torch.bfloat16) ** 2 * w.square() / 3


def block_fp8_weights(frozen_model):
    """E[δw²] of each weight the frozen model keeps: its BF16 rounding, plus E4M3's for the block
    layers: half an ulp ≤ max(2⁻⁴·|w|, 2⁻¹⁰·s) with s the block's scale (2⁻¹⁰: half the smallest
    subnormal step, in units of s), so E[δ²] ≤ that²/3."""
    scales = {}
    for name, m in frozen_model.named_modules():
        if isinstance(m, FrozenBlockFP8Linear):
            s = m.weight_scale_inv.double().repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
            scales[f"{name}.weight"] = s[: m.out_features, : m.in_features].t()  # Conv1D holds in × out

    def error_sq(name, w):
        var = bf16_weights(name, w)
        if name in scales:
            half_ulp = torch.maximum(w.abs() * 2.0**-4, scales[name] * 2.0**-10)
            var = var + half_ulp.square() / 3
        return var

    return error_sq


def frozen_reference(tmp_path, tokenizer, strategy, model, **options):
    trainer = dpo(tmp_path, tokenizer, strategy, tiny_lm(tokenizer), model, **options)
    return trainer.ref_model, trainer.precision


def test_the_frozen_references_log_probs_are_within_their_rounding_of_fp64(tmp_path, tokenizer):
    model = trained_like(tokenizer)
    ids = torch.randint(2, len(tokenizer), (2, 10), generator=torch.Generator().manual_seed(0))
    exact, sigma_bf16 = rounding_sigmas(model, ids, bf16_weights)
    assert exact.max() - exact.min() > 2.0

    def logprobs(reference, strategy):
        with strategy.forward_context(), torch.no_grad():
            return token_logprobs(reference.eval()(input_ids=ids).logits, ids)

    # Five standard deviations: a Gaussian sum of many small independent roundings exceeds it with
    # probability 6e-7 per token.
    bf16_ref, bf16 = frozen_reference(tmp_path / "bf16", tokenizer, "bf16-mixed", copy.deepcopy(model))
    assert param_dtypes(bf16_ref) == {torch.bfloat16}
    error = (logprobs(bf16_ref, bf16) - exact).abs()
    assert (error <= 5 * sigma_bf16).all(), (error / sigma_bf16).max()
    assert error.max() > 0

    # The old behaviour (FP32 weights under the same autocast): within the same bound.
    old_ref, old = frozen_reference(
        tmp_path / "old", tokenizer, "bf16-mixed", copy.deepcopy(model), precision_options={"frozen_models": "policy"}
    )
    assert param_dtypes(old_ref) == {torch.float32}
    assert ((logprobs(old_ref, old) - exact).abs() <= 5 * sigma_bf16).all()

    fp8_ref, fp8 = frozen_reference(tmp_path / "fp8", tokenizer, "fp8-lm-o2", copy.deepcopy(model))
    _, sigma_fp8 = rounding_sigmas(model, ids, block_fp8_weights(fp8_ref))
    error = (logprobs(fp8_ref, fp8) - exact).abs()
    assert (error <= 5 * sigma_fp8).all(), (error / sigma_fp8).max()
    # The E4M3 weights are what the forward computes with: beyond what BF16 weights would give.
    # Measured 11.2σ at worst on AVX2 (2026-12-01): the part of the error that depends on the CPU
    # (oneDNN's BF16 activation roundings) is the BF16 reference's, under 5σ above, so > 5σ holds on
    # an AVX-512 machine too; the E4M3 part (2^-4 relative weight steps) is the same everywhere.
    assert (error > 5 * sigma_bf16).any(), (error / sigma_bf16).max()


def test_under_bf16_autocast_a_frozen_linear_computes_what_its_fp32_original_does(tmp_path, tokenizer):
    """integrations.frozen's premise: autocast rounds an FP32 linear layer's weight and bias to
    BF16 at every GEMM, so holding them in BF16 changes no bit of its output."""
    model = trained_like(tokenizer)
    original = copy.deepcopy(model)
    reference, strategy = frozen_reference(tmp_path, tokenizer, "bf16-mixed", model)
    layers = [n for n, m in original.named_modules() if isinstance(m, (Conv1D, nn.Linear))]
    assert len(layers) == BLOCK_LINEARS + 1
    generator = torch.Generator().manual_seed(1)
    for name in layers:
        frozen, fp32 = reference.get_submodule(name), original.get_submodule(name)
        assert frozen.weight.dtype == torch.bfloat16 and fp32.weight.dtype == torch.float32
        width = fp32.weight.shape[0] if isinstance(fp32, Conv1D) else fp32.in_features  # Conv1D holds in × out
        x = torch.randn(2, 5, width, generator=generator).bfloat16()  # what the layer before hands on
        with strategy.forward_context(), torch.no_grad():
            assert_bits_equal(frozen(x), fp32(x), name)


# ---------------------------------------------------------------------------------------------
# PPO (TRL 1.12): reference and reward frozen, policy and value trained
# ---------------------------------------------------------------------------------------------


@pytest.mark.ppo
@pytest.mark.parametrize("passed", [False, True], ids=["reference-copied", "reference-passed"])
def test_ppo_freezes_reference_and_reward_and_trains_policy_and_value(tmp_path, tokenizer, passed):
    # The recipe (recipes/ppo_rlhf.py) passes ref_model=None: TRL would copy the policy.
    reference = tiny_lm(tokenizer) if passed else None
    trainer = ppo_trainer(tmp_path, tokenizer, precision_strategy="bf16-mixed", ref_model=reference)
    if passed:
        assert trainer.ref_model is reference
    reference = trainer.ref_model
    for model, role in ((reference, "reference"), (trainer.reward_model, "reward")):
        assert_frozen_16bit(model, role)
        assert model.__dict__[FROZEN_ATTR]["blocks_bytes_per_param"] == 2.0
    # The reference is the initial policy, rounded once to BF16.
    for (name, p), q in zip(reference.named_parameters(), tiny_lm(tokenizer).parameters(), strict=True):
        assert_bits_equal(p.detach(), q.detach().bfloat16(), name)
    for model in (trainer.model.policy, trainer.model.value_model):  # trained: FP32 masters
        assert param_dtypes(model) == {torch.float32} and all(p.requires_grad for p in model.parameters())
    frozen = [p.detach().clone() for p in reference.parameters()]
    values = [p.detach().clone() for p in trainer.model.value_model.parameters()]
    trainer.train()
    assert "loss/value_avg" in trainer.state.log_history[-1]
    assert any(not torch.equal(a, p) for a, p in zip(values, trainer.model.value_model.parameters()))
    assert all(torch.equal(a, p) for a, p in zip(frozen, reference.parameters()))


def test_freezing_keeps_what_the_model_or_trl_keeps_in_fp32_and_the_policys_fp8_skips(tokenizer):
    """TRL's `cast_lm_head_to_fp32` (head_fp32) and what transformers keeps FP32 in the frozen dtype
    (`_keep_in_fp32_modules_strict`, `_keep_in_fp32_modules` in FP16 only) keep their FP32 weights, a
    strict layer out of the FP8 blocks too; FP8 blocks follow the policy's `min_gemm_features` (a
    layer kept out of FP8 in the policy stays out of it in the reference)."""
    from hf_lowprec import get_strategy
    from hf_lowprec.integrations.frozen import freeze_model

    model = freeze_model(get_strategy("bf16-mixed"), tiny_lm(tokenizer), "reference", head_fp32=True)
    assert model.lm_head.weight.dtype == torch.float32  # tied: the input embedding with it
    assert model.transformer.h[0].attn.c_attn.weight.dtype == torch.bfloat16
    for name, attr, ln_f in [
        ("bf16-mixed", "_keep_in_fp32_modules_strict", torch.float32),
        ("bf16-mixed", "_keep_in_fp32_modules", torch.bfloat16),  # as a BF16 load: FP16's list only
        ("fp16-mixed", "_keep_in_fp32_modules", torch.float32),
    ]:
        kept = tiny_lm(tokenizer)
        setattr(kept, attr, ["ln_f"])
        kept = freeze_model(get_strategy(name), kept, "reference")
        assert kept.transformer.ln_f.weight.dtype == ln_f and kept.lm_head.weight.dtype != torch.float32, attr
    strict = tiny_lm(tokenizer)
    strict._keep_in_fp32_modules_strict = ["h.0.mlp.c_fc"]
    strict = freeze_model(get_strategy("fp8-lm-o2"), strict, "reference")
    assert (
        type(strict.transformer.h[0].mlp.c_fc) is Conv1D
        and strict.transformer.h[0].mlp.c_fc.weight.dtype == torch.float32
    )
    assert isinstance(strict.transformer.h[1].mlp.c_fc, FrozenBlockFP8Linear)
    small = freeze_model(get_strategy("fp8-lm-o2", min_gemm_features=4096), tiny_lm(tokenizer), "reference")
    assert not any(isinstance(m, FrozenBlockFP8Linear) for m in small.modules())
    assert {p.dtype for p in small.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize(
    ("name", "arch"),
    [
        ("bf16-pure", "deepseek_v3"),
        ("collage-plus", "deepseek_v3"),
        ("bf16-mixed", "deepseek_v3"),
        ("fp16-als", "deepseek_v3"),
        ("fp16-mixed", "t5"),
        ("bf16-mixed", "t5"),
    ],
)
def test_a_frozen_model_holds_and_computes_what_a_stock_load_in_its_dtype_does(tmp_path, name, arch):
    """A frozen model has the dtypes of `from_pretrained(dtype=<frozen dtype>)` and computes its logits bit
    for bit: DeepSeek-V3's router `gate.weight` (`_keep_in_fp32_modules_strict`, a parameter's name) was
    BF16 (logits 1.95e-3 from the stock load's); T5's `wo` is FP32 in FP16 and BF16 in BF16, as loaded."""
    import transformers

    from hf_lowprec import get_strategy
    from hf_lowprec.integrations.frozen import freeze_model
    from hf_lowprec.testing.moe import tiny_moe

    torch.manual_seed(0)
    if arch == "t5":
        config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
        model, cls = transformers.T5ForConditionalGeneration(config), transformers.T5ForConditionalGeneration
    else:
        model, cls = tiny_moe(arch), transformers.AutoModelForCausalLM
    strategy = get_strategy(name)
    model.save_pretrained(tmp_path)
    stock = cls.from_pretrained(tmp_path, dtype=strategy.compute_dtype)
    frozen = freeze_model(strategy, model, "reference")
    dtypes = {n: p.dtype for n, p in frozen.named_parameters()}
    assert dtypes == {n: p.dtype for n, p in stock.named_parameters()}
    assert torch.float32 in dtypes.values() or (name, arch) == ("bf16-mixed", "t5")
    assert {n: b.dtype for n, b in frozen.named_buffers()} == {n: b.dtype for n, b in stock.named_buffers()}
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    extra = {"decoder_input_ids": ids[:, :6]} if arch == "t5" else {}
    with torch.no_grad():  # both in eval mode (no dropout), as TRL runs a reference
        assert_bits_equal(frozen.eval()(ids, **extra).logits, stock.eval()(ids, **extra).logits, "logits")


# ---------------------------------------------------------------------------------------------
# a model frozen or trained before: the trained model itself, another strategy's frozen model,
# a model trained here under an FP8 strategy
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["DPO", "KTO"])
def test_the_trained_model_passed_as_its_own_reference_reaches_trls_refusal_unchanged(tmp_path, tokenizer, kind):
    # It was frozen in place (FP8 blocks, requires_grad off) before TRL refused it: the retry TRL's
    # message asks for, the same model without ref_model=, then had no trainable parameter.
    model = tiny_lm(tokenizer)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    layers = [type(m) for m in model.modules()]
    data = datasets.Dataset.from_dict(PAIRS if kind == "DPO" else UNPAIRED)
    with pytest.raises(ValueError, match="cannot be the same object"):
        getattr(hl_trl, f"{kind}Trainer")(
            model=model,
            ref_model=model,
            args=trl_args(f"{kind}Config", tmp_path, "fp8-lm-o2", max_length=32),
            train_dataset=data,
            processing_class=tokenizer,
        )
    assert FROZEN_ATTR not in model.__dict__ and [type(m) for m in model.modules()] == layers
    for name, p in model.named_parameters():
        assert p.requires_grad, name
        assert_bits_equal(p.detach(), before[name], name)


def test_a_model_another_strategy_froze_is_reused_in_the_same_storage_and_refused_in_another(
    tmp_path, tokenizer, saved
):
    # Frozen to FP8 blocks under fp8-lm-o2 and passed again under fp32, the reference kept its
    # FP8 blocks and the report said "fp8-blocks": step 0's DPO loss was 0.6931236, not ln 2.
    from hf_lowprec import get_strategy
    from hf_lowprec.integrations.frozen import freeze_model

    reference = tiny_lm(tokenizer)
    first = dpo(tmp_path / "fp8", tokenizer, "fp8-lm-o2", tiny_lm(tokenizer), reference)
    facts = first.hf_lowprec_frozen_models["reference"]
    assert facts["storage"] == "fp8-blocks" and facts["strategy"] == "fp8-lm-o2"
    held = {name: p.detach().clone() for name, p in reference.named_parameters()}
    again = dpo(tmp_path / "coat", tokenizer, "coat", tiny_lm(tokenizer), reference)  # FP8 blocks too: reused
    assert again.ref_model is reference and again.hf_lowprec_frozen_models["reference"] is facts
    expected = (
        r"frozen already, by precision_strategy='fp8-lm-o2' \(storage: fp8-blocks\); "
        r"precision_strategy='fp32' keeps frozen models as float32.*fresh copy"
    )
    with pytest.raises(ValueError, match=expected):
        dpo(tmp_path / "fp32", tokenizer, "fp32", tiny_lm(tokenizer), reference)
    for name, p in reference.named_parameters():
        assert_bits_equal(p.detach(), held[name], name)

    # Refused before any model is changed: the first reward model stays as passed.
    fresh, frozen = tiny_scorer(tokenizer), freeze_model(get_strategy("bf16-mixed"), tiny_scorer(tokenizer), "reward")
    with pytest.raises(ValueError, match=r"by precision_strategy='bf16-mixed' \(storage: bfloat16\)"):
        hl_trl.GRPOTrainer(
            model=saved["lm"],
            reward_funcs=[fresh, frozen],
            args=trl_args("GRPOConfig", tmp_path / "grpo", "fp32", num_generations=2, max_completion_length=4),
            train_dataset=datasets.Dataset.from_dict(PROMPTS),
            processing_class=tokenizer,
        )
    assert FROZEN_ATTR not in fresh.__dict__ and param_dtypes(fresh) == {torch.float32}
    assert all(p.requires_grad for p in fresh.parameters())


def test_a_model_trained_under_fp8_frozen_in_16_bits_holds_its_real_weights_in_plain_layers(tokenizer):
    # Its FP8Linear layers (FP16 masters scaled by 2^k) stayed, with a report saying bfloat16: a
    # reward model's scores were ~10× the BF16 rounding off. The real weights are master / 2^k,
    # exact; frozen, they are those in BF16, as a model holding them in FP32 would be frozen.
    from transformers.pytorch_utils import Conv1D

    from hf_lowprec import get_strategy
    from hf_lowprec.fp8.experts import FP8Experts
    from hf_lowprec.integrations.frozen import freeze_model
    from hf_lowprec.testing.moe import tiny_moe

    bf16 = get_strategy("bf16-mixed")
    ids = torch.randint(2, len(tokenizer), (2, 12), generator=torch.Generator().manual_seed(0))
    trained = get_strategy("fp8-lm-o2").prepare_model(trained_like(tokenizer))
    layers = [n for n, m in trained.named_modules() if isinstance(m, FP8Linear)]
    assert len(layers) == BLOCK_LINEARS and trained.get_submodule(layers[0]).master_scale > 1
    real = trained.state_dict()  # the real weights, in FP32 (FP8Linear exports master / scale)
    plain = trained_like(tokenizer)
    plain.load_state_dict(real)
    model = freeze_model(bf16, trained, "reward")
    assert not any(isinstance(m, FP8Linear) for m in model.modules())
    assert all(type(model.get_submodule(n)) is Conv1D for n in layers)
    assert model.__dict__[FROZEN_ATTR]["storage"] == "bfloat16" and param_dtypes(model) == {torch.bfloat16}
    for name, p in model.named_parameters():
        assert_bits_equal(p.detach(), real[name].bfloat16(), name)
    baseline = freeze_model(bf16, plain, "reward")
    with bf16.forward_context(), torch.no_grad():
        assert_bits_equal(model(input_ids=ids).logits, baseline(input_ids=ids).logits, "logits")

    # FP8 experts: the experts module gets its own class back, its real weights in BF16.
    moe = get_strategy("fp8-lm-o2").prepare_model(tiny_moe("qwen3_moe"))
    experts = moe.model.layers[0].mlp.experts
    assert isinstance(experts, FP8Experts) and experts.gate_up_proj.dtype == torch.float16
    real = moe.state_dict()
    moe = freeze_model(bf16, moe, "reference")
    experts = moe.model.layers[0].mlp.experts
    assert type(experts).__name__ == "Qwen3MoeExperts" and not list(experts.buffers())
    for name, p in moe.named_parameters():
        assert_bits_equal(p.detach(), real[name].bfloat16(), name)
    assert set(moe.state_dict()) == set(real)


def _dpo_losses(trainer) -> list[float]:
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("first, storage", [("collage-plus", "bfloat16"), ("fp8-lm-o2", "fp8-blocks")])
def test_a_trainer_without_a_strategy_refuses_a_reference_a_strategy_froze_in_place(
    tmp_path, tokenizer, first, storage
):
    # A notebook's baseline after a strategy run, passing the same `ref` object: the reference the first
    # trainer converted in place (BF16, or FP8 blocks) was used as it was, with no error or warning
    # (3 DPO losses 0.6446356, 0.6540939, 0.5127164 after collage-plus where a fresh FP32 reference gives
    # 0.6444528, 0.6541836, 0.5126004). Now refused before TRL's __init__, naming the strategy and the fix.
    reference = tiny_lm(tokenizer, seed=1)
    dpo(tmp_path / "first", tokenizer, first, tiny_lm(tokenizer), reference)
    held = {name: p.detach().clone() for name, p in reference.named_parameters()}
    expected = (
        rf"the reference model passed to this trainer was frozen already, by precision_strategy='{first}', "
        rf"which converted that object in place \(storage: {storage}\); this trainer has no precision_strategy"
        r".*fresh copy"
    )
    with pytest.raises(ValueError, match=expected):
        dpo(tmp_path / "none", tokenizer, None, tiny_lm(tokenizer), reference)
    with pytest.raises(ValueError, match=expected):  # TR-DPO's sync mixes into it too
        dpo(tmp_path / "sync", tokenizer, None, tiny_lm(tokenizer), reference, sync_ref_model=True)
    for name, p in reference.named_parameters():
        assert_bits_equal(p.detach(), held[name], name)


def test_a_trainer_without_a_strategy_takes_a_reference_frozen_in_fp32(tmp_path, tokenizer):
    """fp32 freezes a reference without converting it (FP32 weights in plain layers): a trainer without
    a strategy takes it, and its DPO loss is bit for bit that of a reference a first trainer without a
    strategy saw (TRL's first trainer wraps the reference's forward: a fresh one differs in any case)."""
    frozen, seen = tiny_lm(tokenizer, seed=1), tiny_lm(tokenizer, seed=1)
    dpo(tmp_path / "fp32", tokenizer, "fp32", tiny_lm(tokenizer), frozen)
    dpo(tmp_path / "stock", tokenizer, None, tiny_lm(tokenizer), seen)
    assert frozen.__dict__[FROZEN_ATTR]["storage"] == "float32"
    reused = _dpo_losses(dpo(tmp_path / "reused", tokenizer, None, tiny_lm(tokenizer), frozen))
    stock = _dpo_losses(dpo(tmp_path / "again", tokenizer, None, tiny_lm(tokenizer), seen))
    assert len(stock) == 1 and math.isfinite(stock[0])
    assert_bits_equal(torch.tensor(reused, dtype=torch.float64), torch.tensor(stock, dtype=torch.float64), "loss")


def test_a_trl_trainer_without_a_strategy_refuses_a_policy_whose_conversion_bound_fp8_layers(tmp_path, tokenizer):
    # The Trainer's refusal (strategies/prepared.py) in hf_lowprec.trl's trainers: a policy fp8-lm-o2
    # prepared, passed to a DPOTrainer with no strategy, would not train its FP8 GEMM weights.
    from hf_lowprec import get_strategy

    policy = get_strategy("fp8-lm-o2").prepare_model(tiny_lm(tokenizer))
    with pytest.raises(ValueError, match=r"prepared under precision strategy 'fp8-lm-o2', and this DPOTrainer has no"):
        dpo(tmp_path, tokenizer, None, policy, tiny_lm(tokenizer, seed=1))
