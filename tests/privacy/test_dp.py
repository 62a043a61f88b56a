"""The distributed discrete Gaussian mechanism: sensitivity, noise sizing, accounting, solve."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant

from secure_afl.analytic import ALL_GROUP, PseudoLabelConfig, class_group, pseudo_group
from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.privacy.dp import (
    DpConfig,
    DpError,
    FederationLayout,
    cap_images_per_patient,
    clip_rows,
    epsilon_of,
    fewest_survivors,
    plan_noise,
    private_statistics,
    privatize,
    randomized_round,
    rho_for_epsilon,
)
from secure_afl.privacy.dp_solve import analytic_sums, fit_private, refine_private, ridge_for_noise
from secure_afl.sim.secure import secure_aggregate

CLIP = 3.0


def _data(rng: np.random.Generator, n: int = 60, d: int = 6, classes: int = 3):
    x = np.abs(rng.normal(size=(n, d))) * rng.uniform(0.2, 3, size=(n, 1))
    y = (rng.random((n, classes)) < 0.4).astype(int)
    return x, y


def _flat(stats) -> dict[str, np.ndarray]:
    return {
        "gram": stats.gram,
        "sums": np.concatenate([stats.pos_sum.ravel(), stats.neg_sum.ravel()]),
        "counts": np.concatenate([stats.n_pos, stats.n_neg]).astype(float),
    }


# ------------------------------------------------------------------------------------------------
# Sensitivity
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_one_clipped_row_moves_the_statistics_by_at_most_delta(seed: int) -> None:
    rng = np.random.default_rng(seed)
    x, y = _data(rng)
    base = _flat(private_statistics(x, y, CLIP, device="cpu"))
    # the new row: random, huge, and one exactly on the bound
    for row in (rng.normal(size=6) * 50, np.full(6, CLIP / math.sqrt(6)), np.abs(rng.normal(size=6))):
        label = (rng.random((1, 3)) < 0.5).astype(int)
        more = _flat(private_statistics(np.vstack([x, row]), np.vstack([y, label]), CLIP, device="cpu"))
        assert np.linalg.norm(more["gram"] - base["gram"]) <= CLIP**2 * (1 + 1e-12)
        # per class, one of (pos, neg) moves by the row: the class block's l2 change is <= C
        d = 6
        change = (more["sums"] - base["sums"]).reshape(2, d, 3)
        for c in range(3):
            assert np.linalg.norm(change[:, :, c]) <= CLIP * (1 + 1e-12)
            counts = (more["counts"] - base["counts"]).reshape(2, 3)[:, c]
            assert np.linalg.norm(counts) == pytest.approx(1.0)


def test_a_patient_moves_the_statistics_by_at_most_cap_times_delta() -> None:
    rng = np.random.default_rng(7)
    x, y = _data(rng)
    cap = 3
    patient = rng.normal(size=(cap, 6)) * 40
    labels = (rng.random((cap, 3)) < 0.5).astype(int)
    base = _flat(private_statistics(x, y, CLIP, device="cpu"))
    more = _flat(private_statistics(np.vstack([x, patient]), np.vstack([y, labels]), CLIP, device="cpu"))
    assert np.linalg.norm(more["gram"] - base["gram"]) <= cap * CLIP**2 * (1 + 1e-12)
    change = (more["sums"] - base["sums"]).reshape(2, 6, 3)
    for c in range(3):
        assert np.linalg.norm(change[:, :, c]) <= cap * CLIP * (1 + 1e-12)


def test_clipping_and_the_patient_cap() -> None:
    x = np.array([[3.0, 4.0], [0.3, 0.4], [30.0, 40.0]])
    clipped, n = clip_rows(x, 1.0)
    assert n == 2
    assert np.all(np.linalg.norm(clipped, axis=1) <= 1.0)
    np.testing.assert_array_equal(clipped[1], x[1])
    keep = cap_images_per_patient(np.array([5, 5, 5, 7, 5, 7]), 2)
    np.testing.assert_array_equal(keep, [True, True, False, True, False, True])
    with pytest.raises(DpError, match="NaN"):
        clip_rows(np.array([[np.nan, 1.0]]), 1.0)


# ------------------------------------------------------------------------------------------------
# Noise sizing
# ------------------------------------------------------------------------------------------------


def test_fewest_survivors() -> None:
    assert fewest_survivors(1, n_clients=8, threshold=5, min_group_size=1) == 1
    assert fewest_survivors(8, n_clients=8, threshold=5, min_group_size=1) == 5  # >= t survive
    assert fewest_survivors(7, n_clients=8, threshold=5, min_group_size=1) == 4
    assert fewest_survivors(7, n_clients=8, threshold=5, min_group_size=6) == 6
    assert fewest_survivors(3, n_clients=8, threshold=5, min_group_size=6) == 3  # the group's size
    assert fewest_survivors(7, n_clients=8, threshold=5, min_group_size=2, masked=False) == 1


LAYOUTS = [
    # missing 7 (one client per class), missing 1 (each class labelled by 7)
    ({f"k{i}": [i] for i in range(8)}, 8),
    ({f"k{i}": [c for c in range(8) if c != i] for i in range(8)}, 8),
    ({"a": [0, 1], "b": [1, 2], "c": [0, 2], "d": [2]}, 3),
]


@pytest.mark.parametrize("active,n_classes", LAYOUTS)
@pytest.mark.parametrize("threshold,min_group", [(5, 1), (3, 2), (8, 1)])
@pytest.mark.parametrize("rounds", [1, 2])
def test_every_group_sum_at_its_fewest_survivors_carries_the_target_variance(
    active, n_classes, threshold, min_group, rounds
) -> None:
    threshold = min(threshold, len(active))
    layout = FederationLayout(
        active=active,
        n_classes=n_classes,
        dim=16,
        threshold=threshold,
        min_group_size=min_group,
        rounds=rounds,
    )
    plan = plan_noise(DpConfig(epsilon=1.0, clip=2.0), layout)
    for (group, _), block in plan.blocks.items():
        members = layout.members(group)
        fewest = max(1, min(members, max(min_group, members - (len(active) - threshold))))
        assert block.fewest == fewest
        assert block.fewest * block.client_variance >= block.target_variance_steps
        assert block.rho <= block.target_rho * (1 + 1e-12)
    if rounds == 2:
        assert {g for g, _ in plan.blocks} >= {
            pseudo_group(c) for c in range(n_classes) if layout.members(pseudo_group(c))
        }


def test_noise_sums_at_the_fewest_survivors_empirically() -> None:
    """Members' actual noise, summed over the fewest survivors, has at least the target variance."""
    active = {f"k{i}": [0] for i in range(5)}  # one class group of 5 and the Gram group of 5
    layout = FederationLayout(active=active, n_classes=1, dim=4, threshold=3, min_group_size=1)
    plan = plan_noise(DpConfig(epsilon=2.0, clip=1.0), layout)
    block = plan.blocks[(class_group(0), "sums")]
    assert block.fewest == 3
    zeros = {
        class_group(0): {
            "pos_sum/0": np.zeros(2000),
            "neg_sum/0": np.zeros(2000),
            "n_pos/0": np.zeros(1),
            "n_neg/0": np.zeros(1),
        }
    }
    source = DeterministicRandomSource(b"noise")
    sums = (
        sum(privatize(zeros, plan, source)[class_group(0)]["pos_sum/0"] for _ in range(block.fewest))
        * 2.0**block.grid_bits
    )
    target = block.target_variance_steps
    assert np.var(sums) >= 0.9 * target  # 2000 draws: relative sd of the variance estimate ~3 %
    assert np.var(sums) == pytest.approx(block.fewest * block.client_variance, rel=0.1)


