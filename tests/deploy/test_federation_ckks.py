"""The deployment with ``protection="ckks"``: the same server and client code, in one process.

Small on purpose (TenSEAL is slow): d = 6, 3 classes, 4-5 clients, N = 8192 (the smallest ring
degree the clients accept).  The classifier is compared with the simulator's masked aggregation
over the same survivors (``reference_classifier``, exact to 2^-32): CKKS rounds every decrypted sum
to 2^-24 (SECURITY.md §7.3); the weights differ by 5e-11 here (measured), the tests allow
``WEIGHT_TOLERANCE``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from secure_afl.deploy.client import NodeSettings, _client_session
from secure_afl.deploy.errors import ConfigurationError, FederationAbortedError
from secure_afl.deploy.server import FederationServer
from secure_afl.deploy.study import Method, Study
from secure_afl.deploy.wire import Envelope
from secure_afl.keys import Roster, load_identity_key
from secure_afl.privacy.ledger import MemoryLedger
from secure_afl.privacy.release import Release
from secure_afl.protocol.ckks import codec, context
from secure_afl.protocol.ckks.context import CkksParameters
from secure_afl.protocol.ckks.messages import CkksAdvertiseRequest, CkksKeyDistribution
from secure_afl.rehearsal import reference_classifier

from .helpers import PASSPHRASE, InProcessTransport, make_federation, run_server

WEIGHT_TOLERANCE = 1e-6  # max |CKKS weights - masked weights|; measured 5e-11 (module docstring)
DIM = 6


def _groups(transport: InProcessTransport, direction: str) -> list[str]:
    events = transport.sent if direction == "sent" else transport.received
    return [group for _, group, _ in events]


def test_ckks_deployment_equals_the_simulation_within_ckks_precision_with_a_dropped_client(
    tmp_path: Path,
) -> None:
    # Two rounds (round 2's pseudo/0 group: client-0 and client-1 miss class 0).  client-2 advertises
    # keys and takes the key request, then is killed before it uploads (R2): it is not in the sums.
    active = {
        "client-0": (1, 2),
        "client-1": (1, 2),
        "client-2": (0, 1, 2),
        "client-3": (0, 1, 2),
        "client-4": (0, 2),
    }
    method = Method(rounds=2, min_pos=1, min_neg=1, tau=0.5)
    federation = make_federation(
        tmp_path, n_clients=5, dim=DIM, active=active, method=method, protection="ckks"
    )
    federation.nodes[1002].dead_from = "s1-R2"
    server, classifier, transport = run_server(federation)
    session1, session2 = server.report.sessions
    assert session1.participants == ("client-0", "client-1", "client-2", "client-3", "client-4")
    assert session1.survivors == ("client-0", "client-1", "client-3", "client-4")
    assert [g["name"] for g in session2.groups] == ["pseudo/0"]
    assert server.report.dropouts == [
        {"at": "session 1 R2", "client": "client-2", "reason": "did not answer within 1 s"}
    ]
    # R1: every client was asked (it needs the advertisements), only the key holder sent a message.
    r1 = [(node, env) for node, group, env in transport.received if group == "s1-R1"]
    assert len(r1) == 5 and all(env.kind == "reply" for _, env in r1)
    holders = [federation.nodes[node].client_id for node, env in r1 if env.payload]
    assert holders == [session1.key_holder]
    # R3 (the view) went to every survivor, R4 only to the decryptors the session chose, each a
    # survivor of its groups.
    r3_nodes = {node for node, group, _ in transport.sent if group == "s1-R3"}
    assert {federation.nodes[n].client_id for n in r3_nodes} == set(session1.survivors)
    r4_nodes = {node for node, group, _ in transport.sent if group == "s1-R4"}
    assert {federation.nodes[n].client_id for n in r4_nodes} == set(session1.decryptors.values())
    for group in session1.groups:
        assert session1.decryptors[group["name"]] in group["survivors"]

    reference = reference_classifier(
        federation.data,
        federation.study,
        roster_size=5,
        dropouts={"R2": ["client-2"]},
        device="cpu",
        colluders="0",
    )
    error = float(np.max(np.abs(classifier.weights - reference.coef)))
    assert error <= WEIGHT_TOLERANCE, error
    assert not np.array_equal(classifier.weights, reference.coef)  # CKKS, not the masked sums
    # Without the dropout the classifier is far from this one: the comparison can fail.
    everyone = reference_classifier(
        federation.data, federation.study, roster_size=5, dropouts={}, device="cpu", colluders="0"
    )
    assert float(np.max(np.abs(everyone.coef - classifier.weights))) > 100 * WEIGHT_TOLERANCE

    assert classifier.protocol["backend"] == "ckks"
    assert classifier.protocol["poly_modulus_degree"] == 8192
    assert classifier.protocol["key_holders"]["1"] == session1.key_holder
    assert server.report.acknowledged == ("client-0", "client-1", "client-3", "client-4")
    # Every survivor's sessions are over: no seed, message or input is left in its local state.
    for node in federation.nodes.values():
        if node.client_id == "client-2":
            continue
        for label, record in node.state.records.items():
            assert record["status"] == "done", (node.client_id, label, record.get("status"))
            assert "seed" not in record and "messages" not in record


def test_a_dropped_decryptor_is_replaced_and_its_input_still_counts(tmp_path: Path, monkeypatch) -> None:
    # Four clients, client-k lacks class k.  The server picks the least-loaded surviving member per
    # group in name order: client-0 decrypts "all".  Killed when R4 reaches it (after it signed the
    # view in R3), it is replaced by client-1, which had decrypted class/0 in the first R4: its
    # second R4 (a repeated round) is answered by a client rebuilt from the replay of both R4 messages.
    federation = make_federation(tmp_path, dim=DIM, protection="ckks")
    federation.nodes[1000].dead_from = "s1-R4"
    calls = {"keys": 0, "encryptions": 0}
    new_secret_context, encrypt = context.new_secret_context, context.encrypt

    def counted_key(*args, **kwargs):
        calls["keys"] += 1
        return new_secret_context(*args, **kwargs)

    def counted_encrypt(*args, **kwargs):
        calls["encryptions"] += 1
        return encrypt(*args, **kwargs)

    monkeypatch.setattr(context, "new_secret_context", counted_key)
    monkeypatch.setattr(context, "encrypt", counted_encrypt)
    server, classifier, transport = run_server(federation)
    # Rebuilt clients replay without redoing their replies: one key (the key holder's, in R1) and
    # one encryption per tensor per client (R2: 3 + 3 + 3 + 4), although the decryptors were
    # rebuilt from R0..R3 for each R4.
    assert calls == {"keys": 1, "encryptions": 13}
    (session,) = server.report.sessions
    assert server.report.dropouts == [
        {"at": "session 1 R4", "client": "client-0", "reason": "did not answer within 1 s"}
    ]
    assert session.survivors == ("client-0", "client-1", "client-2", "client-3")  # its input counts
    assert session.decryptors == {
        "all": "client-1",
        "class/0": "client-1",
        "class/1": "client-2",
        "class/2": "client-3",
    }
    second_r4 = [federation.nodes[n].client_id for n, g, _ in transport.sent if g == "s1-R4"]
    assert second_r4 == ["client-1", "client-2", "client-3", "client-1"]  # client-0 never answered
    assert session.completed == ("client-1", "client-2", "client-3")
    assert server.report.acknowledged == ("client-1", "client-2", "client-3")
    reference = reference_classifier(
        federation.data,
        federation.study,
        roster_size=4,
        dropouts={"R3": ["client-0"]},
        device="cpu",
        colluders="0",
    )
    assert reference.survivors == session.survivors
    error = float(np.max(np.abs(classifier.weights - reference.coef)))
    assert error <= WEIGHT_TOLERANCE, error


def test_the_server_never_receives_a_secret_key(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, dim=DIM, protection="ckks")
    snapshots = {}

    class Snapshotting(InProcessTransport):
        def exchange(self, outgoing, group, timeout):
            replies = super().exchange(outgoing, group, timeout)
            if group == "s1-R2":  # each client's local state, with the R2 message that opened its key
                snapshots.update({n: node.state.load("1") for n, node in federation.nodes.items()})
            return replies

    server, _, transport = run_server(federation, Snapshotting(federation))
    (session,) = server.report.sessions
    # Rebuild the key holder's session from its local state to learn the secret context, then look
    # for it in every byte the server received.
    node_id = next(n for n, node in federation.nodes.items() if node.client_id == session.key_holder)
    node, saved = federation.nodes[node_id], snapshots[node_id]
    roster = Roster.from_json(node.settings.roster.read_text())
    identity = load_identity_key(node.settings.identity_key, PASSPHRASE)
    inputs: dict[str, dict[str, np.ndarray]] = {}
    for key, values in saved["inputs"].items():
        group, tensor = key.split("|", 1)
        inputs.setdefault(group, {})[tensor] = np.asarray(values)
    release = Release.from_json(json.loads(saved["release"]))
    client = _client_session(
        federation.study.backend(4), node.client_id, identity, roster, inputs, saved["seed"],
        federation.study, MemoryLedger(), release, 0, saved["context"],
        json.loads(saved["rows"]),
    )  # fmt: skip
    for data in saved["messages"]:
        client.receive_bytes(data)
    secret_context = context.secret_bytes(client._context)  # type: ignore[attr-defined]
    assert context.load_context(secret_context).is_private() and len(secret_context) > 10_000
    key_messages = 0
    for _, _, envelope in transport.received:
        if envelope.kind != "reply" or not envelope.payload:
            continue
        message = codec.decode(envelope.payload, max_message_bytes=1 << 30)
        if isinstance(message, CkksKeyDistribution):
            key_messages += 1
            assert not context.load_context(message.public_context).is_private()
            assert len(message.public_context) < 1000  # the parameters only: no key of any kind
            for sealed in message.contexts:  # AES-GCM ciphertexts, not contexts
                with pytest.raises(ValueError):
                    context.load_context(sealed.ciphertext)
        # No 64-byte window of the secret context past its parameter header (which the public
        # context shares) reaches the server.
        for start in range(1024, len(secret_context) - 64, len(secret_context) // 16):
            assert secret_context[start : start + 64] not in envelope.payload
    assert key_messages == 1
    # The server object holds no TenSEAL context at all once the run is over.
    assert not any(type(v).__module__.startswith("tenseal") for v in vars(server).values())


def test_a_key_holder_that_drops_before_the_key_is_replaced_or_the_session_aborts(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, dim=DIM, protection="ckks")

    class KeyHoldersDie(InProcessTransport):
        """The node with a key to send dies before it is sent: the first one, or every one."""

        def __init__(self, federation, every: bool) -> None:
            super().__init__(federation)
            self.every = every
            self.killed: list[str] = []

        def exchange(self, outgoing, group, timeout):
            replies = super().exchange(outgoing, group, timeout)
            if group == "s1-R1" and (self.every or not self.killed):
                for node, envelope in list(replies.items()):
                    if envelope.payload:
                        del replies[node]
                        node_ = self.federation.nodes[node]
                        node_.dead_from = "s1-R1"
                        self.killed.append(node_.client_id)
            return replies

    transport = KeyHoldersDie(federation, every=False)
    server, classifier, _ = run_server(federation, transport)
    (session,) = server.report.sessions
    (dropped,) = transport.killed
    assert session.replaced_key_holders == (dropped,)
    assert session.key_holder not in ("", dropped)
    assert server.report.dropouts == [
        {"at": "session 1 R1", "client": dropped, "reason": "did not answer within 1 s"}
    ]
    assert dropped not in session.survivors and len(session.survivors) == 3
    assert dropped not in server.report.acknowledged and len(server.report.acknowledged) == 3
    reference = reference_classifier(
        federation.data,
        federation.study,
        roster_size=4,
        dropouts={"R1": [dropped]},
        device="cpu",
        colluders="0",
    )
    assert reference.survivors == session.survivors
    error = float(np.max(np.abs(classifier.weights - reference.coef)))
    assert error <= WEIGHT_TOLERANCE, error

    # Every key holder dies: after two, class groups keep one member (client-k lacks class k) and
    # the re-election aborts the session before anything is encrypted.
    federation = make_federation(tmp_path / "again", dim=DIM, protection="ckks")
    transport = KeyHoldersDie(federation, every=True)
    server = FederationServer(
        transport, federation.roster, federation.study, round_timeout=1, log=lambda s: None
    )
    with pytest.raises(
        FederationAbortedError, match=r"session 1 aborted after R1: group .* without the key holder"
    ):
        server.run()
    assert len(transport.killed) == 2
    assert [d["client"] for d in server.report.dropouts] == transport.killed


def test_a_client_refuses_a_protection_it_did_not_agree_to_or_that_differs_from_the_study(
    tmp_path: Path,
) -> None:
    everything = {f"client-{k}": (0, 1, 2) for k in range(5)}  # two survivors would fill every group
    federation = make_federation(tmp_path, n_clients=5, dim=DIM, active=everything, protection="ckks")
    # client-4's institution agreed to masking only: it refuses the CKKS study.
    node4 = federation.nodes[1004]
    node4.settings = replace(node4.settings, protections=frozenset({"mask"}))
    other = CkksParameters(poly_modulus_degree=16384)

    def tamper(node_id: int, group: str, envelope: Envelope) -> Envelope:
        if group != "s1-R0":
            return envelope
        if node_id == 1003:  # the session says masking while the study says CKKS
            return Envelope(envelope.kind, {**envelope.meta, "backend": "mask"}, envelope.payload)
        if node_id == 1002:  # CKKS parameters other than the study's
            request = codec.decode(envelope.payload, max_message_bytes=1 << 20)
            assert isinstance(request, CkksAdvertiseRequest)
            changed = CkksAdvertiseRequest(replace(request.config, parameters=other))
            return Envelope(envelope.kind, envelope.meta, codec.encode(changed, max_message_bytes=1 << 20))
        return envelope

    server = FederationServer(
        InProcessTransport(federation, tamper=tamper),
        federation.roster,
        federation.study,
        round_timeout=1,
        log=lambda s: None,
        signer=federation.signer,
        colluders=0,
    )
    # Two survivors fill every group, but they are not t of the roster's five: no decryptor would
    # decrypt under a view so few signed (the one-view rule), and the server stops after R3.
    with pytest.raises(FederationAbortedError, match=r"session 1 aborted after R3: 2 survivor\(s\) signed"):
        server.run()
    refusals = {r["from"]: (r["error"], r["message"]) for r in server.report.refusals}
    assert set(refusals) == {"client-2", "client-3", "client-4"}
    assert all(error == "StudyMismatchError" for error, _ in refusals.values())
    assert "agreed to mask only" in refusals["client-4"][1]
    assert "session runs the 'mask' protection, but the study says 'ckks'" in refusals["client-3"][1]
    assert "CKKS parameters" in refusals["client-2"][1] and "16384" in refusals["client-2"][1]
    assert server.report.sessions[0].participants == ("client-0", "client-1")
    for node_id in (1002, 1003, 1004):
        assert federation.nodes[node_id].state.records["1"] == {"status": "failed: StudyMismatchError"}


def test_the_study_records_the_protection_and_refuses_bad_ckks_parameters() -> None:
    study = Study(
        classes=("A", "B"),
        dim=4,
        backbone={"name": "toy", "weights_id": "x", "preprocessing": "none"},
        protection="ckks",
        ckks_degree=16384,
    )
    again = Study.from_json(study.to_json())
    assert again == study and again.ckks_parameters() == CkksParameters(poly_modulus_degree=16384)
    assert again.backend(4).name == "ckks" and replace(study, protection="mask").backend(4).name == "mask"
    assert study.digest() != replace(study, ckks_degree=8192).digest()
    with pytest.raises(ConfigurationError, match="poly_modulus_degree must be one of"):
        replace(study, ckks_degree=4096)
    with pytest.raises(ConfigurationError, match="protection must be one of mask, ckks"):
        replace(study, protection="paillier")
    with pytest.raises(ConfigurationError, match="protection='rsa'"):
        NodeSettings.from_node_config(
            {k: "x" for k in NodeSettings.KEYS} | {"passphrase-file": "x"} | {"protection": "rsa"}
        )
    assert NodeSettings.from_node_config(
        {k: "x" for k in NodeSettings.KEYS} | {"passphrase-file": "x"} | {"protection": "mask, ckks"}
    ).protections == {"mask", "ckks"}
