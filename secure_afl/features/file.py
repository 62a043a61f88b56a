"""The feature file: what a hospital's SuperNode reads, and what ``secure-afl predict`` can score.

A NumPy ``.npz`` archive (a zip of ``.npy`` arrays), always read with ``allow_pickle=False``: no
object arrays, nothing executable.  Arrays:

=================  =============================  ==================================================
name               dtype / shape                  meaning
=================  =============================  ==================================================
``format``         str scalar                     ``"secure-afl-features/v1"``
``features``       float32 or float64, N × d      one row per image, from the frozen backbone
``image_ids``      str, N                         one id per row (file name), used in predict's CSV
``labels``         uint8, N × C (or 0 × C)        multi-hot labels; all-zero columns for classes the
                                                  institution does not label; absent rows (0 × C)
                                                  for a file meant only for prediction
``classes``        str, C                         class names, in column order
``active``         int64, k                       indices of the classes this institution labels
``backbone``       str scalar                     backbone name (``densenet121-xrv``, ``resnet18``...)
``weights_id``     str scalar                     ``sha256:<hex>`` of the weight file (or another id)
``preprocessing``  str scalar                     the backbone's preprocessing description (JSON)
``patient_ids``    str, N (optional)              one patient id per row; needed only by a study that
                                                  protects patients (``dp-unit = "patient"``), which
                                                  caps each patient's images before the statistics
``image_sha256``   str, N (optional)              SHA-256 of each row's image file (64 lowercase hex
                                                  digits): one of the names the ledger counts releases
                                                  by (one release per image). Files written before
                                                  digests were recorded lack the array: they still
                                                  load, and :meth:`FeatureFile.require_image_digests`
                                                  refuses them where digests are needed
``pixel_sha256``   str, N (optional)              SHA-256 of each row's decoded 8-bit image (size and
                                                  pixels, :func:`secure_afl.features.images.pixel_sha256`):
                                                  the same X-ray re-exported losslessly (recompressed,
                                                  new DICOM UIDs or metadata) keeps it while its file
                                                  digest changes; written by ``features extract``.
                                                  A release needs it
                                                  (:meth:`FeatureFile.require_image_identities`)
``sop_instance_uid`` str, N (optional)            each row's DICOM SOP Instance UID, ``""`` for a row
                                                  without one (a PNG); written by ``features extract``
=================  =============================  ==================================================

Each row's image has up to three names (:func:`secure_afl.privacy.release.image_keys`): its file
digest, its pixel digest and its SOP Instance UID; two rows are one image when any name agrees.
Two rows of one image (or of one SOP Instance UID) may be written (``features extract`` keeps both,
and says so), but no release takes either: a node withholds both, naming them in its log
(:func:`secure_afl.privacy.release.select_rows`), and releases the file's other rows.

The backbone fields travel into the classifier file, and ``predict`` refuses features whose
backbone, weights or preprocessing differ from the model's.

A feature file is written with mode 0600 (the hospital's user only; the features are derived from
patients' images), through a temporary file created 0600 and renamed into place; the directories
:func:`make_private_dirs` creates for it are 0700.
"""

from __future__ import annotations

import os
import re
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FEATURE_FILE_FORMAT = "secure-afl-features/v1"
_NAMES = (
    "format",
    "features",
    "image_ids",
    "labels",
    "classes",
    "active",
    "backbone",
    "weights_id",
    "preprocessing",
)
_OPTIONAL_NAMES = ("patient_ids", "image_sha256", "pixel_sha256", "sop_instance_uid")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_DICOM_UID = re.compile(r"[0-9]+(\.[0-9]+)*")  # PS3.5 9.1: digits and dots, at most 64 characters
PRIVATE_FILE_MODE = 0o600  # feature files and cache files: the hospital's user only
PRIVATE_DIR_MODE = 0o700  # directories features/ creates for them
REEXTRACT_ADVICE = "re-extract with `secure-afl features extract`"


def make_private_dirs(directory: str | os.PathLike[str]) -> Path:
    """Creates ``directory`` and its missing parents with mode 0700 (existing ones are left as they are)."""
    directory = Path(directory)
    missing = []
    current = directory
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for created in reversed(missing):
        try:
            created.mkdir(mode=PRIVATE_DIR_MODE)
        except FileExistsError:
            continue  # made meanwhile by another process: its mode is its maker's
        os.chmod(created, PRIVATE_DIR_MODE)  # the umask can only have removed bits
    return directory


