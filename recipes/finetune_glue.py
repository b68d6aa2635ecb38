"""GLUE fine-tuning (classification, sentence pairs, STS-B regression) with a precision strategy.

    python recipes/finetune_glue.py --precision_strategy collage-plus                          # embedded task
    python recipes/finetune_glue.py --precision_strategy collage-plus --task_name synthetic-stsb
    python recipes/finetune_glue.py --precision_strategy collage-plus --task_name sst2 --model_name_or_path bert-base-uncased
    python recipes/finetune_glue.py --precision_strategy bf16-mixed --train_file train.csv --validation_file dev.csv

Data, in the order tried: a GLUE task from `datasets` (`--task_name sst2|cola|mrpc|qqp|stsb|
mnli|qnli|rte|wnli`); local CSV/JSON files in the run_glue layout (`--train_file`,
`--validation_file`: a `label` column and one or two text columns); or one of the embedded
tasks generated from the standard library's docstrings (`--task_name synthetic-sst2`, the
default, `synthetic-cola`, `synthetic-mrpc`, `synthetic-stsb`), each shaped like its GLUE
namesake and scored with its metric. Metrics come from the local `evaluate` module in
`recipes/metrics/glue` (nothing is downloaded).
"""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path

import numpy as np
from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding, set_seed

from common import ModelArguments, load_model, load_tokenizer, parse_args, report, run_training, setup_logging
from hf_lowprec import Trainer, TrainingArguments
from hf_lowprec.data import embedded_corpus

METRIC_PATH = str(Path(__file__).resolve().parent / "metrics" / "glue")

# task: (text columns, number of labels (1: regression), validation split)
GLUE_TASKS: dict[str, tuple[tuple[str, str | None], int, str]] = {
    "cola": (("sentence", None), 2, "validation"),
    "sst2": (("sentence", None), 2, "validation"),
    "mrpc": (("sentence1", "sentence2"), 2, "validation"),
    "qqp": (("question1", "question2"), 2, "validation"),
    "stsb": (("sentence1", "sentence2"), 1, "validation"),
    "mnli": (("premise", "hypothesis"), 3, "validation_matched"),
    "qnli": (("question", "sentence"), 2, "validation"),
    "rte": (("sentence1", "sentence2"), 2, "validation"),
    "wnli": (("sentence1", "sentence2"), 2, "validation"),
}

# GLUE's headline metric by task (accuracy where unlisted).
PRIMARY_METRICS = {"cola": "matthews_correlation", "stsb": "pearson"}


@dataclasses.dataclass
class GlueArguments:
    task_name: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": f"GLUE task ({', '.join(GLUE_TASKS)}) or embedded task "
            "(synthetic-sst2, synthetic-cola, synthetic-mrpc, synthetic-stsb). "
            "Unset with no files: synthetic-sst2."
        },
    )
    train_file: str | None = dataclasses.field(default=None, metadata={"help": "Training CSV/JSON."})
    validation_file: str | None = dataclasses.field(default=None, metadata={"help": "Validation CSV/JSON."})
    max_seq_length: int = dataclasses.field(default=128, metadata={"help": "Truncate inputs to this many tokens."})
    max_train_samples: int | None = dataclasses.field(default=None, metadata={"help": "Truncate the training set."})
    max_eval_samples: int | None = dataclasses.field(default=None, metadata={"help": "Truncate the validation set."})
    synthetic_size: int = dataclasses.field(default=2000, metadata={"help": "Training examples of an embedded task."})


# --- embedded tasks ------------------------------------------------------------------------
_POSITIVE = ("clear", "helpful", "reliable", "elegant", "fast", "excellent", "useful", "simple", "robust", "great")
_NEGATIVE = ("confusing", "useless", "fragile", "clumsy", "slow", "terrible", "broken", "awkward", "buggy", "poor")
_SUBJECTS = ("the {} module", "this {} function", "the {} documentation", "using {}", "the {} API")
_FRAMES = ("{s} is {a}.", "I found {s} {a}.", "Honestly, {s} feels {a}.", "{s} turned out {a} in practice.")
# Words that replace a sentence's own in the similarity task; how many there are sets the score.
_NOISE = (
    "banana",
    "violet",
    "thunder",
    "pebble",
    "walrus",
    "saffron",
    "lantern",
    "meadow",
    "quartz",
    "tulip",
    "harbor",
    "cobalt",
    "falcon",
    "juniper",
    "marble",
    "nutmeg",
    "orchid",
    "papaya",
    "rocket",
    "velvet",
)


