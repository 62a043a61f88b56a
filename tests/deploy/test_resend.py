"""A round message lost in flight is sent again (issue 54).  Flower 1.42 delivers a pulled message once:
a connection reset that cuts the pull's response loses it, and the node, online, never answers.
GridTransport sends a node still online without an answer the same envelope again (a new message id);
the node answers an identical repeat of the message it answered last with the reply it recorded, byte
for byte, without running the protocol, releasing or writing its audit log again; a changed message
for an answered round is refused as before (SECURITY.md R8).  Flower's Grid is a stand-in over the
in-process federation, with a fake clock (no sleeps, no Flower processes)."""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path
from types import MappingProxyType, SimpleNamespace

import numpy as np
import pytest

from secure_afl.deploy.apps import POLL_SECONDS, GridTransport
from secure_afl.deploy.audit import node_audit_log
from secure_afl.deploy.client import envelope_bytes, envelope_from_bytes, handle
from secure_afl.deploy.errors import ConfigurationError, FederationAbortedError
from secure_afl.deploy.wire import Envelope, from_record_dict, to_record_dict
from secure_afl.keys.auditlog import read_log

from .helpers import (
    Clock,
    InProcessTransport,
    check_study,
    flower_error,
    flower_reply,
    make_federation,
    run_server,
)


@pytest.fixture
def plain_messages(monkeypatch):
    # Flower's Message needs a running ServerApp's context: a plain record stands in for it.
    monkeypatch.setattr(
        "secure_afl.deploy.apps.Message", lambda content, **meta: SimpleNamespace(content=content, **meta)
    )


def _answer(message_id: str, envelope: Envelope) -> SimpleNamespace:
    return flower_reply(message_id, envelope)


def _error(message_id: str) -> SimpleNamespace:
    return flower_error(message_id, "Error: ClientApp process died")


class FederationGrid:
    """A SuperLink over the in-process federation: a pushed message reaches its node at once, which
    answers it through Flower's record form (as the apps do), except the first message to each
    ``(node, group)`` in ``lose``: a reset cut its pull, so the node never saw it.  A ``(node, group)``
    in ``late`` has each reply reach the SuperLink that many seconds after its push (a busy host).
    A pull returns every reply it holds, of any round: the transport must pick its own."""

    def __init__(self, federation, clock: Clock, lose=(), late=None) -> None:
        self.federation, self.clock = federation, clock
        self.lose, self.late = set(lose), dict(late or {})
        self.group_of: dict[str, str] = {}  # message id -> its round's group
        self.held: list[tuple[float, str, SimpleNamespace]] = []  # (visible from, id, reply)
        self.handled: list[tuple[int, str, bytes]] = []  # (node, group, the reply's canonical bytes)
        self.pushed: list[tuple[int, str]] = []
        self.asked: list[list[str]] = []

    def get_node_ids(self):
        return sorted(self.federation.nodes)

    def push_messages(self, messages):
        ids = []
        for message in messages:
            node_id, group = message.dst_node_id, message.group_id
            message_id = f"m{len(self.group_of)}"
            self.group_of[message_id] = group
            self.pushed.append((node_id, group))
            ids.append(message_id)
            if (node_id, group) in self.lose:
                self.lose.discard((node_id, group))
                continue
            node = self.federation.nodes[node_id]
            reply = handle(from_record_dict(message.content), node.state, node.settings)
            self.handled.append((node_id, group, envelope_bytes(reply)))
            visible = self.clock.now + self.late.get((node_id, group), 0.0)
            self.held.append((visible, message_id, _answer(message_id, reply)))
        return ids

    def pull_messages(self, ids):
        self.asked.append(list(ids))
        return [reply for visible, _, reply in self.held if self.clock.now >= visible]


def _audit_kinds(node) -> list[str]:
    return [r.kind for r in read_log(node_audit_log(node.settings)).records()]  # type: ignore[union-attr]


