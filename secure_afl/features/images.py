"""Finding and loading the ChestXray14 PNGs (SPEC §4).

Public API
----------
``IMAGE_LAYOUTS``
    The layouts searched under a data directory: the official archives unpacked in place
    (``images_001/images/*.png`` … ``images_012/images/*.png``) and a flat ``images/*.png``.
``index_images(data_dir) -> dict[str, Path]``
    File name (``00000001_000.png``) -> path, over both layouts.
``resolve_image_paths(data_dir, image_names) -> ImagePaths(paths, missing_names)``
    ``paths`` holds the path of every name that was found, in the order of ``image_names``;
    ``missing_names`` the names that were not (the caller drops those rows, and should report them).
    Raises :class:`ImagesNotFoundError` when not a single name is found (wrong directory or layout).
``load_grayscale(path) -> PIL.Image.Image``
    Opens a PNG as 8-bit grayscale (mode ``L``); RGB(A)/palette images are converted, 16-bit ones
    rescaled to 8 bits. NIH PNGs are 8-bit, a few of them RGBA.
``ImageDataset(paths, transform)``, ``collate_images``, ``ImageBatch``
    A map-style ``torch.utils.data.Dataset`` that returns ``LoadedImage(index, pixels, error)`` and its
    collate function for a ``DataLoader``. An unreadable or corrupt PNG does not stop the run: the
    dataset returns ``pixels=None`` with the reason, ``collate_images`` moves it to
    ``ImageBatch.skipped``, and :func:`secure_afl.features.extraction.extract_features` reports the skipped
    indices so the caller can drop those rows (or raises :class:`CorruptImageError` with ``strict=True``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

__all__ = [
    "IMAGE_LAYOUTS",
    "CorruptImageError",
    "ImageBatch",
    "ImageDataset",
    "ImagePaths",
    "ImagesNotFoundError",
    "LoadedImage",
    "collate_images",
    "index_images",
    "load_grayscale",
    "resolve_image_paths",
]

# Searched in this order; the first layout that holds a name wins.
IMAGE_LAYOUTS: tuple[str, ...] = ("images_*/images/*.png", "images/*.png")

# What PIL and the transforms raise on a truncated, corrupt or odd file.
_UNREADABLE_IMAGE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


class ImagesNotFoundError(FileNotFoundError):
    """None of the requested images exists under the data directory."""


class CorruptImageError(OSError):
    """An image could not be read or preprocessed (raised only in strict mode)."""


class ImagePaths(NamedTuple):
    paths: list[Path]
    missing_names: list[str]


class LoadedImage(NamedTuple):
    index: int
    pixels: torch.Tensor | None  # None marks an unreadable image
    error: str | None


class ImageBatch(NamedTuple):
    indices: list[int]  # dataset indices of the rows of ``pixels``
    pixels: torch.Tensor | None  # None when every image of the batch was unreadable
    skipped: list[tuple[int, str]]  # (dataset index, reason)


def index_images(data_dir: Path) -> dict[str, Path]:
    """Maps each PNG file name found in :data:`IMAGE_LAYOUTS` under ``data_dir`` to its path."""
    data_dir = Path(data_dir)
    found: dict[str, Path] = {}
    for pattern in IMAGE_LAYOUTS:
        for path in sorted(data_dir.glob(pattern)):
            found.setdefault(path.name, path)
    return found


def resolve_image_paths(data_dir: Path, image_names: Sequence[str]) -> ImagePaths:
    """Finds ``image_names`` under ``data_dir``; see the module docstring."""
    data_dir = Path(data_dir)
    index = index_images(data_dir)
    paths: list[Path] = []
    missing: list[str] = []
    for name in image_names:
        path = index.get(name)
        if path is None:
            missing.append(name)
        else:
            paths.append(path)
    if image_names and not paths:
        layouts = " or ".join(str(data_dir / pattern) for pattern in IMAGE_LAYOUTS)
        raise ImagesNotFoundError(
            f"none of the {len(image_names)} requested images (e.g. {image_names[0]}) is under {data_dir} "
            f"({len(index)} PNG files found there). Expected the ChestXray14 PNGs as the official archives "
            f"unpack them, {layouts}."
        )
    return ImagePaths(paths, missing)


def load_grayscale(path: Path) -> Image.Image:
    """Opens ``path`` as an 8-bit grayscale image, fully decoded (so corruption surfaces here)."""
    with Image.open(path) as image:
        image.load()
        if image.mode in ("I", "I;16", "I;16B", "I;16L"):
            # 16-bit grayscale: rescale to 8 bits, as the backbones' preprocessing expects 0…255.
            pixels = np.asarray(image, dtype=np.float64)
            return Image.fromarray(np.clip(np.round(pixels * (255 / 65535)), 0, 255).astype(np.uint8))
        return image.convert("L")


class ImageDataset(Dataset[LoadedImage]):
    """PNG files -> preprocessed tensors; unreadable files become a marker instead of an exception."""

    def __init__(self, paths: Sequence[Path], transform: Callable[[Image.Image], torch.Tensor]) -> None:
        self.paths = list(paths)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> LoadedImage:
        path = self.paths[index]
        try:
            return LoadedImage(index, self.transform(load_grayscale(path)), None)
        except _UNREADABLE_IMAGE_ERRORS as error:
            return LoadedImage(index, None, f"{path}: {error.__class__.__name__}: {error}")


def collate_images(batch: Sequence[LoadedImage]) -> ImageBatch:
    """Stacks the readable images of a batch and lists the unreadable ones."""
    readable = [item for item in batch if item.pixels is not None]
    skipped = [(item.index, item.error or "unreadable") for item in batch if item.pixels is None]
    pixels = torch.stack([item.pixels for item in readable]) if readable else None
    return ImageBatch([item.index for item in readable], pixels, skipped)
