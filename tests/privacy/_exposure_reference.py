"""The exhaustive colluder enumeration the exposure check ran before its bounded search, kept as
the tests' exact reference: every maximal choice of peer types within the budget, one elimination
each."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from secure_afl.privacy.exposure import determined

# --- colluders ------------------------------------------------------------------------------------

_SPAN_PRIME = (1 << 31) - 1  # products of two residues fit in int64
_SPAN_MAX_COLUMNS = 22  # Hadamard: every minor of a 0/1 matrix this wide is below the prime
_BATCH = 2048


def isolating_colluders(
    rows: Sequence[Collection[tuple[str, ...]]], target: tuple[str, ...], owner: str, budget: int
) -> tuple[str, ...] | None:
    """A set of at most ``budget`` peers whose values, known to the server, let the sums over
    ``rows`` determine ``target``; None when no such set exists.

    Variables are ``(client, ...)`` tuples; a colluding peer makes all its variables known, and
    known variables leave the sums, so ``target`` is determined iff its column is outside the span
    of the remaining unknowns' columns.  Exact: peers with identical columns form one type
    (colluding with only some of a type changes no span), types with more members than ``budget``
    are never all known, and every maximal choice of the other types within the budget is tested
    (exposure only grows with the colluders), in batches of exact eliminations modulo 2^31 - 1
    (above the Hadamard bound of every minor up to 22 columns; wider systems fall back to
    :func:`determined`).  Cost: one small elimination per maximal choice, at most C(types, budget)
    of them (bench/bench_exposure.py measures it).
    """
    if budget <= 0:
        return None
    columns: dict[tuple[str, ...], set[int]] = {}
    for i, row in enumerate(rows):
        for var in row:
            columns.setdefault(var, set()).add(i)
    if target not in columns:
        return None
    by_peer: dict[str, list[tuple[str, ...]]] = {}
    for var in columns:
        if var[0] != owner:
            by_peer.setdefault(var[0], []).append(var)
    types: dict[tuple, list[str]] = {}
    for client, variables in sorted(by_peer.items()):
        key = tuple(sorted((var[1:], tuple(sorted(columns[var]))) for var in variables))
        types.setdefault(key, []).append(client)
    removable = [clients for clients in types.values() if len(clients) <= budget]
    movable = {c for clients in removable for c in clients}
    fixed = [v for v in columns if v != target and v[0] not in movable]
    others = [v for v in columns if v[0] in movable]
    variables = [*fixed, *others, target]
    base = np.zeros((len(rows), len(variables)), dtype=np.int64)
    for j, var in enumerate(variables):
        base[sorted(columns[var]), j] = 1
    only_fixed = base.copy()
    only_fixed[:, len(fixed) : len(fixed) + len(others)] = 0
    if not _outside_span(only_fixed[None], rows, set(others), target)[0]:
        return None  # the values no colluder set can make known already hide the target
    choices = _maximal_choices([len(c) for c in removable], budget)
    position = {var: j for j, var in enumerate(variables)}
    for start in range(0, len(choices), _BATCH):
        batch_choices = choices[start : start + _BATCH]
        batch = np.repeat(base[None], len(batch_choices), axis=0)
        known_sets = []
        for b, choice in enumerate(batch_choices):
            known = {c for k in choice for c in removable[k]}
            gone = {var for var in others if var[0] in known}
            batch[b][:, [position[var] for var in gone]] = 0
            known_sets.append(gone)
        outside = _outside_span(batch, rows, known_sets, target)
        hits = np.flatnonzero(outside)
        if hits.size:
            return tuple(sorted(c for k in batch_choices[int(hits[0])] for c in removable[k]))
    return None


def _maximal_choices(sizes: Sequence[int], budget: int) -> list[tuple[int, ...]]:
    """Every set of type indices whose sizes sum to at most ``budget`` and to which no further
    type fits."""
    out: list[tuple[int, ...]] = []

    def extend(chosen: tuple[int, ...], next_at: int, left: int) -> None:
        for k in range(next_at, len(sizes)):
            if sizes[k] <= left:
                extend((*chosen, k), k + 1, left - sizes[k])
        if all(sizes[k] > left for k in range(len(sizes)) if k not in chosen):
            out.append(chosen)

    extend((), 0, budget)
    return out


def _outside_span(
    matrices: np.ndarray,
    rows: Sequence[Collection[tuple[str, ...]]],
    known: set | Sequence[set],
    target: tuple[str, ...],
) -> np.ndarray:
    """Per matrix of a batch (B, rows, columns): whether its last column is outside the span of the
    others, by row echelon elimination modulo 2^31 - 1 in column order.  ``rows``/``known`` (the
    variables zeroed in each matrix, or one set for all) serve the exact fallback for wide systems."""
    batch, n_rows, width = matrices.shape
    if min(n_rows, width) > _SPAN_MAX_COLUMNS:
        sets = [known] * batch if isinstance(known, set) else list(known)
        return np.array([target in determined([set(row) - gone for row in rows]) for gone in sets])
    m = matrices % _SPAN_PRIME
    rank = np.zeros(batch, dtype=np.int64)
    row_ids = np.arange(n_rows)
    for j in range(width - 1):
        candidates = (m[:, :, j] != 0) & (row_ids[None, :] >= rank[:, None])
        has = candidates.any(axis=1)
        if not has.any():
            continue
        b = np.flatnonzero(has)
        pivot = np.argmax(candidates[b], axis=1)
        r = rank[b]
        pivot_rows = m[b, pivot, :].copy()
        m[b, pivot, :] = m[b, r, :]
        m[b, r, :] = pivot_rows
        inverse = _inverse_mod(pivot_rows[:, j])
        pivot_rows = (pivot_rows * inverse[:, None]) % _SPAN_PRIME
        m[b, r, :] = pivot_rows
        below = (row_ids[None, :] > r[:, None]).astype(np.int64)
        factors = (m[b, :, j] * below) % _SPAN_PRIME
        m[b] = (m[b] - (factors[:, :, None] * pivot_rows[:, None, :]) % _SPAN_PRIME) % _SPAN_PRIME
        rank[b] += 1
    last = m[:, :, width - 1]
    return ((last != 0) & (row_ids[None, :] >= rank[:, None])).any(axis=1)


def _inverse_mod(values: np.ndarray) -> np.ndarray:
    result = np.ones_like(values)
    base = values % _SPAN_PRIME
    exponent = _SPAN_PRIME - 2
    while exponent:
        if exponent & 1:
            result = (result * base) % _SPAN_PRIME
        base = (base * base) % _SPAN_PRIME
        exponent >>= 1
    return result
