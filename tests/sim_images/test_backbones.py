"""Backbones: registry, shapes, preprocessing ranges, weight files and their errors."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
import torchxrayvision as xrv
from PIL import Image

from secure_afl.features.backbones import (
    BACKBONES,
    UnknownBackboneError,
    WeightsMismatchError,
    WeightsNotFoundError,
    default_weights_path,
    load_backbone,
    weights_sha256,
)

from .conftest import synthetic_pixels


def gray_image(size: int = 64, value: int | None = None) -> Image.Image:
    pixels = synthetic_pixels(1, size) if value is None else np.full((size, size), value, dtype=np.uint8)
    return Image.fromarray(pixels, mode="L")


def test_registry_lists_every_backbone_of_the_paper() -> None:
    expected = {
        "densenet121-xrv",
        *(f"resnet{d}" for d in (18, 34, 50, 101, 152)),
        *(f"vgg{d}" for d in (11, 13, 16, 19)),
        *(f"efficientnet_b{i}" for i in range(8)),
    }
    assert set(BACKBONES) == expected
    assert BACKBONES["densenet121-xrv"].feature_dim == 1024
    assert BACKBONES["resnet50"].feature_dim == 2048
    assert BACKBONES["efficientnet_b7"].feature_dim == 2560


def test_densenet_xrv_input_is_one_channel_224_in_xrv_range_and_features_are_1024d() -> None:
    backbone = load_backbone("densenet121-xrv", None, random_init=True)
    # A non-square image is center-cropped on its long side, then resized, as XRayCenterCrop does.
    wide = Image.fromarray(np.tile(np.arange(256, dtype=np.uint8), (64, 1))[:, :200], mode="L")
    pixels = backbone.transform(wide)
    assert pixels.shape == (1, 224, 224) and pixels.dtype == torch.float32
    assert pixels.min() >= -1024 and pixels.max() <= 1024
    black, white = backbone.transform(gray_image(value=0)), backbone.transform(gray_image(value=255))
    assert torch.allclose(black, torch.full_like(black, -1024.0))
    assert torch.allclose(white, torch.full_like(white, 1024.0))
    features = backbone.embed(torch.stack([pixels, black]))
    assert features.shape == (2, 1024)
    assert backbone.preprocess.as_dict()["resize"] == 224


def test_densenet_xrv_transform_matches_torchxrayvision_pipeline() -> None:
    backbone = load_backbone("densenet121-xrv", None, random_init=True)
    raw = synthetic_pixels(3, 100)
    scaled = xrv.datasets.normalize(raw, 255)[None]
    reference = xrv.datasets.XRayResizer(224)(xrv.datasets.XRayCenterCrop()(scaled))
    assert np.allclose(backbone.transform(Image.fromarray(raw, mode="L")).numpy(), reference)


@pytest.mark.parametrize(("name", "dim"), [("resnet18", 512), ("efficientnet_b0", 1280), ("vgg11", 4096)])
def test_imagenet_backbones_take_normalised_rgb_224_and_return_pooled_features(name: str, dim: int) -> None:
    backbone = load_backbone(name, None, random_init=True)
    white = backbone.transform(gray_image(size=300, value=255))
    assert white.shape == (3, 224, 224)
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    assert torch.allclose(white[:, 100, 100], (1 - mean) / std, atol=1e-5)
    features = backbone.embed(torch.stack([white, backbone.transform(gray_image())]))
    assert features.shape == (2, dim) == (2, backbone.feature_dim)


def test_backbones_are_frozen_and_in_eval_mode() -> None:
    backbone = load_backbone("resnet18", None, random_init=True)
    assert not backbone.module.training
    assert all(not p.requires_grad for p in backbone.module.parameters())


def test_random_init_is_seeded_and_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = load_backbone("resnet18", None, random_init=True, random_init_seed=7)
    after = torch.rand(1)
    b = load_backbone("resnet18", None, random_init=True, random_init_seed=7)
    c = load_backbone("resnet18", None, random_init=True, random_init_seed=8)
    assert torch.equal(before, after)
    assert torch.equal(a.module.conv1.weight, b.module.conv1.weight)
    assert not torch.equal(a.module.conv1.weight, c.module.conv1.weight)
    assert a.weights_id == "random-init-seed-7" and c.weights_id == "random-init-seed-8"


def test_resnet_state_dict_saved_with_torch_save_loads_via_weights(tmp_path: Path) -> None:
    torch.manual_seed(1)
    reference = torchvision.models.resnet18(weights=None).eval()
    weight_file = tmp_path / "resnet18.pth"
    torch.save(reference.state_dict(), weight_file)
    backbone = load_backbone("resnet18", weight_file)
    reference.fc = torch.nn.Identity()
    x = backbone.transform(gray_image())[None]
    assert torch.allclose(backbone.embed(x), reference(x), atol=1e-5)
    assert backbone.weights_id == f"sha256:{hashlib.sha256(weight_file.read_bytes()).hexdigest()}"
    assert backbone.weights_path == weight_file


@pytest.mark.parametrize("whole_model", [False, True], ids=["state-dict", "pickled-model-as-xrv-publishes"])
def test_densenet_xrv_weights_load_from_a_file(tmp_path: Path, whole_model: bool) -> None:
    torch.manual_seed(2)
    reference = xrv.models.DenseNet(weights=None).eval()
    weight_file = tmp_path / "xrv.pt"
    torch.save(reference if whole_model else reference.state_dict(), weight_file)
    backbone = load_backbone("densenet121-xrv", weight_file)
    x = backbone.transform(gray_image())[None]
    assert torch.allclose(backbone.embed(x), reference.features2(x), atol=1e-4)


def test_default_xrv_weights_path_is_torchxrayvision_cache_and_missing_file_is_explained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    expected = (
        tmp_path
        / ".torchxrayvision"
        / "models_data"
        / ("mimic_ch-densenet121-d121-tw-lr001-rot45-tr15-sc15-seed0-best.pt")
    )
    assert default_weights_path("densenet121-xrv") == expected
    with pytest.raises(WeightsNotFoundError) as caught:
        load_backbone("densenet121-xrv", None)
    message = str(caught.value)
    assert isinstance(caught.value, FileNotFoundError)
    assert str(expected) in message and "densenet121-xrv" in message and "--weights FILE" in message
    assert "github.com/mlmed/torchxrayvision/releases" in message and "mimic_ch" in message


def test_missing_imagenet_weight_file_names_file_backbone_and_download_url(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "resnet18.pth"
    with pytest.raises(WeightsNotFoundError) as caught:
        load_backbone("resnet18", missing)
    message = str(caught.value)
    assert str(missing) in message and "'resnet18'" in message and "--weights FILE" in message
    assert "https://download.pytorch.org/models/resnet18-f37072fd.pth" in message


def test_state_dict_of_another_architecture_is_a_mismatch(tmp_path: Path) -> None:
    weight_file = tmp_path / "resnet34.pth"
    torch.save(torchvision.models.resnet34(weights=None).state_dict(), weight_file)
    with pytest.raises(WeightsMismatchError) as caught:
        load_backbone("resnet18", weight_file)
    assert isinstance(caught.value, ValueError)
    assert str(weight_file) in str(caught.value) and "unexpected keys" in str(caught.value)


def test_state_dict_with_wrong_shapes_is_a_mismatch(tmp_path: Path) -> None:
    weight_file = tmp_path / "resnet18-10-classes.pth"
    torch.save(torchvision.models.resnet18(weights=None, num_classes=10).state_dict(), weight_file)
    expected = r"wrong shapes: fc\.bias: file \(10,\) vs network \(1000,\)"
    with pytest.raises(WeightsMismatchError, match=expected):
        load_backbone("resnet18", weight_file)


def test_unreadable_weight_file_is_a_mismatch_naming_the_file(tmp_path: Path) -> None:
    weight_file = tmp_path / "truncated.pth"
    weight_file.write_bytes(b"PK\x03\x04 not really a checkpoint")
    for name in ("resnet18", "densenet121-xrv"):
        with pytest.raises(WeightsMismatchError, match=str(weight_file)):
            load_backbone(name, weight_file)


def test_unknown_backbone_lists_the_known_ones() -> None:
    with pytest.raises(UnknownBackboneError, match="resnet18"):
        load_backbone("resnet17", None, random_init=True)


def test_weights_sha256_hashes_files_larger_than_one_chunk(tmp_path: Path) -> None:
    blob = np.random.default_rng(0).bytes(3 * (1 << 20) + 17)
    (tmp_path / "w.bin").write_bytes(blob)
    assert weights_sha256(tmp_path / "w.bin") == hashlib.sha256(blob).hexdigest()
