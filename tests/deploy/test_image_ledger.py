"""One contribution per image: the ledger names images by the digest of their files' bytes.

Retraining over released images (an added image, re-extracted files, a reordered file, another
layout), through the deployment's handler (in process): a node withholds every released row, and
one with no row left refuses, naming how many rows are already released and in which session.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from secure_afl.deploy.errors import FederationAbortedError
from secure_afl.deploy.server import FederationServer
from secure_afl.deploy.study import Method
from secure_afl.features.file import load_feature_file, save_feature_file

from .helpers import (
    Federation,
    InProcessTransport,
    check_study,
    make_federation,
    pixel_digests,
    row_digests,
    run_server,
)


def _fresh_run(federation: Federation) -> None:
    """A new Flower run of the coordinator: each node's per-run state is new, its ledger is not."""
    for node in federation.nodes.values():
        node.state.records.clear()


def _rewrite(path: Path, *, features=None, order=None, digests=None, keep_digests: bool = True) -> None:
    """Save ``path`` again: new feature bytes, rows reordered, other digests, or none at all."""
    file = load_feature_file(path, require_labels=True)
    rows = np.arange(len(file.features)) if order is None else np.asarray(order)
    values = file.features if features is None else features
    sha = list(file.image_sha256 or ()) if digests is None else list(digests)
    pixels = list(file.pixel_sha256 or ()) if digests is None else pixel_digests(digests)
    save_feature_file(
        path, values[rows], labels=file.labels[rows], active=file.active, classes=file.classes,
        backbone=file.backbone, weights_id=file.weights_id, preprocessing=file.preprocessing,
        image_sha256=[sha[i] for i in rows] if keep_digests else None,
        pixel_sha256=[pixels[i] for i in rows] if keep_digests else None,
    )  # fmt: skip


def _one_ulp(features: np.ndarray, seed: int) -> np.ndarray:
    """GPU non-determinism: about half the float32 entries moved by one ulp."""
    moved = np.random.default_rng(seed).random(features.shape) < 0.5
    out = features.astype(np.float32)
    out[moved] = np.nextafter(out[moved], np.float32(np.inf))
    return out


def _refusals(federation: Federation, **kwargs) -> tuple[FederationServer, list[dict]]:
    check_study(federation, nodes=list(federation.nodes))  # each hospital checked the study (deploy check)
    server = FederationServer(
        InProcessTransport(federation), federation.roster, federation.study, round_timeout=1,
        log=lambda s: None, signer=federation.signer, colluders=0, **kwargs,
    )  # fmt: skip
    with pytest.raises(FederationAbortedError):
        server.run()
    return server, server.report.refusals


def _first_session(server: FederationServer) -> str:
    return server.report.sessions[0].session_id.hex()[:16]


def test_retraining_after_one_added_image_is_refused_by_the_unchanged_peers(tmp_path: Path) -> None:
    federation = make_federation(tmp_path)
    first, _, _ = run_server(federation)
    released = _first_session(first)
    # client-0 adds one image; the coordinator runs the same study again over every file.
    node = federation.nodes[1000]
    file = load_feature_file(node.settings.features, require_labels=True)
    save_feature_file(
        node.settings.features, np.vstack([file.features, file.features[:1] + 1]),
        labels=np.vstack([file.labels, file.labels[:1]]), active=file.active, classes=file.classes,
        backbone=file.backbone, weights_id=file.weights_id, preprocessing=file.preprocessing,
        image_sha256=[*file.image_sha256, *row_digests("added", 1)],
        pixel_sha256=[*file.pixel_sha256, *pixel_digests(row_digests("added", 1))],
    )  # fmt: skip
    _fresh_run(federation)
    _, refusals = _refusals(federation)
    # client-0 would release its added image only (its 60 released rows withheld); its peers have
    # nothing new and refuse, so the session ends before anything is released
    assert {(r["from"], r["error"]) for r in refusals} == {
        (f"client-{k}", "ImageAlreadyReleasedError") for k in range(1, 4)
    }
    by_node = {r["from"]: r["message"] for r in refusals}
    assert "60 of this client's 60 rows are images already released" in by_node["client-1"]
    assert all(f"in session {released}" in message for message in by_node.values())


