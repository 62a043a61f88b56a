"""sim --scenario multisite on real images: small generated files in each collection's own layout."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from click.testing import CliRunner
from PIL import Image

from secure_afl.cli import main
from secure_afl.sim.multisite import (
    EXACT_BAR,
    SITE_KEYS,
    MultisiteConfig,
    MultisiteError,
    load_site_table,
    patient_split,
)
from secure_afl.sim.setting import SimConfig

from .test_dicom import write_dicom

PAPER = (
    "Atelectasis",
    "Cardiomegaly",
    "Effusion",
    "Infiltration",
    "Mass",
    "Nodule",
    "Pneumonia",
    "Pneumothorax",
)
PER_SIDE = {"train": 5, "test": 2}
SIZE = 48


def _pixels(seed: int) -> np.ndarray:
    pixels = np.random.default_rng(seed).integers(0, 256, (SIZE, SIZE), dtype=np.uint8)
    pixels[0, 0], pixels[-1, -1] = 0, 255
    return pixels


def _write(key: str, root: Path, image_id: str, pixels: np.ndarray) -> Path:
    """One image where torchxrayvision's dataset class for ``key`` reads it."""
    if key in ("nih", "google"):
        path = root / image_id
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels, mode="L").save(path)
    elif key == "chexpert":
        path = root / image_id.replace("CheXpert-v1.0-small/", "")
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels, mode="L").save(path, quality=95)
    elif key == "padchest":  # 16-bit PNGs
        path = root / image_id
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels.astype(np.uint16) * 257).save(path)
    elif key == "vindr":
        path = write_dicom(root / f"{image_id}.dicom", pixels)
    elif key == "rsna":
        path = write_dicom(root / f"{image_id}.dcm", pixels)
    else:  # siim: the release's nested study/series folders
        path = write_dicom(root / "dicom-images-train" / "1.2.3" / "4.5.6" / f"{image_id}.dcm", pixels)
    return path


@pytest.fixture(scope="module")
def collections(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[str]]]:
    """A directory per site with a few of its table's images (both sides of the split), and per site
    the image ids written.  RSNA's first image has the pixels of NIH's first: one image, two sites."""
    root = tmp_path_factory.mktemp("multisite_images")
    table = load_site_table(PAPER)
    test = patient_split(table.patients, seed=0)
    written: dict[str, list[str]] = {}
    seed = 0
    for k, site in enumerate(table.sites):
        written[site.key] = []
        for side, count in PER_SIDE.items():
            rows = np.flatnonzero((table.site == k) & (test == (side == "test")))
            # positives of its classes first, so that the classes are not all one-sided
            order = rows[np.argsort(-np.nansum(table.labels[rows], axis=1), kind="stable")]
            for row in order[:count]:
                pixels = _pixels(seed if not (site.key == "rsna" and not written["rsna"]) else 0)
                _write(site.key, root / site.key, str(table.image_ids[row]), pixels)
                written[site.key].append(str(table.image_ids[row]))
                seed += 1
    return root, written


def _resnet(path: Path) -> Path:
    torch.manual_seed(0)
    torch.save(torchvision.models.resnet18().state_dict(), path)
    return path


def test_real_images_end_to_end(collections: tuple[Path, dict[str, list[str]]], tmp_path: Path) -> None:
    root, written = collections
    weights = _resnet(tmp_path / "resnet18.pth")
    args = ["sim", "--scenario", "multisite", "--backbone", "resnet18", "--weights", str(weights)]
    for key in SITE_KEYS:
        args += ["--site-dir", f"{key}={root / key}"]
    args += ["--workers", "0", "--fedavg-rounds", "1", "--cache-dir", str(tmp_path / "cache")]
    done = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "run")])
    assert done.exit_code == 0, done.output
    assert "FEATURES ARE SYNTHETIC" not in done.output
    out = json.loads((tmp_path / "run" / "results.json").read_text())
    assert out["dataset"]["synthetic_features"] is False and out["dataset"]["features"] == "resnet18, d=512"
    sites = {s["key"]: s for s in out["sites"]}
    assert list(sites) == list(SITE_KEYS)
    for key, ids in written.items():
        duplicates = 1 if key == "rsna" else 0  # its first image is NIH's first, kept at NIH
        assert sites[key]["duplicate_images_removed"] == duplicates
        assert sites[key]["rows"] == len(ids) - duplicates
        assert sites[key]["images_missing"] > 0  # the rest of its table is not on disk
    assert sites["nih"]["labelled_classes"] == list(PAPER) and sites["siim"]["labelled_classes"] == [
        "Pneumothorax"
    ]
    assert out["max_abs_w_vs_centralised"] <= EXACT_BAR
    assert {"AFL (1 round)", "AFL (2 rounds)", "FedAvg"} <= set(out["metrics"])

    again = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "run2")])  # features from the cache
    assert again.exit_code == 0, again.output
    second = json.loads((tmp_path / "run2" / "results.json").read_text())
    assert second["dataset"]["features_from_cache"] is True
    assert second["metrics"]["AFL (1 round)"] == out["metrics"]["AFL (1 round)"]


def test_absent_directory_or_images_are_named(tmp_path: Path) -> None:
    from secure_afl.sim.datasets import ImageSource
    from secure_afl.sim.multisite import run_multisite

    empty = tmp_path / "rsna"
    empty.mkdir()
    source = ImageSource(data_dir=empty, backbone="resnet18", weights=tmp_path / "w.pth", device="cpu")
    config = MultisiteConfig(
        sim=SimConfig(),
        sites=("rsna", "siim"),
        site_dirs=(("rsna", empty), ("siim", tmp_path / "siim-absent")),
        images=source,
    )
    with pytest.raises(
        MultisiteError, match=f"directory of site siim does not exist: {tmp_path / 'siim-absent'}"
    ):
        run_multisite(config)
    (tmp_path / "siim").mkdir()
    config = MultisiteConfig(
        sim=SimConfig(),
        sites=("rsna", "siim"),
        site_dirs=(("rsna", empty), ("siim", tmp_path / "siim")),
        images=source,
    )
    with pytest.raises(
        MultisiteError, match=rf"none of the \d+ images of RSNA Pneumonia is under {empty}: {empty}/"
    ):
        run_multisite(config)
