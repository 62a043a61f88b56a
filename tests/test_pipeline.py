"""One pipeline: every setting, private or not, walks the same stages of ``run_setting``; a
mechanism only supplies their contents."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.privacy.dp import DpConfig
from secure_afl.sim import private, runner
from secure_afl.sim.datasets import prepare
from secure_afl.sim.mechanism import PaperMechanism
from secure_afl.sim.private import AFL_DP_1, AFL_DP_2, PrivateMechanism, client_private_statistics
from secure_afl.sim.report import privacy_verdict
from secure_afl.sim.setting import AFL_1, AFL_2, PhaseTimer, SettingResult, SimConfig

BASE = SimConfig(missing=(7,), rounds=2, fraction=0.05, dim=16, secure="mask", device="cpu")
ROUND1 = ["statistics", "undefined_balance", "privatize", "solve"]
ROUND2 = ["teacher", "round2_statistics", "privatize_round2", "refine"]


@pytest.fixture(scope="module")
def data():
    return prepare(None, fraction=BASE.fraction, dim=BASE.dim, seed=BASE.seed, n_clients=BASE.n_clients)


def _stats(data, config: SimConfig) -> dict[str, object]:
    if config.dp is not None:
        return {}
    from secure_afl.analytic import client_statistics

    return {
        f"client-{k}": client_statistics(data.features[r], data.cohort.labels[r], device="cpu").packed()
        for k, r in enumerate(data.split.clients)
    }


class Recording:
    """A real mechanism, every stage call recorded before it is delegated."""

    def __init__(self, inner: object, calls: list[str]) -> None:
        self.inner, self.calls = inner, calls

    def __getattr__(self, name: str) -> object:
        value = getattr(self.inner, name)
        if not callable(value):
            return value

        def call(*args: object, **kwargs: object) -> object:
            self.calls.append(name)
            return value(*args, **kwargs)

        return call


def _recorded(monkeypatch, data, config: SimConfig) -> tuple[list[str], SettingResult, SettingResult, type]:
    made = runner.mechanism_for
    calls: list[str] = []
    kinds: list[type] = []

    def recording(*args: object, **kwargs: object) -> Recording:
        inner = made(*args, **kwargs)
        kinds.append(type(inner))
        return Recording(inner, calls)

    monkeypatch.setattr(runner, "mechanism_for", recording)
    random = DeterministicRandomSource(b"\x05" * 32)
    result = runner.run_setting(data, _stats(data, config), 7, config, PhaseTimer(), random=random)
    monkeypatch.undo()
    plain = runner.run_setting(
        data, _stats(data, config), 7, config, PhaseTimer(), random=DeterministicRandomSource(b"\x05" * 32)
    )
    assert kinds and len(set(kinds)) == 1
    return calls, result, plain, kinds[0]


@pytest.mark.parametrize("dp", [None, DpConfig(epsilon=2.0)], ids=["paper", "private"])
def test_every_mechanism_walks_the_same_stages_in_the_same_order(monkeypatch, data, dp) -> None:
    config = replace(BASE, dp=dp, fedavg=replace(BASE.fedavg, rounds=1))
    calls, result, plain, kind = _recorded(monkeypatch, data, config)
    assert kind is (PaperMechanism if dp is None else PrivateMechanism)
    stages = [c for c in calls if c in ROUND1 + ROUND2]
    assert stages == ROUND1 + ROUND2
    # the recorder only watched: the setting's results are the unwatched run's, bit for bit
    assert list(result.metrics) == list(plain.metrics)
    for method in (AFL_1, AFL_2) if dp is None else (AFL_DP_1, AFL_DP_2):
        assert method in result.metrics
        np.testing.assert_array_equal(result.coefs[method], plain.coefs[method])
    assert (result.privacy is None) == (dp is None)


def test_a_private_masked_setting_records_the_clients_own_checks_like_every_other(data) -> None:
    config = replace(BASE, dp=DpConfig(epsilon=1.0))
    first = runner.run_setting(
        data, {}, 7, config, PhaseTimer(), random=DeterministicRandomSource(b"\x01" * 32)
    )
    again = runner.run_setting(
        data, {}, 7, config, PhaseTimer(), random=DeterministicRandomSource(b"\x01" * 32)
    )
    other = runner.run_setting(
        data, {}, 7, config, PhaseTimer(), random=DeterministicRandomSource(b"\x02" * 32)
    )
    # seeded noise: the same release twice, another with another seed
    np.testing.assert_array_equal(first.coefs[AFL_DP_2], again.coefs[AFL_DP_2])
    assert not np.array_equal(first.coefs[AFL_DP_2], other.coefs[AFL_DP_2])
    # at missing 7 every class group has one annotator: its own check sees its (noised) class sums
    assert set(first.audit.client_findings) == {f"client-{k}" for k in range(8)}
    assert list(first.method_audits) == [AFL_DP_2]
    assert "own exposure checks agree with this audit" in privacy_verdict(first)
    assert first.privacy is not None and set(first.privacy["epsilon_spent"]) == set(
        first.audit.client_findings
    )


def test_clipped_statistics_handed_in_are_used_not_made_again(monkeypatch, data) -> None:
    config = replace(BASE, rounds=1, secure="none", dp=DpConfig(epsilon=4.0))
    stats = client_private_statistics(data, config)
    made: list[int] = []
    original = private.client_private_statistics

    def counting(*args: object, **kwargs: object) -> object:
        made.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(private, "client_private_statistics", counting)
    seed = DeterministicRandomSource(b"\x03" * 32)
    given = runner.run_setting(data, stats, 7, config, PhaseTimer(), random=seed)
    assert made == []
    fresh = runner.run_setting(
        data, {}, 7, config, PhaseTimer(), random=DeterministicRandomSource(b"\x03" * 32)
    )
    assert made == [1]
    np.testing.assert_array_equal(given.coefs[AFL_DP_1], fresh.coefs[AFL_DP_1])
    assert given.privacy == fresh.privacy


def test_a_growing_study_walks_one_session_loop_with_either_growth() -> None:
    """The growing scenario's loop calls the same steps of the plain and the private growth."""
    import inspect

    from secure_afl.sim.growing import PlainGrowth
    from secure_afl.sim.private import PrivateGrowth

    for step in ("uploads", "solve", "reference"):
        plain, noisy = (
            inspect.signature(getattr(PlainGrowth, step)),
            inspect.signature(getattr(PrivateGrowth, step)),
        )
        assert list(plain.parameters) == list(noisy.parameters), step
    assert PlainGrowth.knows_idle_zeros and not PrivateGrowth.knows_idle_zeros
