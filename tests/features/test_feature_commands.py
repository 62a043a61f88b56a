"""``secure-afl features extract`` and ``features show``: both input modes, resumption, the labels CSV's
errors and what ``show`` prints.  The images are a few 48 × 48 PNGs; nothing is downloaded.

The happy paths of both input modes run the real ``resnet18`` from a randomly initialised state dict
saved to a local file.  The other extractions use a toy network (a few hundred parameters, loaded
from its own local weight file and identified by that file's SHA-256, as ``load_backbone`` does) in
place of ``load_backbone``, to keep them at milliseconds."""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch
import torchvision
from click.testing import CliRunner, Result
from PIL import Image
from torch import nn

import secure_afl.features.backbones as backbones_module
from secure_afl.cli import main
from secure_afl.features.backbones import (
    BACKBONES,
    Backbone,
    Preprocess,
    XRayTransform,
    load_backbone,
    weights_sha256,
)
from secure_afl.features.file import (
    FeatureFileError,
    describe_preprocessing,
    load_feature_file,
    save_feature_file,
)
from secure_afl.features.images import load_grayscale
from secure_afl.features.labels import LabelsCsvError, read_labels_csv
from secure_afl.sim.data import CLASSES

NIH_HEADER = ["Image Index", "Finding Labels", "Follow-up #", "Patient ID", "View Position"]


def write_png(path: Path, seed: int, size: int = 48) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size), dtype=np.uint8)
    Image.fromarray(pixels, mode="L").save(path)
    return path


def write_csv(path: Path, rows: list[list[object]]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows(rows)
    return path


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def features(*args: object) -> Result:
    return CliRunner().invoke(main, ["features", *map(str, args)])


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ResNet-18 state dict written with torch.save, as a hospital would have the published file."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torchvision.models.resnet18(weights=None)
    path = tmp_path_factory.mktemp("weights") / "resnet18-local.pth"
    torch.save(model.state_dict(), path)
    return path


@pytest.fixture(scope="module")
def reference(weights: Path) -> Backbone:
    return load_backbone("resnet18", weights)


def direct_features(backbone: Backbone, paths: list[Path]) -> np.ndarray:
    with torch.inference_mode():
        return backbone.embed(torch.stack([backbone.transform(load_grayscale(p)) for p in paths])).numpy()


def common(weights: Path, out: Path, cache: Path) -> list[object]:
    return [
        "--backbone", "resnet18", "--weights", weights, "--out", out, "--cache-dir", cache,
        "--device", "cpu", "--workers", 0, "--no-progress",
    ]  # fmt: skip


def summary_value(output: str, key: str) -> str:
    """The value of one ``key   value`` line of the summary."""
    match = re.search(rf"^{re.escape(key)} +(.+)$", output, flags=re.MULTILINE)
    assert match, f"no {key!r} line in:\n{output}"
    return match.group(1)


def run_config(output: str) -> dict[str, object]:
    """The run-config lines that the summary prints, parsed as TOML."""
    lines = [line.strip() for line in output.splitlines() if re.match(r"^  [a-z-]+ = ", line)]
    return tomllib.loads("\n".join(lines))


@pytest.fixture
def no_backbone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails the test if the command gets as far as loading the backbone."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the inputs should have been refused before the backbone is loaded")

    monkeypatch.setattr(backbones_module, "load_backbone", refuse)


class ToyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, kernel_size=3, stride=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x / 1024)).mean(dim=(2, 3))


@pytest.fixture(scope="module")
def toy_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = ToyNet()
    path = tmp_path_factory.mktemp("toy") / "toy.pth"
    torch.save(model.state_dict(), path)
    return path


def load_toy(name: str, weights: Path | None, **kwargs: object) -> Backbone:
    """load_backbone's contract on a toy network: a local state dict, ``sha256:`` of the file."""
    assert weights is not None
    module = ToyNet()
    module.load_state_dict(torch.load(weights, weights_only=True))
    module.requires_grad_(False).eval()
    return Backbone(
        name=name,
        module=module,
        embed=module,
        feature_dim=8,
        transform=XRayTransform(32),
        preprocess=Preprocess("toy-grayscale", (("resize", 32),)),
        weights_id=f"sha256:{weights_sha256(weights)}",
        weights_path=weights,
    )


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backbones_module, "load_backbone", load_toy)


