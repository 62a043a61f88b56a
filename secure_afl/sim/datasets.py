"""Where the experiment's features come from: the embedded default data or real ChestXray14 images.

Both sources share one code path: the cohort (label table, PA rows, 8 classes), an optional random
subset, then features, then the split into test rows and equal IID clients.  They differ only in the
features: seeded synthetic ones (:mod:`secure_afl.sim.synthetic`) or a frozen backbone's on the
images (:mod:`secure_afl.features.backbones`, cached by :mod:`secure_afl.features.extraction`).
Images that are absent from the data directory or unreadable are dropped with their labels *before*
the split, and counted in the dataset description.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from secure_afl.sim.data import N_CLIENTS, Cohort, Split, SplitBy, load_cohort, split_cohort
from secure_afl.sim.synthetic import synthetic_features

if TYPE_CHECKING:
    from secure_afl.features.extraction import FeatureMaps

Progress = Callable[[str, int, int], None]  # (task, done, total)


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/secure-afl/features`` (``~/.cache/secure-afl/features``)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "secure-afl" / "features"


@dataclass(frozen=True)
class ImageSource:
    """Real images: a ChestXray14 directory, a backbone, its weight file and the feature cache."""

    data_dir: Path
    backbone: str = "densenet121-xrv"
    weights: Path | None = None  # None: the file in TorchXRayVision's / torch hub's cache directory
    csv: Path | None = None  # None: the table bundled with torchxrayvision
    cache_dir: Path | None = None  # None: default_cache_dir()
    device: str = "auto"
    batch_size: int = 64
    num_workers: int | None = None
    amp: bool = False
    # Also cache the backbone's feature map before pooling, for FedNCA-ML's spatial tokens
    # (DenseNet-121: 1024 × 7 × 7 float16 per image, ~6.8 GB for ChestXray14's PA images).
    spatial: bool = False


@dataclass(frozen=True)
class PreparedData:
    cohort: Cohort
    features: np.ndarray
    split: Split
    description: Mapping[str, object]
    # Spatial tokens of the same rows (``tokens(rows)`` -> rows × T × d, ``grid``): the cached feature
    # maps with ImageSource(spatial=True); None otherwise (FedNCA-ML makes synthetic ones).
    tokens: FeatureMaps | None = None


def _subset(cohort: Cohort, fraction: float, seed: int) -> Cohort:
    if fraction >= 1:
        return cohort
    rng = np.random.default_rng(seed)
    size = max(1, round(fraction * len(cohort)))
    return cohort.subset(np.sort(rng.choice(len(cohort), size=size, replace=False)))


def _image_features(
    source: ImageSource, cohort: Cohort
) -> tuple[Cohort, np.ndarray, dict[str, object], FeatureMaps | None]:
    # Imported here: torchvision and the image stack are only needed for real images.
    from secure_afl.features.backbones import load_backbone
    from secure_afl.features.extraction import extract_features
    from secure_afl.features.images import resolve_image_paths

    found = resolve_image_paths(source.data_dir, list(cohort.image_names))
    missing = set(found.missing_names)
    present = np.array([name not in missing for name in cohort.image_names])
    cohort = cohort.subset(np.flatnonzero(present))
    backbone = load_backbone(source.backbone, source.weights)
    result = extract_features(
        found.paths,
        backbone,
        cache_dir=source.cache_dir or default_cache_dir(),
        device=source.device,
        batch_size=source.batch_size,
        num_workers=source.num_workers,
        amp=source.amp,
        spatial=source.spatial,
    )
    keep = np.setdiff1d(np.arange(len(cohort)), np.asarray(result.skipped, dtype=int))
    description = {
        "name": "nih",
        "data_dir": str(source.data_dir),
        "backbone": source.backbone,
        "weights": backbone.weights_id,
        "images_missing": len(missing),
        "images_unreadable": len(result.skipped),
        "features_from_cache": result.from_cache,
        "forward_passes": result.forward_passes,
        "cache": str(result.cache_path),
        "features": f"{source.backbone}, d={backbone.feature_dim}",
        "synthetic_features": False,
    }
    maps = None
    if result.maps is not None:
        maps = result.maps.subset(keep)
        h, w = maps.grid
        description["feature_maps"] = f"{h}x{w} tokens of d={maps.dim}, float16, cached"
    return cohort.subset(keep), result.features[keep], description, maps


def prepare(
    images: ImageSource | None,
    *,
    fraction: float = 1.0,
    dim: int = 1024,
    seed: int = 0,
    n_clients: int = N_CLIENTS,
    split: SplitBy = "image",
    progress: Progress | None = None,
    cohort_read: Callable[[], None] | None = None,
) -> PreparedData:
    """Cohort, features and split.  ``images=None`` is the embedded data with synthetic features.

    ``cohort_read`` is called once the label table is read, before the features.
    """
    report = progress or (lambda task, done, total: None)
    tokens = None
    cohort = _subset(load_cohort(images.csv if images else None), fraction, seed)
    if cohort_read is not None:
        cohort_read()
    if images is None:
        features = synthetic_features(
            cohort.labels,
            cohort.patient_ids,
            dim=dim,
            seed=seed,
            progress=lambda done: report("features (synthetic)", done, len(cohort)),
        )
        description: dict[str, object] = {
            "name": "embedded",
            "features": f"synthetic, d={dim}, seed={seed}",
            "synthetic_features": True,
        }
    else:
        cohort, features, description, tokens = _image_features(images, cohort)
    description = {"label_source": cohort.source, "rows": len(cohort), **description}
    return PreparedData(
        cohort=cohort,
        features=features,
        split=split_cohort(cohort, n_clients=n_clients, by=split, seed=seed),
        description=description,
        tokens=tokens,
    )


@dataclass(frozen=True)
class DataRequest:
    """The arguments of :func:`prepare` for the embedded data (what a :class:`SimConfig` fixes)."""

    fraction: float = 1.0
    dim: int = 1024
    seed: int = 0
    n_clients: int = N_CLIENTS
    split: SplitBy = "image"

    def prepare(
        self,
        images: ImageSource | None = None,
        progress: Progress | None = None,
        cohort_read: Callable[[], None] | None = None,
    ) -> PreparedData:
        """:func:`prepare` with these arguments."""
        return prepare(
            images,
            fraction=self.fraction,
            dim=self.dim,
            seed=self.seed,
            n_clients=self.n_clients,
            split=self.split,
            progress=progress,
            cohort_read=cohort_read,
        )


class PreparationCancelled(RuntimeError):
    """:meth:`PreparingData.cancel` stopped the preparation before the data were ready."""


class PreparingData:
    """The embedded data, prepared on a background thread from the moment this is created.

    The command line starts it before importing torch and the training code: the synthetic features
    are numpy work that mostly runs outside the GIL, so the imports (about two seconds of one
    core) overlap it.  Reading the label table is Python work that needs the GIL as much as an
    import does: the command waits for it (:meth:`wait_for_cohort`) before importing, so that the
    features start about 0.8 s sooner.  :meth:`result` waits and gives the data and the seconds they
    took.
    """

    def __init__(self, request: DataRequest, progress: Progress | None = None) -> None:
        self.request = request
        self._cohort_read = threading.Event()
        self._cancelled = threading.Event()
        executor = ThreadPoolExecutor(1, thread_name_prefix="prepare-data")
        self._future = executor.submit(self._prepare, request, progress)
        executor.shutdown(wait=False)  # the thread ends with the job

    def _prepare(self, request: DataRequest, progress: Progress | None) -> tuple[PreparedData, float]:
        def report(task: str, done: int, total: int) -> None:  # called after every chunk of features
            if self._cancelled.is_set():
                raise PreparationCancelled("preparing the data was cancelled")
            if progress is not None:
                progress(task, done, total)

        start = time.perf_counter()
        try:
            data = request.prepare(None, report, cohort_read=self._cohort_read.set)
        finally:
            self._cohort_read.set()  # a failure before the table was read releases the waiters too
        return data, time.perf_counter() - start

    def cancel(self) -> None:
        """Stop at the next chunk of features (Ctrl-C or an error elsewhere), so that a process that
        waits for its threads before exiting does not wait for data nobody will use."""
        self._cancelled.set()

    def wait_for_cohort(self) -> None:
        """Return once the label table is read (or preparing has failed: :meth:`result` raises it)."""
        self._cohort_read.wait()

    def result(self) -> tuple[PreparedData, float]:
        """The prepared data and their wall seconds (raises what :func:`prepare` raised)."""
        return self._future.result()
