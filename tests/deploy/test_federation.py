"""The deployment's server and client code in one process (Flower's runtime: test_deploy_local.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from secure_afl.deploy.classifier import Classifier
from secure_afl.deploy.errors import FederationAbortedError
from secure_afl.deploy.server import FederationServer
from secure_afl.deploy.study import Method, round1_layout
from secure_afl.deploy.wire import Envelope
from secure_afl.keys import IdentityKey, Roster, RosterEntry, save_identity_key
from secure_afl.rehearsal import reference_classifier

from .helpers import PASSPHRASE, InProcessTransport, make_federation, run_server, write_cosigned_roster


@pytest.mark.parametrize("colluders", [None, 0])
def test_round2_forms_only_the_pseudo_label_groups_the_nodes_colluder_bound_accepts(
    tmp_path: Path, colluders: int | None
) -> None:
    # n = 6, t = 5: one colluder under the default bound. Class 0 is missed by clients 3-5 (a group of
    # three), class 1 by clients 4-5 (two: with one colluder the other's projection is exposed, so the
    # nodes would refuse the session if the server formed it).
    active = {"client-0": (0, 1, 2), "client-1": (0, 1, 2), "client-2": (0, 1, 2), "client-3": (1, 2),
              "client-4": (2,), "client-5": (2,)}  # fmt: skip
    method = Method(rounds=2, min_pos=1, min_neg=1, tau=0.5)
    federation = make_federation(
        tmp_path, n_clients=6, active=active, method=method, colluders=colluders, rows=40
    )
    server, classifier, _ = run_server(federation)
    session2 = server.report.sessions[1]
    # Without colluders pseudo/1 = {4, 5} is large enough, but beside pseudo/0 = {3, 4, 5} it would
    # give client-3's projection away (the teacher is the server's: 4's and 5's two values may be
    # one, SECURITY.md "Inventory of server choices"), so the server forms pseudo/0 alone either way.
    expected = ["pseudo/0"]
    assert [g["name"] for g in session2.groups] == expected
    assert session2.survivors == tuple(f"client-{k}" for k in range(6))  # nobody refused
    minimum = 3 if colluders is None else 2
    reference = reference_classifier(
        federation.data, federation.study, roster_size=6, dropouts={}, device="cpu",
        colluders="n-t" if colluders is None else str(colluders),
    )  # fmt: skip
    assert np.array_equal(reference.coef, classifier.weights)
    assert server.round2_min_group_size == minimum


@pytest.mark.parametrize("rounds", [1, 2])
def test_deployment_equals_the_simulation_over_the_same_survivors_bit_for_bit(
    tmp_path: Path, rounds: int
) -> None:
    # Round 2 needs two live clients that miss one class (pseudo/0: client-0 and client-1); pseudo/1
    # would hold client-4 alone, so it is not summed (on either side).
    active = {
        "client-0": (1, 2),
        "client-1": (1, 2),
        "client-2": (0, 1, 2),
        "client-3": (0, 1, 2),
        "client-4": (0, 2),
    }
    method = Method(rounds=rounds, min_pos=1, min_neg=1, tau=0.5)
    federation = make_federation(tmp_path, n_clients=5, active=active, method=method)
    federation.nodes[1002].dead_from = "s1-R1"  # client-2 advertises keys, then is killed
    server, classifier, _ = run_server(federation)
    session1 = server.report.sessions[0]
    assert session1.participants == ("client-0", "client-1", "client-2", "client-3", "client-4")
    assert session1.survivors == ("client-0", "client-1", "client-3", "client-4")
    if rounds == 2:
        assert [g["name"] for g in server.report.sessions[1].groups] == ["pseudo/0"]
    assert [s.label for s in server.report.sessions] == (["1", "2"] if rounds == 2 else ["1"])
    reference = reference_classifier(
        federation.data,
        federation.study,
        roster_size=5,
        dropouts={"R1": ["client-2"]},
        device="cpu",
        colluders="0",
    )
    assert reference.survivors == session1.survivors
    assert classifier.weights.dtype == np.float64
    assert np.array_equal(classifier.weights, reference.coef)  # bit for bit, not approximately
    assert classifier.weights.tobytes() == reference.coef.tobytes()
    # Without the dropout the classifier differs: the comparison can fail.
    everyone = reference_classifier(
        federation.data, federation.study, roster_size=4, dropouts={}, device="cpu", colluders="0"
    )
    assert not np.array_equal(everyone.coef, classifier.weights)
    # Every survivor stored the same classifier, and the file round-trips exactly.
    assert server.report.acknowledged == ("client-0", "client-1", "client-3", "client-4")
    for cid in server.report.acknowledged:
        stored = tmp_path / f"out-{cid}" / "classifier.json"
        assert np.array_equal(Classifier.load(stored, roster=federation.roster).weights, classifier.weights)
    assert [d["client"] for d in server.report.dropouts] == ["client-2"]
    # The session's secrets were dropped from every node's local state when it ended.
    for node in federation.nodes.values():
        for record in node.state.records.values():
            assert "seed" not in record or record["status"] == "active"


def test_the_round1_layout_is_the_methods_own(tmp_path: Path) -> None:
    from secure_afl.aggregation.layout import layout_of
    from secure_afl.analytic import client_statistics

    for method in (Method(), Method(gram="class", balance="global"), Method(rounds=2, gram="class")):
        federation = make_federation(
            tmp_path / method.gram / method.balance / str(method.rounds), method=method
        )
        features, labels, _ = federation.data["client-0"]
        stats = client_statistics(features, labels, device="cpu")
        everything = stats.contributions(
            range(3), balance=method.balance, gram=method.gram, include_global_gram=method.rounds == 2
        )
        expected = layout_of({"c": everything})
        layout = round1_layout(federation.study)
        assert layout.group_specs() == expected.group_specs()


def test_a_node_whose_key_is_not_in_the_roster_is_refused_at_the_node_and_reported_at_the_server(
    tmp_path: Path,
) -> None:
    federation = make_federation(tmp_path)
    node = federation.nodes[1003]
    intruder = IdentityKey.generate()
    key_path = tmp_path / "intruder.key"
    save_identity_key(key_path, intruder, PASSPHRASE, scrypt_n=2**10)
    node.settings = type(node.settings)(**{**node.settings.__dict__, "identity_key": key_path})
    server, classifier, transport = run_server(federation)
    refusals = [(r["from"], r["error"]) for r in server.report.refusals]
    # Its key is in no roster entry: it cannot be named (no Flower node id is shown either), and the
    # message the coordinator gets names the node's roster file by its node-config key, not its path.
    assert refusals == [("an unidentified node", "IdentityNotInRosterError")]
    assert "not in its roster [roster]" in server.report.refusals[0]["message"]
    assert str(tmp_path) not in json.dumps(server.report.to_dict())
    assert server.report.sessions[0].participants == ("client-0", "client-1", "client-2")
    assert classifier.sessions[0]["survivors"] == ["client-0", "client-1", "client-2"]
    # The refusing node sent nothing but its refusal, and keeps no session secret.
    assert [r.kind for n, _, r in transport.received if n == 1003] == ["refused"]
    assert node.state.records["1"] == {"status": "failed: IdentityNotInRosterError"}


def test_roster_mismatch_between_two_institutions_is_refused_by_the_one_that_differs(tmp_path: Path) -> None:
    federation = make_federation(tmp_path)
    node = federation.nodes[1001]
    # client-1's IT team pinned a roster where client-3 has another key (co-signed by that key).
    keys = {**federation.identities, "client-3": IdentityKey.generate()}
    other = Roster(RosterEntry(e.client_id, e.name, keys[e.client_id].public_key) for e in federation.roster)
    path = write_cosigned_roster(tmp_path / "roster-client-1.json", other, keys)
    node.settings = type(node.settings)(**{**node.settings.__dict__, "roster": path})
    server, _, _ = run_server(federation)
    assert [(r["from"], r["error"]) for r in server.report.refusals] == [("client-1", "RosterMismatchError")]
    assert other.fingerprint in server.report.refusals[0]["message"]
    assert server.report.sessions[0].survivors == ("client-0", "client-2", "client-3")


def _fresh_run(federation, ledgers: str | None = None) -> None:
    """A new Flower run: local state is per run; ``ledgers`` moves every node to new ledger dirs."""
    for node in federation.nodes.values():
        node.state.records.clear()
        if ledgers is not None:
            ledger_dir = node.settings.ledger_dir.parent / f"{ledgers}-{node.client_id}"
            node.settings = type(node.settings)(**{**node.settings.__dict__, "ledger_dir": ledger_dir})


def test_a_message_replayed_from_an_earlier_run_is_refused_by_its_recipient(tmp_path: Path) -> None:
    federation = make_federation(tmp_path)
    _, _, first = run_server(federation)
    old_r1 = next(env for node, group, env in first.sent if node == 1000 and group == "s1-R1")
    old_advert = next(env for node, group, env in first.received if node == 1001 and group == "s1-R0")

    # Run 2: a server-side attacker feeds client-0 the R1 message of run 1.  Only client-0 gets a
    # fresh ledger (else it too would refuse in R0, its values released in run 1).
    _fresh_run(federation)
    node = federation.nodes[1000]
    fresh = node.settings.ledger_dir.parent / "ledger2-client-0"
    node.settings = type(node.settings)(**{**node.settings.__dict__, "ledger_dir": fresh})

    def tamper(node_id: int, group: str, envelope: Envelope) -> Envelope:
        return old_r1 if (node_id == 1000 and group == "s1-R1") else envelope

    transport = InProcessTransport(federation, tamper=tamper)
    server = FederationServer(
        transport, federation.roster, federation.study, round_timeout=1, log=lambda s: None
    )
    with pytest.raises(FederationAbortedError, match="aborted after R0"):
        server.run()
    refusals = {(r["at"], r["from"], r["error"]) for r in server.report.refusals}
    # The same statistics summed again without client-0 would isolate client-0's (run 1 minus run 2):
    # every peer released them in run 1 and refuses in R0 (one contribution per value).
    peers = (1001, 1002, 1003)
    assert refusals == {("session 1 R0", f"client-{k - 1000}", "ImageAlreadyReleasedError") for k in peers}

    # Run 2b, every ledger fresh (the documented limit: a lost ledger forgets run 1): client-0 still
    # refuses the replayed R1 by itself.
    _fresh_run(federation, ledgers="ledger2b")
    server = FederationServer(
        InProcessTransport(federation, tamper=tamper), federation.roster, federation.study, round_timeout=1,
        log=lambda s: None, signer=federation.signer,
    )  # fmt: skip
    server.run()
    assert [(r["at"], r["from"], r["error"]) for r in server.report.refusals] == [
        ("session 1 R1", "client-0", "ReplayedMessageError")
    ]

    # Run 3 (fresh ledgers): the server refuses a client's advertisement replayed from run 1.
    _fresh_run(federation, ledgers="ledger3")

    class Replaying(InProcessTransport):
        def exchange(self, outgoing, group, timeout):
            replies = super().exchange(outgoing, group, timeout)
            if group == "s1-R0":
                replies[1001] = old_advert
            return replies

    server, _, _ = run_server(federation, Replaying(federation))
    assert [(r["from"], r["error"]) for r in server.report.rejections] == [
        ("node 1001", "ReplayedMessageError")
    ]
    assert "client-1" not in server.report.sessions[0].participants


def test_too_few_survivors_abort_with_a_specific_error(tmp_path: Path) -> None:
    federation = make_federation(tmp_path)
    federation.nodes[1001].dead_from = "s1-R2"
    federation.nodes[1002].dead_from = "s1-R2"
    with pytest.raises(FederationAbortedError, match="session 1 aborted after R2"):
        run_server(federation)


def test_a_released_sessions_id_reused_in_a_new_run_is_refused_in_r0_by_every_node(tmp_path: Path) -> None:
    """A coordinator that starts a new run under a session id whose release point every node passed
    (its ledger holds the survivor set): the session's own images are exempt from the released-image
    rule (Flower may deliver an R0 again before the release), so the nodes would have advertised rows
    they released and signed a second commitment for the session.  Every node refuses in R0 instead,
    and its ledger entry of the session is unchanged."""
    federation = make_federation(tmp_path)
    first, _, _ = run_server(federation)
    session_id = first.report.sessions[0].session_id
    entries = {
        n.client_id: (n.settings.ledger_dir / f"{n.client_id}.ledger.json").read_bytes()
        for n in federation.nodes.values()
    }
    _fresh_run(federation)
    server = FederationServer(
        InProcessTransport(federation), federation.roster, federation.study, round_timeout=1,
        log=lambda s: None, session_ids=[session_id],
    )  # fmt: skip
    with pytest.raises(FederationAbortedError, match="aborted after R0"):
        server.run()
    nodes = {n.client_id for n in federation.nodes.values()}
    refusals = {(r["at"], r["from"], r["error"]) for r in server.report.refusals}
    assert refusals == {("session 1 R0", cid, "SessionReplayError") for cid in nodes}, server.report.refusals
    for node in federation.nodes.values():
        ledger = node.settings.ledger_dir / f"{node.client_id}.ledger.json"
        assert ledger.read_bytes() == entries[node.client_id]
