"""A federation that grows, through the deployment's handler (in process): three studies, each
extending the last, each releasing only the images not yet released; the classifier after the
third equals the centralised fit on every image."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from secure_afl.deploy.errors import ConfigurationError, FederationAbortedError
from secure_afl.deploy.server import FederationServer
from secure_afl.deploy.study import Method, Study
from secure_afl.deploy.sums import load_sums, save_sums
from secure_afl.features.file import load_feature_file, save_feature_file

from .helpers import Federation, InProcessTransport, check_study, make_federation

ROWS, ARRIVALS = 60, (20, 40, 60)  # each hospital's rows arrive in three batches


def _federation(tmp_path: Path, n_clients: int = 4) -> tuple[Federation, dict]:
    federation = make_federation(tmp_path, n_clients=n_clients, rows=ROWS, method=Method(balance="global"))
    full = {node.client_id: load_feature_file(node.settings.features, require_labels=True) for node in
            federation.nodes.values()}  # fmt: skip
    return federation, full


def _arrive(federation: Federation, full: dict, counts: dict[str, int]) -> None:
    """Each hospital's feature file now holds its first ``counts[cid]`` rows (the same extraction)."""
    for node in federation.nodes.values():
        file, n = full[node.client_id], counts[node.client_id]
        save_feature_file(
            node.settings.features, file.features[:n], labels=file.labels[:n], active=file.active,
            classes=file.classes, backbone=file.backbone, weights_id=file.weights_id,
            preprocessing=file.preprocessing, image_sha256=file.image_sha256[:n],
            pixel_sha256=file.pixel_sha256[:n],
        )  # fmt: skip
        node.state.records.clear()  # a new Flower run


def _pin(federation: Federation, study: Study) -> None:
    """Every hospital checked ``study`` (``deploy check --study``): it takes part in it."""
    check_study(federation, study, nodes=list(federation.nodes))


def _run(federation: Federation, study: Study, earlier=None) -> FederationServer:
    _pin(federation, study)
    server = FederationServer(
        InProcessTransport(federation), federation.roster, study, round_timeout=1, log=lambda s: None,
        signer=federation.signer, colluders=0, earlier=earlier,
    )  # fmt: skip
    classifier = server.run()
    server.deliver(classifier)
    server.classifier = classifier  # type: ignore[attr-defined]
    return server


def _centralised(federation: Federation, full: dict, counts: dict[str, int], gamma: float) -> np.ndarray:
    """The global-balance ridge fit on every released row, by numpy alone: class c over the rows of
    the hospitals that label c, the Gram over every row."""
    rows = {cid: np.asarray(full[cid].features[: counts[cid]], dtype=np.float64) for cid in full}
    labels = {cid: full[cid].labels[: counts[cid]].astype(bool) for cid in full}
    h = np.vstack(list(rows.values()))
    gram = h.T @ h
    weights = np.empty((h.shape[1], len(federation.study.classes)))
    for c in range(len(federation.study.classes)):
        labelled = [cid for cid in full if c in full[cid].active]
        hc = np.vstack([rows[cid] for cid in labelled])
        yc = np.concatenate([labels[cid][:, c] for cid in labelled])
        b = hc[yc].mean(axis=0) - hc[~yc].mean(axis=0)
        weights[:, c] = np.linalg.solve(gram + gamma * np.eye(h.shape[1]), b)
    return weights


def test_three_growing_sessions_equal_the_centralised_fit_on_every_image(tmp_path: Path) -> None:
    federation, full = _federation(tmp_path)
    study, earlier, servers = federation.study, None, []
    gamma = study.method.gamma
    for k, n in enumerate(ARRIVALS):
        counts = dict.fromkeys(full, n)
        _arrive(federation, full, counts)
        if k:
            study = dataclasses.replace(federation.study, extends=servers[-1].study.digest())
        server = _run(federation, study, earlier)
        assert server.report.refusals == []
        # the coordinator keeps the sums in its out-dir: the next study reads them from there
        path = save_sums(tmp_path / "coordinator", server.accumulated)
        earlier = load_sums(tmp_path / "coordinator", study.digest())
        assert path.exists() and len(earlier.chain) == k + 1
        servers.append(server)
        want = _centralised(federation, full, counts, gamma)
        got = server.classifier.weights
        assert np.max(np.abs(got - want)) < 1e-9, (k, np.max(np.abs(got - want)))
    # the last classifier records the chain: every study's session
    growth = servers[-1].classifier.protocol["growth"]
    assert growth["extends"] == servers[1].study.digest()
    assert [e["study"] for e in growth["chain"]] == [s.study.digest() for s in servers]
    # ... and it is not the fit of the last increment alone (each session released only new rows)
    alone = _centralised(federation, full, dict.fromkeys(full, 60), gamma)
    assert np.max(np.abs(servers[0].classifier.weights - alone)) > 1e-3