class CountingEmbed:
    """Counts forward passes; raises KeyboardInterrupt (Ctrl-C) at call ``interrupt_at``."""

    def __init__(self, embed: Callable[[torch.Tensor], torch.Tensor], interrupt_at: int | None) -> None:
        self.embed, self.interrupt_at, self.calls = embed, interrupt_at, 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.interrupt_at:
            raise KeyboardInterrupt
        return self.embed(x)


def counting_backbones(
    monkeypatch: pytest.MonkeyPatch, interrupt_at: int | None = None
) -> list[CountingEmbed]:
    counters: list[CountingEmbed] = []

    def load(*args: object, **kwargs: object) -> Backbone:
        backbone = load_toy(*args, **kwargs)  # type: ignore[arg-type]
        counters.append(CountingEmbed(backbone.embed, interrupt_at))
        return dataclasses.replace(backbone, embed=counters[-1])

    monkeypatch.setattr(backbones_module, "load_backbone", load)
    return counters


# ------------------------------------------------------------------------------------------ help


def test_help_says_what_each_command_reads_and_writes() -> None:
    top = CliRunner().invoke(main, ["--help"])
    assert top.exit_code == 0 and "features" in top.output
    extract = features("extract", "--help")
    assert extract.exit_code == 0
    expected = (
        "Reads:", "Writes:", "--out FILE.npz", "--dataset nih --data-dir DIR", "--images DIR",
        "image,Atelectasis,Effusion,patient", "--weights", "nothing is downloaded", "--active",
        "--patient-ids", "--cache-dir", "--device", "--batch-size",
    )  # fmt: skip
    for text in expected:
        assert text in extract.output, text
    for name in BACKBONES:  # every registered backbone's family is named in --backbone's help
        family = re.sub(r"\d+$", "", name).rstrip("_b") if name != "densenet121-xrv" else name
        assert family in extract.output, name
    show = features("show", "--help")
    assert show.exit_code == 0 and "Reads:  FILE" in show.output and "Writes: nothing" in show.output


# ---------------------------------------------------------------------------- extract, NIH mode


