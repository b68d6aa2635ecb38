"""What the recipes share: arguments, tokenizer, model, data, and the result line.

Every recipe runs offline with no argument beyond the strategy: the tokenizer is trained
locally on the embedded corpus (`hf_lowprec.data`), the model is a tiny one built from a
config, and the data is the embedded corpus or a task generated from it. Give a model
name/path, a dataset name or local files, and the same recipe trains the real thing.

The precision strategy comes from `--precision_strategy`/`--precision_options` or, when those
are absent, from the environment variables `HF_LOWPREC_PRECISION_STRATEGY` and
`HF_LOWPREC_PRECISION_OPTIONS` (how an `accelerate launch` wrapper passes it). They are read
here, at the recipe's edge, and nowhere in the library.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoTokenizer, HfArgumentParser

from hf_lowprec.data import build_tokenizer, embedded_corpus, tiny_bert_config, tiny_gpt2_config
from hf_lowprec.integrations.launch_env import InheritedOptions, json_object

# The result line and files every recipe writes (`hf-lowprec compare` reads them) are the package's.
from hf_lowprec.runner import RESULT_MARKER
from hf_lowprec.runner import write_result as report

__all__ = [
    "ENV_STRATEGY",
    "ENV_OPTIONS",
    "RESULT_MARKER",
    "ModelArguments",
    "TextDataArguments",
    "parse_args",
    "run_training",
    "setup_logging",
    "load_tokenizer",
    "load_model",
    "tiny_config",
    "load_text_datasets",
    "group_texts",
    "docstring_prompts",
    "preference_pairs",
    "reward_model",
    "report",
]

ENV_STRATEGY = "HF_LOWPREC_PRECISION_STRATEGY"
ENV_OPTIONS = "HF_LOWPREC_PRECISION_OPTIONS"

logger = logging.getLogger("recipes")


@dataclasses.dataclass
class ModelArguments:
    """Which model and tokenizer: a hub name or local path, a config, or the embedded tiny default."""

    model_name_or_path: str | None = dataclasses.field(
        default=None, metadata={"help": "Pretrained model name or path. Unset: a model built from a config."}
    )
    config_name: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Config name or path to build a fresh model from. Unset, with no "
            "model_name_or_path: a tiny config of --model_type."
        },
    )
    model_type: str | None = dataclasses.field(
        default=None, metadata={"help": "Architecture of the tiny default model (gpt2, bert, roberta)."}
    )
    config_overrides: str | None = dataclasses.field(
        default=None, metadata={"help": "Override config values of a fresh model, e.g. 'n_embd=128,n_layer=4'."}
    )
    tokenizer_name: str | None = dataclasses.field(
        default=None, metadata={"help": "Tokenizer name or path. Unset: the model's, or the local BPE tokenizer."}
    )


@dataclasses.dataclass
class TextDataArguments:
    """Where the text comes from: a `datasets` name, local files, or the embedded corpus."""

    dataset_name: str | None = dataclasses.field(default=None, metadata={"help": "A `datasets` dataset name."})
    dataset_config_name: str | None = dataclasses.field(default=None, metadata={"help": "Its configuration."})
    train_file: str | None = dataclasses.field(
        default=None, metadata={"help": "Training text (.txt, .csv, .json, .jsonl)."}
    )
    validation_file: str | None = dataclasses.field(default=None, metadata={"help": "Validation text, same formats."})
    text_column: str = dataclasses.field(default="text", metadata={"help": "Column holding the text."})
    validation_split_percentage: int = dataclasses.field(
        default=10, metadata={"help": "Percent of train held out when there is no validation split."}
    )
    max_train_samples: int | None = dataclasses.field(default=None, metadata={"help": "Truncate the training set."})
    max_eval_samples: int | None = dataclasses.field(default=None, metadata={"help": "Truncate the validation set."})


def parse_args(
    dataclass_types: tuple[type, ...], recipe: str, argv: list[str] | None = None, **defaults: Any
) -> tuple[Any, ...]:
    """Parse the command line into `dataclass_types`, with the recipe's and the environment's defaults.

    Defaults (all overridable on the command line): output_dir `runs/<recipe>`, no reporting
    integrations, CPU when no CUDA device is present, the strategy from the environment.
    """
    parser = HfArgumentParser(dataclass_types)
    base: dict[str, Any] = {
        "output_dir": os.path.join("runs", recipe),
        "report_to": "none",
        "use_cpu": not torch.cuda.is_available(),
    }
    if os.environ.get(ENV_STRATEGY):
        base["precision_strategy"] = os.environ[ENV_STRATEGY]
    if os.environ.get(ENV_OPTIONS):
        base["precision_options"] = os.environ[ENV_OPTIONS]
        if os.environ.get(ENV_STRATEGY):  # the variable's options: dropped, with a warning, under another strategy
            options = json_object(os.environ[ENV_OPTIONS], f"${ENV_OPTIONS}")
            base["precision_options"] = InheritedOptions(options, os.environ[ENV_STRATEGY], f"${ENV_OPTIONS}")
    base.update(defaults)
    known = {f.name for cls in dataclass_types for f in dataclasses.fields(cls)}
    unknown = sorted(set(base) - known)
    if unknown:
        raise TypeError(f"recipe defaults name no argument: {unknown}")
    parser.set_defaults(**base)
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml")):
        # The HF examples' convention: all arguments in one file, over the same defaults (HF's
        # parse_json_file/parse_yaml_file would build the arguments from the file alone).
        with open(os.path.abspath(argv[0]), encoding="utf-8") as f:
            given = json.load(f) if argv[0].endswith(".json") else __import__("yaml").safe_load(f)
        if not isinstance(given, dict):
            raise ValueError(f"{argv[0]} must hold a mapping of argument names to values, got {type(given).__name__}")
        parsed = parser.parse_dict({**base, **given})
    else:
        parsed = parser.parse_args_into_dataclasses(args=argv)
    for args in parsed:
        if isinstance(args, transformers.TrainingArguments):
            _check_resume(args)
    return parsed


_LAST = ("true", "True", "last")  # --resume_from_checkpoint values naming the output dir's last checkpoint


def _check_resume(args: Any) -> None:
    """Before any work: a fresh run must not overwrite the checkpoints of an earlier one in the same
    output directory, and a checkpoint to resume from must exist."""
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    resume = args.resume_from_checkpoint
    if resume is None and last is not None:
        raise ValueError(
            f"--output_dir {args.output_dir} holds the checkpoints of an earlier run ({last}), which this run would "
            f"overwrite: continue it with --resume_from_checkpoint {last} (or 'last'), or pick another --output_dir"
        )
    if resume in _LAST and last is None:
        raise ValueError(f"--resume_from_checkpoint {resume}: --output_dir {args.output_dir} holds no checkpoint-* yet")
    if resume is not None and resume not in _LAST and not os.path.isdir(resume):
        raise ValueError(f"--resume_from_checkpoint {resume}: no such checkpoint directory")


def run_training(trainer: Any, training_args: Any) -> Any:
    """`trainer.train()`, resuming from `--resume_from_checkpoint` (a checkpoint directory, or
    'last': the output directory's latest), as the HF examples pass it; the stock Trainer does
    not read the argument itself."""
    resume = training_args.resume_from_checkpoint
    if resume is None:  # TRL's PPOTrainer.train takes no argument
        return trainer.train()
    return trainer.train(resume_from_checkpoint=True if resume in _LAST else resume)


def setup_logging(training_args: Any) -> None:
    """HF examples' logging: the process log level (quiet on replicas), to stdout."""
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    level = training_args.get_process_log_level()
    logger.setLevel(level)
    transformers.utils.logging.set_verbosity(level)
    try:
        import datasets

        datasets.utils.logging.set_verbosity(level)
        if training_args.disable_tqdm:
            datasets.disable_progress_bars()
    except ImportError:
        pass
    logger.info("precision strategy: %s %s", training_args.precision_strategy, training_args.precision_options or "")


def load_tokenizer(model_args: ModelArguments, *, encoder: bool = False) -> Any:
    """The named tokenizer, or the local BPE tokenizer.

    The local one gets `<cls> A <sep> [B <sep>]` templates with segment ids when `encoder`
    (BERT-style models); otherwise it returns no token_type_ids, which GPT-2 would embed.
    """
    name = model_args.tokenizer_name or model_args.model_name_or_path
    if name:
        return AutoTokenizer.from_pretrained(name)
    tokenizer = build_tokenizer()
    if encoder:
        from tokenizers import processors

        cls, sep = tokenizer.cls_token, tokenizer.sep_token
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{cls} $A {sep}",
            pair=f"{cls} $A {sep} $B:1 {sep}:1",
            special_tokens=[(cls, tokenizer.cls_token_id), (sep, tokenizer.sep_token_id)],
        )
    else:
        tokenizer.model_input_names = ["input_ids", "attention_mask"]
    return tokenizer


