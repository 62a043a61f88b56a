"""The pre-pooling feature-map cache (FedNCA-ML's spatial tokens on real images)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from click.testing import CliRunner
from PIL import Image

from secure_afl.cli import main
from secure_afl.features.backbones import Backbone, load_backbone
from secure_afl.features.extraction import extract_features, feature_cache_key
from secure_afl.features.images import hash_image_files

from .conftest import CountingEmbed, SimulatedInterruption, nih_name, write_nih_csv, write_png


@pytest.mark.parametrize(("name", "channels", "dim"), [("densenet121-xrv", 1, 1024), ("resnet18", 3, 512)])
def test_feature_map_then_pool_is_the_pooled_feature_bit_for_bit(name: str, channels: int, dim: int) -> None:
    backbone = load_backbone(name, None, random_init=True)
    x = torch.randn(2, channels, 224, 224) * (400 if channels == 1 else 1)
    assert backbone.feature_map is not None and backbone.pool is not None
    with torch.inference_mode():
        feature_map = backbone.feature_map(x)
        assert feature_map.shape == (2, dim, 7, 7)
        assert torch.equal(backbone.pool(feature_map), backbone.embed(x))


def test_vgg_has_no_feature_map_and_spatial_extraction_refuses_it(
    flat_paths: list[Path], tmp_path: Path
) -> None:
    vgg = load_backbone("vgg11", None, random_init=True)
    assert vgg.feature_map is None
    with pytest.raises(ValueError, match=r"vgg11.*no spatial feature map.*densenet121-xrv"):
        extract_features(flat_paths[:2], vgg, cache_dir=tmp_path, spatial=True, progress=False)
    assert not any(tmp_path.iterdir())  # refused before any cache entry is made


def _spatial(toy_backbone: Backbone, counter: CountingEmbed | None = None) -> Backbone:
    """The toy network split at its pool: relu(conv) is the map, the mean over the grid the feature."""
    conv = toy_backbone.module.conv

    def feature_map(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(conv(x / 1024))

    return Backbone(
        **{
            **toy_backbone.__dict__,
            "feature_map": counter if counter is not None else feature_map,
            "pool": lambda m: m.mean(dim=(2, 3)),
        }
    )


def test_spatial_cache_holds_float16_tokens_that_pool_to_the_features(
    flat_paths: list[Path], toy_backbone: Backbone, tmp_path: Path
) -> None:
    backbone = _spatial(toy_backbone)
    options = {"cache_dir": tmp_path, "shard_size": 5, "num_workers": 0, "progress": False}
    plain = extract_features(flat_paths, backbone, **options)
    spatial = extract_features(flat_paths, backbone, spatial=True, **options)
    # a separate entry: the pooled-only key is the one it always was
    digests = hash_image_files(flat_paths)
    assert feature_cache_key(digests, backbone) == feature_cache_key(digests, backbone, spatial=False)
    assert spatial.cache_path != plain.cache_path and plain.maps is None
    np.testing.assert_array_equal(spatial.features, plain.features)  # one pass, split at the pool

    maps = spatial.maps
    assert maps is not None and maps.grid == (8, 8) and len(maps) == len(flat_paths)
    tokens = maps.tokens(np.arange(len(flat_paths)))
    assert tokens.shape == (len(flat_paths), 64, 8) and tokens.dtype == np.float32
    stored = np.load(spatial.cache_path / "maps_00000.npy")
    assert stored.dtype == np.float16 and stored.shape == (5, 64, 8)
    np.testing.assert_allclose(tokens.mean(axis=1), spatial.features, rtol=2e-3, atol=1e-4)
    # token p is grid cell (p // w, p % w), as the positional encoding assumes
    with torch.inference_mode():
        direct = backbone.feature_map(backbone.transform(Image.open(flat_paths[7]))[None])
    np.testing.assert_allclose(tokens[7, 8 * 2 + 3], direct[0, :, 2, 3].numpy(), rtol=1e-3, atol=1e-4)

    view = maps.subset(np.array([13, 2, 21]))
    np.testing.assert_array_equal(view.tokens(np.array([2, 0])), tokens[[21, 13]])


def test_spatial_cache_resumes_and_recomputes_a_lost_maps_file_alone(
    flat_paths: list[Path], toy_backbone: Backbone, tmp_path: Path
) -> None:
    counter = CountingEmbed(lambda x: torch.relu(toy_backbone.module.conv(x / 1024)), fail_at=4)
    backbone = _spatial(toy_backbone, counter)
    options = {"cache_dir": tmp_path, "shard_size": 6, "batch_size": 3, "num_workers": 0, "progress": False}
    with pytest.raises(SimulatedInterruption):
        extract_features(flat_paths, backbone, spatial=True, **options)
    counter.fail_at = None
    resumed = extract_features(flat_paths, backbone, spatial=True, **options)
    assert resumed.shards_reused == 1 and resumed.shards_computed == 3

    (resumed.cache_path / "maps_00002.npy").unlink()
    again = extract_features(flat_paths, backbone, spatial=True, **options)
    assert again.shards_computed == 1 and again.shards_reused == 3
    everything = np.arange(len(flat_paths))
    np.testing.assert_array_equal(again.maps.tokens(everything), resumed.maps.tokens(everything))

    calls = counter.calls
    cached = extract_features(flat_paths, backbone, spatial=True, **options)
    assert cached.from_cache and counter.calls == calls


def test_an_unreadable_image_has_nan_tokens(
    corrupt_data_dir: tuple[list[Path], int], toy_backbone: Backbone, tmp_path: Path
) -> None:
    paths, bad = corrupt_data_dir
    result = extract_features(
        paths, _spatial(toy_backbone), cache_dir=tmp_path, num_workers=0, progress=False, spatial=True
    )
    tokens = result.maps.tokens(np.arange(len(paths)))
    assert result.skipped == [bad]
    assert np.isnan(tokens[bad]).all() and not np.isnan(np.delete(tokens, bad, axis=0)).any()


def test_sim_fednca_on_images_trains_on_the_cached_feature_maps(tmp_path: Path) -> None:
    names = [nih_name(i) for i in range(72)]
    for i, name in enumerate(names):
        write_png(tmp_path / "data" / "images" / name, i)
    write_nih_csv(tmp_path / "data" / "labels.csv", names)
    torch.manual_seed(0)
    weights = tmp_path / "resnet18.pth"
    torch.save(torchvision.models.resnet18().state_dict(), weights)
    data = tmp_path / "data"
    args = [
        "sim", "--dataset", "nih", "--data-dir", str(data), "--csv", str(data / "labels.csv"),
        "--backbone", "resnet18", "--weights", str(weights), "--missing", "7", "--protection", "none",
        "--fedavg-rounds", "1", "--baselines", "fednca-ml", "--workers", "0",
        "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    run = json.loads((tmp_path / "out" / "results.json").read_text())
    assert run["dataset"]["feature_maps"] == "7x7 tokens of d=512, float16, cached"
    macro = run["settings"][0]["metrics"]["FedNCA-ML"]["macro"]
    assert 0.0 <= macro["bacc"] <= 1.0 and "FedNCA-ML" in result.output
    entries = [p for p in (tmp_path / "cache").iterdir() if (p / "maps_00000.npy").exists()]
    assert len(entries) == 1 and np.load(entries[0] / "maps_00000.npy").shape[1:] == (49, 512)
