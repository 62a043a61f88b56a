"""Finding, hashing and loading the X-ray files: ChestXray14 PNGs, JPEGs and DICOM (SPEC §4).

Public API
----------
``IMAGE_LAYOUTS``, ``DICOM_LAYOUTS``
    The layouts searched under a data directory: the official archives unpacked in place
    (``images_001/images/*.png`` … ``images_012/images/*.png``) and a flat ``images/*.png``; then
    DICOM files (``*.dcm``, ``*.dicom``) in the same folders.
``index_images(data_dir) -> dict[str, Path]``
    File name (``00000001_000.png``) -> path, over these layouts.
``list_images(folder) -> list[Path]``, ``find_images(data_dir) -> dict[str, Path]``
    The one place that decides which files of a folder are images: a name ending in one of
    :data:`~secure_afl.features.labels.IMAGE_SUFFIXES` (PNG, JPEG, DICOM; any case).
    ``list_images``: the files directly in ``folder`` (``features extract --images DIR``);
    ``find_images``: those, then the same under ``DIR/images/`` and ``DIR/images_*/images/``
    (``predict --data-dir DIR``), by file name, the first found winning. Both raise
    :class:`NoImagesError`, naming the extensions and the folders searched, when there is none.
``resolve_image_paths(data_dir, image_names) -> ImagePaths(paths, missing_names)``
    ``paths`` holds the path of every name that was found, in the order of ``image_names``;
    ``missing_names`` the names that were not (the caller drops those rows, and should report them).
    Raises :class:`ImagesNotFoundError` when not a single name is found (wrong directory or layout).
``image_sha256(path) -> str``, ``hash_image_files(paths, workers) -> tuple[str | None, ...]``
    The SHA-256 (64 lowercase hex digits) of an image file's bytes, read in 1 MiB chunks: the image's
    name by content, which the feature cache is keyed by and the feature file records per row.  Two
    files with the same bytes are the same image.  ``hash_image_files`` gives None for a file that
    cannot be read (the extraction then skips it with the reason).
``pixel_sha256(image) -> str``
    The SHA-256 of a decoded 8-bit grayscale image (size and pixels): the image named by what the
    backbone sees, unchanged by a lossless re-export of the file. The extraction records it per row
    beside the file digest.
``sop_instance_uid(path) -> str``
    A DICOM file's SOP Instance UID (its header only is read), ``""`` for another file or a DICOM
    file without one. The extraction records it per row: a third name of the image
    (:func:`secure_afl.privacy.release.image_keys`).
``load_grayscale(path) -> PIL.Image.Image``
    Opens a PNG, JPEG or DICOM file as 8-bit grayscale (mode ``L``); RGB(A)/palette images are
    converted, 16-bit ones rescaled to 8 bits. NIH PNGs are 8-bit, a few of them RGBA. DICOM: see
    :func:`dicom_grayscale`.
``dicom_grayscale(data, name) -> numpy.ndarray``
    A DICOM file's bytes -> its display image as uint8 (read with pydicom): the modality LUT (rescale
    slope and intercept, or a Modality LUT Sequence), then the first VOI transform the file holds (a
    VOI LUT Sequence, else Window Center/Width with its VOI LUT Function), mapped onto 0…255; a file
    without a VOI transform maps the whole range of its Bits Stored (as torchxrayvision's
    ``read_xray_dcm`` does). MONOCHROME1 (bright = low values) is inverted to MONOCHROME2. Compressed
    transfer syntaxes are read where pydicom has a decoder here (RLE Lossless natively, JPEG Baseline
    and JPEG 2000 through Pillow, Deflate); any other raises :class:`DicomCompressionError` naming
    the file, the syntax and how to convert it (``gdcmconv --raw IN OUT``). A truncated or malformed
    file raises :class:`DicomError` naming the file.
``ImageDataset(paths, transform, sha256=None)``, ``collate_images``, ``ImageBatch``
    A map-style ``torch.utils.data.Dataset`` that returns ``LoadedImage(index, pixels, error)`` and its
    collate function for a ``DataLoader``. An unreadable or corrupt image does not stop the run: the
    dataset returns ``pixels=None`` with the reason, ``collate_images`` moves it to
    ``ImageBatch.skipped``, and :func:`secure_afl.features.extraction.extract_features` reports the skipped
    indices so the caller can drop those rows (or raises :class:`CorruptImageError` with ``strict=True``).
    With ``sha256`` (one digest per path), each file is read once into memory, its bytes are checked
    against the digest and decoded from that copy: a file that changed after it was hashed raises
    :class:`ImageChangedError` (the extraction stops; the shards it completed stay cached), so features
    never pair with another image's digest, and no cache entry records such an image as skipped.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from secure_afl.features.labels import IMAGE_SUFFIXES

__all__ = [
    "DICOM_LAYOUTS",
    "DICOM_SUFFIXES",
    "IMAGE_LAYOUTS",
    "CorruptImageError",
    "DicomCompressionError",
    "DicomError",
    "ImageBatch",
    "ImageChangedError",
    "ImageDataset",
    "ImagePaths",
    "ImagesNotFoundError",
    "LoadedImage",
    "NoImagesError",
    "collate_images",
    "dicom_grayscale",
    "find_images",
    "hash_image_files",
    "image_sha256",
    "index_images",
    "is_dicom",
    "list_images",
    "load_grayscale",
    "pixel_sha256",
    "resolve_image_paths",
    "sop_instance_uid",
]

# Searched in this order; the first layout that holds a name wins.
IMAGE_LAYOUTS: tuple[str, ...] = ("images_*/images/*.png", "images/*.png")
# DICOM files in the same places (``secure-afl predict --data-dir`` reads these too); searched after the PNGs.
DICOM_LAYOUTS: tuple[str, ...] = tuple(
    pattern.replace(".png", suffix) for suffix in (".dcm", ".dicom") for pattern in IMAGE_LAYOUTS
)

DICOM_SUFFIXES: tuple[str, ...] = (".dcm", ".dicom")
# Where find_images looks under a folder, after the folder itself (ChestXray14's two layouts).
IMAGE_SUBFOLDERS: tuple[str, ...] = ("images", "images_*/images")
_HASH_CHUNK = 1 << 20
_DICOM_CONVERT_ADVICE = (
    "convert it to an uncompressed transfer syntax first, e.g. `gdcmconv --raw IN.dcm OUT.dcm` (GDCM) or "
    "`dcmdjpeg IN.dcm OUT.dcm` (DCMTK), or install a pydicom decoder plugin for it (pylibjpeg with "
    "pylibjpeg-libjpeg for JPEG Lossless and JPEG-LS)"
)

# What PIL and the transforms raise on a truncated, corrupt or odd file.
_UNREADABLE_IMAGE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


class ImagesNotFoundError(FileNotFoundError):
    """None of the requested images exists under the data directory."""


class NoImagesError(ImagesNotFoundError):
    """A folder holds no file with an image extension where it was searched: the message names the
    extensions looked for and the folders searched."""


class CorruptImageError(OSError):
    """Images that could not be read or preprocessed: raised by the extraction in strict mode, and by
    the commands (``features extract``, ``predict``) naming every file left out and why."""


class ImageChangedError(CorruptImageError):
    """An image file whose bytes no longer match the digest taken before the extraction."""


class DicomError(CorruptImageError):
    """A DICOM file that cannot be read as a grayscale X-ray (the message names the file and why)."""


class DicomCompressionError(DicomError):
    """A DICOM file in a compressed transfer syntax that no installed pydicom decoder reads."""


class ImagePaths(NamedTuple):
    paths: list[Path]
    missing_names: list[str]


class LoadedImage(NamedTuple):
    index: int
    pixels: torch.Tensor | None  # None marks an unreadable image
    error: str | None
    pixel_sha256: str | None = None  # of the decoded image (see pixel_sha256); None if unreadable


class ImageBatch(NamedTuple):
    indices: list[int]  # dataset indices of the rows of ``pixels``
    pixels: torch.Tensor | None  # None when every image of the batch was unreadable
    skipped: list[tuple[int, str]]  # (dataset index, reason)
    pixel_sha256: list[str | None] | None = None  # per row of ``pixels``


def index_images(data_dir: Path) -> dict[str, Path]:
    """Maps each file name found in :data:`IMAGE_LAYOUTS`, then :data:`DICOM_LAYOUTS`, to its path."""
    data_dir = Path(data_dir)
    found: dict[str, Path] = {}
    for pattern in IMAGE_LAYOUTS + DICOM_LAYOUTS:
        for path in sorted(data_dir.glob(pattern)):
            found.setdefault(path.name, path)
    return found


def _image_files(folder: Path) -> list[Path]:
    """The files directly in ``folder`` whose name ends in an image extension, sorted by name."""
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())


def _no_images(folders: Sequence[str]) -> NoImagesError:
    return NoImagesError(
        f"no image files in {' or '.join(folders)}: looked for the extensions {' '.join(IMAGE_SUFFIXES)} "
        "(PNG, JPEG, DICOM; any case)"
    )


def list_images(folder: Path) -> list[Path]:
    """The image files directly in ``folder`` (not its subfolders), sorted by name; see the module doc."""
    folder = Path(folder)
    if not folder.is_dir():
        raise NoImagesError(f"{folder} is not a folder")
    found = _image_files(folder)
    if not found:
        raise _no_images([f"{folder} (subfolders are not searched)"])
    return found


def find_images(data_dir: Path) -> dict[str, Path]:
    """File name -> path of the images in ``data_dir``, then under :data:`IMAGE_SUBFOLDERS`; see the
    module doc."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise NoImagesError(f"{data_dir} is not a folder")
    folders = [data_dir, *(p for pattern in IMAGE_SUBFOLDERS for p in sorted(data_dir.glob(pattern)))]
    found: dict[str, Path] = {}
    for folder in folders:
        for path in _image_files(folder) if folder.is_dir() else ():
            found.setdefault(path.name, path)
    if not found:
        raise _no_images([str(data_dir), *(f"{data_dir}/{pattern}/" for pattern in IMAGE_SUBFOLDERS)])
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
            f"({len(index)} image files found there). Expected the ChestXray14 PNGs as the official archives "
            f"unpack them, {layouts}."
        )
    return ImagePaths(paths, missing)


