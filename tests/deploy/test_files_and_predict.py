"""The feature file, the classifier file and ``secure-afl predict``."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from secure_afl.cli import main
from secure_afl.deploy.classifier import Classifier, ClassifierSigner
from secure_afl.deploy.errors import ClassifierFileError, ModelMismatchError
from secure_afl.features.file import FeatureFileError, load_feature_file, save_feature_file
from secure_afl.keys import IdentityKey, Roster, RosterEntry

CLASSES = ("A", "B")
COORDINATOR_KEY = IdentityKey.generate()
ROSTER = Roster(
    (RosterEntry(h, h, IdentityKey.generate().public_key) for h in ("h1", "h2")),
    RosterEntry("coordinator", "Coordinator", COORDINATOR_KEY.public_key),
)
SIGNER = ClassifierSigner("coordinator", COORDINATOR_KEY)


def _save(tmp_path: Path, classifier: Classifier, name: str = "c.json") -> Path:
    """The coordinator's signed file, and the roster that verifies it in ``tmp_path/roster.json``."""
    (tmp_path / "roster.json").write_text(ROSTER.to_json())
    classifier.save(tmp_path / name, SIGNER)
    return tmp_path / name


def _features(tmp_path: Path, name: str = "f.npz", **overrides) -> Path:
    rng = np.random.default_rng(1)
    arguments = dict(
        features=rng.random((5, 3)).astype(np.float32),
        classes=CLASSES,
        backbone="resnet18",
        weights_id="sha256:aa",
        preprocessing='{"name": "imagenet"}',
        labels=np.array([[1, 0], [0, 0], [1, 0], [0, 0], [1, 0]]),
        active=(0,),
        image_ids=[f"img{i}.png" for i in range(5)],
    )
    arguments.update(overrides)
    path = tmp_path / name
    save_feature_file(path, arguments.pop("features"), **arguments)
    return path


def _classifier(**overrides) -> Classifier:
    fields = dict(
        weights=np.array([[0.5, -1.0], [2.0, 0.25], [-0.125, 1e-3]]),
        classes=CLASSES,
        backbone={"name": "resnet18", "weights_id": "sha256:aa", "preprocessing": '{"name": "imagenet"}'},
        method={"gamma": 1.0},
        protocol={"backend": "mask"},
        sessions=(
            {"label": "1", "session_id": "00" * 32, "participants": ["h1", "h2"], "survivors": ["h1", "h2"]},
        ),
        roster_fingerprint=ROSTER.fingerprint,
        audit={"groups": []},
        study_digest="00",
        created="2026-11-30T00:00:00+00:00",
    )
    fields.update(overrides)
    return Classifier(**fields)


def test_feature_file_round_trips_and_never_unpickles(tmp_path: Path) -> None:
    path = _features(tmp_path)
    data = load_feature_file(path, require_labels=True)
    assert data.features.shape == (5, 3) and data.active == (0,) and data.classes == CLASSES
    assert data.image_ids[0] == "img0.png" and data.labels is not None and data.labels.sum() == 3
    # An object array (what a pickle payload needs) is refused by np.load(allow_pickle=False).
    evil = tmp_path / "evil.npz"
    arrays = dict(np.load(path, allow_pickle=False))
    arrays["classes"] = np.array(["A", None], dtype=object)
    np.savez(evil, **arrays)
    with pytest.raises(FeatureFileError, match=r"v1 file \(it holds an object array"):
        load_feature_file(evil)
    # A CSV given by mistake: the message says what to make instead, not numpy's allow_pickle advice.
    text = tmp_path / "labels.csv"
    text.write_text("image,A\nimg0.png,1\n")
    with pytest.raises(FeatureFileError, match=r"not a NumPy \.npz archive.*features extract") as caught:
        load_feature_file(text)
    assert "allow_pickle" not in str(caught.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"features": np.full((5, 3), np.nan, np.float32)}, "NaN"),
        ({"labels": np.full((5, 2), 2)}, "0/1"),
        ({"active": (5,)}, "outside"),
        ({"image_ids": ["a"]}, "one string per feature row"),
        ({"classes": ("A", "A")}, "distinct"),
    ],
)
def test_feature_file_errors_name_the_field(tmp_path: Path, overrides: dict, message: str) -> None:
    with pytest.raises(FeatureFileError, match=message):
        _features(tmp_path, **overrides)
    assert not (tmp_path / "f.npz").exists()  # nothing half-written


def test_classifier_file_round_trips_exactly_and_detects_corruption(tmp_path: Path) -> None:
    classifier = _classifier()
    path = _save(tmp_path, classifier)
    loaded = Classifier.load(path, roster=ROSTER)
    assert loaded.weights.tobytes() == classifier.weights.tobytes() and loaded.signer == "coordinator"
    document = json.loads(path.read_text())
    assert (
        document["format"] == "secure-afl-classifier/v2"
        and document["preprocessing"] == '{"name": "imagenet"}'
    )
    document["weights"]["sha256"] = "0" * 64
    path.write_text(json.dumps(document))
    with pytest.raises(ClassifierFileError, match="sha256"):
        Classifier.load(path, roster=None)
    path.write_text("not json")
    with pytest.raises(ClassifierFileError, match="not JSON"):
        Classifier.load(path, roster=ROSTER)


