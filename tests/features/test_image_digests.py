"""Images named by their content: ``features extract`` records each row's image SHA-256, the feature
cache is keyed by those digests (images overwritten under the same names get fresh features), and
feature files, the cache and their directories are private to the hospital's user (0600 / 0700)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import secure_afl.features.backbones as backbones_module
from secure_afl.features.backbones import XRayTransform
from secure_afl.features.extraction import extract_features
from secure_afl.features.file import FeatureFileError, load_feature_file, save_feature_file
from secure_afl.features.images import (
    ImageChangedError,
    ImageDataset,
    hash_image_files,
    image_sha256,
    load_grayscale,
    pixel_sha256,
)
from secure_afl.sim.data import CLASSES

from .test_feature_commands import (
    ToyNet,
    common,
    direct_features,
    features,
    load_toy,
    summary_value,
    write_csv,
    write_png,
)


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy network's weights, a local state dict (as in test_feature_commands)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = ToyNet()
    path = tmp_path_factory.mktemp("toy") / "toy.pth"
    torch.save(model.state_dict(), path)
    return path


@pytest.fixture
def toy_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    """``features extract`` loads the toy network in place of the real backbone."""
    monkeypatch.setattr(backbones_module, "load_backbone", load_toy)


def sha256_hex(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The usual umask, under which a plain open() or mkdir() gives 0644 files and 0755 directories."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def labelled_folder(root: Path, seeds: list[int]) -> tuple[Path, Path, list[Path]]:
    images = root / "images"
    paths = [write_png(images / f"{i}.png", seed) for i, seed in enumerate(seeds)]
    rows: list[list[object]] = [["image", "Effusion"]] + [[p.name, i % 2] for i, p in enumerate(paths)]
    return images, write_csv(root / "labels.csv", rows), paths


# ----------------------------------------------------------------------------------- the digests


def test_extract_records_each_rows_image_sha256_and_show_says_so(
    tmp_path: Path, weights_file: Path, toy_cli: None
) -> None:
    images, labels, paths = labelled_folder(tmp_path, [1, 2, 3])
    out = tmp_path / "f.npz"
    result = features(
        "extract", "--images", images, "--labels", labels, *common(weights_file, out, tmp_path / "c")
    )
    assert result.exit_code == 0, result.output
    file = load_feature_file(out)
    assert file.image_sha256 == tuple(sha256_hex(p) for p in paths)
    assert file.require_image_digests() == file.image_sha256
    shown = features("show", out)
    assert summary_value(shown.output, "image digests").startswith("present (SHA-256 of each image file: 3 ")
    as_json = json.loads(features("show", "--json", out).output)
    assert as_json["image_digests"] is True and as_json["distinct_images"] == 3


def test_identical_image_files_keep_both_rows_with_one_digest(
    tmp_path: Path, weights_file: Path, toy_cli: None
) -> None:
    images, labels, paths = labelled_folder(tmp_path, [5, 6])
    shutil.copyfile(paths[0], images / "copy.png")
    write_csv(labels, [["image", "Effusion"], ["0.png", 1], ["1.png", 0], ["copy.png", 0]])
    out = tmp_path / "f.npz"
    result = features(
        "extract", "--images", images, "--labels", labels, *common(weights_file, out, tmp_path / "c")
    )
    assert result.exit_code == 0, result.output
    file = load_feature_file(out)
    assert file.image_ids == ("0.png", "1.png", "copy.png")
    assert (
        file.image_sha256 is not None and file.image_sha256[0] == file.image_sha256[2] != file.image_sha256[1]
    )
    assert "note: 1 images have the same bytes as another image read here" in result.output
    assert "2 distinct images; 1 rows repeat another row's image bytes" in features("show", out).output


def _save(path: Path, **extra: object) -> None:
    save_feature_file(
        path,
        np.ones((2, 3), np.float32),
        classes=CLASSES,
        backbone="toy",
        weights_id="sha256:00",
        preprocessing="{}",
        labels=np.eye(2, len(CLASSES), dtype=np.uint8),
        active=(0, 1),
        **extra,  # type: ignore[arg-type]
    )


def test_a_file_without_digests_loads_but_is_refused_where_digests_are_required(tmp_path: Path) -> None:
    path = tmp_path / "old.npz"
    _save(path)
    file = load_feature_file(path)
    assert file.image_sha256 is None and file.features.shape == (2, 3)
    with pytest.raises(FeatureFileError) as refused:
        file.require_image_digests()
    message = str(refused.value)
    assert str(path) in message and "re-extract with `secure-afl features extract`" in message
    shown = features("show", path)
    assert shown.exit_code == 0 and summary_value(shown.output, "image digests").startswith("absent")
    assert "re-extract with `secure-afl features extract`" in shown.output
    assert json.loads(features("show", "--json", path).output)["image_digests"] is False


@pytest.mark.parametrize(
    "digests, complaint",
    [
        (["ab" * 32], "one digest per feature row (2)"),  # one digest for two rows
        (["ab" * 32, "AB" * 32], "row 1 is 'ABAB"),  # upper case
        (["ab" * 32, "ab" * 31], "not a SHA-256 digest"),  # 62 digits
        (["ab" * 32, "sha256:" + "ab" * 32], "64 lowercase hex digits"),  # prefixed
    ],
)
def test_malformed_digests_are_refused_and_nothing_is_written(
    tmp_path: Path, digests: list[str], complaint: str
) -> None:
    path = tmp_path / "f.npz"
    with pytest.raises(FeatureFileError, match="image_sha256") as refused:
        _save(path, image_sha256=digests)
    assert complaint in str(refused.value)
    assert not path.exists() and not list(tmp_path.iterdir())
    # the same check on reading a file written by something else
    arrays = {name: value for name, value in np.load(_written(tmp_path / "ok.npz")).items()}
    arrays["image_sha256"] = np.array(digests, dtype=str)
    np.savez(tmp_path / "foreign.npz", **arrays)
    with pytest.raises(FeatureFileError, match="image_sha256"):
        load_feature_file(tmp_path / "foreign.npz")


def _written(path: Path) -> Path:
    _save(path, image_sha256=["ab" * 32, "cd" * 32])
    return path


def test_hashing_streams_the_bytes_and_marks_unreadable_files(tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom((1 << 20) * 2 + 17))  # spans three 1 MiB chunks
    small = write_png(tmp_path / "a.png", 1)
    assert image_sha256(big) == sha256_hex(big)
    for workers in (1, 3):
        assert hash_image_files([small, tmp_path / "absent.png", big], workers=workers) == (
            sha256_hex(small),
            None,
            sha256_hex(big),
        )


def test_an_image_changed_after_it_was_hashed_is_not_decoded_under_the_old_digest(
    tmp_path: Path, weights_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_png(tmp_path / "a.png", 1)
    digest = image_sha256(path)
    write_png(path, 2)  # overwritten between hashing and decoding
    with pytest.raises(ImageChangedError, match="changed since it was hashed") as raised:
        ImageDataset([path], XRayTransform(32), sha256=[digest])[0]
    assert str(path) in str(raised.value)
    assert ImageDataset([path], XRayTransform(32), sha256=[image_sha256(path)])[0].pixels is not None

    # through the extraction: it stops, and the cache does not record the image as skipped
    paths = [write_png(tmp_path / "img" / f"{i}.png", i) for i in range(4)]
    digests = hash_image_files(paths)
    write_png(paths[3], 99)
    backbone = load_toy("toy", weights_file)
    options = {
        "cache_dir": tmp_path / "cache",
        "num_workers": 0,
        "progress": False,
        "shard_size": 2,
        "batch_size": 2,
    }
    with pytest.raises(ImageChangedError):
        extract_features(paths, backbone, image_sha256=digests, **options)
    (entry,) = (tmp_path / "cache").iterdir()
    manifest = json.loads((entry / "manifest.json").read_text())
    assert sorted(manifest["shards"]) == ["0"] and manifest["shards"]["0"]["skipped"] == {}
    with pytest.raises(ImageChangedError) as from_worker:  # the same from a DataLoader worker process
        extract_features(paths, backbone, image_sha256=digests, **{**options, "num_workers": 2})
    assert str(from_worker.value).startswith(f"{paths[3]}: changed since it was hashed")
    # the CLI says what happened and writes nothing
    monkeypatch.setattr(backbones_module, "load_backbone", load_toy)
    monkeypatch.setattr(
        "secure_afl.features.images.hash_image_files", lambda paths, workers=1: tuple(digests)
    )
    out = tmp_path / "f.npz"
    result = features("extract", "--images", tmp_path / "img", *common(weights_file, out, tmp_path / "c2"))
    assert result.exit_code == 1 and "ImageChangedError" in result.output and str(paths[3]) in result.output
    assert not out.exists()


# ------------------------------------------------------------------ the cache, keyed by content


def test_stale_cache_reproducer_overwritten_images_get_fresh_features(
    tmp_path: Path, weights_file: Path, toy_cli: None
) -> None:
    """The stale-cache reproducer: extract, overwrite the images under the same names, extract again."""
    reference = load_toy("resnet18", weights_file)
    images, labels, paths = labelled_folder(tmp_path, [1, 2, 3, 4])
    out, cache = tmp_path / "f.npz", tmp_path / "cache"
    args = ["extract", "--images", images, "--labels", labels, *common(weights_file, out, cache)]
    first = features(*args)
    assert first.exit_code == 0, first.output
    old = load_feature_file(out)
    assert np.allclose(old.features, direct_features(reference, paths), atol=1e-5)

    for i, path in enumerate(paths):  # new images, the same names, the same labels CSV
        write_png(path, 100 + i)
    second = features(*args)
    assert second.exit_code == 0, second.output
    assert "1 computed, 0 reused" in second.output  # a new cache entry, not the old one
    new = load_feature_file(out)
    fresh = direct_features(reference, paths)
    assert np.allclose(new.features, fresh, atol=1e-5)
    assert not np.allclose(new.features, old.features, atol=1e-3)  # the old features would be stale
    assert new.image_sha256 == tuple(sha256_hex(p) for p in paths) != old.image_sha256

    # the same bytes under other names and folders are the same images: the entry is reused
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    for i, path in enumerate(paths):
        shutil.copyfile(path, moved / f"renamed-{i}.png")
    write_csv(
        tmp_path / "moved.csv", [["image", "Effusion"]] + [[f"renamed-{i}.png", i % 2] for i in range(4)]
    )
    third = features(
        "extract", "--images", moved, "--labels", tmp_path / "moved.csv", *common(weights_file, out, cache)
    )
    assert third.exit_code == 0, third.output
    assert "0 forward passes" in third.output and "0 computed, 1 reused" in third.output
    assert np.array_equal(load_feature_file(out).features, new.features)


def test_one_overwritten_image_in_a_library_call_is_recomputed(tmp_path: Path, weights_file: Path) -> None:
    backbone = load_toy("toy", weights_file)
    paths = [write_png(tmp_path / "img" / f"{i}.png", i) for i in range(3)]
    options = {"cache_dir": tmp_path / "cache", "num_workers": 0, "progress": False}
    before = extract_features(paths, backbone, **options)
    write_png(paths[1], 50)
    after = extract_features(paths, backbone, **options)
    assert after.cache_path != before.cache_path and after.forward_passes == 1
    assert after.image_sha256[1] == sha256_hex(paths[1]) != before.image_sha256[1]
    assert np.allclose(after.features, direct_features(backbone, paths), atol=1e-5)
    assert np.array_equal(after.features[[0, 2]], before.features[[0, 2]])


# ------------------------------------------------------------------------------------ file modes


def test_feature_file_cache_and_their_new_directories_are_private(
    tmp_path: Path, weights_file: Path, toy_cli: None, umask_022: None
) -> None:
    images, labels, _ = labelled_folder(tmp_path, [1, 2])
    out = tmp_path / "new" / "dir" / "f.npz"
    cache = tmp_path / "cache-root" / "features"
    result = features("extract", "--images", images, "--labels", labels, *common(weights_file, out, cache))
    assert result.exit_code == 0, result.output
    assert mode(out) == 0o600
    assert mode(out.parent) == mode(out.parent.parent) == 0o700  # created by extract
    assert mode(cache) == mode(cache.parent) == 0o700
    (entry,) = cache.iterdir()
    assert mode(entry) == 0o700
    files = list(entry.iterdir())
    assert {p.name for p in files} >= {"manifest.json", "images.txt", "shard_00000.npy"}
    assert all(mode(p) == 0o600 for p in files), {p.name: oct(mode(p)) for p in files}


def test_an_existing_world_readable_feature_file_is_replaced_by_a_private_one(
    tmp_path: Path, umask_022: None
) -> None:
    path = tmp_path / "f.npz"
    path.write_bytes(b"old")
    path.chmod(0o644)
    existing = tmp_path / "shared"
    existing.mkdir(mode=0o755)
    _save(path)
    assert mode(path) == 0o600
    _save(existing / "g.npz")
    assert mode(existing / "g.npz") == 0o600 and mode(existing) == 0o755  # not ours to change
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.npz", "shared"]  # no temporary left


def test_a_cache_entry_left_0755_by_an_older_version_is_made_private(
    tmp_path: Path, weights_file: Path
) -> None:
    backbone = load_toy("toy", weights_file)
    paths = [write_png(tmp_path / "img" / f"{i}.png", i) for i in range(2)]
    first = extract_features(paths, backbone, cache_dir=tmp_path / "cache", num_workers=0, progress=False)
    first.cache_path.chmod(0o755)
    again = extract_features(paths, backbone, cache_dir=tmp_path / "cache", num_workers=0, progress=False)
    assert again.from_cache and mode(again.cache_path) == 0o700


def test_png_fixture_images_are_what_the_digests_name(tmp_path: Path) -> None:
    """The digest is of the file's bytes, not its pixels: a re-encoded copy is another file."""
    path = write_png(tmp_path / "a.png", 3)
    Image.open(path).save(tmp_path / "b.png", optimize=True)
    same_pixels = np.array_equal(np.asarray(Image.open(path)), np.asarray(Image.open(tmp_path / "b.png")))
    assert same_pixels and image_sha256(path) != image_sha256(tmp_path / "b.png")


