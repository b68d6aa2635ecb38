"""hf_lowprec.integrations.trl_trainers (also `hf_lowprec.trl`): TRL configs and trainers with precision_strategy (the recipes run them end to end)."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from transformers import HfArgumentParser  # noqa: E402

import hf_lowprec.trl as hl_trl  # noqa: E402
from hf_lowprec.strategies.interface import PrecisionStrategy, StrategyOptimizer  # noqa: E402
from tests import helpers  # noqa: E402
from tests.helpers import PAIRS, left_padded_tokenizer, ppo_trainer, tiny_lm, tiny_scorer, trl_args  # noqa: E402

CONFIGS = ("SFTConfig", "RewardConfig", "GRPOConfig", "DPOConfig", "RLOOConfig", "KTOConfig", "DistillationConfig")
TRL_HAS_PPO = importlib.util.find_spec("trl.experimental.ppo") is not None


@pytest.fixture(scope="module")
def tokenizer():
    return left_padded_tokenizer()


@pytest.mark.parametrize("name", CONFIGS)
def test_configs_leave_mixed_precision_to_the_strategy(tmp_path, name):
    config = getattr(hl_trl, name)
    assert config.__module__ == "hf_lowprec.integrations.trl_trainers" and config.__name__ == name
    with_strategy = config(output_dir=str(tmp_path), precision_strategy="collage-plus", use_cpu=True)
    assert with_strategy.bf16 is False and with_strategy.build_precision_strategy().name == "collage-plus"
    assert config(output_dir=str(tmp_path), use_cpu=True).bf16 is True  # TRL's own default, untouched
    with pytest.raises(ValueError, match="owns mixed precision"):
        config(output_dir=str(tmp_path), precision_strategy="fp32", bf16=True, use_cpu=True)


@pytest.mark.parametrize("strategy", ["collage-plus", "bf16-pure", "bf16-sr", "fp16-als"])
def test_an_fp32_lm_head_is_refused_where_every_trained_weight_is_16_bit(tmp_path, strategy):
    """GRPO's `cast_lm_head_to_fp32=True` was undone on the trained policy: TRL cast the head to FP32 in
    its `__init__`, then the strategy's `prepare_model` cast the whole model to BF16 (FP16), without a
    word. Now the config refuses it, naming the alternatives; strategies with FP32 masters keep it."""
    with pytest.raises(ValueError, match=rf"cast_lm_head_to_fp32.*{strategy}.*drop cast_lm_head_to_fp32.*bf16-mixed"):
        hl_trl.GRPOConfig(
            output_dir=str(tmp_path), precision_strategy=strategy, use_cpu=True, cast_lm_head_to_fp32=True
        )
    for kept in ("bf16-mixed", "fp8-lm-o2", "fp32"):
        config = hl_trl.GRPOConfig(
            output_dir=str(tmp_path), precision_strategy=kept, use_cpu=True, cast_lm_head_to_fp32=True
        )
        assert config.cast_lm_head_to_fp32 is True
    assert hl_trl.GRPOConfig(output_dir=str(tmp_path), precision_strategy=strategy, use_cpu=True).bf16 is False


def test_config_parses_and_pickles(tmp_path):
    (args,) = HfArgumentParser(hl_trl.SFTConfig).parse_args_into_dataclasses(
        [
            "--output_dir",
            str(tmp_path),
            "--precision_strategy",
            "bf16-pure",
            "--use_cpu",
            "true",
            "--precision_options",
            '{"lost_arithmetic_metrics": true}',
        ]
    )
    assert args.precision_options == {"lost_arithmetic_metrics": True}
    clone = pickle.loads(pickle.dumps(args))  # the Trainer saves training_args.bin this way
    assert type(clone) is hl_trl.SFTConfig and clone.precision_strategy == "bf16-pure"


def test_the_short_import_path_gives_the_same_classes():
    from hf_lowprec.integrations import trl_trainers as integrations_trl
    from hf_lowprec.trl import SFTConfig, SFTTrainer

    assert SFTConfig is integrations_trl.SFTConfig and SFTTrainer is integrations_trl.SFTTrainer
    assert set(hl_trl.__all__) == set(integrations_trl.__all__)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchTrainer'"):
        hl_trl.NoSuchTrainer  # noqa: B018


def test_missing_trl_names_the_extra():
    code = (
        "import sys; sys.modules['trl'] = None\nimport hf_lowprec.trl as t\n"
        "try:\n    t.SFTTrainer\nexcept ImportError as e:\n    print(e)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert "pip install -e '.[trl]'" in out


@pytest.mark.slow
def test_grpo_generates_and_scores_in_the_strategy_context(tmp_path, tokenizer):
    seen = []

    def reward(completions, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu"))
        return [float(len(c)) / 10 for c in completions]

    args = hl_trl.GRPOConfig(
        output_dir=str(tmp_path),
        precision_strategy="bf16-mixed",
        use_cpu=True,
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        **helpers.no_activation_checkpointing(),
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
    )
    train = datasets.Dataset.from_dict({"prompt": ["Return the", "Open a file", "Split the", "Join"]})
    trainer = hl_trl.GRPOTrainer(
        model=tiny_lm(tokenizer), reward_funcs=[reward], args=args, train_dataset=train, processing_class=tokenizer
    )
    trainer.train()
    assert seen and all(seen)
    assert isinstance(trainer.optimizer.optimizer, StrategyOptimizer)
    assert "precision/skipped_steps" in trainer.state.log_history[0]


class _ScaledFP32(PrecisionStrategy):
    """FP32 with a static loss scale of 2**10 (exact), counting the gradients it scaled."""

    def __init__(self):
        super().__init__(name="fp32")
        self.scaled_tensors = 0
        self.pending = False

    def scale_loss(self, loss):
        self.scaled_tensors += 1
        self.pending = True
        return loss * 1024.0

    def unscale_gradients(self, optimizer):
        if self.pending:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.div_(1024.0)
            self.pending = False


def run_ppo(tmp_path, tokenizer, strategy=None):
    trainer = ppo_trainer(tmp_path, tokenizer, strategy)
    trainer.train()
    return trainer


@pytest.mark.ppo
def test_ppo_config_leaves_mixed_precision_to_the_strategy(tmp_path):
    with_strategy = hl_trl.PPOConfig(output_dir=str(tmp_path), precision_strategy="collage-plus", use_cpu=True)
    assert with_strategy.bf16 is False and with_strategy.build_precision_strategy().name == "collage-plus"


@pytest.mark.skipif(TRL_HAS_PPO, reason="this TRL still ships PPOTrainer; the ppo-marked tests cover it")
def test_ppo_under_current_trl_names_the_ppo_extra():
    for name in ("PPOConfig", "PPOTrainer"):
        with pytest.raises(ImportError, match=r"removed it in 1\.13.*the `ppo` extra"):
            getattr(hl_trl, name)


def test_dpo_converts_policy_and_reference_with_the_strategy(tmp_path, tokenizer):
    args = trl_args("DPOConfig", tmp_path, "collage-plus", max_steps=2, max_length=32)
    policy, reference = tiny_lm(tokenizer), tiny_lm(tokenizer)
    reference.requires_grad_(False)
    trainer = hl_trl.DPOTrainer(
        model=policy,
        ref_model=reference,
        args=args,
        train_dataset=datasets.Dataset.from_dict(PAIRS),
        processing_class=tokenizer,
    )
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in reference.parameters()} == {torch.bfloat16}
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert isinstance(trainer.optimizer.optimizer, StrategyOptimizer)
    assert trainer.state.global_step == 2 and trainer.precision.skipped_steps == 0
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, trainer.model.parameters()))


@pytest.mark.ppo
@pytest.mark.slow
def test_ppo_applies_the_strategy_including_loss_scaling(tmp_path, tokenizer):
    plain = run_ppo(tmp_path / "plain", tokenizer)
    assert isinstance(plain.optimizer.optimizer, StrategyOptimizer)
    logged = plain.state.log_history[-1]
    assert "loss/policy_avg" in logged and "loss/value_avg" in logged and "precision/skipped_steps" in logged

    strategy = _ScaledFP32()
    scaled = run_ppo(tmp_path / "scaled", tokenizer, strategy)
    assert scaled.precision is strategy and strategy.scaled_tensors > 0
    # Scaling by 2**10 and back is exact in FP32, so the update is the same bit for bit.
    for a, b in zip(plain.model.parameters(), scaled.model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.ppo
@pytest.mark.slow
@pytest.mark.multiproc
def test_ppo_recipe_under_ddp_trains_and_saves(tmp_path):
    """Two gloo ranks: PPO trains, and save_model writes the policy (TRL 1.12 alone fails there)."""
    root = Path(__file__).resolve().parents[2]
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "recipes/configs/ddp.yaml",
        "recipes/ppo_rlhf.py",
        "--precision_strategy",
        "collage-plus",
        "--total_episodes",
        "8",
        "--per_device_train_batch_size",
        "4",
        "--num_mini_batches",
        "1",
        "--num_ppo_epochs",
        "1",
        "--response_length",
        "4",
        "--reward_steps",
        "1",
        "--num_prompts",
        "16",
        *(f"--{name}" for name in helpers.no_activation_checkpointing()),
        "false",
        "--disable_tqdm",
        "true",
        "--output_dir",
        str(tmp_path),
    ]
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    result = json.loads((tmp_path / "recipe_result.json").read_text())
    assert result["world_size"] == 2 and result["backend"] == "gloo" and result["ppo_updates"] == 1
    assert (tmp_path / "model.safetensors").exists()


def test_a_16_bit_loss_takes_the_loss_scale(tmp_path, tokenizer):
    """A reward model under fp16-als computes in FP16 without autocast, so its loss is FP16: the loss
    scale (an FP32 tensor) used to fail in backward ("hook 'scale_loss' has changed the type of
    value"). The loss is widened to FP32 before its gradient is scaled, as GradScaler does."""
    pairs = {"chosen": PAIRS["prompt"], "rejected": PAIRS["rejected"]}
    trainer = hl_trl.RewardTrainer(
        model=tiny_scorer(tokenizer),
        args=trl_args("RewardConfig", tmp_path, "fp16-als", max_length=32),
        train_dataset=datasets.Dataset.from_dict(pairs),
        processing_class=tokenizer,
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.state.global_step == 1 and trainer.precision.skipped_steps == 0
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, trainer.model.parameters()))


