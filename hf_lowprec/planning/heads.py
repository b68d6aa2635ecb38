"""The labels a counted step gives the model's head: the token ids for a language-model head,
one class (or score) per sequence for sequence classification, one class per token for token
classification; heads that take other targets (spans, choices) are refused before counting."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_head", "step_labels"]

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
