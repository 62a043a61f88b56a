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