@pytest.mark.parametrize("absent", [None, "client-0"])
def test_re_extracted_files_of_released_images_are_refused(tmp_path: Path, absent: str | None) -> None:
    """Retraining on re-extracted files: every peer re-extracts (one ulp moves), with the victim in
    run 2 or absent from it: the difference of the two sums would give the victim's h hᵀ or its Gram."""
    federation = make_federation(tmp_path)
    first, _, _ = run_server(federation)
    for k, node in federation.nodes.items():
        file = load_feature_file(node.settings.features, require_labels=True)
        moved = _one_ulp(file.features, k)
        assert (moved != file.features).mean() > 0.4  # other bytes: another file digest, other values
        _rewrite(node.settings.features, features=moved)
    if absent is not None:
        federation.nodes[1000].dead_from = "s1-R0"
    _fresh_run(federation)
    _, refusals = _refusals(federation)
    refusing = {r["from"] for r in refusals if r["error"] == "ImageAlreadyReleasedError"}
    expected = {"client-1", "client-2", "client-3"} | ({"client-0"} if absent is None else set())
    assert refusing == expected
    released = f"60 of this client's 60 rows are images already released in session {_first_session(first)}"
    for refusal in refusals:
        assert released in refusal["message"] and "round 1" in refusal["message"]


def test_a_reordered_file_and_another_layout_over_released_images_are_refused(tmp_path: Path) -> None:
    federation = make_federation(tmp_path)
    run_server(federation)
    for node in federation.nodes.values():
        _rewrite(node.settings.features, order=np.random.default_rng(1).permutation(60))
    # another study (global balance: another layout, other bytes) over the same images
    federation.study = dataclasses.replace(federation.study, method=Method(balance="global"))
    _fresh_run(federation)
    _, refusals = _refusals(federation)
    assert {r["error"] for r in refusals} == {"ImageAlreadyReleasedError"} and len(refusals) == 4


def test_new_images_release_and_the_value_rule_stays_beside_the_image_rule(tmp_path: Path) -> None:
    """The rule is about images, not files: new images in a new study release (the negative control
    of the tests above, through the same handler and ledgers)."""
    federation = make_federation(tmp_path)
    run_server(federation)
    rng = np.random.default_rng(7)
    for k, node in federation.nodes.items():
        new = rng.gamma(2.0, 1.0, size=(60, 40)).astype(np.float32)
        _rewrite(node.settings.features, features=new, digests=row_digests(f"second-batch/{k}", 60))
    _fresh_run(federation)
    server, classifier, _ = run_server(federation)
    assert server.report.refusals == [] and classifier is not None
    # The values' own rule stays beside the images': the same bytes under new image names are refused.
    for k, node in federation.nodes.items():
        _rewrite(node.settings.features, digests=row_digests(f"third-batch/{k}", 60))
    _fresh_run(federation)
    _, refusals = _refusals(federation)
    assert {r["error"] for r in refusals} == {"ValueAlreadyReleasedError"} and len(refusals) == 4


def test_a_feature_file_without_image_digests_is_refused_with_re_extract_advice(tmp_path: Path) -> None:
    federation = make_federation(tmp_path)
    _rewrite(federation.nodes[1002].settings.features, keep_digests=False)
    server, _, _ = run_server(federation)
    (refusal,) = server.report.refusals
    assert refusal["from"] in ("client-2", "node 1002") and refusal["error"] == "FeatureFileError"
    assert "no image digests" in refusal["message"] and "extract" in refusal["message"]
    assert "client-2" not in server.report.sessions[0].participants


def test_round_two_of_the_same_study_stays_the_declared_exception(tmp_path: Path) -> None:
    method = Method(rounds=2, min_pos=1, min_neg=1, tau=0.5)
    active = {"client-0": (0, 1, 2), "client-1": (0, 1, 2), "client-2": (0, 1, 2), "client-3": (1, 2),
              "client-4": (2,), "client-5": (2,)}  # fmt: skip
    federation = make_federation(tmp_path, n_clients=6, active=active, method=method, rows=40)
    server, _, _ = run_server(federation)
    assert server.report.refusals == [] and [s.label for s in server.report.sessions] == ["1", "2"]
    # ... but once: the same study's round 2 again (a fresh run, round 1 refused, so no round 2)
    _fresh_run(federation)
    _, refusals = _refusals(federation)
    assert {r["error"] for r in refusals} == {"ImageAlreadyReleasedError"} and len(refusals) == 6
