"""A node's own dp-epsilon over a growing DP chain, through the deployment's handler (in process):
under the patient unit one patient's images fall in several sessions, so the node composes its
released sessions of the chain with the new one and refuses, in R0, a session that would take the
chain past its limit; under the image unit the chain's ε is the max over sessions (issue 29)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from secure_afl.deploy.errors import ConfigurationError, FederationAbortedError
from secure_afl.deploy.local import node_dp_epsilon
from secure_afl.deploy.server import FederationServer
from secure_afl.deploy.study import Method, StudyDp, noise_plan
from secure_afl.deploy.sums import load_sums, save_sums
from secure_afl.features.file import load_feature_file, save_feature_file
from secure_afl.privacy.dp import epsilon_of

from .helpers import Federation, InProcessTransport, make_federation
from .test_growing import _pin

ROWS, CLIP, EPSILON, CAP = 60, 8.0, 1.0, 2
ARRIVALS = (20, 40, 60)  # each hospital's rows arrive in three batches of 20
NODE_DELTA = 1e-6  # the nodes set no dp-delta: the default floor


def _federation(tmp_path: Path, unit: str) -> tuple[Federation, dict, dict[str, float]]:
    """Four DP hospitals whose patients (10 each, 6 images) have images in every batch; each node's
    dp-epsilon fits a patient chain's composed ε over two sessions but not three (the limits)."""
    federation = make_federation(tmp_path, n_clients=4, rows=ROWS, method=Method(balance="global"))
    lists = {cid: tuple(data[2]) for cid, data in federation.data.items()}
    dp = StudyDp(epsilon=EPSILON, class_lists=lists, clip=CLIP, unit=unit, max_images_per_patient=CAP)
    federation.study = dataclasses.replace(federation.study, dp=dp)
    full = {}
    for node in federation.nodes.values():
        file = load_feature_file(node.settings.features, require_labels=True)
        full[node.client_id] = dataclasses.replace(
            file, patient_ids=tuple(f"{node.client_id}-p{i % 10}" for i in range(ROWS))
        )
    # the limits deploy local gives its nodes for a two-session patient chain (under either unit here)
    patient = dataclasses.replace(federation.study, dp=dataclasses.replace(dp, unit="patient"))
    plan = noise_plan(patient, len(federation.roster))
    limits = {}
    for cid in full:
        limits[cid] = node_dp_epsilon(patient, len(federation.roster), cid, sessions=2)
        events = plan.events(cid)
        assert (
            EPSILON < epsilon_of(events * 2, NODE_DELTA) <= limits[cid] < epsilon_of(events * 3, NODE_DELTA)
        )
    for node in federation.nodes.values():
        node.settings = dataclasses.replace(node.settings, dp_epsilon=limits[node.client_id])
    return federation, full, limits


def _arrive(federation: Federation, full: dict, n: int) -> None:
    for node in federation.nodes.values():
        file = full[node.client_id]
        save_feature_file(
            node.settings.features, file.features[:n], labels=file.labels[:n], active=file.active,
            classes=file.classes, backbone=file.backbone, weights_id=file.weights_id,
            preprocessing=file.preprocessing, image_sha256=file.image_sha256[:n],
            patient_ids=file.patient_ids[:n],
        )  # fmt: skip
        node.state.records.clear()  # a new Flower run


def _ledger_dirs(federation: Federation) -> dict[str, dict[str, bytes]]:
    return {
        node.client_id: {p.name: p.read_bytes() for p in sorted(node.settings.ledger_dir.iterdir())}
        for node in federation.nodes.values()
    }


def _chain(tmp_path: Path, unit: str, sessions: int = 3) -> dict:
    """Run up to ``sessions`` growing studies; stop at the first the nodes refuse."""
    federation, full, limits = _federation(tmp_path, unit)
    coordinator = tmp_path / "coordinator"
    study, earlier, servers = federation.study, None, []
    out: dict = {"federation": federation, "limits": limits, "servers": servers}
    for k, n in enumerate(ARRIVALS[:sessions]):
        _arrive(federation, full, n)
        if k:
            study = dataclasses.replace(federation.study, extends=servers[-1].study.digest())
        _pin(federation, study)
        before = _ledger_dirs(federation)
        server = FederationServer(
            InProcessTransport(federation), federation.roster, study, round_timeout=1,
            log=lambda s: None, signer=federation.signer, colluders=0, earlier=earlier,
        )  # fmt: skip
        try:
            classifier = server.run()
        except FederationAbortedError as exc:
            out.update(refused=server, aborted=str(exc), before=before, after=_ledger_dirs(federation))
            return out
        server.deliver(classifier)
        server.classifier = classifier  # type: ignore[attr-defined]
        save_sums(coordinator, server.accumulated)
        earlier = load_sums(coordinator, study.digest())
        servers.append(server)
    return out


