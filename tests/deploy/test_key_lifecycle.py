"""Membership and key lifecycle through the deployment's handler (secure_afl.deploy.client.handle):
a revoked or rotated-away key cannot start, sign or answer a session; a rotated node keeps its ledger;
a node's ledger and DP budget carry across roster versions; a removed member's images stay counted."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from secure_afl.deploy import client as node_client
from secure_afl.deploy.errors import FederationAbortedError
from secure_afl.deploy.server import FederationServer
from secure_afl.deploy.sums import load_sums, save_sums
from secure_afl.keys import IdentityKey, Roster, RosterEntry, save_identity_key
from secure_afl.keys.cosign import cosigned_roster_json, sign_roster
from secure_afl.keys.lifecycle import accept_successor, next_version, write_pin
from secure_afl.keys.recognition import Recognition
from secure_afl.keys.rotation import KeyRotation
from secure_afl.privacy.ledger import FileLedger, LedgerOwner

from .helpers import PASSPHRASE, Federation, InProcessTransport, make_federation

TARGET = "client-0"


def _move(federation: Federation, following: Roster, recognition: Recognition | None = None) -> None:
    """Every node moves to ``following`` as `keys roster update` does: co-signed by every member of it,
    checked against the pinned roster, written over the node's roster file, the version pinned."""
    keys = federation.identities
    text = cosigned_roster_json(following, dict(sign_roster(following, keys[e.client_id]) for e in following))
    for node in federation.nodes.values():
        pinned = node.settings.roster.read_text()
        accept_successor(pinned, text, recognition or Recognition(assume_recognised=True))
    for node in federation.nodes.values():
        node.settings.roster.write_text(text)
        write_pin(node.settings.ledger_dir, following)
        node.state.records.clear()  # a new Flower run
    federation.roster = following


def _new_key(federation: Federation, cid: str, tmp_path: Path) -> IdentityKey:
    key = IdentityKey.generate()
    path = tmp_path / f"{cid}.next.key"
    save_identity_key(path, key, PASSPHRASE, scrypt_n=2**10)
    return key


def _with_key(roster: Roster, cid: str, key: IdentityKey) -> tuple[RosterEntry, ...]:
    return tuple(
        RosterEntry(e.client_id, e.name, key.public_key) if e.client_id == cid else e for e in roster
    )


def _node(federation: Federation, cid: str):
    return next(node for node in federation.nodes.values() if node.client_id == cid)


def _use_key(federation: Federation, cid: str, key: IdentityKey, tmp_path: Path) -> None:
    """The node's operator switches its node config to ``key`` (keys rotate's new identity.key)."""
    node = _node(federation, cid)
    node.settings = dataclasses.replace(node.settings, identity_key=tmp_path / f"{cid}.next.key")
    federation.identities[cid] = key


def _run(
    federation: Federation, study=None, **kwargs
) -> tuple[FederationServer, InProcessTransport, Exception | None]:
    transport = InProcessTransport(federation)
    server = FederationServer(
        transport, kwargs.pop("roster", federation.roster), study or federation.study, round_timeout=1,
        log=lambda s: None, signer=federation.signer, colluders=0, **kwargs,
    )  # fmt: skip
    try:
        server.classifier = server.run()  # type: ignore[attr-defined]
    except FederationAbortedError as exc:
        return server, transport, exc
    server.deliver(server.classifier)  # type: ignore[attr-defined]
    return server, transport, None


def _refusals(transport: InProcessTransport) -> dict[str, set[str]]:
    ids = {node_id: node.client_id for node_id, node in transport.federation.nodes.items()}
    out: dict[str, set[str]] = {}
    for node_id, _, reply in transport.received:
        if reply.kind == "refused":
            out.setdefault(ids[node_id], set()).add(str(reply.meta["error"]))
    return out


