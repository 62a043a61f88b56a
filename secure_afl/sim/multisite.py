"""``secure-afl sim --scenario multisite``: a federation of real collections, each labelling its own classes.

**Sites.**  Seven public chest X-ray collections whose label tables ship inside torchxrayvision
(read through its dataset classes, never downloaded; :data:`SITES`): NIH ChestX-ray14, CheXpert,
PadChest, VinDr-CXR, RSNA Pneumonia, SIIM-ACR Pneumothorax and Google's relabels of NIH images.
Each site is one client.  Its rows, patients and label set are its table's, with torchxrayvision's
default views (PA where the table records a view) and every image of a patient
(``unique_patients=False``).

**Classes.**  A common list of pathologies in torchxrayvision's names, aligned by
``xrv.datasets.relabel_dataset``: the paper's 8 by default, all 18 of ``default_pathologies`` that
some site labels with ``classes="all"``, or a list.  **A site labels a class iff its table does**
(the relabelled column is not all NaN): where it does not, the truth is unknown, and the site is
simply not in ``S_c`` (no Gram, no projection, no test row for that class).  Within a class a site
labels, a row whose entry is NaN (CheXpert's blank "not mentioned" and its uncertain −1, which
torchxrayvision maps to NaN) counts as negative, CheXpert's U-Zeros convention; how many such rows
each site has per class is recorded (``unlabelled_rows_counted_negative``).

**Images in two collections.**  Google's relabels are NIH images under the same names: each such
image is kept once, at the Google site (whose only rows they are), and removed from the NIH site
(``overlap_removed``).  The two sites share one patient namespace, so the split below keeps an NIH
patient's images on one side at both.  RSNA's and SIIM's images were also drawn from ChestX-ray14,
under new anonymous ids that the tables do not map back: that overlap cannot be seen in the
tables.  With real images it is removed by content: a row whose decoded pixels (the extraction's
``pixel_sha256``) equal an earlier row's is dropped (``duplicate_images_removed``).

**Split.**  Patient-wise, per site: every patient (``<namespace>:<id>``) draws one uniform number,
the first 8 bytes of ``SHA-256("<seed>:<0x5175>:<patient>")`` over 2⁶⁴ (a simulation split, nothing
secret), and goes to the test side when it is below 0.3: a patient's side depends on nothing else,
so it is the same at every site, fraction and subset of sites.  A patient's rows are never on both
sides, at any site.  VinDr and SIIM record no patient in their tables, so each image is its own
patient there; RSNA's ``patientId`` is one image.  ``fraction < 1`` keeps that random fraction of
each site's rows first.

**Features.**  Synthetic, from :mod:`secure_afl.sim.synthetic`'s seeded model (one model for every
site: the same class signatures; the unknown entries carry no signature, since the truth there is
unknown), plus a **site shift**: site ``s`` adds ``δ_s ~ N(0, site_shift² I_d)`` to every row's
pre-activation, drawn from a generator seeded with ``(seed, 0x517E)``, one site after another.
The default ``site_shift = 0.1`` equals a class signature's per-dimension shift, on every dimension
instead of a tenth of them: scanners and populations move every feature, more than one finding
does.  ``site_shift = 0`` turns it off.  With real images (``site_dirs``) the features are a
frozen backbone's, through :mod:`secure_afl.features` (cache, DICOM reader).

**Methods.**  The simulator's own stages, unchanged (:func:`secure_afl.sim.runner.run_setting`):
the sites' statistics, the masking protocol (``secure="mask"`` by default), AFL with 1 and 2
rounds and its variants, FedAvg with unknown labels as negatives and the ``baselines``.  The
gradient methods' batched engine trains clients of equal size: every site's training rows are
cycled, in a seeded order, to the largest site's count, so that each round every site takes one
epoch of the largest site's steps (the smaller sites revisit their rows), and the server averages
the sites with equal weights.

**Metrics.**  Per class over the test rows of the sites that label it; per site over its own test
rows and classes.

**Theorem 1.**  ``max_abs_w_vs_centralised``: AFL (1 round)'s W, from the securely aggregated
sums, against the per-class ridge fitted in one plaintext float64 pass over every training row of
the (surviving) sites that label the class, each row's target Eq. 9's balanced label of its own
site; ``max_abs_w_vs_centralised_global_balance``: AFL (global balance) against the same ridge with
the pooled rows' balanced labels (no site information at all).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
from rich.console import Console
from scipy.linalg import cho_factor, cho_solve
from threadpoolctl import threadpool_limits

from secure_afl.analytic import UndefinedBalanceWarning, balanced_labels, client_statistics
from secure_afl.sim.audit import trust_models
from secure_afl.sim.data import CLASSES, Cohort, Split
from secure_afl.sim.datasets import ImageSource, PreparedData, Progress, default_cache_dir
from secure_afl.sim.metrics import Metrics, evaluate
from secure_afl.sim.partial import LabelAssignment
from secure_afl.sim.runner import run_setting
from secure_afl.sim.setting import (
    AFL_1,
    AFL_2,
    AFL_GLOBAL_BALANCE,
    BASELINES,
    ExperimentError,
    PhaseTimer,
    SettingResult,
    SimConfig,
    client_id,
)
from secure_afl.sim.synthetic import synthetic_features
from secure_afl.torch_threads import one_torch_thread

TEST_FRACTION = 0.3
SPLIT_STREAM = 0x5175
SHIFT_STREAM = 0x517E
CYCLE_STREAM = 0x7113
DEFAULT_SITE_SHIFT = 0.1
EXACT_BAR = 1e-9  # max |W − W_centralised| under the exact protections (none, mask)


class MultisiteError(ExperimentError):
    """A multi-site configuration that cannot run (an unknown site or class, a missing directory, ...)."""


@dataclass(frozen=True)
class Site:
    """One collection: its torchxrayvision class, where its table keeps image and patient, and the
    layout of its images under the site's directory (torchxrayvision's)."""

    key: str
    name: str
    dataset: str  # the class in torchxrayvision.datasets
    image_column: str
    patient_column: str | None  # None: the table records no patient (each image its own)
    namespace: str  # patients of sites that share a namespace are the same people
    layout: str

    def image_path(self, directory: Path, image_id: str, index: Mapping[str, Path]) -> Path | None:
        """Where torchxrayvision's dataset class reads this image under ``directory`` (None: absent).
        ``index``: file name -> path of the files under it, for the layouts found by name."""
        if self.key in ("nih", "google"):  # torchxrayvision's flat folder, or the official archives
            flat = directory / image_id
            return flat if flat.is_file() else index.get(image_id)
        if self.key == "siim":
            return index.get(f"{image_id}.dcm")
        if self.key == "chexpert":
            relative = image_id.replace("CheXpert-v1.0-small/", "").replace("CheXpert-v1.0/", "")
            candidates = [directory / relative]
        elif self.key == "padchest":
            candidates = [directory / image_id]
        elif self.key == "vindr":
            candidates = [directory / f"{image_id}.dicom"]
        else:  # rsna: the Kaggle release's DICOMs, or torchxrayvision's default JPEG conversion
            candidates = [directory / f"{image_id}.dcm", directory / f"{image_id}.jpg"]
        return next((p for p in candidates if p.is_file()), None)

    def expected(self, directory: Path, image_id: str) -> str:
        """The path a missing image was looked for at (for the error message)."""
        return self.layout.replace("<dir>", str(directory)).replace("<id>", image_id)


SITES: tuple[Site, ...] = (
    Site(
        "nih",
        "NIH ChestX-ray14",
        "NIH_Dataset",
        "Image Index",
        "Patient ID",
        "nih",
        "<dir>/<id> (or the archives' <dir>/images_0NN/images/<id>)",
    ),
    Site(
        "chexpert",
        "CheXpert",
        "CheX_Dataset",
        "Path",
        "patientid",
        "chexpert",
        "<dir>/train/<id's patient/study/view>",
    ),
    Site("padchest", "PadChest", "PC_Dataset", "ImageID", "PatientID", "padchest", "<dir>/<id>"),
    Site("vindr", "VinDr-CXR", "VinDr_Dataset", "image_id", None, "vindr", "<dir>/<id>.dicom"),
    Site(
        "rsna",
        "RSNA Pneumonia",
        "RSNA_Pneumonia_Dataset",
        "patientId",
        "patientId",
        "rsna",
        "<dir>/<id>.dcm or .jpg",
    ),
    Site(
        "siim",
        "SIIM-ACR Pneumothorax",
        "SIIM_Pneumothorax_Dataset",
        "ImageId",
        None,
        "siim",
        "<dir>/**/<id>.dcm",
    ),
    Site(
        "google",
        "Google NIH relabels",
        "NIH_Google_Dataset",
        "Image Index",
        "Patient ID",
        "nih",
        "<dir>/<id> (NIH PNGs)",
    ),
)
SITE_KEYS = tuple(s.key for s in SITES)


def site_by_key(key: str) -> Site:
    for site in SITES:
        if site.key == key:
            return site
    raise MultisiteError(f"unknown site {key!r}: choose from {', '.join(SITE_KEYS)}")


def resolve_classes(classes: str | Sequence[str]) -> tuple[str, ...]:
    """``"paper"`` (the 8), ``"all"`` (torchxrayvision's 18 default pathologies; those no site labels
    are dropped later) or a list of names from them."""
    from torchxrayvision.datasets import default_pathologies

    if classes == "paper":
        return CLASSES
    if classes == "all":
        return tuple(default_pathologies)
    names = tuple(c.strip() for c in ([classes] if isinstance(classes, str) else classes) if c.strip())
    names = tuple(n for part in names for n in part.split(",") if n.strip())
    unknown = [n for n in names if n not in default_pathologies]
    if unknown or not names:
        raise MultisiteError(
            f"unknown classes {unknown or list(names)}: use 'paper', 'all' or names from torchxrayvision's "
            f"default_pathologies ({', '.join(default_pathologies)})"
        )
    if len(set(names)) != len(names):
        raise MultisiteError(f"classes listed twice in {list(names)}")
    return names


# ----------------------------------------------------------------------------------------------
# The label tables
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SiteTable:
    """Every site's rows: site index, image id, namespaced patient, labels (NaN: not labelled)."""

    sites: tuple[Site, ...]
    classes: tuple[str, ...]
    site: np.ndarray  # per row, index into sites
    image_ids: np.ndarray
    patients: np.ndarray  # "<namespace>:<id>"
    labels: np.ndarray  # rows × classes, float64, NaN where unknown
    labelled: np.ndarray  # sites × classes: the site's table labels the class
    overlap_removed: Mapping[str, int]  # site -> rows dropped because another site holds the image
    load_seconds: Mapping[str, float]
    directories: Mapping[str, Path] = field(default_factory=dict)  # real images: site -> directory

    def __len__(self) -> int:
        return len(self.site)

    def subset(self, rows: np.ndarray) -> SiteTable:
        return replace(
            self,
            site=self.site[rows],
            image_ids=self.image_ids[rows],
            patients=self.patients[rows],
            labels=self.labels[rows],
        )

    def known(self) -> np.ndarray:
        """Rows × classes: the row's site labels the class."""
        return self.labelled[self.site]

    def binary(self) -> np.ndarray:
        """0/1 labels (int8): NaN inside a labelled class counts negative; unlabelled classes are 0
        and never used (the site is not in S_c)."""
        return np.where(self.known() & (self.labels == 1), 1, 0).astype(np.int8)


