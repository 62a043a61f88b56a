"""`sim --secure mask` against `sim --secure none`: the same sums up to fixed point, the same classifier.

The masking protocol returns the exact sum of the members' fixed-point encodings, so a decoded group
sum differs from the float sum by at most ``members × 2^-(frac_bits+1)`` per entry
(:func:`secure_afl.core.encoding.rounding_error_bound`), and the classifiers fitted on the two sets
of sums differ by a perturbation of that size.  Every check here compares against an independent
plaintext computation, so a missing unmasking (sums off by ~2^32), a wrong survivor set or a dropped
tensor makes it fail.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
import pytest

from secure_afl.analytic import (
    AnalyticClassifier,
    ClientStatistics,
    Contributions,
    client_statistics,
    sum_contributions,
)
from secure_afl.core import encoding
from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.sim.fedavg import FedAvgConfig
from secure_afl.sim.metrics import Metrics, evaluate
from secure_afl.sim.partial import assign_partial_labels
from secure_afl.sim.runner import data_request, run_experiment
from secure_afl.sim.secure import secure_aggregate
from secure_afl.sim.setting import AFL_1, SYMMETRIC_TENSORS, ExperimentResult, SimConfig, client_id

BASE = {
    "missing": (1,),
    "fraction": 0.05,
    "dim": 32,
    "fedavg": FedAvgConfig(rounds=1),
    "device": "cpu",  # the direct computations below must see the runner's statistics bit for bit
}
GAMMA = SimConfig().gamma
FRAC_BITS = encoding.DEFAULT_FRAC_BITS
EPS = np.finfo(np.float64).eps
VARIANTS = {  # the AFL variants fitted on round-1 sums, as in the runner
    "client balance": {},
    "global balance": {"balance": "global"},
    "global Gram": {"gram": "global"},
}


class Data(NamedTuple):
    """The embedded data exactly as the runner prepares it for ``BASE``."""

    features: np.ndarray
    labels: np.ndarray
    clients: Sequence[np.ndarray]  # row indices per client
    test: np.ndarray

    @property
    def test_x(self) -> np.ndarray:
        return self.features[self.test]

    @property
    def test_y(self) -> np.ndarray:
        return self.labels[self.test]


@pytest.fixture(scope="module")
def prepared() -> Data:
    config = SimConfig(**BASE)  # type: ignore[arg-type]
    data = data_request(config).prepare()  # the embedded data: a request, never None
    return Data(data.features, data.cohort.labels, data.split.clients, data.split.test)


def run(**overrides: object) -> ExperimentResult:
    return run_experiment(SimConfig(**{**BASE, **overrides}))  # type: ignore[arg-type]


def client_stats(prepared: Data) -> dict[str, ClientStatistics]:
    return {
        client_id(k): client_statistics(prepared.features[rows], prepared.labels[rows], device="cpu")
        for k, rows in enumerate(prepared.clients)
    }


def round1_contributions(prepared: Data, missing: int) -> dict[str, Contributions]:
    """Every round-1 tensor the runner uploads: client- and globally-balanced, and the `all` Gram."""
    stats = client_stats(prepared)
    n_classes = prepared.labels.shape[1]
    assignment = assign_partial_labels(len(stats), n_classes, missing, seed=SimConfig().seed)
    out: dict[str, Contributions] = {}
    for k, name in enumerate(stats):  # client-0, client-1, ... in order
        mine = stats[name].contributions(assignment.active[k], include_global_gram=True)
        for group, tensors in stats[name].contributions(assignment.active[k], balance="global").items():
            mine[group].update(tensors)
        out[name] = mine
    return out


def assert_sums_within_rounding_bound(
    secure_sums: Mapping[str, Mapping[str, np.ndarray]],
    contributions: Mapping[str, Contributions],
    survivors: Mapping[str, tuple[str, ...]],
) -> None:
    """Each decoded entry lies within members × 2^-(f+1) of the plaintext sum over ``survivors``.

    The plaintext float sum itself carries at most (n - 1)·u·Σ|x_k| of float64 rounding, and the
    decoding one more u·|s|: both are added to the fixed-point bound (they are ~1e-13 here).
    """
    plain = sum_contributions(contributions[c] for c in sorted(contributions) if c in survivors["all"])
    assert set(secure_sums) == set(plain)
    for group, tensors in plain.items():
        assert set(secure_sums[group]) == set(tensors), group
        members = survivors[group]
        for name, expected in tensors.items():
            got = secure_sums[group][name]
            assert got.shape == expected.shape, (group, name)
            absolute = sum(np.abs(contributions[c][group][name]) for c in members)
            float_slack = (len(members) + 1) * EPS * absolute
            tolerance = encoding.rounding_error_bound(FRAC_BITS, len(members)) + float_slack
            excess = np.abs(got - expected) - tolerance
            assert np.all(excess <= 0), f"{group}/{name}: {np.max(np.abs(got - expected))} above the bound"


def coefficient_tolerance(
    sums: Mapping[str, Mapping[str, np.ndarray]], coef: np.ndarray, members: int
) -> float:
    """A bound on ‖w_mask − w_plain‖₂ for one column, from the per-entry rounding bound ε.

    With A = G + γI (G positive semidefinite) ‖A⁻¹‖₂ ≤ 1/γ, so to first order
    ‖δw‖ ≤ (‖δb‖ + ‖δG‖·‖w‖)/γ with ‖δb‖ ≤ √d·3ε (the globally balanced right-hand side combines three
    sums with weights ≤ 1) and ‖δG‖₂ ≤ ‖δG‖_F ≤ d·ε; doubled for the second order, plus the two
    Cholesky solves' own float error, ~d·u·κ(A)·‖w‖ with κ(A) ≤ (‖G‖_F + γ)/γ.
    """
    d = coef.shape[0]
    eps_entry = encoding.rounding_error_bound(FRAC_BITS, members)
    norm_w = float(np.linalg.norm(coef))
    gram_norm = max(float(np.linalg.norm(t["gram"])) for t in sums.values() if "gram" in t)
    kappa = (gram_norm + GAMMA) / GAMMA
    return 2 * (np.sqrt(d) * 3 * eps_entry + d * eps_entry * norm_w) / GAMMA + 4 * d * EPS * kappa * norm_w


def assert_same_metrics(a: Mapping[str, Metrics], b: Mapping[str, Metrics]) -> None:
    """BACC exactly (the same predictions at 0.5), AUC and AP to 1e-9."""
    assert list(a) == list(b)
    for method in a:
        np.testing.assert_array_equal(a[method].bacc, b[method].bacc, err_msg=method)
        np.testing.assert_allclose(a[method].auc, b[method].auc, rtol=0, atol=1e-9, err_msg=method)
        np.testing.assert_allclose(a[method].ap, b[method].ap, rtol=0, atol=1e-9, err_msg=method)


def test_masked_sums_and_coefficients_match_plaintext_within_the_fixed_point_bound(
    prepared: Data,
) -> None:
    contributions = round1_contributions(prepared, missing=1)
    result = secure_aggregate(
        contributions, symmetric=SYMMETRIC_TENSORS, random=DeterministicRandomSource(b"secure-vs-plain")
    )
    assert result.frac_bits == FRAC_BITS
    everyone = tuple(sorted(contributions))
    assert result.survivors["all"] == everyone
    for group in result.members:
        assert result.survivors[group] == result.members[group]
    # (a) every summed tensor within the documented per-entry bound
    assert_sums_within_rounding_bound(result.sums, contributions, result.survivors)

    # (b) the fitted coefficients, column by column, within the perturbation that bound allows
    plain = sum_contributions(contributions.values())
    test_x = prepared.test_x
    for variant, options in VARIANTS.items():
        secure_model = AnalyticClassifier(8, gamma=GAMMA, **options).fit(result.sums)  # type: ignore[arg-type]
        plain_model = AnalyticClassifier(8, gamma=GAMMA, **options).fit(plain)  # type: ignore[arg-type]
        assert secure_model.coef_ is not None and plain_model.coef_ is not None
        for c in range(8):
            w_secure, w_plain = secure_model.coef_[:, c], plain_model.coef_[:, c]
            # every group has at most len(everyone) members, and the bound grows with the members
            tolerance = coefficient_tolerance(plain, w_plain, len(everyone))
            error = float(np.linalg.norm(w_secure - w_plain))
            # the worst case (~1e-5 relative here) is far below what a wrong sum would do ...
            assert tolerance < 1e-3 * np.linalg.norm(w_plain), (variant, c)
            assert error <= tolerance, (variant, c, error, tolerance)
            # ... and the rounding errors do not add up to it: ~1e-9 relative measured
            assert error <= 1e-6 * np.linalg.norm(w_plain), (variant, c, error)
        # the same predictions at the 0.5 threshold on the test rows
        np.testing.assert_array_equal(secure_model.predict(test_x), plain_model.predict(test_x))


def test_run_experiment_mask_and_none_give_the_same_metrics(prepared: Data) -> None:
    masked = run(secure="mask")
    plain = run(secure="none")
    (masked_setting,) = masked.settings
    (plain_setting,) = plain.settings
    # the protocol really ran on one side only
    assert masked_setting.protocol_costs is not None and plain_setting.protocol_costs is None
    assert masked_setting.audit.protection == "mask" and plain_setting.audit.protection == "none"
    assert (
        len(masked_setting.metrics) == 6
    )  # AFL 1 round, 2 rounds (paper τ, rescaled τ), global balance, global Gram, FedAvg
    assert_same_metrics(masked_setting.metrics, plain_setting.metrics)
    # round 2 is fed by the round-1 classifier: the same pseudo labels on both sides
    assert masked_setting.pseudo_labels == plain_setting.pseudo_labels


@pytest.mark.parametrize("stage", ["R1", "R2", "R3"])
def test_dropouts_give_the_plaintext_classifier_of_the_surviving_clients(prepared: Data, stage: str) -> None:
    masked = run(secure="mask", dropout=2, dropout_stage=stage, rounds=1)
    plain = run(secure="none", dropout=2, dropout_stage=stage, rounds=1)
    (masked_setting,) = masked.settings
    (plain_setting,) = plain.settings
    dropped = masked_setting.dropped
    assert len(dropped) == 2 and plain_setting.dropped == dropped
    # R1/R2 dropouts never sent their masked inputs; an R3 dropout already did and stays in the sum
    gone = set(dropped) if stage in ("R1", "R2") else set()
    shrunk = 0
    for group_audit in masked_setting.audit.groups:
        expected = tuple(c for c in group_audit.members if c not in gone)
        assert group_audit.survivors == expected, group_audit.group
        shrunk += group_audit.survivors != group_audit.members
    # every group with a dropped member lost it: each of the method's groups (7 or 8 of the 8 clients)
    # and, where the Gram went by difference, the dropped clients' own complement groups
    assert shrunk == sum(bool(gone & set(g.members)) for g in masked_setting.audit.groups)
    assert shrunk >= (len(plain_setting.audit.groups) if gone else 0)
    assert_same_metrics(masked_setting.metrics, plain_setting.metrics)

    # Directly: the masked sums equal a plaintext sum over the survivors only ...
    contributions = round1_contributions(prepared, missing=1)
    result = secure_aggregate(
        contributions,
        symmetric=SYMMETRIC_TENSORS,
        dropouts={stage: dropped},
        random=DeterministicRandomSource(stage.encode()),
    )
    alive = tuple(c for c in sorted(contributions) if c not in gone)
    assert result.survivors["all"] == alive
    assert_sums_within_rounding_bound(result.sums, contributions, result.survivors)
    survivors_model = AnalyticClassifier(8, gamma=GAMMA).fit(
        sum_contributions(contributions[c] for c in alive)
    )
    test_x, test_y = prepared.test_x, prepared.test_y
    # ... and the masked run's AFL (1 round) is the classifier fitted on the survivors' plaintext sums.
    assert_same_metrics(
        {AFL_1: masked_setting.metrics[AFL_1]},
        {AFL_1: evaluate(test_y, survivors_model.decision_function(test_x), kind="logits")},
    )
    if gone:  # the check can tell the survivors from everyone: the all-client classifier differs
        everyone_model = AnalyticClassifier(8, gamma=GAMMA).fit(sum_contributions(contributions.values()))
        everyone = evaluate(test_y, everyone_model.decision_function(test_x), kind="logits")
        assert np.max(np.abs(everyone.auc - masked_setting.metrics[AFL_1].auc)) > 1e-4
