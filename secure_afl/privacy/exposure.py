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

**Server-parameterised values (the adversarial rule).**  Round 2's tensors (``b_pseudo/<c>``, and
under DP ``pseudo_pos_sum/<c>`` and its kin) are values of a function the server chooses: the
teacher W decides each class's pseudo-labels.  Two columns of W made equal (or negated, or 0.1 %
apart) make a peer's values under two names equal (up to a sign the one view fixes for everyone),
so the names are not independent unknowns.  The check models the server's choice adversarially:
a *family* of such names (:func:`value_family`) is one unknown per peer across its names (the
server can make them equal; a common per-name scale changes no rank), while the checking client's
own values stay one unknown per distinct value, and it counts as exposed when *any non-zero linear
combination* of its own values is determined (the server can make two of its values differ by a
few images), not only a single one.  Values predictable from public information (a committed count
of 0, or below the count any non-zero value needs: the gate's ``known_zero``) leave the sums like
a colluder's.

Who runs it:

- every client, before it signs the survivor set (R3) and before it reveals shares (R4), over the
  groups that carry its own tensors, the survivors it is shown and the sums of earlier sessions
  over the same input (:func:`client_exposures`; the session ledger keeps those sessions);
- the simulator's audit, over every group of a run (:func:`exposed_clients`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

# (group, tensor) -> a label of the client's value (:func:`own_value_labels`): how a client tells
# its own values apart, equal labels for equal values.
OwnValues = Mapping[tuple[str, str], str]

# Tensor-name prefixes (before ``/<class>``) whose values a function the server parameterises
# computes: round 2's pseudo-label statistics, scored with the teacher W the server sends.  The
# names of one family are linked: one unknown per peer across them (see the module docstring).
SERVER_PARAMETERISED_FAMILIES: Mapping[str, str] = {
    "b_pseudo": "b_pseudo",
    "b_pseudo_rescaled": "b_pseudo",  # the same rule on rescaled scores: one family with it
    "pseudo_pos_sum": "pseudo_pos_sum",
    "pseudo_neg_sum": "pseudo_neg_sum",
    "pseudo_n_pos": "pseudo_n_pos",
    "pseudo_n_neg": "pseudo_n_neg",
}


def value_family(tensor: str) -> str:
    """The unknown a peer's value of ``tensor`` is, across names: ``family:<prefix>`` for a tensor
    a server-parameterised function computes (``b_pseudo/3`` -> ``family:b_pseudo``), else the name."""
    head, sep, _ = tensor.partition("/")
    family = SERVER_PARAMETERISED_FAMILIES.get(head) if sep else None
    return tensor if family is None else f"family:{family}"


def linked_groups(
    own_tensors: Collection[str], groups: Mapping[str, Collection[str]]
) -> dict[str, tuple[str, ...]]:
    """The groups whose sums bear on a client sending ``own_tensors``: every group carrying one of
    its tensors or a tensor of the same family (a pseudo group it is not in still cancels peers'
    values out of one it is in).  ``groups``: group -> its tensors."""
    families = {value_family(t) for t in own_tensors}
    return {
        name: tuple(tensors)
        for name, tensors in groups.items()
        if any(value_family(t) in families for t in tensors)
    }


def tensor_kind(tensor: str) -> str:
    """What kind of value ``tensor`` names, whatever its class: the name before ``/`` (``b/3`` ->
    ``b``), a server-parameterised family's names one kind (``b_pseudo_rescaled/2`` -> ``b_pseudo``)."""
    head, sep, _ = tensor.partition("/")
    return SERVER_PARAMETERISED_FAMILIES.get(head, head) if sep else tensor


@dataclass(frozen=True, slots=True)
class OneMemberApart:
    """Two groups carrying one kind of tensor whose memberships differ by exactly ``member``.

    ``larger`` = ``smaller`` plus ``member``.  Where the server knows that the other members' values
    of the two groups' tensors are equal (the same tensor, or side knowledge: peers with no positive
    of either class send equal ``b/0`` and ``b/1``), the difference of the two sums is ``member``'s
    value exactly.  Side knowledge of peers' values is equivalent to those peers colluding (it counts
    against c); nodes do not refuse such layouts, the simulator's report lists them.
    """

    larger: str
    smaller: str
    member: str
    kinds: tuple[str, ...]  # the tensor kinds both groups carry

    def describe(self) -> str:
        """``larger = smaller + member (kinds)``."""
        return f"{self.larger} = {self.smaller} + {self.member} ({', '.join(self.kinds)})"


def one_member_apart(
    members: Mapping[str, Collection[str]],
    tensors: Mapping[str, Collection[str]],
    *,
    kind: Callable[[str], str] = tensor_kind,
) -> tuple[OneMemberApart, ...]:
    """Every pair of groups carrying a tensor of one kind whose memberships differ by exactly one
    member, that member named; sorted by (larger, smaller).

    ``members``: group -> the clients summed (members, or survivors for the sums a server got);
    ``tensors``: group -> its tensor names; ``kind``: which names are values of one shape and
    meaning (:func:`tensor_kind`).  A group with no member sums nothing and pairs with none (a
    group of one is a single-member group, reported as such).  Linear in the memberships: each
    group is looked up with each of its members taken out.
    """
    missing = sorted(set(members) - set(tensors))
    if missing:
        raise ValueError(
            f"groups {', '.join(missing)} have members but no tensors: give each group its tensors"
        )
    by_set: dict[frozenset[str], list[str]] = {}
    for group, ids in members.items():
        if ids:
            by_set.setdefault(frozenset(ids), []).append(group)
    kinds = {group: {kind(t) for t in tensors[group]} for group in members}
    out = []
    for group in sorted(members):
        ids = frozenset(members[group])
        if len(ids) < 2:
            continue
        for member in sorted(ids):
            for smaller in by_set.get(ids - {member}, ()):
                shared = tuple(sorted(kinds[group] & kinds[smaller]))
                if shared:
                    out.append(OneMemberApart(group, smaller, member, shared))
    return tuple(sorted(out, key=lambda p: (p.larger, p.smaller)))


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
    is determined iff its unit vector lies in the rows' span over the rationals.  Variables with
    the same incidence column (in the same rows) are merged into one unknown first: every vector of
    the row space has equal coefficients on identical columns, so none of a class of two or more
    is ever determined, and a singleton's unit vector is in the row space iff it is in the merged
    one's.  The work then depends on the distinct columns (at most 2^rows), not on the number of
    variables.  Computed exactly: Gauss-Jordan elimination modulo a prime above the Hadamard bound
    of the 0/1 matrix's minors (so no non-zero minor vanishes and every rank equals the rational
    one), stopping once the rows span every unknown.
    """
    unique = sorted({frozenset(row) for row in rows if row}, key=lambda r: (len(r), sorted(map(repr, r))))
    incidence: dict[Hashable, list[int]] = {}
    for i, row in enumerate(unique):
        for variable in row:
            incidence.setdefault(variable, []).append(i)
    classes: dict[tuple[int, ...], list[Hashable]] = {}
    for variable, where in incidence.items():
        classes.setdefault(tuple(where), []).append(variable)
    keys = sorted(classes)  # one unknown per distinct column, in a fixed order
    position = {key: j for j, key in enumerate(keys)}
    members: list[list[int]] = [[] for _ in unique]  # row -> its unknowns
    for key in keys:
        for i in key:
            members[i].append(position[key])
    prime = _exact_prime(min(len(keys), len(unique)))  # every square minor has at most this size
    # basis: pivot -> row (sparse, pivot coefficient 1, zero in every other pivot column)
    basis: dict[int, dict[int, int]] = {}
    for unknowns in sorted(members):
        if len(basis) == len(keys):
            break  # full rank: every unknown is determined
        vector = dict.fromkeys(unknowns, 1)
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
    if len(basis) == len(keys):
        solved = range(len(keys))
    else:
        solved = [pivot for pivot, row in basis.items() if len(row) == 1]
    return frozenset(classes[keys[j]][0] for j in solved if len(classes[keys[j]]) == 1)


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
    Several names of one server-parameterised family (:func:`value_family`) are examined together,
    under the adversarial rule (one key, the names joined by `` + ``).
    """
    distinct = distinct or {}
    by_family: dict[str, dict[str, list[tuple[str, Sequence[str]]]]] = {}
    for name, (survivors, tensors) in groups.items():
        for tensor in tensors:
            by_family.setdefault(value_family(tensor), {}).setdefault(tensor, []).append((name, survivors))
    out: dict[str, tuple[str, ...]] = {}
    for family in sorted(by_family):
        names = by_family[family]
        if len(names) > 1:  # several server-parameterised names: the adversarial rule
            found = _family_exposed(names, distinct)
            if found:
                out[" + ".join(sorted(names))] = found
            continue
        ((tensor, entries),) = names.items()

        def variable(client: str, group: str, tensor: str = tensor) -> tuple[str, ...]:
            if tensor in distinct.get(client, ()):
                return (client, tensor, group)
            return (client, tensor)

        rows = [{variable(c, g) for c in survivors} for g, survivors in entries]
        exposed = sorted({var[0] for var in determined(rows)})
        if exposed:
            out[tensor] = tuple(exposed)
    return out