def _read_site(
    site: Site, classes: Sequence[str], imgpath: Path
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(image ids, patient ids, labels with NaN) of one site's table, through torchxrayvision."""
    import inspect

    import torchxrayvision as xrv

    cls = getattr(xrv.datasets, site.dataset)
    kwargs: dict[str, object] = {"imgpath": str(imgpath)}
    if "unique_patients" in inspect.signature(cls).parameters:
        kwargs["unique_patients"] = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dataset = cls(**kwargs)
        xrv.datasets.relabel_dataset(list(classes), dataset, silent=True)
    table = dataset.csv
    images = table[site.image_column].astype(str).to_numpy()
    patients = images if site.patient_column is None else table[site.patient_column].astype(str).to_numpy()
    labels = np.asarray(dataset.labels, dtype=np.float64)
    if len(labels) != len(images):  # pragma: no cover - torchxrayvision keeps them aligned
        raise MultisiteError(f"{site.name}: {len(images)} rows but {len(labels)} label rows")
    bad = ~np.isnan(labels) & ~np.isin(labels, (0.0, 1.0))
    if bad.any():
        raise MultisiteError(f"{site.name}: labels other than 0, 1 or NaN ({np.unique(labels[bad])[:5]})")
    # SIIM's table has a row per pneumothorax region: one image, one row (its rows must agree).
    _, first, inverse = np.unique(images, return_index=True, return_inverse=True)
    if len(first) != len(images):
        coded = np.nan_to_num(labels, nan=-1.0)
        if not np.array_equal(coded, coded[first][inverse]):
            raise MultisiteError(f"{site.name}'s table gives one image different labels on different rows")
        keep = np.sort(first)
        images, patients, labels = images[keep], patients[keep], labels[keep]
    return images, patients, labels


def load_site_table(
    classes: Sequence[str],
    sites: Sequence[str] = SITE_KEYS,
    *,
    directories: Mapping[str, Path] | None = None,
) -> SiteTable:
    """Every named site's table, aligned on ``classes``; classes that no site labels are dropped.

    ``directories``: real images, the directory of each site (read by torchxrayvision as its
    ``imgpath``); without them the tables are read with an empty placeholder directory, since the
    dataset classes check that one exists but read no image when constructed."""
    chosen = tuple(site_by_key(k) for k in sites)
    if len(set(sites)) != len(sites):
        raise MultisiteError(f"sites listed twice in {list(sites)}")
    if len(chosen) < 2:
        raise MultisiteError(f"a federation needs at least 2 sites, got {list(sites)}")
    for key, directory in (directories or {}).items():
        if key not in sites:
            raise MultisiteError(f"a directory is given for site {key!r}, which is not in the run")
        if not Path(directory).is_dir():
            raise MultisiteError(f"the directory of site {key} does not exist: {directory}")
    seconds: dict[str, float] = {}
    parts = []
    with tempfile.TemporaryDirectory(prefix="secure-afl-multisite-") as placeholder:
        for site in chosen:
            started = time.perf_counter()
            imgpath = Path((directories or {}).get(site.key, placeholder))
            parts.append(_read_site(site, classes, imgpath))
            seconds[site.key] = time.perf_counter() - started
    images = [p[0] for p in parts]
    # Google's relabels are NIH images: each is kept once, at the Google site.
    removed = {site.key: 0 for site in chosen}
    keys = [s.key for s in chosen]
    if "nih" in keys and "google" in keys:
        nih, google = keys.index("nih"), keys.index("google")
        keep = ~np.isin(images[nih], images[google])
        removed["nih"] = int((~keep).sum())
        parts[nih] = tuple(a[keep] for a in parts[nih])  # type: ignore[assignment]
    for site, (ids, _, _) in zip(chosen, parts, strict=True):
        if len(np.unique(ids)) != len(ids):
            raise MultisiteError(f"{site.name}'s table lists an image more than once")
    labels = np.concatenate([p[2] for p in parts])
    site_index = np.concatenate([np.full(len(p[0]), k) for k, p in enumerate(parts)])
    labelled = np.array([~np.isnan(p[2]).all(axis=0) for p in parts])
    kept = np.flatnonzero(labelled.any(axis=0))
    if not len(kept):
        raise MultisiteError(f"no site labels any of {list(classes)}")
    patients = np.concatenate(
        [np.char.add(f"{site.namespace}:", p[1].astype(str)) for site, p in zip(chosen, parts, strict=True)]
    )
    return SiteTable(
        sites=chosen,
        classes=tuple(classes[c] for c in kept),
        site=site_index,
        image_ids=np.concatenate([p[0] for p in parts]).astype(str),
        patients=patients,
        labels=labels[:, kept],
        labelled=labelled[:, kept],
        overlap_removed=removed,
        load_seconds=seconds,
        directories=dict(directories or {}),
    )


def patient_split(patients: np.ndarray, seed: int, test_fraction: float = TEST_FRACTION) -> np.ndarray:
    """True for the test rows: each patient's side is a function of its key and the seed alone (see
    the module doc), the same whichever rows, sites or fraction a run keeps."""
    keys, inverse = np.unique(patients, return_inverse=True)
    draw = np.array(
        [
            int.from_bytes(hashlib.sha256(f"{seed}:{SPLIT_STREAM}:{key}".encode()).digest()[:8], "big")
            / 2**64
            for key in keys
        ]
    )
    return (draw < test_fraction)[inverse]


def site_shifts(n_sites: int, dim: int, sd: float, seed: int) -> np.ndarray:
    """``δ_s ~ N(0, sd² I)``, one row per site, from the ``(seed, 0x517E)`` stream."""
    return np.random.default_rng([seed, SHIFT_STREAM]).normal(0.0, sd, size=(n_sites, dim))


def cycled_rows(clients: Sequence[np.ndarray], seed: int) -> tuple[np.ndarray, ...]:
    """Each client's rows in a seeded order, repeated to the largest client's count (gradient methods)."""
    size = max(len(r) for r in clients)
    out = []
    for k, rows in enumerate(clients):
        order = np.asarray(rows)[np.random.default_rng([seed, CYCLE_STREAM, k]).permutation(len(rows))]
        out.append(np.tile(order, math.ceil(size / len(rows)))[:size])
    return tuple(out)


# ----------------------------------------------------------------------------------------------
# Configuration and data
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MultisiteConfig:
    """A multi-site run: the simulator's settings (``n_clients`` and ``missing`` are set from the
    sites), the sites, classes, site shift and, for real images, each site's directory."""

    sim: SimConfig = field(default_factory=SimConfig)
    sites: tuple[str, ...] = SITE_KEYS
    classes: tuple[str, ...] | str = "paper"
    site_shift: float = DEFAULT_SITE_SHIFT
    site_dirs: tuple[tuple[str, Path], ...] = ()  # real images: (site, directory) for every site
    images: ImageSource | None = None  # real images: the backbone and cache (its data_dir unused)

    def validate(self) -> None:
        for key in self.sites:
            site_by_key(key)
        if not self.site_shift >= 0 or not math.isfinite(self.site_shift):
            raise MultisiteError(
                f"the site shift must be a finite non-negative number, got {self.site_shift}"
            )
        if self.sim.dp is not None:
            raise MultisiteError("--dp-epsilon is not run with --scenario multisite")
        if self.sim.images is not None:
            raise MultisiteError("--scenario multisite reads images per site (--site-dir), not --data-dir")
        if "fednca-ml" in self.sim.baselines:
            raise MultisiteError(
                "fednca-ml is not run with --scenario multisite (it needs equal-size clients)"
            )
        dirs = dict(self.site_dirs)
        if len(dirs) != len(self.site_dirs):
            raise MultisiteError("a site is given two directories")
        if dirs:
            absent = [k for k in self.sites if k not in dirs]
            if absent:
                raise MultisiteError(
                    f"real images need a directory for every site of the run; none for {', '.join(absent)} "
                    f"(give --site-dir SITE=DIR, or leave those sites out with --sites)"
                )
            if self.images is None:
                raise MultisiteError("real images need a backbone (ImageSource)")


@dataclass(frozen=True)
class MultisiteData:
    prepared: PreparedData
    table: SiteTable  # the rows kept, in the prepared data's order
    test: np.ndarray  # bool per row
    assignment: LabelAssignment
    unknown_negative: np.ndarray  # sites × classes: NaN rows of a labelled class, counted negative
    duplicates_removed: Mapping[str, int] = field(default_factory=dict)
    images_missing: Mapping[str, int] = field(default_factory=dict)
    images_unreadable: Mapping[str, int] = field(default_factory=dict)


def _fraction(table: SiteTable, fraction: float, seed: int) -> SiteTable:
    if fraction >= 1:
        return table
    rng = np.random.default_rng([seed, 0xF4AC])
    keep = []
    for k in range(len(table.sites)):
        rows = np.flatnonzero(table.site == k)
        keep.append(np.sort(rng.choice(rows, size=max(1, round(fraction * len(rows))), replace=False)))
    return table.subset(np.concatenate(keep))


def prepare_multisite(config: MultisiteConfig, progress: Progress | None = None) -> MultisiteData:
    """Tables, split, features (synthetic with the site shift, or real), clients = sites."""
    report = progress or (lambda task, done, total: None)
    sim = config.sim
    classes = resolve_classes(config.classes)
    table = load_site_table(classes, config.sites, directories=dict(config.site_dirs) or None)
    table = _fraction(table, sim.fraction, sim.seed)
    description: dict[str, object]
    extra: dict[str, Mapping[str, int]] = {}
    if config.site_dirs:
        table, features, description, extra = _real_features(table, config)
    else:
        offsets = None
        if config.site_shift > 0:
            offsets = (table.site, site_shifts(len(table.sites), sim.dim, config.site_shift, sim.seed))
        _, patient_codes = np.unique(table.patients, return_inverse=True)
        features = synthetic_features(
            table.binary(),
            patient_codes,
            dim=sim.dim,
            seed=sim.seed,
            progress=lambda done: report("features (synthetic)", done, len(table)),
            offsets=offsets,
        )
        description = {
            "name": "multisite (embedded)",
            "features": f"synthetic, d={sim.dim}, seed={sim.seed}, site shift sd={config.site_shift}",
            "synthetic_features": True,
        }
    test = patient_split(table.patients, sim.seed)
    clients = []
    for k, site in enumerate(table.sites):
        rows = np.flatnonzero((table.site == k) & ~test)
        n_test = int(((table.site == k) & test).sum())
        if not len(rows) or not n_test:
            raise MultisiteError(
                f"{site.name} has {len(rows)} training and {n_test} test rows; use a larger --fraction"
            )
        clients.append(rows)
    _, patient_codes = np.unique(table.patients, return_inverse=True)
    cohort = Cohort(table.image_ids, patient_codes, table.binary(), "torchxrayvision's label tables")
    split = Split(clients=tuple(clients), test=np.flatnonzero(test), unused=np.empty(0, dtype=np.int64))
    description = {"label_source": cohort.source, "rows": len(cohort), **description}
    assignment = LabelAssignment(
        missing=0,
        n_classes=len(table.classes),
        active=tuple(tuple(int(c) for c in np.flatnonzero(row)) for row in table.labelled),
        draw="sites",
    )
    unknown = np.array(
        [
            (np.isnan(table.labels[table.site == k]) & table.labelled[k]).sum(axis=0)
            for k in range(len(table.sites))
        ]
    )
    return MultisiteData(
        prepared=PreparedData(cohort=cohort, features=features, split=split, description=description),
        table=table,
        test=test,
        assignment=assignment,
        unknown_negative=unknown,
        duplicates_removed=extra.get("duplicates", {}),
        images_missing=extra.get("missing", {}),
        images_unreadable=extra.get("unreadable", {}),
    )


def site_image_paths(table: SiteTable) -> tuple[list[Path | None], dict[str, list[str]]]:
    """Each row's image under its site's directory (None: absent), and per site the paths that were
    looked for and not found."""
    from secure_afl.features.images import index_images

    paths: list[Path | None] = [None] * len(table)
    missing: dict[str, list[str]] = {}
    for k, site in enumerate(table.sites):
        directory = Path(table.directories[site.key])
        if site.key in ("nih", "google"):
            index = index_images(directory)
        elif site.key == "siim":
            index = {p.name: p for p in sorted(directory.rglob("*.dcm"))}
        else:
            index = {}
        for row in np.flatnonzero(table.site == k):
            found = site.image_path(directory, str(table.image_ids[row]), index)
            paths[row] = found
            if found is None:
                missing.setdefault(site.key, []).append(site.expected(directory, str(table.image_ids[row])))
    return paths, missing


def _real_features(
    table: SiteTable, config: MultisiteConfig
) -> tuple[SiteTable, np.ndarray, dict[str, object], dict[str, Mapping[str, int]]]:
    """A frozen backbone's features of every site's images (cached), rows without an image dropped."""
    from secure_afl.features.backbones import load_backbone
    from secure_afl.features.extraction import extract_features

    source = config.images
    assert source is not None
    paths, missing = site_image_paths(table)
    for k, site in enumerate(table.sites):
        rows = table.site == k
        if len(missing.get(site.key, ())) == int(rows.sum()):
            raise MultisiteError(
                f"none of the {int(rows.sum())} images of {site.name} is under "
                f"{table.directories[site.key]}: {missing[site.key][0]} does not exist"
            )
    present = np.array([p is not None for p in paths])
    table = table.subset(np.flatnonzero(present))
    found = [p for p in paths if p is not None]
    backbone = load_backbone(source.backbone, source.weights)
    result = extract_features(
        found,
        backbone,
        cache_dir=source.cache_dir or default_cache_dir(),
        device=source.device,
        batch_size=source.batch_size,
        num_workers=source.num_workers,
        amp=source.amp,
    )
    keep = np.ones(len(found), dtype=bool)
    keep[np.asarray(result.skipped, dtype=int)] = False
    unreadable = {s.key: int(((table.site == k) & ~keep).sum()) for k, s in enumerate(table.sites)}
    # An image held by two sites (the same decoded pixels) is kept once, at the first site.
    seen: set[str] = set()
    duplicates = {s.key: 0 for s in table.sites}
    for row, digest in enumerate(result.pixel_sha256):
        if not keep[row] or digest is None:
            continue
        if digest in seen:
            keep[row] = False
            duplicates[table.sites[table.site[row]].key] += 1
        seen.add(digest)
    description: dict[str, object] = {
        "name": "multisite (images)",
        "directories": {k: str(v) for k, v in table.directories.items()},
        "backbone": source.backbone,
        "weights": backbone.weights_id,
        "features_from_cache": result.from_cache,
        "cache": str(result.cache_path),
        "features": f"{source.backbone}, d={backbone.feature_dim}",
        "synthetic_features": False,
    }
    counts = {
        "missing": {k: len(v) for k, v in missing.items()},
        "unreadable": unreadable,
        "duplicates": duplicates,
    }
    if missing:
        description["images_missing_examples"] = {k: v[:3] for k, v in missing.items()}
    rows = np.flatnonzero(keep)
    return table.subset(rows), result.features[rows], description, counts


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MultisiteResult:
    config: MultisiteConfig
    data: MultisiteData = field(repr=False)
    setting: SettingResult
    per_site: Mapping[str, Mapping[str, Metrics]]  # method -> site key -> its metrics
    theorem1: Mapping[str, float]
    seconds: Mapping[str, float]
    notice: str


def _class_metrics(labels: np.ndarray, known: np.ndarray, logits: np.ndarray) -> Metrics:
    """Per class over the rows where it is known (NaN where none, or one-sided)."""
    n_classes = labels.shape[1]
    out = [np.full(n_classes, np.nan) for _ in range(4)]
    for c in range(n_classes):
        rows = known[:, c]
        if not rows.any():
            continue
        m = evaluate(labels[rows][:, [c]], logits[rows][:, [c]], kind="logits")
        out[0][c], out[1][c], out[2][c] = m.bacc[0], m.auc[0], m.ap[0]
        out[3][c] = m.prevalence[0] if m.prevalence is not None else np.nan
    return Metrics(bacc=out[0], auc=out[1], ap=out[2], prevalence=out[3])


def _sim_config(config: MultisiteConfig, n_sites: int) -> SimConfig:
    return replace(config.sim, n_clients=n_sites, missing=(0,), split="patient", images=None)


def centralised_fit(data: MultisiteData, members: Sequence[int], gamma: float) -> dict[str, np.ndarray]:
    """The per-class ridge of paper Theorem 1 over every training row of the sites ``members`` that
    label the class, in one plaintext float64 pass (features × classes), with per-site balanced
    targets (``"client"``) and with the pooled rows' (``"global"``); see the module doc.  Classes
    labelled by the same sites share one Cholesky factor."""
    prepared = data.prepared
    features, labels = prepared.features, prepared.cohort.labels
    active = data.assignment.active
    dim = features.shape[1]
    grams = {}
    for k in members:
        rows = prepared.split.clients[k]
        gram = np.zeros((dim, dim))
        for start in range(0, len(rows), 8192):
            h = features[rows[start : start + 8192]].astype(np.float64)
            gram += h.T @ h
        grams[k] = gram
    out = {"client": np.zeros((dim, labels.shape[1])), "global": np.zeros((dim, labels.shape[1]))}
    factors: dict[tuple[int, ...], tuple[np.ndarray, bool]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UndefinedBalanceWarning)
        for c in range(labels.shape[1]):
            sites = tuple(k for k in members if c in active[k])
            if not sites:
                continue
            if sites not in factors:
                factors[sites] = cho_factor(sum(grams[k] for k in sites) + gamma * np.eye(dim))
            per_site = [prepared.split.clients[k] for k in sites]
            rhs_client = sum(
                features[rows].astype(np.float64).T @ balanced_labels(labels[rows], [c])[:, c]
                for rows in per_site
            )
            pooled = np.concatenate(per_site)
            rhs_global = features[pooled].astype(np.float64).T @ balanced_labels(labels[pooled], [c])[:, c]
            out["client"][:, c] = cho_solve(factors[sites], rhs_client)
            out["global"][:, c] = cho_solve(factors[sites], rhs_global)
    return out


def run_multisite(config: MultisiteConfig, *, progress: Progress | None = None) -> MultisiteResult:
    """Prepare the sites, then the simulator's stages with the sites as clients (see the module doc)."""
    config.validate()
    report = progress or (lambda task, done, total: None)
    timer = PhaseTimer()
    with timer.phase("data"):
        data = prepare_multisite(config, report)
    prepared, table = data.prepared, data.table
    n_sites = len(table.sites)
    sim = _sim_config(config, n_sites)
    sim.validate()
    test_rows = prepared.split.test
    test_y = prepared.cohort.labels[test_rows]
    test_known = table.known()[test_rows]
    test_site = table.site[test_rows]
    per_site: dict[str, dict[str, Metrics]] = {}

    def score(method: str, logits: np.ndarray) -> Metrics:
        per_site[method] = {
            site.key: _class_metrics(
                test_y[test_site == k], test_known[test_site == k], logits[test_site == k]
            )
            for k, site in enumerate(table.sites)
        }
        return _class_metrics(test_y, test_known, logits)

    from secure_afl.sim.baselines import BASELINES as TABLE2_BASELINES
    from secure_afl.sim.gradient import GradientMethods

    cycled = cycled_rows(prepared.split.clients, sim.seed)
    with (
        one_torch_thread(),
        GradientMethods(
            prepared.features,
            [prepared.cohort.labels[rows] for rows in cycled],
            {0: data.assignment.active},
            fedavg=sim.fedavg,
            baselines=tuple(b for b in sim.baselines if b in TABLE2_BASELINES),
            baseline=sim.baseline,
            client_rows=cycled,
            fork_ok=not config.site_dirs,
        ) as gradient,
        threadpool_limits(1, user_api="blas") if gradient.mode != "inline" else nullcontext(),
    ):
        with timer.phase("statistics"), ThreadPoolExecutor(gradient.statistics_threads) as pool:
            jobs = [
                pool.submit(
                    client_statistics,
                    prepared.features[rows],
                    prepared.cohort.labels[rows],
                    device=sim.device,
                )
                for rows in prepared.split.clients
            ]
            stats = {}
            for k, job in enumerate(jobs):
                stats[client_id(k)] = job.result()
                report("site statistics", k + 1, n_sites)
        setting = run_setting(
            prepared, stats, 0, sim, timer, report, gradient, assignment=data.assignment, score=score
        )
    with timer.phase("centralised reference"):
        survivors = [k for k in range(n_sites) if client_id(k) not in setting.dropped]
        theorem1 = {}
        references = centralised_fit(data, survivors, sim.gamma)
        for method, balance, key in (
            (AFL_1, "client", "max_abs_w_vs_centralised"),
            (AFL_GLOBAL_BALANCE, "global", "max_abs_w_vs_centralised_global_balance"),
        ):
            reference = references[balance]
            theorem1[key] = float(np.abs(setting.coefs[method] - reference).max())
            theorem1[f"{key}_scale"] = float(np.abs(reference).max())
    notice = ""
    if prepared.description.get("synthetic_features"):
        notice = (
            "FEATURES ARE SYNTHETIC: the sites' rows, patients and label sets are the real tables shipped "
            "with torchxrayvision; the features come from the seeded model of secure_afl/sim/synthetic.py "
            "plus a site shift. The numbers show how the methods behave on the real label structure of a "
            "multi-site federation, not how well chest X-rays can be classified."
        )
    return MultisiteResult(
        config=config,
        data=data,
        setting=setting,
        per_site=per_site,
        theorem1=theorem1,
        seconds=dict(timer.seconds),
        notice=notice,
    )


# ----------------------------------------------------------------------------------------------
# Reports
# ----------------------------------------------------------------------------------------------


def sites_list(data: MultisiteData) -> list[dict[str, object]]:
    """results.json's ``sites``: name, rows, patients and labelled classes of every site."""
    table = data.table
    out = []
    for k, site in enumerate(table.sites):
        rows = table.site == k
        train = rows & ~data.test
        out.append(
            {
                "key": site.key,
                "name": site.name,
                "client": client_id(k),
                "rows": int(rows.sum()),
                "patients": len(np.unique(table.patients[rows])),
                "train_rows": int(train.sum()),
                "test_rows": int((rows & data.test).sum()),
                "labelled_classes": [table.classes[c] for c in np.flatnonzero(table.labelled[k])],
                "positives_train": {
                    table.classes[c]: int(data.prepared.cohort.labels[train, c].sum())
                    for c in np.flatnonzero(table.labelled[k])
                },
                "unlabelled_rows_counted_negative": {
                    table.classes[c]: int(data.unknown_negative[k, c])
                    for c in np.flatnonzero(table.labelled[k])
                    if data.unknown_negative[k, c]
                },
                "overlap_removed": int(table.overlap_removed.get(site.key, 0)),
                "duplicate_images_removed": int(data.duplicates_removed.get(site.key, 0)),
                "images_missing": int(data.images_missing.get(site.key, 0)),
                "images_unreadable": int(data.images_unreadable.get(site.key, 0)),
                "load_seconds": round(float(table.load_seconds.get(site.key, 0.0)), 3),
            }
        )
    return out


def class_rows(data: MultisiteData) -> list[dict[str, object]]:
    """Per class: |S_c|, the sites that label it, and its training rows and positives."""
    table = data.table
    labels = data.prepared.cohort.labels
    out = []
    for c, name in enumerate(table.classes):
        members = [k for k in range(len(table.sites)) if table.labelled[k, c]]
        rows = np.concatenate([data.prepared.split.clients[k] for k in members])
        out.append(
            {
                "class": name,
                "S_c": len(members),
                "sites": [table.sites[k].key for k in members],
                "train_rows": len(rows),
                "train_positives": int(labels[rows, c].sum()),
            }
        )
    return out


def _metrics_row(name: str, metrics: Metrics) -> list[str]:
    macro = metrics.macro
    return [name, f"{100 * macro['bacc']:.2f}", f"{100 * macro['auc']:.2f}", f"{macro['map']:.4f}"]


def result_tables(result: MultisiteResult) -> list[tuple[str, list[str], list[list[str]]]]:
    data, setting = result.data, result.setting
    table = data.table
    sites = sites_list(data)
    site_rows = [
        [s["name"], str(s["rows"]), str(s["patients"]), str(s["train_rows"]), str(s["test_rows"]),
         ", ".join(s["labelled_classes"])]  # type: ignore[arg-type]
        for s in sites
    ]  # fmt: skip
    tables = [
        ("Sites", ["Site", "Rows", "Patients", "Train", "Test", "Labels (of the run's classes)"], site_rows),
        (
            "Classes: |S_c| and the sites that label each",
            ["Class", "|S_c|", "Sites", "Train rows", "Train positives"],
            [
                [
                    r["class"],
                    str(r["S_c"]),
                    ", ".join(r["sites"]),
                    str(r["train_rows"]),
                    str(r["train_positives"]),
                ]  # type: ignore[arg-type]
                for r in class_rows(data)
            ],
        ),
        (
            "Overall (each class on the test rows of the sites that label it)",
            ["Method", "BACC", "AUC", "mAP"],
            [_metrics_row(name, m) for name, m in setting.metrics.items()],
        ),
    ]
    methods = [m for m in setting.metrics if m in (AFL_1, AFL_2) or m in BASELINES or "FedAvg" in m]
    header = ["Site", *methods]
    rows = []
    for site in table.sites:
        rows.append([site.name] + [f"{100 * result.per_site[m][site.key].macro['auc']:.2f}" for m in methods])
    tables.append(("Per site: macro AUC over its own test rows and classes", header, rows))
    return tables


def summary_lines(result: MultisiteResult) -> list[str]:
    from secure_afl.sim.report import privacy_verdict

    t1 = result.theorem1
    setting = result.setting
    lines = [
        f"Theorem 1: max |W - W_centralised| = {t1['max_abs_w_vs_centralised']:.2e} "
        f"(max |W| {t1['max_abs_w_vs_centralised_scale']:.2e}; AFL 1 round, per-site balance); "
        f"global balance {t1['max_abs_w_vs_centralised_global_balance']:.2e}",
        f"protection: {result.config.sim.secure}; "
        + privacy_verdict(setting).replace("missing 0", "the sites"),
    ]
    if setting.undefined_balance:
        names = ", ".join(
            f"{result.data.table.sites[int(c.split('-')[1])].key if c.startswith('client-') else c}/"
            f"{result.data.table.classes[k]} ({why})"
            for c, k, why in setting.undefined_balance
        )
        lines.append(f"Eq. 9 undefined (a labelled class without positives or negatives): {names}")
    removed = {k: v for k, v in result.data.table.overlap_removed.items() if v}
    if removed:
        lines.append(
            "images in two collections kept once: "
            + ", ".join(f"{v} removed from {k}" for k, v in removed.items())
            + " (Google's relabels are NIH images; they stay at the Google site)"
        )
    return lines


def print_multisite_report(result: MultisiteResult, console: Console) -> None:
    if result.notice:
        console.print(f"[bold yellow]{result.notice}[/]")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a site whose every class is one-sided: NaN
        tables = result_tables(result)
    from secure_afl.sim.report import rich_table

    for title, header, rows in tables:
        console.print(rich_table(title, header, rows))
    for line in summary_lines(result):
        console.print(line, markup=False, highlight=False)


def to_json(result: MultisiteResult) -> dict[str, object]:
    data, setting, config = result.data, result.setting, result.config
    classes = data.table.classes
    sim = _sim_config(config, len(data.table.sites))
    sim_dict = {k: v for k, v in asdict(sim).items() if k not in ("images", "dp")}
    return {
        "scenario": "multisite",
        "notice": result.notice,
        "config": {
            "sim": sim_dict,
            "sites": list(config.sites),
            "classes": list(classes),
            "site_shift": config.site_shift,
            "site_dirs": {k: str(v) for k, v in config.site_dirs},
            "trust_model": trust_models(sim.secure),
        },
        "dataset": dict(data.prepared.description),
        "sites": sites_list(data),
        "classes": class_rows(data),
        **result.theorem1,
        "theorem1_tolerance": EXACT_BAR,
        "metrics": {name: _metrics_dict(m, classes) for name, m in setting.metrics.items()},
        "metrics_per_site": {
            method: {site: _metrics_dict(m, classes) for site, m in by_site.items()}
            for method, by_site in result.per_site.items()
        },
        "privacy_audit": setting.audit.to_dict(),
        "privacy_by_method": {
            method: {
                "single_member_groups": [g.group for g in a.single_member_groups()],
                "exposed_by_overlapping_groups": {t: list(c) for t, c in a.exposed_by_overlap().items()},
            }
            for method, a in setting.method_audits.items()
        },
        "dropped": list(setting.dropped),
        "upload_bytes": dict(setting.upload_bytes),
        "undefined_balance": [
            {"client": client, "class": classes[c], "reason": why}
            for client, c, why in setting.undefined_balance
        ],
        "pseudo_labels": [
            {
                "client": client,
                "class": classes[r.cls],
                "pseudo_positive": r.n_pseudo_pos,
                "pseudo_negative": r.n_pseudo_neg,
                "qualified": r.qualified,
            }
            for client, r in setting.pseudo_labels
        ],
        "protocol_costs": setting.protocol_costs,
        "seconds_per_method": dict(setting.method_seconds),
        "seconds_per_phase": dict(result.seconds),
    }


def _metrics_dict(metrics: Metrics, classes: Sequence[str]) -> dict[str, object]:
    def clean(values: np.ndarray) -> dict[str, float | None]:
        return {c: (None if np.isnan(v) else float(v)) for c, v in zip(classes, values, strict=True)}

    macro = {k: (None if np.isnan(v) else v) for k, v in metrics.macro.items()}
    return {"macro": macro, "bacc": clean(metrics.bacc), "auc": clean(metrics.auc), "ap": clean(metrics.ap)}


def write_multisite_reports(result: MultisiteResult, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "results.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # nanmean of an all-NaN site/class
        payload = to_json(result)
    json_path.write_text(json.dumps(payload, indent=2, default=_json_default))
    lines = ["# secure-afl sim --scenario multisite", ""]
    if result.notice:
        lines += [f"**{result.notice}**", ""]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        tables = result_tables(result)
    for title, header, rows in tables:
        lines += [f"## {title}", "", _md_table(header, rows), ""]
    lines += [f"- {line}" for line in summary_lines(result)]
    from secure_afl.sim.report import audit_lines

    lines += ["", "## Privacy audit", ""] + [f"- {line}" for line in audit_lines(result.setting)]
    md_path = out_dir / "report.md"
    md_path.write_text("\n".join(lines) + "\n")
    return json_path, md_path


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])


def _json_default(value: object) -> object:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (Path, os.PathLike)):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value)}")
