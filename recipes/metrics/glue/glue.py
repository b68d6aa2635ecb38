"""GLUE metrics as a local `evaluate` module: accuracy, F1, Matthews correlation, Pearson, Spearman.

    metric = evaluate.load("recipes/metrics/glue", "mrpc")    # a path: nothing is downloaded
    metric.compute(predictions=[1, 0, 1], references=[1, 1, 1])
    # {'accuracy': 0.667, 'f1': 0.8}

The configuration is the GLUE task; each task reports the metrics the GLUE benchmark scores
it with (Wang et al., 2019, Table 1): CoLA Matthews correlation; STS-B Pearson and Spearman
correlation; MRPC and QQP accuracy and F1 of the positive class; every other task accuracy.
Written with numpy only. A correlation that is undefined (constant predictions or references)
is reported as 0.0, not NaN.
"""

from __future__ import annotations

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "GLUE benchmark metrics (accuracy, F1, Matthews correlation, Pearson and Spearman correlation)."
_CITATION = """@inproceedings{wang2019glue,
  title={{GLUE}: A Multi-Task Benchmark and Analysis Platform for Natural Language Understanding},
  author={Wang, Alex and Singh, Amanpreet and Michael, Julian and Hill, Felix and Levy, Omer and Bowman, Samuel R.},
  booktitle={International Conference on Learning Representations},
  year={2019}
}"""
_INPUTS = """
Args:
    predictions: predicted labels (int), or scores (float) for stsb.
    references: gold labels (int), or scores (float) for stsb.
Returns:
    cola: matthews_correlation; stsb: pearson, spearmanr; mrpc, qqp: accuracy, f1;
    sst2, mnli, mnli_matched, mnli_mismatched, qnli, rte, wnli, hans, ax: accuracy.
"""

_ACCURACY_F1 = {"mrpc", "qqp"}
_ACCURACY = {"sst2", "mnli", "mnli_matched", "mnli_mismatched", "qnli", "rte", "wnli", "hans", "ax"}
TASKS = sorted(_ACCURACY_F1 | _ACCURACY | {"cola", "stsb"})


def accuracy(predictions: np.ndarray, references: np.ndarray) -> float:
    return float(np.mean(predictions == references))


def f1_positive(predictions: np.ndarray, references: np.ndarray) -> float:
    """F1 of label 1 (0 when there is no true or predicted positive)."""
    tp = float(np.sum((predictions == 1) & (references == 1)))
    fp = float(np.sum((predictions == 1) & (references != 1)))
    fn = float(np.sum((predictions != 1) & (references == 1)))
    return 0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn)


def matthews_correlation(predictions: np.ndarray, references: np.ndarray) -> float:
    """Multi-class Matthews correlation (Gorodkin's R_K); 0 when either side is constant."""
    labels = np.union1d(predictions, references)
    index = {label: i for i, label in enumerate(labels)}
    confusion = np.zeros((len(labels), len(labels)), dtype=np.float64)
    for p, r in zip(predictions, references):
        confusion[index[r], index[p]] += 1
    t = confusion.sum(axis=1)  # true counts per class
    p = confusion.sum(axis=0)  # predicted counts per class
    n = confusion.sum()
    correct = np.trace(confusion)
    numerator = correct * n - t @ p
    denominator = np.sqrt((n * n - p @ p) * (n * n - t @ t))
    return 0.0 if denominator == 0 else float(numerator / denominator)


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    x = np.asarray(x, dtype=np.float64) - np.mean(x)
    y = np.asarray(y, dtype=np.float64) - np.mean(y)
    denominator = np.sqrt(np.sum(x * x) * np.sum(y * y))
    return 0.0 if denominator == 0 else float(np.sum(x * y) / denominator)


def average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n with ties given the mean of the ranks they span."""
    x = np.asarray(x)
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    sorted_x = x[order]
    start = 0
    while start < len(x):
        end = start
        while end + 1 < len(x) and sorted_x[end + 1] == sorted_x[start]:
            end += 1
        ranks[order[start : end + 1]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    return pearson(average_ranks(x), average_ranks(y))


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _INPUTS)
class Glue(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        if self.config_name not in TASKS:
            raise KeyError(f"unknown GLUE task {self.config_name!r}; choose one of {TASKS}")
        value = datasets.Value("float32" if self.config_name == "stsb" else "int64")
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_INPUTS,
            features=datasets.Features({"predictions": value, "references": value}),
            format="numpy",
        )

    def _compute(self, predictions: np.ndarray, references: np.ndarray) -> dict[str, float]:
        predictions = np.asarray(predictions)
        references = np.asarray(references)
        if self.config_name == "cola":
            return {"matthews_correlation": matthews_correlation(predictions, references)}
        if self.config_name == "stsb":
            return {"pearson": pearson(predictions, references), "spearmanr": spearman(predictions, references)}
        if self.config_name in _ACCURACY_F1:
            return {"accuracy": accuracy(predictions, references), "f1": f1_positive(predictions, references)}
        return {"accuracy": accuracy(predictions, references)}