def _tiny_roberta_config(vocab_size: int, **overrides: Any) -> Any:
    from transformers import RobertaConfig

    bert = tiny_bert_config(vocab_size).to_dict()
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "pad_token_id")
    kwargs = {k: bert[k] for k in keys}
    # RoBERTa numbers positions from pad_token_id + 1: two more slots than the sequence length.
    kwargs["max_position_embeddings"] = bert["max_position_embeddings"] + 2
    kwargs.update(bos_token_id=0, eos_token_id=0)
    kwargs.update(overrides)
    return RobertaConfig(vocab_size=vocab_size, **kwargs)


_TINY: dict[str, Callable[..., Any]] = {
    "gpt2": tiny_gpt2_config,
    "bert": tiny_bert_config,
    "roberta": _tiny_roberta_config,
}


def tiny_config(model_type: str, vocab_size: int, max_length: int | None = None, **overrides: Any) -> Any:
    """The embedded tiny config of `model_type`, with room for `max_length` positions."""
    if model_type not in _TINY:
        raise ValueError(
            f"no tiny default for model_type {model_type!r}; choose one of {sorted(_TINY)} "
            "or pass --config_name / --model_name_or_path"
        )
    config = _TINY[model_type](vocab_size)
    if max_length is not None:
        if model_type == "gpt2":
            overrides.setdefault("n_positions", max(config.n_positions, max_length))
        else:
            extra = 2 if model_type == "roberta" else 0
            overrides.setdefault("max_position_embeddings", max(config.max_position_embeddings, max_length + extra))
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def load_model(
    auto_class: Any,
    model_args: ModelArguments,
    tokenizer: Any,
    *,
    default_type: str,
    max_length: int | None = None,
    **config_values: Any,
) -> Any:
    """`auto_class.from_pretrained(name)`, or a fresh model from `--config_name` or the tiny default."""
    if model_args.model_name_or_path:
        return auto_class.from_pretrained(model_args.model_name_or_path, **config_values)
    if model_args.config_name:
        config = AutoConfig.from_pretrained(model_args.config_name)
        for key, value in config_values.items():
            setattr(config, key, value)
    else:
        config = tiny_config(model_args.model_type or default_type, len(tokenizer), max_length, **config_values)
    if model_args.config_overrides:
        config.update_from_string(model_args.config_overrides)
    return auto_class.from_config(config)