def test_noisy_values_are_on_the_grid_and_the_protocol_sums_them_exactly() -> None:
    rng = np.random.default_rng(3)
    active = {"a": [0], "b": [0, 1], "c": [1]}
    layout = FederationLayout(active=active, n_classes=2, dim=5, threshold=2, min_group_size=1)
    plan = plan_noise(DpConfig(epsilon=1.0, clip=CLIP), layout)
    source = DeterministicRandomSource(b"grid")
    uploads = {}
    for name, classes in active.items():
        x, y = _data(rng, d=5, classes=2)
        uploads[name] = privatize(private_statistics(x, y, CLIP, device="cpu").round1(classes), plan, source)
    for groups in uploads.values():
        for group, tensors in groups.items():
            for name, values in tensors.items():
                steps = values * 2.0 ** plan.block(group, name).grid_bits
                np.testing.assert_array_equal(steps, np.round(steps))
        np.testing.assert_array_equal(groups[ALL_GROUP]["gram"], groups[ALL_GROUP]["gram"].T)
    result = secure_aggregate(uploads, random=DeterministicRandomSource(b"mask"), dropouts={"R2": ("c",)})
    for group, tensors in result.sums.items():
        for name, value in tensors.items():
            alive = [uploads[k][group][name] for k in result.survivors[group]]
            np.testing.assert_array_equal(value, np.sum(alive, axis=0))  # bit for bit


