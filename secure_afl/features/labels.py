"""A hospital's labels CSV, checked against its images folder and the study's class list.

The format (``features extract --help`` shows it to users)::

    image,Atelectasis,Effusion,patient
    scans/0001.png,1,0,P-17

:func:`read_labels_csv` reads and checks it before anything is computed; a malformed CSV raises
:class:`LabelsCsvError`, whose message says what is wrong, where, and how to fix it.
"""

from __future__ import annotations

import csv
import difflib
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "IMAGE_COLUMN",
    "IMAGE_SUFFIXES",
    "PATIENT_COLUMN",
    "LabelTable",
    "LabelsCsvError",
    "file_digest",
    "read_labels_csv",
]

IMAGE_COLUMN = "image"
PATIENT_COLUMN = "patient"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".dcm", ".dicom")  # what --images DIR without --labels reads

_SHOWN = 5  # how many offending names an error message lists


class LabelsCsvError(ValueError):
    """A labels CSV that cannot be used; the message says what is wrong, where, and how to fix it."""


@dataclass(frozen=True)
class LabelTable:
    """What a labels CSV says, checked against the images folder and the class list."""

    image_ids: tuple[str, ...]  # the ``image`` cells, in file order
    paths: tuple[Path, ...]  # the images, under the images folder
    labelled: tuple[str, ...]  # the class columns present, in the class list's order
    labels: np.ndarray | None  # N × C uint8 over the whole class list; None without class columns
    patient_ids: tuple[str, ...] | None  # the ``patient`` column, when there is one


def file_digest(path: Path) -> str:
    """``sha256:<hex>`` of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


def _shown(names: Sequence[str]) -> str:
    listed = ", ".join(repr(n) for n in names[:_SHOWN])
    return listed + (f", ... ({len(names)} in all)" if len(names) > _SHOWN else "")


def _unknown_class(path: Path, column: str, classes: Sequence[str]) -> LabelsCsvError:
    close = difflib.get_close_matches(column, classes, n=1) or [
        c for c in classes if c.lower() == column.lower()
    ]
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return LabelsCsvError(
        f"{path}: column {column!r} is not a class{hint}. The classes are {', '.join(classes)}; a labels "
        f"CSV holds only the column {IMAGE_COLUMN!r}, optionally {PATIENT_COLUMN!r}, and one column per "
        "class this hospital labels, named exactly as the class. Rename or remove the column, or pass "
        "--classes with the study's class list."
    )


def read_labels_csv(path: Path, images_dir: Path, classes: Sequence[str]) -> LabelTable:
    """Reads and checks a labels CSV (the format is in ``features extract --help``).

    Raises :class:`LabelsCsvError` on a missing ``image`` column, a duplicate or unknown column,
    a cell other than 0 or 1, an empty cell, a row of the wrong length, an image listed twice, an
    image name outside ``images_dir``, or images listed but absent.
    """
    path, images_dir = Path(path), Path(images_dir)
    try:
        with open(path, encoding="utf-8-sig", newline="") as handle:
            rows = list(csv.reader(handle))
    except FileNotFoundError:
        raise LabelsCsvError(f"{path}: no such labels CSV") from None
    except UnicodeDecodeError as exc:
        raise LabelsCsvError(f"{path}: not UTF-8 text ({exc}); save the CSV as UTF-8") from None
    except csv.Error as exc:
        raise LabelsCsvError(f"{path}: not a readable CSV ({exc})") from None
    except OSError as exc:
        raise LabelsCsvError(f"{path}: cannot read the labels CSV: {exc.strerror}") from None
    numbered = [(line, row) for line, row in enumerate(rows, start=1) if any(cell.strip() for cell in row)]
    if not numbered:
        raise LabelsCsvError(
            f"{path}: empty; the first line must be the header, e.g. {IMAGE_COLUMN},{','.join(classes[:2])}"
        )
    header = [cell.strip() for cell in numbered[0][1]]
    body = numbered[1:]
    seen: set[str] = set()
    for column in header:
        if not column:
            raise LabelsCsvError(f"{path}: the header has an empty column name; name every column")
        if column in seen:
            raise LabelsCsvError(f"{path}: the header names column {column!r} twice; keep one")
        seen.add(column)
    if IMAGE_COLUMN not in header:
        raise LabelsCsvError(
            f"{path}: no {IMAGE_COLUMN!r} column (the header is {', '.join(header)}). The first line must "
            f"name the image column {IMAGE_COLUMN!r} (file names relative to {images_dir}), then one column "
            f"per labelled class, e.g. {IMAGE_COLUMN},{','.join(classes[:2])}"
        )
    class_columns = [c for c in header if c not in (IMAGE_COLUMN, PATIENT_COLUMN)]
    for column in class_columns:
        if column not in classes:
            raise _unknown_class(path, column, classes)
    if not body:
        raise LabelsCsvError(f"{path}: a header but no image rows; list one image per line")
    where = {column: i for i, column in enumerate(header)}
    labelled = tuple(c for c in classes if c in class_columns)
    root = images_dir.resolve()
    labels = np.zeros((len(body), len(classes)), dtype=np.uint8)
    ids: list[str] = []
    paths: list[Path] = []
    patients: list[str] = []
    first_line: dict[str, int] = {}
    for row_index, (line, row) in enumerate(body):
        if len(row) != len(header):
            raise LabelsCsvError(
                f"{path}, line {line}: {len(row)} fields, but the header has {len(header)} "
                f"({', '.join(header)}); give every row one value per column"
            )
        image = row[where[IMAGE_COLUMN]].strip()
        if not image:
            raise LabelsCsvError(f"{path}, line {line}: empty {IMAGE_COLUMN!r} cell; name the image file")
        if image in first_line:
            raise LabelsCsvError(
                f"{path}, line {line}: image {image!r} is listed twice (also on line {first_line[image]}); "
                "list each image once, with all its labels on that line"
            )
        first_line[image] = line
        image_path = images_dir / image
        if Path(image).is_absolute() or not image_path.resolve().is_relative_to(root):
            raise LabelsCsvError(
                f"{path}, line {line}: image {image!r} is not inside {images_dir}; give file names "
                "relative to the --images folder"
            )
        ids.append(image)
        paths.append(image_path)
        if PATIENT_COLUMN in where:
            patient = row[where[PATIENT_COLUMN]].strip()
            if not patient:
                raise LabelsCsvError(
                    f"{path}, line {line}: empty {PATIENT_COLUMN!r} cell for {image!r}; give every image "
                    f"its patient id, or remove the {PATIENT_COLUMN!r} column"
                )
            patients.append(patient)
        for class_name in labelled:
            value = row[where[class_name]].strip()
            if value not in ("0", "1"):
                raise LabelsCsvError(
                    f"{path}, line {line}: {class_name} = {value!r} for {image!r}; class cells must be 0 "
                    "(negative) or 1 (positive): no blanks, no other values. A class this hospital does "
                    "not label has no column at all."
                )
            labels[row_index, classes.index(class_name)] = int(value)
    absent = [image for image, image_path in zip(ids, paths, strict=True) if not image_path.is_file()]
    if absent:
        raise LabelsCsvError(
            f"{path}: {len(absent)} of the {len(ids)} listed images are not in {images_dir}: "
            f"{_shown(absent)}. Copy them there, fix their names, or remove their lines."
        )
    return LabelTable(
        image_ids=tuple(ids),
        paths=tuple(paths),
        labelled=labelled,
        labels=labels if labelled else None,
        patient_ids=tuple(patients) if PATIENT_COLUMN in where else None,
    )
