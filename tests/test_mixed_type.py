"""FedMT's mixed-type setting: M, its estimate, soft targets, the analytic solve, the scenario end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from secure_afl.cli import main
from secure_afl.sim.mixed_type import (
    ALL_GROUP,
    COARSE_CLASSES,
    FINE_CLASSES,
    METHODS,
    FedMTConfig,
    MixedTypeError,
    coarse_of,
    correspondence_matrix,
    estimate_correspondence,
    soft_target_contributions,
    soft_targets,
    solve_soft_ridge,
    target_tensor,
    train_fedmt,
    with_intercept,
)
from secure_afl.sim.secure import secure_aggregate


def test_correspondence_matrix_maps_every_fine_class_to_one_coarse_group() -> None:
    m = correspondence_matrix()
    assert m.shape == (len(COARSE_CLASSES), len(FINE_CLASSES)) == (5, 9)
    np.testing.assert_array_equal(m.sum(axis=0), np.ones(9))
    assert m[COARSE_CLASSES.index("Pleural"), FINE_CLASSES.index("Pneumothorax")] == 1
    assert m[COARSE_CLASSES.index("Lung lesion"), FINE_CLASSES.index("Nodule")] == 1
    assert coarse_of(np.array([FINE_CLASSES.index("No Finding")]), m)[0] == COARSE_CLASSES.index("Normal")


def test_estimate_of_m_recovers_a_known_stochastic_m_from_confident_predictions() -> None:
    """Toy case: 3 fine classes, 2 coarse; the model is right and confident on 80 % of the rows."""
    rng = np.random.default_rng(1)
    true_m = np.array([[1.0, 0.3, 0.0], [0.0, 0.7, 1.0]])  # columns P(ỹ | y=k)
    n = 60_000
    fine = rng.integers(3, size=n)
    coarse = (rng.random(n) >= true_m[0, fine]).astype(int)  # P(ỹ=0 | y=k) = M_0k
    confident = rng.random(n) < 0.8
    probs = np.full((n, 3), 1 / 3)
    probs[confident] = 0.02
    probs[confident, fine[confident]] = 0.96
    estimate, n_conf = estimate_correspondence(probs, coarse, 2, xi=0.9)
    assert n_conf == confident.sum()
    np.testing.assert_allclose(estimate, true_m, atol=0.01)
    # with a threshold no row passes, the client sits the round out
    assert estimate_correspondence(probs * 0 + 1 / 3, coarse, 2, xi=0.5) == (None, 0)
    # a fine class never predicted confidently keeps an uninformative column
    only_first = np.tile([0.95, 0.03, 0.02], (10, 1))
    partial, _ = estimate_correspondence(only_first, np.zeros(10, dtype=int), 2, xi=0.9)
    np.testing.assert_array_equal(partial[:, 1], [0.5, 0.5])
    with pytest.raises(MixedTypeError, match="ξ"):
        estimate_correspondence(probs, coarse, 2, xi=1.0)


def test_soft_targets_are_bayes_posteriors_within_the_coarse_group() -> None:
    m = correspondence_matrix()
    priors = np.arange(1, 10, dtype=float)
    priors /= priors.sum()
    pleural = COARSE_CLASSES.index("Pleural")
    t = soft_targets(np.array([pleural]), m, priors)[0]
    eff, ptx = FINE_CLASSES.index("Effusion"), FINE_CLASSES.index("Pneumothorax")
    assert t.sum() == pytest.approx(1.0)
    assert t[eff] == pytest.approx(priors[eff] / (priors[eff] + priors[ptx]))
    assert np.count_nonzero(t) == 2
    with pytest.raises(MixedTypeError, match="priors"):
        soft_targets(np.array([0]), m, priors[:3])


def _toy_mixed(seed: int = 0, d: int = 12):
    rng = np.random.default_rng(seed)
    m = correspondence_matrix()
    priors = rng.dirichlet(np.ones(9))
    clients = []
    for _ in range(3):
        h = rng.random((40, d))
        coarse = rng.integers(5, size=40)
        clients.append((h, soft_targets(coarse, m, priors)))
    centre_h = rng.random((18, d))
    centre_t = np.eye(9)[rng.integers(9, size=18)]
    return clients, centre_h, centre_t


@pytest.mark.parametrize("secure", [False, True])
def test_analytic_mixed_type_solve_equals_centralised_ridge_on_soft_targets(secure: bool) -> None:
    clients, centre_h, centre_t = _toy_mixed()
    gamma = 0.5
    uploads = {f"client-{k}": soft_target_contributions(h, {"prior": t}) for k, (h, t) in enumerate(clients)}
    if secure:  # the product path: the masking protocol sums the uploads
        sums = secure_aggregate(uploads).sums
    else:
        sums = {
            ALL_GROUP: {
                name: sum(u[ALL_GROUP][name] for u in uploads.values())
                for name in uploads["client-0"][ALL_GROUP]
            }
        }
    centre = soft_target_contributions(centre_h, {"prior": centre_t})[ALL_GROUP]
    coef = solve_soft_ridge(
        sums[ALL_GROUP]["gram"] + centre["gram"],
        sums[ALL_GROUP][target_tensor("prior")] + centre[target_tensor("prior")],
        gamma,
    )
    # centralised: all rows pooled, ridge on [H, 1] with the soft (clients) and one-hot (centre) targets
    h_all = with_intercept(np.vstack([h for h, _ in clients] + [centre_h]))
    t_all = np.vstack([t for _, t in clients] + [centre_t])
    reference = np.linalg.solve(h_all.T @ h_all + gamma * np.eye(h_all.shape[1]), h_all.T @ t_all)
    # plaintext sums: equal to 1e-8; masked sums carry the 2^-33 fixed-point rounding per entry
    np.testing.assert_allclose(coef, reference, rtol=0, atol=1e-8)


def test_fedmt_with_known_m_learns_fine_classes_the_centre_alone_cannot_separate() -> None:
    """Two fine classes share one coarse label; the clients' coarse labels separate them from a third."""
    rng = np.random.default_rng(3)
    d, n_fine = 8, 3
    means = np.eye(d)[:n_fine] * 3
    m = np.array([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    fine = rng.integers(n_fine, size=4000)
    x = (means[fine] + rng.normal(size=(4000, d))).astype(np.float32)
    centre = np.arange(30)
    clients = [np.arange(30 + 1000 * k, 1030 + 1000 * k) for k in range(3)]
    coarse = [m[:, fine[r]].argmax(axis=0) for r in clients]
    head, _ = train_fedmt(
        x, centre, fine[centre], clients, coarse, m, FedMTConfig(rounds=10, lr=1e-2), n_fine=3
    )
    test = np.arange(3030, 4000)
    accuracy = np.mean(head.predict_proba(x[test]).argmax(axis=1) == fine[test])
    assert accuracy > 0.85
    # with M estimated, the clients' estimate converges to the true M on this easy task
    head_e, trace = train_fedmt(
        x,
        centre,
        fine[centre],
        clients,
        coarse,
        None,
        FedMTConfig(rounds=10, lr=1e-2, xi=0.7),
        n_fine=3,
        n_coarse=2,
        true_m=m,
    )
    assert np.mean(head_e.predict_proba(x[test]).argmax(axis=1) == fine[test]) > 0.85
    assert trace.participants[-1] == 3 and trace.m_error[-1] < 0.1


SMALL = ["--fraction", "0.25", "--dim", "32", "--fedmt-rounds", "2", "--centre-n", "3,6"]


def test_sim_mixed_type_writes_tables_figure_and_json(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main, ["sim", "--scenario", "mixed-type", "--out", str(tmp_path), *SMALL], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    assert "FEATURES ARE SYNTHETIC" in result.output and "Lung opacity" in result.output
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["scenario"] == "mixed-type" and data["aggregation"]["protection"] == "mask"
    assert set(data["scores"]) == {"3", "6"}
    for per_method in data["scores"].values():
        assert set(per_method) == set(METHODS)
        assert all(0 <= s["accuracy"] <= 1 and 0 <= s["balanced_accuracy"] <= 1 for s in per_method.values())
    png = (tmp_path / "mixed_type.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "| Analytic (soft targets, prevalence prior) |" in (tmp_path / "report.md").read_text()


def test_sim_mixed_type_refuses_a_centre_larger_than_a_class(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main,
        [
            "sim",
            "--scenario",
            "mixed-type",
            "--out",
            str(tmp_path),
            "--fraction",
            "0.05",
            "--dim",
            "8",
            "--centre-n",
            "500",
        ],
    )
    assert result.exit_code == 1
    assert "Pneumonia" in result.output and "--centre-n" in result.output
    assert not (tmp_path / "results.json").exists()
