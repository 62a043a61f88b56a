"""DP under growth: noisy DP sums accumulate across sessions, the chain's ridge is sized
from the summed noise variance, and the chain's ε is the max over sessions (image unit) or their
composition (patient unit)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from secure_afl.analytic import sum_contributions
from secure_afl.cli import main
from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.growth import GrowthError, accumulate_sums, check_same_privacy, is_private
from secure_afl.privacy.dp import DpConfig, FederationLayout, epsilon_of, plan_noise
from secure_afl.privacy.dp_config import DpError
from secure_afl.privacy.dp_growth import ChainNoise, SessionNoise
from secure_afl.privacy.dp_solve import fit_private
from secure_afl.sim.datasets import DataRequest
from secure_afl.sim.growing import GrowingConfig, run_growing
from secure_afl.sim.partial import assign_partial_labels
from secure_afl.sim.setting import SimConfig

D = 5
ACTIVE = {"a": (0, 1), "b": (0, 1), "c": (0,), "d": (1,)}


def _plan(**config) -> object:
    layout = FederationLayout(active=ACTIVE, n_classes=2, dim=D, threshold=3, min_group_size=2)
    return plan_noise(DpConfig(**{"epsilon": 1.0, "clip": 4.0, **config}), layout)


def _dp_session(rng: np.random.Generator, positives: bool = False) -> dict[str, dict[str, np.ndarray]]:
    """Noisy-looking DP sums (floats, counts not whole numbers): the split or the positives layout."""
    a = rng.normal(size=(D, D))
    out = {"all": {"gram": a @ a.T + 50 * np.eye(D)}}
    if positives:
        out["all"].update({"total_sum": rng.normal(size=D), "n_total": np.array([40.3]),
                           "gram_min_eig": np.array([3.7])})  # fmt: skip
        for c in (0, 1):
            out[f"class/{c}"] = {f"wpos_sum/{c}": rng.normal(size=D), f"wpos_n/{c}": np.array([9.6])}
        return out
    for c in (0, 1):
        out[f"class/{c}"] = {
            f"pos_sum/{c}": rng.normal(size=D),
            f"neg_sum/{c}": rng.normal(size=D),
            f"n_pos/{c}": np.array([10.4 + c]),
            f"n_neg/{c}": np.array([-0.6]),  # a noisy count may be negative: floored only at the solve
        }
    return out


@pytest.mark.parametrize("positives", [False, True])
def test_dp_tensors_accumulate_as_plain_float_sums(positives):
    rng = np.random.default_rng(1)
    sessions = [_dp_session(rng, positives) for _ in range(3)]
    total = None
    for s in sessions:
        total = accumulate_sums(total, s)
    assert is_private(total)
    for group, tensors in sessions[0].items():
        for name in tensors:
            want = sessions[0][group][name] + sessions[1][group][name] + sessions[2][group][name]
            np.testing.assert_array_equal(total[group][name], want)
    if not positives:  # counts stay noisy floats here: -0.6 three times, not 1 + 1 + 1
        assert total["class/0"]["n_neg/0"][0] == pytest.approx(-1.8)


def test_a_chain_mixing_dp_and_exact_sums_is_refused_and_nothing_changes():
    rng = np.random.default_rng(2)
    noisy = accumulate_sums(None, _dp_session(rng))
    exact = {"class/0": {"pos_sum/0": rng.normal(size=D), "n_pos/0": np.array([3.0]),
                         "feat_sum": rng.normal(size=D), "n": np.array([9.0])},
             "all": {"gram": np.eye(D)}}  # fmt: skip
    before = {g: {t: v.copy() for t, v in ts.items()} for g, ts in noisy.items()}
    with pytest.raises(GrowthError, match="non-DP session cannot extend a chain of DP"):
        accumulate_sums(noisy, exact)
    with pytest.raises(GrowthError, match="DP session cannot extend a chain of non-DP"):
        accumulate_sums(accumulate_sums(None, exact), _dp_session(rng))
    assert all(np.array_equal(noisy[g][t], before[g][t]) for g in before for t in before[g])
    check_same_privacy(True, True)
    check_same_privacy(False, False)


def test_the_chain_ridge_is_sized_from_the_summed_noise_variance():
    plan = _plan()
    block = plan.blocks[("all", "gram")]
    survivors = (4, 3, 4)
    sessions = [SessionNoise.of(plan, n) for n in survivors]
    chain = ChainNoise(tuple(sessions))
    # by hand: session k's Gram noise has variance n_k·v·grid² per entry; independent sessions add
    by_hand = math.sqrt(sum(n * block.client_variance for n in survivors)) * 2.0**-block.grid_bits
    assert chain.gram_std == pytest.approx(by_hand, rel=1e-12)
    assert chain.gram_std > max(s.gram_std for s in sessions)
    beta = plan.config.ridge_failure_probability
    ridge = by_hand * (2 * math.sqrt(D) + 6 * math.sqrt(math.log(D)) + 2 * math.sqrt(math.log(1 / beta)))
    sums = accumulate_sums(accumulate_sums(None, _dp_session(np.random.default_rng(3))),
                           _dp_session(np.random.default_rng(4)))  # fmt: skip
    _, solve, _ = fit_private(sums, plan, n_classes=2, gamma=1.0, gram_survivors=4, chain=chain)
    assert solve.ridge == pytest.approx(ridge, rel=1e-12) and solve.gram_noise_std == pytest.approx(by_hand)
    _, alone, _ = fit_private(sums, plan, n_classes=2, gamma=1.0, gram_survivors=4)
    assert alone.ridge < solve.ridge  # one session's plan alone would under-size it


def test_the_chain_lambda_min_lower_bound_uses_the_summed_eigen_noise():
    plan = _plan(ridge="adassp")
    sessions = tuple(SessionNoise.of(plan, n) for n in (4, 4))
    chain = ChainNoise(sessions)
    eigen = plan.blocks[("all", "eigen")]
    assert chain.eigen_std == pytest.approx(math.sqrt(2) * eigen.group_std(4), rel=1e-12)
    sums = _dp_session(np.random.default_rng(5))
    sums["all"]["gram_min_eig"] = np.array([1e6])  # a large summed λ_min: the ridge is B − λ̃_min, floored
    beta = plan.config.ridge_failure_probability
    _, solve, _ = fit_private(sums, plan, n_classes=2, gamma=1.0, gram_survivors=4, chain=chain)
    tail = math.sqrt(2 * math.log(1 / beta))
    assert solve.min_eigenvalue_bound == pytest.approx(1e6 - chain.eigen_std * tail, rel=1e-12)


def test_epsilon_is_the_max_over_sessions_for_images_and_composes_for_patients():
    image = ChainNoise(tuple(SessionNoise.of(_plan(epsilon=e), 4) for e in (0.5, 2.0, 1.0)))
    for k, eps in image.epsilons().items():
        spent = [s.epsilon[k] for s in image.sessions]
        assert eps == max(spent) and eps <= 2.0
    assert image.composition == "parallel"
    patient = ChainNoise(tuple(SessionNoise.of(_plan(epsilon=1.0, unit="patient"), 4) for _ in range(3)))
    for k, eps in patient.epsilons().items():
        spent = [s.epsilon[k] for s in patient.sessions]
        events = [e for s in patient.sessions for e in s.events[k]]
        assert eps == pytest.approx(epsilon_of(events, 1e-6), rel=1e-12)
        assert max(spent) < eps <= sum(spent)  # RDP composition: more than one session, below the sum
    assert patient.record()["composition"] == "rdp"
    # every session's ε is in the record, per institution
    assert [s["epsilon_spent"] for s in image.record()["sessions"]] == [
        dict(s.epsilon) for s in image.sessions
    ]
    # records survive their JSON (the deployment's chain entries)
    again = SessionNoise.from_json(json.loads(json.dumps(image.sessions[1].to_json())))
    assert again == image.sessions[1]


def test_a_chain_refuses_sessions_that_do_not_share_a_unit_a_row_map_or_a_ridge_kind():
    one = SessionNoise.of(_plan(), 4)
    with pytest.raises(DpError, match="different units"):
        ChainNoise((one, SessionNoise.of(_plan(unit="patient"), 4)))
    with pytest.raises(DpError, match="map their rows differently"):
        ChainNoise((one, SessionNoise.of(_plan(row_centre=True), 4)))
    with pytest.raises(DpError, match="adassp"):
        ChainNoise((one, SessionNoise.of(_plan(ridge="adassp"), 4)))
    with pytest.raises(DpError, match="not a DP session record"):
        SessionNoise.from_json({"gram_noise_std": 1.0})


# ----------------------------------------------------------------------------------------------
# The simulator: secure-afl sim --scenario growing --dp-epsilon E
# ----------------------------------------------------------------------------------------------

SMALL = {"fraction": 0.02, "dim": 16, "device": "cpu", "rounds": 1, "missing": (1,)}


@pytest.fixture(scope="module")
def data():
    return DataRequest(0.02, 16, 0, 8, "image").prepare()


def test_three_dp_sessions_under_masking_accumulate_the_noisy_uploads_exactly(data):
    from secure_afl.sim.growing import arrivals
    from secure_afl.sim.private import PrivateGrowth

    sim = SimConfig(secure="mask", dp=DpConfig(epsilon=1.0, clip=8.0), **SMALL)
    config = GrowingConfig(sim=sim, idle=((2, 3),))
    result = run_growing(config, data=data, random=DeterministicRandomSource(b"\x07" * 32))
    # the same noise again, client by client: the masked sums are the sums of the noisy uploads, bit
    # for bit, and the chain's sums the sum of the sessions'
    active = assign_partial_labels(8, data.cohort.labels.shape[1], 1, seed=0).active
    again = PrivateGrowth(data, sim, active, DeterministicRandomSource(b"\x07" * 32))
    want = None
    for s, session in enumerate(arrivals(data.split.clients, 3, config.idle, 0)):
        noisy, _ = again.uploads(session, lambda *a: None, "session")
        plain = sum_contributions(noisy.values())
        released = result.sessions[s].released_sums
        for group, tensors in plain.items():
            for name, value in tensors.items():
                np.testing.assert_array_equal(np.asarray(released[group][name]).reshape(value.shape), value)
        want = accumulate_sums(want, released)
    for group, tensors in want.items():
        for name, value in tensors.items():
            np.testing.assert_array_equal(result.accumulated[group][name], value)
    # every session's ε per institution is recorded, and the chain's is their max (image unit)
    for r in result.sessions:
        growth = r.privacy["growth"]
        assert len(growth["sessions"]) == r.session
        for k, eps in growth["epsilon_chain"].items():
            assert eps == max(s["epsilon_spent"][k] for s in growth["sessions"]) <= 1.0
    assert result.sessions[1].idle == ("client-3",) and result.sessions[1].known_zero == ()
    stds = [s["gram_noise_std"] for s in result.sessions[-1].privacy["growth"]["sessions"]]
    assert result.sessions[-1].privacy["gram_noise_std"] == pytest.approx(math.sqrt(sum(x * x for x in stds)))


@pytest.mark.parametrize("secure", ["mask", "none"])
def test_a_dp_growing_classifier_at_a_very_large_epsilon_is_near_the_noise_free_fit(data, secure):
    sim = SimConfig(secure=secure, dp=DpConfig(epsilon=1e8, clip=8.0), **SMALL)
    result = run_growing(GrowingConfig(sim=sim), data=data)
    for r in result.sessions:
        assert r.max_abs_w_vs_centralised <= 0.05 * r.max_abs_w
    # ... while at ε = 1 the noise is visible (the comparison above can fail); the large-ε gap is the
    # fixed-point grid's noise floor and the ridge it sizes, not a bias of the accumulation
    sim = SimConfig(secure=secure, dp=DpConfig(epsilon=1.0, clip=8.0), **SMALL)
    noisy = run_growing(GrowingConfig(sim=sim), data=data)
    assert noisy.sessions[-1].max_abs_w_vs_centralised > 0.05 * noisy.sessions[-1].max_abs_w


def test_the_patient_unit_composes_the_sessions_epsilon(data):
    dp = DpConfig(epsilon=1.0, clip=8.0, unit="patient", max_images_per_patient=2)
    result = run_growing(GrowingConfig(sim=SimConfig(secure="mask", dp=dp, **SMALL)), data=data)
    growth = result.sessions[-1].privacy["growth"]
    assert growth["composition"] == "rdp"
    for k, eps in growth["epsilon_chain"].items():
        spent = [s["epsilon_spent"][k] for s in growth["sessions"]]
        assert max(spent) < eps <= sum(spent)


def test_dp_under_ckks_stays_refused():
    sim = SimConfig(secure="ckks", dp=DpConfig(epsilon=1.0), **SMALL)
    with pytest.raises(Exception, match="--secure mask or none"):
        GrowingConfig(sim=sim).validate()


def test_the_command_records_every_sessions_epsilon(tmp_path):
    args = ["sim", "--scenario", "growing", "--sessions", "3", "--dp-epsilon", "2", "--clip", "8",
            "--fraction", "0.02", "--dim", "16", "--device", "cpu", "--missing", "1",
            "--out", str(tmp_path)]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "parallel composition" in result.output
    saved = json.loads((tmp_path / "results.json").read_text())
    chain = saved["differential_privacy"]
    assert [s["session"] for s in chain["sessions"]] == [1, 2, 3]
    assert all(0 < e <= 2.0 for s in chain["sessions"] for e in s["epsilon_spent"].values())
    assert [s["differential_privacy"]["epsilon_target"] for s in saved["sessions"]] == [2.0, 2.0, 2.0]
