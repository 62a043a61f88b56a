"""The privacy audit: per group, who was in it, who survived, and what the server's sums reveal.

Beyond listing each group's sum, the audit works out what the server can *derive*: a tensor name
denotes the same client value wherever it appears (see :mod:`secure_afl.analytic`), so when one
tensor is summed over several overlapping groups the server learns every linear combination of
those sums.  Client ``k``'s own value is exposed exactly when the indicator vector ``e_k`` lies in
the row space of the groups' survivor-incidence matrix.  Example: 8 clients each missing one class
and a per-class Gram: the 8 "all but one" sums determine every client's Gram individually.

The rank test is :func:`secure_afl.privacy.exposure.exposed_clients`, the one the clients run on
themselves before they sign or reveal.  Since the audit runs at the server (the party we do not
trust), it also lists what each *client* found (``client_findings``): a deployed client refuses
such a session, the simulator's clients go on and report it here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from secure_afl.aggregation.difference import complemented_group
from secure_afl.privacy.exposure import (
    ExposureFinding,
    OneMemberApart,
    exposed_clients,
    one_member_apart,
    value_family,
)
from secure_afl.privacy.guarantees import guarantee

if TYPE_CHECKING:
    from secure_afl.aggregation.inprocess import InProcessRun

SINGLE_SURVIVOR_WARNING = "the server learns this client's statistics exactly"


def trust_models(protection: str, client_policy: str = "simulator") -> dict[str, str]:
    """What each protection of a run ("none", "mask", "ckks" or "mask,ckks") guarantees under its
    clients' policy, one line each (:mod:`secure_afl.privacy.guarantees`)."""
    return {name: guarantee(name, client_policy).text for name in protection.split(",")}


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
    # tensor -> the clients whose individual value follows from the group sums (non-empty only)
    exposed: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # client -> what its own exposure check found (R3/R4) and went on past (simulator policy)
    client_findings: Mapping[str, tuple[ExposureFinding, ...]] = field(default_factory=dict)
    # the policy the session's clients ran under (privacy.guarantees: which guarantee applies)
    client_policy: str = "simulator"
    # pairs of groups one member apart over survivors (privacy.exposure.one_member_apart)
    one_member_apart: tuple[OneMemberApart, ...] = ()

    def seen_by_clients(self) -> dict[str, list[str]]:
        """Client -> one line per tensor its own check found exposed (last round it checked)."""
        out: dict[str, list[str]] = {}
        for client, findings in sorted(self.client_findings.items()):
            last: dict[tuple[str, tuple[str, ...], bool], ExposureFinding] = {}
            for finding in findings:
                last[(finding.tensor, finding.clients, finding.with_history)] = finding
            if last:
                out[client] = [f.describe() for f in last.values()]
        return out

    def group(self, name: str) -> GroupAudit:
        for group in self.groups:
            if group.group == name:
                return group
        raise KeyError(f"no group {name!r} in the audit")

    def warnings(self) -> list[str]:
        if self.protection == "none":
            return ["plaintext run: the server receives every client's statistics individually"]
        lines = [g.warning for g in self.groups if g.warning]
        by_clients: dict[tuple[str, ...], list[str]] = {}
        for tensor, clients in self.exposed_by_overlap().items():
            by_clients.setdefault(clients, []).append(tensor)
        for clients, tensors in by_clients.items():
            linked = [t for t in tensors if value_family(t.split(" + ")[0]).startswith("family:")]
            plain = [t for t in tensors if t not in linked]
            if plain:
                lines.append(
                    f"the group sums determine the individual values of {', '.join(plain)} for "
                    f"{', '.join(clients)}: sum a tensor that every client sends to several groups in one "
                    "all-clients group instead (for the Gram: gram='global')"
                )
            if linked:
                lines.append(
                    f"a server that chose round 2's teacher W adversarially (columns made equal or "
                    f"related) could recover the round-2 statistics {', '.join(linked)} of "
                    f"{', '.join(clients)} from these groups: the deployment forms only pseudo groups "
                    "no node refuses (SECURITY.md, the adversarial rule), or run one round"
                )
        return lines

    def exposed_by_overlap(self) -> dict[str, tuple[str, ...]]:
        """Exposures that come from combining overlapping groups, not from a lone survivor.  A lone
        survivor of a difference plan's complement group counts as overlap: the plan sends its
        value there only because the overlapping groups' sums determine it anyway."""
        out = {}
        for tensor, clients in self.exposed.items():
            alone = {g.survivors[0] for g in self.single_member_groups() if tensor in g.tensors}
            rest = tuple(c for c in clients if c not in alone)
            if rest:
                out[tensor] = rest
        return out

    def single_member_groups(self) -> list[GroupAudit]:
        """The groups with one survivor, a difference plan's complement groups left out (they
        carry what the overlapping groups determine: :meth:`exposed_by_overlap`)."""
        return [g for g in self.groups if len(g.survivors) == 1 and complemented_group(g.group) is None]

    def single_member_complements(self) -> list[GroupAudit]:
        """A difference plan's complement groups with one survivor: the rest of the one-survivor
        groups, which :meth:`single_member_groups` leaves out."""
        return [g for g in self.groups if len(g.survivors) == 1 and complemented_group(g.group) is not None]

    def to_dict(self) -> dict[str, object]:
        return {
            "protection": self.protection,
            "trust_model": trust_models(self.protection, self.client_policy),
            "groups": [g.to_dict() for g in self.groups],
            "individually_exposed": {t: list(c) for t, c in self.exposed.items()},
            "one_member_apart": [
                {"larger": p.larger, "smaller": p.smaller, "member": p.member, "kinds": list(p.kinds)}
                for p in self.one_member_apart
            ],
            "seen_by_clients": self.seen_by_clients(),
            "warnings": self.warnings(),
        }


