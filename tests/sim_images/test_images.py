"""Finding the NIH PNGs in both layouts, loading them, and marking unreadable ones."""

from __future__ import annotations

import csv
import gzip
from pathlib import Path

import numpy as np
import pytest
import torch
import torchxrayvision as xrv
from PIL import Image

from secure_afl.features.backbones import XRayTransform
from secure_afl.features.images import (
    ImageDataset,
    ImagesNotFoundError,
    collate_images,
    index_images,
    load_grayscale,
    resolve_image_paths,
)

from .conftest import NIH_CSV_HEADER, synthetic_pixels


def test_fixture_csv_has_the_header_of_the_real_data_entry_file(archive_data_dir: Path) -> None:
    bundled = Path(xrv.datasets.__file__).parent / "data" / "Data_Entry_2017_v2020.csv.gz"
    with gzip.open(bundled, "rt") as handle:
        real_header = next(csv.reader(handle))
    with open(archive_data_dir / "Data_Entry_2017_v2020.csv") as handle:
        assert next(csv.reader(handle)) == real_header == NIH_CSV_HEADER


@pytest.mark.parametrize("layout", ["archive", "flat"])
def test_resolve_finds_images_in_both_layouts_in_the_requested_order(
    layout: str, archive_data_dir: Path, flat_data_dir: Path, image_names: list[str]
) -> None:
    data_dir = archive_data_dir if layout == "archive" else flat_data_dir
    wanted = [*reversed(image_names[:5]), "99999999_000.png", image_names[-1]]
    paths, missing = resolve_image_paths(data_dir, wanted)
    assert [p.name for p in paths] == [*reversed(image_names[:5]), image_names[-1]]
    assert missing == ["99999999_000.png"]
    assert all(p.is_file() and p.is_relative_to(data_dir) for p in paths)
    if layout == "archive":
        assert {p.parent.parent.name for p in paths} == {"images_001", "images_002"}


def test_index_covers_every_archive_folder(archive_data_dir: Path, image_names: list[str]) -> None:
    assert sorted(index_images(archive_data_dir)) == sorted(image_names)


def test_no_matching_image_names_the_directory_and_the_expected_layouts(
    tmp_path: Path, image_names: list[str]
) -> None:
    (tmp_path / "images").mkdir()
    Image.fromarray(synthetic_pixels(0)).save(tmp_path / "images" / "unrelated.png")
    with pytest.raises(ImagesNotFoundError) as caught:
        resolve_image_paths(tmp_path, image_names)
    message = str(caught.value)
    assert isinstance(caught.value, FileNotFoundError)
    assert str(tmp_path) in message and "images_*/images/*.png" in message and "images/*.png" in message
    assert image_names[0] in message and "1 image files found" in message


def test_rgba_and_16_bit_pngs_load_as_8_bit_grayscale(tmp_path: Path) -> None:
    gray = synthetic_pixels(7)
    rgba = np.dstack([gray, gray, gray, np.full_like(gray, 255)])
    Image.fromarray(rgba, mode="RGBA").save(tmp_path / "a.png")
    Image.fromarray(gray.astype(np.uint16) * 257).save(tmp_path / "b.png")  # 16-bit, same intensities
    assert Image.open(tmp_path / "b.png").mode.startswith("I")
    for name in ("a.png", "b.png"):
        image = load_grayscale(tmp_path / name)
        assert image.mode == "L"
        assert np.array_equal(np.asarray(image), gray)


def test_dataset_marks_a_corrupt_png_and_collate_separates_it(
    corrupt_data_dir: tuple[list[Path], int],
) -> None:
    paths, bad = corrupt_data_dir
    dataset = ImageDataset(paths, XRayTransform(32))
    marked = dataset[bad]
    assert marked.index == bad and marked.pixels is None and str(paths[bad]) in marked.error
    batch = collate_images([dataset[i] for i in range(len(paths))])
    assert batch.indices == [i for i in range(len(paths)) if i != bad]
    assert [index for index, _ in batch.skipped] == [bad]
    assert isinstance(batch.pixels, torch.Tensor) and batch.pixels.shape == (len(paths) - 1, 1, 32, 32)


def test_batch_of_only_corrupt_images_has_no_pixels(corrupt_data_dir: tuple[list[Path], int]) -> None:
    paths, bad = corrupt_data_dir
    batch = collate_images([ImageDataset(paths, XRayTransform(32))[bad]])
    assert batch.pixels is None and batch.indices == [] and len(batch.skipped) == 1
