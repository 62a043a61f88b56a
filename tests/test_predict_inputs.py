"""``secure-afl predict --data-dir`` and ``features extract --images`` over folders that hold no
readable image: an exit code that says the run failed, each file named with why, the extensions
looked for, and the same answer from both commands (one function lists the images); and the hint
``deploy check --superlink`` gives when nothing listens, which names this project's command."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner, Result
from deploy.test_files_and_predict import _classifier, _save
from features.test_feature_commands import ToyNet, load_toy, write_png

import secure_afl.features.backbones as backbones_module
from secure_afl.cli import main
from secure_afl.cli_deploy import deploy_provision
from secure_afl.deploy.check import connect
from secure_afl.deploy.errors import ConfigurationError
from secure_afl.deploy.processes import free_port
from secure_afl.deploy.superlink import DEFAULT_FLEET_PORT
from secure_afl.features.file import describe_preprocessing, load_feature_file
from secure_afl.features.images import find_images, list_images
from secure_afl.features.labels import IMAGE_SUFFIXES

OBJECT_REPR = re.compile(r"<[^>]* at 0x[0-9a-fA-F]+>")


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backbones_module, "load_backbone", load_toy)


@pytest.fixture(scope="module")
def toy_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy backbone's local weight file (as tests/features/ write it)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module = ToyNet()
    path = tmp_path_factory.mktemp("toy") / "toy.pth"
    torch.save(module.state_dict(), path)
    return path


@pytest.fixture
def model(tmp_path: Path, toy_weights: Path) -> Path:
    """A signed classifier of the toy backbone (8 features, 2 classes), and its roster beside it."""
    backbone = load_toy("toy", toy_weights)
    described = {
        "name": backbone.name,
        "weights_id": backbone.weights_id,
        "preprocessing": describe_preprocessing(backbone.preprocess),
    }
    weights = np.linspace(-1.0, 1.0, 16).reshape(8, 2)
    return _save(tmp_path, _classifier(weights=weights, backbone=described), name="classifier.json")


def predict(model: Path, weights: Path, folder: Path, out: Path, cache: Path) -> Result:
    return CliRunner().invoke(
        main,
        ["predict", "--model", str(model), "--roster", str(model.parent / "roster.json"),
         "--data-dir", str(folder), "--weights", str(weights), "--cache-dir", str(cache),
         "--device", "cpu", "--out", str(out)],
    )  # fmt: skip


def extract(weights: Path, folder: Path, out: Path, cache: Path) -> Result:
    return CliRunner().invoke(
        main,
        ["features", "extract", "--images", str(folder), "--backbone", "toy", "--weights", str(weights),
         "--out", str(out), "--cache-dir", str(cache), "--device", "cpu", "--workers", "0",
         "--no-progress"],
    )  # fmt: skip


def test_a_folder_of_non_images_fails_naming_each_file_and_why(
    tmp_path: Path, toy: None, model: Path, toy_weights: Path
) -> None:
    folder = tmp_path / "scans"
    folder.mkdir()
    (folder / "fake.png").write_text("this is not an image")
    (folder / "empty.jpg").write_bytes(b"")
    (folder / "readme.txt").write_text("not looked at: not an image extension")
    out = tmp_path / "p.csv"
    result = predict(model, toy_weights, folder, out, tmp_path / "cache")
    assert result.exit_code == 1, result.output
    assert "CorruptImageError: none of the 2 images could be read" in result.output
    for name in ("fake.png", "empty.jpg"):
        line = next(line for line in result.output.splitlines() if name in line)
        assert "not a PNG, JPEG or DICOM image" in line, line
    assert "readme.txt" not in result.output
    assert not OBJECT_REPR.search(result.output) and "0x" not in result.output
    assert not out.exists() and "wrote" not in result.output

    features = tmp_path / "f.npz"
    extracted = extract(toy_weights, folder, features, tmp_path / "cache2")
    assert extracted.exit_code == result.exit_code, extracted.output
    assert "CorruptImageError: none of the 2 images could be read" in extracted.output
    assert "fake.png" in extracted.output and "empty.jpg" in extracted.output
    assert "0x" not in extracted.output and not features.exists()


@pytest.mark.parametrize("content", ["nothing", "other files"])
def test_a_folder_without_images_names_the_extensions_looked_for(
    tmp_path: Path, toy: None, model: Path, toy_weights: Path, content: str
) -> None:
    folder = tmp_path / "scans"
    folder.mkdir()
    if content == "other files":
        (folder / "notes.txt").write_text("x")
        (folder / "scan.bmp").write_bytes(b"BM")
        (folder / "images").mkdir()  # ChestXray14's layout, empty
    out = tmp_path / "p.csv"
    result = predict(model, toy_weights, folder, out, tmp_path / "cache")
    assert result.exit_code == 1, result.output
    assert "NoImagesError: no image files in" in result.output
    assert "ModelMismatchError" not in result.output
    for suffix in (".png", ".jpg", ".jpeg", ".dcm", ".dicom"):
        assert suffix in result.output
    assert f"{folder}/images/" in result.output and not out.exists()

    extracted = extract(toy_weights, folder, tmp_path / "f.npz", tmp_path / "cache")
    assert extracted.exit_code == result.exit_code, extracted.output
    assert "NoImagesError: no image files in" in extracted.output and ".jpeg" in extracted.output


def test_some_readable_images_are_written_and_the_others_named_with_exit_1(
    tmp_path: Path, toy: None, model: Path, toy_weights: Path
) -> None:
    folder = tmp_path / "scans"
    write_png(folder / "a.png", 1)
    write_png(folder / "b.jpg", 2)  # saved as JPEG (by its name)
    (folder / "c.jpeg").write_bytes(b"\xff\xd8\xff truncated")
    out = tmp_path / "p.csv"
    result = predict(model, toy_weights, folder, out, tmp_path / "cache")
    assert result.exit_code == 1, result.output
    assert "1 of the 3 images could not be read and have no row in" in result.output
    assert "c.jpeg" in result.output and "0x" not in result.output
    rows = list(csv.reader(out.open()))
    assert [row[0] for row in rows[1:]] == ["a.png", "b.jpg"]
    assert f"wrote {out}: 2 images" in result.output

    features = tmp_path / "f.npz"
    extracted = extract(toy_weights, folder, features, tmp_path / "cache")
    assert extracted.exit_code == result.exit_code, extracted.output
    assert "1 of the 3 images could not be read" in extracted.output and "c.jpeg" in extracted.output
    assert load_feature_file(features).image_ids == ("a.png", "b.jpg")


def test_predict_and_extract_list_images_by_one_rule(tmp_path: Path) -> None:
    folder = tmp_path / "d"
    for name in ("x.PNG", "y.jpg", "z.jpeg", "w.dcm", "v.dicom", "u.txt"):
        (folder / "images").mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"")
    (folder / "images" / "in_layout.png").write_bytes(b"")
    flat = [p.name for p in list_images(folder)]
    assert flat == ["v.dicom", "w.dcm", "x.PNG", "y.jpg", "z.jpeg"]
    assert set(find_images(folder)) == {*flat, "in_layout.png"}
    assert IMAGE_SUFFIXES == (".png", ".jpg", ".jpeg", ".dcm", ".dicom")


def test_deploy_check_hint_names_this_projects_superlink_command_and_port() -> None:
    port = free_port()  # nothing listens there
    with pytest.raises(ConfigurationError) as refused:
        connect(f"127.0.0.1:{port}", None, timeout=5.0)
    message = str(refused.value)
    assert f"nothing listens on 127.0.0.1:{port}" in message
    assert "secure-afl deploy superlink --listen" in message and f"default {DEFAULT_FLEET_PORT}" in message
    assert "flower-superlink" not in message and "8000" not in message
    provision_port = next(p for p in deploy_provision.params if p.name == "port")
    assert DEFAULT_FLEET_PORT == provision_port.default == 9092  # the kits dial this port
    with pytest.raises(ConfigurationError, match=f"superlink.example.org:{DEFAULT_FLEET_PORT}"):
        connect("no-port", None)