def test_randomized_rounding_is_unbiased() -> None:
    y = np.full(200_000, 0.3)
    r = randomized_round(y, DeterministicRandomSource(b"round"))
    assert set(np.unique(r)) == {0, 1}
    assert abs(r.mean() - 0.3) < 0.005
    r = randomized_round(np.full(200_000, -2.75), DeterministicRandomSource(b"neg"))
    assert set(np.unique(r)) == {-3, -2}
    assert abs(r.mean() + 2.75) < 0.005


# ------------------------------------------------------------------------------------------------
# Accounting
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("epsilon,delta", [(0.5, 1e-6), (1.0, 1e-6), (8.0, 1e-5)])
def test_epsilon_matches_dp_accounting_called_directly(epsilon: float, delta: float) -> None:
    active = {f"k{i}": [c for c in range(4) if c != i % 4] for i in range(6)}
    layout = FederationLayout(active=active, n_classes=4, dim=8, threshold=4, rounds=2)
    plan = plan_noise(DpConfig(epsilon=epsilon, delta=delta, clip=2.0), layout)
    for inst, classes in active.items():
        accountant = RdpAccountant()
        # recompute every event from the blocks' public parameters (Kairouz et al., Prop. 14)
        groups = [(ALL_GROUP, "gram")]
        for c in range(4):
            g = class_group(c) if c in classes else pseudo_group(c)
            groups += [(g, "sums"), (g, "counts")]
        for key in groups:
            b = plan.blocks[key]
            delta_steps = b.sensitivity * 2.0**b.grid_bits + 2 * math.sqrt(b.dim)
            rho = delta_steps**2 / (2 * b.fewest * b.client_variance)
            tau = 10 * sum(
                math.exp(-2 * math.pi**2 * b.client_variance * k / (k + 1)) for k in range(1, b.members)
            )
            accountant.compose(dp_accounting.ZCDpEvent(rho=rho, xi=tau * b.dim))
        direct = accountant.get_epsilon(delta)
        assert plan.epsilon(inst) == pytest.approx(direct, rel=1e-12)
        assert direct <= epsilon
        assert direct >= 0.97 * epsilon  # calibrated, not wasteful
    # two rounds compose: the same noise on round 1 alone spends less
    layout1 = FederationLayout(active=active, n_classes=4, dim=8, threshold=4, rounds=1)
    plan1 = plan_noise(DpConfig(epsilon=epsilon, delta=delta, clip=2.0), layout1)
    assert len(plan.events("k0")) == 1 + 2 * 4 and len(plan1.events("k0")) == 1 + 2 * 3


def test_rho_for_epsilon_inverts_the_accountant() -> None:
    rho = rho_for_epsilon(1.0, 1e-6)
    assert epsilon_of([(rho, 0.0)], 1e-6) <= 1.0
    assert epsilon_of([(rho * 1.01, 0.0)], 1e-6) > 1.0


def test_bad_settings_are_refused() -> None:
    for bad, match in [
        (DpConfig(epsilon=0), "dp-epsilon"),
        (DpConfig(epsilon=1, delta=1), "dp-delta"),
        (DpConfig(epsilon=1, clip=-1), "clip"),
        (DpConfig(epsilon=1, unit="visit"), "dp-unit"),  # type: ignore[arg-type]
    ]:
        with pytest.raises(DpError, match=match):
            bad.validate()
    layout = FederationLayout(active={"a": [0]}, n_classes=2, dim=3, threshold=1)
    with pytest.raises(DpError, match="class 1 has no annotating client"):
        plan_noise(DpConfig(epsilon=1), layout)


