"""Per-class then macro-averaged BACC (of the decisions), ROC AUC and average precision (of the scores).

AUC and AP are computed from the real-valued **scores** (logits ``h·w``), not from ``σ(score)``:
``σ`` saturates to exactly 1.0 in float64 above a score of about 37 (and to 0 below about −745), so
probabilities can tie where the scores do not, and a tie changes both rankings.  Both are rank
statistics, so on unsaturated scores they equal the values on probabilities.

BACC (Eq. 25) is computed from each method's own 0/1 decisions (``σ(score) > 0.5``).

The formulas are scikit-learn's (``roc_auc_score``: the Mann–Whitney statistic with tied scores
counted one half; ``average_precision_score``: ``Σ_k (R_k − R_{k−1}) P_k`` over distinct score
thresholds), written in numpy so that the simulator does not import scikit-learn at start-up; a
test checks them against scikit-learn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np


@dataclass(frozen=True)
class Metrics:
    """Per-class arrays and their macro averages; a class absent from the test labels is NaN.

    ``prevalence``: per class, the fraction of positives among the scored test rows (NaN where the
    class is not scored), from which :attr:`chance` follows; not part of :meth:`to_dict`.
    """

    bacc: np.ndarray
    auc: np.ndarray
    ap: np.ndarray
    prevalence: np.ndarray | None = None

    @property
    def macro(self) -> dict[str, float]:
        return {
            "bacc": float(np.nanmean(self.bacc)),
            "auc": float(np.nanmean(self.auc)),
            "map": float(np.nanmean(self.ap)),
        }

    @property
    def chance(self) -> dict[str, float]:
        """What a scorer without information gets, macro-averaged as :attr:`macro` is: BACC ½ (any
        constant decision), AUC ½ (a random ranking), and mAP the mean prevalence of the scored
        classes (a random ranking's expected average precision is about its class's prevalence).
        """
        prevalence = np.full(len(self.ap), np.nan) if self.prevalence is None else self.prevalence
        scored = ~np.isnan(self.ap) & ~np.isnan(prevalence)
        return {
            "bacc": 0.5,
            "auc": 0.5,
            "map": float(prevalence[scored].mean()) if scored.any() else float("nan"),
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


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC of one class: P(score of a positive > score of a negative), ties counted ½."""
    positive = np.asarray(labels).astype(bool)
    n_pos = int(positive.sum())
    n_neg = len(positive) - n_pos
    values = np.asarray(scores, dtype=np.float64)
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    # average rank (1-based) of each distinct score value
    rank_of_value = np.cumsum(counts) - (counts - 1) / 2.0
    rank_sum = float(rank_of_value[inverse][positive].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def average_precision(labels: np.ndarray, scores: np.ndarray) -> float:
    """Average precision of one class: ``Σ_k (R_k − R_{k−1}) P_k`` over distinct thresholds."""
    scores = np.asarray(scores, dtype=np.float64)
    order = np.argsort(scores, kind="mergesort")[::-1]
    ranked = scores[order]
    hits = np.asarray(labels)[order].astype(np.float64)
    last_of_value = np.r_[np.flatnonzero(np.diff(ranked)), len(ranked) - 1]
    tps = np.cumsum(hits)[last_of_value]
    precision = tps / (last_of_value + 1)
    recall = tps / tps[-1]
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def balanced_accuracy(labels: np.ndarray, decisions: np.ndarray) -> float:
    """Eq. 25: the mean of sensitivity and specificity of 0/1 decisions."""
    positive = np.asarray(labels).astype(bool)
    predicted = np.asarray(decisions).astype(bool)
    return 0.5 * (float(predicted[positive].mean()) + float((~predicted[~positive]).mean()))


ScoreKind = Literal["logits", "probabilities"]
SCORE_KINDS: tuple[ScoreKind, ...] = ("logits", "probabilities")


def evaluate(
    labels: np.ndarray, scores: np.ndarray, decisions: np.ndarray | None = None, *, kind: ScoreKind
) -> Metrics:
    """``labels`` rows × classes in {0,1}; ``scores`` of the same shape, of the ``kind`` the caller
    states: ``"logits"`` (real-valued ``h·w``, the default decision ``score > 0``) or
    ``"probabilities"`` (``σ(h·w)`` in [0, 1], the default decision ``score > 0.5``).
    ``decisions``: the 0/1 predictions, when they are not the default threshold of the scores.

    The kind is never guessed from the values: logits may all lie in [0, 1] (a weak model's), and
    probabilities read as logits would make every decision positive.  AUC and AP are rank
    statistics, the same for both kinds except where σ saturates (see the module docstring).
    """
    if kind not in SCORE_KINDS:
        raise ValueError(
            f"kind must be 'logits' (decision_function's h·w) or 'probabilities' (σ of them), got {kind!r}"
        )
    labels = np.asarray(labels)
    scores = np.asarray(scores, dtype=np.float64)
    if labels.shape != scores.shape or labels.ndim != 2:
        raise ValueError(f"labels {labels.shape} and scores {scores.shape} must both be rows × classes")
    if not np.isfinite(scores).all():
        raise ValueError("scores contain NaN or infinite values")
    if not np.isin(labels, (0, 1)).all():
        raise ValueError("labels must contain only 0 and 1")
    if kind == "probabilities" and scores.size and (scores.min() < 0 or scores.max() > 1):
        raise ValueError(
            f"kind='probabilities' but the scores range over [{scores.min():.4g}, {scores.max():.4g}], "
            "outside [0, 1]: these look like logits; pass kind='logits'"
        )
    if decisions is None:
        decisions = scores > (0.0 if kind == "logits" else 0.5)
    decisions = np.asarray(decisions)
    if decisions.shape != labels.shape:
        raise ValueError(f"decisions {decisions.shape} must have the shape of the labels {labels.shape}")
    n_classes = labels.shape[1]
    bacc, auc, ap, prevalence = (np.full(n_classes, np.nan) for _ in range(4))
    for c in range(n_classes):
        y = labels[:, c]
        if y.min() == y.max():  # one-sided test labels: these scores are undefined
            continue
        bacc[c] = balanced_accuracy(y, decisions[:, c])
        auc[c] = roc_auc(y, scores[:, c])
        ap[c] = average_precision(y, scores[:, c])
        prevalence[c] = float(y.mean())
    return Metrics(bacc=bacc, auc=auc, ap=ap, prevalence=prevalence)
