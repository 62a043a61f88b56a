"""A feature file from extracted features: the rows that could be read, their labels and every
name of their images, written atomically, with what a hospital should know about them.

:func:`write_extracted` takes what ``features extract`` gathered (an :class:`ExtractionInput`:
the images, their labels and patient ids) and the extraction's result
(:func:`secure_afl.features.extraction.extract_features`), and writes the feature file of
:mod:`secure_afl.features.file`.  It raises :class:`FeatureBuildError` (nothing written) when no
image could be read, when a DICOM changed since its pixels were read, or when the file cannot be
written; otherwise it returns the written file and the notes the command prints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .file import (
    FeatureFile,
    FeatureFileError,
    describe_preprocessing,
    load_feature_file,
    make_private_dirs,
    save_feature_file,
)
from .images import DicomError, sop_instance_uid

__all__ = ["ExtractionInput", "FeatureBuildError", "write_extracted"]


class FeatureBuildError(ValueError):
    """No feature file could be written; the message says why and that nothing was written."""


@dataclass
class ExtractionInput:
    """The images to extract and what the feature file records beside their features."""

    paths: list[Path]
    image_ids: list[str]
    classes: tuple[str, ...]
    labels: np.ndarray | None  # N × C uint8 over classes
    labelled: tuple[str, ...]  # classes with labels in the source
    patient_ids: list[str] | None
    source: str
    notes: list[str] = field(default_factory=list)


def write_extracted(
    data: ExtractionInput,
    model: Any,  # features.backbones.Backbone
    result: Any,  # features.extraction.ExtractionResult
    out_path: Path,
    active: Sequence[int],
    write_patients: bool,
) -> tuple[FeatureFile, list[str]]:
    """Write ``out_path`` from the readable rows of ``result``; returns the file as written and the
    notes for the hospital (the source's notes, repeated images, classes left unlabelled, the
    cache's work). The unreadable images are the caller's to report (``result.unreadable_error``)."""
    notes: list[str] = []
    keep = np.setdiff1d(np.arange(len(data.paths)), np.asarray(result.skipped, dtype=np.int64))
    if len(keep) == 0:
        raise FeatureBuildError(str(result.unreadable_error(out_path)))
    labels = None
    if data.labels is not None:
        labels = data.labels[keep].copy()
        labels[:, [c for c in range(len(data.classes)) if c not in active]] = 0
    make_private_dirs(out_path.parent)
    digests = [result.image_sha256[i] for i in keep]
    assert all(d is not None for d in digests)  # a file unreadable when hashed was skipped
    pixels = [result.pixel_sha256[i] for i in keep]
    try:
        uids = [sop_instance_uid(data.paths[i]) for i in keep]  # DICOM: a third name of the image
    except (DicomError, OSError) as exc:  # changed or removed since its pixels were read
        raise FeatureBuildError(f"{type(exc).__name__}: {exc}; nothing was written to {out_path}") from None
    try:
        save_feature_file(
            out_path,
            result.features[keep],
            classes=data.classes,
            backbone=model.name,
            weights_id=model.weights_id,
            preprocessing=describe_preprocessing(model.preprocess),
            labels=labels,
            active=active,
            image_ids=[data.image_ids[i] for i in keep],
            patient_ids=[data.patient_ids[i] for i in keep] if write_patients else None,  # type: ignore[index]
            image_sha256=digests,  # type: ignore[arg-type]
            pixel_sha256=pixels,  # type: ignore[arg-type]
            sop_instance_uids=uids if any(uids) else None,
        )
        written = load_feature_file(out_path)
    except FeatureFileError as exc:
        raise FeatureBuildError(f"FeatureFileError: {exc}") from None

    for note in data.notes:
        notes.append(f"note: {note}")
    repeated = len(digests) - len(set(digests))
    if repeated:
        notes.append(
            f"note: {repeated} images have the same bytes as another image read here (the same SHA-256); "
            "their rows are kept, and a ledger counts each such image once"
        )
    same_pixels = len(pixels) - len(set(pixels)) - repeated
    if same_pixels > 0:
        notes.append(
            f"note: {same_pixels} further images decode to the same pixels as another image read here "
            "(the same X-ray exported twice?); their rows are kept"
        )
    from secure_afl.privacy.release import select_rows

    for line in select_rows(written.require_image_identities(), {}).log_lines(
        written.image_ids, written.sop_instance_uids
    ):  # one image (or one UID) in two rows: written, but every node withholds those rows
        notes.append(f"note: a federation node releases this file's other rows only: {line}")
    unlabelled_sources = [c for c in data.labelled if data.classes.index(c) not in active]
    if unlabelled_sources:
        notes.append(f"note: labels of {', '.join(unlabelled_sources)} were not recorded (not in --active)")
    notes.append(
        f"features: {result.forward_passes} forward passes on {result.device}; cache shards "
        f"{result.shards_computed} computed, {result.shards_reused} reused ({result.cache_path})"
    )
    return written, notes