# ------------------------------------------------------------------------------------------------
# Solving with noisy statistics
# ------------------------------------------------------------------------------------------------


def test_noisy_indefinite_gram_is_solved() -> None:
    rng = np.random.default_rng(0)
    active = {f"k{i}": [0, 1] for i in range(3)}
    d = 20
    layout = FederationLayout(active=active, n_classes=2, dim=d, threshold=2)
    plan = plan_noise(DpConfig(epsilon=0.5, clip=1.0), layout)
    source = DeterministicRandomSource(b"solve")
    uploads = [
        privatize(
            private_statistics(*_data(rng, n=15, d=d, classes=2), 1.0, device="cpu").round1([0, 1]),
            plan,
            source,
        )
        for _ in active
    ]
    from secure_afl.analytic import sum_contributions

    sums = sum_contributions(uploads)
    assert np.linalg.eigvalsh(sums[ALL_GROUP]["gram"]).min() < 0  # the noise made it indefinite
    model, solve, _ = fit_private(sums, plan, n_classes=2, gamma=1.0, gram_survivors=3)
    assert np.isfinite(model.coef_).all()
    assert solve.ridge == pytest.approx(ridge_for_noise(solve.gram_noise_std, d, 1e-6))
    assert solve.ridge > -np.linalg.eigvalsh(sums[ALL_GROUP]["gram"]).min()
    # a Gram the ridge cannot rescue goes through the eigenvalue floor, still by Cholesky
    sums[ALL_GROUP]["gram"] = sums[ALL_GROUP]["gram"] - 10 * solve.ridge * np.eye(d)
    model, solve, used = fit_private(sums, plan, n_classes=2, gamma=1.0, gram_survivors=3)
    assert solve.eigenvalue_floor and np.isfinite(model.coef_).all()
    assert np.linalg.eigvalsh(used[ALL_GROUP]["gram"]).min() >= -1e-8


def test_server_rebuilds_global_balance_sums_with_counts_floored() -> None:
    sums = {
        ALL_GROUP: {"gram": np.eye(2)},
        class_group(0): {
            "pos_sum/0": np.array([1.0, 2.0]),
            "neg_sum/0": np.array([3.0, 4.0]),
            "n_pos/0": np.array([-2.3]),
            "n_neg/0": np.array([7.6]),
        },
    }
    out = analytic_sums(sums, 1)
    np.testing.assert_array_equal(out[class_group(0)]["feat_sum"], [4.0, 6.0])
    assert out[class_group(0)]["n_pos/0"][0] == 1.0 and out[class_group(0)]["n"][0] == 9.0


def test_round2_qualifies_only_counts_clear_of_the_noise() -> None:
    from secure_afl.analytic import sum_contributions

    rng = np.random.default_rng(1)
    active = {"k0": [0], "k1": [1], "k2": [0, 1]}
    layout = FederationLayout(active=active, n_classes=2, dim=4, threshold=2, rounds=2)
    plan = plan_noise(DpConfig(epsilon=1.0, clip=1.0), layout)
    source = DeterministicRandomSource(b"r2")
    uploads = [
        privatize(
            private_statistics(*_data(rng, n=30, d=4, classes=2), 1.0, device="cpu").round1(c), plan, source
        )
        for c in active.values()
    ]
    model, solve, converted = fit_private(
        sum_contributions(uploads), plan, n_classes=2, gamma=1.0, gram_survivors=3
    )

    def pseudo(n_pos: float) -> dict:
        tensors = {"pseudo_pos_sum/1": np.ones(4), "pseudo_neg_sum/1": np.ones(4)}
        return {
            pseudo_group(1): {
                **tensors,
                "pseudo_n_pos/1": np.array([n_pos]),
                "pseudo_n_neg/1": np.array([900.0]),
            }
        }

    config = PseudoLabelConfig()
    # a noisy count of 20 with noise std 40 could be noise alone: refused; 500 is clear of it
    _, refused = refine_private(
        model, converted, pseudo(20.0), solve, n_classes=2, config=config, count_noise_std={1: 40.0}
    )
    _, taken = refine_private(
        model, converted, pseudo(500.0), solve, n_classes=2, config=config, count_noise_std={1: 40.0}
    )
    assert refused.qualified == () and taken.qualified == (1,)
