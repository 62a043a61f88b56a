"""The in-process driver: every client and the server of one session, in one process, any backend.

Messages are really encoded to bytes and decoded again, so the byte counts are those of the wire
format.  Timings are measured here, with ``time.perf_counter``, never inside ``secure_afl.protocol``.
The driver generates the identities and the roster itself: it measures and checks, it is not a
security boundary.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Collection, Mapping, MutableMapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from secure_afl.core import heap
from secure_afl.core.randomness import OsRandomSource, RandomSource
from secure_afl.keys.identity import IdentityKey
from secure_afl.keys.roster import Roster, RosterEntry

from .backend import ProtectionBackend, SessionOutcome
from .difference import plan_wire
from .layout import Layout, flatten, layout_of, members_of


@dataclass(frozen=True, slots=True)
class SessionCosts:
    """Bytes per client per round, client seconds per client per round, server seconds per round."""

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


@dataclass(frozen=True)
class InProcessRun:
    outcome: SessionOutcome
    costs: SessionCosts
    session_id: bytes
    clients: Mapping[str, object]  # the client sessions, for checks after the run
    layout: Layout  # the session's groups and tensors


def run_in_process(
    backend: ProtectionBackend,
    contributions: Mapping[str, Mapping[str, Mapping[str, np.ndarray]]],
    *,
    symmetric: Collection[str] = ("gram",),
    min_group_size: int = 1,
    dropouts: Mapping[str, Collection[str]] = MappingProxyType({}),
    random: RandomSource | None = None,
    session_id: bytes | None = None,
    context: bytes = b"",
    difference: bool = True,
    unpack: bool = True,
    consume: bool = False,
) -> InProcessRun:
    """Sum ``contributions`` (client -> group -> tensor -> float64 array) per group through ``backend``.

    ``dropouts`` maps a round label of ``backend.rounds`` (not the first) to the clients that stop
    answering from that round on.  ``context`` is the session context every client and the server
    bind (:func:`secure_afl.protocol.binding.session_context`; empty: none).  ``difference``: a
    backend with exact sums sends the Gram by difference where that sends fewer copies
    (:mod:`.difference`; the same sums, bit for bit, and the same span of them); False keeps
    every group as the contributions name it.  The run's ``layout`` is the wire's.  ``unpack=False``
    leaves each symmetric tensor's sum as its packed upper triangle (as a contribution may also
    give it: :func:`~secure_afl.aggregation.layout.flatten`).  ``consume=True`` hands the inputs
    over: ``contributions`` (a dict) is emptied once every client session holds its own, and a
    session that lets its values go once sent (the masking client after R2) frees them then, when
    nothing else holds them (at d = 4096 a client's Gram is 64 MiB).
    """
    if consume and not isinstance(contributions, MutableMapping):
        raise TypeError(
            f"consume=True empties the contributions: pass a dict, not a {type(contributions).__name__}"
        )
    given = contributions
    random = OsRandomSource() if random is None else random
    client_ids = tuple(sorted(contributions))
    if not client_ids:
        raise ValueError("no contributions")
    drop_stage = dropout_stages(dropouts, client_ids, backend.rounds[1:])
    layout = layout_of(contributions, symmetric)
    plan = None
    if difference and backend.exact_sums:
        members = members_of(contributions)
        # an exact backend's fixed point: a partition plan checks each value against `all`'s bound
        frac_bits: int = backend.frac_bits  # type: ignore[attr-defined]
        plan = plan_wire(members, layout, min_group_size=min_group_size, frac_bits=frac_bits)
        if plan is not None and not all(plan.applies_to(contributions[cid]) for cid in client_ids):
            # a client sends different Grams to different groups (keep them apart), or one that
            # only its own session should refuse (the method's layout, where it would)
            plan = None
    if plan is not None:
        contributions = {cid: plan.wire(contributions[cid], checked=True) for cid in client_ids}
        layout = plan.wire_layout(layout)
    session_id = random.token_bytes(32) if session_id is None else session_id
    identities = {cid: IdentityKey.generate(random) for cid in client_ids}
    roster = Roster(RosterEntry(cid, cid, identities[cid].public_key) for cid in client_ids)
    # A client's Gram shared by several groups is packed once.  The key holds the packing too (one
    # array may be a symmetric tensor in one group and a plain one in another), and the entry keeps
    # the original array alive so its id cannot be reused by another array while the cache lives.
    flattened: dict[tuple[int, bool], tuple[np.ndarray, np.ndarray]] = {}

    def wire_vector(values: np.ndarray, name: str) -> np.ndarray:
        key = (id(values), name in layout.symmetric)
        entry = flattened.get(key)
        if entry is None or entry[0] is not values:
            vector = flatten(values, key[1])
            if vector.base is None and vector is not values:  # a packed copy of the driver's own:
                vector.setflags(write=False)  # read-only, so the client session keeps it uncopied
            entry = (values, vector)
            flattened[key] = entry
        return entry[1]

    inputs = {
        cid: {
            group: {name: wire_vector(values, name) for name, values in tensors.items()}
            for group, tensors in contributions[cid].items()
        }
        for cid in client_ids
    }
    made: dict[str, object] = {}

    def make_session(cid: str) -> None:
        made[cid] = backend.client_session(
            cid,
            identities[cid],
            roster,
            inputs[cid],
            session_id=session_id,
            min_group_size=min_group_size,
            random=random,
            context=context,
        )

    # A session reads its inputs when it starts (their checks; under the one-contribution rule the
    # release's SHA-256 of each value: at d = 4096 0.3 s in all), and draws nothing at random
    # before R0: the backend's workers start several at once where it has them.
    backend.workers.run([functools.partial(make_session, cid) for cid in client_ids])
    clients = {cid: made[cid] for cid in client_ids}
    inputs.clear()
    made.clear()
    # Every session holds its own inputs now: the driver keeps none (and with `consume`, neither
    # does the caller's mapping), so what a session lets go is freed.
    del contributions
    flattened.clear()
    if consume:
        given.clear()  # type: ignore[attr-defined]
    del given
    server = backend.server_session(
        roster, layout, session_id=session_id, min_group_size=min_group_size, context=context
    )
    # Message sizes follow the layout, so a large layout is not cut off by a fixed cap, and
    # anything larger than an honest message is still refused.
    server_limit = server.max_message_bytes

    rounds = backend.rounds
    bytes_sent = {cid: dict.fromkeys(rounds, 0) for cid in client_ids}
    bytes_received = {cid: dict.fromkeys(rounds, 0) for cid in client_ids}
    client_seconds = {cid: dict.fromkeys(rounds, 0.0) for cid in client_ids}
    server_seconds = dict.fromkeys(rounds, 0.0)

    started = time.perf_counter()
    first_request = server.start()
    requests: Mapping[str, object] = dict.fromkeys(client_ids, first_request)
    server_seconds[rounds[0]] += time.perf_counter() - started
    dropped: set[str] = set()
    while requests:
        round_name = server.round.value  # type: ignore[attr-defined]
        dropped |= {
            cid for cid, stage in drop_stage.items() if rounds.index(stage) <= rounds.index(round_name)
        }
        started = time.perf_counter()
        wire: dict[int, bytes] = {}  # a broadcast message is encoded once
        for request in requests.values():
            if id(request) not in wire:
                wire[id(request)] = backend.encode(request, server_limit)
        server_seconds[round_name] += time.perf_counter() - started
        # One client's replies are made and freed at a time: the next client's land on the same
        # pages (core/heap.py; at d = 4096 an R2 message is 128 MiB, faulted in afresh otherwise).
        with heap.reused_pages():
            for cid, request in requests.items():
                if cid in dropped:
                    continue
                data = wire[id(request)]
                client = clients[cid]
                started = time.perf_counter()
                encoded_replies = client.receive_bytes(data)  # decoded under the client's own limits
                client_seconds[cid][round_name] += time.perf_counter() - started
                bytes_received[cid][round_name] += len(data)
                for reply_bytes in encoded_replies:
                    bytes_sent[cid][round_name] += len(reply_bytes)
                    started = time.perf_counter()
                    server.receive(backend.decode(reply_bytes, server_limit))
                    server_seconds[round_name] += time.perf_counter() - started
                # The replies go before the next client builds its own: the server holds what it still
                # needs (at d = 4096 an R2 message is 128 MiB, added to the sums as it arrives).
                del encoded_replies
                reply_bytes = b""
        started = time.perf_counter()
        requests = server.next_round()
        server_seconds[round_name] += time.perf_counter() - started

    return InProcessRun(
        outcome=backend.outcome(server, layout, unpack=unpack),
        costs=SessionCosts(bytes_sent, bytes_received, client_seconds, server_seconds),
        session_id=session_id,
        clients=clients,
        layout=layout,
    )


def dropout_stages(
    dropouts: Mapping[str, Collection[str]], client_ids: tuple[str, ...], stages: tuple[str, ...]
) -> dict[str, str]:
    """client -> the stage from which it stops answering; unknown stages or clients raise ``ValueError``."""
    stage_of: dict[str, str] = {}
    for stage, ids in dropouts.items():
        if stage not in stages:
            raise ValueError(f"unknown dropout stage {stage!r}; expected one of {stages}")
        for cid in ids:
            if cid not in client_ids:
                raise ValueError(f"dropout of unknown client {cid!r}")
            if cid in stage_of:
                raise ValueError(f"client {cid!r} drops at two stages")
            stage_of[cid] = stage
    return stage_of