@pytest.fixture(scope="module")
def patient_chain(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _chain(tmp_path_factory.mktemp("patient"), "patient")


def test_under_the_patient_unit_a_node_refuses_the_session_that_would_compose_past_its_limit(
    patient_chain: dict,
) -> None:
    servers, server = patient_chain["servers"], patient_chain["refused"]
    # the first two sessions were accepted by every node, with nothing refused
    assert len(servers) == 2
    assert all(s.report.refusals == [] and s.report.rejections == [] for s in servers)
    # the third is refused by every node in R0, with the chain error: the session aborts there
    assert "aborted after R0" in patient_chain["aborted"]
    refusals = server.report.refusals
    assert sorted(r["from"] for r in refusals) == [f"client-{k}" for k in range(4)]
    assert {(r["error"], r["at"]) for r in refusals} == {("ChainBudgetExceededError", "session 1 R0")}
    # nothing was released: every node's ledger-dir (its ledger, its DP records) is as it was
    assert patient_chain["after"] == patient_chain["before"]
    # the two accepted sessions' chain ε is the composed one, within each node's limit
    growth = servers[-1].classifier.privacy["growth"]
    assert growth["composition"] == "rdp"
    for cid, limit in patient_chain["limits"].items():
        assert max(s["epsilon_spent"][cid] for s in growth["sessions"]) < growth["epsilon_chain"][cid]
        assert growth["epsilon_chain"][cid] <= limit


def test_the_chain_refusal_names_the_spent_the_session_the_total_and_the_limit(patient_chain: dict) -> None:
    federation = patient_chain["federation"]
    plan = noise_plan(federation.study, len(federation.roster))
    for refusal in patient_chain["refused"].report.refusals:
        cid, message = refusal["from"], refusal["message"]
        events = plan.events(cid)
        limit = patient_chain["limits"][cid]
        assert f"dp-epsilon {limit:g}" in message
        spent = epsilon_of(events * 2, NODE_DELTA)
        assert f"already spent ε = {spent:.4g} in 2 released session(s)" in message
        assert f"this session spends ε = {epsilon_of(events, NODE_DELTA):.4g}" in message
        assert f"the chain's ε would be {epsilon_of(events * 3, NODE_DELTA):.4g} at δ = 1e-06" in message
        assert "composed in one RdpAccountant (patient unit" in message
        assert "Nothing was released" in message
        for remedy in ("raise this node's dp-epsilon knowingly", "start a new chain", "dp-unit image"):
            assert remedy in message
        assert "[path]" not in message and "missed a session" not in message


def test_under_the_image_unit_the_same_limits_take_all_three_sessions(tmp_path: Path) -> None:
    chain = _chain(tmp_path, "image")
    assert "refused" not in chain
    servers = chain["servers"]
    assert len(servers) == 3 and all(s.report.refusals == [] for s in servers)
    growth = servers[-1].classifier.privacy["growth"]
    assert growth["composition"] == "parallel"
    plan = noise_plan(chain["federation"].study, len(chain["federation"].roster))
    for cid, limit in chain["limits"].items():
        per_session = [s["epsilon_spent"][cid] for s in growth["sessions"]]
        assert growth["epsilon_chain"][cid] == max(per_session) <= limit
        # composed (as the patient unit would), the three sessions would exceed the limit
        assert epsilon_of(plan.events(cid) * 3, NODE_DELTA) > limit


def test_a_node_that_missed_a_session_of_the_chain_counts_every_release_it_recorded(tmp_path: Path) -> None:
    """The node follows the chain back through its own records; past a study it has no record of
    (it missed that session) it cannot tell which of its releases belong to the chain, so it counts
    every release it recorded under the unit; a recorded study its ledger shows unreleased counts 0."""

    from secure_afl.deploy.client import _DP_SESSIONS_DOMAIN, DP_SESSIONS, DP_SESSIONS_FORMAT, _chain_released
    from secure_afl.deploy.study import Study
    from secure_afl.privacy.ledger import FileLedger, LedgerOwner, signed_json

    federation, _, _ = _federation(tmp_path, "patient")
    node = federation.nodes[1000]
    settings, cid = node.settings, node.client_id
    identity = federation.identities[cid]
    first = federation.study
    missed = dataclasses.replace(first, extends=first.digest(), min_group_size=3)  # another digest
    third = dataclasses.replace(first, extends=missed.digest())
    unreleased = dataclasses.replace(first, min_group_size=4)  # recorded, refused before R3
    spend = {"epsilon": 1.0, "events": [[0.01, 0.0]], "unit": "patient", "delta": 1e-6}
    records = {s.digest(): {"extends": s.extends, "client": cid, "spend": spend} for s in (first, unreleased)}
    owner = LedgerOwner(cid, identity)
    settings.ledger_dir.mkdir(parents=True, exist_ok=True)

    def write(records: dict) -> None:
        document = {"format": DP_SESSIONS_FORMAT, "client_id": cid, "studies": records}
        (settings.ledger_dir / DP_SESSIONS).write_bytes(signed_json(owner, _DP_SESSIONS_DOMAIN, document))

    write(records)

    def released(study: Study, session: str):
        def change(state) -> None:
            entry = state.entry(bytes.fromhex(session))
            entry.survivors, entry.scope = ("client-0", "client-1"), f"study:{study.digest()}/round:1"

        return change

    ledger = FileLedger(settings.ledger_dir)
    ledger.update(LedgerOwner(cid, identity), released(first, "01" * 32))
    # the node was not in the missed session: no record of it, and its ledger shows no release
    spends, broken = _chain_released(third, settings, cid, identity)
    assert broken and [s.epsilon for s in spends] == [1.0]  # the first study's, found past the gap
    # a session the ledger shows released but that has no record: the record was lost, and
    # counting nothing for it would under-count, so the node refuses
    ledger.update(LedgerOwner(cid, identity), released(missed, "02" * 32))
    with pytest.raises(
        ConfigurationError, match=r"shows study .* released, but ledger-dir's dp-sessions.json"
    ):
        _chain_released(third, settings, cid, identity)
    # with a record of the missed study the walk reaches the first one without guessing
    records[missed.digest()] = {"extends": missed.extends, "client": cid, "spend": {**spend, "epsilon": 0.5}}
    write(records)
    spends, broken = _chain_released(third, settings, cid, identity)
    assert not broken and sorted(s.epsilon for s in spends) == [0.5, 1.0]


def test_a_dp_record_modified_outside_secure_afl_is_refused(tmp_path: Path) -> None:
    """dp-sessions.json is signed with the node's identity key, as its ledger is: a lowered spend
    (or a file of another node) is refused, never counted."""
    import json

    from secure_afl.deploy.client import DP_SESSIONS, _chain_released, _record_dp_session
    from secure_afl.privacy.dp_growth import NodeSpend
    from secure_afl.privacy.ledger import LedgerOwner

    federation, _, _ = _federation(tmp_path, "patient")
    node = federation.nodes[1000]
    settings, cid = node.settings, node.client_id
    identity = federation.identities[cid]
    first = federation.study
    spend = NodeSpend(epsilon=1.0, events=((0.01, 0.0),), unit="patient", delta=1e-6)
    _record_dp_session(settings, first, LedgerOwner(cid, identity), spend)
    path = settings.ledger_dir / DP_SESSIONS
    assert path.stat().st_mode & 0o777 == 0o600
    later = dataclasses.replace(first, extends=first.digest())
    assert _chain_released(later, settings, cid, identity) == ([], False)  # recorded, not released
    document = json.loads(path.read_text())
    document["studies"][first.digest()]["spend"]["epsilon"] = 0.001  # lowered by hand
    path.write_text(json.dumps(document))
    with pytest.raises(ConfigurationError, match=r"not signed by 'client-0'.s identity key"):
        _chain_released(later, settings, cid, identity)
    other = federation.identities["client-1"]  # another node's signed file copied in
    path.unlink()
    _record_dp_session(settings, first, LedgerOwner("client-1", other), spend)
    with pytest.raises(ConfigurationError, match="is not client-0's"):
        _chain_released(later, settings, cid, identity)
