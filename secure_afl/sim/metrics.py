"""Per-class then macro-averaged BACC (at 0.5), ROC AUC and average precision, from scikit-learn."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sklearn.metrics import average_precision_score, balanced_accuracy_score, roc_auc_score

THRESHOLD = 0.5


@dataclass(frozen=True)
class Metrics:
    """Per-class arrays and their macro averages; a class absent from the test labels is NaN."""

    bacc: np.ndarray
    auc: np.ndarray
    ap: np.ndarray

    @property
    def macro(self) -> dict[str, float]:
        return {
            "bacc": float(np.nanmean(self.bacc)),
            "auc": float(np.nanmean(self.auc)),
            "map": float(np.nanmean(self.ap)),
        }

    def to_dict(self) -> dict[str, object]:
        return {
            "macro": self.macro,
            "per_class": {
                "bacc": [float(v) for v in self.bacc],
                "auc": [float(v) for v in self.auc],
                "ap": [float(v) for v in self.ap],
            },
        }


def evaluate(labels: np.ndarray, probabilities: np.ndarray) -> Metrics:
    """``labels`` rows × classes in {0,1}; ``probabilities`` the same shape, in [0, 1]."""
    labels = np.asarray(labels)
    probabilities = np.asarray(probabilities, dtype=np.float64)
    if labels.shape != probabilities.shape or labels.ndim != 2:
        raise ValueError(
            f"labels {labels.shape} and probabilities {probabilities.shape} must both be rows × classes"
        )
    if not np.isfinite(probabilities).all():
        raise ValueError("probabilities contain NaN or infinite values")
    n_classes = labels.shape[1]
    bacc, auc, ap = (np.full(n_classes, np.nan) for _ in range(3))
    for c in range(n_classes):
        y = labels[:, c]
        if y.min() == y.max():  # one-sided test labels: these scores are undefined
            continue
        p = probabilities[:, c]
        bacc[c] = balanced_accuracy_score(y, p > THRESHOLD)
        auc[c] = roc_auc_score(y, p)
        ap[c] = average_precision_score(y, p)
    return Metrics(bacc=bacc, auc=auc, ap=ap)
