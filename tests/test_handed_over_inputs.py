"""Inputs handed over to the masked aggregation go once sent, and change nothing.

The simulator's clients and server share one process: at d = 4096 the clients' Grams (64 MiB each)
and the server's sums would otherwise all coexist.  A masking client lets its values go after R2,
the in-process driver keeps none once the sessions hold theirs, and a caller that hands its
contributions over (``consume=True``) keeps none either; the audit reads a view of them taken
before.  A session or driver that kept a reference would fail the freed checks here; a view that
lost a value's identity, or a run that consumed what it should not, would fail the equalities.
"""

from __future__ import annotations

import gc
import weakref
from types import MappingProxyType

import numpy as np
import pytest

from secure_afl.aggregation.backend import MaskingBackend
from secure_afl.aggregation.inprocess import run_in_process
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.sim.audit import audit_groups, audit_view
from secure_afl.sim.fedavg import FedAvgConfig
from secure_afl.sim.runner import run_experiment
from secure_afl.sim.secure import secure_aggregate
from secure_afl.sim.setting import SimConfig
from secure_afl.statistics import client_statistics

ACTIVE = {"c0": [0, 1], "c1": [1, 2], "c2": [0, 2]}


def _contributions(seed: int = 7, d: int = 12) -> dict[str, dict[str, dict[str, np.ndarray]]]:
    """Three clients' round-1 uploads, each Gram its read-only packed triangle in several groups."""
    rng = np.random.default_rng(seed)
    out = {}
    for cid, active in ACTIVE.items():
        features = rng.standard_normal((40, d))
        labels = (rng.random((40, 3)) < 0.4).astype(np.int8)
        stats = client_statistics(features, labels, device="cpu").packed()
        mine = stats.contributions(active, include_global_gram=True)
        for group, tensors in stats.contributions(active, balance="global").items():
            mine[group].update(tensors)
        out[cid] = mine
    return out


def _grams(contributions: dict[str, dict[str, dict[str, np.ndarray]]]) -> list[weakref.ref]:
    grams = {
        id(t["gram"]): t["gram"] for groups in contributions.values() for t in groups.values() if "gram" in t
    }
    return [weakref.ref(g) for g in grams.values()]


def test_handed_over_contributions_are_freed_and_give_the_same_sums_and_audit() -> None:
    kept = secure_aggregate(_contributions(), unpack=False)
    given = _contributions()
    grams = _grams(given)
    assert len(grams) == 3 and all(ref() is not None for ref in grams)
    result = secure_aggregate(given, unpack=False, consume=True)
    gc.collect()
    assert given == {}  # handed over: the caller's mapping is emptied
    assert all(ref() is None for ref in grams), "a client's Gram outlived its session's R2"
    assert result.sums.keys() == kept.sums.keys()
    for group, tensors in kept.sums.items():
        assert tensors.keys() == result.sums[group].keys()
        for name, values in tensors.items():
            assert np.array_equal(values, result.sums[group][name]), (group, name)  # exact sums mod 2⁶⁴
    assert result.audit.exposed == kept.audit.exposed
    assert result.audit.groups == kept.audit.groups


def test_without_handing_over_the_caller_keeps_its_inputs() -> None:
    given = _contributions()
    grams = _grams(given)
    secure_aggregate(given, unpack=False)
    gc.collect()
    assert set(given) == set(ACTIVE) and all(ref() is not None for ref in grams)


def test_the_masking_client_lets_its_values_go_after_r2() -> None:
    given = _contributions()
    grams = _grams(given)
    run = run_in_process(
        MaskingBackend(threshold=2, client_policy=ClientPolicy.simulator()), given, consume=True
    )
    gc.collect()
    assert all(ref() is None for ref in grams)  # while every client session is still alive
    assert set(run.clients) == set(ACTIVE)
    for client in run.clients.values():
        assert client.state.name == "DONE"
        assert client.groups and set(client.groups) <= set(run.layout.groups)  # the names stay


def test_consume_refuses_a_mapping_it_cannot_empty() -> None:
    given = _contributions()
    frozen = MappingProxyType(given)
    with pytest.raises(TypeError, match="pass a dict"):
        run_in_process(
            MaskingBackend(threshold=2, client_policy=ClientPolicy.simulator()), frozen, consume=True
        )
    assert set(given) == set(ACTIVE)  # nothing taken


def test_the_audit_of_a_view_is_the_audit_of_the_values() -> None:
    shared = np.arange(6.0)
    equal = np.arange(6.0)  # another object, the same values
    other = np.arange(6.0) + 1
    nan = np.array([np.nan, 1.0])
    contributions = {
        "a": {
            "g1": {"x": shared, "y": nan},
            "g2": {"x": shared, "y": nan},
            "g3": {"x": equal},
        },  # one value each
        "b": {
            "g1": {"x": shared, "y": nan},
            "g2": {"x": other, "y": np.array([np.nan, 1.0])},
        },  # two values each
        "c": {"g2": {"x": other}, "g3": {"x": other}},
    }
    members = {"g1": ("a", "b"), "g2": ("a", "b", "c"), "g3": ("a", "c")}
    tensors = {"g1": ("x", "y"), "g2": ("x", "y"), "g3": ("x",)}
    direct = audit_groups(
        protection="mask", members=members, survivors=members, tensors=tensors, contributions=contributions
    )
    view = audit_view(contributions)
    viewed = audit_groups(
        protection="mask", members=members, survivors=members, tensors=tensors, contributions=view
    )
    assert viewed == direct
    # The view holds none of the arrays: one word per value, equal tokens where the values are one.
    assert all(v.size == 1 for groups in view.values() for t in groups.values() for v in t.values())
    assert view["a"]["g1"]["x"] is view["a"]["g2"]["x"] is view["a"]["g3"]["x"]
    assert not np.array_equal(view["b"]["g1"]["x"], view["b"]["g2"]["x"])
    assert not np.array_equal(view["b"]["g1"]["y"], view["b"]["g2"]["y"])  # NaN: equal only to itself


def test_the_last_setting_that_takes_the_statistics_over_gives_what_an_earlier_one_gives() -> None:
    small = {"fraction": 0.05, "dim": 32, "fedavg": FedAvgConfig(rounds=1), "device": "cpu", "secure": "mask"}
    last = {s.missing: s for s in run_experiment(SimConfig(**{**small, "missing": (1, 7)})).settings}  # type: ignore[arg-type]
    first = {s.missing: s for s in run_experiment(SimConfig(**{**small, "missing": (7, 1)})).settings}  # type: ignore[arg-type]
    for missing in (1, 7):  # 7 is handed over in the first run, 1 in the second
        a, b = last[missing], first[missing]
        assert a.coefs.keys() == b.coefs.keys()
        for method, coef in a.coefs.items():
            assert np.array_equal(coef, b.coefs[method]), (missing, method)
        assert a.metrics.keys() == b.metrics.keys()
        for method, metrics in a.metrics.items():
            for field in ("bacc", "auc", "ap", "prevalence"):
                assert np.array_equal(
                    getattr(metrics, field), getattr(b.metrics[method], field), equal_nan=True
                )
        assert a.audit == b.audit
        assert a.method_audits == b.method_audits
        assert a.upload_bytes == b.upload_bytes
