"""RLHF with PPO (TRL 1.12's `trl.experimental.ppo`) and a precision strategy.

    python recipes/ppo_rlhf.py --precision_strategy collage-plus
    python recipes/ppo_rlhf.py --precision_strategy bf16-mixed --sft_model_path my-sft-model \
        --reward_model_path my-reward-model --dataset_name trl-internal-testing/descriptiveness-sentiment-trl-style

Four models, as in TRL's PPO example: the policy (`--sft_model_path`), a frozen reference copy
of it, a reward model (`--reward_model_path`) and a value model initialised from the reward
model. The only change from a TRL script is `from hf_lowprec.trl import PPOConfig, PPOTrainer`.

Offline default: a tiny GPT-2 policy; a tiny reward model first trained here for
`--reward_steps` steps (RewardTrainer, same strategy) to prefer docstring text over shuffled
words; prompts are the opening words of docstring paragraphs.
"""

from __future__ import annotations

import copy
import dataclasses

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
from hf_lowprec.trl import PPOConfig, PPOTrainer


@dataclasses.dataclass
class PPODataArguments:
    dataset_name: str | None = dataclasses.field(
        default=None, metadata={"help": "A `datasets` dataset with a prompt column. Unset: docstring prompts."}
    )
    dataset_text_field: str = dataclasses.field(default="prompt", metadata={"help": "The prompt column."})
    num_prompts: int = dataclasses.field(default=256, metadata={"help": "Embedded prompts to train on."})
    reward_steps: int = dataclasses.field(
        default=40, metadata={"help": "Steps to train the tiny reward model when no --reward_model_path."}
    )


def main(argv: list[str] | None = None) -> dict:
    model_args, data_args, training_args = parse_args(
        (ModelArguments, PPODataArguments, PPOConfig),
        "ppo_rlhf",
        argv,
        sft_model_path=None,
        reward_model_path=None,
        learning_rate=1e-4,
        per_device_train_batch_size=8,
        num_mini_batches=2,
        num_ppo_epochs=2,
        response_length=16,
        total_episodes=64,
        stop_token="eos",
        missing_eos_penalty=1.0,
        num_sample_generations=0,
        logging_steps=1,
        save_strategy="no",
    )
    if training_args.resume_from_checkpoint is not None:  # before any work
        raise ValueError("--resume_from_checkpoint: TRL's PPOTrainer cannot resume (its train() takes no checkpoint)")
    setup_logging(training_args)
    set_seed(training_args.seed)
    import datasets

    if training_args.sft_model_path:
        model_args.model_name_or_path = model_args.model_name_or_path or training_args.sft_model_path
    tokenizer = load_tokenizer(model_args)
    tokenizer.padding_side = "left"
    policy = load_model(AutoModelForCausalLM, model_args, tokenizer, default_type="gpt2")
    reward = reward_model(training_args.reward_model_path, tokenizer, training_args, steps=data_args.reward_steps)
    value = copy.deepcopy(reward)
    reward.requires_grad_(False)

    if data_args.dataset_name:
        raw = datasets.load_dataset(data_args.dataset_name)
        train, evaluation = raw["train"], raw.get("validation", raw.get("test", raw["train"].select(range(16))))
    else:
        prompts = docstring_prompts(data_args.num_prompts + 16, training_args.seed)
        train = datasets.Dataset.from_dict({"prompt": prompts[16:]})
        evaluation = datasets.Dataset.from_dict({"prompt": prompts[:16]})

    def tokenize(batch: dict) -> dict:
        return {"input_ids": tokenizer(batch[data_args.dataset_text_field], padding=False)["input_ids"]}

    # PPOConfig redefines world_size (unset until the trainer starts), so no main_process_first here.
    train = train.map(tokenize, batched=True, remove_columns=train.column_names)
    evaluation = evaluation.map(tokenize, batched=True, remove_columns=evaluation.column_names)

    trainer = PPOTrainer(
        args=training_args,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,
        reward_model=reward,
        value_model=value,
        train_dataset=train,
        eval_dataset=evaluation,
    )
    run_training(trainer, training_args)
    trainer.save_model(training_args.output_dir)
    updates = [h for h in trainer.state.log_history if "loss/policy_avg" in h]
    last = updates[-1] if updates else {}
    keys = ("loss/policy_avg", "loss/value_avg", "objective/scores", "objective/kl", "objective/rlhf_reward")
    return report(training_args, trainer, ppo_updates=len(updates), **{k: last.get(k) for k in keys})


if __name__ == "__main__":
    main()