@pytest.mark.parametrize("how", ["revoked", "rotated"])
def test_a_node_whose_key_was_revoked_or_rotated_away_refuses_to_run_and_its_new_key_takes_part(
    how: str, tmp_path: Path
) -> None:
    federation = make_federation(tmp_path, n_clients=3)  # t = 3: nothing is released without client-0
    old = federation.identities[TARGET]
    new = _new_key(federation, TARGET, tmp_path)
    entries = _with_key(federation.roster, TARGET, new)
    rotations = (KeyRotation.make(TARGET, old, new.public_key),) if how == "rotated" else ()
    following = next_version(federation.roster).replace(
        entries=entries, revoked=(old.fingerprint,), rotations=rotations
    )
    signers = federation.identities
    federation.identities = {**signers, TARGET: new}
    # a revoked key's replacement is recognised like a newcomer; a rotation is vouched for by the old key
    expect = Recognition(expected={TARGET: new.fingerprint}) if how == "revoked" else Recognition()
    _move(federation, following, expect)
    federation.identities = signers  # the node's operator has not switched to the new key yet
    _, transport, aborted = _run(federation)
    assert _refusals(transport).get(TARGET) == {"KeyRevokedError"}
    refused = [r for n, g, r in transport.received if r.kind == "refused" and g == "s1-R0"]
    assert "revoked or rotated away" in refused[0].meta["message"]
    assert aborted is not None  # t = 3 of 3: the session cannot go on without it
    # with its new key (and its ledger moved to it, as keys rotate --ledger-dir does), it takes part
    FileLedger(_node(federation, TARGET).settings.ledger_dir).rotate(
        LedgerOwner(TARGET, old), LedgerOwner(TARGET, new), KeyRotation.make(TARGET, old, new.public_key)
    )
    _use_key(federation, TARGET, new, tmp_path)
    for node in federation.nodes.values():
        node.state.records.clear()
    server, transport, aborted = _run(federation)
    assert (
        aborted is None and _refusals(transport) == {} and TARGET in server.report.sessions[-1].participants
    )


