"""Supervised fine-tuning with TRL's SFTTrainer and a precision strategy: plain text or chat messages.

    python recipes/sft.py --precision_strategy collage-plus                             # embedded text
    python recipes/sft.py --precision_strategy collage-plus --dataset_format messages   # embedded chats
    python recipes/sft.py --precision_strategy bf16-mixed --use_peft                    # LoRA
    python recipes/sft.py --precision_strategy collage-plus --model_name_or_path Qwen/Qwen2.5-0.5B \
        --dataset_name trl-lib/Capybara

The only change from a TRL script is `from hf_lowprec.trl import SFTConfig, SFTTrainer`.
Data: `--dataset_name` (a `datasets` name), `--train_file` (JSON/JSONL/CSV with a `text` or a
`messages` column), or the embedded default: docstring paragraphs as text, or chats where the
user asks what a standard-library function does and the assistant answers with its docstring.
The local tokenizer gets a small chat template with generation markers, so
`--assistant_only_loss` works with it.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import random
from typing import Literal

from transformers import AutoModelForCausalLM, set_seed

from common import (
    ModelArguments,
    TextDataArguments,
    load_model,
    load_text_datasets,
    load_tokenizer,
    parse_args,
    report,
    run_training,
    setup_logging,
)
from hf_lowprec.trl import SFTConfig, SFTTrainer

# Roles are written out as text; the answer and its end-of-text token are the generation.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\n' }}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}{{ '\n' }}"
    "{%- else %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>\n' }}{%- endif %}"
)

_CHAT_MODULES = (
    "json",
    "os.path",
    "re",
    "textwrap",
    "itertools",
    "functools",
    "collections",
    "string",
    "math",
    "statistics",
    "shutil",
    "pathlib",
    "random",
    "heapq",
    "bisect",
    "base64",
    "difflib",
    "fnmatch",
    "glob",
    "shlex",
    "copy",
    "operator",
    "datetime",
    "csv",
    "zipfile",
    "tarfile",
)
_QUESTIONS = ("What does {} do?", "Explain {} briefly.", "How would you describe {}?", "What is {} for?")


@dataclasses.dataclass
class SFTDataArguments:
    dataset_format: Literal["text", "messages"] = dataclasses.field(
        default="text", metadata={"help": "Embedded default data: plain text or chat messages."}
    )
    use_peft: bool = dataclasses.field(default=False, metadata={"help": "Train a LoRA adapter (needs peft)."})
    lora_r: int = dataclasses.field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = dataclasses.field(default=16, metadata={"help": "LoRA alpha."})


def docstring_chats(seed: int) -> list[list[dict[str, str]]]:
    """One-turn chats about standard-library functions, answered by their docstrings."""
    chats = []
    rng = random.Random(seed)
    for module_name in _CHAT_MODULES:
        module = importlib.import_module(module_name)
        for name in sorted(getattr(module, "__all__", None) or dir(module)):
            obj = getattr(module, name, None)
            doc = inspect.getdoc(obj) if callable(obj) and not name.startswith("_") else None
            if not doc or getattr(obj, "__module__", None) not in (module.__name__, module_name):
                continue
            answer = " ".join(doc.split("\n\n")[0].split())
            if len(answer) >= 30:
                question = rng.choice(_QUESTIONS).format(f"`{module_name}.{name}`")
                chats.append([{"role": "user", "content": question}, {"role": "assistant", "content": answer}])
    rng.shuffle(chats)
    return chats


def main(argv: list[str] | None = None) -> dict:
    model_args, data_args, sft_args, training_args = parse_args(
        (ModelArguments, TextDataArguments, SFTDataArguments, SFTConfig),
        "sft",
        argv,
        num_train_epochs=1.0,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        warmup_steps=0.05,
        per_device_train_batch_size=8,
        max_length=128,
        logging_steps=10,
        save_strategy="no",
    )
    setup_logging(training_args)
    set_seed(training_args.seed)
    import datasets

    tokenizer = load_tokenizer(model_args)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = CHAT_TEMPLATE
    model = load_model(
        AutoModelForCausalLM, model_args, tokenizer, default_type="gpt2", max_length=training_args.max_length
    )

    if data_args.dataset_name or data_args.train_file or sft_args.dataset_format == "text":
        data = load_text_datasets(data_args, training_args.seed)
    else:
        chats = docstring_chats(training_args.seed)
        n_eval = max(1, len(chats) // 10)
        data = datasets.DatasetDict(
            {
                "train": datasets.Dataset.from_dict({"messages": chats[n_eval:]}),
                "validation": datasets.Dataset.from_dict({"messages": chats[:n_eval]}),
            }
        )
        for split, limit in (("train", data_args.max_train_samples), ("validation", data_args.max_eval_samples)):
            if limit is not None:
                data[split] = data[split].select(range(min(limit, len(data[split]))))
    if "text" not in data["train"].column_names and data_args.text_column in data["train"].column_names:
        training_args.dataset_text_field = data_args.text_column

    peft_config = None
    if sft_args.use_peft:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=sft_args.lora_r,
            lora_alpha=sft_args.lora_alpha,
            lora_dropout=0.0,
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        )

    trainer = SFTTrainer(
        model=model,
        args=training_args,
        train_dataset=data["train"],
        eval_dataset=data["validation"],
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    train_result = run_training(trainer, training_args)
    trainer.save_model()
    trainer.log_metrics("train", train_result.metrics)
    eval_metrics = trainer.evaluate()
    trainer.log_metrics("eval", eval_metrics)
    frozen = [p for p in trainer.model.parameters() if not p.requires_grad]
    return report(
        training_args,
        trainer,
        eval_loss=eval_metrics["eval_loss"],
        data_format=list(data["train"].column_names),
        peft=sft_args.use_peft,
        frozen_param_dtype=str(frozen[0].dtype) if frozen else None,
    )


if __name__ == "__main__":
    main()
