"""The local GLUE `evaluate` module against values worked out by hand."""

from pathlib import Path

import numpy as np
import pytest

evaluate = pytest.importorskip("evaluate")

METRIC = str(Path(__file__).resolve().parents[2] / "recipes" / "metrics" / "glue")


def load(task):
    return evaluate.load(METRIC, task)


def test_accuracy_and_f1():
    # tp=2, fp=1, fn=1, tn=1: accuracy 3/5, F1 = 2*2 / (2*2 + 1 + 1) = 2/3.
    out = load("mrpc").compute(predictions=[1, 1, 1, 0, 0], references=[1, 1, 0, 1, 0])
    assert out == pytest.approx({"accuracy": 0.6, "f1": 2 / 3}, abs=1e-12)
    assert load("sst2").compute(predictions=[0, 1], references=[1, 1]) == {"accuracy": 0.5}


def test_matthews_correlation():
    # Binary: tp=2, tn=1, fp=1, fn=1: (2*1 - 1*1) / sqrt(3*3*2*2) = 1/6.
    out = load("cola").compute(predictions=[1, 1, 1, 0, 0], references=[1, 1, 0, 1, 0])
    assert out["matthews_correlation"] == pytest.approx(1 / 6, abs=1e-12)
    # Constant predictions: 0 by convention (the correlation is undefined).
    assert load("cola").compute(predictions=[1, 1, 1], references=[1, 0, 1])["matthews_correlation"] == 0.0
    assert load("cola").compute(predictions=[0, 1, 0, 1], references=[0, 1, 0, 1])["matthews_correlation"] == 1.0


def test_pearson_and_spearman_with_ties():
    x = np.array([1.0, 2.0, 2.0, 4.0])
    y = np.array([1.0, 3.0, 2.0, 5.0])
    out = load("stsb").compute(predictions=x, references=y)
    # Pearson by its definition; Spearman is Pearson of the tie-averaged ranks [1, 2.5, 2.5, 4] and [1, 3, 2, 4].
    xc, yc = x - x.mean(), y - y.mean()
    assert out["pearson"] == pytest.approx(float(xc @ yc / np.sqrt((xc @ xc) * (yc @ yc))), abs=1e-6)
    rx, ry = np.array([1, 2.5, 2.5, 4]), np.array([1, 3, 2, 4.0])
    rx, ry = rx - rx.mean(), ry - ry.mean()
    assert out["spearmanr"] == pytest.approx(float(rx @ ry / np.sqrt((rx @ rx) * (ry @ ry))), abs=1e-6)


def test_unknown_task_is_refused():
    with pytest.raises(KeyError, match="unknown GLUE task"):
        load("squad")
