"""The colluder search at scale: the line bound is sound (never above the true minimum
cut, on random layouts by brute force over every flat), and the per-class Gram layouts at
n = 100 and n = 1,000 are decided within the work bound, agreeing with independent checks."""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secure_afl.privacy import exposure
from secure_afl.privacy.exposure import client_exposures, determined, isolating_colluders

from .test_exposure_colluders import _class_gram_layout, _gram_rows

# --- an exact rank test of its own (rationals), independent of the search's residues mod p ---------


def _rank(vectors: list[tuple[int, ...]]) -> int:
    rows = [[Fraction(x) for x in v] for v in vectors]
    rank = 0
    width = len(rows[0]) if rows else 0
    for col in range(width):
        pivot = next((r for r in range(rank, len(rows)) if rows[r][col] != 0), None)
        if pivot is None:
            continue
        rows[rank], rows[pivot] = rows[pivot], rows[rank]
        for r in range(len(rows)):
            if r != rank and rows[r][col] != 0:
                factor = rows[r][col] / rows[rank][col]
                rows[r] = [a - factor * b for a, b in zip(rows[r], rows[rank], strict=True)]
        rank += 1
    return rank


def _in_span(vector: tuple[int, ...], basis: list[tuple[int, ...]]) -> bool:
    return _rank([*basis, vector]) == _rank(basis)


def _vec(array: np.ndarray) -> tuple[int, ...]:
    return tuple(int(x) for x in array)


def _flats(problem, included: list[int]) -> set[frozenset[int]]:
    """The columns inside each flat span(owner's other columns + included + S) that avoids a_t, S
    any set of columns: by brute force, with ranks over the rationals."""
    columns = [_vec(c) for c in problem.columns]
    base = [_vec(b) for b in problem.base] + [columns[j] for j in included]
    target = _vec(problem.target)
    out = set()
    for size in range(len(columns) + 1):
        for chosen in itertools.combinations(range(len(columns)), size):
            flat = base + [columns[j] for j in chosen]
            rank = _rank(flat) if flat else 0
            if _rank([*flat, target]) == rank:
                continue  # a_t inside
            out.add(frozenset(j for j, c in enumerate(columns) if _rank([*flat, c]) == rank))
    return out


def _hits(problem, flats: set[frozenset[int]], outside: set[int]) -> list[int]:
    """Peers hit by each flat that leaves every column of ``outside`` outside."""
    return [
        sum(
            len(peers)
            for cols, peers in zip(problem.type_columns, problem.type_peers, strict=True)
            if not all(int(j) in inside for j in cols)
        )
        for inside in flats
        if not inside & outside
    ]


@st.composite
def small_problems(draw):
    """Random columns over a few rows: peers with one or two variables, the owner with one or two."""
    n_rows = draw(st.integers(2, 5))
    column = st.lists(st.booleans(), min_size=n_rows, max_size=n_rows)
    variables = {("c0", "t"): draw(column)}
    if draw(st.booleans()):
        variables[("c0", "u")] = draw(column)
    for k in range(draw(st.integers(1, 7))):
        variables[(f"p{k}", "x")] = draw(column)
        if draw(st.integers(0, 3)) == 0:
            variables[(f"p{k}", "y")] = draw(column)
    rows = [{v for v, col in variables.items() if col[i]} for i in range(n_rows)]
    problem = exposure._CutProblem.build(rows, ("c0", "t"), "c0")
    if problem is None or not 0 < len(problem.columns) <= 7:
        return None
    picks = st.lists(st.integers(0, len(problem.columns) - 1), max_size=2, unique=True)
    return problem, draw(picks), draw(picks)


@settings(max_examples=100, deadline=None)
@given(small_problems())
def test_the_line_bound_never_exceeds_the_true_minimum_cut(drawn) -> None:
    if drawn is None:
        return
    problem, included, excluded = drawn
    excluded = [j for j in excluded if j not in included]
    flat = exposure._Flat.root(problem)
    for j in included:
        if flat.residues[j].any():
            flat = flat._with(flat.residues[j].copy())
    flats = _flats(problem, included)
    hits = _hits(problem, flats, set(excluded))
    if not flat.target.any():
        assert not flats  # the included columns span a_t: no flat below
        return
    weight, scale = problem.column_weights()
    mask = np.zeros(len(problem.columns), dtype=bool)
    mask[excluded] = True
    bound, forced, blocked, gain = exposure._line_bound(
        problem.prime, flat.residues, flat.target, mask, weight
    )
    # the exact big-residue path (more than 22 rows) groups by tuples: the same answer
    wide = exposure._line_bound(
        problem.prime, flat.residues.astype(object), flat.target.astype(object), mask, weight
    )
    assert wide[0] == bound
    assert all((a == b).all() for a, b in zip(wide[1:], (forced, blocked, gain), strict=True))
    if hits:
        assert Fraction(bound, scale) <= min(hits)
    # forced and blocked columns lie outside every flat below (so they are never branched on)
    below = [inside for inside in flats if not inside & set(excluded)]
    for j in np.flatnonzero(forced | blocked):
        assert all(int(j) not in inside for inside in below)
    # the exclusion gain is sound too: with j outside as well, every flat below hits at least
    # bound + gain (what lets the search include j without a branch when that exceeds the budget)
    for j in np.flatnonzero(gain):
        with_j_out = _hits(problem, flats, {*excluded, int(j)})
        if with_j_out:
            assert Fraction(bound + int(gain[j]), scale) <= min(with_j_out)


