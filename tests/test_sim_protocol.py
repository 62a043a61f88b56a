"""The experiment protocol: cohort, split, partial labels, metrics, synthetic features, FedAvg."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
from sklearn.metrics import average_precision_score, balanced_accuracy_score, roc_auc_score

from secure_afl.privacy.exposure import exposed_clients
from secure_afl.sim.data import CLASSES, CohortError, load_cohort, split_cohort
from secure_afl.sim.fedavg import FedAvgConfig, missing_as_negative, train_fedavg
from secure_afl.sim.metrics import evaluate
from secure_afl.sim.partial import PartialLabelError, assign_partial_labels
from secure_afl.sim.synthetic import synthetic_features


@pytest.fixture(scope="module")
def cohort():
    return load_cohort()


def test_embedded_cohort_is_the_pa_rows_of_chestxray14(cohort) -> None:
    assert len(cohort) == 67_310
    assert cohort.labels.shape == (67_310, 8)
    assert set(np.unique(cohort.labels)) == {0, 1}
    # Pneumonia is the rarest class (about 0.9 %), Infiltration the most frequent
    prevalence = cohort.labels.mean(axis=0)
    assert CLASSES[int(prevalence.argmin())] == "Pneumonia" and 0.008 < prevalence.min() < 0.011
    assert CLASSES[int(prevalence.argmax())] == "Infiltration"


def test_split_sizes_and_determinism(cohort) -> None:
    split = split_cohort(cohort, seed=0)
    assert [len(c) for c in split.clients] == [5_889] * 8
    assert len(split.test) == 20_193 and len(split.unused) == 5
    rows = np.concatenate([*split.clients, split.test, split.unused])
    assert len(np.unique(rows)) == len(cohort)  # a partition of the rows
    again = split_cohort(cohort, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(split.clients, again.clients, strict=True))


def test_patient_split_has_no_shared_patients(cohort) -> None:
    split = split_cohort(cohort, by="patient", seed=0)
    train = np.concatenate(split.clients)
    assert not set(cohort.patient_ids[train]) & set(cohort.patient_ids[split.test])


@pytest.mark.parametrize("missing", [1, 3, 5, 7])
def test_partial_labels(missing: int) -> None:
    assignment = assign_partial_labels(8, 8, missing, seed=4)
    assert all(len(a) == 8 - missing for a in assignment.active)
    assert all(len(s) >= 1 for s in assignment.coverage())  # every class covered
    assert assignment == assign_partial_labels(8, 8, missing, seed=4)  # deterministic under a seed
    assert assignment.mask().sum() == 8 * (8 - missing)


def test_missing7_is_the_diagonal() -> None:
    assignment = assign_partial_labels(8, 8, 7, seed=123)
    assert assignment.active == tuple((k,) for k in range(8))
    assert np.array_equal(assignment.mask(), np.eye(8, dtype=bool))


def test_different_seeds_give_different_assignments() -> None:
    draws = {assign_partial_labels(8, 8, 3, seed=s).active for s in range(5)}
    assert len(draws) > 1


@pytest.mark.parametrize("missing", [-1, 8, 2.5, "7"])
def test_unknown_missing_level(missing) -> None:
    with pytest.raises(PartialLabelError, match="missing must be an integer"):
        assign_partial_labels(8, 8, missing)


def test_metrics_equal_scikit_learn_and_eq25() -> None:
    rng = np.random.default_rng(0)
    labels = (rng.random((400, 3)) < [0.1, 0.4, 0.7]).astype(int)
    scores = labels * 0.3 + rng.random((400, 3)) * 0.7 - 0.5
    scores[::7] = np.round(scores[::7], 1)  # tied scores, counted ½ by AUC and grouped by AP
    m = evaluate(labels, scores, scores > 0, kind="logits")
    for c in range(3):
        y, p = labels[:, c], scores[:, c]
        pred = p > 0
        tp, fn = np.sum(pred & (y == 1)), np.sum(~pred & (y == 1))
        tn, fp = np.sum(~pred & (y == 0)), np.sum(pred & (y == 0))
        assert m.bacc[c] == pytest.approx(0.5 * (tp / (tp + fn) + tn / (tn + fp)))  # Eq. 25
        assert m.bacc[c] == pytest.approx(balanced_accuracy_score(y, pred))
        assert m.auc[c] == pytest.approx(roc_auc_score(y, p))
        assert m.ap[c] == pytest.approx(average_precision_score(y, p))
    assert m.macro["bacc"] == pytest.approx(m.bacc.mean())
    assert m.macro["map"] == pytest.approx(m.ap.mean())


def test_metrics_reject_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="must both be rows × classes"):
        evaluate(np.zeros((4, 2)), np.zeros((4, 3)), kind="logits")
    with pytest.raises(ValueError, match="decisions"):
        evaluate(np.zeros((4, 2)), np.zeros((4, 2)), np.zeros((4, 3)), kind="logits")
    with pytest.raises(ValueError, match="outside \\[0, 1\\]: these look like logits"):
        evaluate(np.eye(4, 2), np.full((4, 2), 1.5), kind="probabilities")
    with pytest.raises(ValueError, match="kind must be 'logits'"):
        evaluate(np.eye(4, 2), np.full((4, 2), 0.5), kind="scores")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="kind"):
        evaluate(np.eye(4, 2), np.full((4, 2), 0.5))  # type: ignore[call-arg]


def test_logits_inside_0_1_are_logits_and_probabilities_are_thresholded_at_one_half() -> None:
    """The kind is the caller's word, never read from the values."""
    labels = np.array([[1, 0], [0, 1], [1, 1], [0, 0]])
    weak = np.array([[0.9, 0.2], [0.1, 0.8], [0.7, 0.6], [0.3, 0.1]])  # logits of a weak model
    as_logits = evaluate(labels, weak, kind="logits")  # every logit > 0: every decision positive
    assert as_logits.bacc.tolist() == [0.5, 0.5]
    as_probabilities = evaluate(labels, weak, kind="probabilities")  # > 0.5: the right decisions
    assert as_probabilities.bacc.tolist() == [1.0, 1.0]
    assert as_logits.auc.tolist() == as_probabilities.auc.tolist() == [1.0, 1.0]  # ranks agree
    logits = np.log(weak / (1 - weak))
    assert evaluate(labels, logits, kind="logits").to_dict() == as_probabilities.to_dict()


