"""One tensor summed over many large, overlapping groups, sent as an everyone-sum minus a complement.

Under the per-class Gram layout class ``c``'s group ``S_c`` sums every member's Gram.  When most
clients label ``c`` (``|S_c| > n/2``), the same sum is ``Σ_all G_k − Σ_{k∉S_c} G_k``: each client
sends its Gram once to the ``all`` group and once to the complement group ``others/class/<c>`` of
each class it does *not* label, instead of once to each class group it does.  At n = 1,000 and
missing 3 (groups of about 625, complements of about 375) that is 4 Grams per client instead of 5,
and about 2,100 pairwise masks over a Gram instead of about 3,100; at missing 1 (complements of
about 125) 2 instead of 7.

What the server learns is unchanged: the plan is made only when the ``all`` group's sum is already
a linear combination of the class groups' sums (it is summed anyway, or the all-ones vector lies in
the row space of the class-membership matrix: e.g. every client labels the same number of classes),
so the wire groups' sums and the class groups' sums span the same space, for every survivor set
(a linear identity over the clients holds on any subset of them).  SECURITY.md §4 says it in full.
The sums are integers mod 2⁶⁴: the difference is taken on the unmasked words, before decoding, so a
class's sum is bit for bit the one its own group would have given.

Only a backend whose sums are exact takes a plan (masking; not CKKS, whose decrypted sums carry
noise that a difference of two large sums would scale up).  Every driver applies it the same way:
:func:`plan_difference` on the public memberships, :meth:`DifferencePlan.wire` on each client's
contribution, :meth:`DifferencePlan.wire_layout` for the session, and the backend's ``outcome``
turns the wire sums back into the class sums (:meth:`Layout.logical_words`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from secure_afl.core import encoding
from secure_afl.core.errors import EncodingOverflowError, NonFiniteValueError

from .layout import Derivation, Layout

COMPLEMENT_PREFIX = "others/"


def complement_group(group: str) -> str:
    """The wire group of the clients *not* in ``group`` (for one tensor of ``group``)."""
    return COMPLEMENT_PREFIX + group


def complemented_group(name: str) -> str | None:
    """The group whose complement group ``name`` is (``others/class/3`` -> ``class/3``), else None."""
    return name[len(COMPLEMENT_PREFIX) :] if name.startswith(COMPLEMENT_PREFIX) else None


@dataclass(frozen=True)
class DifferencePlan:
    """Which groups' ``tensor`` travels as ``everyone``'s sum minus a complement group's.

    ``complements`` maps each such group to its complement group's name, or to None when every
    client is in the group (its sum is then ``everyone``'s); ``members`` gives every wire group
    that the plan adds its members.  ``everyone_added``: ``everyone`` carries ``tensor`` only
    because of the plan (the method itself does not sum it), so the result leaves it out.
    """

    tensor: str
    everyone: str
    complements: Mapping[str, str | None]
    members: Mapping[str, tuple[str, ...]]
    everyone_added: bool
    savings: Mapping[str, int] = field(default_factory=dict)  # copies of the tensor: direct, wire

    def describe(self) -> str:
        """One line for logs: what the plan sends and what it saves."""
        return (
            f"{len(self.complements)} class Gram(s) sent by difference "
            f"({self.savings['wire']} Gram copies instead of {self.savings['direct']})"
        )

    def applies_to(self, contribution: Mapping[str, Mapping[str, np.ndarray]]) -> bool:
        """Whether this client sends one value of ``tensor`` to every group it sends it to (the
        plan sends it once per wire group; different values per group must stay apart)."""
        return _one_value(contribution, self.tensor)

    def wire(
        self, contribution: Mapping[str, Mapping[str, np.ndarray]], *, checked: bool = False
    ) -> dict[str, dict[str, np.ndarray]]:
        """One client's contribution as sent: ``tensor`` out of the planned groups it is in, into
        ``everyone`` and the complement of each planned group it is not in (the same array).
        ``checked``: :meth:`applies_to` said so just now (the same test is not made again)."""
        out = {group: dict(tensors) for group, tensors in contribution.items()}
        if not checked and not self.applies_to(contribution):
            raise ValueError(
                f"the difference plan needs one value of {self.tensor!r} in every group a client sends it to"
            )
        value = next(
            (tensors[self.tensor] for tensors in contribution.values() if self.tensor in tensors), None
        )
        if value is None:
            return out  # this client sends no such tensor: nothing moves
        for group, complement in self.complements.items():
            if group in out:
                del out[group][self.tensor]
            elif complement is not None:
                out[complement] = {self.tensor: value}
        out.setdefault(self.everyone, {})[self.tensor] = value
        return out

    def wire_layout(self, layout: Layout) -> Layout:
        """The session's groups as sent, with the derivation that gives back ``layout``'s sums."""
        length = next(g[self.tensor] for g in layout.groups.values() if self.tensor in g)
        groups = {group: dict(tensors) for group, tensors in layout.groups.items()}
        derived: dict[tuple[str, str], Derivation] = {}
        hidden: set[tuple[str, str]] = set()
        for group, complement in self.complements.items():
            del groups[group][self.tensor]
            subtracted = () if complement is None else (complement,)
            derived[(group, self.tensor)] = Derivation((self.everyone,), subtracted)
            if complement is not None:
                groups[complement] = {self.tensor: length}
                hidden.add((complement, self.tensor))
        groups.setdefault(self.everyone, {})[self.tensor] = length
        if self.everyone_added:
            hidden.add((self.everyone, self.tensor))
        return Layout(
            groups=groups,
            shapes=layout.shapes,
            symmetric=layout.symmetric,
            derived=derived,
            hidden=frozenset(hidden),
        )


def plan_difference(
    members: Mapping[str, Collection[str]],
    layout: Layout,
    *,
    min_group_size: int,
    tensor: str = "gram",
    everyone: str = "all",
) -> DifferencePlan | None:
    """The plan that sends fewest copies of ``tensor``, or None when the direct layout is cheaper
    or a plan would change what the server learns.

    ``members``: group -> its members, as every client declares them (public).  A group is sent
    by difference only when its complement is strictly smaller than itself, the complement is
    empty or has at least ``min_group_size`` members, and the group keeps another tensor (so its
    membership stays on the wire).

    Dropouts need no margin.  A complement whose every member drops sums to zero, and the server
    finishes without it (:attr:`Layout.complement_groups`, the server's ``may_be_empty``).  One
    left with 1 to ``min_group_size`` - 1 live members aborts the session, where the direct
    layout would go on; but the direct layout's sums would then determine those members' sum
    (``everyone − S_c`` is in their span whenever a plan is made), which is what the minimum
    group size exists to prevent.
    """
    clients = sorted({cid for ids in members.values() for cid in ids})
    n = len(clients)
    carrying = sorted(g for g, tensors in layout.groups.items() if tensor in tensors and g != everyone)
    if n == 0 or not carrying or layout.derived:
        return None
    present = everyone in layout.groups and tensor in layout.groups[everyone]
    if everyone in members and set(members[everyone]) != set(clients):
        return None  # an `everyone` group that is not everyone: leave the layout as it is
    if not present and not _ones_in_row_space([set(members.get(g, ())) for g in carrying], clients):
        return None  # the everyone-sum would be new information: never
    complements: dict[str, str | None] = {}
    saved = 0
    for group in carrying:
        inside = set(members.get(group, ()))
        outside = n - len(inside)
        if outside >= len(inside) or 0 < outside < max(min_group_size, 1):
            continue
        if len(layout.groups[group]) < 2:
            continue  # the group would vanish from the wire, and its membership with it
        complements[group] = complement_group(group) if outside else None
        saved += len(inside) - outside
    if not complements or saved <= (0 if present else n):
        return None
    direct = sum(len(set(members.get(g, ()))) for g in carrying) + (n if present else 0)
    wire_members = {
        complement: tuple(cid for cid in clients if cid not in set(members.get(group, ())))
        for group, complement in complements.items()
        if complement is not None
    }
    wire_members[everyone] = tuple(clients)
    return DifferencePlan(
        tensor=tensor,
        everyone=everyone,
        complements=complements,
        members=wire_members,
        everyone_added=not present,
        savings={"direct": direct, "wire": direct - saved + (0 if present else n)},
    )


@dataclass(frozen=True)
class PartitionPlan:
    """``everyone``'s ``tensor`` not sent but derived as the sum of ``parts``' sums: groups that
    carry it anyway and partition the clients (each client in exactly one), e.g. the class groups
    when every institution labels one class (``--missing 7`` at 8 clients and 8 classes).

    The wire sums are a subset of the method's, so the server learns no more than it would; the
    derived sum over any survivor set is the sum of the parts' over the same survivors (exact mod
    2⁶⁴).  A client's value is checked here against the fixed-point bound of ``everyone``'s size
    (its session checks only its part's, a smaller group, and the derived sum must not wrap).
    """

    tensor: str
    everyone: str
    parts: tuple[str, ...]
    group_size: int  # everyone's members: each value's bound (encoding.encoding_bound)
    frac_bits: int
    savings: Mapping[str, int] = field(default_factory=dict)  # copies of the tensor: direct, wire
    members: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # no wire group added

    def describe(self) -> str:
        return (
            f"the {self.everyone} group's Gram summed from the {len(self.parts)} class groups that "
            f"partition the clients ({self.savings['wire']} Gram copies instead of {self.savings['direct']})"
        )

    def applies_to(self, contribution: Mapping[str, Mapping[str, np.ndarray]]) -> bool:
        """Whether this client sends one value of ``tensor`` everywhere and to one part only, and
        that value is encodable in a sum over ``everyone``."""
        try:
            self._check(contribution)
        except (ValueError, EncodingOverflowError, NonFiniteValueError):
            return False  # the method's layout: the client's own session refuses a bad value there
        return True

    def _check(self, contribution: Mapping[str, Mapping[str, np.ndarray]]) -> None:
        """Raise ``ValueError`` for a client outside the plan's premise, the encoding's error for a
        value that a sum over ``everyone`` could not hold."""
        parts = [g for g in self.parts if self.tensor in contribution.get(g, {})]
        value = contribution.get(self.everyone, {}).get(self.tensor)
        if len(parts) != (0 if value is None else 1) or not _one_value(contribution, self.tensor):
            raise ValueError(
                f"the partition plan derives {self.everyone}'s {self.tensor!r} from its parts: this "
                f"client sends it to {len(parts)} of them and {'not ' if value is None else ''}to "
                f"{self.everyone} (one of each needed), or different values to different groups"
            )
        if value is not None:
            encoding.check_encodable(
                np.asarray(value, dtype=np.float64),
                tensor=f"{self.everyone}/{self.tensor}",
                frac_bits=self.frac_bits,
                group_size=self.group_size,
            )

    def wire(
        self, contribution: Mapping[str, Mapping[str, np.ndarray]], *, checked: bool = False
    ) -> dict[str, dict[str, np.ndarray]]:
        """One client's contribution as sent: ``tensor`` out of ``everyone`` (the group goes when
        nothing else is in it).  Raises ``ValueError`` for a client outside the plan's premise, and
        the encoding's error (:class:`EncodingOverflowError`, :class:`NonFiniteValueError`) for a
        value that a sum over ``everyone`` could not hold.  ``checked``: :meth:`applies_to` said
        so just now (the value is not read again)."""
        if not checked:
            self._check(contribution)
        out = {group: dict(tensors) for group, tensors in contribution.items()}
        if self.tensor not in out.get(self.everyone, {}):
            return out
        del out[self.everyone][self.tensor]
        if not out[self.everyone]:
            del out[self.everyone]
        return out

    def wire_layout(self, layout: Layout) -> Layout:
        groups = {group: dict(tensors) for group, tensors in layout.groups.items()}
        del groups[self.everyone][self.tensor]
        if not groups[self.everyone]:
            del groups[self.everyone]
        return Layout(
            groups=groups,
            shapes=layout.shapes,
            symmetric=layout.symmetric,
            derived={(self.everyone, self.tensor): Derivation(self.parts)},
        )


WirePlan = DifferencePlan | PartitionPlan


def plan_partition(
    members: Mapping[str, Collection[str]],
    layout: Layout,
    *,
    frac_bits: int,
    tensor: str = "gram",
    everyone: str = "all",
) -> PartitionPlan | None:
    """The plan deriving ``everyone``'s ``tensor`` from the other groups carrying it, when those
    partition the clients; else None.

    ``members``: group -> its members, as every client declares them (public).  ``everyone`` must
    carry ``tensor`` (the method sums it; a plan never adds a sum) and have every client; the other
    groups carrying it must be pairwise disjoint, non-empty and together hold every client.  A
    dropout changes nothing: the parts' survivors partition the survivors, and a part left empty
    aborts the session as it would without the plan (a method group).
    """
    clients = sorted({cid for ids in members.values() for cid in ids})
    if not clients or layout.derived or tensor not in layout.groups.get(everyone, {}):
        return None
    if set(members.get(everyone, ())) != set(clients):
        return None
    parts = sorted(g for g, tensors in layout.groups.items() if tensor in tensors and g != everyone)
    seen: set[str] = set()
    for group in parts:
        inside = set(members.get(group, ()))
        if not inside or inside & seen:
            return None
        seen |= inside
    if seen != set(clients):
        return None
    n = len(clients)
    return PartitionPlan(
        tensor=tensor,
        everyone=everyone,
        parts=tuple(parts),
        group_size=n,
        frac_bits=frac_bits,
        savings={"direct": 2 * n, "wire": n},
    )


def plan_wire(
    members: Mapping[str, Collection[str]],
    layout: Layout,
    *,
    min_group_size: int,
    frac_bits: int,
    tensor: str = "gram",
    everyone: str = "all",
) -> WirePlan | None:
    """The plan that sends fewest copies of ``tensor`` (:func:`plan_difference`,
    :func:`plan_partition`), or None when neither applies or saves anything.  Every driver calls
    this on the public memberships, so the server and every client agree on the wire layout."""
    plans = [
        plan_difference(members, layout, min_group_size=min_group_size, tensor=tensor, everyone=everyone),
        plan_partition(members, layout, frac_bits=frac_bits, tensor=tensor, everyone=everyone),
    ]
    made = [plan for plan in plans if plan is not None]
    return min(made, key=lambda plan: plan.savings["wire"]) if made else None


def _one_value(contribution: Mapping[str, Mapping[str, np.ndarray]], tensor: str) -> bool:
    values = [tensors[tensor] for tensors in contribution.values() if tensor in tensors]
    return all(v is values[0] or np.array_equal(v, values[0]) for v in values[1:])


def _ones_in_row_space(groups: list[set[str]], clients: list[str]) -> bool:
    """Whether some weights α give Σ_g α_g·1[k ∈ g] = 1 for every client k (exact rationals)."""
    patterns = sorted({tuple(int(cid in g) for g in groups) for cid in clients})
    rows = [[Fraction(v) for v in pattern] + [Fraction(1)] for pattern in patterns]
    width = len(groups)
    rank = 0
    for column in range(width):
        pivot = next((r for r in range(rank, len(rows)) if rows[r][column] != 0), None)
        if pivot is None:
            continue
        rows[rank], rows[pivot] = rows[pivot], rows[rank]
        head = rows[rank][column]
        rows[rank] = [v / head for v in rows[rank]]
        for r in range(len(rows)):
            if r != rank and rows[r][column] != 0:
                factor = rows[r][column]
                rows[r] = [a - factor * b for a, b in zip(rows[r], rows[rank], strict=True)]
        rank += 1
    # Consistent iff no row reduced to 0 = 1.
    return all(any(v != 0 for v in row[:width]) or row[width] == 0 for row in rows)