def _family_exposed(
    names: Mapping[str, Sequence[tuple[str, Sequence[str]]]], distinct: Mapping[str, Collection[str]]
) -> tuple[str, ...]:
    """The clients exposed through one family's sums, each in its worst case: its own values one
    unknown per name (per group where ``distinct``), every other client's one unknown across the
    family (the server can make them equal), and exposed when a non-zero combination of its own
    values is determined (:func:`own_combination_exposed`)."""
    entries = [(tensor, group, survivors) for tensor, where in names.items() for group, survivors in where]
    clients = sorted({c for _, _, survivors in entries for c in survivors})
    out = []
    for client in clients:
        rows = []
        for tensor, group, survivors in entries:
            row: set[tuple[str, ...]] = set()
            for c in survivors:
                if c == client:
                    own = (c, tensor, group) if tensor in distinct.get(c, ()) else (c, tensor)
                    row.add(own)
                else:
                    row.add((c, value_family(tensor)))
            rows.append(row)
        if own_combination_exposed(rows, client):
            out.append(client)
    return tuple(out)


def own_combination_exposed(
    rows: Sequence[Collection[tuple[str, ...]]], owner: str
) -> tuple[str, ...] | None:
    """One of ``owner``'s variables (``(owner, ...)``) whose column lies outside the span of the
    other clients' columns, or None.  Some non-zero linear combination of the owner's values is
    determined by the sums exactly when one exists: rank(all columns) > rank(others' columns) iff
    some functional y vanishes on every other column but not on one of the owner's.  Tested as
    "that variable is determined once the owner's other values are taken as known"."""
    own = sorted({var for row in rows for var in row if var[0] == owner})
    for target in own:
        others = set(own) - {target}
        if target in determined([set(row) - others for row in rows]):
            return target
    return None


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
    # the colluder search reached its bound: not shown safe, treated as exposing (a refusal)
    undecided: bool = False

    def describe(self) -> str:
        where = ", ".join(repr(g) for g in self.groups) or "(none of this session's groups)"
        if self.undecided:
            return (
                f"{self.round}: the exposure check could not show within its work bound that no "
                f"{len(self.colluders) or 'c'} colluding peers make the sums of {where} determine the "
                f"individual value of {self.tensor!r} for {', '.join(self.clients)}"
            )
        helped = f" once the values of {', '.join(self.colluders)} are known" if self.colluders else ""
        return (
            f"{self.round}: the sums of {where}{helped} determine the individual value of "
            f"{self.tensor!r} for {', '.join(self.clients)}"
        )