def test_a_lost_round_message_is_sent_again_and_the_session_completes_without_a_dropout(
    tmp_path: Path, plain_messages
) -> None:
    federation = make_federation(tmp_path, n_clients=4)
    check_study(federation)
    clock = Clock()
    lost = {(1003, "s1-R0"), (1001, "s1-R2"), (1002, "classifier")}
    grid = FederationGrid(federation, clock, lose=lost, late={(1000, "s1-R3"): 1.5})
    logs: list[str] = []
    transport = GridTransport(grid, log=logs.append, clock=clock, sleep=clock.sleep, resends=3)
    server, classifier, _ = run_server(federation, transport, round_limit=100)  # type: ignore[arg-type]
    # No dropout: each lost message was sent once more, one timeout (1 s) after the first, and answered.
    assert server.report.dropouts == [] and server.report.refusals == [] and server.report.rejections == []
    assert classifier.sessions[0]["survivors"] == sorted(federation.roster.client_ids)
    for node, group in lost:
        assert grid.pushed.count((node, group)) == 2
        assert [g for n, g, _ in grid.handled if n == node].count(group) == 1
    assert server.report.acknowledged == tuple(sorted(federation.roster.client_ids))
    assert clock.now < 12.0  # never near the round's limit (100 s): each round waited about 1 s at most
    # The busy node got its R3 twice and answered the repeat with the identical bytes; the first wins.
    repeated = [b for n, g, b in grid.handled if (n, g) == (1000, "s1-R3")]
    assert len(repeated) == 2 and repeated[0] == repeated[1]
    # Nothing was released or recorded twice: one session accepted, one release, no refusal.
    for node in federation.nodes.values():
        assert _audit_kinds(node) == ["log-started", "roster-pinned", "session-accepted", "release"]
    # Every pull asked for ids of one round only (never an earlier round's), though the SuperLink held
    # every reply of the run.
    for asked in grid.asked:
        assert len({grid.group_of[m] for m in asked}) == 1, asked
    # The coordinator's log counts the re-sends; it names no node.
    resent = [line for line in logs if "sent the round's message again" in line]
    assert any(line.startswith("s1-R2: sent the round's message again to 1 node(s)") for line in resent)
    assert not any(str(n) in line for n in federation.nodes for line in resent)


class Repeating(InProcessTransport):
    """Sends every message twice, the second an identical copy, and keeps both replies; then, where
    ``changes`` names the node and the round, a changed copy, and keeps its answer."""

    def __init__(self, federation, changes=None) -> None:
        super().__init__(federation)
        self.changes = dict(changes or {})
        self.pairs: dict[str, list[tuple[bytes, bytes]]] = {}
        self.unchanged: list[bool] = []
        self.answers: dict[tuple[int, str], Envelope] = {}

    def exchange(self, outgoing, group, timeout):
        replies = super().exchange(outgoing, group, timeout)
        for node_id, envelope in outgoing.items():
            node = self.federation.nodes[node_id]
            if node_id not in replies:
                continue
            before = (_files(node.settings.ledger_dir), pickle.dumps(node.state.records))
            again = handle(from_record_dict(to_record_dict(envelope)), node.state, node.settings)
            # The repeat wrote nothing: not the ledger, not the audit log, not the node's state.
            after = (_files(node.settings.ledger_dir), pickle.dumps(node.state.records))
            self.unchanged.append(before == after)
            self.pairs.setdefault(group, []).append((envelope_bytes(replies[node_id]), envelope_bytes(again)))
            if (node_id, group) in self.changes:
                changed = self.changes[node_id, group](envelope)
                self.answers[node_id, group] = handle(changed, node.state, node.settings)
        return replies