def test_predict_writes_scores_and_decisions(tmp_path: Path) -> None:
    classifier = _classifier()
    model = _save(tmp_path, classifier)
    features = _features(tmp_path)
    out = tmp_path / "p.csv"
    result = CliRunner().invoke(
        main,
        ["predict", "--model", str(model), "--roster", str(tmp_path / "roster.json"),
         "--features", str(features), "--out", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = list(csv.reader(out.open()))
    assert rows[0] == ["image_id", "score(A)", "score(B)", "positive(A)", "positive(B)"]
    data = load_feature_file(features)
    expected = data.features.astype(np.float64) @ classifier.weights
    assert [r[0] for r in rows[1:]] == list(data.image_ids)
    assert np.allclose([[float(x) for x in r[1:3]] for r in rows[1:]], expected, rtol=1e-8, atol=0)
    assert [[int(x) for x in r[3:]] for r in rows[1:]] == (expected > 0).astype(int).tolist()


def test_predict_states_its_decision_rule_and_offers_no_probability(tmp_path: Path) -> None:
    features = _features(tmp_path)
    data = load_feature_file(features)
    for scale in (1.0, 1e-4):  # at 1e-4 every σ(score) would lie within 1e-4 of 0.5
        classifier = _classifier(weights=scale * _classifier().weights)
        model = _save(tmp_path, classifier, name=f"{scale}.json")
        out = tmp_path / f"{scale}.csv"
        result = CliRunner().invoke(main, ["predict", "--model", str(model), "--roster",
                                           str(tmp_path / "roster.json"), "--features", str(features),
                                           "--out", str(out)])  # fmt: skip
        assert result.exit_code == 0, result.output
        assert "score(CLASS) = h·w_CLASS" in result.output and "it is not a probability" in result.output
        assert "positive(CLASS) = 1 when score(CLASS) > 0 (the file's signed threshold 0.5" in result.output
        assert "balanced sensitivity and specificity" in result.output
        assert "not calibrated to prevalence" in result.output
        rows = list(csv.reader(out.open()))
        assert not any(name.startswith("p(") for name in rows[0])
        # Tiny scores keep their sign and their decisions (σ would have rounded them towards 0.5).
        scores = np.array([[float(x) for x in r[1:3]] for r in rows[1:]])
        expected = data.features.astype(np.float64) @ classifier.weights
        assert np.allclose(scores, expected, rtol=1e-8, atol=0)
        assert [[int(x) for x in r[3:]] for r in rows[1:]] == (expected > 0).astype(int).tolist()
    help_text = CliRunner().invoke(main, ["predict", "--help"]).output
    assert "score(CLASS)" in help_text and "not a probability" in help_text and "p(CLASS)" not in help_text
    assert "not calibrated to" in help_text and "PNG, JPEG or DICOM" in help_text


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"backbone": "vgg11"}, "backbone name"),
        ({"weights_id": "sha256:bb"}, "weights_id"),
        ({"preprocessing": '{"name": "xrv"}'}, "preprocessing"),
        ({"features": np.ones((5, 4), np.float32)}, "dimension 4"),
    ],
)
def test_predict_refuses_features_from_another_backbone(
    tmp_path: Path, overrides: dict, message: str
) -> None:
    model = _save(tmp_path, _classifier())
    features = _features(tmp_path, **overrides)
    roster = str(tmp_path / "roster.json")
    result = CliRunner().invoke(
        main, ["predict", "--model", str(model), "--roster", roster, "--features", str(features)]
    )
    assert result.exit_code != 0 and "ModelMismatchError" in result.output and message in result.output
    with pytest.raises(ModelMismatchError):
        data = load_feature_file(features)
        _classifier().check_features(data.describe_backbone(), data.dim)


def test_predict_from_images_refuses_a_model_whose_backbone_cannot_be_built(tmp_path: Path) -> None:
    model = _save(
        tmp_path,
        _classifier(backbone={"name": "embedded-synthetic", "weights_id": "x", "preprocessing": "none"}),
    )
    images = tmp_path / "images"
    images.mkdir()
    roster = str(tmp_path / "roster.json")
    result = CliRunner().invoke(
        main, ["predict", "--model", str(model), "--roster", roster, "--data-dir", str(images)]
    )
    assert result.exit_code != 0 and "ModelMismatchError" in result.output and "backbone" in result.output
    result = CliRunner().invoke(main, ["predict", "--model", str(model), "--roster", roster])
    assert result.exit_code != 0 and "exactly one of --features FILE or --data-dir DIR" in result.output
