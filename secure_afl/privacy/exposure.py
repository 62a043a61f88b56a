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
_INPUT_DOMAIN = b"secure-afl/v1/input\x00"


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
class GroupRecord:
    """One group of one session: who survived and which tensors it summed (what the server learned)."""

    name: str
    survivors: tuple[str, ...]
    tensors: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """What one session revealed, as a client saw it: the groups that carry its tensors, their
    survivors, and (per group and tensor) a digest of the value this client sent there."""

    session_id: bytes
    groups: tuple[GroupRecord, ...]
    own_values: tuple[tuple[str, str, str], ...]  # (group, tensor, hex SHA-256 of the value)


@dataclass(frozen=True, slots=True)
class ExposureFinding:
    """One tensor whose value, for ``clients``, the sums determine; seen by a client in ``round``."""

    round: str
    tensor: str
    clients: tuple[str, ...]
    groups: tuple[str, ...]  # this session's groups whose sums take part
    with_history: bool  # True when only the sums of earlier sessions (the ledger) complete it

    def describe(self) -> str:
        where = ", ".join(repr(g) for g in self.groups) or "(none of this session's groups)"
        history = " together with earlier sessions over the same input" if self.with_history else ""
        return (
            f"{self.round}: the sums of {where}{history} determine the individual value of "
            f"{self.tensor!r} for {', '.join(self.clients)}"
        )


def value_digest(values: np.ndarray) -> str:
    """Hex SHA-256 of a float64 array's shape and bytes (how a client recognises its own values)."""
    array = np.ascontiguousarray(values, dtype=np.float64)
    digest = hashlib.sha256(_VALUE_DOMAIN)
    digest.update(repr(array.shape).encode())
    digest.update(array.astype("<f8", copy=False).tobytes())
    return digest.hexdigest()


def input_digest(inputs: Mapping[str, Mapping[str, np.ndarray]]) -> bytes:
    """SHA-256 of a client's whole input (group -> tensor -> array): the key of its ledger history.

    Take it over the statistics *before* any randomisation (DP noise), so that two sessions over
    the same data share one history.
    """
    digest = hashlib.sha256(_INPUT_DOMAIN)
    for group in sorted(inputs):
        for tensor in sorted(inputs[group]):
            for part in (group, tensor, value_digest(inputs[group][tensor])):
                raw = part.encode("utf-8")
                digest.update(len(raw).to_bytes(4, "big") + raw)
    return digest.digest()


def client_exposures(
    client_id: str,
    own_values: OwnValues,
    groups: Mapping[str, tuple[Collection[str], Collection[str]]],
    *,
    round_name: str,
    history: Sequence[SessionRecord] = (),
) -> tuple[ExposureFinding, ...]:
    """What a client sees before it signs (R3) or reveals (R4): every value its tensors' sums determine.

    ``own_values``: (group, tensor) -> digest of this client's value there; the tensors it sends.
    ``groups``: this session's groups -> (survivors, tensors).  ``history``: earlier sessions over
    the same input.  Unknowns: this client's own values (by digest, so a value it sends unchanged
    to several groups is one unknown, and different values are different unknowns); a peer's tensor
    is one unknown across groups and sessions (the tensor-identity rule, and the conservative
    assumption that a peer's input did not change between sessions over this client's input).
    Only tensors this client sends are examined: the others' members check them.
    """
    tensors = sorted({tensor for _, tensor in own_values})
    findings = []
    for tensor in tensors:
        current = [
            (name, tuple(survivors))
            for name, (survivors, carried) in sorted(groups.items())
            if tensor in carried and survivors
        ]
        now = _rows(client_id, tensor, current, own_values)
        past = [
            row
            for record in history
            for row in _rows(
                client_id,
                tensor,
                [(g.name, g.survivors) for g in record.groups if tensor in g.tensors and g.survivors],
                {(g, t): d for g, t, d in record.own_values},
            )
        ]
        alone = {var[0] for var in determined(now)}
        combined = {var[0] for var in determined(now + past)} if past else alone
        for clients, with_history in ((alone, False), (combined - alone, True)):
            if not clients:
                continue
            involved = tuple(name for name, survivors in current if set(survivors) & clients)
            findings.append(
                ExposureFinding(
                    round=round_name,
                    tensor=tensor,
                    clients=tuple(sorted(clients)),
                    groups=involved or tuple(name for name, _ in current),
                    with_history=with_history,
                )
            )
    return tuple(findings)


def _rows(
    client_id: str, tensor: str, groups: Sequence[tuple[str, Sequence[str]]], own_values: OwnValues
) -> list[set[tuple[str, ...]]]:
    rows = []
    for group, survivors in groups:
        row = set()
        for cid in survivors:
            if cid == client_id:
                # This client's value in that group (a group it is in always has a digest).
                row.add((cid, tensor, own_values.get((group, tensor), f"unknown:{group}")))
            else:
                row.add((cid, tensor))
        rows.append(row)
    return rows
