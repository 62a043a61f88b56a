"""``class_sums="positives"``: label-normalised positive sums per class and one total in ``all``.

The mechanism's claims, each tested: one image moves all of its institution's class blocks together
by at most C (so they are one accounting slot), the plan's ε is what dp-accounting gives for the
blocks' public parameters, the class blocks need far less noise than the split sums' at missing 1,
the server's solve is the weighted balanced projection, and the uploads ride the masking protocol
and the deployment exactly as the split sums do.
"""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant

from secure_afl.analytic import ALL_GROUP, AnalyticClassifier, class_group, pseudo_group, sum_contributions
from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.privacy.dp import (
    POSITIVE_COUNT,
    POSITIVE_SUM,
    TOTAL_COUNT,
    TOTAL_SUM,
    DpConfig,
    DpError,
    FederationLayout,
    label_weights,
    plan_noise,
    private_statistics,
    privatize,
    round1_upload,
)
from secure_afl.privacy.dp_solve import analytic_sums, fit_private
from secure_afl.sim.secure import secure_aggregate

CLIP = 3.0
POSITIVES = {"class_sums": "positives"}


def _data(rng: np.random.Generator, n: int = 60, d: int = 6, classes: int = 4):
    x = np.abs(rng.normal(size=(n, d))) * rng.uniform(0.2, 3, size=(n, 1))
    y = (rng.random((n, classes)) < 0.4).astype(int)
    return x, y


