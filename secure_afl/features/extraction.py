"""Batched feature extraction with a resumable on-disk cache (SPEC §4).

Public API
----------
``extract_features(paths, backbone, *, cache_dir, device="auto", batch_size=64, num_workers=None,
amp=False, shard_size=2048, progress=True, strict=False) -> ExtractionResult``
    Features of the images ``paths`` (in that order) from a frozen ``backbone``
    (:func:`secure_afl.features.backbones.load_backbone`). Returns an :class:`ExtractionResult`:

    - ``features``: float32 array ``len(paths) x backbone.feature_dim``; the rows of skipped images are
      NaN, so that a caller who forgets to drop them fails loudly downstream;
    - ``skipped``: sorted indices (into ``paths``) of unreadable or corrupt PNGs, with the reasons in
      ``skip_reasons``; the caller drops these rows (their labels too) and reports each file:
      ``unreadable_error(out_path)`` is the error naming them that the commands raise.
      ``strict=True`` raises :class:`secure_afl.features.images.CorruptImageError` instead;
    - ``forward_passes``: batches run through the network in this call (0 on a complete cache);
    - ``from_cache``: True when every shard came from the cache; ``shards_computed`` /
      ``shards_reused`` count both kinds, ``cache_path`` is the cache entry's directory;
    - ``image_sha256``: per path, the SHA-256 of its file's bytes (None for a file that could not be
      read, which is skipped): the digests the feature file records and the cache key is made of.
      Each file is hashed once, streaming (pass ``image_sha256`` to reuse digests computed earlier);
      on a cache miss each image's bytes are checked against its digest as they are decoded;
    - ``pixel_sha256``: per path, :func:`secure_afl.features.images.pixel_sha256` of the decoded
      image (None where skipped), kept per shard in the manifest, so a cached run has them too.

``spatial=True`` also caches the backbone's feature map before its global pool (DenseNet-121:
    1024 × 7 × 7 per image) for methods that attend over spatial tokens (FedNCA-ML); the result's
    ``maps`` (:class:`FeatureMaps`) reads them on demand. See "Feature maps" below.
``feature_cache_key(image_sha256, backbone, *, amp=False, spatial=False) -> str``
    The cache entry's name: SHA-256 over the backbone name, its weights id (SHA-256 of the weight file,
    or ``random-init-seed-N``), its preprocessing description, the AMP flag and the ordered list of
    the images' content digests (:func:`secure_afl.features.images.hash_image_files`), not their
    paths: images overwritten under the same names are a new entry, so they get fresh features, and
    the same images under other paths reuse the entry.
``resolve_device(device) -> torch.device``
    ``"auto"`` -> CUDA when available, else CPU; ``"cuda"`` without a GPU raises ``ValueError``.
``default_num_workers() -> int``
    DataLoader workers used when ``num_workers`` is None: the usable CPUs, at most 8.

Cache layout: ``cache_dir/<key>/manifest.json`` (key fields, feature dim, shard size, per completed
shard its file, row count, skipped indices with reasons and its rows' pixel digests), ``images.txt``
(the ordered image list as ``sha256sum`` writes it, ``<digest>  <path>``, so ``sha256sum -c
images.txt`` re-checks it) and ``shard_00000.npy`` … (float32, ``shard_size`` rows each, the last
one shorter). Every file is written 0600 and every directory created 0700 (features derive from
patients' images). Each shard is written to a temporary file and moved into place with
``os.replace``, then recorded in the manifest (also replaced atomically), so an interrupted
extraction resumes at the first shard it had not finished, and a complete cache returns without
building a DataLoader or running the network.

Feature maps (``spatial=True``): a separate cache entry (``spatial`` is part of the key, so the
pooled-only entry and its key are unchanged), whose shards carry beside ``shard_NNNNN.npy`` a
``maps_NNNNN.npy``: float16, ``rows × T × D`` with the ``h × w`` grid flattened row-major into
``T = h·w`` tokens (``grid`` in the manifest). Both come from one forward pass, split at the pool
(:attr:`Backbone.feature_map` / :attr:`Backbone.pool`), so the pooled features equal the plain
extraction's bit for bit. Disk: ``T·D·2`` bytes per image, 100,352 B for DenseNet-121 at 224
(7 × 7 × 1024), i.e. **6.8 GB for ChestXray14's 67,310 PA images** (the pooled cache: 276 MB);
memory while extracting: one shard of maps (``shard_size·T·D·2`` B, 205 MB at the default 2048).
float16 keeps ~3 significant digits, ample for post-ReLU activations feeding an attention head.
VGG has no feature map (its features are fc7): ``spatial=True`` refuses it.

Precision: the network runs in float32; ``amp=True`` wraps the forward pass in ``torch.autocast``
(float16) on CUDA only and is ignored, with a warning, on CPU. Features are stored as float32 either
way; downstream statistics are accumulated in float64. The AMP flag is part of the cache key;
the device is not (CPU and GPU float32 features differ only by rounding).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text
from torch.utils.data import DataLoader

from secure_afl.analytic import resolve_device
from secure_afl.features.backbones import Backbone
from secure_afl.features.file import PRIVATE_DIR_MODE, PRIVATE_FILE_MODE, make_private_dirs
from secure_afl.features.images import (
    CorruptImageError,
    ImageBatch,
    ImageChangedError,
    ImageDataset,
    collate_images,
    hash_image_files,
)

__all__ = [
    "CACHE_FORMAT_VERSION",
    "ExtractionResult",
    "FeatureMaps",
    "default_num_workers",
    "extract_features",
    "feature_cache_key",
    "resolve_device",
]

CACHE_FORMAT_VERSION = 2  # 2: keyed by the images' content digests (1 was keyed by their paths)
UNREADABLE_DIGEST = "unreadable"  # in the key, for a file that could not be read when hashed
MANIFEST_NAME = "manifest.json"
IMAGE_LIST_NAME = "images.txt"
_MAX_DEFAULT_WORKERS = 8

logger = logging.getLogger(__name__)


class FeatureMaps:
    """The cached pre-pooling feature maps of an extraction, read on demand from memory-mapped shards.

    ``tokens(rows)`` returns ``len(rows) × T × D`` float32 (rows index the extraction's image list,
    or this view's rows after :meth:`subset`); ``grid`` is the map's ``(h, w)``.  Nothing of size
    images × T × D is held in memory.
    """

    def __init__(
        self, entry: Path, shard_files: dict[int, str], shard_size: int, grid: tuple[int, int], dim: int
    ) -> None:
        self.entry = entry
        self.grid = grid
        self.dim = dim
        self._shard_files = shard_files
        self._shard_size = shard_size
        self._opened: dict[int, np.ndarray] = {}
        self._index = np.arange(sum(len(self._open(s)) for s in shard_files), dtype=np.int64)

    def _open(self, shard: int) -> np.ndarray:
        if shard not in self._opened:
            self._opened[shard] = np.load(self.entry / self._shard_files[shard], mmap_mode="r")
        return self._opened[shard]

    def __len__(self) -> int:
        return len(self._index)

    def subset(self, rows: np.ndarray) -> FeatureMaps:
        """A view of the given rows, in that order (e.g. the images that were read and kept)."""
        view = copy.copy(self)  # shares the opened shards
        view._index = self._index[np.asarray(rows, dtype=np.int64)]
        return view

    def tokens(self, rows: np.ndarray) -> np.ndarray:
        images = self._index[np.asarray(rows, dtype=np.int64)]
        out = np.empty((len(images), self.grid[0] * self.grid[1], self.dim), dtype=np.float32)
        shards = images // self._shard_size
        for shard in np.unique(shards):
            where = np.flatnonzero(shards == shard)
            out[where] = self._open(int(shard))[images[where] - shard * self._shard_size]
        return out


@dataclass(frozen=True)
class ExtractionResult:
    features: np.ndarray
    skipped: list[int]
    skip_reasons: dict[int, str]
    forward_passes: int
    from_cache: bool
    shards_computed: int
    shards_reused: int
    cache_path: Path
    device: str
    maps: FeatureMaps | None = None  # with spatial=True
    image_sha256: tuple[str | None, ...] = ()  # per path; None: unreadable (skipped)
    pixel_sha256: tuple[str | None, ...] = ()  # per path, of the decoded image; None where skipped

    def unreadable_error(self, out_path: Path) -> CorruptImageError | None:
        """None when every image was read; else the error that ``features extract`` and ``predict``
        raise, naming every file left out and why: before writing ``out_path`` when no image could
        be read, after writing the readable ones' rows to it otherwise (the run is still a failure)."""
        if not self.skipped:
            return None
        total, bad = len(self.features), len(self.skipped)
        if bad == total:
            head = f"none of the {total} images could be read, so nothing was written to {out_path}:"
        else:
            head = (
                f"{bad} of the {total} images could not be read and have no row in {out_path} (the "
                f"other {total - bad} were written):"
            )
        return CorruptImageError("\n".join([head, *(f"  {self.skip_reasons[i]}" for i in self.skipped)]))


@dataclass
class _ShardBuffer:
    """Rows of one shard being filled batch by batch."""

    features: np.ndarray
    remaining: int
    skipped: dict[int, str] = field(default_factory=dict)
    maps: np.ndarray | None = None  # rows × T × D float16 with spatial=True
    pixel_sha256: list[str | None] = field(default_factory=list)  # one per row, filled as rows arrive


def default_num_workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(0, min(_MAX_DEFAULT_WORKERS, cpus))


def _key_fields(
    image_sha256: Sequence[str | None], backbone: Backbone, amp: bool, spatial: bool
) -> dict[str, Any]:
    """The inputs that identify a cache entry, in their JSON form (tuples become lists), so that they
    compare equal to the copy read back from ``manifest.json``."""
    fields = {
        "format": CACHE_FORMAT_VERSION,
        "backbone": backbone.name,
        "weights": backbone.weights_id,
        "preprocess": backbone.preprocess.as_dict(),
        "feature_dim": backbone.feature_dim,
        "amp": amp,
        "n_images": len(image_sha256),
        "image_digests_sha256": _digest_list_sha256(image_sha256),
    }
    if spatial:  # only then, so that the pooled-only entries keep their keys
        fields["feature_map"] = "float16, rows x tokens x dim, grid row-major"
    return json.loads(json.dumps(fields))


def _digest_list_sha256(image_sha256: Sequence[str | None]) -> str:
    """SHA-256 of the ordered content digests, one per line (the images' order is the rows' order)."""
    digest = hashlib.sha256()
    for image in image_sha256:
        digest.update((image or UNREADABLE_DIGEST).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def feature_cache_key(
    image_sha256: Sequence[str | None], backbone: Backbone, *, amp: bool = False, spatial: bool = False
) -> str:
    """The cache entry of images with these content digests (in this order); see the module doc."""
    if isinstance(image_sha256, str) or not all(d is None or isinstance(d, str) for d in image_sha256):
        raise TypeError("feature_cache_key takes the images' content digests (hash_image_files), not paths")
    fields = _key_fields(image_sha256, backbone, amp, spatial)
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _atomic_write(target: Path, write: Any) -> None:
    """Writes via ``write(file_object)`` to a temporary file beside ``target``, then renames it."""
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")  # 0600
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), PRIVATE_FILE_MODE)
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def _write_json(target: Path, payload: dict[str, Any]) -> None:
    _atomic_write(target, lambda handle: handle.write(json.dumps(payload, indent=1).encode()))


