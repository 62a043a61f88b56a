"""A node's own dp-epsilon over a growing DP chain, through the deployment's handler (in process):
under the patient unit one patient's images fall in several sessions, so the node composes its
released sessions of the chain with the new one and refuses, in R0, a session that would take the
chain past its limit; under the image unit the chain's ε is the max over sessions."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from secure_afl.deploy.errors import FederationAbortedError
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


def _arrive(federation: Federation, full: dict, n: int, start: int = 0) -> None:
    for node in federation.nodes.values():
        file = full[node.client_id]
        rows = slice(start, n)
        save_feature_file(
            node.settings.features, file.features[rows], labels=file.labels[rows], active=file.active,
            classes=file.classes, backbone=file.backbone, weights_id=file.weights_id,
            preprocessing=file.preprocessing, image_sha256=file.image_sha256[rows],
            pixel_sha256=file.pixel_sha256[rows],
            patient_ids=file.patient_ids[rows],
        )  # fmt: skip
        node.state.records.clear()  # a new Flower run


def _ledger_dirs(federation: Federation) -> dict[str, dict[str, bytes]]:
    """Every node's ledger directory but its audit log (which records the refusals too) and the
    classifier check's kept values (a directory: verify.KEPT_DIR)."""
    return {
        node.client_id: {
            p.name: p.read_bytes()
            for p in sorted(node.settings.ledger_dir.iterdir())
            if p.name != "audit.log" and p.is_file()
        }
        for node in federation.nodes.values()
    }


def _chain(tmp_path: Path, unit: str, sessions: int = 3, *, fresh_last: bool = False) -> dict:
    """Run up to ``sessions`` growing studies; stop at the first the nodes refuse.  ``fresh_last``:
    the last study extends nothing (a new chain, as a server may claim) over only the new images."""
    federation, full, limits = _federation(tmp_path, unit)
    coordinator = tmp_path / "coordinator"
    study, earlier, servers = federation.study, None, []
    out: dict = {"federation": federation, "limits": limits, "servers": servers}
    for k, n in enumerate(ARRIVALS[:sessions]):
        fresh = fresh_last and k == sessions - 1
        _arrive(federation, full, n, start=ARRIVALS[k - 1] if fresh else 0)
        if fresh:
            study, earlier = dataclasses.replace(federation.study, min_group_size=3), None
        elif k:
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
        assert f"already spent ε = {spent:.4g} in 2 released DP session(s) under the patient unit" in message
        assert f"this session spends ε = {epsilon_of(events, NODE_DELTA):.4g}" in message
        assert f"the total would be {epsilon_of(events * 3, NODE_DELTA):.4g} at δ = 1e-06" in message
        assert "composed in one RdpAccountant (patient unit" in message
        assert "Nothing was released" in message
        for remedy in ("raise this node's dp-epsilon knowingly", "dp-unit image"):
            assert remedy in message
        assert "[path]" not in message


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


def test_a_new_chain_does_not_reset_a_patients_budget(tmp_path: Path) -> None:
    """A server that presents the third session as a new study extending nothing (a "new chain")
    gains nothing: under the patient unit the node composes every DP release its ledger holds."""
    chain = _chain(tmp_path, "patient", fresh_last=True)
    assert len(chain["servers"]) == 2 and chain["refused"].study.extends == ""
    refusals = chain["refused"].report.refusals
    assert {(r["error"], r["at"]) for r in refusals} == {("ChainBudgetExceededError", "session 1 R0")}
    assert len(refusals) == 4 and chain["after"] == chain["before"]


def test_each_release_carries_its_spend_into_the_signed_ledger(patient_chain: dict) -> None:
    """The spends the cap adds up are the node's own, written with the release at its release
    point into the ledger its identity key signs (a hand-edited ledger is refused as tampered)."""
    import json

    from secure_afl.privacy.dp_growth import NodeSpend
    from secure_afl.privacy.ledger import FileLedger, LedgerOwner

    federation = patient_chain["federation"]
    plan = noise_plan(federation.study, len(federation.roster))
    for node in federation.nodes.values():
        cid = node.client_id
        state = FileLedger(node.settings.ledger_dir).load(LedgerOwner(cid, federation.identities[cid]))
        spends = [e.spend for e in state.sessions.values() if e.survivors is not None]
        assert len(spends) == 2  # the two released sessions; the refused third left nothing
        for spend in spends:
            assert NodeSpend.from_json(json.loads(spend)) == NodeSpend.of(plan, cid)