def test_synthetic_features_are_nonnegative_seeded_and_carry_class_signal(cohort) -> None:
    rows = np.arange(3000)
    labels, patients = cohort.labels[rows], cohort.patient_ids[rows]
    a = synthetic_features(labels, patients, dim=64, seed=1)
    assert a.dtype == np.float32 and a.shape == (3000, 64) and (a >= 0).all()
    assert np.array_equal(a, synthetic_features(labels, patients, dim=64, seed=1))
    assert not np.array_equal(a, synthetic_features(labels, patients, dim=64, seed=2))
    c = CLASSES.index("Infiltration")
    gap = a[labels[:, c] == 1].mean(axis=0) - a[labels[:, c] == 0].mean(axis=0)
    assert np.abs(gap).max() > 0.03  # positives differ from negatives on the signature dimensions


def test_synthetic_features_do_not_depend_on_the_machines_blas_threads(cohort, monkeypatch) -> None:
    from threadpoolctl import threadpool_limits

    from secure_afl.sim import synthetic

    rows = np.arange(9000)  # two chunks
    labels, patients = cohort.labels[rows], cohort.patient_ids[rows]
    with threadpool_limits(1, user_api="blas"):
        one = synthetic_features(labels, patients, dim=128)
    with threadpool_limits(4, user_api="blas"):
        four = synthetic_features(labels, patients, dim=128)
    assert np.array_equal(one, four)
    # What makes it so: the products run under exactly SYNTHETIC_BLAS_THREADS BLAS threads, whatever
    # the caller set.  (Whether OpenBLAS's float32 products change with the thread count depends on
    # the build: numpy 2.4's does not on this host, earlier ones did; the pin holds either way.)
    seen = []
    pinned = synthetic.threadpool_limits

    def spy(limits=None, user_api=None):
        seen.append((limits, user_api))
        return pinned(limits, user_api=user_api)

    monkeypatch.setattr(synthetic, "threadpool_limits", spy)
    assert np.array_equal(one, synthetic_features(labels, patients, dim=128))
    assert seen and set(seen) == {(synthetic.SYNTHETIC_BLAS_THREADS, "blas")}