def describe_preprocessing(preprocess: object) -> str:
    """The canonical text of a backbone's preprocessing (``Backbone.preprocess``), as files store it."""
    import json

    as_dict = getattr(preprocess, "as_dict", None)
    return json.dumps(as_dict() if callable(as_dict) else str(preprocess), sort_keys=True, default=str)


class FeatureFileError(ValueError):
    """A feature file that is missing, malformed or inconsistent (the message says which field)."""


@dataclass(frozen=True)
class FeatureFile:
    features: np.ndarray
    image_ids: tuple[str, ...]
    labels: np.ndarray | None  # N × C uint8, or None for a prediction-only file
    classes: tuple[str, ...]
    active: tuple[int, ...]
    backbone: str
    weights_id: str
    preprocessing: str
    patient_ids: tuple[str, ...] | None = None
    image_sha256: tuple[str, ...] | None = None  # per row: SHA-256 of the image file's bytes
    pixel_sha256: tuple[str, ...] | None = None  # per row: SHA-256 of the decoded image
    sop_instance_uids: tuple[str, ...] | None = None  # per row: DICOM SOP Instance UID, "" if none
    path: Path | None = field(default=None, compare=False)  # where it was read from, for messages

    @property
    def dim(self) -> int:
        return int(self.features.shape[1])

    def require_image_digests(self) -> tuple[str, ...]:
        """The per-row image digests, or :class:`FeatureFileError` saying how to get a file that has them."""
        if self.image_sha256 is None:
            where = f"{self.path}: " if self.path is not None else ""
            raise FeatureFileError(
                f"{where}this feature file has no image digests (image_sha256: the SHA-256 of each row's "
                "image file, which counts each image's releases); it was written before they were "
                f"recorded: {REEXTRACT_ADVICE} (the feature cache makes that quick)"
            )
        return self.image_sha256

    def require_image_identities(self) -> tuple[tuple[bytes, ...], ...]:
        """Per row, its image's names (:func:`secure_afl.privacy.release.image_keys`: file digest
        first, then the pixel digest and the SOP Instance UID), what a release counts images by.

        Refuses (:class:`FeatureFileError`) a file without file or pixel digests, written before they
        were recorded: its images would be known by their file bytes only, which a lossless
        re-export changes.  Rows that repeat a name are returned as they are: which of them a
        release takes is :func:`~secure_afl.privacy.release.select_rows`' decision (none of them)."""
        from secure_afl.privacy.release import image_keys

        files = self.require_image_digests()
        where = f"{self.path}: " if self.path is not None else ""
        if self.pixel_sha256 is None:
            raise FeatureFileError(
                f"{where}this feature file has no pixel digests (pixel_sha256: the SHA-256 of each row's "
                "decoded image, which names an image across lossless re-exports, so that a re-encoded copy "
                f"of a released image is not released again); it was written before they were recorded: "
                f"{REEXTRACT_ADVICE} (the feature cache makes that quick)"
            )
        uids = self.sop_instance_uids or ("",) * len(files)
        return tuple(
            image_keys(file, pixels, uid)
            for file, pixels, uid in zip(files, self.pixel_sha256, uids, strict=True)
        )

    def describe_backbone(self) -> dict[str, str]:
        return {"name": self.backbone, "weights_id": self.weights_id, "preprocessing": self.preprocessing}