def _shard_file(shard: int) -> str:
    return f"shard_{shard:05d}.npy"


def _maps_file(shard: int) -> str:
    return f"maps_{shard:05d}.npy"


def _read_manifest(entry: Path, key_fields: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest of a cache entry, or None if absent, unreadable or made for other inputs."""
    try:
        manifest = json.loads((entry / MANIFEST_NAME).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        logger.warning("ignoring unreadable feature-cache manifest %s: %s", entry / MANIFEST_NAME, error)
        return None
    if manifest.get("key_fields") != key_fields:
        logger.warning("ignoring feature-cache manifest %s: it was written for other inputs", entry)
        return None
    return manifest


def _completed_shards(
    entry: Path, manifest: dict[str, Any], feature_dim: int, spatial: bool
) -> dict[int, dict[str, Any]]:
    """Shards recorded in the manifest whose files exist with the recorded shapes."""
    completed = {}
    for shard_text, record in manifest["shards"].items():
        try:
            stored = np.load(entry / record["file"], mmap_mode="r")
            maps = np.load(entry / record["maps_file"], mmap_mode="r") if spatial else None
        except (OSError, ValueError, KeyError):
            continue  # lost or truncated shard: recompute it
        if stored.shape != (record["rows"], feature_dim) or stored.dtype != np.float32:
            continue
        if len(record.get("pixel_sha256") or ()) != record["rows"]:
            continue  # the decoded images' digests are part of a shard
        if maps is not None:
            tokens = manifest["grid"][0] * manifest["grid"][1]
            if maps.shape != (record["rows"], tokens, feature_dim) or maps.dtype != np.float16:
                continue
        completed[int(shard_text)] = record
    return completed


class _ImagesPerSecondColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:,.1f} img/s" if speed else "… img/s", style="progress.data.speed")


def _progress_bar(enabled: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        _ImagesPerSecondColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not enabled,
    )


def _forward(
    backbone: Backbone, pixels: torch.Tensor, device: torch.device, amp: bool, spatial: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    """One forward pass of a batch; the only place the network is called.

    Returns the pooled features and, with ``spatial``, the map as ``rows × h × w × D`` float16.
    """
    autocast = torch.autocast("cuda", dtype=torch.float16) if amp else contextlib.nullcontext()
    with torch.inference_mode(), autocast:
        x = pixels.to(device, non_blocking=True)
        if not spatial:
            return backbone.embed(x).float().cpu().numpy(), None
        assert backbone.feature_map is not None and backbone.pool is not None
        feature_map = backbone.feature_map(x)
        pooled = backbone.pool(feature_map)
        channels_last = feature_map.permute(0, 2, 3, 1)  # N × D × h × w -> N × h × w × D
    return pooled.float().cpu().numpy(), channels_last.half().cpu().numpy()


def _batches(
    dataset: ImageDataset, indices: list[int], batch_size: int, num_workers: int, device: torch.device
) -> Iterator[ImageBatch]:
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=indices,  # ordered, only the indices of shards still to compute
        num_workers=num_workers,
        collate_fn=collate_images,
        pin_memory=device.type == "cuda",
    )
    try:
        yield from loader
    except ImageChangedError as exc:  # from a worker, torch prefixes the worker's traceback: keep the message
        message = str(exc).strip().splitlines()[-1]
        raise ImageChangedError(message.split("ImageChangedError: ", 1)[-1]) from None


def extract_features(
    paths: Sequence[Path],
    backbone: Backbone,
    *,
    cache_dir: Path,
    device: str = "auto",
    batch_size: int = 64,
    num_workers: int | None = None,
    amp: bool = False,
    shard_size: int = 2048,
    progress: bool = True,
    strict: bool = False,
    spatial: bool = False,
    image_sha256: Sequence[str | None] | None = None,
) -> ExtractionResult:
    """Features of ``paths`` from ``backbone``, read from or written to ``cache_dir``; see the module doc.

    ``image_sha256``: the digests of ``paths`` from :func:`hash_image_files`, if the caller has them
    already (they are not recomputed); by default each file is hashed here.
    """
    if batch_size < 1 or shard_size < 1:
        raise ValueError("batch_size and shard_size must be positive")
    if spatial and (backbone.feature_map is None or backbone.pool is None):
        raise ValueError(
            f"backbone {backbone.name!r} has no spatial feature map (its features are not a pooled "
            "map); choose densenet121-xrv, a ResNet or an EfficientNet for methods that need spatial tokens"
        )
    paths = [Path(p) for p in paths]
    torch_device = resolve_device(device)
    if amp and torch_device.type != "cuda":
        warnings.warn("amp=True has an effect on CUDA only; running in float32", stacklevel=2)
        amp = False
    workers = default_num_workers() if num_workers is None else num_workers
    if image_sha256 is None:
        image_sha256 = hash_image_files(paths, workers=max(1, workers))
    elif len(image_sha256) != len(paths):
        raise ValueError(f"image_sha256 holds {len(image_sha256)} digests for {len(paths)} images")
    digests = tuple(image_sha256)
    key_fields = _key_fields(digests, backbone, amp, spatial)
    entry = make_private_dirs(Path(cache_dir)) / feature_cache_key(
        digests, backbone, amp=amp, spatial=spatial
    )
    entry.mkdir(mode=PRIVATE_DIR_MODE, exist_ok=True)
    os.chmod(entry, PRIVATE_DIR_MODE)  # an entry made by an older version may be 0755

    manifest = _read_manifest(entry, key_fields)
    if manifest is None:
        manifest = {"key_fields": key_fields, "shard_size": shard_size, "shards": {}}
        image_list = "".join(
            f"{d or UNREADABLE_DIGEST}  {p.resolve()}\n" for d, p in zip(digests, paths, strict=True)
        ).encode()
        _atomic_write(entry / IMAGE_LIST_NAME, lambda handle: handle.write(image_list))
        _write_json(entry / MANIFEST_NAME, manifest)
    shard_size = manifest["shard_size"]  # an existing cache keeps the shard size it was written with
    n_images, dim = len(paths), backbone.feature_dim
    n_shards = -(-n_images // shard_size)
    completed = _completed_shards(entry, manifest, dim, spatial)
    manifest["shards"] = {str(s): record for s, record in completed.items()}
    pending = [s for s in range(n_shards) if s not in completed]

    features = np.full((n_images, dim), np.nan, dtype=np.float32)
    skip_reasons: dict[int, str] = {}
    pixel_digests: list[str | None] = [None] * n_images
    for shard, record in completed.items():
        start = shard * shard_size
        features[start : start + record["rows"]] = np.load(entry / record["file"])
        pixel_digests[start : start + record["rows"]] = record["pixel_sha256"]
        skip_reasons.update({int(i): reason for i, reason in record["skipped"].items()})
    if strict and skip_reasons:
        raise CorruptImageError(f"unreadable images recorded in the cache {entry}: {_first(skip_reasons)}")

    forward_passes = 0
    if pending:
        forward_passes = _compute_shards(
            paths,
            digests,
            backbone,
            pending,
            features,
            skip_reasons,
            pixel_digests,
            manifest,
            entry,
            device=torch_device,
            batch_size=batch_size,
            shard_size=shard_size,
            amp=amp,
            strict=strict,
            num_workers=workers,
            progress=progress,
            rows_done=sum(record["rows"] for record in completed.values()),
            spatial=spatial,
        )
    for index in sorted(skip_reasons):
        logger.warning("skipped unreadable image %d: %s", index, skip_reasons[index])
    return ExtractionResult(
        features=features,
        skipped=sorted(skip_reasons),
        skip_reasons=skip_reasons,
        forward_passes=forward_passes,
        from_cache=not pending,
        shards_computed=len(pending),
        shards_reused=len(completed),
        cache_path=entry,
        device=str(torch_device),
        maps=_feature_maps(entry, manifest, dim) if spatial else None,
        image_sha256=digests,
        pixel_sha256=tuple(pixel_digests),
    )


def _feature_maps(entry: Path, manifest: dict[str, Any], dim: int) -> FeatureMaps:
    shards = {int(s): record["maps_file"] for s, record in manifest["shards"].items()}
    grid = tuple(manifest.get("grid", (0, 0)))
    return FeatureMaps(entry, dict(sorted(shards.items())), manifest["shard_size"], grid, dim)  # type: ignore[arg-type]


def _first(skip_reasons: dict[int, str]) -> str:
    index = min(skip_reasons)
    return f"{len(skip_reasons)} image(s), first index {index}: {skip_reasons[index]}"


def _shard_range(shard: int, shard_size: int, n_images: int) -> range:
    return range(shard * shard_size, min((shard + 1) * shard_size, n_images))


def _compute_shards(
    paths: list[Path],
    digests: tuple[str | None, ...],
    backbone: Backbone,
    pending: list[int],
    features: np.ndarray,
    skip_reasons: dict[int, str],
    pixel_digests: list[str | None],
    manifest: dict[str, Any],
    entry: Path,
    *,
    device: torch.device,
    batch_size: int,
    shard_size: int,
    amp: bool,
    strict: bool,
    num_workers: int,
    progress: bool,
    rows_done: int,
    spatial: bool,
) -> int:
    """Runs the network over the pending shards, writing each as soon as it is complete."""
    n_images = len(paths)
    indices = [i for s in pending for i in _shard_range(s, shard_size, n_images)]
    buffers: dict[int, _ShardBuffer] = {}
    forward_passes = 0
    backbone.module.to(device)
    dataset = ImageDataset(paths, backbone.transform, sha256=digests)
    with _progress_bar(progress) as bar:
        task = bar.add_task(f"features {backbone.name}", total=n_images, completed=rows_done)
        for batch in _batches(dataset, indices, batch_size, num_workers, device):
            if strict and batch.skipped:
                raise CorruptImageError(batch.skipped[0][1])
            rows = np.empty((0, backbone.feature_dim), dtype=np.float32)
            maps: np.ndarray | None = None
            if batch.pixels is not None:
                rows, maps = _forward(backbone, batch.pixels, device, amp, spatial)
                forward_passes += 1
                if maps is not None:
                    maps = _record_grid(manifest, maps)
            placed = [(i, j, None) for j, i in enumerate(batch.indices)]
            placed += [(i, None, reason) for i, reason in batch.skipped]
            for index, j, reason in placed:
                shard = index // shard_size
                buffer = buffers.get(shard)
                if buffer is None:
                    rows_in_shard = len(_shard_range(shard, shard_size, n_images))
                    empty = np.full((rows_in_shard, backbone.feature_dim), np.nan, dtype=np.float32)
                    buffer = buffers[shard] = _ShardBuffer(empty, rows_in_shard)
                    buffer.pixel_sha256 = [None] * rows_in_shard
                if spatial and buffer.maps is None and "grid" in manifest:
                    buffer.maps = _empty_maps(len(buffer.features), manifest, backbone.feature_dim)
                if j is not None:
                    buffer.features[index - shard * shard_size] = rows[j]
                    if batch.pixel_sha256 is not None:
                        buffer.pixel_sha256[index - shard * shard_size] = batch.pixel_sha256[j]
                    if buffer.maps is not None and maps is not None:
                        buffer.maps[index - shard * shard_size] = maps[j]
                else:
                    buffer.skipped[index] = reason
                buffer.remaining -= 1
                if buffer.remaining == 0:
                    if spatial and buffer.maps is None:  # every image of the shard was unreadable
                        buffer.maps = _empty_maps(len(buffer.features), manifest, backbone.feature_dim)
                    _write_shard(entry, manifest, shard, buffers.pop(shard))
                    start = shard * shard_size
                    features[start : start + len(buffer.features)] = buffer.features
                    pixel_digests[start : start + len(buffer.features)] = buffer.pixel_sha256
                    skip_reasons.update(buffer.skipped)
            bar.advance(task, len(batch.indices) + len(batch.skipped))
    if buffers:  # cannot happen unless the DataLoader dropped indices
        raise RuntimeError(f"feature extraction left shards {sorted(buffers)} incomplete")
    return forward_passes


def _empty_maps(rows: int, manifest: dict[str, Any], dim: int) -> np.ndarray:
    h, w = manifest.get("grid", (0, 0))  # no grid yet: a 0-token shard, recomputed once one is known
    return np.full((rows, h * w, dim), np.nan, dtype=np.float16)


def _record_grid(manifest: dict[str, Any], maps: np.ndarray) -> np.ndarray:
    """Records the map's ``h × w`` grid (fixed by the input size) once; returns the maps as tokens."""
    grid = [int(maps.shape[1]), int(maps.shape[2])]
    if manifest.setdefault("grid", grid) != grid:
        raise RuntimeError(f"feature map of grid {grid}, but this cache entry holds {manifest['grid']}")
    return maps.reshape(len(maps), grid[0] * grid[1], maps.shape[3])


def _write_shard(entry: Path, manifest: dict[str, Any], shard: int, buffer: _ShardBuffer) -> None:
    file_name = _shard_file(shard)
    _atomic_write(entry / file_name, lambda handle: np.save(handle, buffer.features, allow_pickle=False))
    record: dict[str, Any] = {
        "file": file_name,
        "rows": len(buffer.features),
        "skipped": {str(i): reason for i, reason in sorted(buffer.skipped.items())},
        "pixel_sha256": list(buffer.pixel_sha256),
    }
    if buffer.maps is not None:
        maps_name = _maps_file(shard)
        _atomic_write(entry / maps_name, lambda handle: np.save(handle, buffer.maps, allow_pickle=False))
        record["maps_file"] = maps_name
    manifest["shards"][str(shard)] = record
    _write_json(entry / MANIFEST_NAME, manifest)
