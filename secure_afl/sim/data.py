"""The ChestXray14 cohort of the paper: PA rows, the 8 classes, the 70/30 split and 8 IID clients.

One code path for the embedded default data and the real images: both start from the label table
(``Data_Entry_2017_v2020.csv``, bundled inside torchxrayvision) and differ only in where the
features come from.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd

CLASSES: tuple[str, ...] = (
    "Atelectasis",
    "Cardiomegaly",
    "Effusion",
    "Infiltration",
    "Mass",
    "Nodule",
    "Pneumonia",
    "Pneumothorax",
)
REQUIRED_COLUMNS = ("Image Index", "Finding Labels", "Patient ID", "View Position")
BUNDLED_CSV = "Data_Entry_2017_v2020.csv.gz"
N_CLIENTS = 8  # the paper's IID clients

SplitBy = Literal["image", "patient"]


class CohortError(ValueError):
    """The label table is missing, malformed, or cannot give the requested split."""


@dataclass(frozen=True)
class Cohort:
    """Image names, patient ids and the multi-hot labels (rows × 8 classes) of the PA images."""

    image_names: np.ndarray
    patient_ids: np.ndarray
    labels: np.ndarray
    source: str

    def __len__(self) -> int:
        return len(self.image_names)

    def subset(self, rows: np.ndarray) -> Cohort:
        return Cohort(self.image_names[rows], self.patient_ids[rows], self.labels[rows], self.source)


def bundled_csv_path() -> Path:
    """The label table shipped inside the installed torchxrayvision package (never copied here).

    Located with ``find_spec``, without importing torchxrayvision (whose import costs seconds).
    """
    spec = importlib.util.find_spec("torchxrayvision")
    if spec is None or not spec.submodule_search_locations:  # pragma: no cover - a project dependency
        raise CohortError("torchxrayvision is not installed; it ships the ChestXray14 label table")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / BUNDLED_CSV
    if not path.is_file():
        raise CohortError(
            f"{path} is missing from the installed torchxrayvision; reinstall it or pass --csv "
            f"pointing at {BUNDLED_CSV} from the NIH ChestXray14 release"
        )
    return path


def load_cohort(csv_path: Path | None = None, *, view: str = "PA") -> Cohort:
    """Read the label table, keep ``view`` rows, and encode the 8 classes as a 0/1 matrix."""
    path = Path(csv_path) if csv_path is not None else bundled_csv_path()
    if not path.is_file():
        raise CohortError(f"label table {path} does not exist")
    try:
        table = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, EOFError, OSError) as exc:
        raise CohortError(f"cannot parse {path} as a CSV: {exc}") from exc
    missing = [c for c in REQUIRED_COLUMNS if c not in table.columns]
    if missing:
        raise CohortError(
            f"{path} lacks the columns {missing}; expected the header of ChestXray14's "
            f"Data_Entry_2017_v2020.csv ({', '.join(REQUIRED_COLUMNS)}, ...)"
        )
    rows = table[table["View Position"] == view]
    if rows.empty:
        raise CohortError(f"{path} has no rows with View Position == {view!r}")
    if rows["Image Index"].duplicated().any():
        dup = rows["Image Index"][rows["Image Index"].duplicated()].iloc[0]
        raise CohortError(f"{path} lists image {dup!r} more than once")
    labels = _multi_hot(rows["Finding Labels"].fillna("").astype(str).to_numpy())
    try:
        patients = rows["Patient ID"].astype(np.int64).to_numpy()
    except (TypeError, ValueError) as exc:
        raise CohortError(f"{path}: 'Patient ID' must be integers ({exc})") from exc
    return Cohort(
        image_names=rows["Image Index"].astype(str).to_numpy(),
        patient_ids=patients,
        labels=labels,
        source=str(path),
    )


def _multi_hot(findings: np.ndarray) -> np.ndarray:
    """``"Mass|Nodule"`` → 0/1 row over CLASSES (other findings ignored); a plain loop is 10× faster
    than pandas' ``str.get_dummies`` on the 112k-row table."""
    column = {name: c for c, name in enumerate(CLASSES)}
    labels = np.zeros((len(findings), len(CLASSES)), dtype=np.int8)
    for row, text in enumerate(findings):
        for name in text.split("|"):
            c = column.get(name)
            if c is not None:
                labels[row, c] = 1
    return labels


def _image_wise_split(n_rows: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Exactly scikit-learn's ``train_test_split(arange(n), test_size=f, random_state=seed)``
    (a ``RandomState(seed)`` permutation, the first ``ceil(f·n)`` rows for the test set), without
    importing scikit-learn (seconds of start-up)."""
    n_test = math.ceil(test_fraction * n_rows)
    permutation = np.random.RandomState(seed).permutation(n_rows)
    return permutation[n_test:], permutation[:n_test]


@dataclass(frozen=True)
class Split:
    """Row indices into the cohort: the training rows of each client, and the held-out test rows."""

    clients: tuple[np.ndarray, ...]
    test: np.ndarray
    unused: np.ndarray  # training rows left over so that clients have equal sizes


def split_cohort(
    cohort: Cohort,
    *,
    n_clients: int = N_CLIENTS,
    test_fraction: float = 0.3,
    by: SplitBy = "image",
    seed: int = 0,
) -> Split:
    """70/30 split (image-wise as FedMLP, or patient-wise), then IID clients of equal size."""
    if not 0 < test_fraction < 1:
        raise CohortError(f"test_fraction must lie strictly between 0 and 1, got {test_fraction}")
    if n_clients < 1:
        raise CohortError(f"n_clients must be at least 1, got {n_clients}")
    rows = np.arange(len(cohort))
    if len(rows) < 2 * n_clients:
        raise CohortError(
            f"{len(rows)} rows cannot give a test set and {n_clients} clients; use a larger --fraction"
        )
    if by == "image":
        train, test = _image_wise_split(len(rows), test_fraction, seed)
    elif by == "patient":
        from sklearn.model_selection import GroupShuffleSplit

        splitter = GroupShuffleSplit(n_splits=1, test_size=test_fraction, random_state=seed)
        train, test = next(splitter.split(rows, groups=cohort.patient_ids))
    else:
        raise CohortError(f"split must be 'image' or 'patient', got {by!r}")
    per_client = len(train) // n_clients
    if per_client == 0:
        raise CohortError(f"{len(train)} training rows cannot fill {n_clients} clients")
    shuffled = np.random.default_rng(seed).permutation(train)
    clients = tuple(np.sort(shuffled[i * per_client : (i + 1) * per_client]) for i in range(n_clients))
    return Split(clients=clients, test=np.sort(test), unused=np.sort(shuffled[n_clients * per_client :]))