def save_feature_file(
    path: str | os.PathLike[str],
    features: np.ndarray,
    *,
    classes: Sequence[str],
    backbone: str,
    weights_id: str,
    preprocessing: str,
    labels: np.ndarray | None = None,
    active: Sequence[int] | Sequence[bool] | np.ndarray = (),
    image_ids: Sequence[str] | None = None,
    patient_ids: Sequence[str] | None = None,
    image_sha256: Sequence[str] | None = None,
    pixel_sha256: Sequence[str] | None = None,
    sop_instance_uids: Sequence[str] | None = None,
) -> None:
    """Write a feature file (checked as it would be read), mode 0600; a temporary file is renamed into place.

    ``active``: the labelled classes as indices, or a boolean mask with one entry per class
    (:func:`secure_afl.analytic.active_class_indices`); anything else raises :class:`FeatureFileError`.
    """
    from secure_afl.analytic import StatisticsError, active_class_indices  # torch: only when writing

    try:
        active_indices = active_class_indices(active, len(classes))
    except StatisticsError as exc:
        raise FeatureFileError(f"active: {exc}") from None
    features = np.asarray(features)
    n = features.shape[0] if features.ndim == 2 else 0
    ids = tuple(image_ids) if image_ids is not None else tuple(f"row-{i}" for i in range(n))
    label_array = (
        np.zeros((0, len(classes)), np.uint8) if labels is None else np.asarray(labels).astype(np.uint8)
    )
    arrays = {
        "format": np.array(FEATURE_FILE_FORMAT),
        "features": features,
        "image_ids": np.array(ids, dtype=str),
        "labels": label_array,
        "classes": np.array(tuple(classes), dtype=str),
        "active": np.array(active_indices, dtype=np.int64),
        "backbone": np.array(backbone),
        "weights_id": np.array(weights_id),
        "preprocessing": np.array(preprocessing),
    }
    if patient_ids is not None:
        arrays["patient_ids"] = np.array([str(p) for p in patient_ids], dtype=str)
    if image_sha256 is not None:
        arrays["image_sha256"] = np.array([str(d) for d in image_sha256], dtype=str)
    if pixel_sha256 is not None:
        arrays["pixel_sha256"] = np.array([str(d) for d in pixel_sha256], dtype=str)
    if sop_instance_uids is not None:
        arrays["sop_instance_uid"] = np.array([str(u) for u in sop_instance_uids], dtype="<U64")
    _validate(Path(path), arrays)
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp.npz")
    temporary.unlink(missing_ok=True)  # a leftover of a killed run
    try:
        # O_EXCL|0600: the features are never readable by others, not even before the rename
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
        with os.fdopen(descriptor, "wb") as handle:
            os.fchmod(handle.fileno(), PRIVATE_FILE_MODE)
            np.savez(handle, **arrays)
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()