# Words of a value compared before the whole (its bucket): a few spread over it, so that values
# that differ almost anywhere never meet in one bucket.
_SAMPLE_WORDS = 8
# Words compared at a time between two values of one bucket: a difference ends the comparison.
_COMPARE_WORDS = 1 << 15


def own_value_labels(inputs: Mapping[str, Mapping[str, np.ndarray]]) -> dict[tuple[str, str], str]:
    """(group, tensor) -> a label of a client's value there: equal labels exactly where the values
    are equal (the same shape and the same float64 bit patterns: -0.0 is not 0.0), which is all
    the exposure check asks of them.  One array object sent to several groups (the drivers pass one
    Gram object to every group that carries it) is one value without being read; distinct objects
    are told apart by a few sampled words, and only those that agree there are compared in full, a
    slice at a time.  Nothing is hashed: a client's own values never leave it, and equality decided
    on the words is exact where a digest would be equal only up to a collision."""
    by_object: dict[int, tuple[np.ndarray, str]] = {}  # id -> (the array, kept alive; its label)
    buckets: dict[tuple[object, ...], list[tuple[np.ndarray, str]]] = {}
    out: dict[tuple[str, str], str] = {}
    for group, tensors in inputs.items():
        for name, values in tensors.items():
            entry = by_object.get(id(values))
            if entry is None or entry[0] is not values:
                words = _bit_patterns(values)
                sample = np.linspace(0, max(words.shape[0] - 1, 0), _SAMPLE_WORDS).astype(np.intp)
                key = (values.shape, words[sample].tobytes() if words.shape[0] else b"")
                same = buckets.setdefault(key, [])
                label = next((lab for other, lab in same if _equal_words(other, words)), None)
                if label is None:
                    label = f"value {len(by_object)}"
                    same.append((words, label))
                entry = (values, label)
                by_object[id(values)] = entry
            out[(group, name)] = entry[1]
    return out


def _bit_patterns(values: np.ndarray) -> np.ndarray:
    """A float64 array's words as flat uint64 bit patterns (a view where it can be)."""
    array = np.ascontiguousarray(values, dtype=np.float64).reshape(-1)
    return array.view(np.uint64)


