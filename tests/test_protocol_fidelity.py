"""Where the simulator's protocol follows the paper exactly: the missing-1 permutation,
boolean masks of active classes, the undefined Eq. 9, metrics from scores, and round 2's τ."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.special
from sklearn.metrics import average_precision_score, roc_auc_score

from secure_afl.analytic import (
    PSEUDO_TENSOR_RESCALED,
    AnalyticClassifier,
    StatisticsError,
    UndefinedBalanceWarning,
    active_class_indices,
    balanced_labels,
    class_group,
    client_statistics,
    pseudo_label_contributions,
    sum_contributions,
)
from secure_afl.sim.fedavg import FedAvgConfig, missing_as_negative
from secure_afl.sim.metrics import evaluate
from secure_afl.sim.partial import PartialLabelError, assign_partial_labels
from secure_afl.sim.report import markdown_report
from secure_afl.sim.runner import run_experiment
from secure_afl.sim.setting import AFL_2, AFL_2_RESCALED, SimConfig

# ---------------------------------------------------------------------------------------------
# missing 1: every class labelled by exactly K − 1 clients
# ---------------------------------------------------------------------------------------------


def test_missing1_withholds_a_permutation_so_every_class_has_seven_annotators() -> None:
    for seed in range(200):
        assignment = assign_partial_labels(8, 8, 1, seed=seed)
        assert assignment.draw == "permutation"
        assert [len(s) for s in assignment.coverage()] == [7] * 8, seed
        assert all(len(a) == 7 for a in assignment.active)
    draws = {assign_partial_labels(8, 8, 1, seed=s).active for s in range(10)}
    assert len(draws) > 1  # the permutation depends on the seed


def test_missing1_random_draw_is_kept_behind_an_option() -> None:
    coverages = set()
    for seed in range(30):
        assignment = assign_partial_labels(8, 8, 1, seed=seed, missing1="random")
        assert assignment.draw == "random"
        assert all(len(a) == 7 for a in assignment.active) and min(map(len, assignment.coverage())) >= 1
        coverages.update(len(s) for s in assignment.coverage())
    assert coverages != {7}  # the earlier draw does not give |S_c| = 7 everywhere
    assert assign_partial_labels(8, 8, 3, seed=2).draw == "random"  # missing 3 and 5 unchanged
    with pytest.raises(PartialLabelError, match="missing1 must be"):
        assign_partial_labels(8, 8, 1, missing1="paper")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# boolean masks of active classes
# ---------------------------------------------------------------------------------------------


def _client(rng: np.random.Generator, n: int = 60, d: int = 6, n_classes: int = 3):
    h = np.abs(rng.normal(size=(n, d)))
    y = (rng.random((n, n_classes)) < 0.4).astype(int)
    y[:3], y[3:6] = 1, 0  # both sides present in every class
    return h, y


def test_boolean_mask_is_read_as_a_mask_everywhere_active_classes_are_taken() -> None:
    rng = np.random.default_rng(0)
    h, y = _client(rng)
    stats = client_statistics(h, y, device="cpu")
    mask = np.array([False, False, True])
    assert active_class_indices(mask, 3) == [2]
    assert active_class_indices([False, False, True], 3) == [2]  # a list of Python bools too
    assert active_class_indices((2, 0, 2), 3) == [0, 2]
    by_mask, by_index = stats.contributions(mask), stats.contributions([2])
    assert set(by_mask) == set(by_index) == {class_group(2)}
    np.testing.assert_array_equal(by_mask[class_group(2)]["b/2"], by_index[class_group(2)]["b/2"])
    np.testing.assert_array_equal(balanced_labels(y, mask), balanced_labels(y, [2]))
    np.testing.assert_array_equal(missing_as_negative(y, [True, False, True]), missing_as_negative(y, [0, 2]))
    coef = rng.normal(size=(6, 3))
    out_mask, _ = pseudo_label_contributions(h, coef, mask, device="cpu")
    out_index, _ = pseudo_label_contributions(h, coef, [2], device="cpu")
    assert set(out_mask) == set(out_index) == {"pseudo/0", "pseudo/1"}


@pytest.mark.parametrize(
    ("active", "message"),
    [
        (np.array([True, False]), "one entry per class"),
        ([True, 2], "mix booleans and integers"),
        ([0.0, 1.0], "class indices \\(integers\\) or a boolean mask"),
        ([0, 3], "outside 0..2"),
    ],
)
def test_bad_active_classes_are_refused_with_the_reason(active, message) -> None:
    stats = client_statistics(*_client(np.random.default_rng(1)), device="cpu")
    with pytest.raises(StatisticsError, match=message):
        stats.contributions(active)
    with pytest.raises(StatisticsError, match=message):
        missing_as_negative(np.zeros((4, 3)), active)


# ---------------------------------------------------------------------------------------------
# Eq. 9 undefined: a labelled class without positives (or negatives)
# ---------------------------------------------------------------------------------------------


def test_undefined_eq9_warns_and_drops_the_empty_side() -> None:
    rng = np.random.default_rng(2)
    h, y = _client(rng)
    y[:, 1] = 0  # class 1 labelled but no positive here
    stats = client_statistics(h, y, device="cpu")
    assert stats.undefined_classes([0, 1]) == {1: "no positive"}
    with pytest.warns(UndefinedBalanceWarning, match="class 1 .* no positive sample .* all-negative"):
        upload = stats.contributions([0, 1])
    # the convention: the positive term is dropped, b = −mean of the negatives
    np.testing.assert_allclose(upload[class_group(1)]["b/1"], -h.mean(axis=0), rtol=1e-12)
    with pytest.warns(UndefinedBalanceWarning, match="balanced labels: class 1"):
        targets = balanced_labels(y, [1])
    np.testing.assert_allclose(targets[:, 1], -1 / len(y))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UndefinedBalanceWarning)
        stats.contributions([0])  # a well-defined class does not warn
    # the server sees it under global balancing: no positive in the whole of S_c
    sums = sum_contributions([stats.contributions([0, 1], balance="global")])
    with pytest.warns(UndefinedBalanceWarning, match="global balance over S_c: class 1"):
        AnalyticClassifier(2, balance="global").fit(sums)  # classes 0 and 1


def test_sim_reports_where_eq9_is_undefined() -> None:
    # 2 % of the rows: some clients have no Pneumonia positive (prevalence 0.9 %) among ~118 rows
    config = SimConfig(
        missing=(1,), rounds=1, fraction=0.02, dim=16, secure="none", fedavg=FedAvgConfig(rounds=1)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", UndefinedBalanceWarning)  # reported, not raised per client
        result = run_experiment(config)
    undefined = result.settings[0].undefined_balance
    assert undefined and all(why in ("no positive", "no negative") for _, _, why in undefined)
    pneumonia = 6
    assert any(c == pneumonia and why == "no positive" for _, c, why in undefined)
    assert "Eq. 9 is undefined" in markdown_report(result)


# ---------------------------------------------------------------------------------------------
# AUC and AP from scores, BACC from decisions
# ---------------------------------------------------------------------------------------------


def test_auc_and_ap_rank_scores_not_saturated_probabilities() -> None:
    labels = np.array([[0], [0], [1], [1], [0], [1]])
    scores = np.array([[38.0], [39.0], [40.0], [41.0], [-3.0], [42.0]])
    probabilities = scipy.special.expit(scores)
    assert len(np.unique(probabilities[:4])) == 1  # σ saturates: 38..42 all give exactly 1.0
    on_scores = evaluate(labels, scores, kind="logits")
    assert on_scores.auc[0] == pytest.approx(1.0) and on_scores.ap[0] == pytest.approx(1.0)
    on_probabilities = evaluate(labels, probabilities, kind="probabilities")
    assert on_probabilities.auc[0] < 0.9  # the ties that the scores do not have
    assert on_scores.bacc[0] == on_probabilities.bacc[0]  # decisions are the same


def test_rank_metrics_match_scikit_learn_with_ties() -> None:
    rng = np.random.default_rng(3)
    for _ in range(20):
        n = int(rng.integers(5, 300))
        y = (rng.random(n) < rng.uniform(0.05, 0.9)).astype(int)
        y[0], y[1] = 0, 1
        s = np.round(rng.normal(size=n), int(rng.integers(0, 3)))
        m = evaluate(y[:, None], s[:, None], kind="logits")
        assert m.auc[0] == pytest.approx(roc_auc_score(y, s), abs=1e-12)
        assert m.ap[0] == pytest.approx(average_precision_score(y, s), abs=1e-12)


# ---------------------------------------------------------------------------------------------
# round 2: the paper's τ never fires on O(1/N) scores; the rescaled variant does
# ---------------------------------------------------------------------------------------------


def _two_client_federation(rng: np.random.Generator, n: int = 400, d: int = 8):
    signal = np.zeros(d)
    signal[:3] = 1.5
    features, labels = [], []
    for _ in range(2):
        y = (rng.random((n, 2)) < 0.3).astype(int)
        features.append(np.abs(rng.normal(size=(n, d))) + y[:, :1] * signal + 0.5 * y[:, 1:] * signal[::-1])
        labels.append(y)
    return features, labels


def test_rescaled_tau_makes_round_two_fire() -> None:
    rng = np.random.default_rng(4)
    features, labels = _two_client_federation(rng)
    actives = [[0], [1]]  # each class labelled by one client
    stats = [client_statistics(h, y, device="cpu") for h, y in zip(features, labels, strict=True)]
    sums = sum_contributions(_merged(s, a) for s, a in zip(stats, actives, strict=True))
    model = AnalyticClassifier(2, gamma=1.0).fit(sums)
    coef, offset = model.rescaled_scores(sums)
    for c, k in ((0, 0), (1, 1)):  # client k labels class c
        rescaled = features[k] @ coef[:, c] + offset[c]
        positive = labels[k][:, c] == 1
        # +1 is the average labelled positive, −1 the average labelled negative, exactly
        assert rescaled[positive].mean() == pytest.approx(1.0, rel=1e-9)
        assert rescaled[~positive].mean() == pytest.approx(-1.0, rel=1e-9)
    # the paper's rule: no pseudo-label on O(1/N) scores; the rescaled rule: Eq. 20 is met
    _, paper = pseudo_label_contributions(features[1], model.coef_, [1], device="cpu")
    upload, variant = pseudo_label_contributions(
        features[1], coef, [1], device="cpu", tensor=PSEUDO_TENSOR_RESCALED, offset=offset
    )
    assert not paper[0].qualified and paper[0].n_pseudo_pos == 0
    assert variant[0].qualified and variant[0].n_pseudo_pos >= 5 and variant[0].n_pseudo_neg >= 50
    assert set(upload["pseudo/0"]) == {f"{PSEUDO_TENSOR_RESCALED}/0"}
    # the variant needs the counts and feature sums of the class groups (balance="global" upload)
    plain = sum_contributions(s.contributions(a) for s, a in zip(stats, actives, strict=True))
    with pytest.raises(StatisticsError, match="need the class group's sums"):
        AnalyticClassifier(2).fit(plain).rescaled_scores(plain)


def _merged(stats, active):
    upload = stats.contributions(active, include_global_gram=True)
    for group, tensors in stats.contributions(active, balance="global").items():
        upload[group].update(tensors)
    return upload


def test_sim_runs_both_round_two_rules_and_reports_qualifying_pairs() -> None:
    config = SimConfig(missing=(7,), fraction=0.1, dim=64, secure="none", fedavg=FedAvgConfig(rounds=1))
    setting = run_experiment(config).settings[0]
    assert AFL_2 in setting.metrics and AFL_2_RESCALED in setting.metrics
    assert len(setting.pseudo_labels) == len(setting.pseudo_labels_rescaled) == 56
    assert sum(r.qualified for _, r in setting.pseudo_labels) == 0  # the paper's τ on O(1/N) scores
    assert sum(r.qualified for _, r in setting.pseudo_labels_rescaled) > 0
