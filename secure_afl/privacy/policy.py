"""A client's own security settings: what it refuses, whatever the server proposes.

The policy is the client's setting, never the server's: a server cannot lower it, it can only
propose a session that the client then refuses.  Two presets:

``ClientPolicy.deployment()`` (a hospital in a real federation; the server is the party we do not
trust): refuse any session whose sums would determine one client's value (the exposure check, with
the ledger of earlier sessions); minimum group size >= 2; threshold t >= floor(2n/3) + 1, the bound
under which Bonawitz et al. prove security against an *active* server colluding with fewer than n/3
clients (below it a server that shows two halves of the clients different survivor sets, with a
few colluders signing both, rebuilds both secrets of a target; see SECURITY.md).

``ClientPolicy.simulator()`` (the in-process simulator; every party runs in one process): go on
and report what the sums reveal, attributed to the client that saw it; minimum group size 1;
threshold floor a majority, floor(n/2) + 1 (honest-but-curious server).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ThresholdRule = Literal["majority", "two-thirds"]
ThreatModel = Literal["active", "honest-but-curious"]

ACTIVE = "active"
HONEST_BUT_CURIOUS = "honest-but-curious"

# The largest session config (AdvertiseRequest) a client decodes, and the most groups and tensors
# it accepts in one: they bound the work an R0 message can cost before anything is known.
DEFAULT_MAX_CONFIG_BYTES = 1 << 20
DEFAULT_MAX_GROUPS = 1024
DEFAULT_MAX_LAYOUT_TENSORS = 16384


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

    def __post_init__(self) -> None:
        if self.min_group_size < 1:
            raise ValueError(f"min_group_size must be at least 1, got {self.min_group_size}")
        if self.threshold_rule not in ("majority", "two-thirds"):
            raise ValueError(
                f"threshold_rule must be 'majority' or 'two-thirds', got {self.threshold_rule!r}"
            )
        for name in ("max_config_bytes", "max_groups", "max_layout_tensors"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")

    @classmethod
    def deployment(cls) -> ClientPolicy:
        """Refuse exposure; min group size 2; t >= floor(2n/3) + 1 (defends against an active server)."""
        return cls(name="deployment", refuse_exposure=True, min_group_size=2, threshold_rule="two-thirds")

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