def test_reward_losses_under_bf16_mixed_are_stock_bf16s_from_fp32_outputs(tmp_path, tokenizer):
    # `bf16=True` hands the model's outputs on in FP32 (Accelerate's convert_outputs_to_fp32); the
    # strategy turns that flag off, and RewardTrainer's loss came from BF16 scores: 0.6953125 and
    # 0.69140625 where stock logs 0.694367826 and 0.690041840. The same forward, then the same FP32
    # loss: the same bits. Evaluated before the step, which the two optimizers take differently.
    import trl

    pairs = datasets.Dataset.from_dict(
        {
            "chosen": [p + c for p, c in zip(PAIRS["prompt"], PAIRS["chosen"], strict=True)] * 2,
            "rejected": [p + r for p, r in zip(PAIRS["prompt"], PAIRS["rejected"], strict=True)] * 2,
        }
    )
    logged = {}
    for label, config, trainer_class, flags in (
        ("stock", trl.RewardConfig, trl.RewardTrainer, {"bf16": True}),
        ("bf16-mixed", hl_trl.RewardConfig, hl_trl.RewardTrainer, {"precision_strategy": "bf16-mixed"}),
    ):
        args = config(
            output_dir=str(tmp_path / label),
            use_cpu=True,
            per_device_train_batch_size=4,
            per_device_eval_batch_size=4,
            max_steps=1,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            max_length=32,
            **flags,
        )
        trainer = trainer_class(
            model=tiny_scorer(tokenizer), args=args, train_dataset=pairs, eval_dataset=pairs, processing_class=tokenizer
        )
        evaluated = trainer.evaluate()["eval_loss"]
        trainer.train()
        logged[label] = (evaluated, next(e["loss"] for e in trainer.state.log_history if "loss" in e))
    assert logged["bf16-mixed"] == logged["stock"]
    assert all(torch.tensor(v).bfloat16().item() != v for v in logged["stock"])  # not BF16 numbers


