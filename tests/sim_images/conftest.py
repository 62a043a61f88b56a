"""Fixtures: a tiny synthetic ChestXray14 on disk, and a fast toy backbone for the cache tests."""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from secure_afl.features.backbones import Backbone, Preprocess, XRayTransform

N_IMAGES = 24
IMAGE_SIZE = 64
# The header of torchxrayvision's bundled Data_Entry_2017_v2020.csv.gz, verbatim: the last two
# bracketed names contain unquoted commas, so they are four columns.
NIH_CSV_HEADER = [
    "Image Index",
    "Finding Labels",
    "Follow-up #",
    "Patient ID",
    "Patient Age",
    "Patient Gender",
    "View Position",
    "OriginalImage[Width",
    "Height]",
    "OriginalImagePixelSpacing[x",
    "y]",
]
FINDINGS = [
    "No Finding",
    "Atelectasis",
    "Cardiomegaly|Effusion",
    "Infiltration",
    "Mass|Nodule",
    "Pneumonia",
    "Pneumothorax",
]


def nih_name(index: int) -> str:
    """NIH file names are <8-digit patient id>_<3-digit follow-up>.png; 3 images per patient here."""
    return f"{index // 3 + 1:08d}_{index % 3:03d}.png"


def synthetic_pixels(index: int, size: int = IMAGE_SIZE) -> np.ndarray:
    rng = np.random.default_rng(index)
    pixels = rng.integers(0, 256, (size, size), dtype=np.uint8)
    pixels[0, 0], pixels[-1, -1] = 0, 255  # full 8-bit range, so the scaled range is known
    return pixels


def write_png(path: Path, index: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    gray = synthetic_pixels(index)
    if index % 5 == 4:  # some NIH PNGs are RGBA
        rgba = np.dstack([gray, gray, gray, np.full_like(gray, 255)])
        Image.fromarray(rgba, mode="RGBA").save(path)
    else:
        Image.fromarray(gray, mode="L").save(path)


def write_nih_csv(path: Path, names: list[str]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(NIH_CSV_HEADER)
        for i, name in enumerate(names):
            patient = int(name[:8])
            writer.writerow(
                [
                    name,
                    FINDINGS[i % len(FINDINGS)],
                    int(name[9:12]),
                    patient,
                    40 + i,
                    "MF"[i % 2],
                    "PA" if i % 4 else "AP",
                    2500,
                    2048,
                    0.143,
                    0.143,
                ]
            )


@pytest.fixture(scope="session")
def image_names() -> list[str]:
    return [nih_name(i) for i in range(N_IMAGES)]


@pytest.fixture(scope="session")
def archive_data_dir(tmp_path_factory: pytest.TempPathFactory, image_names: list[str]) -> Path:
    """A data dir laid out as the official archives unpack: images_001/images/, images_002/images/."""
    root = tmp_path_factory.mktemp("nih_archives")
    for i, name in enumerate(image_names):
        write_png(root / f"images_{1 + 2 * i // N_IMAGES:03d}" / "images" / name, i)
    write_nih_csv(root / "Data_Entry_2017_v2020.csv", image_names)
    return root


@pytest.fixture(scope="session")
def flat_data_dir(tmp_path_factory: pytest.TempPathFactory, image_names: list[str]) -> Path:
    """The same images in a flat images/ directory."""
    root = tmp_path_factory.mktemp("nih_flat")
    for i, name in enumerate(image_names):
        write_png(root / "images" / name, i)
    write_nih_csv(root / "Data_Entry_2017_v2020.csv", image_names)
    return root


@pytest.fixture
def flat_paths(flat_data_dir: Path, image_names: list[str]) -> list[Path]:
    return [flat_data_dir / "images" / name for name in image_names]


@pytest.fixture
def corrupt_data_dir(tmp_path: Path, image_names: list[str]) -> tuple[list[Path], int]:
    """Eight images of which one (index 5) is a truncated PNG."""
    paths = []
    for i, name in enumerate(image_names[:8]):
        write_png(tmp_path / "images" / name, i)
        paths.append(tmp_path / "images" / name)
    paths[5].write_bytes(paths[5].read_bytes()[:60])
    return paths, 5


class ToyNet(nn.Module):
    """A few-hundred-parameter CNN, so the cache tests run in milliseconds."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, kernel_size=3, stride=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x / 1024)).mean(dim=(2, 3))


class SimulatedInterruption(RuntimeError):
    """Stands in for a crash or Ctrl-C in the middle of an extraction."""


class CountingEmbed:
    """Wraps a backbone's embed: counts calls and, optionally, raises at call number ``fail_at``."""

    def __init__(self, embed: Callable[[torch.Tensor], torch.Tensor], fail_at: int | None = None) -> None:
        self.embed = embed
        self.calls = 0
        self.fail_at = fail_at

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            raise SimulatedInterruption(f"interrupted at forward pass {self.calls}")
        return self.embed(x)


@pytest.fixture
def toy_backbone() -> Backbone:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module = ToyNet().requires_grad_(False).eval()
    return Backbone(
        name="toy",
        module=module,
        embed=module,
        feature_dim=8,
        transform=XRayTransform(32),
        # A tuple-valued parameter, as the ImageNet backbones have (mean, std): JSON turns it into a list.
        preprocess=Preprocess("xrv-grayscale", (("resize", 32), ("mean", (0.5,)))),
        weights_id="random-init-seed-0",
        weights_path=None,
    )