def _positive_blocks(stats, classes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    upload = stats.round1(classes, class_sums="positives")
    sums = np.stack([upload[class_group(c)][f"{POSITIVE_SUM}/{c}"] for c in classes])
    counts = np.array([upload[class_group(c)][f"{POSITIVE_COUNT}/{c}"][0] for c in classes])
    return sums, counts, upload[ALL_GROUP][TOTAL_SUM]


@pytest.mark.parametrize("seed", range(4))
def test_one_image_moves_all_its_class_blocks_together_by_at_most_the_clip(seed: int) -> None:
    rng = np.random.default_rng(seed)
    x, y = _data(rng)
    classes = [0, 1, 3]  # class 2 is not labelled here: its column must not count
    base = _positive_blocks(private_statistics(x, y, CLIP, device="cpu", active=classes), classes)
    for labels in ([1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 1, 0], [0, 1, 1, 1]):
        row = rng.normal(size=(1, 6)) * 50  # clipped to the bound
        more_stats = private_statistics(
            np.vstack([x, row]), np.vstack([y, [labels]]), CLIP, device="cpu", active=classes
        )
        more = _positive_blocks(more_stats, classes)
        moved = [k for k in range(3) if labels[classes[k]]]
        # every class block together: ℓ2 ≤ C for the sums, ≤ 1 for the counts, exactly on the bound
        # when the row has a labelled positive (then the row's weights have unit norm)
        sums_change = np.linalg.norm(more[0] - base[0])
        counts_change = np.linalg.norm(more[1] - base[1])
        assert sums_change <= CLIP * (1 + 1e-12)
        assert counts_change <= 1 + 1e-12
        if moved:
            assert sums_change == pytest.approx(CLIP) and counts_change == pytest.approx(1.0)
        else:
            assert sums_change == 0 and counts_change == 0
        assert np.linalg.norm(more[2] - base[2]) == pytest.approx(CLIP)  # the total: by the row


def test_label_weights_normalise_over_the_labelled_classes_only() -> None:
    y = np.array([[1, 1, 1], [1, 0, 0], [0, 0, 0], [0, 1, 1]])
    w = label_weights(y, [0, 1])
    np.testing.assert_allclose(w, [[1 / math.sqrt(2)] * 2 + [0], [1, 0, 0], [0, 0, 0], [0, 1, 0]])
    assert (np.sum(label_weights(y, [0, 1, 2]) ** 2, axis=1) <= 1 + 1e-12).all()


def test_round1_refuses_statistics_made_for_other_classes() -> None:
    x, y = _data(np.random.default_rng(0))
    with pytest.raises(DpError, match=r"private_statistics\(\.\.\., active="):
        private_statistics(x, y, CLIP, device="cpu").round1([0, 1], class_sums="positives")
    stats = private_statistics(x, y, CLIP, device="cpu", active=[0, 1])
    with pytest.raises(DpError, match=r"normalised over the classes \[0, 1\]"):
        stats.round1([0, 1, 2], class_sums="positives")
    with pytest.raises(DpError, match="class_sums must be"):
        stats.round1([0, 1], class_sums="both")  # type: ignore[arg-type]
    with pytest.raises(DpError, match="--dp-class-sums"):
        DpConfig(epsilon=1.0, class_sums="negatives").validate()  # type: ignore[arg-type]


MISSING_1 = {f"k{i}": [c for c in range(8) if c != i] for i in range(8)}


@pytest.mark.parametrize("rounds", [1, 2])
@pytest.mark.parametrize("unit", ["image", "patient"])
@pytest.mark.parametrize("epsilon", [1.0, 4.0])
def test_epsilon_matches_dp_accounting_called_directly(rounds: int, unit: str, epsilon: float) -> None:
    """Every event recomputed from the blocks' public parameters: a joint slot of A blocks moved by
    Δ_b with Σ Δ_b² ≤ Δ² spends at most max_b 1/(2σ_b²) · (Δ + √A · max_b 2√D_b·2^-g_b)²."""
    layout = FederationLayout(active=MISSING_1, n_classes=8, dim=16, threshold=5, rounds=rounds)
    config = DpConfig(epsilon=epsilon, clip=2.0, unit=unit, **POSITIVES)  # type: ignore[arg-type]
    plan = plan_noise(config, layout)
    for inst, classes in MISSING_1.items():
        accountant = RdpAccountant()
        single = [(ALL_GROUP, "gram"), (ALL_GROUP, "total_sums"), (ALL_GROUP, "total_counts")]
        reached = range(8) if unit == "patient" else classes
        joint = [[(class_group(c), kind) for c in reached] for kind in ("sums", "counts")]
        if rounds == 2:
            pseudo = range(8) if unit == "patient" else [c for c in range(8) if c not in classes]
            single += [(pseudo_group(c), kind) for c in pseudo for kind in ("sums", "counts")]
        for keys in [[k] for k in single] + joint:
            blocks = [plan.blocks[k] for k in keys]
            inverse = max(1 / (2 * b.fewest * b.client_variance * b.grid**2) for b in blocks)
            slack = max(2 * math.sqrt(b.dim) * b.grid for b in blocks)
            rho = inverse * (blocks[0].sensitivity + math.sqrt(len(blocks)) * slack) ** 2
            xi = 0.0
            for b in blocks:
                tau = 10 * sum(
                    math.exp(-2 * math.pi**2 * b.client_variance * k / (k + 1)) for k in range(1, b.members)
                )
                xi += tau * b.dim
            accountant.compose(dp_accounting.ZCDpEvent(rho=rho, xi=xi))
        direct = accountant.get_epsilon(config.delta)
        assert plan.epsilon(inst) == pytest.approx(direct, rel=1e-9)
        assert 0.97 * epsilon <= direct <= epsilon
    assert len(plan.events("k0")) == 5 + (2 if rounds == 2 else 0) * (8 if unit == "patient" else 1)


def test_the_class_blocks_need_far_less_noise_than_the_split_sums_at_missing_1() -> None:
    layout = FederationLayout(active=MISSING_1, n_classes=8, dim=64, threshold=5)
    split = plan_noise(DpConfig(epsilon=1.0), layout)
    positives = plan_noise(DpConfig(epsilon=1.0, **POSITIVES), layout)  # type: ignore[arg-type]
    for c in range(8):
        ratio = (
            positives.blocks[(class_group(c), "sums")].group_std()
            / split.blocks[(class_group(c), "sums")].group_std()
        )
        # split: the sums' ρ over 7 classes; positives: 0.9 of it for all of them (√(0.9·7) ≈ 2.5)
        assert ratio == pytest.approx(1 / math.sqrt(0.9 * 7), rel=0.05)
    assert positives.blocks[(class_group(0), "sums")].dim == 64  # one sum, no negative side
    assert max(positives.epsilons().values()) <= 1.0


def test_exact_positive_sums_solve_to_the_weighted_balanced_projection() -> None:
    """On clean sums: W = (G + γI)⁻¹ (Σ w h / Σ w − Σ h / n), the positives' weighted mean less the
    federation's mean."""
    rng = np.random.default_rng(5)
    active = {"a": [0, 1], "b": [1, 2], "c": [0, 2]}
    parts = {name: _data(rng, n=40, d=5, classes=3) for name in active}
    stats = {
        name: private_statistics(x, y, CLIP, device="cpu", active=active[name])
        for name, (x, y) in parts.items()
    }
    sums = sum_contributions(s.round1(active[name], class_sums="positives") for name, s in stats.items())
    model = AnalyticClassifier(3, gamma=2.0, balance="global", gram="global").fit(analytic_sums(sums, 3))
    clipped = {name: s.gram for name, s in stats.items()}
    gram = sum(clipped.values())
    total = sum(s.total_sum for s in stats.values())
    n_total = sum(s.n_rows for s in stats.values())
    for c in range(3):
        weighted = sum(s.positive_sum[:, c] for s in stats.values())
        n_pos = sum(s.positive_n[c] for s in stats.values())
        b = weighted / n_pos - total / n_total
        expected = np.linalg.solve(gram + 2.0 * np.eye(5), b)
        # the classifier divides by a whole count: the sum is rescaled to keep the mean
        np.testing.assert_allclose(model.coef_[:, c], expected, rtol=1e-10, atol=1e-12)


def test_noisy_positive_sums_are_on_the_grid_and_the_protocol_sums_them_exactly() -> None:
    rng = np.random.default_rng(3)
    active = {"a": [0], "b": [0, 1], "c": [1], "d": [0, 1]}
    layout = FederationLayout(active=active, n_classes=2, dim=5, threshold=3, min_group_size=1)
    plan = plan_noise(DpConfig(epsilon=1.0, clip=CLIP, **POSITIVES), layout)  # type: ignore[arg-type]
    source = DeterministicRandomSource(b"grid")
    uploads = {}
    for name, classes in active.items():
        x, y = _data(rng, d=5, classes=2)
        stats = private_statistics(x, y, CLIP, device="cpu", active=classes)
        uploads[name], clean = round1_upload(stats, classes, plan, source)
        assert sorted(clean[ALL_GROUP]) == ["gram", TOTAL_COUNT, TOTAL_SUM]
        assert sorted(clean) == sorted([ALL_GROUP] + [class_group(c) for c in classes])
    for groups in uploads.values():
        for group, tensors in groups.items():
            for name, values in tensors.items():
                steps = values * 2.0 ** plan.block(group, name).grid_bits
                np.testing.assert_array_equal(steps, np.round(steps))
    result = secure_aggregate(uploads, random=DeterministicRandomSource(b"mask"), dropouts={"R2": ("c",)})
    for group, tensors in result.sums.items():
        for name, value in tensors.items():
            alive = [uploads[k][group][name] for k in result.survivors[group]]
            np.testing.assert_array_equal(value, np.sum(alive, axis=0))
    model, solve, _ = fit_private(result.sums, plan, n_classes=2, gamma=1.0, gram_survivors=3)
    assert np.isfinite(model.coef_).all() and solve.ridge > 0
    # an upload of the split layout's tensors gets no noise from this plan (nor the reverse)
    split_clean = private_statistics(*_data(rng, d=5, classes=2), CLIP, device="cpu").round1([0])
    with pytest.raises(DpError, match="other class-sums layout"):
        privatize(split_clean, plan, source)
    split_plan = plan_noise(DpConfig(epsilon=1.0, clip=CLIP), layout)
    with pytest.raises(DpError, match="other class-sums layout"):
        privatize(uploads["a"], split_plan, source)


def test_row_centring_is_a_public_per_row_map_and_the_classifier_acts_on_the_original_features() -> None:
    from secure_afl.privacy.dp import private_rows
    from secure_afl.privacy.dp_solve import lift
    from secure_afl.privacy.projection import row_map

    rng = np.random.default_rng(11)
    x, y = _data(rng, n=50, d=7, classes=2)
    centring = row_map(7, None, 0, centre=True)
    assert row_map(7, None, 0) is None and centring.shape == (7, 7)
    rows, _ = private_rows(x, 1e9, centring)
    np.testing.assert_allclose(rows, x - x.mean(axis=1, keepdims=True), atol=1e-12)
    # each row alone: a row's map does not depend on the others (the sensitivities hold unchanged)
    np.testing.assert_allclose(private_rows(x[:1], 1e9, centring)[0], rows[:1], atol=1e-12)
    clipped, _ = private_rows(x, CLIP, centring)
    assert (np.linalg.norm(clipped, axis=1) <= CLIP).all()
    # then the projection: the map is centring ∘ projection, and the lifted weights predict on x
    both = row_map(7, 3, 5, centre=True)
    stats = private_statistics(x, y, CLIP, projection=both, device="cpu", active=[0, 1])
    sums = analytic_sums(stats.round1([0, 1], class_sums="positives"), 2)
    model = AnalyticClassifier(2, gamma=1.0, balance="global", gram="global").fit(sums)
    projected, _ = private_rows(x, 1e9, both)
    np.testing.assert_allclose(
        lift(model, both).decision_function(x), model.decision_function(projected), rtol=1e-9, atol=1e-12
    )
    np.testing.assert_allclose(lift(model, both).coef_.sum(axis=0), 0, atol=1e-12)