@pytest.mark.parametrize("strategy", ["bf16-mixed", "fp8-lm-o2", "bf16-pure"])
def test_policy_and_reference_outputs_are_fp32_where_the_strategy_computes_in_16_bits(tmp_path, tokenizer, strategy):
    # As Accelerate's mixed precision wraps the policy and TRL's reference (prepare_model): FP32 outputs,
    # also of a model stored in BF16 (bf16-pure), as under bf16=True whatever the weights' dtype.
    trainer = hl_trl.DPOTrainer(
        model=tiny_lm(tokenizer),
        ref_model=tiny_lm(tokenizer),
        args=trl_args("DPOConfig", tmp_path, strategy, max_length=32),
        train_dataset=datasets.Dataset.from_dict(PAIRS),
        processing_class=tokenizer,
    )
    ids = torch.randint(2, len(tokenizer), (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), trainer.compute_loss_context_manager():
        policy, reference = trainer.model(input_ids=ids).logits, trainer.ref_model(input_ids=ids).logits
        inner = trainer.model.lm_head(trainer.model.transformer(input_ids=ids)[0])  # the forward's own logits
    assert policy.dtype == reference.dtype == torch.float32 and inner.dtype == torch.bfloat16
    assert torch.equal(policy, inner.float())  # widened, not computed otherwise
