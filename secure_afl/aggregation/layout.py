"""From a client's statistics (group -> tensor -> float64 array) to the protocol's named flat tensors.

One implementation for every driver (the simulator's in-process driver, the Flower apps): the
protocol sums flat vectors; symmetric matrices travel as their upper triangle.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from secure_afl.core import encoding
from secure_afl.core.errors import LocalProtocolError
from secure_afl.protocol.messages import GroupSpec, TensorSpec

Contributions = Mapping[str, Mapping[str, np.ndarray]]  # group -> tensor -> array


@dataclass(frozen=True)
class Derivation:
    """A sum that is not sent: the sum of the ``added`` wire sums minus the ``subtracted`` ones
    (exact on the unmasked words, mod 2⁶⁴).  Its members are the ``added`` groups' less the
    ``subtracted`` groups' (the plans that make one keep each client in one added group, and a
    subtracted group's members inside the added ones)."""

    added: tuple[str, ...]
    subtracted: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.added:
            raise ValueError("a derivation adds at least one wire sum")
        if set(self.added) & set(self.subtracted):
            raise ValueError(f"a derivation adds and subtracts the same sum: {self}")

    def __str__(self) -> str:
        text = " + ".join(self.added)
        return text + "".join(f" − {group}" for group in self.subtracted)

    def to_dict(self) -> dict[str, list[str]]:
        """The JSON form (records, results.json)."""
        return {"added": list(self.added), "subtracted": list(self.subtracted)}

    def words(self, sums: Mapping[str, Mapping[str, np.ndarray]], tensor: str) -> np.ndarray:
        """The derived sum's uint64 words from the wire sums (a new array, read-only)."""
        terms = [(np.add, group) for group in self.added[1:]] + [(np.subtract, g) for g in self.subtracted]
        first = sums[self.added[0]][tensor]
        if not terms:
            words = first.copy()
        else:  # the first operation allocates the result, the others work in it
            (op, group), *rest = terms
            words = op(first, sums[group][tensor])
            for op, group in rest:
                op(words, sums[group][tensor], out=words)
        words.setflags(write=False)
        return words

    def members(self, wire: Mapping[str, Sequence[str]]) -> tuple[str, ...]:
        """The derived group's clients from the wire groups' (members or survivors)."""
        inside = {cid for group in self.added for cid in wire.get(group, ())}
        outside = {cid for group in self.subtracted for cid in wire.get(group, ())}
        return tuple(sorted(inside - outside))


@dataclass(frozen=True)
class Layout:
    """Per group its tensors' wire lengths; per tensor name its array shape; which are symmetric.

    ``derived`` and ``hidden`` are set by a plan (:mod:`.difference`): a (group, tensor) sum that
    is not sent but derived from wire sums (:class:`Derivation`: ``everyone − complement``, or a
    sum of groups that partition the clients), and the wire sums that only serve a derivation.
    :meth:`logical_words` applies both to the unmasked words.
    """

    groups: Mapping[str, Mapping[str, int]]
    shapes: Mapping[str, tuple[int, ...]]
    symmetric: frozenset[str]
    derived: Mapping[tuple[str, str], Derivation] = field(default_factory=dict)
    hidden: frozenset[tuple[str, str]] = frozenset()

    @property
    def complement_groups(self) -> frozenset[str]:
        """The wire groups whose sums are only subtracted (``everyone − complement``): when every
        member of one drops, its sum is zero and the derived sums are ``everyone``'s, so the
        session may finish without it (the server's ``may_be_empty``)."""
        return frozenset(group for d in self.derived.values() for group in d.subtracted)

    def derivations(self) -> dict[str, dict[str, Derivation]]:
        """Group -> tensor -> how its sum is derived from wire sums; empty without a plan.  What an
        audit prints beside the groups as sent."""
        out: dict[str, dict[str, Derivation]] = {}
        for (group, tensor), derivation in sorted(self.derived.items()):
            out.setdefault(group, {})[tensor] = derivation
        return out

    def logical_tensors(self) -> dict[str, tuple[str, ...]]:
        """Group -> the tensor names of the method's sums (:meth:`logical_words`'s, by name)."""
        out = {group: set(tensors) for group, tensors in self.groups.items()}
        for group, tensor in self.derived:
            out.setdefault(group, set()).add(tensor)
        for group, tensor in self.hidden:
            out[group].discard(tensor)
        return {group: tuple(sorted(tensors)) for group, tensors in out.items() if tensors}

    def group_records(
        self, members: Mapping[str, Sequence[str]], survivors: Mapping[str, Sequence[str]]
    ) -> list[dict[str, Any]]:
        """What the server learned of each group, as an audit states it: the method's groups and the
        wire groups that only serve a derivation, each with its members and survivors (the
        :meth:`logical_members` of the wire's), the tensors summed on the wire (a derived group:
        its derived ones) and how a derived sum is formed.  Every party derives it alike, the
        server from its sums' members, a client from the advertisements and the survivor set it
        signed."""
        logical, derived = self.logical_tensors(), self.derivations()
        records = []
        for name in sorted(set(logical) | {group for group, _ in self.hidden}):
            entry: dict[str, Any] = {
                "name": name,
                "members": list(members[name]),
                "survivors": list(survivors[name]),
                "tensors": sorted(self.groups[name] if name in self.groups else logical[name]),
            }
            if name in derived:
                entry["derived"] = {tensor: d.to_dict() for tensor, d in derived[name].items()}
            records.append(entry)
        return records

    def logical_members(self, wire: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, ...]]:
        """Group -> clients (members or survivors) for the method's groups: the wire groups', and
        each derived group that is not on the wire from its derivation's groups."""
        out = {group: tuple(ids) for group, ids in wire.items()}
        for (group, _), derivation in sorted(self.derived.items()):
            if group not in out:
                out[group] = derivation.members(wire)
        return out

    def group_specs(self) -> tuple[GroupSpec, ...]:
        """The session config's groups, sorted by name (tensors sorted by name)."""
        return tuple(
            GroupSpec(group, tuple(TensorSpec(name, length) for name, length in sorted(tensors.items())))
            for group, tensors in sorted(self.groups.items())
        )

    def logical_words(self, sums: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, dict[str, np.ndarray]]:
        """The method's group sums from the wire's (uint64 words, exact mod 2⁶⁴): derived sums
        added, the sums that only served a derivation left out (a group left empty goes too)."""
        out = {group: dict(tensors) for group, tensors in sums.items()}
        for (group, tensor), derivation in self.derived.items():
            out.setdefault(group, {})[tensor] = derivation.words(sums, tensor)
        for group, tensor in self.hidden:
            del out[group][tensor]
        return {group: tensors for group, tensors in out.items() if tensors}

    def flatten(self, name: str, values: np.ndarray) -> np.ndarray:
        return flatten(values, name in self.symmetric)

    def unflatten(self, name: str, flat: np.ndarray) -> np.ndarray:
        return unflatten(flat, self.shapes[name], name in self.symmetric)