def restrict(audit: PrivacyAudit, keep: Callable[[str, str], bool], **kwargs: object) -> PrivacyAudit:
    """The audit of a protocol that summed only the (group, tensor) pairs that ``keep`` accepts."""
    tensors = {g.group: tuple(t for t in g.tensors if keep(g.group, t)) for g in audit.groups}
    groups = [g for g in audit.groups if tensors[g.group]]
    return audit_groups(
        protection=audit.protection,
        client_policy=audit.client_policy,
        members={g.group: g.members for g in groups},
        survivors={g.group: g.survivors for g in groups},
        tensors={g.group: tensors[g.group] for g in groups},
        **kwargs,  # type: ignore[arg-type]
    )


def audit_run(
    run: InProcessRun,
    contributions: Mapping[str, Mapping[str, Mapping[str, np.ndarray]]],
    *,
    protection: str,
    client_policy: str = "simulator",
) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]], PrivacyAudit]:
    """Members and survivors of the method's groups, and the audit of the groups as sent, of an
    in-process run of any protection backend whose clients ran under ``client_policy``."""
    outcome = run.outcome
    members = {group: tuple(outcome.members[group]) for group in sorted(outcome.members)}
    survivors = {group: tuple(outcome.survivors[group]) for group in members}
    wire = [group for group in members if group in run.layout.groups]  # the audit: groups as sent
    audit = audit_groups(
        protection=protection,
        client_policy=client_policy,
        members={group: members[group] for group in wire},
        survivors={group: survivors[group] for group in wire},
        tensors={group: tuple(run.layout.groups[group]) for group in wire},
        contributions=contributions,
        client_findings={cid: client.exposure_findings for cid, client in run.clients.items()},  # type: ignore[attr-defined]
    )
    return members, survivors, audit


