"""A small in-test driver that lets tests intercept and tamper with every message."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.core.workers import Threads
from secure_afl.keys.identity import IdentityKey
from secure_afl.keys.roster import Roster, RosterEntry
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.protocol import codec
from secure_afl.protocol.client import ClientSession
from secure_afl.protocol.messages import GroupSpec, SessionConfig, TensorSpec
from secure_afl.protocol.server import ServerSession

ROUND_NAMES = ("R0", "R1", "R2", "R3", "R4")


@dataclass
class Federation:
    roster: Roster
    identities: dict[str, IdentityKey]
    clients: dict[str, ClientSession]
    server: ServerSession
    config: SessionConfig
    members: dict[str, tuple[str, ...]]
    inputs: dict[str, dict[str, dict[str, np.ndarray]]]  # client -> group -> tensor -> float64
    requests: dict = field(default_factory=dict)  # the server's pending requests, by recipient
    log: list = field(default_factory=list)  # every (direction, round, client, message)


def make_federation(
    n: int = 4,
    groups: Mapping[str, tuple[str, ...]] | None = None,
    *,
    threshold: int | None = None,
    min_group_size: int = 1,
    client_min_group_size: int | None = None,
    lengths: Mapping[str, int] | None = None,
    seed: bytes = b"federation",
    session_id: bytes | None = None,
    values: str = "random",
    policy: ClientPolicy | None = None,
) -> Federation:
    """A federation of ``n`` clients; by default under the simulator's policy (these tests exercise
    the protocol's checks, not the exposure check: tests/protocol/test_malicious_server.py does)."""
    random = DeterministicRandomSource(seed)
    ids = tuple(f"c{i}" for i in range(n))
    groups = {"all": ids} if groups is None else dict(groups)
    lengths = {"x": 5, "y": 3} if lengths is None else dict(lengths)
    threshold = n // 2 + 1 if threshold is None else threshold
    identities = {cid: IdentityKey.generate(random) for cid in ids}
    roster = Roster(RosterEntry(cid, f"Hospital {cid}", identities[cid].public_key) for cid in ids)
    config = SessionConfig(
        session_id=random.token_bytes(32) if session_id is None else session_id,
        threshold=threshold,
        min_group_size=min_group_size,
        frac_bits=32,
        groups=tuple(
            GroupSpec(g, tuple(TensorSpec(t, length) for t, length in sorted(lengths.items())))
            for g in sorted(groups)
        ),
    )
    rng = np.random.default_rng(int.from_bytes(random.token_bytes(4), "big"))
    inputs: dict[str, dict[str, dict[str, np.ndarray]]] = {}
    for cid in ids:
        inputs[cid] = {}
        for g, members in groups.items():
            if cid in members:
                inputs[cid][g] = {
                    t: (np.zeros(length) if values == "zeros" else rng.normal(scale=100.0, size=length))
                    for t, length in lengths.items()
                }
    clients = {
        cid: ClientSession(
            cid,
            identities[cid],
            roster,
            inputs[cid],
            min_threshold=threshold,
            min_group_size=min_group_size if client_min_group_size is None else client_min_group_size,
            random=random,
            policy=ClientPolicy.simulator() if policy is None else policy,
        )
        for cid in ids
    }
    server = ServerSession(roster, config)
    members = {g: tuple(sorted(m)) for g, m in groups.items()}
    return Federation(roster, identities, clients, server, config, members, inputs)


def wire(message):
    """Encode and decode, as a real transport would."""
    return codec.decode(codec.encode(message))


def play_round(fed: Federation, round_name: str, *, drop: set[str] = frozenset()) -> dict:
    """Deliver the pending requests, feed the replies to the server, close the round."""
    if round_name == "R0":
        request = fed.server.start()
        fed.requests = dict.fromkeys(fed.clients, request)
    for cid, request in sorted(fed.requests.items()):
        if cid in drop:
            continue
        fed.log.append(("to-client", round_name, cid, request))
        for reply in fed.clients[cid].receive(wire(request)):
            fed.log.append(("to-server", round_name, cid, reply))
            fed.server.receive(wire(reply))
    fed.requests = fed.server.next_round()
    return fed.requests


def play(fed: Federation, *, until: str = "R4", drops: Mapping[str, set[str]] | None = None) -> None:
    """Play rounds R0..``until`` inclusive; ``drops`` maps a round to the clients silent from then on."""
    drops = drops or {}
    dropped: set[str] = set()
    for round_name in ROUND_NAMES:
        dropped |= set(drops.get(round_name, ()))
        play_round(fed, round_name, drop=dropped)
        if round_name == until:
            return


class CountingThreads(Threads):
    """Threads that record how many tasks each call was split into (tests/test_workers.py shows
    that the tasks run on threads of their own)."""

    def __init__(self, count: int) -> None:
        super().__init__(count)
        object.__setattr__(self, "splits", [])

    def run(self, tasks):  # type: ignore[no-untyped-def]
        self.splits.append(len(tasks))  # type: ignore[attr-defined]
        super().run(tasks)
