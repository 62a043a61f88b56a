"""CKKS decryptors shown different survivor sets, through the real deployment handler with
protection ``ckks``.

The deployment's server runs R0..R2 (clients rebuilt per message, file ledgers, deployment
policy); at R3 the transport keeps the honest view requests and delivers none, and the test, as a
hostile server, scripts R3 and R4 through :func:`secure_afl.deploy.client.handle`: half the nodes
sign every upload (S1), half all but the victim's (S2), and one decryptor of each is asked to
decrypt the ``all`` group over its view.  The difference of the two sums would be the victim's
upload; both decryptors refuse (``UnsignedViewError``, R4), and a node forked before R3 signs one
view only (its file ledger).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest

from secure_afl.deploy.client import handle
from secure_afl.deploy.errors import FederationAbortedError
from secure_afl.deploy.server import FederationServer
from secure_afl.deploy.wire import Envelope
from secure_afl.protocol.ckks import binding, codec
from secure_afl.protocol.ckks.messages import (
    CkksDecryption,
    CkksDecryptRequest,
    CkksInput,
    CkksViewRequest,
    CkksViewSignature,
    GroupUploads,
    SignedUpload,
)

from .helpers import InProcessTransport, make_federation

LIMIT = 1 << 30
DIM = 6


class HostileAtR3(InProcessTransport):
    """Carries R0..R2 as the server sends them; keeps R3's requests and delivers nothing."""

    r3: dict[int, Envelope]

    def exchange(self, outgoing, group, timeout):
        if group == "s1-R3":
            self.r3 = dict(outgoing)
            return {}
        return super().exchange(outgoing, group, timeout)


def _start(tmp_path: Path):
    federation = make_federation(tmp_path, dim=DIM, protection="ckks")
    transport = HostileAtR3(federation)
    server = FederationServer(
        transport, federation.roster, federation.study, round_timeout=1, log=lambda s: None, colluders=0
    )
    with pytest.raises(FederationAbortedError, match=r"aborted after R3: 0 survivor\(s\) signed the view"):
        server.run()  # the honest server stops here; the hostile one goes on below
    nodes = {node.client_id: node for node in federation.nodes.values()}
    uploads = {
        federation.nodes[n].client_id: codec.decode(e.payload, max_message_bytes=LIMIT)
        for n, g, e in transport.received
        if g == "s1-R2"
    }
    assert set(uploads) == set(nodes) and all(isinstance(u, CkksInput) for u in uploads.values())
    (view,) = {codec.decode(e.payload, max_message_bytes=LIMIT) for e in transport.r3.values()}
    assert isinstance(view, CkksViewRequest) and len(view.uploads) == 4
    return nodes, uploads, view


def _send(node, round_name: str, message) -> Envelope:
    envelope = Envelope(
        "protocol", {"session": "1", "round": round_name}, codec.encode(message, max_message_bytes=LIMIT)
    )
    return handle(envelope, node.state, node.settings)


def _all_group(uploads, senders) -> GroupUploads:
    """Every chunk of "all" (its tensors in name order, as the server slices a whole group)."""
    chunks = {
        cid: tuple(c for t in uploads[cid].tensors if t.group == "all" for c in t.chunks) for cid in senders
    }
    (count,) = {len(c) for c in chunks.values()}
    return GroupUploads(
        "all",
        tuple(range(count)),
        tuple(
            SignedUpload(
                cid, binding.tensor_digests(uploads[cid].tensors), uploads[cid].signature, chunks[cid]
            )
            for cid in sorted(senders)
        ),
    )


def test_decryptors_shown_two_survivor_sets_through_the_deployment_handler_both_refuse(
    tmp_path: Path,
) -> None:
    nodes, uploads, s1 = _start(tmp_path)
    victim = "client-3"
    s2 = dataclasses.replace(s1, uploads=tuple(e for e in s1.uploads if e.sender != victim))
    plan = {"client-0": s1, "client-3": s1, "client-1": s2, "client-2": s2}
    signed: dict[int, list[CkksViewSignature]] = {}
    for cid, view in sorted(plan.items()):
        reply = _send(nodes[cid], "R3", view)
        assert reply.kind == "reply", reply.meta
        signature = codec.decode(reply.payload, max_message_bytes=LIMIT)
        assert isinstance(signature, CkksViewSignature) and signature.sender == cid
        signed.setdefault(len(view.uploads), []).append(signature)
    for decryptor, view in (("client-0", s1), ("client-1", s2)):
        senders = [e.sender for e in view.uploads]
        request = CkksDecryptRequest(
            view.session_id, view.uploads, tuple(signed[len(senders)]), (_all_group(uploads, senders),)
        )
        reply = _send(nodes[decryptor], "R4", request)
        assert reply.kind == "refused" and reply.payload == b""  # no decrypted sum left the node
        assert reply.meta["error"] == "UnsignedViewError" and reply.meta["round"] == "R4"
        assert "2 survivor(s) signed the view, fewer than t = 3" in str(reply.meta["message"])
        assert nodes[decryptor].state.load("1") == {"status": "failed: UnsignedViewError"}  # secrets gone


def test_a_node_forked_before_r3_signs_one_view_through_the_deployment_handler(tmp_path: Path) -> None:
    nodes, _, s1 = _start(tmp_path)
    node = nodes["client-0"]
    fork = copy.deepcopy(node.state)  # the state as Flower would load it for a second, concurrent message
    assert _send(node, "R3", s1).kind == "reply"
    s2 = dataclasses.replace(s1, uploads=tuple(e for e in s1.uploads if e.sender != "client-3"))
    forked = dataclasses.replace(node, state=fork)
    reply = _send(forked, "R3", s2)
    assert reply.kind == "refused" and reply.payload == b""
    assert reply.meta["error"] == "ConflictingAnswerError" and reply.meta["round"] == "R3"
    assert "R3" in str(reply.meta["message"]) and fork.load("1") == {
        "status": "failed: ConflictingAnswerError"
    }


def test_the_scripted_decryption_is_answered_when_a_quorum_signed_one_view(tmp_path: Path) -> None:
    # The control: the same hand-made R4, signed by every survivor, is decrypted through the handler.
    nodes, uploads, s1 = _start(tmp_path)
    signatures = []
    for cid in sorted(nodes):
        reply = _send(nodes[cid], "R3", s1)
        signatures.append(codec.decode(reply.payload, max_message_bytes=LIMIT))
    request = CkksDecryptRequest(s1.session_id, s1.uploads, tuple(signatures), (_all_group(uploads, nodes),))
    reply = _send(nodes["client-0"], "R4", request)
    assert reply.kind == "reply", reply.meta
    decryption = codec.decode(reply.payload, max_message_bytes=LIMIT)
    assert isinstance(decryption, CkksDecryption) and [g.group for g in decryption.groups] == ["all"]
