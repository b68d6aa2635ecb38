"""Preference tuning with DPO (TRL's DPOTrainer) under a precision strategy.

    python recipes/dpo.py --precision_strategy collage-plus --max_steps 20
    python recipes/dpo.py --precision_strategy bf16-mixed --model_name_or_path my-sft-model \
        --dataset_name trl-lib/ultrafeedback_binarized

The only change from a TRL script is `from hf_lowprec.trl import DPOConfig, DPOTrainer`. The
reference model is a frozen copy of the policy at the start, kept at its forward's precision
(BF16, FP16 or FP8 blocks; docs/rl.md), passed as `ref_model=`, since a model built from a
config has no name TRL could reload it from.

Offline default: a tiny GPT-2 and an embedded preference set: the first words of a docstring
passage are the prompt, its true continuation is chosen over the same words shuffled.
"""

from __future__ import annotations

import copy
import dataclasses

from transformers import AutoModelForCausalLM, set_seed

from common import (
    ModelArguments,
    load_model,
    load_tokenizer,
    parse_args,
    preference_pairs,
    report,
    run_training,
    setup_logging,
)
from hf_lowprec.trl import DPOConfig, DPOTrainer


@dataclasses.dataclass
class DPOScriptArguments:
    dataset_name: str | None = dataclasses.field(
        default=None, metadata={"help": "A `datasets` preference dataset (prompt/chosen/rejected). Unset: embedded."}
    )
    num_pairs: int = dataclasses.field(default=128, metadata={"help": "Embedded preference pairs to train on."})
    prompt_words: int = dataclasses.field(
        default=6, metadata={"help": "Words of each embedded passage used as the prompt."}
    )


def embedded_preferences(n: int, seed: int, prompt_words: int) -> dict[str, list[str]]:
    """prompt / chosen / rejected: a passage's first words, its continuation, the continuation shuffled."""
    pairs = preference_pairs(n, seed)
    out: dict[str, list[str]] = {"prompt": [], "chosen": [], "rejected": []}
    for chosen, rejected in zip(pairs["chosen"], pairs["rejected"]):
        words = chosen.split()
        prompt, rest = words[:prompt_words], words[prompt_words:]
        shuffled = list(rejected.split())
        for w in prompt:  # the rejected side continues the same prompt with the remaining words shuffled
            shuffled.remove(w)
        if not rest or rest == shuffled:
            continue
        out["prompt"].append(" ".join(prompt))
        out["chosen"].append(" " + " ".join(rest))
        out["rejected"].append(" " + " ".join(shuffled))
    return out


def main(argv: list[str] | None = None) -> dict:
    model_args, script_args, training_args = parse_args(
        (ModelArguments, DPOScriptArguments, DPOConfig),
        "dpo",
        argv,
        learning_rate=5e-4,
        per_device_train_batch_size=8,
        num_train_epochs=1.0,
        logging_steps=1,
        save_strategy="no",
        max_length=64,
    )
    setup_logging(training_args)
    set_seed(training_args.seed)
    import datasets

    tokenizer = load_tokenizer(model_args)
    policy = load_model(AutoModelForCausalLM, model_args, tokenizer, default_type="gpt2")
    reference = copy.deepcopy(policy)
    reference.requires_grad_(False)
    reference.eval()
    if script_args.dataset_name:
        train = datasets.load_dataset(script_args.dataset_name, split="train")
    else:
        train = datasets.Dataset.from_dict(
            embedded_preferences(script_args.num_pairs, training_args.seed, script_args.prompt_words)
        )

    trainer = DPOTrainer(
        model=policy, ref_model=reference, args=training_args, train_dataset=train, processing_class=tokenizer
    )
    run_training(trainer, training_args)
    trainer.save_model()
    history = [h for h in trainer.state.log_history if "loss" in h]
    first, last = (history[0], history[-1]) if history else ({}, {})
    margin_key = next((k for k in last if k.endswith("rewards/margins")), None)
    accuracy_key = next((k for k in last if k.endswith("rewards/accuracies")), None)
    return report(
        training_args,
        trainer,
        first_margin=first.get(margin_key),
        final_margin=last.get(margin_key),
        final_reward_accuracy=last.get(accuracy_key),
    )


if __name__ == "__main__":
    main()