# ----------------------------------------------------------------------- the decoded images' digests


def test_pixel_digests_survive_a_lossless_re_export_and_the_cache(
    tmp_path: Path, weights_file: Path, toy_cli: None
) -> None:
    images, labels, paths = labelled_folder(tmp_path, [1, 2])
    Image.open(paths[0]).save(images / "re-exported.png", optimize=True)  # same pixels, other bytes
    write_csv(labels, [["image", "Effusion"], ["0.png", 1], ["1.png", 0], ["re-exported.png", 1]])
    out, cache = tmp_path / "f.npz", tmp_path / "cache"
    args = ["extract", "--images", images, "--labels", labels, *common(weights_file, out, cache)]
    first = features(*args)
    assert first.exit_code == 0, first.output
    file = load_feature_file(out)
    expected = tuple(pixel_sha256(load_grayscale(images / name)) for name in file.image_ids)
    assert file.pixel_sha256 == expected
    assert file.pixel_sha256[0] == file.pixel_sha256[2] != file.pixel_sha256[1]
    assert file.image_sha256 is not None and file.image_sha256[0] != file.image_sha256[2]
    assert "note: 1 further images decode to the same pixels" in first.output
    assert "1 rows repeat another row's pixels" in summary_value(
        features("show", out).output, "pixel digests"
    )
    again = features(*args)  # from the cache: the pixel digests come from its manifest
    assert again.exit_code == 0 and "0 forward passes" in again.output
    assert load_feature_file(out).pixel_sha256 == expected


def test_pixel_digest_is_of_size_and_pixels() -> None:
    pixels = np.arange(12, dtype=np.uint8).reshape(3, 4)
    base = pixel_sha256(Image.fromarray(pixels, mode="L"))
    assert base == pixel_sha256(Image.fromarray(pixels, mode="L").convert("RGB"))  # gray either way
    assert base != pixel_sha256(Image.fromarray(pixels.reshape(4, 3), mode="L"))  # same bytes, other shape
    changed = pixels.copy()
    changed[1, 1] += 1
    assert base != pixel_sha256(Image.fromarray(changed, mode="L"))