def _plain_search(problem, budget: int) -> bool:
    """Whether some flat avoiding a_t hits at most ``budget`` peers: every flat, by include/exclude
    decisions in a fixed order, a branch cut only when the peers with a forced or excluded column
    exceed the budget (the search's rule before the line bound), no work bound."""
    weights = np.array([len(peers) for peers in problem.type_peers], dtype=np.int64)
    owner = np.zeros((len(problem.columns), len(weights)), dtype=bool)
    for t, cols in enumerate(problem.type_columns):
        owner[cols, t] = True

    def hit(columns: np.ndarray) -> int:
        return int(weights[owner[columns].any(axis=0)].sum())

    p = problem.prime
    stack = [(exposure._Flat.root(problem), 0, np.zeros(len(problem.columns), dtype=bool))]
    while stack:
        flat, at, excluded = stack.pop()
        residues, target = flat.residues, flat.target
        outside = residues.any(axis=1)
        pivot = int(np.flatnonzero(target)[0])
        along = (residues[:, pivot] * pow(int(target[pivot]), -1, p)) % p
        forced = ((along[:, None] * target[None, :]) % p == residues).all(axis=1) & outside
        if hit(forced | excluded) > budget:
            continue
        if hit(outside) <= budget:
            return True
        rest = np.flatnonzero((outside & ~forced & ~excluded)[at:])
        if not rest.size:
            continue
        j = at + int(rest[0])
        without = excluded.copy()
        without[j] = True
        stack.append((flat, j + 1, without))
        stack.append((flat._with(residues[j].copy()), j + 1, excluded))
    return False


def _verdict(n: int, missing: int, seed: int, budget: int):
    _, groups = _class_gram_layout(n, 8, 8 - missing, seed=seed)
    rows = _gram_rows(groups, "c0000")
    return rows, isolating_colluders(rows, ("c0000", "G"), "c0000", budget)  # never the limit error


@pytest.mark.parametrize(("missing", "seed"), [(1, 2), (3, 2), (3, 9), (5, 5), (7, 2)])
def test_per_class_layouts_at_100_agree_with_the_plain_search(missing: int, seed: int) -> None:
    """Exposed but (3, 9): safe, the plain search's proof costing it about 14,000 nodes."""
    rows, witness = _verdict(100, missing, seed=seed, budget=33)
    problem = exposure._CutProblem.build(rows, ("c0000", "G"), "c0000")
    assert (witness is not None) == _plain_search(problem, 33)
    if witness is not None:
        assert len(witness) <= 33 and "c0000" not in witness
        assert ("c0000", "G") in determined([{v for v in row if v[0] not in witness} for row in rows])


def test_per_class_layouts_at_100_have_both_verdicts() -> None:
    assert _verdict(100, 3, seed=2, budget=33)[1] is not None  # exposed
    assert _verdict(100, 5, seed=2, budget=33)[1] is None  # safe
    assert _verdict(100, 3, seed=9, budget=33)[1] is None  # safe


@pytest.mark.parametrize(("missing", "seed", "smallest"), [(3, 1, 367), (5, 1, 366), (3, 2, 332)])
def test_per_class_layouts_at_1000_are_decided(missing: int, seed: int, smallest: int) -> None:
    """At c = 333: missing 3 and 5 (seed 1) safe, missing 3 (seed 2) exposed by 332 peers.  The
    smallest exposing colluder set is found exactly: none below it (the search's proof), one of it
    (a witness the rank test confirms)."""
    rows, witness = _verdict(1000, missing, seed, budget=333)
    assert (witness is None) == (smallest > 333)
    below = isolating_colluders(rows, ("c0000", "G"), "c0000", smallest - 1)
    at = isolating_colluders(rows, ("c0000", "G"), "c0000", smallest)
    assert below is None and at is not None and len(at) == smallest
    assert ("c0000", "G") in determined([{v for v in row if v[0] not in at} for row in rows])
    assert ("c0000", "G") not in determined([{v for v in row if v[0] not in at[1:]} for row in rows])


def test_the_client_check_at_1000_is_decided() -> None:
    labels, groups = _class_gram_layout(1000, 8, 5, seed=1)  # missing 3: safe at c = 333
    me = "c0000"
    own = {(f"class/{c}", "gram"): "G" for c in labels[me]}
    assert client_exposures(me, own, groups, round_name="R3", colluders=333) == ()
    labels, groups = _class_gram_layout(1000, 8, 7, seed=1)  # missing 1: exposed
    own = {(f"class/{c}", "gram"): "G" for c in labels[me]}
    (finding,) = client_exposures(me, own, groups, round_name="R3", colluders=333)
    assert not finding.undecided and 0 < len(finding.colluders) <= 333


def test_determined_merges_identical_columns() -> None:
    rows = [{"a", "b", "x"}, {"a", "b"}, {"y", "x"}, {"y"}]
    # a and b share every row: neither is determined; x = row0 - row1, y = row3
    assert determined(rows) == frozenset({"x", "y"})
    assert determined([{"a"}, {"a", "b"}]) == frozenset({"a", "b"})
    assert determined([{"a", "b"}]) == frozenset()
