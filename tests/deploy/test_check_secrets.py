"""A classifier check that cannot finish at a node leaves none of its secrets on the node's disk, and a
node whose session records are unreadable still refuses, in its audit log too (SECURITY.md §5,
"Session state")."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from secure_afl.deploy.audit import node_audit_log
from secure_afl.deploy.client import handle
from secure_afl.deploy.errors import ConfigurationError
from secure_afl.deploy.verify import STATE_INPUTS, STATE_LABEL
from secure_afl.deploy.wire import Envelope
from secure_afl.keys.auditlog import read_log

from .helpers import DictState, Node, make_federation, run_server
from .test_classifier_check import _server


def _secrets(node: Node) -> dict[str, bool]:
    """Whether the node's records hold the check's mask key and the values it kept for its terms."""
    records = node.state.records
    return {"key": "key" in records.get(STATE_LABEL, {}), "values": "inputs" in records.get(STATE_INPUTS, {})}


def _drop_commitment(node: int, group: str, envelope: Envelope) -> Envelope:
    """The delivery relays one survivor's commitment fewer: every node's check stops at it."""
    if group != "classifier":
        return envelope
    commitments = json.loads(str(envelope.meta["verify-commitments"]))
    del commitments[sorted(commitments)[-1]]
    return Envelope(
        envelope.kind, {**envelope.meta, "verify-commitments": json.dumps(commitments)}, envelope.payload
    )


@pytest.mark.parametrize("require", ["when-offered", "false"])
def test_a_check_that_cannot_finish_leaves_no_key_or_kept_values(tmp_path: Path, require: str) -> None:
    federation = make_federation(tmp_path, n_clients=3)
    for node in federation.nodes.values():
        node.settings = dataclasses.replace(node.settings, require_verified=require)
    server, _ = _server(federation, tamper=_drop_commitment)
    classifier = server.run()
    # Session 1 is over: each node holds its mask key and its values until the classifier comes.
    assert all(_secrets(node) == {"key": True, "values": True} for node in federation.nodes.values())
    server.deliver(classifier, server.sign(classifier))
    assert server.report.verified == ()
    if require == "false":  # stored on receipt, unverified
        assert server.report.acknowledged == ("client-0", "client-1", "client-2")
    else:
        assert {r["error"] for r in server.report.refusals} == {"VerificationError"}
    for node in federation.nodes.values():
        assert _secrets(node) == {"key": False, "values": False}, node.client_id
        assert node.state.records[STATE_LABEL]["status"] == "failed"


def test_a_refused_classifier_file_ends_the_check_and_a_later_delivery_is_refused(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=3)
    server, _ = _server(federation)
    classifier = server.run()
    signed = server.sign(classifier)
    document = json.loads(signed)
    document["classes"][0] += " (edited)"  # after signing: the content digest no longer matches
    server.deliver(classifier, json.dumps(document).encode("utf-8"))
    assert {r["error"] for r in server.report.refusals} == {"ClassifierTamperedError"}
    assert all(_secrets(node) == {"key": False, "values": False} for node in federation.nodes.values())
    # The check ran out at the refusal: the signed file sent after it is not checked, nor stored.
    server.deliver(classifier, signed)
    assert server.report.verified == () and server.report.acknowledged == ()
    assert not any((n.settings.out_dir / "classifier.json").exists() for n in federation.nodes.values())


class UnreadableState(DictState):
    """A node's records once a session's record can no longer be read (a damaged disk, a hand edit)."""

    def __init__(self) -> None:
        super().__init__()
        self.broken: set[str] = set()

    def load(self, label: str) -> dict[str, Any] | None:
        if label in self.broken:
            raise ConfigurationError(f"a session record of this node is unreadable ({label})")
        return super().load(label)

    def save(self, label: str, record: Any) -> None:
        before = (self.records.get(label) or {}).get("answered-sha256")
        super().save(label, record)
        if label == "1" and len(record.get("messages", [])) == 2 and record.get("answered-sha256") != before:
            self.broken.add(label)  # once R1's answer is recorded: R2 finds the record unreadable


def test_a_node_whose_records_are_unreadable_refuses_and_its_audit_log_says_so(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=4)
    broken = federation.nodes[1001]
    broken.state = UnreadableState()
    server, _, _ = run_server(federation)  # four institutions tolerate one dropout
    assert [(r["from"], r["error"]) for r in server.report.refusals] == [("client-1", "ConfigurationError")]
    records = [r for r in read_log(node_audit_log(broken.settings)).records() if r is not None]
    (refused,) = [r for r in records if r.kind == "session-refused"]
    assert refused.body["error"] == "ConfigurationError" and "unreadable" in refused.body["rule"]
    assert refused.body["round"].startswith("unknown")


def test_a_delivery_refused_for_the_nodes_own_trouble_leaves_the_check_open(tmp_path: Path) -> None:
    # The passphrase file is away while the classifier comes: the node refuses (it cannot sign), and
    # the copy the coordinator sends again once it is back is answered, not refused as a check over.
    federation = make_federation(tmp_path, n_clients=3)
    node = federation.nodes[1000]
    passfile = node.settings.passphrase_file
    away = passfile.with_name("away")

    def hide(node_id: int, group: str, envelope: Envelope) -> Envelope:
        if node_id == 1000 and group == "classifier":
            passfile.rename(away)
        return envelope

    server, transport = _server(federation, tamper=hide)
    classifier = server.run()
    server.deliver(classifier, server.sign(classifier))
    (refusal,) = [e for n, g, e in transport.received if n == 1000 and g == "classifier"]
    assert refusal.kind == "refused" and refusal.meta["error"] not in (
        "VerificationError",
        "SessionReplayError",
    )
    assert _secrets(node) == {"key": True, "values": True}
    away.rename(passfile)
    (delivery,) = [e for n, g, e in transport.sent if n == 1000 and g == "classifier"]
    again = handle(delivery, node.state, node.settings)
    assert again.kind == "ack" and again.meta["held"] is True, again.meta
    assert _secrets(node) == {"key": False, "values": False}  # its terms computed: neither is needed


def test_a_refused_second_delivery_leaves_an_answered_check_to_finish(tmp_path: Path) -> None:
    # After its masked terms went, a node refuses another classifier message; the check it answered
    # still decides on the relay (nothing secret was left to forget).
    federation = make_federation(tmp_path, n_clients=3)
    node = federation.nodes[1000]
    delivered: list[Envelope] = []

    def resend_before_relay(node_id: int, group: str, envelope: Envelope) -> Envelope:
        if group == "classifier" and node_id == 1000:
            delivered.append(envelope)
        if group == "verify-sums" and node_id == 1000:
            other = Envelope(
                "classifier", {**delivered[0].meta, "round": "classifier again"}, delivered[0].payload
            )
            assert handle(other, node.state, node.settings).kind == "refused"
        return envelope

    server, _ = _server(federation, tamper=resend_before_relay)
    classifier = server.run()
    server.deliver(classifier, server.sign(classifier))
    assert server.report.verified == ("client-0", "client-1", "client-2")


class UnreadableCheckRecord(DictState):
    """The check's record turns unreadable once the delivery has read it (armed by the test)."""

    armed, reads = False, 0

    def load(self, label: str) -> dict[str, Any] | None:
        if label == STATE_LABEL and self.armed:
            self.reads += 1
            if self.reads > 1:
                raise ConfigurationError("the check's record is unreadable")
        return super().load(label)


def test_the_kept_values_go_even_when_the_checks_own_record_turns_unreadable(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=3)
    node = federation.nodes[1000]
    state = node.state = UnreadableCheckRecord()

    def arm(node_id: int, group: str, envelope: Envelope) -> Envelope:
        state.armed = state.armed or (node_id == 1000 and group == "classifier")
        return _drop_commitment(node_id, group, envelope)

    server, _ = _server(federation, tamper=arm)
    classifier = server.run()
    assert "inputs" in state.records[STATE_INPUTS]
    server.deliver(classifier, server.sign(classifier))
    assert ("client-0", "VerificationError") in [(r["from"], r["error"]) for r in server.report.refusals]
    assert state.reads >= 2 and "inputs" not in state.records[STATE_INPUTS]
