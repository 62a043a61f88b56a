"""The patient unit's rounding slack: every client rounds its own values, so a patient whose images
sit at j clients moves a group sum by up to ``P·Δ·2^g + j·√D`` grid steps, not ``2√D``.

The plan bounds it by ``max(2, j)·√D`` with j the layout's public bound (the simulator: every
client, capped at P); the deployment, where a patient stays within one institution, keeps j = 1.
"""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant

from secure_afl.analytic import ALL_GROUP
from secure_afl.core import encoding
from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.privacy.dp import (
    DpConfig,
    DpError,
    FederationLayout,
    plan_noise,
    randomized_round,
    rounding_slack_steps,
)
from secure_afl.privacy.dp_sampler import noise_words
from secure_afl.sim.data import load_cohort, split_cohort
from secure_afl.sim.datasets import PreparedData
from secure_afl.sim.private import client_rows

CLIP = 2.0
P = 4  # images per patient (the default cap)
ACTIVE = {f"k{i}": [i % 3, (i + 1) % 3] for i in range(6)}  # 6 institutions, 3 classes, groups of 4


def _patient_plan(patient_clients: int, *, epsilon: float = 4.0, dim: int = 3):
    config = DpConfig(epsilon=epsilon, clip=CLIP, unit="patient", max_images_per_patient=P)
    layout = FederationLayout(
        active=ACTIVE, n_classes=3, dim=dim, threshold=4, patient_clients=patient_clients
    )
    return config, layout, plan_noise(config, layout)


def _uniforms(seed: bytes, n: int) -> np.ndarray:
    """The fractions U that randomized_round draws from ``DeterministicRandomSource(seed)``."""
    words = noise_words(DeterministicRandomSource(seed)).take(n) >> np.uint64(11)
    return words.astype(np.float64) / 2.0**53


def test_a_patient_at_four_clients_moves_the_gram_sum_by_four_roundings() -> None:
    """Worst-case rounding: at each client the neighbour without the patient sits exactly on the
    rounding threshold, so the patient's tiny Gram terms round every coordinate up at every client."""
    d = 3
    _, _, plan = _patient_plan(patient_clients=6, dim=d)
    block = plan.blocks[(ALL_GROUP, "gram")]
    dim = encoding.upper_triangle_length(d)
    assert block.dim == dim and block.rounding_clients == P  # min(6 clients, 4 images)
    scale = 2.0**block.grid_bits
    h = np.full(d, 1e-4 / math.sqrt(scale))  # one image per client: h hᵀ·2^g = 1e-8 per entry
    change = np.zeros(dim)
    for k in range(P):  # the patient's 4 images at 4 clients, each rounding its own Gram
        seed = bytes([k]) * 32
        without = _uniforms(seed, dim)  # on the threshold: rounds down
        with_patient = without + encoding.pack_symmetric(np.outer(h, h)) * scale
        change += randomized_round(with_patient, DeterministicRandomSource(seed)) - randomized_round(
            without, DeterministicRandomSource(seed)
        )
    moved = float(np.linalg.norm(change))
    exact = float(np.linalg.norm(P * encoding.pack_symmetric(np.outer(h, h)))) * scale
    assert moved == pytest.approx(P * math.sqrt(dim))  # every coordinate up once per client
    assert moved > exact + 2 * math.sqrt(dim)  # beyond the former Δ·2^g + 2√D
    assert moved <= exact + P * math.sqrt(dim)  # within P·Δ·2^g + j·√D
    # the plan's bound for this block covers it: Δ = P·C², slack max(2, j)·√D
    assert block.sensitivity_steps == pytest.approx(P * CLIP**2 * scale + P * math.sqrt(dim), rel=1e-15)
    assert block.sensitivity_steps >= P * CLIP**2 * scale + moved