def test_a_member_without_new_images_commits_zero_and_one_hospital_alone_is_refused(tmp_path: Path) -> None:
    # Five hospitals; client-k misses class k (k < 3), client-3 and client-4 label every class.
    federation, full = _federation(tmp_path, n_clients=5)
    _arrive(federation, full, dict.fromkeys(full, 30))
    first = _run(federation, federation.study)
    extended = dataclasses.replace(federation.study, extends=federation.study.digest())
    # client-4 has no new images: it commits 0 rows and sends zeros, which every member's check
    # takes as known; the others' new rows still hide one another (colluders = 0 here).
    counts = {cid: 40 for cid in full} | {"client-4": 30}
    _arrive(federation, full, counts)
    second = _run(federation, extended, first.accumulated)
    assert second.report.refusals == []
    assert "client-4" in second.report.sessions[0].survivors
    want = _centralised(federation, full, counts, federation.study.method.gamma)
    assert np.max(np.abs(second.classifier.weights - want)) < 1e-9
    # one hospital adds one image and nobody else has any: releasing it would hand the server that
    # image's statistics (the sum minus known zeros), so every member refuses
    third = dataclasses.replace(federation.study, extends=extended.digest())
    _arrive(federation, full, counts | {"client-0": 41})
    _pin(federation, third)
    server = FederationServer(
        InProcessTransport(federation), federation.roster, third, round_timeout=1, log=lambda s: None,
        signer=federation.signer, colluders=0, earlier=second.accumulated,
    )  # fmt: skip
    with pytest.raises(FederationAbortedError):
        server.run()
    assert {r["error"] for r in server.report.refusals} == {"IncrementTooSmallError"}


def test_a_growing_study_needs_the_earlier_sums_and_an_additive_method(tmp_path: Path) -> None:
    federation, _ = _federation(tmp_path)
    extended = dataclasses.replace(federation.study, extends="ab" * 32)
    with pytest.raises(ConfigurationError, match="no earlier sums"):
        FederationServer(InProcessTransport(federation), federation.roster, extended, log=lambda s: None)
    with pytest.raises(ConfigurationError, match="is missing"):
        load_sums(tmp_path / "nowhere", "ab" * 32)
    with pytest.raises(ConfigurationError, match="balance='global'"):
        dataclasses.replace(extended, method=Method(balance="client"))
    with pytest.raises(ConfigurationError, match="round 1 only"):
        dataclasses.replace(extended, method=Method(balance="global", rounds=2))
    with pytest.raises(ConfigurationError, match="64-hex-digit"):
        dataclasses.replace(federation.study, extends="not a digest")
    # the digest of a study that extends none is what it was
    assert "extends" not in federation.study.to_json()
    assert Study.from_json(extended.to_json()) == extended


def test_a_forked_chain_releases_each_image_once(tmp_path: Path) -> None:
    """The server extends one study twice (two branches of the chain over the same new images): the
    first branch releases them; in the second every member has no new image, commits 0 rows and the
    session is refused, so the server never holds two sums over one image."""
    federation, full = _federation(tmp_path)
    _arrive(federation, full, dict.fromkeys(full, 30))
    first = _run(federation, federation.study)
    branch_a = dataclasses.replace(federation.study, extends=federation.study.digest())
    branch_b = dataclasses.replace(branch_a, method=Method(balance="global", gamma=2.0))
    _arrive(federation, full, dict.fromkeys(full, 45))
    assert _run(federation, branch_a, first.accumulated).report.refusals == []
    _arrive(federation, full, dict.fromkeys(full, 45))
    _pin(federation, branch_b)
    server = FederationServer(
        InProcessTransport(federation), federation.roster, branch_b, round_timeout=1, log=lambda s: None,
        signer=federation.signer, colluders=0, earlier=first.accumulated,
    )  # fmt: skip
    with pytest.raises(FederationAbortedError):
        server.run()
    refusals = server.report.refusals
    assert len(refusals) == 4 and {r["error"] for r in refusals} == {"IncrementTooSmallError"}
    assert all("only 0 member(s)" in r["message"] for r in refusals)
    # and a study that does not extend the chain is refused over the same images
    _arrive(federation, full, dict.fromkeys(full, 45))
    plain = dataclasses.replace(federation.study, method=Method(balance="global", gamma=3.0))
    _pin(federation, plain)
    server = FederationServer(
        InProcessTransport(federation), federation.roster, plain, round_timeout=1, log=lambda s: None,
        signer=federation.signer, colluders=0,
    )  # fmt: skip
    with pytest.raises(FederationAbortedError):
        server.run()
    assert {r["error"] for r in server.report.refusals} == {"ImageAlreadyReleasedError"}


@pytest.mark.parametrize("options", [["--balance", "client"], ["--rounds", "2"], ["--rehearse-abort"]])
def test_deploy_local_sessions_refuses_what_does_not_add_before_any_process(options, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from secure_afl.cli import main

    result = CliRunner().invoke(
        main, ["deploy", "local", "--sessions", "3", *options, "--out", str(tmp_path)]
    )
    assert result.exit_code == 2 and "a federation that grows" in result.output
    assert not (tmp_path / "logs").exists()  # refused before the work directory or any process
