"""A forked node through the real deployment handler: a node rebuilt from a copied context
state (Flower loads it when a task starts and saves it when it ends; two concurrent messages can
start from one state) is shown a second survivor set.  The node's file ledger holds the answer."""

from __future__ import annotations

import copy
from pathlib import Path

from secure_afl.deploy.client import handle
from secure_afl.deploy.wire import Envelope
from secure_afl.protocol import codec
from secure_afl.protocol.messages import ConsistencyCheckRequest

from .helpers import DictState, InProcessTransport, make_federation, run_server


def test_a_node_forked_before_r3_refuses_a_second_survivor_set(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=5)
    forks: dict[int, DictState] = {}
    r3: dict[int, Envelope] = {}

    def snapshot(node_id: int, group: str, envelope: Envelope) -> Envelope:
        if group == "s1-R3":  # the state as Flower would load it for a second, concurrent message
            forks[node_id] = copy.deepcopy(federation.nodes[node_id].state)
            r3[node_id] = envelope
        return envelope

    server, classifier, _ = run_server(federation, InProcessTransport(federation, tamper=snapshot))
    survivors = tuple(server.report.sessions[0].survivors)
    assert len(survivors) == 5 and classifier is not None  # the honest branch completed
    for node_id, state in sorted(forks.items()):
        node = federation.nodes[node_id]
        request = codec.decode(r3[node_id].payload)
        victim = next(c for c in survivors if c != node.client_id)
        other = ConsistencyCheckRequest(request.session_id, tuple(c for c in survivors if c != victim))
        forked = Envelope("protocol", dict(r3[node_id].meta), codec.encode(other))
        reply = handle(forked, state, node.settings)
        assert reply.kind == "refused", reply
        assert reply.meta["error"] == "ConflictingAnswerError"
        assert "a second one" in str(reply.meta["message"])
        assert state.load("1") == {"status": "failed: ConflictingAnswerError"}  # the copy's secrets are gone