def _epsilon_from_scratch(plan, clients: int) -> float:
    """An institution's ε recomputed with dp-accounting.  The patient unit, split class sums, one
    round: a patient may sit at any client, so every block of the plan is one of its slots, each
    ρ = (P·Δ·2^g + max(2, j)·√D)² / (2·u·σ_c²) at the fewest survivors u, ξ = τ(m)·D."""
    accountant = RdpAccountant()
    for b in plan.blocks.values():
        steps = b.sensitivity * 2.0**b.grid_bits + max(2, clients) * math.sqrt(b.dim)
        rho = steps**2 / (2.0 * b.fewest * b.client_variance)
        tau = 10.0 * sum(
            math.exp(-2.0 * math.pi**2 * b.client_variance * k / (k + 1)) for k in range(1, b.members)
        )
        accountant.compose(dp_accounting.ZCDpEvent(rho=rho, xi=tau * b.dim))
    return float(accountant.get_epsilon(plan.config.delta))


@pytest.mark.parametrize("epsilon", [1.0, 4.0])
def test_the_reported_epsilon_is_exact_for_a_patient_spread_over_clients(epsilon: float) -> None:
    _, _, plan = _patient_plan(patient_clients=6, epsilon=epsilon)
    assert {b.rounding_clients for b in plan.blocks.values()} == {P}
    recomputed = _epsilon_from_scratch(plan, P)
    spent = plan.epsilons()
    assert set(spent) == set(ACTIVE)
    assert all(e == pytest.approx(recomputed, rel=1e-9) for e in spent.values())
    assert epsilon * 0.99 < recomputed <= epsilon  # calibrated to the target, never beyond


def test_the_one_client_plan_overspends_for_a_patient_at_four_clients() -> None:
    """What the fix is for: the noise of a plan that assumed one client's rounding (2√D), accounted
    for a patient whose images sit at four clients, spends more than the target."""
    _, _, narrow = _patient_plan(patient_clients=1)
    assert {b.rounding_clients for b in narrow.blocks.values()} == {1}
    assert max(narrow.epsilons().values()) <= 4.0
    assert _epsilon_from_scratch(narrow, 1) == pytest.approx(max(narrow.epsilons().values()), rel=1e-9)
    assert _epsilon_from_scratch(narrow, P) > 4.0
    _, _, wide = _patient_plan(patient_clients=6)
    for key, b in wide.blocks.items():  # the fix pays with more noise (real units), never less
        assert b.group_std() >= narrow.blocks[key].group_std() * (1 - 1e-9)


def test_the_image_unit_and_two_clients_keep_the_two_roundings_bound() -> None:
    layout = FederationLayout(active=ACTIVE, n_classes=3, dim=3, threshold=4, patient_clients=6)
    image = plan_noise(DpConfig(epsilon=2.0, clip=CLIP), layout)  # an image sits at one client
    two = plan_noise(
        DpConfig(epsilon=2.0, clip=CLIP, unit="patient", max_images_per_patient=2), layout
    )  # 2 images: at most 2 clients
    for plan in (image, two):
        for b in plan.blocks.values():
            assert b.sensitivity_steps == b.sensitivity * 2.0**b.grid_bits + 2 * math.sqrt(b.dim)
    assert rounding_slack_steps(5, 1) == rounding_slack_steps(5, 2) == 2 * math.sqrt(5)
    assert rounding_slack_steps(5, 7) == 7 * math.sqrt(5)


def test_the_deployment_keeps_a_patient_within_one_institution() -> None:
    """The deployment's plan (noise_plan of a study) keeps j = 1: exactly the former bound."""
    from secure_afl.deploy.study import Method, Study, StudyDp, noise_plan

    study = Study(
        classes=("A", "B", "C"),
        dim=8,
        backbone={"name": "toy", "weights_id": "sha256:00", "preprocessing": "none"},
        method=Method(balance="global", rounds=1),
        dp=StudyDp(
            epsilon=1.0,
            class_lists={cid: tuple(c) for cid, c in ACTIVE.items()},
            clip=CLIP,
            unit="patient",
            max_images_per_patient=P,
        ),
    )
    plan = noise_plan(study, len(ACTIVE))
    for b in plan.blocks.values():
        assert b.rounding_clients == 1
        assert b.sensitivity_steps == b.sensitivity * 2.0**b.grid_bits + 2 * math.sqrt(b.dim)
    # and it is the plan of a layout that states one institution per patient
    config = study.dp.config()  # type: ignore[union-attr]
    layout = FederationLayout(
        active=dict(ACTIVE), n_classes=3, dim=8, threshold=study.threshold_for(len(ACTIVE)),
        min_group_size=study.min_group_size, rounds=1, frac_bits=study.frac_bits, patient_clients=1,
    )  # fmt: skip
    assert plan.blocks == plan_noise(config, layout).blocks