def load_feature_file(path: str | os.PathLike[str], *, require_labels: bool = False) -> FeatureFile:
    """Read and check a feature file (never unpickles; raises :class:`FeatureFileError`)."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files if name in _NAMES + _OPTIONAL_NAMES}
    except FileNotFoundError:
        raise FeatureFileError(f"{path}: no such feature file") from None
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        # numpy's own message for a non-npz file suggests allow_pickle=True, which must never be
        # followed for a file from elsewhere: say what the file should be instead
        detail = str(exc)
        if "Object arrays" in detail:
            detail = "it holds an object array, i.e. a pickle, which is never loaded"
        elif "allow_pickle" in detail:
            detail = "not a NumPy .npz archive"
        raise FeatureFileError(
            f"{path}: not a {FEATURE_FILE_FORMAT} file ({detail}); make one with `secure-afl features "
            "extract` and check it with `secure-afl features show`"
        ) from None
    file = _validate(path, arrays)
    if require_labels and file.labels is None:
        raise FeatureFileError(f"{path}: has no labels; a federation member's feature file needs them")
    return file


def _validate(path: Path, arrays: dict[str, np.ndarray]) -> FeatureFile:
    missing = [name for name in _NAMES if name not in arrays]
    if missing:
        raise FeatureFileError(f"{path}: lacks the arrays {missing} of a {FEATURE_FILE_FORMAT} file")

    def text(name: str) -> str:
        value = arrays[name]
        if value.shape != () or value.dtype.kind != "U":
            raise FeatureFileError(f"{path}: {name!r} must be a string")
        return str(value)

    if text("format") != FEATURE_FILE_FORMAT:
        raise FeatureFileError(f"{path}: format {text('format')!r}, expected {FEATURE_FILE_FORMAT!r}")
    features = arrays["features"]
    if features.ndim != 2 or features.shape[0] < 1 or features.shape[1] < 1:
        raise FeatureFileError(f"{path}: 'features' must be a non-empty N × d array, got {features.shape}")
    if features.dtype not in (np.float32, np.float64):
        raise FeatureFileError(f"{path}: 'features' must be float32 or float64, got {features.dtype}")
    if not np.isfinite(features).all():
        raise FeatureFileError(f"{path}: 'features' holds NaN or infinite values (dropped images?)")
    n = features.shape[0]
    classes = arrays["classes"]
    if (
        classes.ndim != 1
        or classes.dtype.kind != "U"
        or len(classes) < 1
        or len(set(classes.tolist())) != len(classes)
    ):
        raise FeatureFileError(f"{path}: 'classes' must be distinct class names")
    ids = arrays["image_ids"]
    if ids.shape != (n,) or ids.dtype.kind != "U":
        raise FeatureFileError(f"{path}: 'image_ids' must hold one string per feature row ({n})")
    labels = arrays["labels"]
    if labels.ndim != 2 or labels.shape[1] != len(classes) or labels.shape[0] not in (0, n):
        raise FeatureFileError(
            f"{path}: 'labels' must be N × C ({n} × {len(classes)}) or empty, got {labels.shape}"
        )
    if labels.dtype.kind not in "uib" or not np.isin(labels, (0, 1)).all():
        raise FeatureFileError(f"{path}: 'labels' must be 0/1")
    active = arrays["active"]
    if active.ndim != 1 or active.dtype.kind not in "iu":
        raise FeatureFileError(f"{path}: 'active' must be a list of class indices")
    active_list = sorted({int(c) for c in active})
    if any(not 0 <= c < len(classes) for c in active_list):
        raise FeatureFileError(f"{path}: 'active' holds indices outside 0..{len(classes) - 1}")
    if labels.shape[0] and not active_list:
        raise FeatureFileError(f"{path}: 'active' is empty: which classes does this institution label?")
    patients = arrays.get("patient_ids")
    if patients is not None and (patients.shape != (n,) or patients.dtype.kind != "U"):
        raise FeatureFileError(f"{path}: 'patient_ids' must hold one string per feature row ({n})")
    digests = _digests(path, arrays, "image_sha256", n)
    pixel_digests = _digests(path, arrays, "pixel_sha256", n)
    uids = _sop_instance_uids(path, arrays, n)
    return FeatureFile(
        features=features,
        image_ids=tuple(ids.tolist()),
        labels=labels.astype(np.uint8) if labels.shape[0] else None,
        classes=tuple(classes.tolist()),
        active=tuple(active_list),
        backbone=text("backbone"),
        weights_id=text("weights_id"),
        preprocessing=text("preprocessing"),
        patient_ids=tuple(patients.tolist()) if patients is not None else None,
        image_sha256=digests,
        pixel_sha256=pixel_digests,
        sop_instance_uids=uids,
        path=path,
    )


def _digests(path: Path, arrays: dict[str, np.ndarray], name: str, n: int) -> tuple[str, ...] | None:
    """An optional per-row array of SHA-256 digests (64 lowercase hex digits each)."""
    value = arrays.get(name)
    if value is None:
        return None
    if value.shape != (n,) or value.dtype.kind != "U":
        raise FeatureFileError(f"{path}: {name!r} must hold one digest per feature row ({n})")
    listed = tuple(str(d) for d in value.tolist())
    bad = next((i for i, d in enumerate(listed) if not _SHA256_HEX.fullmatch(d)), None)
    if bad is not None:
        raise FeatureFileError(
            f"{path}: {name!r} row {bad} is {listed[bad]!r}, not a SHA-256 digest (64 lowercase hex "
            f"digits); {REEXTRACT_ADVICE}"
        )
    return listed


def _sop_instance_uids(path: Path, arrays: dict[str, np.ndarray], n: int) -> tuple[str, ...] | None:
    """The optional per-row SOP Instance UIDs ("" for a row without one)."""
    value = arrays.get("sop_instance_uid")
    if value is None:
        return None
    if value.shape != (n,) or value.dtype.kind != "U":
        raise FeatureFileError(f"{path}: 'sop_instance_uid' must hold one string per feature row ({n})")
    listed = tuple(str(u) for u in value.tolist())
    bad = next(
        (i for i, u in enumerate(listed) if u and not (len(u) <= 64 and _DICOM_UID.fullmatch(u))), None
    )
    if bad is not None:
        raise FeatureFileError(
            f"{path}: 'sop_instance_uid' row {bad} is {listed[bad]!r}, not a DICOM UID (digits and dots, at "
            f"most 64 characters) or empty; {REEXTRACT_ADVICE}"
        )
    return listed
