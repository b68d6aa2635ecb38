"""The labels a counted step gives the model's head: the token ids for a language-model head,
one class (or score) per sequence for sequence classification, one class per token for token
classification; heads that take other targets (spans, choices), and models that take more than
token ids (a vision tower beside the language model), are refused before counting."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_head", "check_text_only", "step_labels"]

# Heads whose targets are not derived from the token ids alone.
_REFUSED = ("ForQuestionAnswering", "ForMultipleChoice", "ForNextSentencePrediction")


def check_head(cls: Any) -> None:
    """Raise ValueError naming `cls` when the planner cannot give its head labels."""
    name = getattr(cls, "__name__", str(cls))
    if name.endswith(_REFUSED):
        raise ValueError(
            f"{name} takes span or choice targets; plan counts language-model, sequence- and "
            "token-classification heads: save the model with one of those heads (e.g. its *ForMaskedLM class)"
        )


def check_text_only(model: str, config: Any) -> None:
    """Raise ValueError when `config` (of `--model model`) holds models beside its language model
    (LLaVA, Qwen2-VL: `text_config` and `vision_config`): the counted step feeds token ids only, so
    their blocks would never run, and the depth and the blocks to count are the text model's."""
    if config.get_text_config() is config:
        return
    others = ", ".join(key for key in getattr(config, "sub_configs", {}) if key != "text_config") or "other configs"
    raise ValueError(
        f"--model {model}: {type(config).__name__} holds a language model (text_config) and models beside it "
        f"({others}) that the counted step, token ids in, would never run, so their memory and time would be "
        "missing; the planners count language models only: pass the language model's config (its text_config "
        'saved as a config.json, with "architectures" naming a causal-LM class where its model_type has none)'
    )


def step_labels(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Labels of the shape and dtype `model`'s head takes for the (sequences, tokens) ids `ids`."""
    check_head(type(model))
    name, config = type(model).__name__, model.config
    num_labels = getattr(config, "num_labels", 2)
    if name.endswith("ForSequenceClassification"):
        problem = getattr(config, "problem_type", None)
        if problem == "regression" or (problem is None and num_labels == 1):
            return ids[:, 0].to(torch.float32)
        if problem == "multi_label_classification":
            return ids.new_zeros((ids.shape[0], num_labels), dtype=torch.float32)
        return ids[:, 0] % num_labels
    if name.endswith("ForTokenClassification"):
        return ids % num_labels
    return ids