def flatten(values: np.ndarray, is_symmetric: bool) -> np.ndarray:
    """float64 wire vector: the upper triangle of a symmetric matrix, else the array raveled.

    A symmetric tensor given as its upper triangle already (1-D, :func:`symmetric_dimension`) is
    the wire vector as it is: no copy (a read-only one then stays shared with its owner)."""
    array = np.asarray(values, dtype=np.float64)
    if is_symmetric and array.ndim == 1:
        return array
    return encoding.pack_symmetric(array) if is_symmetric else np.ascontiguousarray(array).ravel()


def symmetric_dimension(name: str, shape: tuple[int, ...]) -> int:
    """``d`` of a symmetric tensor given as a ``d×d`` matrix or as its packed upper triangle (1-D
    of length d(d+1)/2); anything else raises ``ValueError`` saying what was expected."""
    if len(shape) == 2 and shape[0] == shape[1]:
        return shape[0]
    if len(shape) == 1:
        try:
            return encoding.dimension_from_triangle_length(shape[0])
        except LocalProtocolError:
            pass
    raise ValueError(
        f"symmetric tensor {name!r} must be a square matrix or its packed upper triangle "
        f"(length d(d+1)/2), got shape {shape}"
    )


def unflatten(flat: np.ndarray, shape: tuple[int, ...], is_symmetric: bool) -> np.ndarray:
    return encoding.unpack_symmetric(flat) if is_symmetric else np.asarray(flat).reshape(shape)


def members_of(contributions: Mapping[str, Contributions]) -> dict[str, list[str]]:
    """Group -> the clients that send to it, in sorted order (what every client declares: public)."""
    members: dict[str, list[str]] = {}
    for cid in sorted(contributions):
        for group in contributions[cid]:
            members.setdefault(group, []).append(cid)
    return members


def layout_of(contributions: Mapping[str, Contributions], symmetric: Collection[str] = ("gram",)) -> Layout:
    """The layout of every client's contributions (client -> group -> tensor); every member must agree."""
    symmetric = frozenset(symmetric)
    groups: dict[str, dict[str, int]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for cid, client_groups in contributions.items():
        for group, tensors in client_groups.items():
            lengths: dict[str, int] = {}
            for name, values in tensors.items():
                shape = np.shape(values)
                if name in symmetric:  # a matrix or its packed triangle: the same d × d tensor
                    d = symmetric_dimension(name, shape)
                    shape = (d, d)
                if shapes.setdefault(name, shape) != shape:
                    raise ValueError(
                        f"tensor {name!r} has shape {shape} at {cid!r} but {shapes[name]} elsewhere"
                    )
                if name in symmetric:
                    lengths[name] = encoding.upper_triangle_length(shape[0])
                else:
                    lengths[name] = int(np.prod(shape))
            if groups.setdefault(group, lengths) != lengths:
                raise ValueError(f"group {group!r}: {cid!r} sends tensors {lengths}, others {groups[group]}")
    return Layout(groups=groups, shapes=shapes, symmetric=symmetric)