def image_sha256(path: Path) -> str:
    """SHA-256 of the file's bytes as 64 lowercase hex digits, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _sha256_or_none(path: Path) -> str | None:
    try:
        return image_sha256(path)
    except OSError:
        return None  # missing or unreadable: the extraction skips it and says why


def hash_image_files(paths: Sequence[Path], workers: int = 1) -> tuple[str | None, ...]:
    """:func:`image_sha256` of every path, in order (None where a file cannot be read).

    ``workers`` > 1 hashes in that many threads (hashlib releases the GIL on large chunks).
    """
    paths = [Path(p) for p in paths]
    if workers <= 1 or len(paths) < 2:
        return tuple(_sha256_or_none(p) for p in paths)
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        return tuple(pool.map(_sha256_or_none, paths))
    finally:  # on Ctrl-C, drop the files not started instead of hashing them all first
        pool.shutdown(wait=True, cancel_futures=True)


def pixel_sha256(image: Image.Image) -> str:
    """SHA-256 of a decoded 8-bit grayscale image: what the backbone sees, whatever the file's encoding.

    Over ``L``, the width and height (8 bytes each, big-endian) and the row-major pixel bytes. The
    same X-ray re-exported losslessly (a PNG recompressed, a DICOM with new UIDs or other metadata,
    MONOCHROME1 written as inverted MONOCHROME2) keeps this digest while its file digest changes.
    """
    gray = image if image.mode == "L" else image.convert("L")
    digest = hashlib.sha256(b"L")
    digest.update(gray.width.to_bytes(8, "big") + gray.height.to_bytes(8, "big"))
    digest.update(np.ascontiguousarray(np.asarray(gray, dtype=np.uint8)).tobytes())
    return digest.hexdigest()


def sop_instance_uid(path: Path) -> str:
    """The SOP Instance UID of a DICOM file (``""`` for a PNG or JPEG, or a DICOM file without one).

    Reads the header only (pydicom stops before the pixel data). A DICOM file whose header cannot
    be read raises :class:`DicomError` naming the file; the extraction has read its pixels already,
    so that is a file changed or truncated since.
    """
    path = Path(path)
    with open(path, "rb") as handle:
        head = handle.read(132)
    if not is_dicom(head, path):
        return ""
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        dataset = pydicom.dcmread(path, stop_before_pixels=True, force=True, specific_tags=["SOPInstanceUID"])
    except (InvalidDicomError, EOFError, OSError, ValueError, KeyError, TypeError) as exc:
        raise DicomError(
            f"{path}: the DICOM header cannot be read ({exc.__class__.__name__}: {exc})"
        ) from None
    return str(dataset.get("SOPInstanceUID", "") or "").strip(" \x00")


def is_dicom(data: bytes, name: str | Path = "") -> bool:
    """A DICOM file: the ``DICM`` magic after its 128-byte preamble, or a .dcm/.dicom name."""
    return data[128:132] == b"DICM" or Path(name).suffix.lower() in DICOM_SUFFIXES


def load_grayscale(path: Path) -> Image.Image:
    """Opens ``path`` as an 8-bit grayscale image, fully decoded (so corruption surfaces here)."""
    return _decode(Path(path).read_bytes(), Path(path))


def _decode(data: bytes, path: Path) -> Image.Image:
    if is_dicom(data, path):
        return Image.fromarray(dicom_grayscale(data, path), mode="L")
    try:
        opened = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:  # its own message shows the BytesIO object, not the file
        raise UnidentifiedImageError(
            "not a PNG, JPEG or DICOM image (Pillow cannot identify its format)"
        ) from None
    with opened as image:
        image.load()
        if image.mode in ("I", "I;16", "I;16B", "I;16L"):
            # 16-bit grayscale: rescale to 8 bits, as the backbones' preprocessing expects 0…255.
            pixels = np.asarray(image, dtype=np.float64)
            return Image.fromarray(np.clip(np.round(pixels * (255 / 65535)), 0, 255).astype(np.uint8))
        return image.convert("L")


def _read_dicom(data: bytes, path: Path) -> Any:
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        # force=True also reads files written without the preamble and "DICM" (older exports)
        dataset = pydicom.dcmread(io.BytesIO(data), force=True)
    except (InvalidDicomError, EOFError, OSError, ValueError, KeyError, TypeError) as exc:
        raise DicomError(
            f"{path}: not a readable DICOM file ({exc.__class__.__name__}: {exc}); is it truncated? "
            "Export it again from the PACS"
        ) from None
    if "PixelData" not in dataset:
        raise DicomError(
            f"{path}: no DICOM pixel data (no (7FE0,0010) Pixel Data element): the file is truncated, is "
            "not DICOM, or holds no image (a report or structured document); export the image again"
        )
    return dataset


def _stored_pixels(dataset: Any, path: Path) -> np.ndarray:
    from pydicom.pixels import get_decoder
    from pydicom.uid import UID, ExplicitVRLittleEndian

    meta = getattr(dataset, "file_meta", None)
    syntax = UID(getattr(meta, "TransferSyntaxUID", None) or ExplicitVRLittleEndian)
    if syntax.is_compressed:
        try:
            available = get_decoder(syntax).is_available
        except NotImplementedError:
            available = False
        if not available:
            raise DicomCompressionError(
                f"{path}: DICOM transfer syntax {syntax.name} ({syntax}) is compressed and no installed "
                f"decoder reads it; {_DICOM_CONVERT_ADVICE}"
            )
    frames = int(dataset.get("NumberOfFrames", 1) or 1)
    if frames != 1:
        raise DicomError(f"{path}: a multi-frame DICOM ({frames} frames); export each X-ray as one image")
    try:
        pixels = np.asarray(dataset.pixel_array)
    except Exception as exc:  # pydicom raises many kinds on broken pixel data; name the file and why
        raise DicomError(
            f"{path}: DICOM pixel data cannot be decoded ({syntax.name}; {exc.__class__.__name__}: {exc}); "
            "the file may be truncated: export it again from the PACS"
        ) from None
    if pixels.ndim != 2:
        raise DicomError(
            f"{path}: DICOM pixel data of shape {pixels.shape}, expected one 2-D grayscale image"
        )
    return pixels


def _stored_range(dataset: Any) -> tuple[float, float]:
    bits = int(dataset.BitsStored)
    if int(dataset.get("PixelRepresentation", 0)) == 0:
        return 0.0, float(2**bits - 1)
    return float(-(2 ** (bits - 1))), float(2 ** (bits - 1) - 1)


def _lut_range(sequence: Any) -> tuple[float, float]:
    descriptor = sequence[0].LUTDescriptor
    return 0.0, float(2 ** int(descriptor[2]) - 1)


def _window(values: np.ndarray, dataset: Any, path: Path) -> np.ndarray:
    """Window Center/Width (the first pair) onto 0…1, PS3.3 C.11.2.1.2 (LINEAR, LINEAR_EXACT, SIGMOID)."""

    def first(name: str) -> float:
        element = dataset[name]
        value = element.value[0] if element.VM > 1 else element.value
        return float(value)

    center, width = first("WindowCenter"), first("WindowWidth")
    function = str(dataset.get("VOILUTFunction", "LINEAR") or "LINEAR").upper()
    if function == "SIGMOID":
        if width <= 0:
            raise DicomError(f"{path}: Window Width {width} must be positive for a SIGMOID VOI LUT Function")
        return 1.0 / (1.0 + np.exp(-4.0 * (values - center) / width))
    if function == "LINEAR_EXACT":
        if width <= 0:
            raise DicomError(f"{path}: Window Width {width} must be positive")
        return (values - center) / width + 0.5
    if function != "LINEAR":
        raise DicomError(f"{path}: unknown VOI LUT Function {function!r} (LINEAR, LINEAR_EXACT or SIGMOID)")
    if width < 1:
        raise DicomError(f"{path}: Window Width {width} must be at least 1 for a LINEAR window")
    return (values - (center - 0.5)) / (width - 1) + 0.5


def dicom_grayscale(data: bytes, path: Path | str = "<bytes>") -> np.ndarray:
    """A DICOM file's bytes -> its display image, uint8 MONOCHROME2; see the module docstring."""
    from pydicom.pixels import apply_modality_lut, apply_voi

    path = Path(path)
    dataset = _read_dicom(data, path)
    photometric = str(dataset.get("PhotometricInterpretation", "")).strip()
    if photometric not in ("MONOCHROME1", "MONOCHROME2"):
        raise DicomError(
            f"{path}: DICOM Photometric Interpretation {photometric or 'absent'!r}; an X-ray is "
            "MONOCHROME1 or MONOCHROME2 (convert colour images to grayscale first)"
        )
    try:
        stored = _stored_pixels(dataset, path)
        modality = np.asarray(apply_modality_lut(stored, dataset))  # integers when there is no rescale
        values = modality.astype(np.float64)
        if dataset.get("ModalityLUTSequence"):
            low, high = _lut_range(dataset.ModalityLUTSequence)
        else:
            low, high = _stored_range(dataset)
            slope = float(dataset.get("RescaleSlope", 1) or 1)
            intercept = float(dataset.get("RescaleIntercept", 0) or 0)
            low, high = sorted((low * slope + intercept, high * slope + intercept))
        if dataset.get("VOILUTSequence"):
            lut_low, lut_high = _lut_range(dataset.VOILUTSequence)
            unit = (np.asarray(apply_voi(modality, dataset), dtype=np.float64) - lut_low) / (
                lut_high - lut_low
            )
        elif "WindowCenter" in dataset and "WindowWidth" in dataset:
            unit = _window(values, dataset, path)
        else:
            unit = (values - low) / (high - low) if high > low else np.zeros_like(values)
    except DicomError:
        raise
    except (AttributeError, KeyError, ValueError, TypeError, IndexError) as exc:
        raise DicomError(
            f"{path}: DICOM image attributes are missing or inconsistent ({exc.__class__.__name__}: {exc})"
        ) from None
    gray = np.round(np.clip(unit, 0.0, 1.0) * 255.0).astype(np.uint8)
    return 255 - gray if photometric == "MONOCHROME1" else gray


