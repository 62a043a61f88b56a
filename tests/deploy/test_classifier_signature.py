"""What hospitals receive is authenticated whole: the classifier file's content digest covers every
field, the coordinator signs it, and the node and ``secure-afl predict`` verify it against the roster;
``predict --evaluate`` scores it exactly as the simulator does."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from secure_afl.cli import main
from secure_afl.deploy.apps import coordinator_signer
from secure_afl.deploy.classifier import Classifier, ClassifierSigner, content_digest
from secure_afl.deploy.errors import (
    ClassifierSignatureError,
    ClassifierTamperedError,
    ConfigurationError,
    RosterMismatchError,
    UnsignedClassifierError,
)
from secure_afl.deploy.server import FederationServer
from secure_afl.deploy.wire import Envelope
from secure_afl.features.file import save_feature_file
from secure_afl.keys import IdentityKey, Roster, RosterEntry, save_identity_key
from secure_afl.sim.metrics import evaluate

from .helpers import PASSPHRASE, InProcessTransport, make_federation, run_server

CLASSES = ("A", "B", "C")
BACKBONE = {"name": "toy", "weights_id": "sha256:00", "preprocessing": "none"}
COORDINATOR_KEY = IdentityKey.generate()
ROSTER = Roster(
    (RosterEntry(h, h, IdentityKey.generate().public_key) for h in ("h1", "h2", "h3")),
    RosterEntry("coordinator", "Coordinator", COORDINATOR_KEY.public_key),
)
SIGNER = ClassifierSigner("coordinator", COORDINATOR_KEY)


def _classifier(dim: int = 6, **overrides) -> Classifier:
    rng = np.random.default_rng(3)
    fields = dict(
        weights=rng.normal(size=(dim, len(CLASSES))),
        classes=CLASSES,
        backbone=dict(BACKBONE),
        method={"gamma": 1.0, "balance": "client"},
        protocol={"backend": "mask", "threshold": 3},
        sessions=({"label": "1", "session_id": "ab" * 32, "participants": ["h1"], "survivors": ["h1"]},),
        roster_fingerprint=ROSTER.fingerprint,
        audit={"groups": []},
        study_digest="00",
        created="2026-12-01T00:00:00+00:00",
    )
    fields.update(overrides)
    return Classifier(**fields)


def _files(tmp_path: Path, text: str) -> tuple[Path, Path]:
    model, roster = tmp_path / "classifier.json", tmp_path / "roster.json"
    model.write_text(text)
    roster.write_text(ROSTER.to_json())
    return model, roster


def _features(tmp_path: Path, rows: int = 40, dim: int = 6, active=(0, 1, 2)) -> Path:
    rng = np.random.default_rng(5)
    labels = (rng.random((rows, len(CLASSES))) < 0.4).astype(np.uint8)
    labels[:, [c for c in range(len(CLASSES)) if c not in active]] = 0
    path = tmp_path / "labelled.npz"
    save_feature_file(
        path, rng.normal(size=(rows, dim)).astype(np.float32), labels=labels, active=active, classes=CLASSES,
        backbone="toy", weights_id="sha256:00", preprocessing="none",
        image_sha256=[hashlib.sha256(f"{path}/{i}".encode()).hexdigest() for i in range(rows)],
        pixel_sha256=[hashlib.sha256(f"{path}/pixels/{i}".encode()).hexdigest() for i in range(rows)],
    )  # fmt: skip
    return path


def _predict(model: Path, *options: str) -> object:
    return CliRunner().invoke(main, ["predict", "--model", str(model), *options])


def _with_threshold(text: str, threshold: float, *, rehash: bool) -> str:
    document = json.loads(text)
    document["decision_threshold"] = threshold
    if rehash:
        document["content_sha256"] = content_digest(document)
    return json.dumps(document, indent=1)


# --- the file ----------------------------------------------------------------------------------


def test_a_signed_file_verifies_and_its_digest_covers_every_field() -> None:
    text = _classifier().to_json(SIGNER)
    loaded = Classifier.from_json(text, roster=ROSTER)
    assert loaded.signer == "coordinator" and loaded.decision_threshold == 0.5
    document = json.loads(text)
    assert document["signature"]["fingerprint"] == COORDINATOR_KEY.fingerprint
    for field, value in [
        ("decision_threshold", 0.1), ("classes", ["A", "C", "B"]), ("backbone", {**BACKBONE, "name": "x"}),
        ("preprocessing", "other"), ("method", {"gamma": 2.0}), ("roster_fingerprint", "SHA256:00"),
        ("sessions", []), ("differential_privacy", {"epsilon_target": 1.0}), ("extra", 1),
    ]:  # fmt: skip
        changed = {**document, field: value}
        with pytest.raises(ClassifierTamperedError, match="does not match its sha256 digest"):
            Classifier.from_json(json.dumps(changed), roster=ROSTER)
        with pytest.raises(ClassifierTamperedError):  # also when the signature is not checked
            Classifier.from_json(json.dumps(changed), roster=None)


def test_a_tampered_threshold_is_refused_and_a_recomputed_digest_breaks_the_signature() -> None:
    text = _classifier().to_json(SIGNER)
    with pytest.raises(ClassifierTamperedError, match="decision threshold"):
        Classifier.from_json(
            text.replace('"decision_threshold": 0.5', '"decision_threshold": 0.1'), roster=ROSTER
        )
    with pytest.raises(ClassifierSignatureError, match="changed after it was signed"):
        Classifier.from_json(_with_threshold(text, 0.1, rehash=True), roster=ROSTER)
    # Without the roster only the digest protects the file: a recomputed one passes (hence --roster).
    assert (
        Classifier.from_json(_with_threshold(text, 0.1, rehash=True), roster=None).decision_threshold == 0.1
    )


def test_unsigned_wrongly_signed_and_unverifiable_files_are_refused() -> None:
    classifier = _classifier()
    with pytest.raises(UnsignedClassifierError, match="not signed"):
        Classifier.from_json(classifier.to_json(), roster=ROSTER)
    impostor = ClassifierSigner("coordinator", IdentityKey.generate())  # the right id, another key
    with pytest.raises(ClassifierSignatureError, match="does not verify"):
        Classifier.from_json(classifier.to_json(impostor), roster=ROSTER)
    other = ClassifierSigner("h1", IdentityKey.generate())  # someone else signs as themselves
    with pytest.raises(ClassifierSignatureError, match=r"signed by 'h1'.*not by the roster's coordinator"):
        Classifier.from_json(classifier.to_json(other), roster=ROSTER)
    without = Roster(ROSTER.entries)
    with pytest.raises(ClassifierSignatureError, match="names no coordinator"):
        Classifier.from_json(classifier.to_json(SIGNER), roster=without)
    elsewhere = Roster(ROSTER.entries[:2], ROSTER.coordinator)  # same coordinator, another roster
    with pytest.raises(RosterMismatchError, match="made with roster"):
        Classifier.from_json(classifier.to_json(SIGNER), roster=elsewhere)
    old = {**json.loads(classifier.to_json()), "format": "secure-afl-classifier/v1"}
    with pytest.raises(UnsignedClassifierError, match="written before classifier files were signed"):
        Classifier.from_json(json.dumps(old), roster=None)
    text = classifier.to_json(SIGNER)
    duplicated = text.replace(
        '"decision_threshold": 0.5', '"decision_threshold": 0.5, "decision_threshold": 0.1'
    )
    with pytest.raises(ClassifierTamperedError, match="duplicate field"):
        Classifier.from_json(duplicated, roster=ROSTER)
    with pytest.raises(ConfigurationError, match="not the roster's coordinator"):
        ClassifierSigner.for_roster(ROSTER, IdentityKey.generate())
    with pytest.raises(ConfigurationError, match="names no coordinator"):
        ClassifierSigner.for_roster(without, COORDINATOR_KEY)


# --- secure-afl predict ------------------------------------------------------------------------


def test_predict_verifies_the_signature_against_the_roster(tmp_path: Path) -> None:
    text = _classifier().to_json(SIGNER)
    model, roster = _files(tmp_path, text)
    features = _features(tmp_path)
    ok = _predict(
        model, "--roster", str(roster), "--features", str(features), "--out", str(tmp_path / "p.csv")
    )
    assert ok.exit_code == 0, ok.output
    assert f"signed by the coordinator coordinator ({COORDINATOR_KEY.fingerprint})" in ok.output
    missing = _predict(model, "--features", str(features))
    assert missing.exit_code == 2 and "give --roster FILE" in missing.output
    model.write_text(_with_threshold(text, 0.1, rehash=False))
    tampered = _predict(model, "--roster", str(roster), "--features", str(features))
    assert tampered.exit_code == 1 and "ClassifierTamperedError" in tampered.output
    model.write_text(_with_threshold(text, 0.1, rehash=True))
    forged = _predict(model, "--roster", str(roster), "--features", str(features))
    assert forged.exit_code == 1 and "ClassifierSignatureError" in forged.output
    model.write_text(_classifier().to_json())
    unsigned = _predict(model, "--roster", str(roster), "--features", str(features))
    assert unsigned.exit_code == 1 and "UnsignedClassifierError" in unsigned.output
    model.write_text(_classifier().to_json(ClassifierSigner("coordinator", IdentityKey.generate())))
    wrong = _predict(model, "--roster", str(roster), "--features", str(features))
    assert wrong.exit_code == 1 and "ClassifierSignatureError" in wrong.output
    skipped = _predict(model, "--no-verify", "--features", str(features), "--out", str(tmp_path / "q.csv"))
    assert skipped.exit_code == 0 and "signature was NOT checked" in skipped.output


def test_predict_evaluate_equals_the_simulators_metrics(tmp_path: Path) -> None:
    classifier = _classifier()
    model, roster = _files(tmp_path, classifier.to_json(SIGNER))
    features = _features(tmp_path, active=(0, 2))  # this hospital labels A and C only
    metrics = tmp_path / "metrics.json"
    result = _predict(
        model, "--roster", str(roster), "--features", str(features), "--out", str(tmp_path / "p.csv"),
        "--evaluate", "--metrics-out", str(metrics),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    written = json.loads(metrics.read_text())
    data = np.load(features)
    scores = data["features"].astype(np.float64) @ classifier.weights
    expected = evaluate(data["labels"][:, [0, 2]], scores[:, [0, 2]], kind="logits")  # the simulator's call
    assert written["classes"] == ["A", "C"] and written["images"] == 40
    assert written["macro"] == expected.macro
    assert [written["per_class"][c]["auc"] for c in ("A", "C")] == list(expected.auc)
    assert [written["per_class"][c]["bacc"] for c in ("A", "C")] == list(expected.bacc)
    assert f"BACC {100 * expected.macro['bacc']:.2f} %" in result.output
    assert "AUC" in result.output and "mAP" in result.output


def test_predict_evaluate_needs_labels(tmp_path: Path) -> None:
    model, roster = _files(tmp_path, _classifier().to_json(SIGNER))
    unlabelled = tmp_path / "new.npz"
    save_feature_file(unlabelled, np.ones((3, 6)), classes=CLASSES, **{
        "backbone": "toy", "weights_id": "sha256:00", "preprocessing": "none"})  # fmt: skip
    result = _predict(model, "--roster", str(roster), "--features", str(unlabelled), "--evaluate")
    assert result.exit_code == 1 and "has no labels" in result.output
    result = _predict(
        model, "--roster", str(roster), "--features", str(unlabelled), "--metrics-out", "m.json"
    )
    assert result.exit_code == 2 and "--metrics-out needs --evaluate" in result.output


# --- the node and the server ---------------------------------------------------------------------


def test_every_node_stores_the_signed_bytes_as_classifier_json(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=3)
    server, classifier, _ = run_server(federation)
    signed = server.sign(classifier)
    assert server.report.acknowledged == ("client-0", "client-1", "client-2")
    for node in federation.nodes.values():
        assert (node.settings.out_dir / "classifier.json").read_bytes() == signed
        assert not list(node.settings.out_dir.glob("classifier-*.json"))


@pytest.mark.parametrize(
    ("change", "error"),
    [("threshold", "ClassifierTamperedError"), ("rehash", "ClassifierSignatureError"),
     ("unsigned", "UnsignedClassifierError"), ("impostor", "ClassifierSignatureError")],
)  # fmt: skip
def test_the_node_refuses_a_tampered_unsigned_or_wrongly_signed_classifier(
    tmp_path: Path, change: str, error: str
) -> None:
    federation = make_federation(tmp_path, n_clients=3)

    def tamper(node: int, group: str, envelope: Envelope) -> Envelope:
        if group != "classifier":
            return envelope
        text = envelope.payload.decode("utf-8")
        if change in ("threshold", "rehash"):
            text = _with_threshold(text, 0.1, rehash=change == "rehash")
        else:
            classifier = Classifier.from_json(text, roster=None)
            impostor = ClassifierSigner("coordinator", IdentityKey.generate())
            text = classifier.to_json(None if change == "unsigned" else impostor)
        return Envelope(envelope.kind, envelope.meta, text.encode("utf-8"))

    server, _, _ = run_server(federation, InProcessTransport(federation, tamper=tamper))
    assert server.report.acknowledged == ()
    assert [r["error"] for r in server.report.refusals] == [error] * 3
    assert all(not (node.settings.out_dir / "classifier.json").exists() for node in federation.nodes.values())


def test_the_server_signs_only_as_the_rosters_coordinator(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=3)
    transport = InProcessTransport(federation)
    with pytest.raises(ConfigurationError, match="not the roster's coordinator"):
        FederationServer(
            transport,
            federation.roster,
            federation.study,
            signer=ClassifierSigner("coordinator", IdentityKey.generate()),
        )
    server = FederationServer(
        transport, federation.roster, federation.study, round_timeout=1, log=lambda s: None
    )
    classifier = server.run()
    with pytest.raises(ConfigurationError, match="no coordinator identity"):
        server.deliver(classifier)
    assert not any(group == "classifier" for _, group, _ in transport.sent)  # nothing unsigned was sent


def test_the_serverapp_reads_the_coordinator_key_from_the_run_config(tmp_path: Path) -> None:
    key_path, passfile = tmp_path / "coordinator.key", tmp_path / "pass"
    save_identity_key(key_path, COORDINATOR_KEY, PASSPHRASE, scrypt_n=2**10)
    passfile.write_bytes(PASSPHRASE + b"\n")
    passfile.chmod(0o600)
    config = {"identity-key": str(key_path), "passphrase-file": str(passfile)}
    assert coordinator_signer(config, ROSTER).key.public_key == COORDINATOR_KEY.public_key
    with pytest.raises(ConfigurationError, match=r"lacks \['identity-key'\].*keys roster add --coordinator"):
        coordinator_signer({"passphrase-file": str(passfile)}, ROSTER)
    with pytest.raises(ConfigurationError, match="names no coordinator"):
        coordinator_signer(config, Roster(ROSTER.entries))
    passfile.write_bytes(b"another passphrase\n")
    with pytest.raises(ConfigurationError, match="identity-key"):
        coordinator_signer(config, ROSTER)