def _files(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _with_meta(envelope: Envelope, **meta) -> Envelope:
    return Envelope(
        envelope.kind, MappingProxyType({**envelope.meta, **meta}), envelope.payload, envelope.arrays
    )


def _flipped(envelope: Envelope) -> Envelope:
    payload = bytes([envelope.payload[0] ^ 1]) + envelope.payload[1:]
    return Envelope(envelope.kind, envelope.meta, payload, envelope.arrays)


def test_an_identical_repeat_of_every_kind_gets_the_recorded_reply_and_releases_once(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=4)
    changes = {(1001, "s1-R4"): _flipped, (1002, "verify-sums"): lambda e: _with_meta(e, extra="x")}
    transport = Repeating(federation, changes)
    server, classifier, _ = run_server(federation, transport)
    # advertise (R0), R1..R4 (the session is done after R4), the classifier, the check's relay
    assert list(transport.pairs) == ["s1-R0", "s1-R1", "s1-R2", "s1-R3", "s1-R4", "classifier", "verify-sums"]
    for group, pairs in transport.pairs.items():
        assert len(pairs) == 4, group
        for first, again in pairs:
            assert first == again, group  # byte for byte
            assert envelope_from_bytes(first).kind in ("reply", "ack"), group
    assert len(transport.unchanged) == 28 and all(transport.unchanged)
    assert server.report.dropouts == [] and server.report.refusals == []
    assert sorted(server.check.verified) == sorted(federation.roster.client_ids)
    assert classifier.sessions[0]["survivors"] == sorted(federation.roster.client_ids)
    # A changed message for an answered round is refused as before: R4 once the session is over,
    # the classifier check's relay once it was answered; nothing more is released.
    r4, reveal = transport.answers[1001, "s1-R4"], transport.answers[1002, "verify-sums"]
    assert r4.kind == "refused" and r4.meta["error"] == "SessionReplayError", r4.meta
    assert "is over (done)" in str(r4.meta["message"])
    assert reveal.kind == "refused" and reveal.meta["error"] == "VerificationError", reveal.meta
    for node_id, node in federation.nodes.items():
        refused = ["session-refused"] if node_id in (1001, 1002) else []
        assert _audit_kinds(node) == ["log-started", "roster-pinned", "session-accepted", "release", *refused]


def test_a_changed_repeat_of_r0_or_r1_is_refused_and_ends_that_nodes_session(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=4)
    changed = lambda e: _with_meta(e, extra="x")  # noqa: E731 - the same payload, one more field
    changes = {(1000, "s1-R0"): changed, (1001, "s1-R1"): changed}
    transport = Repeating(federation, changes)
    with pytest.raises(FederationAbortedError):  # two of four lost: fewer than t = 3 remain
        run_server(federation, transport)
    r0, r1 = transport.answers[1000, "s1-R0"], transport.answers[1001, "s1-R1"]
    # R0 with one more metadata field: a second start of the session; R1 so: the rebuilt session's
    # state machine refuses a round it answered.  Either ends that node's session, as before.
    assert r0.kind == "refused" and r0.meta["error"] == "SessionReplayError", r0.meta
    assert "already started" in str(r0.meta["message"])
    assert r1.kind == "refused" and r1.meta["error"] == "OutOfOrderMessageError", r1.meta
    for node_id in (1000, 1001):
        assert str(federation.nodes[node_id].state.records["1"]["status"]).startswith("failed")
    assert all(first == again for pairs in transport.pairs.values() for first, again in pairs)


def test_an_envelopes_canonical_bytes_read_back_exactly_and_differ_with_any_field() -> None:
    envelope = Envelope(
        "reply",
        {"session": "1", "round": "R1", "n": 3, "x": 0.1, "held": True},
        b"\x00payload",
        {"coef": np.arange(6.0).reshape(3, 2), "v": np.array([np.nan, -0.0])},
    )
    data = envelope_bytes(envelope)
    back = envelope_from_bytes(data)
    assert envelope_bytes(back) == data and back.payload == envelope.payload
    assert dict(back.meta) == dict(envelope.meta) and type(back.meta["held"]) is bool
    assert np.array_equal(back.arrays["coef"], envelope.arrays["coef"])
    variants = [
        _with_meta(envelope, n=3.0),  # a float where an int was
        _with_meta(envelope, held=1),
        Envelope("reply", envelope.meta, b"\x01payload", envelope.arrays),
        Envelope("reply", envelope.meta, envelope.payload, {"coef": envelope.arrays["coef"].T.copy()}),
        Envelope("ack", envelope.meta, envelope.payload, envelope.arrays),
    ]
    assert len({envelope_bytes(v) for v in variants} | {data}) == len(variants) + 1
    with pytest.raises(ValueError, match="canonical bytes"):
        envelope_from_bytes(data + b"\x00")


def test_replies_are_pulled_for_every_copy_the_first_answer_wins_and_an_error_waits_for_the_other_copies(
    plain_messages,
) -> None:
    clock = Clock()

    class Grid:
        """Node 7: its first copy fails (Flower's error at 2 s), its second answers at 3 s.  Node 8:
        both copies fail at 2 s.  Node 9 answers every copy at 4 s (slow).  Round 1's late replies
        stay at the SuperLink."""

        def __init__(self) -> None:
            self.ids: list[tuple[str, int]] = []
            self.asked: list[list[str]] = []

        def get_node_ids(self):
            return [7, 8, 9]

        def push_messages(self, messages):
            out = []
            for message in messages:
                out.append(f"{message.group_id}/{len(self.ids)}")
                self.ids.append((out[-1], message.dst_node_id))
            return out

        def pull_messages(self, ids):
            self.asked.append(list(ids))
            out = []
            copies: dict[int, int] = {}
            for message_id, node in self.ids:
                copy = copies[node] = copies.get(node, -1) + 1
                if (node == 7 and copy == 0 and clock.now >= 2.0) or (node == 8 and clock.now >= 2.0):
                    out.append(_error(message_id))
                elif (node == 7 and copy == 1 and clock.now >= 3.0) or (node == 9 and clock.now >= 4.0):
                    out.append(_answer(message_id, Envelope("reply", {"id": message_id})))
            return out

    grid = Grid()
    transport = GridTransport(grid, log=lambda s: None, clock=clock, sleep=clock.sleep, resends=3)
    outgoing = {n: Envelope("protocol", {"round": "R1"}) for n in (7, 8, 9)}
    replies = transport.exchange_live(outgoing, "g1", 1.0, 100.0)
    assert replies[7].kind == "reply" and replies[7].meta["id"] == "g1/3"  # the second copy's answer
    assert replies[8].kind == "dropped" and replies[8].meta["error"] == "FlowerError5"
    assert replies[9].kind == "reply" and replies[9].meta["id"] == "g1/2"  # its first copy's answer
    assert 4.0 <= clock.now < 4.0 + 2 * POLL_SECONDS
    # Re-sent once (at 1 s) to each node still without an answer; the next check (6 s) never came.
    assert [n for _, n in grid.ids] == [7, 8, 9, 7, 8, 9]
    # The next round: round 1's copies are never asked for, and what they answer is never read.
    assert all(m.startswith("g1/") for asked in grid.asked for m in asked)
    first = len(grid.asked)
    second = transport.exchange_live({9: Envelope("protocol", {"round": "R2"})}, "g2", 1.0, 100.0)
    assert second[9].meta["id"] == "g2/6"
    assert grid.asked[first:] and all(m.startswith("g2/") for asked in grid.asked[first:] for m in asked)


def test_a_silent_online_node_is_sent_the_message_again_at_1_3_and_7_timeouts_then_only_waited_for(
    plain_messages,
) -> None:
    clock = Clock()

    class Silent:
        """Node 7 stays online and never answers; each push's time is kept."""

        def __init__(self) -> None:
            self.pushed: list[float] = []

        def get_node_ids(self):
            return [7]

        def push_messages(self, messages):
            self.pushed += [clock.now for _ in messages]
            return [f"m{len(self.pushed)}"]

        def pull_messages(self, ids):
            return []

    for resends, expected in ((3, [0.0, 10.0, 30.0, 70.0]), (0, [0.0])):
        clock.now, grid = 0.0, Silent()
        logs: list[str] = []
        transport = GridTransport(grid, log=logs.append, clock=clock, sleep=clock.sleep, resends=resends)
        assert transport.exchange_live({7: Envelope("protocol", {"round": "R1"})}, "g", 10.0, 100.0) == {}
        assert 100.0 <= clock.now < 100.0 + 2 * POLL_SECONDS  # a dropout at the round's limit, as before
        assert len(grid.pushed) == len(expected)
        # each copy at the first liveness check (every 5 s past the timeout) from its time on
        assert all(
            t <= at < t + GridTransport.ONLINE_CHECK_SECONDS
            for at, t in zip(grid.pushed, expected, strict=True)
        )
        assert sum("sent the round's message again to 1 node(s)" in line for line in logs) == resends
    with pytest.raises(ConfigurationError, match="resends must be a whole number"):
        GridTransport(Silent(), resends=-1)