def test_nih_mode_writes_labels_patients_and_the_backbone_record(
    tmp_path: Path, weights: Path, reference: Backbone
) -> None:
    data = tmp_path / "nih"
    rows = [  # name, findings, patient, view; the AP row and the absent PNG are left out
        ("00000001_000.png", "Atelectasis|Effusion", 1, "PA"),
        ("00000001_001.png", "No Finding", 1, "PA"),
        ("00000002_000.png", "Mass|Pneumothorax", 2, "AP"),
        ("00000003_000.png", "Effusion|Cardiomegaly", 3, "PA"),
        ("00000004_000.png", "Nodule", 4, "PA"),
    ]
    for i, (name, *_rest) in enumerate(rows):
        if name != "00000004_000.png":
            write_png(data / "images_001" / "images" / name, i)
    write_csv(data / "Data_Entry_2017.csv", [NIH_HEADER] + [[n, f, 0, p, v] for n, f, p, v in rows])
    out, cache = tmp_path / "out" / "hospital.npz", tmp_path / "cache"
    result = features(
        "extract", "--dataset", "nih", "--data-dir", data, "--active", "Effusion,Atelectasis",
        *common(weights, out, cache),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    file = load_feature_file(out)
    assert file.image_ids == ("00000001_000.png", "00000001_001.png", "00000003_000.png")
    assert file.classes == CLASSES
    assert file.active == (CLASSES.index("Atelectasis"), CLASSES.index("Effusion"))
    expected = np.zeros((3, len(CLASSES)), np.uint8)
    expected[0, [CLASSES.index("Atelectasis"), CLASSES.index("Effusion")]] = 1
    expected[2, CLASSES.index("Effusion")] = 1  # Cardiomegaly is not labelled here: written as 0
    assert np.array_equal(file.labels, expected)
    assert file.patient_ids == ("1", "1", "3")
    assert file.backbone == "resnet18"
    assert file.weights_id == f"sha256:{sha256_of(weights)}"
    assert file.preprocessing == describe_preprocessing(reference.preprocess)
    paths = [data / "images_001" / "images" / name for name in file.image_ids]
    assert file.features.dtype == np.float32 and file.dim == 512
    assert np.allclose(file.features, direct_features(reference, paths), atol=1e-4)
    # What it says it wrote is the file.
    assert summary_value(result.output, "rows") == "3"
    assert summary_value(result.output, "weights-id") == file.weights_id
    assert summary_value(result.output, "preprocessing") == file.preprocessing
    assert summary_value(result.output, "digest").split()[0] == f"sha256:{sha256_of(out)}"
    assert "positives: Atelectasis 1, Effusion 2" in result.output
    assert "1 PA images of the label table are not under" in result.output
    assert "labels of Cardiomegaly" in result.output  # the source's labels not recorded
    assert sorted(p.name for p in out.parent.iterdir()) == ["hospital.npz"]  # no temporary left


def test_nih_mode_needs_a_data_dir_and_no_images_option(tmp_path: Path, no_backbone: None) -> None:
    out = tmp_path / "f.npz"
    assert features("extract", "--dataset", "nih", "--out", out).exit_code == 2
    both = features("extract", "--dataset", "nih", "--data-dir", tmp_path, "--images", tmp_path, "--out", out)
    assert both.exit_code == 2 and "either --dataset nih" in both.output
    labels = features(
        "extract", "--dataset", "nih", "--data-dir", tmp_path, "--labels", "x.csv", "--out", out
    )
    assert labels.exit_code == 2 and "--labels and --classes belong to --images" in labels.output
    assert not out.exists()


# ------------------------------------------------------------------------- extract, folder mode


def test_folder_with_labels_csv(tmp_path: Path, weights: Path, reference: Backbone) -> None:
    images = tmp_path / "images"
    for i, name in enumerate(["a.png", "scans/b.png", "c.png", "not-listed.png"]):
        write_png(images / name, 10 + i)
    labels = write_csv(tmp_path / "labels.csv", [
        ["image", "Effusion", "patient", "Cardiomegaly"],
        ["a.png", 1, "P-1", 0],
        ["scans/b.png", 0, "P-2", 1],
        ["c.png", " 1 ", "P-1", 1],
    ])  # fmt: skip
    out = tmp_path / "hospital.npz"
    result = features(
        "extract", "--images", images, "--labels", labels, *common(weights, out, tmp_path / "c")
    )
    assert result.exit_code == 0, result.output
    file = load_feature_file(out)
    assert file.image_ids == ("a.png", "scans/b.png", "c.png")
    assert file.classes == CLASSES
    cardio, effusion = CLASSES.index("Cardiomegaly"), CLASSES.index("Effusion")
    assert file.active == (cardio, effusion)
    assert file.labels is not None and file.labels.sum() == 4
    assert file.labels[:, effusion].tolist() == [1, 0, 1] and file.labels[:, cardio].tolist() == [0, 1, 1]
    assert file.patient_ids == ("P-1", "P-2", "P-1")
    assert file.weights_id == f"sha256:{sha256_of(weights)}"
    paths = [images / name for name in file.image_ids]
    assert np.allclose(file.features, direct_features(reference, paths), atol=1e-4)
    assert "1 images in" in result.output and "not in" in result.output  # not-listed.png
    assert "labelled       2" in result.output


def test_folder_with_a_class_list_and_no_patient_ids(tmp_path: Path, toy_weights: Path, toy: None) -> None:
    images = tmp_path / "images"
    for i in range(2):
        write_png(images / f"{i}.png", i)
    labels = write_csv(
        tmp_path / "labels.csv", [["image", "tb", "patient"], ["0.png", 1, "x"], ["1.png", 0, "y"]]
    )
    out = tmp_path / "f.npz"
    result = features(
        "extract", "--images", images, "--labels", labels, "--classes", "normal,tb,covid", "--no-patient-ids",
        *common(toy_weights, out, tmp_path / "c"),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    file = load_feature_file(out)
    assert file.classes == ("normal", "tb", "covid") and file.active == (1,)
    assert file.labels is not None and file.labels.tolist() == [[0, 1, 0], [0, 0, 0]]
    assert file.patient_ids is None
    twice = features("extract", "--images", images, "--classes", "tb,normal,tb", "--out", tmp_path / "g.npz")
    assert twice.exit_code == 2 and "a class is named twice" in twice.output


def test_folder_without_labels_is_a_prediction_only_file(
    tmp_path: Path, toy_weights: Path, toy: None
) -> None:
    weights = toy_weights
    images = tmp_path / "images"
    for i, name in enumerate(["b.png", "a.PNG", "c.jpg"]):
        write_png(images / name, i)
    (images / "notes.txt").write_text("not an image")
    out = tmp_path / "predict.npz"
    result = features("extract", "--images", images, *common(weights, out, tmp_path / "c"))
    assert result.exit_code == 0, result.output
    file = load_feature_file(out)
    assert file.image_ids == ("a.PNG", "b.png", "c.jpg")
    assert file.labels is None and file.active == () and file.patient_ids is None
    assert "labelled       none" in result.output
    only_images = write_csv(tmp_path / "ids.csv", [["image"], ["c.jpg"]])
    result = features(
        "extract", "--images", images, "--labels", only_images, *common(weights, out, tmp_path / "c")
    )
    assert result.exit_code == 0, result.output
    assert load_feature_file(out).image_ids == ("c.jpg",) and load_feature_file(out).labels is None
    refused = features(
        "extract",
        "--images",
        images,
        "--active",
        "Mass",
        *common(weights, tmp_path / "x.npz", tmp_path / "c"),
    )
    assert refused.exit_code == 2 and "prediction-only file labels no class" in refused.output
    assert not (tmp_path / "x.npz").exists()


# ------------------------------------------------------------------------------------ resumption


def test_interrupted_extraction_resumes_from_its_completed_shards(
    tmp_path: Path, toy_weights: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights, reference = toy_weights, load_toy("resnet18", toy_weights)
    images = tmp_path / "images"
    paths = [write_png(images / f"{i}.png", 20 + i) for i in range(6)]
    out, cache = tmp_path / "f.npz", tmp_path / "cache"
    args = ["extract", "--images", images, "--shard-size", 2, "--batch-size", 2, *common(weights, out, cache)]
    interrupted = counting_backbones(monkeypatch, interrupt_at=2)  # Ctrl-C during the 2nd of 3 shards
    first = features(*args)
    assert first.exit_code == 130, first.output
    assert "interrupted: 1 of 3 shards" in first.output and "run the same command again" in first.output
    assert not out.exists() and not list(tmp_path.glob(".f.npz*"))
    (shard,) = cache.glob("*/shard_00000.npy")
    assert sorted(p.name for p in shard.parent.glob("shard_*.npy")) == ["shard_00000.npy"]
    mtime = shard.stat().st_mtime_ns
    assert interrupted[0].calls == 2

    resumed = counting_backbones(monkeypatch)
    second = features(*args)
    assert second.exit_code == 0, second.output
    assert resumed[0].calls == 2  # shards 1 and 2 only
    assert "2 computed, 1 reused" in second.output
    assert shard.stat().st_mtime_ns == mtime  # shard 0 was read back, not rewritten
    assert np.allclose(load_feature_file(out).features, direct_features(reference, paths), atol=1e-4)

    again = counting_backbones(monkeypatch)
    third = features(*args)
    assert third.exit_code == 0 and again[0].calls == 0 and "0 computed, 3 reused" in third.output


# --------------------------------------------------------------------------- the labels CSV's errors

BAD_CSVS = {
    "missing image column": ([["file", "Mass"], ["a.png", 1]], "no 'image' column"),
    "unknown class": ([["image", "Efusion"], ["a.png", 1]],
                      "'Efusion' is not a class (did you mean 'Effusion'?)"),
    "not 0/1": ([["image", "Mass"], ["a.png", 1], ["b.png", 2]], "line 3: Mass = '2' for 'b.png'"),
    "yes for 1": ([["image", "Mass"], ["a.png", "yes"]], "must be 0 (negative) or 1 (positive)"),
    "blank cell": ([["image", "Mass"], ["a.png", ""]], "Mass = '' for 'a.png'"),
    "duplicate image": ([["image", "Mass"], ["a.png", 1], ["b.png", 0], ["a.png", 0]],
                        "line 4: image 'a.png' is listed twice (also on line 2)"),
    "absent image": ([["image", "Mass"], ["a.png", 1], ["gone.png", 0]],
                     "1 of the 2 listed images are not in"),
    "duplicate column": ([["image", "Mass", "Mass"], ["a.png", 1, 1]], "names column 'Mass' twice"),
    "short row": ([["image", "Mass", "Nodule"], ["a.png", 1]], "line 2: 2 fields, but the header has 3"),
    "outside the folder": ([["image", "Mass"], ["../a.png", 1]], "is not inside"),
    "empty patient": ([["image", "patient", "Mass"], ["a.png", "", 1]], "empty 'patient' cell for 'a.png'"),
    "header only": ([["image", "Mass"]], "a header but no image rows"),
    "empty file": ([], "empty; the first line must be the header"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_CSVS))
def test_malformed_labels_csv_is_refused_with_what_to_fix(tmp_path: Path, case: str) -> None:
    rows, message = BAD_CSVS[case]
    images = tmp_path / "images"
    write_png(images / "a.png", 0)
    write_png(images / "b.png", 1)
    write_png(tmp_path / "a.png", 2)  # exists, but outside the images folder
    labels = write_csv(tmp_path / "labels.csv", rows)
    with pytest.raises(LabelsCsvError) as raised:
        read_labels_csv(labels, images, CLASSES)
    assert message in str(raised.value)


@pytest.mark.parametrize("case", ["unknown class", "not 0/1", "duplicate image", "absent image"])
def test_malformed_labels_csv_stops_the_command_before_any_work(
    tmp_path: Path, case: str, no_backbone: None
) -> None:
    rows, message = BAD_CSVS[case]
    images = tmp_path / "images"
    write_png(images / "a.png", 0)
    write_png(images / "b.png", 1)
    labels = write_csv(tmp_path / "labels.csv", rows)
    out = tmp_path / "out.npz"
    result = features("extract", "--images", images, "--labels", labels, "--out", out, "--no-progress")
    assert result.exit_code == 1
    assert "LabelsCsvError" in result.output and message in result.output
    assert not out.exists() and not list(tmp_path.glob(".out.npz*"))


def test_active_must_name_a_class_with_labels(tmp_path: Path, no_backbone: None) -> None:
    images = tmp_path / "images"
    write_png(images / "a.png", 0)
    labels = write_csv(tmp_path / "labels.csv", [["image", "Mass"], ["a.png", 1]])
    base = ["extract", "--images", images, "--labels", labels, "--out", tmp_path / "f.npz"]
    unknown = features(*base, "--active", "Mass,Masses")
    assert unknown.exit_code == 2 and "'Masses' is not a class" in unknown.output
    unlabelled = features(*base, "--active", "Nodule")
    assert unlabelled.exit_code == 2 and "'Nodule' has no labels" in unlabelled.output
    patients = features(*base, "--patient-ids")
    assert patients.exit_code == 2 and "add a 'patient' column" in patients.output
    assert not (tmp_path / "f.npz").exists()


# -------------------------------------------------------------------------- weights and backbone


def test_missing_weight_file_and_unknown_backbone_are_refused(tmp_path: Path) -> None:
    images = tmp_path / "images"
    write_png(images / "a.png", 0)
    out = tmp_path / "f.npz"
    absent = tmp_path / "no-such-weights.pth"
    missing = features(
        "extract", "--images", images, "--backbone", "resnet18", "--weights", absent, "--out", out
    )
    assert missing.exit_code == 1
    assert "WeightsNotFoundError" in missing.output and str(absent) in missing.output
    assert "'resnet18' not found" in missing.output
    unknown = features(
        "extract", "--images", images, "--backbone", "resnet19", "--weights", absent, "--out", out
    )
    assert unknown.exit_code == 1
    assert "unknown backbone 'resnet19'" in unknown.output and "densenet121-xrv" in unknown.output
    assert not out.exists()


# ------------------------------------------------------------------------------------------- show


def _saved(path: Path, *, labelled: bool = True) -> Path:
    rng = np.random.default_rng(0)
    labels = np.zeros((5, len(CLASSES)), np.uint8)
    labels[:, 1] = [1, 1, 0, 1, 0]
    labels[:, 4] = [0, 1, 0, 0, 0]
    save_feature_file(
        path,
        rng.standard_normal((5, 16)),
        classes=CLASSES,
        backbone="resnet18",
        weights_id="sha256:" + "ab" * 32,
        preprocessing='{"crop": 224, "name": "imagenet-rgb", "note": "it\'s quoted"}',
        labels=labels if labelled else None,
        active=(1, 4) if labelled else (),
        image_ids=[f"img{i}.png" for i in range(5)],
        patient_ids=["p1", "p1", "p2", "p3", "p3"] if labelled else None,
    )
    return path


def test_show_prints_what_the_file_holds_and_what_the_study_must_match(tmp_path: Path) -> None:
    path = _saved(tmp_path / "f.npz")
    file = load_feature_file(path)
    result = features("show", path)
    assert result.exit_code == 0, result.output
    out = result.output
    assert summary_value(out, "rows") == "5"
    assert summary_value(out, "dim") == "16"
    assert summary_value(out, "dtype") == "float64"
    assert summary_value(out, "classes") == f"8: {','.join(CLASSES)}"
    assert summary_value(out, "labelled") == "2 (active 1,4); positives: Cardiomegaly 3, Mass 1"
    assert summary_value(out, "patient ids") == "present (3 patients)"
    assert summary_value(out, "backbone") == file.backbone
    assert summary_value(out, "weights-id") == file.weights_id
    assert summary_value(out, "preprocessing") == file.preprocessing
    assert summary_value(out, "digest") == f"sha256:{sha256_of(path)} (SHA-256 of the file's bytes)"
    assert "its run config holds exactly these values" in out
    assert run_config(out) == {
        "classes": ",".join(file.classes),
        "dim": file.dim,
        "backbone": file.backbone,
        "weights-id": file.weights_id,
        "preprocessing": file.preprocessing,
    }
    as_json = json.loads(features("show", "--json", path).output)
    assert as_json["weights_id"] == file.weights_id and as_json["preprocessing"] == file.preprocessing
    assert as_json["digest"] == f"sha256:{sha256_of(path)}"
    assert as_json["positives"] == {"Cardiomegaly": 3, "Mass": 1} and as_json["patient_ids"] is True


def test_show_of_a_prediction_only_file(tmp_path: Path) -> None:
    result = features("show", _saved(tmp_path / "p.npz", labelled=False))
    assert result.exit_code == 0, result.output
    assert summary_value(result.output, "labelled").startswith("none: no labels")
    assert summary_value(result.output, "patient ids").startswith("absent")


def test_show_of_a_bad_file_gives_the_feature_file_error(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip")
    incomplete = tmp_path / "incomplete.npz"
    np.savez(incomplete, features=np.zeros((2, 3), np.float32))
    for path in (tmp_path / "absent.npz", garbage, incomplete):
        with pytest.raises(FeatureFileError) as raised:
            load_feature_file(path)
        result = features("show", path)
        assert result.exit_code == 1
        assert str(raised.value) in result.output
