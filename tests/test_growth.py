"""Accumulating sessions' sums (secure_afl/growth.py): the growing federation equals the centralised fit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secure_afl.analytic import AnalyticClassifier, client_statistics, sum_contributions
from secure_afl.growth import GrowthError, accumulate_sums, check_additive

D, C, GAMMA = 6, 3, 0.7


def _data(seed: int, n: int):
    rng = np.random.default_rng(seed)
    y = (rng.random((n, C)) < 0.35).astype(np.int8)
    y[:3] = 1  # every class has positives and negatives
    y[3:6] = 0
    h = rng.normal(size=(n, D)) + 1.5 * y @ rng.normal(size=(C, D))
    return h, y


def _centralised(h, y, labelled, gram):
    """The global-balance ridge fit on the pooled rows, by numpy: class c over the rows labelled for c."""
    w = np.empty((D, C))
    for c in range(C):
        rows = labelled[:, c]
        hc, yc = h[rows], y[rows, c].astype(bool)
        b = hc[yc].mean(axis=0) - hc[~yc].mean(axis=0)
        g = hc.T @ hc if gram == "class" else h.T @ h
        w[:, c] = np.linalg.solve(g + GAMMA * np.eye(D), b)
    return w


def _grow(h, y, client, session, active, gram):
    """Per session, each client's contributions over its rows of that session, summed, then accumulated.

    ``active[(k, s)]``: the classes client k labels in session s.
    """
    total = None
    fits = []
    for s in range(session.max() + 1):
        uploads = []
        for k in range(client.max() + 1):
            rows = (client == k) & (session == s)
            if not rows.any():
                continue  # a client with no new rows contributes nothing
            stats = client_statistics(h[rows], y[rows], device="cpu")
            uploads.append(stats.contributions(active[(k, s)], balance="global", gram=gram))
        total = accumulate_sums(total, sum_contributions(uploads))
        if all(f"class/{c}" in total for c in range(C)):  # else a class has no annotator yet
            fits.append(AnalyticClassifier(C, gamma=GAMMA, balance="global", gram=gram).fit(total).coef_)
        else:
            fits.append(None)
    return total, fits


def _labelled(client, session, active):
    mask = np.zeros((len(client), C), dtype=bool)
    for i, (k, s) in enumerate(zip(client, session, strict=True)):
        mask[i, list(active[(int(k), int(s))])] = True
    return mask


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), sessions=st.integers(1, 4), gram=st.sampled_from(["class", "global"]))
def test_any_partition_into_sessions_accumulates_to_the_centralised_fit(seed, sessions, gram):
    n, clients = 160, 4
    h, y = _data(seed, n)
    rng = np.random.default_rng(seed + 1)
    client = rng.integers(0, clients, n)
    session = rng.integers(0, sessions, n)
    session[:sessions] = np.arange(sessions)  # every session releases something
    # every client labels class k mod C always; the others may start (or stop) being labelled later
    active = {
        (k, s): sorted({k % C} | {c for c in range(C) if rng.random() < 0.5})
        for k in range(clients)
        for s in range(sessions)
    }
    labelled = _labelled(client, session, active)
    _, fits = _grow(h, y, client, session, active, gram)
    for s, coef in enumerate(fits):
        released = session <= s
        if coef is None or not all(np.unique(y[released & labelled[:, c], c]).size == 2 for c in range(C)):
            continue  # a class without a positive or a negative yet: Eq. 9's convention, tested elsewhere
        want = _centralised(h[released], y[released], labelled[released], gram)
        assert np.abs(coef - want).max() < 1e-9
        assert np.abs(coef - want).max() <= 1e-10 * np.abs(want).max()
    want = _centralised(h, y, labelled, gram)
    assert np.abs(fits[-1] - want).max() <= 1e-10 * np.abs(want).max()


def test_three_sessions_equal_the_union_and_one_session_alone_does_not():
    h, y = _data(3, 300)
    client = np.arange(300) % 3
    session = (np.arange(300) // 3) % 3
    active = {(k, s): [0, 1, 2] for k in range(3) for s in range(3)}
    labelled = np.ones((300, C), dtype=bool)
    total, fits = _grow(h, y, client, session, active, "global")
    want = _centralised(h, y, labelled, "global")
    assert np.abs(fits[-1] - want).max() <= 1e-10 * np.abs(want).max()
    last = session == 2
    alone = _centralised(h[last], y[last], labelled[last], "global")
    assert np.abs(alone - want).max() > 1e-4 * np.abs(want).max()  # the accumulation is what does it
    assert total["class/0"]["n"][0] == 300


def test_a_client_without_new_rows_and_a_class_first_labelled_later():
    h, y = _data(5, 240)
    client = np.arange(240) % 3
    session = np.where(np.arange(240) < 120, 0, 1)
    session[(client == 2) & (session == 1)] = 0  # client 2 has no new rows in session 1
    # class 2 is labelled by nobody in session 0, by client 1 from session 1 on
    active = {(0, 0): [0, 1], (1, 0): [0, 1], (2, 0): [0, 1], (0, 1): [0, 1], (1, 1): [0, 1, 2], (2, 1): [0]}
    labelled = _labelled(client, session, active)
    total, fits = _grow(h, y, client, session, active, "class")
    assert fits[0] is None  # after session 0, class 2 has no annotator
    assert "class/2" in total and total["class/2"]["n"][0] == labelled[:, 2].sum()
    want = _centralised(h, y, labelled, "class")
    assert np.abs(fits[-1] - want).max() <= 1e-10 * np.abs(want).max()


def _session(seed, *, balance="global", gram="global", dim=D, active=(0, 1, 2)):
    h, y = _data(seed, 50)
    h = h[:, :dim]
    stats = client_statistics(h, y, device="cpu")
    return stats.contributions(list(active), balance=balance, gram=gram)


def test_the_per_client_balance_is_refused_with_the_reason():
    with pytest.raises(GrowthError, match=r"per-client balanced projection.*re-weight.*balance='global'"):
        accumulate_sums(None, _session(1, balance="client"))
    earlier = accumulate_sums(None, _session(1))
    with pytest.raises(GrowthError, match="per-client"):
        accumulate_sums(earlier, _session(2, balance="client"))
    with pytest.raises(GrowthError, match="per-client"):
        check_additive({"class/0": ["gram", "b/0"]})
    check_additive({"class/0": ["gram", "pos_sum/0", "n_pos/0", "feat_sum", "n"], "all": ["gram"]})


def test_round_two_is_refused_and_dp_tensors_are_additive():
    with pytest.raises(GrowthError, match="round 2"):
        check_additive({"pseudo/1": ["b_pseudo/1"]})
    with pytest.raises(GrowthError, match="round 2"):  # DP's round 2 as well
        check_additive({"pseudo/1": ["pseudo_pos_sum/1"]})
    check_additive({"class/1": ["pos_sum/1", "neg_sum/1", "n_pos/1", "n_neg/1"], "all": ["gram"]})
    check_additive(
        {"class/1": ["wpos_sum/1", "wpos_n/1"], "all": ["gram", "total_sum", "n_total", "gram_min_eig"]}
    )
    with pytest.raises(GrowthError, match="not one of the additive"):
        check_additive({"class/1": ["mystery"]})


def test_mixed_layouts_and_dimensions_are_refused_and_nothing_is_changed():
    earlier = accumulate_sums(None, _session(1, gram="global"))
    before = {g: {t: v.copy() for t, v in ts.items()} for g, ts in earlier.items()}
    with pytest.raises(GrowthError, match="keeps its layout"):
        accumulate_sums(earlier, _session(2, gram="class"))
    per_class = _session(2, gram="class")
    per_class["all"] = {"gram": per_class["class/0"]["gram"]}  # the all group too: the class groups differ
    with pytest.raises(GrowthError, match=r"other tensors .*only new: \['gram'\]"):
        accumulate_sums(earlier, per_class)
    with pytest.raises(GrowthError, match="dimension 5"):
        accumulate_sums(earlier, _session(2, dim=5))
    only_new_class = _session(2, gram="class", active=(0,))
    only_new_class["class/5"] = only_new_class.pop("class/0")  # a class group unseen before, with a Gram
    only_new_class["all"] = {"gram": only_new_class["class/5"]["gram"]}
    with pytest.raises(GrowthError, match="disagree on the Gram"):
        accumulate_sums(earlier, only_new_class)
    no_all = _session(2)
    no_all.pop("all")  # the all-rows Gram of this session's rows is missing
    with pytest.raises(GrowthError, match="only the earlier sessions carry the 'all' group"):
        accumulate_sums(earlier, no_all)
    bad = _session(2)
    bad["class/0"]["n"] = np.array([np.nan])
    with pytest.raises(GrowthError, match="not finite"):
        accumulate_sums(earlier, bad)
    with pytest.raises(GrowthError, match="no sums"):
        accumulate_sums(earlier, {})
    for group, tensors in before.items():  # the earlier sums are untouched by every refusal
        for name, value in tensors.items():
            assert np.array_equal(earlier[group][name], value)
    new = _session(2)
    out = accumulate_sums(earlier, new)
    assert out["all"]["gram"] is not earlier["all"]["gram"]
    assert np.allclose(out["all"]["gram"], before["all"]["gram"] + new["all"]["gram"], rtol=1e-15)
    assert np.array_equal(earlier["all"]["gram"], before["all"]["gram"])
