"""A node keeps every classifier it received (``out-dir/classifiers/<created>-<digest>.json``) and
``classifier.json`` as the latest, never replacing one without a copy; ``predict`` names the file's
study digest, method and date.  In process (tests/deploy/helpers.py), no Flower."""

from __future__ import annotations

import dataclasses
import hashlib
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from secure_afl.cli import main
from secure_afl.deploy.classifier import HISTORY_DIR, history_name, keep_classifier
from secure_afl.deploy.client import handle
from secure_afl.deploy.errors import ClassifierFileError
from secure_afl.deploy.wire import Envelope
from secure_afl.features.file import save_feature_file

from .helpers import make_federation, run_server


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_node_keeps_every_classifier_and_classifier_json_is_the_latest(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=3)
    server, classifier, _ = run_server(federation)
    first = server.sign(classifier)
    node = federation.nodes[1000]
    out = node.settings.out_dir
    (kept,) = (out / HISTORY_DIR).iterdir()
    assert kept.read_bytes() == first == (out / "classifier.json").read_bytes()
    assert kept.name == history_name(first) and hashlib.sha256(first).hexdigest()[:16] in kept.name
    assert kept.name.startswith(classifier.created[:10].replace("-", ""))
    assert _mode(kept) == 0o600 and _mode(out / "classifier.json") == 0o600

    # The coordinator signs another file for the same sessions (later, other weights): it replaces
    # classifier.json, and both stay in the history.
    second_model = dataclasses.replace(
        classifier, weights=classifier.weights * 2, created="2031-01-02T03:04:05+00:00"
    )
    second = server.sign(second_model)
    # A node checks one classifier per session (SECURITY.md §5.4): by default it refuses a second.
    reply = handle(Envelope("classifier", {"round": "classifier"}, second), node.state, node.settings)
    assert reply.kind == "refused" and reply.meta["error"] == "VerificationError"
    node.settings = dataclasses.replace(node.settings, require_verified="false")  # stores every one
    reply = handle(Envelope("classifier", {"round": "classifier"}, second), node.state, node.settings)
    assert reply.kind == "ack", reply.meta
    assert "path" not in reply.meta and str(out) not in str(dict(reply.meta))  # no path to the coordinator
    assert (out / "classifier.json").read_bytes() == second
    history = sorted((out / HISTORY_DIR).iterdir())
    assert [p.read_bytes() for p in history] == [first, second]  # sorted by the files' own dates
    assert history[1].name.startswith("20310102T030405Z-")

    # The same file delivered again is the same history entry, not a second one.
    reply = handle(Envelope("classifier", {"round": "classifier"}, second), node.state, node.settings)
    assert reply.kind == "ack" and len(list((out / HISTORY_DIR).iterdir())) == 2


def test_a_classifier_json_that_is_not_in_the_history_is_kept_before_it_is_replaced(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "classifier.json").write_bytes(b'{"created": "2020-05-06T07:08:09+00:00"}')
    new = b'{"created": "2021-01-01T00:00:00+00:00", "weights": 1}'
    stored = keep_classifier(out, new)
    assert stored.latest.read_bytes() == new and stored.kept.read_bytes() == new
    assert stored.replaced is not None and stored.replaced.name.startswith("20200506T070809Z-")
    assert stored.replaced.read_bytes() == b'{"created": "2020-05-06T07:08:09+00:00"}'


def test_the_history_is_never_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "out"
    data = b'{"created": "2021-01-01T00:00:00+00:00"}'
    (out / HISTORY_DIR).mkdir(parents=True)
    clash = out / HISTORY_DIR / history_name(data)
    clash.write_bytes(b"something else")
    with pytest.raises(ClassifierFileError, match="never overwritten"):
        keep_classifier(out, data)
    assert clash.read_bytes() == b"something else" and not (out / "classifier.json").exists()


def test_predict_prints_the_study_digest_the_method_and_the_date(tmp_path: Path) -> None:
    import numpy as np

    federation = make_federation(tmp_path / "fed", n_clients=3)
    _, classifier, _ = run_server(federation)
    node = federation.nodes[1000]
    features, labels, active = federation.data[node.client_id]
    path = tmp_path / "features.npz"
    save_feature_file(
        path, features, labels=labels, active=active, classes=classifier.classes,
        backbone="toy", weights_id="sha256:00", preprocessing="none",
    )  # fmt: skip
    result = CliRunner().invoke(
        main,
        ["predict", "--model", str(node.settings.out_dir / "classifier.json"), "--roster",
         str(node.settings.roster), "--features", str(path), "--out", str(tmp_path / "p.csv")],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert f"study digest {federation.study.digest()}" in result.output
    assert f"classifier made {classifier.created}" in result.output
    method = federation.study.method
    assert f"gamma {method.gamma}, balance {method.balance}, gram {method.gram}, rounds 1" in result.output
    assert "protection mask, threshold t = " in result.output
    assert np.isfinite(classifier.weights).all()
