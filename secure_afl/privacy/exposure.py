"""What group sums reveal: the one rank test, used by clients, the session ledger and the audit.

A group's sum of a tensor is the sum of its survivors' values.  The tensor-identity rule of
:mod:`secure_afl.analytic` says a tensor name denotes one client value wherever it appears (``gram``
sent to two groups is the same ``G_k`` twice), so whoever sees several group sums of one tensor
learns every linear combination of them.  Client ``k``'s value is *determined* (exposed) exactly
when the unit vector ``e_k`` lies in the row space of the groups' survivor-incidence matrix.

The test is exact, never a floating-point rank: Gauss–Jordan elimination of the 0/1 incidence
matrix modulo a prime larger than the Hadamard bound of its minors, so every rank equals the one
over the rationals.  In reduced row echelon form ``e_k`` lies in the row space iff ``k`` is a pivot
column whose row has no other non-zero entry.

Who runs it:

- every client, before it signs the survivor set (R3) and before it reveals shares (R4), over the
  groups that carry its own tensors, the survivors it is shown and the sums of earlier sessions
  over the same input (:func:`client_exposures`; the session ledger keeps those sessions);
- the simulator's audit, over every group of a run (:func:`exposed_clients`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# (group, tensor) -> hex SHA-256 of the client's value: how a client tells its own values apart.
OwnValues = Mapping[tuple[str, str], str]

_VALUE_DOMAIN = b"secure-afl/v1/input-value\x00"


# Mersenne prime exponents: the elimination runs modulo the first 2^e - 1 above the Hadamard bound.
_MERSENNE_EXPONENTS = (521, 607, 1279, 2203, 2281, 3217, 4253, 4423, 9689, 9941, 11213, 19937, 21701, 23209)


def _exact_prime(n_variables: int) -> int:
    """A prime larger than every minor of any 0/1 matrix with ``n_variables`` columns.

    Hadamard: a k x k 0/1 matrix has |det| <= (k+1)^((k+1)/2) / 2^k.  Modulo a larger prime no
    non-zero minor vanishes, so ranks (and row-space membership) mod p equal those over the rationals.
    """
    k = max(n_variables, 1)
    bits = (k + 1) * math.log2(k + 1) / 2 - k + 2
    for exponent in _MERSENNE_EXPONENTS:
        if exponent > bits:
            return (1 << exponent) - 1
    raise ValueError(f"{n_variables} unknowns are more than the exact rank test supports")


def determined(rows: Iterable[Collection[Hashable]]) -> frozenset[Hashable]:
    """The variables whose value follows from the sums over ``rows``.

    Each row is the set of variables one published sum adds up (every coefficient 1).  A variable
    is determined iff its unit vector lies in the rows' span over the rationals.  Computed exactly:
    Gauss-Jordan elimination modulo a prime above the Hadamard bound of the 0/1 matrix (so no
    non-zero minor vanishes and every rank equals the rational one), stopping once the rows span
    every variable.
    """
    unique = {frozenset(row) for row in rows if row}
    order: dict[Hashable, int] = {}
    for row in sorted(unique, key=lambda r: (len(r), sorted(map(repr, r)))):
        for variable in sorted(row, key=repr):
            order.setdefault(variable, len(order))
    prime = _exact_prime(len(order))
    # basis: pivot -> row (sparse, pivot coefficient 1, zero in every other pivot column)
    basis: dict[int, dict[int, int]] = {}
    for row in sorted(unique, key=lambda r: sorted(order[v] for v in r)):
        if len(basis) == len(order):
            break  # full rank: every variable is determined
        vector = dict.fromkeys((order[v] for v in row), 1)
        for pivot, basis_row in basis.items():
            factor = vector.get(pivot)
            if factor:
                for column, value in basis_row.items():
                    updated = (vector.get(column, 0) - factor * value) % prime
                    if updated:
                        vector[column] = updated
                    else:
                        vector.pop(column, None)
        if not vector:
            continue  # a combination of earlier sums: nothing new
        pivot = min(vector)
        inverse = pow(vector[pivot], -1, prime)
        vector = {column: value * inverse % prime for column, value in vector.items()}
        for other in basis.values():  # keep every basis row reduced in the new pivot column
            factor = other.get(pivot)
            if factor:
                for column, value in vector.items():
                    updated = (other.get(column, 0) - factor * value) % prime
                    if updated:
                        other[column] = updated
                    else:
                        other.pop(column, None)
        basis[pivot] = vector
    names = {index: variable for variable, index in order.items()}
    if len(basis) == len(order):
        return frozenset(order)
    return frozenset(names[pivot] for pivot, row in basis.items() if len(row) == 1)


def exposed_clients(
    groups: Mapping[str, tuple[Sequence[str], Collection[str]]],
    *,
    distinct: Mapping[str, Collection[str]] | None = None,
) -> dict[str, tuple[str, ...]]:
    """Tensor -> the clients whose individual value the group sums determine (non-empty entries only).

    ``groups`` maps a group name to (its survivors, the tensor names it sums).  By the
    tensor-identity rule one client's tensor is one unknown across all groups; ``distinct`` names,
    per client, the tensors it sends with *different* values to different groups: each of those is
    then one unknown per group, and the client counts as exposed when any of them is determined.
    """
    distinct = distinct or {}
    by_tensor: dict[str, list[tuple[str, Sequence[str]]]] = {}
    for name, (survivors, tensors) in groups.items():
        for tensor in tensors:
            by_tensor.setdefault(tensor, []).append((name, survivors))
    out: dict[str, tuple[str, ...]] = {}
    for tensor in sorted(by_tensor):

        def variable(client: str, group: str, tensor: str = tensor) -> tuple[str, ...]:
            if tensor in distinct.get(client, ()):
                return (client, tensor, group)
            return (client, tensor)

        rows = [{variable(c, g) for c in survivors} for g, survivors in by_tensor[tensor]]
        found = sorted({var[0] for var in determined(rows)})
        if found:
            out[tensor] = tuple(found)
    return out


# --- the client's own check -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ExposureFinding:
    """One tensor whose value, for ``clients``, the sums determine; seen by a client in ``round``.

    ``colluders`` is empty when the sums alone determine it, else one set of at most c peers whose
    values, known to the server, complete it (the active model's colluder bound).
    """

    round: str
    tensor: str
    clients: tuple[str, ...]
    groups: tuple[str, ...]  # this session's groups whose sums take part
    with_history: bool = False  # kept for the audit's records; the ledger no longer adds sums
    colluders: tuple[str, ...] = ()

    def describe(self) -> str:
        where = ", ".join(repr(g) for g in self.groups) or "(none of this session's groups)"
        helped = f" once the values of {', '.join(self.colluders)} are known" if self.colluders else ""
        return (
            f"{self.round}: the sums of {where}{helped} determine the individual value of "
            f"{self.tensor!r} for {', '.join(self.clients)}"
        )


def value_digest(values: np.ndarray) -> str:
    """Hex SHA-256 of a float64 array's shape and bytes (how a client recognises its own values)."""
    array = np.ascontiguousarray(values, dtype=np.float64)
    digest = hashlib.sha256(_VALUE_DOMAIN)
    digest.update(repr(array.shape).encode())
    digest.update(array.astype("<f8", copy=False).reshape(-1))  # the buffer: the bytes tobytes() copies
    return digest.hexdigest()


def own_value_digests(inputs: Mapping[str, Mapping[str, np.ndarray]]) -> dict[tuple[str, str], str]:
    """(group, tensor) -> :func:`value_digest` of a client's inputs, each array object hashed once
    (the drivers pass one Gram object to every group that carries it)."""
    seen: dict[int, tuple[np.ndarray, str]] = {}  # id -> (the array, kept alive; its digest)
    out = {}
    for group, tensors in inputs.items():
        for name, values in tensors.items():
            entry = seen.get(id(values))
            if entry is None or entry[0] is not values:
                entry = (values, value_digest(values))
                seen[id(values)] = entry
            out[(group, name)] = entry[1]
    return out


def client_exposures(
    client_id: str,
    own_values: OwnValues,
    groups: Mapping[str, tuple[Collection[str], Collection[str]]],
    *,
    round_name: str,
    colluders: int = 0,
) -> tuple[ExposureFinding, ...]:
    """What a client sees before it shares keys (R1), signs (R3) or reveals (R4): the values its
    tensors' sums determine, with up to ``colluders`` peers' values known to the server.

    ``own_values``: (group, tensor) -> digest of this client's value there; the tensors it sends.
    ``groups``: this session's groups -> (survivors, tensors).  Unknowns: this client's own values
    (by digest, so a value it sends unchanged to several groups, *or under several names*, is one
    unknown, and different values are different unknowns); a peer's tensor is one unknown across
    groups (the tensor-identity rule).  Tensors that share one of this client's values are examined
    together.  With ``colluders = 0`` every client the sums determine is reported; with c > 0 this
    client's own values are tested against every set of at most c colluding peers as well (exact:
    :func:`isolating_colluders`); the peers test their own.
    """
    findings = []
    for component in _components(own_values):
        current = [
            (name, tuple(survivors), tensor)
            for tensor in component
            for name, (survivors, carried) in sorted(groups.items())
            if tensor in carried and survivors
        ]
        rows = _rows(client_id, current, own_values)
        label = " + ".join(component)
        alone = determined(rows)
        exposed = sorted({var[0] for var in alone})
        if exposed:
            findings.append(
                ExposureFinding(
                    round=round_name,
                    tensor=label,
                    clients=tuple(exposed),
                    groups=_involved(current, set(exposed)),
                )
            )
            continue
        if colluders <= 0:
            continue
        own = sorted({var for row in rows for var in row if var[0] == client_id})
        for target in own:
            witness = isolating_colluders(rows, target, client_id, colluders)
            if witness is not None:
                findings.append(
                    ExposureFinding(
                        round=round_name,
                        tensor=label,
                        clients=(client_id,),
                        groups=_involved(current, {client_id}),
                        colluders=witness,
                    )
                )
                break
    return tuple(findings)


def _components(own_values: OwnValues) -> list[tuple[str, ...]]:
    """This client's tensors, linked where it sends one value under several names."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    by_digest: dict[str, str] = {}
    for (_, tensor), digest in sorted(own_values.items()):
        find(tensor)
        if digest in by_digest:
            parent[find(tensor)] = find(by_digest[digest])
        else:
            by_digest[digest] = tensor
    out: dict[str, list[str]] = {}
    for tensor in sorted(parent):
        out.setdefault(find(tensor), []).append(tensor)
    return [tuple(v) for v in out.values()]


def _involved(current: Sequence[tuple[str, tuple[str, ...], str]], clients: set[str]) -> tuple[str, ...]:
    involved = tuple(dict.fromkeys(name for name, survivors, _ in current if set(survivors) & clients))
    return involved or tuple(dict.fromkeys(name for name, _, _ in current))


def _rows(
    client_id: str, groups: Sequence[tuple[str, Sequence[str], str]], own_values: OwnValues
) -> list[set[tuple[str, ...]]]:
    rows = []
    for group, survivors, tensor in groups:
        row = set()
        for cid in survivors:
            if cid == client_id:
                # This client's value in that group, by digest (a group it is in always has one).
                row.add((cid, own_values.get((group, tensor), f"unknown:{group}/{tensor}")))
            else:
                row.add((cid, tensor))
        rows.append(row)
    return rows


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
