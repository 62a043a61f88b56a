"""The privacy audit: per group, who was in it, who survived, and what the server's sums reveal.

Beyond listing each group's sum, the audit works out what the server can *derive*: a tensor name
denotes the same client value wherever it appears (see :mod:`secure_afl.analytic`), so when one
tensor is summed over several overlapping groups the server learns every linear combination of
those sums.  Client ``k``'s own value is exposed exactly when the indicator vector ``e_k`` lies in
the row space of the groups' survivor-incidence matrix.  Example: 8 clients each missing one class
and a per-class Gram: the 8 "all but one" sums determine every client's Gram individually.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class GroupAudit:
    group: str
    members: tuple[str, ...]
    survivors: tuple[str, ...]
    tensors: tuple[str, ...]
    warning: str | None = None

    def to_dict(self) -> dict[str, object]:
        return {
            "group": self.group,
            "members": list(self.members),
            "survivors": list(self.survivors),
            "server_learns": [f"sum over survivors of {t}" for t in self.tensors],
            "warning": self.warning,
        }


@dataclass(frozen=True)
class PrivacyAudit:
    protection: str
    groups: tuple[GroupAudit, ...]
    exposed: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # tensor -> clients exposed

    def warnings(self) -> list[str]:
        if self.protection == "none":
            return ["plaintext run: the server receives every client's statistics individually"]
        lines = [g.warning for g in self.groups if g.warning]
        by_clients: dict[tuple[str, ...], list[str]] = {}
        for tensor, clients in self.exposed.items():
            if clients:
                by_clients.setdefault(clients, []).append(tensor)
        for clients, tensors in by_clients.items():
            lines.append(
                f"the group sums determine the individual values of {', '.join(tensors)} for "
                f"{', '.join(clients)}"
            )
        return lines

    def to_dict(self) -> dict[str, object]:
        return {
            "protection": self.protection,
            "groups": [g.to_dict() for g in self.groups],
            "individually_exposed": {t: list(c) for t, c in self.exposed.items()},
            "warnings": self.warnings(),
        }


def exposed_clients(groups: Sequence[Sequence[str]], clients: Sequence[str]) -> tuple[str, ...]:
    """Clients whose individual value follows from the sums over ``groups`` (sets of clients)."""
    if not groups:
        return ()
    index = {c: i for i, c in enumerate(clients)}
    incidence = np.zeros((len(groups), len(clients)))
    for row, members in enumerate(groups):
        incidence[row, [index[m] for m in members]] = 1.0
    rank = np.linalg.matrix_rank(incidence)
    exposed = []
    for client, col in index.items():
        unit = np.zeros((1, len(clients)))
        unit[0, col] = 1.0
        if np.linalg.matrix_rank(np.vstack([incidence, unit])) == rank:
            exposed.append(client)
    return tuple(exposed)


def audit_groups(
    *,
    protection: str,
    members: Mapping[str, Sequence[str]],
    survivors: Mapping[str, Sequence[str]],
    tensors: Mapping[str, Sequence[str]],
) -> PrivacyAudit:
    """Build the audit from group memberships, survivor sets and the tensors summed per group."""
    clients = sorted({c for group in members.values() for c in group})
    groups = []
    for name in sorted(members):
        alive = tuple(survivors.get(name, ()))
        warning = None
        if protection == "none":
            warning = None
        elif len(alive) == 1:
            warning = (
                f"group {name!r} has a single surviving member ({alive[0]}): the server learns this "
                "client's statistics exactly; no aggregation can hide them"
            )
        groups.append(GroupAudit(name, tuple(members[name]), alive, tuple(sorted(tensors[name])), warning))
    exposed: dict[str, tuple[str, ...]] = {}
    if protection == "none":
        every = sorted({t for names in tensors.values() for t in names})
        exposed = {t: tuple(clients) for t in every}
    else:
        by_tensor: dict[str, list[tuple[str, ...]]] = {}
        for group in groups:
            for tensor in group.tensors:
                by_tensor.setdefault(tensor, []).append(group.survivors)
        exposed = {t: exposed_clients(sets, clients) for t, sets in sorted(by_tensor.items())}
    return PrivacyAudit(protection=protection, groups=tuple(groups), exposed=exposed)
