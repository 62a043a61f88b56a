"""Feature extraction: correctness, the on-disk cache, resumption, skips and devices."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import secure_afl.features.extraction as features_module
from secure_afl.features.backbones import Backbone, load_backbone
from secure_afl.features.extraction import extract_features, feature_cache_key, resolve_device
from secure_afl.features.images import CorruptImageError, hash_image_files, image_sha256, load_grayscale

from .conftest import CountingEmbed, SimulatedInterruption


def counted(backbone: Backbone, fail_at: int | None = None) -> tuple[Backbone, CountingEmbed]:
    counter = CountingEmbed(backbone.embed, fail_at)
    return dataclasses.replace(backbone, embed=counter), counter


def test_densenet_xrv_features_match_a_direct_forward_pass(flat_paths: list[Path], tmp_path: Path) -> None:
    backbone = load_backbone("densenet121-xrv", None, random_init=True)
    paths = flat_paths[:5]
    result = extract_features(
        paths, backbone, cache_dir=tmp_path, batch_size=3, num_workers=2, progress=False
    )
    assert result.features.shape == (5, 1024) and result.features.dtype == np.float32
    assert result.forward_passes == 2 and not result.from_cache and result.skipped == []
    with torch.inference_mode():
        direct = backbone.embed(torch.stack([backbone.transform(load_grayscale(p)) for p in paths]))
    assert np.allclose(result.features, direct.numpy(), atol=1e-4)
    assert result.device == "cpu"


def test_second_run_reads_the_cache_without_a_dataloader_or_forward_pass(
    toy_backbone: Backbone, flat_paths: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first_backbone, first_counter = counted(toy_backbone)
    first = extract_features(
        flat_paths,
        first_backbone,
        cache_dir=tmp_path,
        batch_size=5,
        shard_size=7,
        num_workers=0,
        progress=False,
    )
    assert first_counter.calls == first.forward_passes == 5 and first.shards_computed == 4
    manifest = json.loads((first.cache_path / "manifest.json").read_text())
    assert sorted(manifest["shards"]) == ["0", "1", "2", "3"]
    listed = (first.cache_path / "images.txt").read_text().splitlines()
    assert listed == [f"{image_sha256(p)}  {p}" for p in flat_paths]  # sha256sum's format

    def no_dataloader(*args: object, **kwargs: object) -> None:
        raise AssertionError("a complete cache must not build a DataLoader")

    monkeypatch.setattr(features_module, "DataLoader", no_dataloader)
    second_backbone, second_counter = counted(toy_backbone)
    second = extract_features(flat_paths, second_backbone, cache_dir=tmp_path, progress=False)
    assert second_counter.calls == second.forward_passes == 0
    assert second.from_cache and second.shards_reused == 4 and second.shards_computed == 0
    assert second.cache_path == first.cache_path
    assert np.array_equal(second.features, first.features)


def test_interrupted_extraction_resumes_at_the_first_unfinished_shard(
    toy_backbone: Backbone, flat_paths: list[Path], tmp_path: Path
) -> None:
    # 24 images, shards of 4, batches of 2: the 6th forward pass (inside shard 2) fails.
    options = {"batch_size": 2, "shard_size": 4, "num_workers": 0, "progress": False}
    failing, _ = counted(toy_backbone, fail_at=6)
    with pytest.raises(SimulatedInterruption):
        extract_features(flat_paths, failing, cache_dir=tmp_path / "cache", **options)
    entry = tmp_path / "cache" / feature_cache_key(hash_image_files(flat_paths), toy_backbone)
    assert sorted(p.name for p in entry.glob("shard_*.npy")) == ["shard_00000.npy", "shard_00001.npy"]
    assert not list(entry.glob("*.tmp"))

    resumed_backbone, counter = counted(toy_backbone)
    resumed = extract_features(flat_paths, resumed_backbone, cache_dir=tmp_path / "cache", **options)
    assert resumed.shards_reused == 2 and resumed.shards_computed == 4
    assert counter.calls == resumed.forward_passes == 8  # 4 missing shards x 2 batches
    assert not resumed.from_cache

    uninterrupted = extract_features(flat_paths, toy_backbone, cache_dir=tmp_path / "fresh", **options)
    assert np.allclose(resumed.features, uninterrupted.features, atol=1e-6)


def test_a_lost_shard_file_is_recomputed_alone(
    toy_backbone: Backbone, flat_paths: list[Path], tmp_path: Path
) -> None:
    options = {"batch_size": 4, "shard_size": 8, "num_workers": 0, "progress": False}
    first = extract_features(flat_paths, toy_backbone, cache_dir=tmp_path, **options)
    (first.cache_path / "shard_00001.npy").unlink()
    backbone, counter = counted(toy_backbone)
    again = extract_features(flat_paths, backbone, cache_dir=tmp_path, **options)
    assert again.shards_computed == 1 and again.shards_reused == 2 and counter.calls == 2
    assert np.allclose(again.features, first.features, atol=1e-6)


def test_batches_that_straddle_shards_give_the_same_features(
    toy_backbone: Backbone, flat_paths: list[Path], tmp_path: Path
) -> None:
    straddling = extract_features(
        flat_paths,
        toy_backbone,
        cache_dir=tmp_path / "a",
        batch_size=3,
        shard_size=5,
        num_workers=2,
        progress=False,
    )
    one_batch = extract_features(
        flat_paths, toy_backbone, cache_dir=tmp_path / "b", batch_size=64, num_workers=0, progress=False
    )
    assert straddling.forward_passes == 8 and one_batch.forward_passes == 1
    assert np.isfinite(straddling.features).all()
    assert np.allclose(straddling.features, one_batch.features, atol=1e-6)


def test_cache_key_depends_on_weights_preprocessing_and_image_order(
    toy_backbone: Backbone, flat_paths: list[Path]
) -> None:
    digests = hash_image_files(flat_paths)
    key = feature_cache_key(digests, toy_backbone)
    other_weights = dataclasses.replace(toy_backbone, weights_id="random-init-seed-1")
    other_preprocess = dataclasses.replace(
        toy_backbone, preprocess=dataclasses.replace(toy_backbone.preprocess, params=(("resize", 64),))
    )
    assert (
        len(
            {
                key,
                feature_cache_key(digests, other_weights),
                feature_cache_key(digests, other_preprocess),
                feature_cache_key(digests[::-1], toy_backbone),
                feature_cache_key(digests, toy_backbone, amp=True),
            }
        )
        == 5
    )
    assert feature_cache_key(list(digests), toy_backbone) == key
    with pytest.raises(TypeError, match="digests"):
        feature_cache_key(flat_paths, toy_backbone)  # paths are not the key any more


def test_corrupt_png_is_a_counted_skip_with_a_nan_row_and_survives_the_cache(
    toy_backbone: Backbone, corrupt_data_dir: tuple[list[Path], int], tmp_path: Path
) -> None:
    paths, bad = corrupt_data_dir
    options = {"batch_size": 3, "shard_size": 4, "num_workers": 0, "progress": False}
    result = extract_features(paths, toy_backbone, cache_dir=tmp_path, **options)
    assert result.skipped == [bad] and str(paths[bad]) in result.skip_reasons[bad]
    assert np.isnan(result.features[bad]).all()
    assert np.isfinite(np.delete(result.features, bad, axis=0)).all()
    cached = extract_features(paths, toy_backbone, cache_dir=tmp_path, **options)
    assert cached.from_cache and cached.skipped == [bad] and cached.skip_reasons == result.skip_reasons


def test_strict_mode_raises_on_a_corrupt_png_fresh_or_cached(
    toy_backbone: Backbone, corrupt_data_dir: tuple[list[Path], int], tmp_path: Path
) -> None:
    paths, bad = corrupt_data_dir
    with pytest.raises(CorruptImageError, match=paths[bad].name):
        extract_features(
            paths, toy_backbone, cache_dir=tmp_path / "fresh", num_workers=0, progress=False, strict=True
        )
    extract_features(paths, toy_backbone, cache_dir=tmp_path / "cached", num_workers=0, progress=False)
    with pytest.raises(CorruptImageError, match=paths[bad].name):
        extract_features(
            paths, toy_backbone, cache_dir=tmp_path / "cached", num_workers=0, progress=False, strict=True
        )


def test_empty_image_list_needs_no_forward_pass(toy_backbone: Backbone, tmp_path: Path) -> None:
    result = extract_features([], toy_backbone, cache_dir=tmp_path, progress=False)
    assert result.features.shape == (0, 8) and result.forward_passes == 0 and result.skipped == []


def test_devices_and_amp_on_a_machine_without_cuda(
    toy_backbone: Backbone, flat_paths: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA GPU"):
        resolve_device("cuda")
    with pytest.warns(UserWarning, match="amp=True has an effect on CUDA only"):
        result = extract_features(
            flat_paths[:4], toy_backbone, cache_dir=tmp_path, amp=True, num_workers=0, progress=False
        )
    assert result.cache_path.name == feature_cache_key(
        hash_image_files(flat_paths[:4]), toy_backbone, amp=False
    )


def test_progress_bar_reports_images_per_second(
    toy_backbone: Backbone, flat_paths: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    extract_features(flat_paths, toy_backbone, cache_dir=tmp_path, batch_size=4, num_workers=0, progress=True)
    err = capsys.readouterr().err
    assert "img/s" in err and "24/24" in err
