"""Timeouts that follow liveness, not the clock alone: over Flower (GridTransport) a node the SuperLink
still counts online (its heartbeats) is slow, not gone, and is waited for past its round's timeout up
to the round's limit; a node Flower reports gone is a dropout at once; a reply that comes after the
round's survivor set is fixed is never read.  Flower's Grid is a stand-in with a fake clock (no sleeps)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from secure_afl.deploy.apps import POLL_SECONDS, GridTransport
from secure_afl.deploy.server import FederationServer, LiveTransport
from secure_afl.deploy.wire import Envelope

from .helpers import Clock, InProcessTransport, flower_error, flower_reply, make_federation, run_server


def _reply(message_id: str, payload: bytes = b"x") -> SimpleNamespace:
    return flower_reply(message_id, Envelope("reply", {"round": "R1"}, payload))


def _unavailable(message_id: str) -> SimpleNamespace:
    return flower_error(message_id, "Error: Node Unavailable")


class Grid:
    """A SuperLink's view: per node, when it answers, when it goes offline (Flower then answers its
    message with NODE_UNAVAILABLE, or, ``silent_offline``, only leaves the online list).  Its pull
    returns every reply it holds, of any round: the transport must pick its own round's."""

    def __init__(self, clock: Clock, answers: dict[int, float], offline: dict[int, float], silent=()) -> None:
        self.clock, self.answers, self.offline, self.silent = clock, answers, offline, set(silent)
        self.sent: dict[str, int] = {}  # message id -> node
        self.rounds = 0

    def get_node_ids(self):
        return [n for n in (7, 8, 9) if self.clock.now < self.offline.get(n, float("inf"))]

    def push_messages(self, messages):
        self.rounds += 1
        ids = []
        for message in messages:
            ids.append(f"r{self.rounds}-{message.dst_node_id}")
            self.sent[ids[-1]] = message.dst_node_id
        return ids

    def pull_messages(self, ids):
        out = []
        for message_id, node in self.sent.items():
            if self.clock.now >= self.offline.get(node, float("inf")) and node not in self.silent:
                out.append(_unavailable(message_id))
            elif self.clock.now >= self.answers.get(node, float("inf")):
                out.append(_reply(message_id, message_id.encode()))
        return out


@pytest.fixture
def plain_messages(monkeypatch):
    # Flower's Message needs a running ServerApp's context: a plain record stands in for it.
    monkeypatch.setattr("secure_afl.deploy.apps.Message", lambda content, **meta: SimpleNamespace(**meta))


def _round(transport: GridTransport, nodes, timeout: float, limit: float) -> dict[int, Envelope]:
    return transport.exchange_live(
        {n: Envelope("protocol", {"round": "R1"}) for n in nodes}, "s1-R1", timeout, limit
    )


def test_a_node_online_past_the_timeout_is_waited_for_and_a_gone_one_dropped_at_once(plain_messages) -> None:
    clock = Clock()
    grid = Grid(clock, answers={7: 95.0}, offline={8: 12.0, 9: 50.0}, silent={9})
    logs: list[str] = []
    transport = GridTransport(grid, log=logs.append, clock=clock, sleep=clock.sleep)
    assert isinstance(transport, LiveTransport)
    replies = _round(transport, [7, 8, 9], timeout=30.0, limit=300.0)
    # node 7 answered at 95 s, long past the 30 s timeout: it was online all along (a busy host)
    assert replies[7].kind == "reply" and replies[7].payload == b"r1-7"
    # node 8 went offline at 12 s: Flower's NODE_UNAVAILABLE reply, a dropout before the timeout
    assert replies[8].kind == "dropped" and replies[8].meta["error"] == "FlowerError5"
    # node 9 left the online list at 50 s without an error reply: found by the transport's own check
    assert replies[9].kind == "dropped" and replies[9].meta["error"] == "NodeOffline"
    assert 95.0 <= clock.now < 95.0 + 2 * POLL_SECONDS  # returned once the last answer came
    assert any(
        "2 node(s) still online after 30 s" in line and "waiting up to 300 s" in line for line in logs
    ), logs


def test_a_reply_after_the_limit_is_never_read_not_even_by_the_next_round(plain_messages) -> None:
    clock = Clock()
    grid = Grid(clock, answers={7: 10.0, 8: 400.0}, offline={})
    transport = GridTransport(grid, log=lambda s: None, clock=clock, sleep=clock.sleep)
    first = _round(transport, [7, 8], timeout=30.0, limit=300.0)
    assert set(first) == {7} and 300.0 <= clock.now < 300.0 + 2 * POLL_SECONDS  # 8: silent past the limit
    clock.now = 500.0  # node 8's late reply to round 1 is now at the SuperLink (and pulled with the next)
    second = _round(transport, [7], timeout=30.0, limit=300.0)
    assert set(second) == {7} and second[7].payload == b"r2-7"  # round 2's own reply, nothing of round 1's


def test_the_plain_exchange_keeps_the_timeout(plain_messages) -> None:
    clock = Clock()
    grid = Grid(clock, answers={7: 95.0}, offline={})
    transport = GridTransport(grid, log=lambda s: None, clock=clock, sleep=clock.sleep)
    assert transport.exchange({7: Envelope("protocol", {"round": "R1"})}, "g", 30.0) == {}
    assert 30.0 <= clock.now < 30.0 + 2 * POLL_SECONDS


class Live(InProcessTransport):
    """The in-process federation as a LiveTransport: it records each round's timeout and limit, and
    ``silent`` nodes (node id -> group) give no answer from that group on (alive but silent)."""

    def __init__(self, federation, silent: dict[int, str]) -> None:
        super().__init__(federation)
        self.silent = silent
        self.waits: dict[str, tuple[float, float]] = {}

    def exchange_live(self, outgoing, group, timeout, limit):
        self.waits[group] = (timeout, limit)
        kept = {n: e for n, e in outgoing.items() if self.silent.get(n) != group}
        return super().exchange(kept, group, timeout)


def test_the_server_gives_a_live_node_the_round_limit_and_names_it_when_silent(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=4)
    transport = Live(federation, silent={1002: "s1-R2"})
    server, classifier, _ = run_server(federation, transport, statistics_timeout=3, round_limit=7)
    assert transport.waits["s1-R0"] == (3, 7) and transport.waits["s1-R1"] == (1, 7)
    assert transport.waits["classifier"] == (1, 7)
    (dropout,) = server.report.dropouts
    assert dropout == {
        "at": "session 1 R2",
        "client": "client-2",
        "reason": "was alive but did not answer within 7 s",
    }
    # not asked again: the session's survivor set went on without it
    assert not [g for n, g, _ in transport.sent if n == 1002 and g in ("s1-R3", "s1-R4", "classifier")]
    assert "client-2" not in classifier.sessions[0]["survivors"]


def test_the_round_limit_defaults_to_ten_round_timeouts(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=3)
    server = FederationServer(
        InProcessTransport(federation), federation.roster, federation.study, round_timeout=30
    )
    assert server.round_limit == 300
    server = FederationServer(
        InProcessTransport(federation), federation.roster, federation.study, round_timeout=30, round_limit=5
    )
    assert server.round_limit == 30  # never below the round's timeout