def _equal_words(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two values of one bucket (the same shape) have the same words."""
    for start in range(0, a.shape[0], _COMPARE_WORDS):
        if not np.array_equal(a[start : start + _COMPARE_WORDS], b[start : start + _COMPARE_WORDS]):
            return False
    return True


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

    ``own_values``: (group, tensor) -> :func:`own_value_labels`' label of this client's value there;
    the tensors it sends.
    ``groups``: this session's groups -> (survivors, tensors).  Unknowns: this client's own values
    (by value, so a value it sends unchanged to several groups, *or under several names*, is one
    unknown, and different values are different unknowns); a peer's tensor is one unknown across
    groups (the tensor-identity rule), and one across the names of a server-parameterised family
    (:func:`value_family`).  Tensors that share one of this client's values, or a family, are
    examined together, with the family's groups this client is not in.  This client counts as
    exposed when a non-zero combination of its own values is determined, not only one of them
    (:func:`own_combination_exposed`; the module docstring says why).  With ``colluders = 0``
    every client the sums determine is reported; with c > 0 this
    client's own values are tested against every set of at most c colluding peers as well (exact:
    :func:`isolating_colluders`); the peers test their own.
    """
    findings = []
    verdicts: dict[tuple, tuple[str, tuple[str, ...]] | None] = {}  # one search per membership pattern
    carried_by = {name: set(carried) for name, (_, carried) in groups.items()}
    for component in _components(own_values):
        # The component's tensors and every tensor of their families the groups carry.
        families = {value_family(t) for t in component}
        linked = {t for carried in carried_by.values() for t in carried if value_family(t) in families}
        tensors = sorted(set(component) | linked)
        current = [
            (name, tuple(survivors), tensor)
            for tensor in tensors
            for name, (survivors, carried) in sorted(groups.items())
            if tensor in carried and survivors
        ]
        rows = _rows(client_id, current, own_values)
        label = " + ".join(component)
        alone = determined(rows)
        exposed = sorted({var[0] for var in alone})
        if client_id not in exposed and own_combination_exposed(rows, client_id) is not None:
            exposed = sorted({*exposed, client_id})
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
        # Tensors whose groups have the same survivors (feat_sum and n in every class group) pose
        # the same search: its answer depends only on the rows' membership, not on the names.
        key = (_membership_key(client_id, rows), colluders)
        if key not in verdicts:
            verdicts[key] = _colluder_verdict(rows, own, client_id, colluders)
        verdict = verdicts[key]
        if verdict is not None:
            kind, witness = verdict
            findings.append(
                ExposureFinding(
                    round=round_name,
                    tensor=label,
                    clients=(client_id,),
                    groups=_involved(current, {client_id}),
                    colluders=witness,
                    undecided=kind == "undecided",
                )
            )
    return tuple(findings)


def _colluder_verdict(
    rows: Sequence[Collection[tuple[str, ...]]],
    own: Sequence[tuple[str, ...]],
    client_id: str,
    colluders: int,
) -> tuple[str, tuple[str, ...]] | None:
    """("exposed", witness) for the first own value some colluders isolate, ("undecided", ()) when
    the bounded search could not tell for one (a refusal), None when none can be isolated."""
    undecided = False
    for target in own:
        # A non-zero combination of the owner's values counts (module docstring): the target is
        # tested with the owner's other values taken as known, so any combination is covered.
        others = set(own) - {target}
        reduced = [kept for row in rows if (kept := set(row) - others)]
        try:
            witness = isolating_colluders(reduced, target, client_id, colluders)
        except ColluderSearchLimitError:
            undecided = True
            continue
        if witness is not None:
            return "exposed", witness
    return ("undecided", ()) if undecided else None


def _membership_key(client_id: str, rows: Sequence[Collection[tuple[str, ...]]]) -> tuple:
    """The rows with variables renamed canonically: (client, rank of its variable by first use)."""
    ranks: dict[tuple[str, ...], int] = {}
    per_client: dict[str, int] = {}
    out = []
    for row in rows:
        renamed = []
        for var in sorted(row):
            if var not in ranks:
                ranks[var] = per_client.get(var[0], 0)
                per_client[var[0]] = ranks[var] + 1
            renamed.append((var[0] == client_id, var[0], ranks[var]))
        out.append(tuple(sorted(renamed)))
    return tuple(out)


def _components(own_values: OwnValues) -> list[tuple[str, ...]]:
    """This client's tensors, linked where it sends one value under several names or the names
    are of one server-parameterised family."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    by_value: dict[str, str] = {}
    by_family: dict[str, str] = {}
    for (_, tensor), value in sorted(own_values.items()):
        find(tensor)
        if value in by_value:
            parent[find(tensor)] = find(by_value[value])
        else:
            by_value[value] = tensor
        family = value_family(tensor)
        if family != tensor:
            if family in by_family:
                if find(tensor) != find(by_family[family]):
                    parent[find(tensor)] = find(by_family[family])
            else:
                by_family[family] = tensor
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
                # This client's value in that group, by its label (a group it is in always has one).
                row.add((cid, own_values.get((group, tensor), f"unknown:{group}/{tensor}")))
            else:
                row.add((cid, value_family(tensor)))  # a family's names: one unknown per peer
        rows.append(row)
    return rows


# --- colluders ------------------------------------------------------------------------------------

_SPAN_PRIME = (1 << 31) - 1  # products of two residues fit in int64
_SPAN_MAX_ROWS = 22  # Hadamard: every minor of a 0/1 matrix with this many rows is below the prime
# The colluder search's work bound per target, in column steps: a node of the exact search costs
# one step per distinct column (its rank-1 update and its line bound touch each column once).
# Reached, the client refuses (ColluderSearchLimitError): never an open-ended run.
COLLUDER_SEARCH_LIMIT = 200_000
_PACKING_ROUNDS = 64  # families routed by the packing bound
_PACKING_STEP = 0.2  # its multiplicative length step


class ColluderSearchLimitError(ValueError):
    """The colluder search reached :data:`COLLUDER_SEARCH_LIMIT` without deciding whether some set of
    at most c peers isolates the target (and the packing rule did not prove that none does).

    A client treats it as a refusal (``ExposureCheckLimitError`` at the gate): undecided is never
    accepted."""

    def __init__(self, target: tuple[str, ...], budget: int, limit: int) -> None:
        self.target, self.budget, self.limit = target, budget, limit
        super().__init__(
            f"the colluder search for {target!r} (up to {budget} colluders) spent its {limit} column "
            "steps (search nodes times distinct columns) without an answer, and the packing bound "
            "did not prove it safe"
        )


def isolating_colluders(
    rows: Sequence[Collection[tuple[str, ...]]],
    target: tuple[str, ...],
    owner: str,
    budget: int,
    *,
    limit: int = COLLUDER_SEARCH_LIMIT,
) -> tuple[str, ...] | None:
    """A set of at most ``budget`` peers whose values, known to the server, let the sums over
    ``rows`` determine ``target``; None when no such set exists; :class:`ColluderSearchLimitError`
    when the bounded search cannot tell.

    Variables are ``(client, ...)`` tuples (the owner's are never known to the server); a column is
    a variable's 0/1 incidence over the rows.  Known variables leave the sums, so with a set S of
    colluders ``target`` is determined iff its column a_t is outside the span of the columns of
    the other unknowns.

    **The cut form (exact).**  a_t lies outside the span of a set X of columns iff some functional y
    on the rows has y.a_t != 0 and y.a_v = 0 for every v in X.  So S isolates the target iff some y
    with y.a_t != 0 and y orthogonal to the owner's other columns "hits" (y.a_v != 0 for some
    variable v of) only peers in S.  Only the kernel of y matters: a *flat* F (the span of the owner's
    other columns and some peers' columns) with a_t outside F hits exactly the peers with a column
    outside F; a set of at most ``budget`` peers isolates the target iff some such flat hits at
    most ``budget`` peers.  Peers with the same columns form one *type* (they are hit together),
    so the work depends on the distinct columns (at most 2^rows), not on the number of peers.

    **Two steps, each sound.**  (1) The exact search (:meth:`_CutProblem.search`): every flat
    avoiding a_t that contains the owner's other columns, by include/exclude decisions on the
    distinct columns, each flat reached once, its inclusions explored first (so its first descent
    is a greedy heavy flat).  At each node the *line bound* (:func:`_line_bound`) bounds from below
    the peers every flat below it hits: modulo the node's flat, a_t is a projective point P, every
    outside column lies on one projective line through P (or at P: "forced", in no flat below), and
    a hyperplane avoiding P keeps at most one point of each line; so every flat below hits the
    forced columns and, per line, all but its heaviest point without an excluded column.  Above
    ``budget``, the branch is cut.  A flat hitting at most ``budget`` peers is a witness,
    re-checked with :func:`determined` before it is returned; exhausted without one, no ``budget``
    peers isolate the target.  (2) Past its bound, a proof of safety is still tried: a fractional
    packing of peer sets that each span a_t with the owner's other columns
    (:func:`_packing_bound`, exact rationals); every cut hits at least its value in peers, so a
    value above ``budget`` proves the target safe.  Spans are exact, modulo 2^31 - 1 (above the
    Hadamard bound of every minor of a 0/1 matrix with at most 22 rows; more rows: the Mersenne
    prime of :func:`_exact_prime`): every test the search makes (a residue zero, two residues
    parallel, three on one line) is a rank of a set of the 0/1 columns, equal to the rational one.

    **At the bound.**  When the search has spent :data:`COLLUDER_SEARCH_LIMIT` column steps (nodes
    times distinct columns) without an answer and the packing does not prove safety,
    :class:`ColluderSearchLimitError` is raised and the client refuses.  Undecided is never
    accepted, so the loss is only availability: a layout whose smallest cut exceeds ``budget`` but
    whose pruned search tree is larger than the bound and whose packing bound does not reach
    ``budget + 1`` (bench/bench_scale.py reports the verdicts per layout; SECURITY.md).
    """
    if budget <= 0:
        return None
    problem = _CutProblem.build(rows, target, owner)
    if problem is None:
        return None  # a_t is in the span of the owner's other columns: no colluder can change it
    witness = problem.search(budget, limit)
    if witness is _UNDECIDED:
        if _packing_bound(problem, budget + 1) > budget:
            return None
        raise ColluderSearchLimitError(target, budget, limit)
    if witness is None:
        return None
    known = set(witness)
    if target not in determined([{v for v in row if v[0] not in known} for row in rows]):
        raise AssertionError("the colluder search found a cut that the exact rank test does not confirm")
    return tuple(sorted(witness))


_UNDECIDED = object()


@dataclass(slots=True)
class _CutProblem:
    """One target's cut search: distinct peer columns mod a prime, peer types and their weights."""

    prime: int
    columns: np.ndarray  # (P, rows) distinct peer columns, residues (int64 or object)
    target: np.ndarray  # (rows,)
    base: list[np.ndarray]  # the owner's other columns (never known)
    type_columns: list[np.ndarray]  # per type: indices into ``columns``
    type_peers: list[tuple[str, ...]]

    @classmethod
    def build(
        cls, rows: Sequence[Collection[tuple[str, ...]]], target: tuple[str, ...], owner: str
    ) -> _CutProblem | None:
        n_rows = len(rows)
        incidence: dict[tuple[str, ...], list[int]] = {}
        for i, row in enumerate(rows):
            for var in row:
                incidence.setdefault(var, []).append(i)
        if target not in incidence:
            return None
        small = n_rows <= _SPAN_MAX_ROWS
        prime = _SPAN_PRIME if small else _exact_prime(n_rows)
        dtype = np.int64 if small else object

        def vector(indices: list[int]) -> np.ndarray:
            out = np.zeros(n_rows, dtype=dtype)
            out[indices] = 1
            return out

        index: dict[tuple[int, ...], int] = {}
        by_peer: dict[str, set[int]] = {}
        base = []
        for var, where in sorted(incidence.items()):  # a fixed column order, whatever the hashing
            if var == target:
                continue
            if var[0] == owner:
                base.append(vector(where))
                continue
            key = tuple(where)
            by_peer.setdefault(var[0], set()).add(index.setdefault(key, len(index)))
        types: dict[tuple[int, ...], list[str]] = {}
        for peer, found in sorted(by_peer.items()):
            types.setdefault(tuple(sorted(found)), []).append(peer)
        columns = np.zeros((len(index), n_rows), dtype=dtype)
        for key, j in index.items():
            columns[j, list(key)] = 1
        problem = cls(
            prime,
            columns,
            vector(incidence[target]),
            base,
            [np.array(key, dtype=np.int64) for key in types],
            [tuple(peers) for peers in types.values()],
        )
        return None if _Flat.root(problem) is None else problem

    def column_weights(self) -> tuple[np.ndarray, int]:
        """(integer weight per distinct column, scale): a type of w peers and m distinct columns
        gives each of its columns w * scale / m, scale the lcm of the m (1 when every peer has one
        column).  A flat hits at least (weight of the columns outside it) / scale peers, since a
        type is counted at most once, in full only when all its columns are outside."""
        scale = math.lcm(*(len(cols) for cols in self.type_columns)) if self.type_columns else 1
        weight = np.zeros(len(self.columns), dtype=np.int64)
        for cols, peers in zip(self.type_columns, self.type_peers, strict=True):
            weight[cols] += len(peers) * scale // len(cols)
        return weight, scale

    def search(self, budget: int, limit: int) -> tuple[str, ...] | object | None:
        """The exact search: every flat avoiding a_t that contains the owner's other columns, by
        include/exclude decisions on distinct columns, each flat reached once (a decision splits
        the flats below a node into those holding the column and those leaving it outside).  A
        node is cut once the line bound (:func:`_line_bound`) on the peers every flat below it hits
        exceeds ``budget``; a column whose exclusion alone would push the bound past ``budget`` is
        included without a branch (every flat below within the budget holds it).  Otherwise the
        branch is on the open column of the largest such gain (then the heaviest), its inclusion
        explored first.  A witness, None, or _UNDECIDED past ``limit`` column steps (a node costs
        one step per distinct column: its rank-1 update and its bound touch each once)."""
        weights = np.array([len(peers) for peers in self.type_peers], dtype=np.int64)
        owner_matrix = np.zeros((len(self.columns), len(self.type_peers)), dtype=bool)
        for t, cols in enumerate(self.type_columns):
            owner_matrix[cols, t] = True
        column_weight, scale = self.column_weights()
        # One column per type (peers with one variable each, the usual case): a type is hit iff its
        # column is, so sums of column weights replace the type look-ups.
        single = scale == 1 and all(len(cols) == 1 for cols in self.type_columns)
        allowed = budget * scale  # the budget in weight units

        def peers_hit(columns: np.ndarray) -> int:
            if single:
                return int(columns @ column_weight)
            return int(weights[owner_matrix[columns].any(axis=0)].sum())

        root = _Flat.root(self)
        assert root is not None
        p, width = self.prime, len(self.columns)
        tie_break = column_weight * (width + 1) + np.arange(width)[::-1]  # heavier, then earlier
        stack = [(root.residues, root.target, np.zeros(width, dtype=bool))]
        steps = 0
        while stack:
            residues, target, excluded = stack.pop()
            steps += width
            if steps > limit:
                return _UNDECIDED
            outside = residues.any(axis=1)
            if peers_hit(outside) <= budget:
                hit = owner_matrix[outside].any(axis=0)
                return tuple(peer for t in np.flatnonzero(hit) for peer in self.type_peers[int(t)])
            if (excluded & ~outside).any():
                continue  # an excluded column joined the flat: no flat below leaves it outside
            bound, forced, blocked, gain = _line_bound(p, residues, target, excluded, column_weight)
            if bound > allowed:
                continue  # every flat below hits more than budget peers
            # Columns parallel to an excluded one (modulo the flat) can join no flat below either.
            excluded = excluded | blocked
            if not single and peers_hit(forced | excluded) > budget:
                continue  # the same, counted by type
            open_columns = outside & ~forced & ~excluded
            if not open_columns.any():
                continue  # no undecided column left: this flat was the only one below
            must = open_columns & (gain > allowed - bound)
            if must.any():  # every flat below within the budget holds them: one child, no branch
                flat = _Flat(self, residues, target)
                for j in np.flatnonzero(must):
                    residue = flat.residues[j]
                    if residue.any():
                        flat = flat._with(residue.copy())
                if flat.target.any():
                    stack.append((flat.residues, flat.target, excluded))
                continue
            j = int(np.argmax(np.where(open_columns, gain * (int(tie_break.max()) + 1) + tie_break, -1)))
            without = excluded.copy()
            without[j] = True
            stack.append((residues, target, without))  # explored second: j stays outside
            flat = _Flat(self, residues, target)._with(residues[j].copy())
            stack.append((flat.residues, flat.target, excluded))  # explored first: j inside
        return None


def _line_bound(
    prime: int, residues: np.ndarray, target: np.ndarray, excluded: np.ndarray, weight: np.ndarray
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """A lower bound, in ``weight`` units, on the weight of the columns outside every flat F' that
    contains the flat F (whose residues are given), avoids a_t and leaves the ``excluded`` columns
    outside; with the forced columns (residue parallel to a_t's: in no such F') and the blocked
    ones (residue parallel to an excluded column's: ditto).

    Modulo F, a_t is a projective point P.  F' lies in a hyperplane H that avoids P, and every
    column outside H is outside F'.  A column q outside F and not forced lies on exactly one
    projective line through P (spanned by P and q's residue), and H meets that line in exactly one
    point: of the columns on one line, only those at one point (residues parallel to each other)
    can be inside H, and only if none of them is excluded (an excluded column's parallels would
    bring it into F').  So F' leaves outside at least the forced weight plus, per line, its weight
    less its heaviest point without an excluded column.  Keys: a residue minus its component along
    P (eliminating P's first non-zero coordinate), scaled to a leading 1, names the line; the
    ratio of the component to that lead names the point on it.
    """
    p = prime
    outside = np.flatnonzero(residues.any(axis=1))
    forced = np.zeros(len(residues), dtype=bool)
    blocked = np.zeros(len(residues), dtype=bool)
    gain = np.zeros(len(residues), dtype=np.int64)
    if not outside.size:
        return 0, forced, blocked, gain
    pivot = int(np.flatnonzero(target)[0])
    r = residues[outside]
    along = (r[:, pivot] * pow(int(target[pivot]), -1, p)) % p
    rest = (r - along[:, None] * target[None, :]) % p  # zero at the pivot (one reduction: see _with)
    nonzero = rest != 0
    on_line = nonzero.any(axis=1)
    forced[outside[~on_line]] = True
    bound = int(weight[forced].sum())
    if not on_line.any():
        return bound, forced, blocked, gain
    columns, rest, along = outside[on_line], rest[on_line], along[on_line]
    lead = rest[np.arange(len(rest)), nonzero[on_line].argmax(axis=1)]
    inverse = np.array([pow(int(x), -1, p) for x in lead.tolist()], dtype=rest.dtype)
    line = (rest * inverse[:, None]) % p
    point = (along * inverse) % p
    if rest.dtype == object:  # exact big residues: group by tuples
        keys = [(tuple(row), int(x)) for row, x in zip(line.tolist(), point.tolist(), strict=True)]
        ranked = sorted(range(len(keys)), key=keys.__getitem__)
        ordered = [keys[k] for k in ranked]
        new_line = np.array([k == 0 or ordered[k][0] != ordered[k - 1][0] for k in range(len(ordered))])
        new_point = np.array([k == 0 or ordered[k] != ordered[k - 1] for k in range(len(ordered))])
        ranked = np.array(ranked, dtype=np.int64)
    else:
        ranked = np.lexsort((point, *line.T[::-1]))  # by line, then by point
        line, point = line[ranked], point[ranked]
        new_line = np.ones(len(ranked), dtype=bool)
        new_line[1:] = (line[1:] != line[:-1]).any(axis=1)
        new_point = new_line.copy()
        new_point[1:] |= point[1:] != point[:-1]
    columns = columns[ranked]
    point_start = np.flatnonzero(new_point)
    point_weight = np.add.reduceat(weight[columns], point_start)
    point_excluded = np.add.reduceat(excluded[columns].astype(np.int64), point_start) > 0
    point_line = np.cumsum(new_line)[point_start] - 1
    line_weight = np.zeros(int(point_line[-1]) + 1, dtype=np.int64)
    np.add.at(line_weight, point_line, point_weight)
    # Per line its heaviest point without an excluded column (kept) and the next one: excluding a
    # column of the kept point raises the bound by their difference (its gain).
    kept = np.zeros_like(line_weight)
    point_gain = np.zeros_like(point_weight)
    open_points = np.flatnonzero(~point_excluded)
    if open_points.size:
        ranked = open_points[np.lexsort((-point_weight[open_points], point_line[open_points]))]
        lines_of = point_line[ranked]
        heads = np.ones(len(ranked), dtype=bool)
        heads[1:] = lines_of[1:] != lines_of[:-1]
        at = np.flatnonzero(heads)
        best = ranked[at]
        following = np.minimum(at + 1, len(ranked) - 1)
        runner_up = np.where((at + 1 < len(ranked)) & ~heads[following], point_weight[ranked[following]], 0)
        kept[point_line[best]] = point_weight[best]
        point_gain[best] = point_weight[best] - runner_up
    bound += int((line_weight - kept).sum())
    sizes = np.diff(np.append(point_start, len(columns)))
    blocked[columns[np.repeat(point_excluded, sizes)]] = True
    gain[columns] = np.repeat(point_gain, sizes)
    return bound, forced, blocked, gain


@dataclass(slots=True)
class _Flat:
    """A flat as the residues of every distinct column (and of a_t) modulo its reduced basis."""

    problem: _CutProblem
    residues: np.ndarray  # (P, rows)
    target: np.ndarray  # (rows,): a_t's residue, never zero (a_t is outside the flat)

    @classmethod
    def root(cls, problem: _CutProblem) -> _Flat | None:
        """The span of the owner's other columns; None when it already holds a_t."""
        p, n = problem.prime, len(problem.columns)
        stacked = np.vstack([problem.columns, *(b[None, :] for b in problem.base)])
        flat = cls(problem, stacked % p, problem.target % p)
        for k in range(len(problem.base)):
            residue = flat.residues[n + k]
            if residue.any():
                flat = flat._with(residue)
                if not flat.target.any():
                    return None
        return cls(problem, flat.residues[:n].copy(), flat.target)

    def _with(self, residue: np.ndarray) -> _Flat:
        """The flat spanned by this one and a vector whose residue is ``residue`` (non-zero)."""
        p = self.problem.prime
        pivot = int(np.flatnonzero(residue)[0])
        unit = (residue * pow(int(residue[pivot]), -1, p)) % p
        # One reduction: a residue less a product of two (below p^2 <= 2^62) stays inside int64,
        # and % p of a negative number is its non-negative residue.
        residues = (self.residues - self.residues[:, pivot : pivot + 1] * unit[None, :]) % p
        target = (self.target - self.target[pivot] * unit) % p
        return _Flat(self.problem, residues, target)


class _Basis:
    """A reduced echelon basis modulo the problem's prime, grown one vector at a time."""

    __slots__ = ("prime", "rows")

    def __init__(self, prime: int, vectors: Iterable[np.ndarray] = ()) -> None:
        self.prime = prime
        self.rows: list[tuple[int, np.ndarray]] = []  # (pivot, row with 1 at pivot, 0 at other pivots)
        for vector in vectors:
            self.add(vector)

    def reduce(self, vector: np.ndarray) -> np.ndarray:
        p = self.prime
        out = vector % p
        for pivot, row in self.rows:
            factor = out[pivot]
            if factor:
                out = (out - (factor * row) % p) % p
        return out

    def add(self, vector: np.ndarray) -> bool:
        """Add ``vector``; False when it was already in the span."""
        residue = self.reduce(vector)
        nonzero = np.flatnonzero(residue)
        if not nonzero.size:
            return False
        p, pivot = self.prime, int(nonzero[0])
        unit = (residue * pow(int(residue[pivot]), -1, p)) % p
        self.rows = [
            (q, (row - (row[pivot] * unit) % p) % p if row[pivot] else row) for q, row in self.rows
        ] + [(pivot, unit)]
        return True

    def holds(self, vector: np.ndarray) -> bool:
        return not self.reduce(vector).any()

    def copy(self) -> _Basis:
        out = _Basis(self.prime)
        out.rows = list(self.rows)
        return out


def _spanning_family(problem: _CutProblem, order: Iterable[int]) -> list[int] | None:
    """Types, taken in ``order``, until their columns with the owner's other columns span a_t (then
    pruned of types not needed); None when all of them do not."""
    basis = _Basis(problem.prime, problem.base)
    used = []
    for t in order:
        if any([basis.add(problem.columns[int(j)]) for j in problem.type_columns[t]]):
            used.append(t)
            if basis.holds(problem.target):
                break
    else:
        return None
    for t in reversed(list(used)):  # the last-taken (dearest) first
        trial = [u for u in used if u != t]
        basis = _Basis(problem.prime, problem.base)
        for u in trial:
            for j in problem.type_columns[u]:
                basis.add(problem.columns[int(j)])
        if basis.holds(problem.target):
            used = trial
    return used


def _packing_bound(problem: _CutProblem, wanted: int, *, rounds: int = _PACKING_ROUNDS) -> Fraction:
    """A lower bound on the peers every cut hits: a fractional packing of spanning families.

    A *family* is a set of types whose columns, with the owner's other columns, span a_t.  Every
    functional y with y.a_t != 0 that vanishes on the owner's columns is non-zero on some column
    of every family, so it hits at least one type of each.  Hence for weights x_F >= 0 with
    sum_{F containing T} x_F <= |T| for every type T, the peers hit by any cut are at least
    sum_T |T| [T hit] >= sum_T [T hit] sum_{F containing T} x_F >= sum_F x_F.  The families come
    from a greedy spanning oracle under multiplicative lengths (Garg and Koenemann's packing
    scheme); the loads are then scaled to the capacities in exact rationals, so the bound is exact
    whatever the oracle's quality (a weak oracle only makes it smaller: a safe layout refused).
    """
    weights = [len(peers) for peers in problem.type_peers]
    length = [1.0 / w for w in weights]
    flows: dict[tuple[int, ...], int] = {}
    loads = [0] * len(weights)
    best = Fraction(0)
    for step in range(rounds):
        family = _spanning_family(problem, sorted(range(len(weights)), key=lambda t: (length[t], t)))
        if family is None:
            break
        key = tuple(sorted(family))
        amount = min(weights[t] for t in key)
        flows[key] = flows.get(key, 0) + amount
        for t in key:
            loads[t] += amount
            length[t] *= 1.0 + _PACKING_STEP * amount / weights[t]
        if step % 16 == 15 or step == rounds - 1:
            scale = max(Fraction(load, w) for load, w in zip(loads, weights, strict=True))
            best = max(best, Fraction(sum(flows.values())) / scale)
            if best >= wanted:
                break
    return best