def audit_groups(
    *,
    protection: str,
    members: Mapping[str, Sequence[str]],
    survivors: Mapping[str, Sequence[str]],
    tensors: Mapping[str, Sequence[str]],
    contributions: Mapping[str, Mapping[str, Mapping[str, np.ndarray]]] | None = None,
    client_findings: Mapping[str, Sequence[ExposureFinding]] | None = None,
    client_policy: str = "simulator",
) -> PrivacyAudit:
    """Build the audit from group memberships, survivor sets and the tensors summed per group.

    A tensor name is taken to denote one client value across groups.  When ``contributions`` are at
    hand (in the simulator) that is checked: a client that sends different values of one tensor to
    different groups has one unknown per group for it.  ``client_findings`` are what the clients'
    own checks found (attributed to the client that saw them); ``client_policy`` the policy they
    ran under.  The audit also lists the groups whose survivors are one member apart
    (:func:`~secure_afl.privacy.exposure.one_member_apart`).
    """
    clients = sorted({c for group in members.values() for c in group})
    groups = []
    for name in sorted(members):
        alive = tuple(survivors.get(name, ()))
        warning = None
        if protection != "none" and len(alive) == 1:
            complemented = complemented_group(name)
            if complemented is None:
                warning = (
                    f"group {name!r} has a single surviving member ({alive[0]}): {SINGLE_SURVIVOR_WARNING}; "
                    "no aggregation can hide them"
                )
            else:
                warning = (
                    f"group {name!r} has a single surviving member ({alive[0]}): it carries that client's "
                    f"{', '.join(sorted(tensors[name]))} only for the server to derive {complemented!r}'s "
                    "sum by difference, and the overlapping class sums determine it anyway (gram='global' "
                    "sums every Gram in one all-clients group)"
                )
        groups.append(GroupAudit(name, tuple(members[name]), alive, tuple(sorted(tensors[name])), warning))
    names = sorted({t for group in groups for t in group.tensors})
    if protection == "none":
        exposed = {t: tuple(clients) for t in names}
    else:
        distinct = {} if contributions is None else _distinct_values(contributions, names)
        exposed = exposed_clients({g.group: (g.survivors, g.tensors) for g in groups}, distinct=distinct)
    findings = {c: tuple(f) for c, f in (client_findings or {}).items() if f}
    apart = (
        ()
        if protection == "none"
        else one_member_apart({g.group: g.survivors for g in groups}, {g.group: g.tensors for g in groups})
    )
    return PrivacyAudit(
        protection=protection,
        groups=tuple(groups),
        exposed=exposed,
        client_findings=findings,
        client_policy=client_policy,
        one_member_apart=apart,
    )


def audit_view(
    contributions: Mapping[str, Mapping[str, Mapping[str, np.ndarray]]],
) -> dict[str, dict[str, dict[str, np.ndarray]]]:
    """What :func:`audit_groups` reads of ``contributions``, without their memory: per client and
    tensor name, each value becomes a one-word token, the same token object for one array object
    or for equal arrays, different tokens for different values (all the audit compares), so the
    audit of the view is the audit of the contributions and the arrays can go (at d = 4096 a
    client's Gram is 64 MiB)."""
    view: dict[str, dict[str, dict[str, np.ndarray]]] = {}
    for client, by_group in contributions.items():
        classes: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}  # tensor -> (a value, its token)
        view[client] = {}
        for group, tensors in by_group.items():
            view[client][group] = {}
            for name, values in tensors.items():
                seen = classes.setdefault(name, [])
                token = next((t for v, t in seen if v is values), None)
                if token is None:
                    token = next((t for v, t in seen if np.array_equal(v, values)), None)
                if token is None:
                    token = np.array([float(len(seen))])
                    token.setflags(write=False)
                    seen.append((values, token))
                view[client][group][name] = token
    return view


def _distinct_values(
    contributions: Mapping[str, Mapping[str, Mapping[str, np.ndarray]]], names: Sequence[str]
) -> dict[str, set[str]]:
    """Per client, the tensors it sends with values that are not bit-identical in all its groups."""
    out: dict[str, set[str]] = {}
    for client, by_group in contributions.items():
        for tensor in names:
            values = [tensors[tensor] for tensors in by_group.values() if tensor in tensors]
            # One array given to several groups (the simulator's Gram) is equal to itself: its
            # values are finite (the encoder refuses others), so no element-wise pass is needed.
            if any(other is not values[0] and not np.array_equal(values[0], other) for other in values[1:]):
                out.setdefault(client, set()).add(tensor)
    return out