def test_fedavg_learns_a_separable_problem() -> None:
    rng = np.random.default_rng(0)
    xs, ys = [], []
    for _ in range(3):
        y = (rng.random((200, 2)) < 0.5).astype(np.float32)
        xs.append((rng.normal(size=(200, 5)) + 2 * np.c_[y, -y, np.zeros((200, 1))]).astype(np.float32))
        ys.append(y)
    head = train_fedavg(xs, ys, FedAvgConfig(rounds=5, lr=0.05))
    m = evaluate(np.vstack(ys).astype(int), head.decision_function(np.vstack(xs)), kind="logits")
    assert m.macro["auc"] > 0.95
    assert missing_as_negative(np.ones((2, 3)), [1]).tolist() == [[0, 1, 0], [0, 1, 0]]


def test_fedavg_rejects_unequal_clients() -> None:
    with pytest.raises(ValueError, match="equal size"):
        train_fedavg([np.zeros((3, 2)), np.zeros((4, 2))], [np.zeros((3, 1)), np.zeros((4, 1))])


def test_audit_detects_overlapping_group_leakage() -> None:
    clients = [f"c{k}" for k in range(4)]
    all_but_one = [[c for c in clients if c != out] for out in clients]

    def exposed(groups: list[list[str]]) -> tuple[str, ...]:
        layout = {f"g{i}": (members, ("gram",)) for i, members in enumerate(groups)}
        return exposed_clients(layout).get("gram", ())

    assert exposed(all_but_one) == tuple(clients)  # 4 leave-one-out sums: all exposed
    assert exposed([clients]) == ()  # one group of everyone: nobody exposed
    assert exposed([clients, clients[:3]]) == ("c3",)  # the difference is c3


def test_malformed_csvs(tmp_path: Path) -> None:
    missing_columns = tmp_path / "a.csv"
    missing_columns.write_text("Image Index,Finding Labels\nx.png,Mass\n")
    with pytest.raises(CohortError, match=r"lacks the columns \['Patient ID', 'View Position'\]"):
        load_cohort(missing_columns)
    no_pa = tmp_path / "b.csv"
    no_pa.write_text("Image Index,Finding Labels,Patient ID,View Position\nx.png,Mass,1,AP\n")
    with pytest.raises(CohortError, match="no rows with View Position == 'PA'"):
        load_cohort(no_pa)
    bad_patient = tmp_path / "c.csv"
    bad_patient.write_text("Image Index,Finding Labels,Patient ID,View Position\nx.png,Mass,abc,PA\n")
    with pytest.raises(CohortError, match="'Patient ID' must be integers"):
        load_cohort(bad_patient)
    truncated = tmp_path / "d.csv.gz"
    truncated.write_bytes(gzip.compress(b"Image Index,Finding Labels\n" * 50)[:40])
    with pytest.raises(CohortError, match="cannot parse"):
        load_cohort(truncated)
    with pytest.raises(CohortError, match="does not exist"):
        load_cohort(tmp_path / "nope.csv")


def test_written_out_adam_matches_torch_adam() -> None:
    import torch

    from secure_afl.sim.fedavg import _Adam

    generator = torch.Generator().manual_seed(0)
    ours = torch.randn(5, 3, generator=generator, dtype=torch.float64)
    reference = ours.clone().requires_grad_(True)
    optimiser, adam = torch.optim.Adam([reference], lr=1e-2), _Adam(ours, 1e-2)
    for _ in range(20):
        grad = torch.randn(5, 3, generator=generator, dtype=torch.float64)
        reference.grad = grad.clone()
        optimiser.step()
        adam.step(ours, grad)
    torch.testing.assert_close(ours, reference.detach(), rtol=1e-12, atol=1e-15)
