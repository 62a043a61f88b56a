"""A ClientApp started from a context older than the node's last answer (Flower 1.42 stores a
ClientApp's context when its process exits, after the reply left) asks for the message again instead
of answering from it; the coordinator sends it again and the session completes.  The node counts its
saves in the context and in ``ledger-dir/flower-state.json`` (deploy/apps.py FlowerState).  Flower's
Grid and SuperNode are stand-ins over the in-process federation, with a fake clock."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from flwr.app import Context, RecordDict

from secure_afl.deploy.apps import FlowerState, GridTransport, answer
from secure_afl.deploy.audit import node_audit_log
from secure_afl.deploy.wire import Envelope, from_record_dict, to_record_dict
from secure_afl.keys.auditlog import read_log

from .helpers import Clock, check_study, flower_reply, make_federation, run_server

RUN = 7


@pytest.fixture
def plain_messages(monkeypatch):
    # Flower's Message needs a running ServerApp's context: a plain record stands in for it.
    monkeypatch.setattr(
        "secure_afl.deploy.apps.Message", lambda content, **meta: SimpleNamespace(content=content, **meta)
    )


def _context(state: RecordDict | None = None, run: int = RUN, node: int = 1, config=None) -> Context:
    state = RecordDict() if state is None else state
    return Context(run_id=run, node_id=node, node_config=config or {}, state=state, run_config={})


def _node_config(settings) -> dict[str, str]:
    return {
        "identity-key": str(settings.identity_key), "passphrase-file": str(settings.passphrase_file),
        "roster": str(settings.roster), "features": str(settings.features), "out-dir": str(settings.out_dir),
        "ledger-dir": str(settings.ledger_dir), "device": "cpu", "protection": "mask", "colluders": "0",
    }  # fmt: skip


class SuperNodes:
    """Each node's context as a SuperNode keeps it: a ClientApp gets a copy when it starts and its
    copy is stored back when it ends.  At a ``(node, group)`` in ``late`` the context of the node's
    previous answer is stored only after the next message's ClientApp has started and ended (the
    race); ``lost`` stores it never (its ClientApp's last push failed)."""

    def __init__(self, federation, late=(), lost=()) -> None:
        self.federation = federation
        self.late, self.lost = set(late), set(lost)
        self.stored = {
            node: _context(RecordDict(), node=node, config=_node_config(n.settings))
            for node, n in federation.nodes.items()
        }
        self.previous = {node: copy.deepcopy(c) for node, c in self.stored.items()}
        self.answers: list[tuple[int, str, str]] = []  # (node, group, the reply's kind)

    def client_app(self, node: int, group: str, content):
        stale = (node, group) in self.late or (node, group) in self.lost
        started_from = self.previous[node] if stale else self.stored[node]
        context = copy.deepcopy(started_from)
        before = copy.deepcopy(self.stored[node])
        reply = answer(content, context)
        self.answers.append((node, group, reply.kind))
        if stale:
            self.late.discard((node, group))
            if (node, group) in self.lost:
                self.stored[node] = context  # the stale ClientApp's context, the last answer's never
                self.previous[node] = copy.deepcopy(context)
            else:
                self.stored[node] = before  # the last answer's context lands after this one's
        else:
            self.previous[node], self.stored[node] = self.stored[node], context
        return reply


class Grid:
    """A SuperLink: a pushed message reaches its node's ClientApp at once; its reply is pulled."""

    def __init__(self, supernodes: SuperNodes) -> None:
        self.supernodes = supernodes
        self.held: dict[str, object] = {}
        self.pushed: list[tuple[int, str]] = []

    def get_node_ids(self):
        return sorted(self.supernodes.stored)

    def push_messages(self, messages):
        ids = []
        for message in messages:
            message_id = f"m{len(self.pushed)}"
            self.pushed.append((message.dst_node_id, message.group_id))
            reply = self.supernodes.client_app(message.dst_node_id, message.group_id, message.content)
            self.held[message_id] = flower_reply(message_id, reply)
            ids.append(message_id)
        return ids

    def pull_messages(self, ids):
        return [self.held[m] for m in ids if m in self.held]


def _audit_kinds(node) -> list[str]:
    return [r.kind for r in read_log(node_audit_log(node.settings)).records()]  # type: ignore[union-attr]


def test_a_clientapp_behind_the_last_answer_asks_again_and_the_session_completes(
    tmp_path: Path, plain_messages
) -> None:
    federation = make_federation(tmp_path, n_clients=4)
    check_study(federation)
    late = {(1001, "s1-R3"), (1002, "s1-R1"), (1003, "classifier"), (1000, "verify-sums")}
    supernodes = SuperNodes(federation, late=late)
    grid = Grid(supernodes)
    clock, logs = Clock(), []
    transport = GridTransport(grid, log=logs.append, clock=clock, sleep=clock.sleep, resends=3)
    server, classifier, _ = run_server(federation, transport, round_limit=100)  # type: ignore[arg-type]
    # Each raced ClientApp asked for the message again; the next copy was answered from the current
    # context: no dropout, no refusal, every node verified the classifier.
    for node, group in late:
        kinds = [k for n, g, k in supernodes.answers if (n, g) == (node, group)]
        assert kinds[0] == "retry" and kinds[1] in ("reply", "ack"), (node, group, kinds)
        assert grid.pushed.count((node, group)) == 2
    assert server.report.dropouts == [] and server.report.refusals == []
    assert classifier.sessions[0]["survivors"] == sorted(federation.roster.client_ids)
    assert sorted(server.check.verified) == sorted(federation.roster.client_ids)
    # The retry ran nothing: one session accepted and one release at every node.
    for node in federation.nodes.values():
        assert _audit_kinds(node) == ["log-started", "roster-pinned", "session-accepted", "release"]
    assert clock.now < 30.0  # each retry waited about RETRY_SECONDS, never the round's limit


def test_without_the_count_a_raced_clientapp_fails_the_session_it_answers_from(
    tmp_path: Path, plain_messages, monkeypatch
) -> None:
    # What the count prevents: the same race with FlowerState.behind() always 0 refuses R3.
    monkeypatch.setattr(FlowerState, "behind", lambda self: 0)
    federation = make_federation(tmp_path, n_clients=4)
    check_study(federation)
    supernodes = SuperNodes(federation, late={(1001, "s1-R3")})
    clock = Clock()
    transport = GridTransport(Grid(supernodes), log=lambda s: None, clock=clock, sleep=clock.sleep, resends=3)
    server, _, _ = run_server(federation, transport, round_limit=100)  # type: ignore[arg-type]
    assert [k for n, g, k in supernodes.answers if (n, g) == (1001, "s1-R3")] == ["refused"]
    refused = [(r["from"], r["at"], r["error"]) for r in server.report.refusals]
    assert ("client-1", "session 1 R3", "OutOfOrderMessageError") in refused, refused
    # The node that refused R3 is a survivor that never reaches the classifier check: nobody verifies.
    assert server.check.verified == ()


def test_a_context_never_stored_makes_the_node_a_dropout_that_says_why(
    tmp_path: Path, plain_messages
) -> None:
    federation = make_federation(tmp_path, n_clients=4)
    check_study(federation)
    supernodes = SuperNodes(federation, lost={(1001, "s1-R1")})
    clock = Clock()
    transport = GridTransport(Grid(supernodes), log=lambda s: None, clock=clock, sleep=clock.sleep, resends=3)
    server, classifier, _ = run_server(federation, transport, round_limit=20)  # type: ignore[arg-type]
    # The node asked for R1 again until the round's limit, answered nothing else, and is a dropout
    # whose reason names its state; the others finished the session and verified without it.
    kinds = [k for n, g, k in supernodes.answers if (n, g) == (1001, "s1-R1")]
    assert len(kinds) > 3 and set(kinds) == {"retry"}
    dropouts = [d for d in server.report.dropouts if d["client"] == "client-1"]
    assert len(dropouts) == 1 and "Flower state stayed behind" in dropouts[0]["reason"], dropouts
    assert server.report.refusals == []
    assert classifier.sessions[0]["survivors"] == ["client-0", "client-2", "client-3"]
    assert sorted(server.check.verified) == ["client-0", "client-2", "client-3"]


def test_the_count_is_in_the_context_and_on_disk_and_a_context_before_a_save_is_behind(
    tmp_path: Path,
) -> None:
    journal = tmp_path / "ledger" / FlowerState.JOURNAL
    current = _context()
    state = FlowerState(current, journal)
    assert state.behind() == 0 and not journal.exists()
    state.save("1", {"status": "active"})
    old = copy.deepcopy(current.state)
    FlowerState(current, journal).save("1", {"status": "done"})
    assert json.loads(journal.read_text())["runs"] == {str(RUN): 2}
    assert FlowerState(_context(copy.deepcopy(current.state)), journal).behind() == 0
    assert FlowerState(_context(old), journal).behind() == 1
    assert FlowerState(_context(RecordDict()), journal).behind() == 2
    # A label cannot overwrite the count: it lives apart from the records.
    FlowerState(current, journal).save("../saves", {"status": "x"})
    assert FlowerState(_context(copy.deepcopy(current.state)), journal).behind() == 0
    # Another run's count is its own; the journal keeps the newest runs only.
    assert FlowerState(_context(run=8), journal).behind() == 0
    for run in range(100, 100 + FlowerState.RUNS_KEPT + 2):
        FlowerState(_context(run=run), journal).save("1", {"status": "active"})
    runs = json.loads(journal.read_text())["runs"]
    assert len(runs) == FlowerState.RUNS_KEPT and str(RUN) not in runs
    assert str(100 + FlowerState.RUNS_KEPT + 1) in runs


def test_an_unreadable_count_is_refused_naming_the_file(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=3)
    node = federation.nodes[1000]
    node.settings.ledger_dir.mkdir(parents=True, exist_ok=True)
    (node.settings.ledger_dir / FlowerState.JOURNAL).write_text("{not json")
    context = _context(node=1000, config=_node_config(node.settings))
    reply = answer(to_record_dict(Envelope("advertise", {"session": "1"})), context)
    assert reply.kind == "refused" and reply.meta["error"] == "ConfigurationError"
    message = str(reply.meta["message"])
    assert FlowerState.JOURNAL in message and "delete the file" in message
    assert from_record_dict(to_record_dict(reply)) == reply