def test_an_advertisement_signed_by_a_revoked_key_is_refused_by_every_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key leaked: an attacker holds it, runs client-0's node with it, and the server relays its
    advertisement (verifying it against a roster view with the old key, shown under the new roster's
    fingerprint).  Every peer that pinned the new version refuses the session (RelayedSignatureError)."""
    federation = make_federation(tmp_path, n_clients=4)
    old = federation.identities[TARGET]
    new = _new_key(federation, TARGET, tmp_path)
    v1 = federation.roster
    following = next_version(v1).replace(entries=_with_key(v1, TARGET, new), revoked=(old.fingerprint,))
    federation.identities = {**federation.identities, TARGET: new}
    _move(federation, following, Recognition(expected={TARGET: new.fingerprint}))
    attacker = _node(federation, TARGET).settings  # the old key file: what leaked

    class View(Roster):  # client-0 with its old key, shown under the new roster's fingerprint
        def digest(self) -> bytes:
            return following.digest()

        @property
        def fingerprint(self) -> str:
            return following.fingerprint

    view = View(v1.entries, v1.coordinator)
    pinned = node_client.node_roster
    # the attacker's node (modified code) takes part under the view; the server verifies against it too
    monkeypatch.setattr(node_client, "node_roster", lambda s: view if s == attacker else pinned(s))
    _, transport, aborted = _run(federation, roster=view)
    assert aborted is not None
    refusals = _refusals(transport)
    peers = {cid for cid in federation.roster.client_ids if cid != TARGET}
    assert {cid for cid, errors in refusals.items() if "RelayedSignatureError" in errors} == peers
    # nothing was released by any honest peer
    for cid in peers:
        state = FileLedger(_node(federation, cid).settings.ledger_dir).load(
            LedgerOwner(cid, federation.identities[cid])
        )
        assert all(entry.survivors is None for entry in state.sessions.values())


def test_a_new_roster_version_is_not_a_fresh_dp_budget_and_a_rotated_node_keeps_its_spends(
    tmp_path: Path,
) -> None:
    """The patient-unit chain of test_growing_dp_budget (each node's limit fits two sessions, not three),
    with a new roster version before each session: the third is refused by every node all the same."""
    from .test_growing import _pin
    from .test_growing_dp_budget import ARRIVALS, _arrive, _federation

    federation, full, _ = _federation(tmp_path, "patient")
    coordinator = tmp_path / "coordinator"
    study, earlier, refusals = federation.study, None, None
    for k, n in enumerate(ARRIVALS):
        if k == 1:  # client-0 rotates its key: roster version 2, its ledger moved to the new key
            old, new = federation.identities[TARGET], _new_key(federation, TARGET, tmp_path)
            rotation = KeyRotation.make(TARGET, old, new.public_key)
            following = next_version(federation.roster).replace(
                entries=_with_key(federation.roster, TARGET, new),
                revoked=(old.fingerprint,),
                rotations=(rotation,),
            )
            federation.identities = {**federation.identities, TARGET: new}
            _move(federation, following)
            FileLedger(_node(federation, TARGET).settings.ledger_dir).rotate(
                LedgerOwner(TARGET, old), LedgerOwner(TARGET, new), rotation
            )
            _use_key(federation, TARGET, new, tmp_path)
        if k == 2:  # version 3: nothing but the version changes
            _move(federation, next_version(federation.roster))
        _arrive(federation, full, n)
        if k:
            study = dataclasses.replace(federation.study, extends=study.digest())
        _pin(federation, study)
        server, _, aborted = _run(federation, study, earlier=earlier)
        if aborted is not None:
            refusals = server.report.refusals
            break
        save_sums(coordinator, server.accumulated)
        earlier = load_sums(coordinator, study.digest())
    assert federation.roster.version == 3 and k == 2
    assert refusals is not None and {(r["error"], r["at"]) for r in refusals} == {
        ("ChainBudgetExceededError", "session 1 R0")
    }
    assert sorted(r["from"] for r in refusals) == [f"client-{i}" for i in range(4)]
    rotated = FileLedger(_node(federation, TARGET).settings.ledger_dir).load(
        LedgerOwner(TARGET, federation.identities[TARGET])
    )
    assert len([e for e in rotated.sessions.values() if e.spend]) == 2 and len(rotated.rotations) == 1


def test_a_removed_members_images_stay_counted_in_the_classifier_and_in_every_ledger(tmp_path: Path) -> None:
    """Five hospitals release 20 images each; roster version 2 removes client-4; the four others add 20
    more each.  The classifier equals the centralised fit on every released image, client-4's included,
    and every ledger, client-4's too, still holds its first release."""
    from secure_afl.deploy.study import Method
    from secure_afl.features.file import load_feature_file

    from .test_growing import _arrive, _centralised, _pin

    federation = make_federation(tmp_path, n_clients=5, rows=40, method=Method(balance="global"))
    full = {
        n.client_id: load_feature_file(n.settings.features, require_labels=True)
        for n in federation.nodes.values()
    }
    _arrive(federation, full, dict.fromkeys(full, 20))
    _pin(federation, federation.study)
    first, _, aborted = _run(federation)
    assert aborted is None and len(first.report.sessions[-1].participants) == 5
    save_sums(tmp_path / "coordinator", first.accumulated)
    removed = "client-4"
    removed_node = next(k for k, n in federation.nodes.items() if n.client_id == removed)
    removed_ledger = FileLedger(federation.nodes[removed_node].settings.ledger_dir)
    before = removed_ledger.load(LedgerOwner(removed, federation.identities[removed]))
    following = next_version(federation.roster).replace(
        entries=tuple(e for e in federation.roster if e.client_id != removed)
    )
    _move(federation, following)
    gone = federation.nodes.pop(removed_node)
    counts = {**dict.fromkeys(full, 40), removed: 20}
    _arrive(federation, full, counts)
    study = dataclasses.replace(federation.study, extends=federation.study.digest())
    _pin(federation, study)
    second, _, aborted = _run(
        federation, study, earlier=load_sums(tmp_path / "coordinator", federation.study.digest())
    )
    assert aborted is None and removed not in second.report.sessions[-1].participants
    expected = _centralised(federation, full, counts, federation.study.method.gamma)
    assert np.max(np.abs(second.classifier.weights - expected)) < 1e-9
    without = _centralised(
        federation, {c: f for c, f in full.items() if c != removed}, counts, federation.study.method.gamma
    )
    assert np.max(np.abs(second.classifier.weights - without)) > 1e-3
    for node in federation.nodes.values():
        state = FileLedger(node.settings.ledger_dir).load(
            LedgerOwner(node.client_id, federation.identities[node.client_id])
        )
        released = [len(e.images) // 32 for e in state.sessions.values() if e.survivors is not None]
        assert sorted(released) == [20, 20]  # its first 20 images under version 1, 20 more under version 2
    after = removed_ledger.load(LedgerOwner(removed, federation.identities[removed]))
    assert after.sessions == before.sessions and gone.client_id == removed