def test_the_simulators_split_spreads_patients_within_its_public_bound() -> None:
    """On the default image split, after the cap, some patients sit at 3 or 4 clients (so 2√D was
    short), and none at more than the plan's j = min(clients, P)."""
    cohort = load_cohort()
    split = split_cohort(cohort, n_clients=8, by="image", seed=0)
    data = PreparedData(cohort=cohort, features=np.zeros((len(cohort), 1)), split=split, description={})
    rows = client_rows(data, DpConfig(epsilon=1.0, unit="patient", max_images_per_patient=P))
    clients_of: dict[object, set[int]] = {}
    for k, r in enumerate(rows):
        for pid in cohort.patient_ids[r]:
            clients_of.setdefault(pid, set()).add(k)
    spans = np.bincount([len(c) for c in clients_of.values()])
    assert len(spans) - 1 == P  # the most clients one patient's capped images sit at
    assert spans[3] > 0 and spans[4] > 0


@pytest.mark.parametrize("bad", [0, 7, 2.5, True])
def test_a_bad_patient_bound_is_refused(bad) -> None:
    with pytest.raises(DpError, match="patient_clients"):
        FederationLayout(active=ACTIVE, n_classes=3, dim=3, threshold=4, patient_clients=bad)


@pytest.mark.parametrize("class_sums", ["split", "positives"])
def test_slots_of_several_blocks_cover_every_way_a_spread_patient_moves_them(class_sums: str) -> None:
    """The invariant another way: a slot whose blocks move together (a patient's images on either
    side of a class in round 2; the positive sums of every class) is accounted at least at the ρ of
    every split of the patient's P images and j = 4 clients' roundings over its blocks."""
    config = DpConfig(
        epsilon=2.0,
        clip=CLIP,
        unit="patient",
        max_images_per_patient=P,
        class_sums=class_sums,  # type: ignore[arg-type]
        row_centre=class_sums == "positives",
    )
    layout = FederationLayout(active=ACTIVE, n_classes=3, dim=3, threshold=4, rounds=2, patient_clients=6)
    plan = plan_noise(config, layout)
    checked = 0
    for inst in ACTIVE:
        for slot, (rho, _) in zip(plan.slots[inst], plan.events(inst), strict=True):
            blocks = [plan.blocks[key] for key in slot]
            if len(blocks) < 2:
                continue
            per_image = blocks[0].sensitivity / P  # C for sums, 1 for counts

            def true_rho(
                images: list[float], clients: list[int], blocks=blocks, per_image=per_image
            ) -> float:
                return sum(
                    (a * per_image * 2.0**b.grid_bits + j * math.sqrt(b.dim)) ** 2
                    / (2.0 * b.fewest * b.client_variance)
                    for a, j, b in zip(images, clients, blocks, strict=True)
                )

            worst = 0.0
            if class_sums == "split":  # a images to the class block, P − a to the pseudo block
                for a in range(P + 1):
                    for j0 in range(min(a, P) + 1):
                        for j1 in range(min(P - a, P - j0) + 1):
                            worst = max(worst, true_rho([a, P - a], [j0, j1]))
            else:  # every client holding an image moves every class block: Σ_c w_c² ≤ 1 per image
                n = len(blocks)
                for weights in (np.eye(n)[0], np.full(n, 1 / math.sqrt(n))):
                    worst = max(worst, true_rho(list(P * weights), [P] * n))
            assert rho >= worst * (1 - 1e-12)
            checked += 1
    assert checked > 0
