"""In-process driver of the secure-aggregation protocol (masking backend).

Every client and the server run through their state machines in one process.  Messages are really
encoded to bytes and decoded again, so the byte counts in ``costs`` are those of the wire format.
Timings are measured here, with ``time.perf_counter``, never inside ``secure_afl.protocol``.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from secure_afl.aggregation.layout import flatten, layout_of
from secure_afl.keys.identity import IdentityKey
from secure_afl.keys.roster import Roster, RosterEntry
from secure_afl.privacy.ledger import Ledger
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.protocol import codec, encoding
from secure_afl.protocol.client import ClientSession
from secure_afl.protocol.messages import SessionConfig
from secure_afl.protocol.randomness import OsRandomSource, RandomSource
from secure_afl.protocol.server import ServerSession
from secure_afl.sim.audit import PrivacyAudit, audit_groups

ROUNDS = ("R0", "R1", "R2", "R3", "R4")
DROPOUT_STAGES = ("R1", "R2", "R3", "R4")


@dataclass(frozen=True, slots=True)
class SecureAggregationCosts:
    """Bytes per client per round (R0..R4), client seconds per client per round, server seconds per round."""

    bytes_sent: Mapping[str, Mapping[str, int]]
    bytes_received: Mapping[str, Mapping[str, int]]
    client_seconds: Mapping[str, Mapping[str, float]]
    server_seconds: Mapping[str, float]

    @property
    def total_client_seconds(self) -> float:
        return sum(sum(rounds.values()) for rounds in self.client_seconds.values())

    @property
    def total_server_seconds(self) -> float:
        return sum(self.server_seconds.values())


@dataclass(frozen=True, slots=True)
class SecureAggregationResult:
    """The group sums the server learns, and the audit of what that reveals."""

    sums: Mapping[str, Mapping[str, np.ndarray]]  # group -> tensor -> float64 (full matrix if symmetric)
    members: Mapping[str, tuple[str, ...]]
    survivors: Mapping[str, tuple[str, ...]]
    audit: PrivacyAudit  # per group, and what linear combinations of the sums expose
    costs: SecureAggregationCosts
    threshold: int
    frac_bits: int
    session_id: bytes

    @property
    def exposed(self) -> Mapping[str, tuple[str, ...]]:
        """Tensor -> the clients whose individual value follows from linear combinations of the sums."""
        return self.audit.exposed

    @property
    def warnings(self) -> tuple[str, ...]:
        """Every loud audit line, for reports."""
        return tuple(self.audit.warnings())


def default_threshold(n_clients: int) -> int:
    """t = floor(n/2) + 1: a strict majority (1 for one client, 2 for two, 5 for eight)."""
    return n_clients // 2 + 1


def secure_aggregate(
    contributions: Mapping[str, Mapping[str, Mapping[str, np.ndarray]]],
    *,
    symmetric: Collection[str] = ("gram",),
    threshold: int | None = None,
    min_group_size: int = 1,
    dropouts: Mapping[str, Collection[str]] = MappingProxyType({}),
    frac_bits: int = encoding.DEFAULT_FRAC_BITS,
    random: RandomSource | None = None,
    session_id: bytes | None = None,
    client_policy: ClientPolicy | None = None,
    ledgers: Mapping[str, Ledger] | None = None,
) -> SecureAggregationResult:
    """Sum ``contributions`` (client -> group -> tensor -> float64 array) per group by secure aggregation.

    ``symmetric`` names tensors that are symmetric matrices (sent as their upper triangle).
    ``threshold`` defaults to :func:`default_threshold`.  ``dropouts`` maps a stage ("R1".."R4") to
    the clients that stop answering at that stage.  Raises :class:`GroupTooSmallError` when a group's
    survivors are fewer than ``min_group_size`` and :class:`InsufficientParticipantsError` when fewer
    than t clients answer a round.  ``client_policy`` is every client's own policy (default
    :meth:`ClientPolicy.simulator`: go on and report exposures, which the audit attributes to the
    clients that saw them); under :meth:`ClientPolicy.deployment` a client refuses an exposing
    session with :class:`~secure_afl.protocol.errors.ExposureRefusedError`.  ``ledgers`` gives a
    client its session ledger (none by default: each call is a fresh history).
    """
    client_policy = ClientPolicy.simulator() if client_policy is None else client_policy
    ledgers = {} if ledgers is None else ledgers
    random = OsRandomSource() if random is None else random
    client_ids = tuple(sorted(contributions))
    if not client_ids:
        raise ValueError("no contributions")
    n = len(client_ids)
    threshold = default_threshold(n) if threshold is None else threshold
    if not 1 <= threshold <= n:
        raise ValueError(f"threshold must be in 1..{n}, got {threshold}")
    drop_stage = _dropout_stages(dropouts, client_ids)
    layout = layout_of(contributions, symmetric)
    members = {
        group: tuple(cid for cid in client_ids if group in contributions[cid])
        for group in sorted(layout.groups)
    }
    session_id = random.token_bytes(32) if session_id is None else session_id
    config = SessionConfig(
        session_id=session_id,
        threshold=threshold,
        min_group_size=min_group_size,
        frac_bits=frac_bits,
        groups=layout.group_specs(),
    )
    identities = {cid: IdentityKey.generate(random) for cid in client_ids}
    roster = Roster(RosterEntry(cid, cid, identities[cid].public_key) for cid in client_ids)
    # A client's Gram shared by several groups is packed once.  The key holds the packing too (one
    # array may be a symmetric tensor in one group and a plain one in another), and the entry keeps
    # the original array alive so its id cannot be reused by another array while the cache lives.
    flattened: dict[tuple[int, bool], tuple[np.ndarray, np.ndarray]] = {}

    def wire_vector(values: np.ndarray, name: str) -> np.ndarray:
        key = (id(values), name in symmetric)
        entry = flattened.get(key)
        if entry is None or entry[0] is not values:
            entry = (values, flatten(values, key[1]))
            flattened[key] = entry
        return entry[1]

    # The simulator's clients accept what the simulator's server proposes; a client under any other
    # policy keeps that policy's own floors (a deployed client never takes them from the server).
    floors = (
        {"min_threshold": threshold, "min_group_size": min_group_size}
        if client_policy == ClientPolicy.simulator()
        else {}
    )
    clients = {
        cid: ClientSession(
            cid,
            identities[cid],
            roster,
            {
                group: {name: wire_vector(values, name) for name, values in tensors.items()}
                for group, tensors in contributions[cid].items()
            },
            **floors,
            session_id=session_id,
            random=random,
            policy=client_policy,
            ledger=ledgers.get(cid),
        )
        for cid in client_ids
    }
    server = ServerSession(roster, config)
    # Message sizes follow the layout (a MaskedInput carries every tensor of a client's groups), so
    # a large layout (VGG features: one 4096-d Gram triangle is 67 MB, sent to several groups) is
    # not cut off by a fixed cap, and anything larger than an honest message is still refused.
    server_limit = server.max_message_bytes

    bytes_sent = {cid: dict.fromkeys(ROUNDS, 0) for cid in client_ids}
    bytes_received = {cid: dict.fromkeys(ROUNDS, 0) for cid in client_ids}
    client_seconds = {cid: dict.fromkeys(ROUNDS, 0.0) for cid in client_ids}
    server_seconds = dict.fromkeys(ROUNDS, 0.0)

    started = time.perf_counter()
    first_request = server.start()
    requests = dict.fromkeys(client_ids, first_request)
    server_seconds["R0"] += time.perf_counter() - started
    dropped: set[str] = set()
    for round_name in ROUNDS:
        dropped |= {cid for cid, stage in drop_stage.items() if stage == round_name}
        started = time.perf_counter()
        wire: dict[int, bytes] = {}  # a broadcast message is encoded once
        for request in requests.values():
            if id(request) not in wire:
                wire[id(request)] = codec.encode(request, max_message_bytes=server_limit)
        server_seconds[round_name] += time.perf_counter() - started
        for cid, request in requests.items():
            if cid in dropped:
                continue
            data = wire[id(request)]
            client = clients[cid]
            started = time.perf_counter()
            encoded_replies = client.receive_bytes(data)  # per-message-type size limits
            client_seconds[cid][round_name] += time.perf_counter() - started
            bytes_received[cid][round_name] += len(data)
            for reply_bytes in encoded_replies:
                bytes_sent[cid][round_name] += len(reply_bytes)
                started = time.perf_counter()
                server.receive(codec.decode(reply_bytes, max_message_bytes=server_limit))
                server_seconds[round_name] += time.perf_counter() - started
        started = time.perf_counter()
        requests = server.next_round()  # type: ignore[assignment]
        server_seconds[round_name] += time.perf_counter() - started

    result = server.result()
    sums: dict[str, dict[str, np.ndarray]] = {}
    for group, group_sum in result.groups.items():
        sums[group] = {}
        for name, words in group_sum.sums.items():
            sums[group][name] = layout.unflatten(name, encoding.decode(words, frac_bits=frac_bits))
    survivors = {group: result.groups[group].survivors for group in members}
    audit = audit_groups(
        protection="mask",
        members=members,
        survivors=survivors,
        tensors={group: tuple(layout.groups[group]) for group in members},
        contributions=contributions,
        client_findings={cid: client.exposure_findings for cid, client in clients.items()},
    )
    return SecureAggregationResult(
        sums=sums,
        members=members,
        survivors=survivors,
        audit=audit,
        costs=SecureAggregationCosts(bytes_sent, bytes_received, client_seconds, server_seconds),
        threshold=threshold,
        frac_bits=frac_bits,
        session_id=session_id,
    )


def _dropout_stages(dropouts: Mapping[str, Collection[str]], client_ids: tuple[str, ...]) -> dict[str, str]:
    stage_of: dict[str, str] = {}
    for stage, ids in dropouts.items():
        if stage not in DROPOUT_STAGES:
            raise ValueError(f"unknown dropout stage {stage!r}; expected one of {DROPOUT_STAGES}")
        for cid in ids:
            if cid not in client_ids:
                raise ValueError(f"dropout of unknown client {cid!r}")
            if cid in stage_of:
                raise ValueError(f"client {cid!r} drops at two stages")
            stage_of[cid] = stage
    return stage_of
