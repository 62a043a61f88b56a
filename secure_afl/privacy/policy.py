"""A client's own security settings: what it refuses, whatever the server proposes.

The policy is the client's setting, never the server's: a server cannot lower it, it can only
propose a session that the client then refuses.  Two presets:

``ClientPolicy.deployment()`` (a hospital in a real federation; the server is the party we do not
trust): release each value in at most one completed session and answer each round once (the
ledger); refuse any session whose sums would determine one client's value with up to c = n - t
peers colluding (the exposure check); minimum group size >= 2; threshold t >= floor(2n/3) + 1, the bound
under which Bonawitz et al. prove security against an *active* server colluding with fewer than n/3
clients (below it a server that shows two halves of the clients different survivor sets, with a
few colluders signing both, rebuilds both secrets of a target; see SECURITY.md).

``ClientPolicy.simulator()`` (the in-process simulator; every party runs in one process): go on
and report what the sums reveal, attributed to the client that saw it; minimum group size 1;
threshold floor a majority, floor(n/2) + 1 (honest-but-curious server).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from secure_afl.privacy.exposure import client_exposures, linked_groups

ThresholdRule = Literal["majority", "two-thirds"]
ThreatModel = Literal["active", "honest-but-curious"]

ACTIVE = "active"
HONEST_BUT_CURIOUS = "honest-but-curious"

# The largest session config (AdvertiseRequest) a client decodes, and the most groups and tensors
# it accepts in one: they bound the work an R0 message can cost before anything is known.
DEFAULT_MAX_CONFIG_BYTES = 1 << 18  # 256 KiB: a 100-class layout needs about 50 KB
DEFAULT_MAX_GROUPS = 1024
DEFAULT_MAX_LAYOUT_TENSORS = 4096


def majority_threshold(n_clients: int) -> int:
    """floor(n/2) + 1: enough against an honest-but-curious server."""
    return n_clients // 2 + 1


def active_threshold(n_clients: int) -> int:
    """floor(2n/3) + 1: the threshold an active server with colluding clients requires."""
    return 2 * n_clients // 3 + 1


@dataclass(frozen=True, slots=True)
class ClientPolicy:
    """What a client refuses.  Build one with :meth:`deployment` or :meth:`simulator`."""

    name: str
    refuse_exposure: bool
    min_group_size: int
    threshold_rule: ThresholdRule
    max_config_bytes: int = DEFAULT_MAX_CONFIG_BYTES
    max_groups: int = DEFAULT_MAX_GROUPS
    max_layout_tensors: int = DEFAULT_MAX_LAYOUT_TENSORS
    # One contribution per value and one answer per round (the ledger's two rules, SECURITY.md).
    one_contribution: bool = False
    # The exposure check assumes up to c = n - t peers collude with the server (their values known),
    # or at most ``max_colluders`` of them where the institution sets a lower bound of its own.
    assume_colluders: bool = False
    max_colluders: int | None = None

    def __post_init__(self) -> None:
        if self.min_group_size < 1:
            raise ValueError(f"min_group_size must be at least 1, got {self.min_group_size}")
        if self.threshold_rule not in ("majority", "two-thirds"):
            raise ValueError(
                f"threshold_rule must be 'majority' or 'two-thirds', got {self.threshold_rule!r}"
            )
        if self.max_colluders is not None and self.max_colluders < 0:
            raise ValueError(f"max_colluders must be 0 or more, got {self.max_colluders}")
        for name in ("max_config_bytes", "max_groups", "max_layout_tensors"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")

    @classmethod
    def deployment(cls) -> ClientPolicy:
        """Refuse exposure (with up to n - t colluders); min group size 2; t >= floor(2n/3) + 1; one
        contribution per value and one answer per round (defends against an active server)."""
        return cls(
            name="deployment",
            refuse_exposure=True,
            min_group_size=2,
            threshold_rule="two-thirds",
            one_contribution=True,
            assume_colluders=True,
        )

    @classmethod
    def simulator(cls) -> ClientPolicy:
        """Go on and report exposure; min group size 1; t >= floor(n/2) + 1 (honest-but-curious)."""
        return cls(name="simulator", refuse_exposure=False, min_group_size=1, threshold_rule="majority")

    @classmethod
    def named(cls, name: str) -> ClientPolicy:
        """``"deployment"`` or ``"simulator"``."""
        if name == "deployment":
            return cls.deployment()
        if name == "simulator":
            return cls.simulator()
        raise ValueError(f"unknown client policy {name!r}: use 'deployment' or 'simulator'")

    def colluders(self, n_clients: int, threshold: int) -> int:
        """How many peers the exposure check assumes collude: c = n - t (capped by ``max_colluders``).

        ``threshold`` is the client's own floor for t (:meth:`min_threshold`), never the session's:
        a server that raised t would otherwise shrink the colluders assumed (to none at t = n)."""
        if not self.assume_colluders:
            return 0
        bound = max(0, n_clients - threshold)
        return bound if self.max_colluders is None else min(bound, self.max_colluders)

    def min_threshold(self, n_clients: int) -> int:
        """The lowest threshold t this client accepts in a federation of ``n_clients``."""
        if self.threshold_rule == "two-thirds":
            return active_threshold(n_clients)
        return majority_threshold(n_clients)


def threat_model(
    n_clients: int, threshold: int, min_group_size: int, *, refuse_exposure: bool
) -> ThreatModel:
    """Which server a session's parameters defend against.

    ``"active"`` needs all three: t >= floor(2n/3) + 1, groups of at least 2, and clients that
    refuse exposing layouts and survivor sets; anything less defends only an honest-but-curious
    server (one that follows the protocol and merely looks at what it receives).
    """
    if threshold >= active_threshold(n_clients) and min_group_size >= 2 and refuse_exposure:
        return ACTIVE
    return HONEST_BUT_CURIOUS


@dataclass(frozen=True, slots=True)
class LayoutRefusal:
    """Why one client under a policy would refuse a session layout, and in which round."""

    client: str
    round: str
    reason: str


def layout_refusals(
    members: Mapping[str, Sequence[str]],
    tensors: Mapping[str, Collection[str]],
    survivors: Mapping[str, Sequence[str]] | None = None,
    *,
    policy: ClientPolicy,
) -> tuple[LayoutRefusal, ...]:
    """What each client under ``policy`` would refuse in a session over this layout.

    The checks a :class:`~secure_afl.protocol.client.ClientSession` runs on its own groups,
    applied to a layout before any data moves (the session's threshold is taken to meet the
    policy's floor): in R1 a group of its own with fewer members than the minimum group size, and
    (when the policy refuses exposure) a layout whose sums isolate a client with everyone alive;
    in R3 the same exposure check over ``survivors`` (when given), both with the policy's colluders
    (c = n - t at the policy's threshold floor).  Clients send the same value of a tensor to all
    their groups (the tensor-identity rule).  Empty when the policy accepts it.
    """
    out = []
    everyone = sorted({c for group in members.values() for c in group})
    colluders = policy.colluders(len(everyone), policy.min_threshold(len(everyone)))
    for client in everyone:
        own = {group for group, ids in members.items() if client in ids}
        small = sorted(g for g in own if len(members[g]) < policy.min_group_size)
        if small:
            out.append(
                LayoutRefusal(
                    client,
                    "R1",
                    f"group(s) {', '.join(small)} below the minimum group size {policy.min_group_size}",
                )
            )
            continue
        if not policy.refuse_exposure:
            continue
        own_values = {(g, t): f"the value of {t}" for g in own for t in tensors[g]}
        own_tensors = {t for _, t in own_values}
        relevant = linked_groups(own_tensors, {g: tuple(tensors[g]) for g in members})
        stages = [("R1", members)] + ([("R3", survivors)] if survivors is not None else [])
        for round_name, alive in stages:
            view = {g: (tuple(alive.get(g, ())), relevant[g]) for g in relevant}
            findings = client_exposures(client, own_values, view, round_name=round_name, colluders=colluders)
            if findings:
                out.append(LayoutRefusal(client, round_name, "; ".join(f.describe() for f in findings)))
                break
    return tuple(out)
