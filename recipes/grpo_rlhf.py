"""RLHF with GRPO (TRL's GRPOTrainer) and a reward model, under a precision strategy.

    python recipes/grpo_rlhf.py --precision_strategy collage-plus
    python recipes/grpo_rlhf.py --precision_strategy bf16-mixed --model_name_or_path my-sft-model \
        --reward_model_path my-reward-model --dataset_name trl-lib/tldr

GRPO needs no value model: it samples `--num_generations` completions per prompt and uses
their reward relative to the group as the advantage. The reward comes from a sequence-scoring
model (`--reward_model_path`); a KL term (`--beta`, 0.04 here) keeps the policy near a frozen
reference, which TRL builds from the policy's path. Rollouts and reward scoring run in the
strategy's forward context, like the training forward. The only change from a TRL script is
`from hf_lowprec.trl import GRPOConfig, GRPOTrainer`.

The reference and the reward model are frozen: they keep what their forward computes with
(BF16, FP16, or FP8 blocks under the FP8 strategies; docs/rl.md). The result gives each
model's bytes and how far the rollouts' log-probs are from the training forward's.

Offline default: a tiny GPT-2 policy (saved first, so that TRL can build the reference from
its path), a tiny reward model first trained here for `--reward_steps` steps to prefer
docstring text over shuffled words, docstring prompts.
"""

from __future__ import annotations

import dataclasses
import os

from transformers import AutoModelForCausalLM, set_seed

from common import (
    ModelArguments,
    docstring_prompts,
    load_model,
    load_tokenizer,
    parse_args,
    report,
    reward_model,
    run_training,
    setup_logging,
)
from hf_lowprec.trl import GRPOConfig, GRPOTrainer


@dataclasses.dataclass
class GRPOScriptArguments:
    reward_model_path: str | None = dataclasses.field(
        default=None, metadata={"help": "Reward model name or path. Unset: a tiny one trained here."}
    )
    dataset_name: str | None = dataclasses.field(
        default=None, metadata={"help": "A `datasets` dataset with a `prompt` column. Unset: docstring prompts."}
    )
    num_prompts: int = dataclasses.field(default=64, metadata={"help": "Embedded prompts to train on."})
    reward_steps: int = dataclasses.field(
        default=40, metadata={"help": "Steps to train the tiny reward model when no --reward_model_path."}
    )


def main(argv: list[str] | None = None) -> dict:
    model_args, script_args, training_args = parse_args(
        (ModelArguments, GRPOScriptArguments, GRPOConfig),
        "grpo_rlhf",
        argv,
        learning_rate=1e-4,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=16,
        num_train_epochs=1.0,
        logging_steps=1,
        save_strategy="no",
        beta=0.04,
        disable_dropout=True,  # dropout would draw other masks in the rollout and the training forward
    )
    setup_logging(training_args)
    set_seed(training_args.seed)
    import datasets

    tokenizer = load_tokenizer(model_args)
    tokenizer.padding_side = "left"
    policy = model_args.model_name_or_path
    if policy is None:  # TRL builds the reference from the policy's path: save the tiny one first
        policy = os.path.join(training_args.output_dir, "initial_policy")
        load_model(AutoModelForCausalLM, model_args, tokenizer, default_type="gpt2").save_pretrained(policy)
        tokenizer.save_pretrained(policy)
    reward = reward_model(script_args.reward_model_path, tokenizer, training_args, steps=script_args.reward_steps)
    reward.requires_grad_(False)
    reward.eval()

    if script_args.dataset_name:
        train = datasets.load_dataset(script_args.dataset_name, split="train")
    else:
        train = datasets.Dataset.from_dict({"prompt": docstring_prompts(script_args.num_prompts, training_args.seed)})

    reward_tokenizer = load_tokenizer(ModelArguments(model_name_or_path=script_args.reward_model_path))
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=[reward],
        args=training_args,
        train_dataset=train,
        processing_class=tokenizer,
        reward_processing_classes=[reward_tokenizer],
    )
    run_training(trainer, training_args)
    trainer.save_model()
    history = [h for h in trainer.state.log_history if "reward" in h]
    last = history[-1] if history else {}
    mismatch = [h for h in history if "precision/rollout_logp_diff_max" in h]
    frozen = getattr(trainer, "hf_lowprec_frozen_models", {})
    return report(
        training_args,
        trainer,
        reward=last.get("reward"),
        reward_std=last.get("reward_std"),
        kl=last.get("kl"),
        reward_curve=[h["reward"] for h in history],
        rollout_logp_diff_mean=max((h["precision/rollout_logp_diff_mean"] for h in mismatch), default=None),
        rollout_logp_diff_max=max((h["precision/rollout_logp_diff_max"] for h in mismatch), default=None),
        frozen_bytes={role: facts["bytes"] for role, facts in frozen.items()},
        frozen_bytes_per_param={role: facts["blocks_bytes_per_param"] for role, facts in frozen.items()},
    )


if __name__ == "__main__":
    main()
