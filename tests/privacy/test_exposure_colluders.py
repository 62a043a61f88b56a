"""The colluder search: exact where it ends, never accepting what the old exhaustive
enumeration refuses, bounded, and one search per membership pattern."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secure_afl.privacy import exposure
from secure_afl.privacy.exposure import (
    ColluderSearchLimitError,
    client_exposures,
    determined,
    isolating_colluders,
)

from ._exposure_reference import isolating_colluders as old_isolating_colluders


def _brute_force(rows, target, owner, budget) -> bool:
    """Whether some set of at most ``budget`` peers isolates ``target``: every subset, by the rank test."""
    peers = sorted({v[0] for row in rows for v in row if v[0] != owner})
    for size in range(budget + 1):
        for known in itertools.combinations(peers, size):
            if target in determined([{v for v in row if v[0] not in known} for row in rows]):
                return True
    return False


@st.composite
def layouts(draw):
    """Rows over a few peers and an owner c0, some peers with a second variable (per-group values)."""
    n_peers = draw(st.integers(1, 6))
    peers = [f"p{i}" for i in range(n_peers)]
    n_rows = draw(st.integers(1, 6))
    split = set(draw(st.lists(st.sampled_from(peers), max_size=2)))  # peers with two variables
    own_split = draw(st.booleans())  # the owner sends two values (two own variables)
    rows = []
    for r in range(n_rows):
        members = draw(st.lists(st.sampled_from(peers), max_size=n_peers, unique=True))
        row = {(p, "x", str(r % 2)) if p in split else (p, "x") for p in members}
        if draw(st.booleans()) or r == 0:
            row.add(("c0", f"v{r % 2}" if own_split else "v0"))
        rows.append(row)
    budget = draw(st.integers(1, 4))
    return rows, budget


def _witness_isolates(rows, target, witness) -> bool:
    return target in determined([{v for v in row if v[0] not in set(witness)} for row in rows])


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_the_search_agrees_with_the_exhaustive_enumeration(layout) -> None:
    rows, budget = layout
    targets = sorted({v for row in rows for v in row if v[0] == "c0"})
    for target in targets:
        new = isolating_colluders(rows, target, "c0", budget)
        old = old_isolating_colluders(rows, target, "c0", budget)
        assert (new is None) == (old is None) == (not _brute_force(rows, target, "c0", budget))
        if new is not None:
            assert len(new) <= budget and "c0" not in new
            assert _witness_isolates(rows, target, new)


@settings(max_examples=200, deadline=None)
@given(layouts(), st.integers(1, 3))
def test_at_the_bound_it_never_accepts_what_the_enumeration_refuses(layout, limit) -> None:
    rows, budget = layout
    for target in sorted({v for row in rows for v in row if v[0] == "c0"}):
        exact = _brute_force(rows, target, "c0", budget)
        try:
            new = isolating_colluders(rows, target, "c0", budget, limit=limit)
        except ColluderSearchLimitError as error:
            assert error.limit == limit and error.budget == budget
            continue  # refused: always sound
        if new is None:
            assert not exact  # accepted (by the search or the packing rule): truly safe
        else:
            assert _witness_isolates(rows, target, new)


def _class_gram_layout(n: int, n_classes: int, kept: int, seed: int):
    """The per-class Gram layout: client k labels ``kept`` random classes; one Gram in every group."""
    rng = np.random.default_rng(seed)
    labels = {f"c{k:04d}": sorted(rng.choice(n_classes, size=kept, replace=False).tolist()) for k in range(n)}
    groups = {
        f"class/{c}": (tuple(cid for cid, ls in labels.items() if c in ls), ("gram", f"b/{c}"))
        for c in range(n_classes)
    }
    return labels, groups


def _gram_rows(groups, me):
    return [
        {(cid, "G") if cid == me else (cid, "gram") for cid in survivors} for survivors, _ in groups.values()
    ]


def test_per_class_layout_at_scale_names_a_checked_witness() -> None:
    labels, groups = _class_gram_layout(200, 8, 7, seed=1)  # missing 1 of 8
    me = "c0000"
    own = {(f"class/{c}", "gram"): "G" for c in labels[me]}
    own |= {(f"class/{c}", f"b/{c}"): f"b{c}" for c in labels[me]}
    budget = 200 - (2 * 200 // 3 + 1)
    findings = client_exposures(me, own, groups, round_name="R3", colluders=budget)
    (gram,) = [f for f in findings if f.tensor == "gram"]
    assert not gram.undecided and 0 < len(gram.colluders) <= budget
    assert _witness_isolates(_gram_rows(groups, me), (me, "G"), gram.colluders)
    # the peers labelling my classes but one: fewer than them cannot isolate (they are one type)
    assert not _witness_isolates(_gram_rows(groups, me), (me, "G"), gram.colluders[1:])
    # each class's b: its group's other members are more than the budget
    assert [f.tensor for f in findings] == ["gram"]


def test_global_gram_layout_at_scale_is_proven_safe() -> None:
    members = tuple(f"c{k:04d}" for k in range(1000))
    groups = {"all": (members, ("gram",))}
    own = {("all", "gram"): "G"}
    assert client_exposures("c0000", own, groups, round_name="R3", colluders=333) == ()
    assert isolating_colluders(_gram_rows(groups, "c0000"), ("c0000", "G"), "c0000", 998) is None
    assert isolating_colluders(_gram_rows(groups, "c0000"), ("c0000", "G"), "c0000", 999) is not None


def test_an_undecided_layout_is_refused_at_the_gate(monkeypatch) -> None:
    from secure_afl.core.errors import ExposureCheckLimitError, ExposureRefusedError
    from secure_afl.core.randomness import DeterministicRandomSource
    from secure_afl.keys.identity import IdentityKey
    from secure_afl.privacy.policy import ClientPolicy
    from secure_afl.protocol.exposure_gate import ExposureGate

    labels, groups = _class_gram_layout(200, 8, 5, seed=1)  # missing 3 of 8: safe, by the full search
    # with a search bound of one node, neither the greedy witness nor the packing decides it
    monkeypatch.setattr(exposure.isolating_colluders, "__kwdefaults__", {"limit": 1})
    me = "c0000"
    gram = np.arange(16.0)
    inputs = {f"class/{c}": {"gram": gram} for c in labels[me]}
    gate = ExposureGate(
        me,
        IdentityKey.generate(DeterministicRandomSource(b"g")),
        inputs,
        ClientPolicy.deployment(),
        None,
        None,
    )
    live = {name: (survivors, ("gram",)) for name, (survivors, _) in groups.items()}
    with pytest.raises(ExposureCheckLimitError, match="work bound") as caught:
        gate.check("R3", "sign the survivor set", live, session_id=b"s" * 32, colluders=66)
    assert isinstance(caught.value, ExposureRefusedError)
    assert caught.value.findings and all(f.undecided for f in caught.value.findings)
    # with the default bound the same layout is decided: safe, so the check passes
    monkeypatch.setattr(
        exposure.isolating_colluders, "__kwdefaults__", {"limit": exposure.COLLUDER_SEARCH_LIMIT}
    )
    assert gate.check("R3", "sign the survivor set", live, session_id=b"t" * 32, colluders=66) == ()


@pytest.mark.parametrize("seed", range(6))
def test_a_tiny_bound_refuses_or_decides_soundly(seed: int) -> None:
    labels, groups = _class_gram_layout(16, 6, 3, seed=seed)
    me, budget = "c0000", 4
    rows = _gram_rows(groups, me)
    exact = old_isolating_colluders(rows, (me, "G"), me, budget) is not None
    own = {(f"class/{c}", "gram"): "G" for c in labels[me]}
    for limit in (1, 3, 10**6):
        try:
            found = isolating_colluders(rows, (me, "G"), me, budget, limit=limit)
        except ColluderSearchLimitError:
            assert limit < 10**6  # only a small bound leaves it undecided here
            continue
        assert (found is not None) == exact
    findings = client_exposures(me, own, groups, round_name="R3", colluders=budget)
    assert bool(findings) == exact


def test_one_search_per_membership_pattern(monkeypatch) -> None:
    groups = {f"class/{c}": (("a", "b", "c", "d"), ("feat_sum", "n")) for c in range(3)}
    own = {(g, t): f"{t}-value" for g in groups for t in ("feat_sum", "n")}
    calls = []
    real = exposure._colluder_verdict

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(exposure, "_colluder_verdict", counting)
    assert client_exposures("a", own, groups, round_name="R1", colluders=1) == ()
    assert len(calls) == 1
    found = client_exposures("a", own, groups, round_name="R1", colluders=3)
    assert len(calls) == 2 and {f.tensor for f in found} == {"feat_sum", "n"}
    assert all(f.colluders == ("b", "c", "d") for f in found)


def test_limit_error_names_the_target() -> None:
    error = ColluderSearchLimitError(("c0", "v"), 3, 10)
    assert "up to 3 colluders" in str(error) and "10 column steps" in str(error)
    with pytest.raises(ColluderSearchLimitError):
        raise error