def load_text_datasets(data_args: TextDataArguments, seed: int) -> Any:
    """A DatasetDict with "train" and "validation" splits of a text column."""
    import datasets

    if data_args.dataset_name:
        raw = datasets.load_dataset(data_args.dataset_name, data_args.dataset_config_name)
    elif data_args.train_file:
        files = {"train": data_args.train_file}
        if data_args.validation_file:
            files["validation"] = data_args.validation_file
        suffix = Path(data_args.train_file).suffix.lstrip(".")
        builder = {"txt": "text", "jsonl": "json"}.get(suffix, suffix)
        raw = datasets.load_dataset(builder, data_files=files)
    else:
        raw = datasets.DatasetDict({"train": datasets.Dataset.from_dict({data_args.text_column: embedded_corpus()})})
    if "validation" not in raw:
        split = raw["train"].train_test_split(test_size=data_args.validation_split_percentage / 100, seed=seed)
        raw = datasets.DatasetDict({"train": split["train"], "validation": split["test"]})
    for name, limit in (("train", data_args.max_train_samples), ("validation", data_args.max_eval_samples)):
        if limit is not None:
            raw[name] = raw[name].select(range(min(limit, len(raw[name]))))
    return raw


def group_texts(
    raw: Any, tokenizer: Any, block_size: int, text_column: str, *, training_args: Any, append_eos: bool, labels: bool
) -> Any:
    """Tokenize, concatenate and cut into blocks of `block_size` tokens (run_clm / run_mlm style)."""
    eos = [tokenizer.eos_token_id] if append_eos and tokenizer.eos_token_id is not None else []

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        encoded = tokenizer(batch[text_column], return_attention_mask=False)
        return {"input_ids": [ids + eos for ids in encoded["input_ids"]]}

    def blocks(batch: dict[str, list]) -> dict[str, list]:
        ids = [t for seq in batch["input_ids"] for t in seq]
        n = len(ids) // block_size * block_size
        out = {"input_ids": [ids[i : i + block_size] for i in range(0, n, block_size)]}
        if labels:
            out["labels"] = [list(b) for b in out["input_ids"]]
        return out

    with training_args.main_process_first(desc="tokenize and group"):
        columns = raw["train"].column_names
        tokenized = raw.map(tokenize, batched=True, remove_columns=columns, desc="tokenize")
        grouped = tokenized.map(blocks, batched=True, desc=f"blocks of {block_size}")
    for name, split in grouped.items():
        if len(split) == 0:
            raise ValueError(f"the {name} split has fewer than {block_size} tokens; lower --block_size")
    return grouped


