"""Every survivor checks the classifier against the session's sums (Freivalds, SECURITY.md §5.1):
an honest coordinator's classifier is verified and stored; a coordinator that changes the classifier
or the check's relays is refused by every honest node, which then stores nothing."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from secure_afl.cli import main
from secure_afl.deploy.classifier import Classifier
from secure_afl.deploy.errors import FederationAbortedError
from secure_afl.deploy.server import FederationServer
from secure_afl.deploy.study import Method
from secure_afl.deploy.verify import verification_status
from secure_afl.deploy.wire import Envelope
from secure_afl.keys import IdentityKey
from secure_afl.protocol import verify as pv

from .helpers import Federation, InProcessTransport, make_federation, run_server


def _server(federation: Federation, tamper=None) -> tuple[FederationServer, InProcessTransport]:
    """A coordinator over the in-process transport, ``tamper`` changing its messages."""
    transport = InProcessTransport(federation, tamper=tamper)
    server = FederationServer(
        transport, federation.roster, federation.study, round_timeout=1, signer=federation.signer,
        colluders=0, log=lambda s: None,
    )  # fmt: skip
    return server, transport


def _run(federation: Federation, *, change=None, tamper=None) -> tuple[FederationServer, bytes]:
    """A coordinator that (``change``) alters the classifier before signing it, and (``tamper``) its
    relays; returns the server and the signed bytes it delivered."""
    server, _ = _server(federation, tamper)
    classifier = server.run()
    if change is not None:
        classifier = change(classifier)
    data = server.sign(classifier)
    server.deliver(classifier, data)
    return server, data


def _stored(federation: Federation) -> dict[str, bool]:
    return {n.client_id: (n.settings.out_dir / "classifier.json").exists() for n in federation.nodes.values()}


def _refused_by_all(server: FederationServer, federation: Federation, nodes: set[str], error: str) -> None:
    assert server.report.verified == () and server.report.acknowledged == ()
    assert not any(_stored(federation).values())
    refused = {r["from"] for r in server.report.refusals if r["error"] == error}
    assert refused == nodes, server.report.refusals


def test_an_honest_coordinators_classifier_is_verified_by_every_survivor_with_a_dropout(
    tmp_path: Path,
) -> None:
    federation = make_federation(tmp_path, n_clients=4)
    federation.nodes[1002].dead_from = "s1-R1"  # client-2 advertises, then is gone: not a survivor
    server, classifier, transport = run_server(federation)
    survivors = ("client-0", "client-1", "client-3")
    assert classifier.sessions[0]["survivors"] == list(survivors)
    assert server.report.verified == survivors and server.report.acknowledged == survivors
    signed = server.sign(classifier)
    for node in federation.nodes.values():
        path = node.settings.out_dir / "classifier.json"
        if node.client_id == "client-2":
            assert not path.exists()
            continue
        assert path.read_bytes() == signed
        assert verification_status(path).startswith("classifier check: verified by this node")
        record = json.loads((node.settings.out_dir / "classifier.verified.json").read_text())
        assert record["survivors"] == list(survivors) and record["max_residual_over_bound"] < 1e-3
    # Masking: each relayed vector alone is uniform words, nowhere near the terms it hides.
    relay = next(e for _, g, e in transport.sent if g == "verify-sums")
    ids = json.loads(str(relay.meta["masked-ids"]))
    n_words = len(federation.study.classes) * federation.study.dim + 1
    assert ids == list(survivors)
    for cid, item in pv.unpack_relay(ids, relay.payload, n_words).items():
        assert all(abs(pv.from_fixed(w)) > 2.0**90 for w in item.words), cid


def _perturb(classifier: Classifier) -> Classifier:
    weights = classifier.weights.copy()
    weights[5, 1] += 1e-6 * np.linalg.norm(weights[:, 1])  # one weight, by a millionth of its column
    return dataclasses.replace(classifier, weights=weights)


def _swap(classifier: Classifier) -> Classifier:
    return dataclasses.replace(classifier, weights=classifier.weights[:, [1, 0, 2]].copy())


@pytest.mark.parametrize("change", ["perturb", "swap", "other study"])
def test_a_changed_classifier_is_refused_by_every_survivor(tmp_path: Path, change: str) -> None:
    federation = make_federation(tmp_path / "study", n_clients=4)
    if change == "other study":
        other = make_federation(tmp_path / "other", n_clients=4, seed=7)
        _, theirs, _ = run_server(other)

        def edit(classifier: Classifier) -> Classifier:
            weights = classifier.weights.copy()
            weights[:, 2] = theirs.weights[:, 2]
            return dataclasses.replace(classifier, weights=weights)
    else:
        edit = _perturb if change == "perturb" else _swap
    server, _ = _run(federation, change=edit)
    _refused_by_all(server, federation, {f"client-{k}" for k in range(4)}, "ClassifierCheckFailedError")


def test_a_different_survivor_set_is_refused(tmp_path: Path) -> None:
    """The coordinator leaves client-3's statistics in the sums but reports it as no survivor, does
    not deliver to it, and relays the others' commitments only: every other node refuses the file,
    whose session record is not the survivor set it signed in R3."""
    federation = make_federation(tmp_path, n_clients=4)
    federation.nodes[1003].dead_from = "classifier"

    def edit(classifier: Classifier) -> Classifier:
        sessions = [
            {**s, "survivors": [c for c in s["survivors"] if c != "client-3"]} for s in classifier.sessions
        ]
        return dataclasses.replace(classifier, sessions=tuple(sessions))

    def tamper(node: int, group: str, envelope: Envelope) -> Envelope:
        if group == "classifier":
            commitments = json.loads(str(envelope.meta["verify-commitments"]))
            del commitments["client-3"]
            return Envelope(
                envelope.kind,
                {**envelope.meta, "verify-commitments": json.dumps(commitments)},
                envelope.payload,
            )
        return envelope

    server, _ = _run(federation, change=edit, tamper=tamper)
    _refused_by_all(server, federation, {"client-0", "client-1", "client-2"}, "ClassifierAuditMisstatedError")


@pytest.mark.parametrize("view", [True, False], ids=["session view", "ledger"])
def test_a_survivor_set_narrowed_to_a_colluder_gets_no_masked_terms(tmp_path: Path, view: bool) -> None:
    """The coordinator names two survivors (client-0 and its colluder client-1): were client-0 to mask
    its residual for that set, client-1 could remove its only pad.  It refuses before masking: on
    delivery, where its session record holds what it saw of the session; else (a record without
    it) when the check starts, from the survivor set its ledger says it signed in R3."""
    federation = make_federation(tmp_path, n_clients=4)
    pair = ["client-0", "client-1"]

    def edit(classifier: Classifier) -> Classifier:
        return dataclasses.replace(
            classifier, sessions=tuple({**s, "survivors": pair} for s in classifier.sessions)
        )

    def tamper(node: int, group: str, envelope: Envelope) -> Envelope:
        if group == "classifier":
            return _edit_json(
                envelope, "verify-commitments", lambda r: [r.pop(c) for c in set(r) - set(pair)]
            )
        return envelope

    server, transport = _server(federation, tamper)
    classifier = edit(server.run())
    if not view:
        state = federation.nodes[1000].state
        state.save("1", {k: v for k, v in state.load("1").items() if k != "view"})
    server.deliver(classifier, server.sign(classifier))
    assert server.report.verified == () and not any(_stored(federation).values())
    refused = [r for r in server.report.refusals if r["from"] == "client-0"]
    if view:
        assert refused and refused[0]["error"] == "ClassifierAuditMisstatedError"
        assert "states session 1's survivors other than" in refused[0]["message"]
    else:
        assert refused and refused[0]["error"] == "VerificationError"
        assert "not the set this node signed in R3" in refused[0]["message"]
    assert not any(g == "verify-sums" for _, g, _ in transport.sent)  # no masked terms to relay


def _edit_json(envelope: Envelope, key: str, edit) -> Envelope:
    relayed = json.loads(str(envelope.meta[key]))
    edit(relayed)
    return Envelope(envelope.kind, {**envelope.meta, key: json.dumps(relayed)}, envelope.payload)


def _relayed(envelope: Envelope) -> dict[str, bytes]:
    ids = json.loads(str(envelope.meta["masked-ids"]))
    size = len(envelope.payload) // len(ids)
    return {cid: envelope.payload[i * size : (i + 1) * size] for i, cid in enumerate(ids)}


def _relay(envelope: Envelope, masked: dict[str, bytes]) -> Envelope:
    ids, data = pv.pack_relay(masked)
    return Envelope(envelope.kind, {**envelope.meta, "masked-ids": json.dumps(ids)}, data)


def _withhold(envelope: Envelope) -> Envelope:
    masked = _relayed(envelope)
    del masked["client-2"]
    return _relay(envelope, masked)


def _forge(envelope: Envelope) -> Envelope:
    masked = _relayed(envelope)
    item = bytearray(masked["client-1"])
    item[4 + 31] ^= 1  # the first word's last bit: the sum moves by 2^-128
    return _relay(envelope, {**masked, "client-1": bytes(item)})


def _foreign_commitment(envelope: Envelope) -> Envelope:
    # A commitment the coordinator made itself (its key, not client-1's): it would hold the mask key.
    def edit(relayed: dict) -> None:
        secret = pv.VerifySecret(b"\x02" * 32)
        relayed["client-1"] = pv.commit(
            secret, "client-1", bytes(32), IdentityKey.generate().private_key
        ).to_text()

    return _edit_json(envelope, "verify-commitments", edit)


@pytest.mark.parametrize(
    ("step", "edit"),
    [("verify-sums", _withhold), ("verify-sums", _forge), ("classifier", _foreign_commitment)],
    ids=["withheld value", "forged value", "foreign commitment"],
)
def test_a_tampered_relay_is_refused_by_every_survivor(tmp_path: Path, step: str, edit) -> None:
    federation = make_federation(tmp_path, n_clients=4)

    def tamper(node: int, group: str, envelope: Envelope) -> Envelope:
        return edit(envelope) if group == step else envelope

    server, _ = _run(federation, tamper=tamper)
    _refused_by_all(server, federation, {f"client-{k}" for k in range(4)}, "VerificationError")


def test_a_node_given_another_file_makes_every_sum_fail(tmp_path: Path) -> None:
    """The coordinator delivers one node another signed file: that node's pads are keyed to another
    transcript, so they cancel with nobody's; every node refuses, none learns a sum over two files.
    (There is no challenge to fix in advance: every coordinate of the residual is checked.)"""
    federation = make_federation(tmp_path, n_clients=4)
    swapped: list[bytes] = []

    def tamper(node: int, group: str, envelope: Envelope) -> Envelope:
        if group == "classifier" and node == 1000:
            return Envelope(envelope.kind, envelope.meta, swapped[0])
        return envelope

    server, _ = _server(federation, tamper)
    classifier = server.run()
    swapped.append(server.sign(_perturb(classifier)))
    server.deliver(classifier, server.sign(classifier))
    _refused_by_all(server, federation, {f"client-{k}" for k in range(4)}, "VerificationError")


def test_a_survivor_that_drops_during_the_check_leaves_the_classifier_unverified(tmp_path: Path) -> None:
    federation = make_federation(tmp_path / "delivery", n_clients=4)
    federation.nodes[1001].dead_from = "classifier"  # gone before its masked terms: no sum can be formed
    server, _, _ = run_server(federation)
    assert server.report.verified == () and server.report.acknowledged == ()
    assert not any(_stored(federation).values())  # held until verified: the session can be run again
    later = make_federation(tmp_path / "relay", n_clients=4)
    later.nodes[1001].dead_from = "verify-sums"  # gone after its terms: the others still form the sum
    server, _, _ = run_server(later)
    assert server.report.verified == ("client-0", "client-2", "client-3")
    assert _stored(later) == {"client-0": True, "client-1": False, "client-2": True, "client-3": True}


def test_a_node_that_stores_every_classifier_marks_it_verified_after_the_check(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=3)
    for node in federation.nodes.values():
        node.settings = dataclasses.replace(node.settings, require_verified="false")
    server, _ = _run(federation, change=_swap)  # stored on delivery, never marked verified
    assert server.report.acknowledged == ("client-0", "client-1", "client-2") and server.report.verified == ()
    for node in federation.nodes.values():
        assert verification_status(node.settings.out_dir / "classifier.json").startswith(
            "classifier check: NOT"
        )


def test_a_study_the_check_does_not_cover_is_stored_unverified_or_refused_where_required(
    tmp_path: Path,
) -> None:
    two_rounds = Method(rounds=2, min_pos=1, min_neg=1, tau=0.5)  # round 2 is not checked
    federation = make_federation(tmp_path / "default", n_clients=3, method=two_rounds)
    server, _, _ = run_server(federation)
    assert server.report.acknowledged == ("client-0", "client-1", "client-2") and server.report.verified == ()
    path = federation.nodes[1000].settings.out_dir / "classifier.json"
    assert verification_status(path).startswith("classifier check: NOT verified")
    strict = make_federation(tmp_path / "strict", n_clients=3, method=two_rounds)
    for node in strict.nodes.values():
        node.settings = dataclasses.replace(node.settings, require_verified="true")
    server = FederationServer(
        InProcessTransport(strict), strict.roster, strict.study, round_timeout=1, signer=strict.signer,
        colluders=0, log=lambda s: None,
    )  # fmt: skip
    with pytest.raises(FederationAbortedError):
        server.run()
    assert {r["error"] for r in server.report.refusals} == {"UnverifiedClassifierError"}
    assert len(server.report.refusals) == 3 and not any(_stored(strict).values())


def test_predict_says_whether_the_classifier_was_verified(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=3)
    run_server(federation)
    node = federation.nodes[1000]
    model = node.settings.out_dir / "classifier.json"
    args = ["predict", "--model", str(model), "--roster", str(node.settings.roster), "--features",
            str(node.settings.features), "--out", str(tmp_path / "p.csv")]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "classifier check: verified by this node" in result.output
    (node.settings.out_dir / "classifier.verified.json").unlink()
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0 and "classifier check: NOT verified" in again.output


def test_the_node_config_names_the_requirement_and_refuses_other_values(tmp_path: Path) -> None:
    from secure_afl.deploy.client import NodeSettings
    from secure_afl.deploy.errors import ConfigurationError

    config = {"identity-key": "k", "passphrase-file": "p", "roster": "r", "features": "f", "ledger-dir": "l",
              "out-dir": "o"}  # fmt: skip
    assert NodeSettings.from_node_config(config).require_verified == "when-offered"
    assert (
        NodeSettings.from_node_config({**config, "require-verified-classifier": "false"}).require_verified
        == "false"
    )
    with pytest.raises(ConfigurationError, match="require-verified-classifier='maybe' must be one of"):
        NodeSettings.from_node_config({**config, "require-verified-classifier": "maybe"})