def _sentences(seed: int) -> list[str]:
    out = []
    for paragraph in embedded_corpus():
        for sentence in re.split(r"(?<=[.!?])\s+", paragraph):
            if 5 <= len(sentence.split()) <= 25:
                out.append(sentence)
    random.Random(seed).shuffle(out)
    return out


def synthetic_task(name: str, size: int, seed: int) -> tuple[dict[str, dict[str, list]], str]:
    """Train/validation columns of an embedded task and the GLUE task whose metric scores it."""
    rng = random.Random(seed)
    sentences = _sentences(seed)
    words = [w for s in sentences[:500] for w in s.split()]
    n = size + max(200, size // 10)

    def sst2(i: int) -> tuple:
        label = rng.random() < 0.5
        subject = rng.choice(_SUBJECTS).format(rng.choice(words).strip(".,:;()`'\""))
        text = rng.choice(_FRAMES).format(s=subject, a=rng.choice(_POSITIVE if label else _NEGATIVE))
        return text[0].upper() + text[1:], int(label)

    def cola(i: int) -> tuple:
        tokens = sentences[i % len(sentences)].split()
        if rng.random() < 0.5:
            return " ".join(tokens), 1
        j = rng.randrange(len(tokens) - 1)
        tokens[j], tokens[j + 1] = tokens[j + 1], tokens[j]
        rng.shuffle(tokens)
        return " ".join(tokens), 0

    def mrpc(i: int) -> tuple:
        first = sentences[i % len(sentences)]
        if rng.random() < 0.5:
            tokens = first.split()
            keep = [t for t in tokens if rng.random() > 0.15] or tokens
            return first, " ".join(keep), 1
        return first, sentences[rng.randrange(len(sentences))], 0

    def stsb(i: int) -> tuple:
        tokens = sentences[i % len(sentences)].split()
        fraction = rng.random()
        changed = [rng.choice(_NOISE) if rng.random() < fraction else t for t in tokens]
        same = sum(a == b for a, b in zip(tokens, changed)) / len(tokens)
        return " ".join(tokens), " ".join(changed), round(5.0 * same, 2)

    makers = {
        "synthetic-sst2": (sst2, ("sentence",), "sst2"),
        "synthetic-cola": (cola, ("sentence",), "cola"),
        "synthetic-mrpc": (mrpc, ("sentence1", "sentence2"), "mrpc"),
        "synthetic-stsb": (stsb, ("sentence1", "sentence2"), "stsb"),
    }
    if name not in makers:
        raise ValueError(f"unknown embedded task {name!r}; choose one of {sorted(makers)}")
    make, columns, glue_task = makers[name]
    rows = [make(i) for i in range(n)]
    splits = {"train": rows[:size], "validation": rows[size:]}
    out = {
        split: {col: [r[k] for r in part] for k, col in enumerate((*columns, "label"))}
        for split, part in splits.items()
    }
    return out, glue_task


# --- data ----------------------------------------------------------------------------------
_STRING_DTYPES = ("string", "large_string")


def load_glue_data(args: GlueArguments, seed: int):
    """(DatasetDict with train/validation, text columns, number of labels, metric config)."""
    import datasets

    task = args.task_name
    if task is None and args.train_file is None:
        task = "synthetic-sst2"
    if task is not None and task.startswith("synthetic-"):
        columns, glue_task = synthetic_task(task, args.synthetic_size, seed)
        raw = datasets.DatasetDict({k: datasets.Dataset.from_dict(v) for k, v in columns.items()})
        keys, num_labels, _ = GLUE_TASKS[glue_task]
        return raw, keys, num_labels, glue_task
    if args.train_file is not None:
        files = {"train": args.train_file}
        if args.validation_file:
            files["validation"] = args.validation_file
        builder = "csv" if args.train_file.endswith(".csv") else "json"
        raw = datasets.load_dataset(builder, data_files=files)
        if "validation" not in raw:
            split = raw["train"].train_test_split(test_size=0.1, seed=seed)
            raw = datasets.DatasetDict({"train": split["train"], "validation": split["test"]})
    elif task in GLUE_TASKS:
        full = datasets.load_dataset("nyu-mll/glue", task)
        raw = datasets.DatasetDict({"train": full["train"], "validation": full[GLUE_TASKS[task][2]]})
    else:
        raise ValueError(f"unknown task {task!r}; choose one of {sorted(GLUE_TASKS)} or synthetic-*")
    if task in GLUE_TASKS:
        keys, num_labels, _ = GLUE_TASKS[task]
        return raw, keys, num_labels, task
    # run_glue's rule for files: sentence1/sentence2 if present, else the first one or two text columns.
    features = raw["train"].features
    texts = [c for c in raw["train"].column_names if c != "label" and features[c].dtype in _STRING_DTYPES]
    if {"sentence1", "sentence2"} <= set(texts):
        keys = ("sentence1", "sentence2")
    else:
        keys = (texts[0], texts[1] if len(texts) > 1 else None)
    regression = features["label"].dtype in ("float32", "float64")
    if regression:
        return raw, keys, 1, "stsb"
    labels = sorted(set(raw["train"]["label"]))
    # Labels that are not 0..n-1 (text, or 1-based as Yelp polarity's) become ids, as run_glue maps them.
    if labels != list(range(len(labels))):
        index = {label: i for i, label in enumerate(labels)}
        for split, rows in raw.items():
            unseen = sorted(set(rows["label"]) - set(index), key=str)
            if unseen:
                raise ValueError(
                    f"the {split} split has labels the training data lacks: {unseen[:5]} (train: {labels})"
                )
        raw = raw.map(lambda row: {"label": index[row["label"]]})
    return raw, keys, len(labels), "mrpc" if len(labels) == 2 else "mnli"


def main(argv: list[str] | None = None) -> dict:
    model_args, glue_args, training_args = parse_args(
        (ModelArguments, GlueArguments, TrainingArguments),
        "finetune_glue",
        argv,
        model_type="bert",
        num_train_epochs=3.0,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        warmup_steps=0.06,
        weight_decay=0.01,
        per_device_train_batch_size=32,
        per_device_eval_batch_size=64,
        logging_steps=10,
        save_strategy="no",
        eval_strategy="epoch",
    )
    setup_logging(training_args)
    set_seed(training_args.seed)
    import evaluate

    raw, (key1, key2), num_labels, metric_task = load_glue_data(glue_args, training_args.seed)
    for name, limit in (("train", glue_args.max_train_samples), ("validation", glue_args.max_eval_samples)):
        if limit is not None:
            raw[name] = raw[name].select(range(min(limit, len(raw[name]))))
    metric = evaluate.load(METRIC_PATH, metric_task)

    tokenizer = load_tokenizer(model_args, encoder=True)
    extra = {"num_labels": num_labels, "problem_type": "regression" if num_labels == 1 else None}
    if tokenizer.pad_token_id is not None:
        extra["pad_token_id"] = tokenizer.pad_token_id
    model = load_model(
        AutoModelForSequenceClassification,
        model_args,
        tokenizer,
        default_type="bert",
        max_length=glue_args.max_seq_length,
        **extra,
    )

    def encode(batch: dict) -> dict:
        texts = (batch[key1],) if key2 is None else (batch[key1], batch[key2])
        return tokenizer(*texts, truncation=True, max_length=glue_args.max_seq_length)

    with training_args.main_process_first(desc="tokenize"):
        keep = {"label"}
        encoded = raw.map(encode, batched=True, remove_columns=[c for c in raw["train"].column_names if c not in keep])

    def compute_metrics(prediction) -> dict:
        logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
        predictions = np.squeeze(logits, -1) if num_labels == 1 else np.argmax(logits, axis=-1)
        return metric.compute(predictions=predictions, references=prediction.label_ids)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=encoded["train"],
        eval_dataset=encoded["validation"],
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=compute_metrics,
    )
    train_result = run_training(trainer, training_args)
    trainer.save_model()
    trainer.log_metrics("train", train_result.metrics)
    eval_metrics = trainer.evaluate()
    trainer.log_metrics("eval", eval_metrics)
    glue = {
        k[len("eval_") :]: v
        for k, v in eval_metrics.items()
        if k[len("eval_") :] in ("accuracy", "f1", "matthews_correlation", "pearson", "spearmanr")
    }
    # The task's headline metric, flat beside the others: `hf-lowprec compare` reads `primary_metric`.
    primary = "eval_" + PRIMARY_METRICS.get(metric_task, "accuracy")
    return report(
        training_args,
        trainer,
        task=glue_args.task_name or ("files" if glue_args.train_file else "synthetic-sst2"),
        metric_task=metric_task,
        glue=glue,
        eval_loss=eval_metrics["eval_loss"],
        primary_metric=primary,
        **{primary: eval_metrics.get(primary)},
    )


if __name__ == "__main__":
    main()