def docstring_prompts(n: int, seed: int = 0, words: int = 6) -> list[str]:
    """`n` short prompts: the opening words of embedded-corpus paragraphs."""
    paragraphs = embedded_corpus()
    random.Random(seed).shuffle(paragraphs)
    return [" ".join(p.split()[:words]) for p in paragraphs[:n]]


def preference_pairs(n: int, seed: int = 0, words: int = 24) -> dict[str, list[str]]:
    """Embedded preferences: a docstring passage is chosen over the same words shuffled."""
    rng = random.Random(seed)
    paragraphs = [p.split()[:words] for p in embedded_corpus() if len(p.split()) >= 8]
    rng.shuffle(paragraphs)
    chosen, rejected = [], []
    for tokens in paragraphs[:n]:
        shuffled = tokens[:]
        rng.shuffle(shuffled)
        chosen.append(" ".join(tokens))
        rejected.append(" ".join(shuffled))
    return {"chosen": chosen, "rejected": rejected}


def no_activation_checkpointing() -> dict[str, bool]:
    """TRL's configs checkpoint activations by default; this turns it off under the name the
    installed transformers knows: `activation_checkpointing`, or before it (5.17, for one)
    `gradient_checkpointing`, which later releases keep as its deprecated alias."""
    names = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    return {"activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": False}


def reward_model(path: str | None, tokenizer: Any, training_args: Any, *, steps: int, batch_size: int = 8) -> Any:
    """A sequence-scoring model with one output: loaded from `path`, or a tiny GPT-2 trained here.

    The tiny one is trained for `steps` steps with `hf_lowprec.trl.RewardTrainer`, under the
    run's precision strategy, to prefer docstring text over the same words shuffled.
    """
    from transformers import AutoModelForSequenceClassification

    if path:
        return AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    config = tiny_config("gpt2", len(tokenizer), num_labels=1, pad_token_id=tokenizer.pad_token_id)
    model = AutoModelForSequenceClassification.from_config(config)
    model.name_or_path = "tiny-reward-model"  # TRL names the reward in its logs after this
    if steps <= 0:
        return model
    import datasets

    from hf_lowprec.trl import RewardConfig, RewardTrainer

    args = RewardConfig(
        output_dir=os.path.join(training_args.output_dir, "reward_model"),
        max_steps=steps,
        precision_strategy=training_args.precision_strategy,
        precision_options=training_args.precision_options,
        per_device_train_batch_size=batch_size,
        learning_rate=1e-3,
        max_length=64,
        **no_activation_checkpointing(),
        logging_steps=max(1, steps // 4),
        save_strategy="no",
        report_to="none",
        use_cpu=training_args.use_cpu,
        seed=training_args.seed,
        disable_tqdm=training_args.disable_tqdm,
    )
    pairs = datasets.Dataset.from_dict(preference_pairs(steps * batch_size, training_args.seed))
    trainer = RewardTrainer(model=model, args=args, train_dataset=pairs, processing_class=tokenizer)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    if logged:
        logger.info("reward model: loss %.4f after %d steps", logged[-1]["loss"], steps)
    return trainer.model