class ImageDataset(Dataset[LoadedImage]):
    """Image files -> preprocessed tensors; unreadable files become a marker instead of an exception."""

    def __init__(
        self,
        paths: Sequence[Path],
        transform: Callable[[Image.Image], torch.Tensor],
        sha256: Sequence[str | None] | None = None,
    ) -> None:
        self.paths = list(paths)
        self.transform = transform
        if sha256 is not None and len(sha256) != len(self.paths):
            raise ValueError(f"{len(sha256)} digests for {len(self.paths)} images")
        self.sha256 = list(sha256) if sha256 is not None else None

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> LoadedImage:
        path = Path(self.paths[index])
        try:
            data = path.read_bytes()
        except _UNREADABLE_IMAGE_ERRORS as error:
            return LoadedImage(index, None, f"{path}: {error.__class__.__name__}: {error}")
        if self.sha256 is not None and hashlib.sha256(data).hexdigest() != self.sha256[index]:
            raise ImageChangedError(
                f"{path}: changed since it was hashed (or was unreadable then): is something writing to the "
                "images during the extraction? Let it finish, then run the command again"
            )
        try:
            image = _decode(data, path)
            return LoadedImage(index, self.transform(image), None, pixel_sha256(image))
        except DicomError as error:  # its message already names the file
            return LoadedImage(index, None, f"{error.__class__.__name__}: {error}")
        except _UNREADABLE_IMAGE_ERRORS as error:
            return LoadedImage(index, None, f"{path}: {error.__class__.__name__}: {error}")


def collate_images(batch: Sequence[LoadedImage]) -> ImageBatch:
    """Stacks the readable images of a batch and lists the unreadable ones."""
    readable = [item for item in batch if item.pixels is not None]
    skipped = [(item.index, item.error or "unreadable") for item in batch if item.pixels is None]
    pixels = torch.stack([item.pixels for item in readable]) if readable else None
    digests = [item.pixel_sha256 for item in readable]
    return ImageBatch([item.index for item in readable], pixels, skipped, digests)
