"""Frozen feature backbones for the ChestXray14 experiment (SPEC §4, paper Tables II and III).

Public API
----------
``BACKBONES``
    Read-only mapping ``name -> BackboneInfo`` of the supported backbones:
    ``densenet121-xrv``, ``resnet18|34|50|101|152``, ``vgg11|13|16|19``, ``efficientnet_b0`` … ``b7``.
``load_backbone(name, weights, *, random_init=False, random_init_seed=0) -> Backbone``
    Builds the network without downloading anything, loads its weights from a local file, freezes it
    (``requires_grad_(False)``, eval mode) and returns a :class:`Backbone`.
``default_weights_path(name) -> Path``
    Where a weight file is looked for when ``weights`` is ``None``.
``weights_sha256(path) -> str``
    Hex SHA-256 of a weight file, hashed in chunks (part of the feature-cache key).
``WeightsError``, ``WeightsNotFoundError(WeightsError, FileNotFoundError)``,
``WeightsMismatchError(WeightsError, ValueError)``, ``UnknownBackboneError(KeyError)``
    Errors; their messages name the file, the backbone, where such weights are published and
    what to pass (``--weights FILE``).

A :class:`Backbone` carries ``module`` (the frozen ``torch.nn.Module``), ``embed`` (batch tensor ->
``N x feature_dim`` features; wrap it to count or interrupt forward passes), ``feature_dim``,
``transform`` (``PIL.Image -> torch.Tensor``, picklable so DataLoader workers can use it),
``preprocess`` (a :class:`Preprocess` description that enters the cache key) and ``weights_id``
(``"sha256:<hex>"`` of the weight file, or ``"random-init-seed-<N>"``).

Features
--------
- ``densenet121-xrv``: TorchXRayVision DenseNet-121 with the ``densenet121-res224-mimic_ch`` weights;
  features are ``model.features2(x)`` (ReLU + global average pool of the last dense block), 1024-d.
  Input: the PNG as 8-bit grayscale, scaled to [-1024, 1024] by ``xrv.datasets.normalize(img, 255)``,
  then ``xrv.datasets.XRayCenterCrop`` (square crop of the long side) and ``XRayResizer(224)``
  (skimage), i.e. exactly TorchXRayVision's own pipeline; tensor shape ``1 x 224 x 224``.
- torchvision ImageNet models: the features are the input of the final ``Linear`` layer, the same
  rule for every family: ResNet: the pooled 512/2048-d vector (``fc`` replaced by identity);
  EfficientNet: the pooled 1280…2560-d vector (``classifier`` replaced by identity); VGG: the 4096-d
  penultimate fully connected layer fc7 after its ReLU (dropout is inactive in eval mode).
  Note that VGG's 4096-d features make each client's Gram matrix 16x larger than ResNet-18's.
  Input: the grayscale PNG replicated to RGB, resized (short side) to 256, center-cropped to 224,
  scaled to [0, 1] and normalised with the ImageNet mean and std, using the weights' own torchvision
  preset (``<Model>_Weights.IMAGENET1K_V1.transforms(resize_size=256, crop_size=224)``; bilinear for
  ResNet and VGG, bicubic for EfficientNet). All EfficientNets run at 224 (B1…B7 were trained at
  240…600), as the experiment prescribes one input size for Table III.

Weight files
------------
Nothing is downloaded. ``weights=None`` means the file is looked for where the libraries themselves
cache it (see :func:`default_weights_path`): TorchXRayVision's cache directory
(``~/.torchxrayvision/models_data/mimic_ch-densenet121-d121-tw-lr001-rot45-tr15-sc15-seed0-best.pt``)
or torch hub's checkpoint directory (``~/.cache/torch/hub/checkpoints/resnet18-f37072fd.pth`` …).
A file may hold a state dict (``torch.save(model.state_dict(), f)``) or, for ``densenet121-xrv``
only, a whole pickled model as TorchXRayVision publishes it; the latter needs ``torch.load(...,
weights_only=False)``, which can run code from the file, so only the file published by
TorchXRayVision should be used that way (TorchXRayVision loads it the same way).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
import torchvision
import torchxrayvision as xrv
from PIL import Image
from torch import nn

__all__ = [
    "BACKBONES",
    "Backbone",
    "BackboneInfo",
    "Preprocess",
    "UnknownBackboneError",
    "WeightsError",
    "WeightsMismatchError",
    "WeightsNotFoundError",
    "XRayTransform",
    "default_weights_path",
    "load_backbone",
    "weights_sha256",
]

XRV_WEIGHTS_NAME = "densenet121-res224-mimic_ch"
XRV_INPUT_SIZE = 224
IMAGENET_RESIZE = 256
IMAGENET_CROP = 224
_HASH_CHUNK_BYTES = 1 << 20


class WeightsError(Exception):
    """A backbone's weight file is missing, unreadable or does not fit the network."""


class WeightsNotFoundError(WeightsError, FileNotFoundError):
    """The weight file does not exist."""


class WeightsMismatchError(WeightsError, ValueError):
    """The weight file cannot be read, or its keys or tensor shapes do not match the network."""


class UnknownBackboneError(KeyError):
    """The backbone name is not in :data:`BACKBONES`."""

    def __str__(self) -> str:  # KeyError would print the message repr()-quoted
        return str(self.args[0])


@dataclass(frozen=True)
class Preprocess:
    """What is done to a PNG before the network sees it; enters the feature-cache key."""

    name: str
    params: tuple[tuple[str, Any], ...]

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, **dict(self.params)}


@dataclass(frozen=True)
class BackboneInfo:
    """Static facts about one supported backbone."""

    name: str
    family: str  # "xrv-densenet", "resnet", "vgg" or "efficientnet"
    feature_dim: int
    published_at: str  # where its pretrained weights are published


@dataclass(frozen=True, eq=False)
class Backbone:
    """A frozen feature extractor ready for :func:`secure_afl.features.extraction.extract_features`."""

    name: str
    module: nn.Module
    embed: Callable[[torch.Tensor], torch.Tensor]
    feature_dim: int
    transform: Callable[[Image.Image], torch.Tensor]
    preprocess: Preprocess
    weights_id: str
    weights_path: Path | None
    # The same forward pass split at the global pool, for methods that attend over spatial tokens
    # (FedNCA-ML): ``embed(x)`` equals ``pool(feature_map(x))`` bit for bit, because both run the same
    # operations.  None where the features are not a pooled map (VGG's fc7).
    feature_map: Callable[[torch.Tensor], torch.Tensor] | None = None
    pool: Callable[[torch.Tensor], torch.Tensor] | None = None


class XRayTransform:
    """TorchXRayVision's preprocessing: 8-bit grayscale -> [-1024, 1024], center crop, resize.

    A class rather than a closure so that DataLoader workers can pickle it.
    """

    def __init__(self, size: int = XRV_INPUT_SIZE) -> None:
        self.size = size
        self._crop = xrv.datasets.XRayCenterCrop()
        self._resize = xrv.datasets.XRayResizer(size)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        pixels = np.asarray(image.convert("L"))
        scaled = xrv.datasets.normalize(pixels, 255)[None, :, :]
        return torch.from_numpy(np.ascontiguousarray(self._resize(self._crop(scaled))))


class RGBImageNetTransform:
    """Grayscale PIL image -> RGB -> torchvision's ImageNet preset (resize, crop, normalise)."""

    def __init__(self, preset: Callable[[Any], torch.Tensor]) -> None:
        self._preset = preset

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return self._preset(image.convert("RGB"))


# torchvision builder name -> (its weights enum, feature dim = in_features of the final Linear)
_TORCHVISION_MODELS: dict[str, tuple[str, int]] = {
    "resnet18": ("ResNet18_Weights", 512),
    "resnet34": ("ResNet34_Weights", 512),
    "resnet50": ("ResNet50_Weights", 2048),
    "resnet101": ("ResNet101_Weights", 2048),
    "resnet152": ("ResNet152_Weights", 2048),
    "vgg11": ("VGG11_Weights", 4096),
    "vgg13": ("VGG13_Weights", 4096),
    "vgg16": ("VGG16_Weights", 4096),
    "vgg19": ("VGG19_Weights", 4096),
    **{
        f"efficientnet_b{i}": (f"EfficientNet_B{i}_Weights", dim)
        for i, dim in enumerate((1280, 1280, 1408, 1536, 1792, 2048, 2304, 2560))
    },
}


def _imagenet_weights_enum(name: str) -> Any:
    return getattr(torchvision.models, _TORCHVISION_MODELS[name][0]).IMAGENET1K_V1


def _xrv_weights_url() -> str:
    return xrv.models.model_urls[XRV_WEIGHTS_NAME]["weights_url"]


def _family(name: str) -> str:
    if name == "densenet121-xrv":
        return "xrv-densenet"
    return next(f for f in ("resnet", "vgg", "efficientnet") if name.startswith(f))


def _build_registry() -> Mapping[str, BackboneInfo]:
    infos = {
        "densenet121-xrv": BackboneInfo(
            "densenet121-xrv",
            "xrv-densenet",
            1024,
            f"TorchXRayVision's GitHub releases ({XRV_WEIGHTS_NAME}): {_xrv_weights_url()}",
        )
    }
    for name, (_, dim) in _TORCHVISION_MODELS.items():
        url = _imagenet_weights_enum(name).url
        infos[name] = BackboneInfo(
            name,
            _family(name),
            dim,
            f"torchvision's model docs (https://pytorch.org/vision/stable/models.html), "
            f"ImageNet IMAGENET1K_V1 weights: {url}",
        )
    return MappingProxyType(infos)


BACKBONES: Mapping[str, BackboneInfo] = _build_registry()


def _info(name: str) -> BackboneInfo:
    try:
        return BACKBONES[name]
    except KeyError:
        raise UnknownBackboneError(
            f"unknown backbone {name!r}; choose one of: {', '.join(BACKBONES)}"
        ) from None


def default_weights_path(name: str) -> Path:
    """The file looked for when no ``--weights FILE`` is given: where the library itself caches it."""
    _info(name)
    if name == "densenet121-xrv":
        return Path(xrv.utils.get_cache_dir()).expanduser() / Path(_xrv_weights_url()).name
    url = _imagenet_weights_enum(name).url
    return Path(torch.hub.get_dir()) / "checkpoints" / Path(url).name


def weights_sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks (weight files are up to ~500 MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _where_to_get(info: BackboneInfo, path: Path) -> str:
    return (
        f"Such weights are published at {info.published_at}. Save the file locally and pass "
        f"--weights FILE (Python: load_backbone({info.name!r}, Path(FILE))), or put it at "
        f"{default_weights_path(info.name)}."
    )


def _read_state_dict(path: Path, info: BackboneInfo) -> dict[str, torch.Tensor]:
    """Loads a state dict, or a whole pickled model for densenet121-xrv (TorchXRayVision's format)."""
    if not path.is_file():
        raise WeightsNotFoundError(
            f"weight file {path} for backbone {info.name!r} not found. {_where_to_get(info, path)}"
        )
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as safe_load_error:
        # TorchXRayVision publishes whole pickled models; only that backbone accepts one.
        if info.family != "xrv-densenet":
            raise WeightsMismatchError(
                f"weight file {path} for backbone {info.name!r} is not a plain state dict "
                f"({safe_load_error.__class__.__name__}). {_where_to_get(info, path)}"
            ) from safe_load_error
        loaded = _load_pickled_model(path, info)
    except Exception as error:  # torch raises RuntimeError, EOFError, zipfile errors … on bad files
        raise WeightsMismatchError(
            f"cannot read weight file {path} for backbone {info.name!r}: {error}. {_where_to_get(info, path)}"
        ) from error
    if isinstance(loaded, nn.Module):
        # Modules pickled by old torch versions lack this attribute (pytorch/pytorch#42242).
        for submodule in loaded.modules():
            if not hasattr(submodule, "_non_persistent_buffers_set"):
                submodule._non_persistent_buffers_set = set()
        loaded = loaded.state_dict()
    if isinstance(loaded, Mapping) and "state_dict" in loaded and isinstance(loaded["state_dict"], Mapping):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, Mapping) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise WeightsMismatchError(
            f"weight file {path} for backbone {info.name!r} holds a {type(loaded).__name__}, not a state "
            f"dict of tensors. {_where_to_get(info, path)}"
        )
    return dict(loaded)


def _load_pickled_model(path: Path, info: BackboneInfo) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:
        raise WeightsMismatchError(
            f"cannot read weight file {path} for backbone {info.name!r}: {error}. {_where_to_get(info, path)}"
        ) from error


def _load_into(
    module: nn.Module, state_dict: dict[str, torch.Tensor], path: Path, info: BackboneInfo
) -> None:
    # TorchXRayVision registers op_threshs as a buffer that may be None; it plays no part in features.
    state_dict = {k: v for k, v in state_dict.items() if k != "op_threshs"}
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    wrong_shape = sorted(
        f"{k}: file {tuple(state_dict[k].shape)} vs network {tuple(expected[k].shape)}"
        for k in set(expected) & set(state_dict)
        if state_dict[k].shape != expected[k].shape
    )
    if missing or unexpected or wrong_shape:
        problems = []
        for label, items in (
            ("missing keys", missing),
            ("unexpected keys", unexpected),
            ("wrong shapes", wrong_shape),
        ):
            if items:
                shown = ", ".join(items[:5]) + (f", … ({len(items)} in all)" if len(items) > 5 else "")
                problems.append(f"{label}: {shown}")
        raise WeightsMismatchError(
            f"weight file {path} does not fit backbone {info.name!r} ({'; '.join(problems)}). "
            f"{_where_to_get(info, path)}"
        )
    module.load_state_dict(state_dict, strict=True)


def _build_xrv() -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    labels = xrv.models.model_urls[XRV_WEIGHTS_NAME]["labels"]
    # weights=None: build the architecture only; TorchXRayVision would otherwise download.
    model = xrv.models.DenseNet(weights=None, num_classes=len(labels))
    return model, model.features2


def _build_torchvision(name: str) -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    model = getattr(torchvision.models, name)(weights=None)
    return model, model


class _XrvFeatureMap:
    """DenseNet-121 (TorchXRayVision) up to the pool of ``features2``: ReLU of the last dense block."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self.model, "input_resolution"):  # as features2 does
            x = xrv.models.utils.fix_resolution(x, self.model.input_resolution, self.model)
            xrv.models.utils.warn_normalization(x)
        return nn.functional.relu(self.model.features(x))


def _xrv_pool(feature_map: torch.Tensor) -> torch.Tensor:
    return nn.functional.adaptive_avg_pool2d(feature_map, (1, 1)).view(feature_map.size(0), -1)


class _ResNetFeatureMap:
    """A torchvision ResNet's forward pass up to its global average pool (the output of layer4)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.model
        x = m.maxpool(m.relu(m.bn1(m.conv1(x))))
        return m.layer4(m.layer3(m.layer2(m.layer1(x))))


class _TorchvisionPool:
    """The model's own ``avgpool`` then flatten, as its forward pass does after the feature map."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, feature_map: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.model.avgpool(feature_map), 1)


def _spatial_split(
    family: str, module: nn.Module
) -> tuple[Callable[[torch.Tensor], torch.Tensor] | None, Callable[[torch.Tensor], torch.Tensor] | None]:
    """``(feature_map, pool)`` with ``pool(feature_map(x)) == embed(x)``; (None, None) for VGG."""
    if family == "xrv-densenet":
        return _XrvFeatureMap(module), _xrv_pool
    if family == "resnet":
        return _ResNetFeatureMap(module), _TorchvisionPool(module)
    if family == "efficientnet":
        return module.features, _TorchvisionPool(module)
    return None, None  # VGG: the features are fc7, a fully connected layer with no spatial layout


def _strip_head(name: str, model: nn.Module) -> None:
    """Makes a torchvision classifier return the input of its final Linear layer."""
    family = _family(name)
    if family == "resnet":
        model.fc = nn.Identity()
    elif family == "efficientnet":
        model.classifier = nn.Identity()
    elif family == "vgg":
        model.classifier[-1] = nn.Identity()  # keep fc6, fc7 and their ReLU/Dropout


def _preprocess_for(name: str) -> tuple[Preprocess, Callable[[Image.Image], torch.Tensor]]:
    if _family(name) == "xrv-densenet":
        spec = Preprocess(
            "xrv-grayscale",
            (
                ("channels", 1),
                ("scale", "xrv.datasets.normalize(img, 255) -> [-1024, 1024]"),
                ("crop", "XRayCenterCrop"),
                ("resize", XRV_INPUT_SIZE),
                ("resize_engine", "skimage"),
            ),
        )
        return spec, XRayTransform(XRV_INPUT_SIZE)
    preset = _imagenet_weights_enum(name).transforms(resize_size=IMAGENET_RESIZE, crop_size=IMAGENET_CROP)
    spec = Preprocess(
        "imagenet-rgb",
        (
            ("channels", 3),
            ("gray_to_rgb", "PIL convert('RGB')"),
            ("resize", IMAGENET_RESIZE),
            ("crop", IMAGENET_CROP),
            ("interpolation", preset.interpolation.value),
            ("mean", tuple(preset.mean)),
            ("std", tuple(preset.std)),
        ),
    )
    return spec, RGBImageNetTransform(preset)


def load_backbone(
    name: str,
    weights: Path | None,
    *,
    random_init: bool = False,
    random_init_seed: int = 0,
) -> Backbone:
    """Builds backbone ``name``, loads ``weights`` (or the default file), freezes it.

    ``random_init=True`` skips the weight file and initialises the network from
    ``random_init_seed`` (in a forked RNG, so the caller's global torch RNG is left untouched); it is
    meant for tests and smoke runs, and its ``weights_id`` is ``"random-init-seed-<N>"``.
    Raises :class:`UnknownBackboneError`, :class:`WeightsNotFoundError` or :class:`WeightsMismatchError`.
    """
    info = _info(name)
    weights_path: Path | None = None
    if random_init:
        if weights is not None:
            raise ValueError("pass either weights or random_init=True, not both")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(random_init_seed)
            module, embed = _build_xrv() if info.family == "xrv-densenet" else _build_torchvision(name)
        weights_id = f"random-init-seed-{random_init_seed}"
    else:
        weights_path = Path(weights).expanduser() if weights is not None else default_weights_path(name)
        state_dict = _read_state_dict(weights_path, info)
        module, embed = _build_xrv() if info.family == "xrv-densenet" else _build_torchvision(name)
        _load_into(module, state_dict, weights_path, info)
        weights_id = f"sha256:{weights_sha256(weights_path)}"
    _strip_head(name, module)
    module.requires_grad_(False)
    module.eval()
    preprocess, transform = _preprocess_for(name)
    feature_map, pool = _spatial_split(info.family, module)
    return Backbone(
        name=name,
        module=module,
        embed=embed,
        feature_dim=info.feature_dim,
        transform=transform,
        preprocess=preprocess,
        weights_id=weights_id,
        weights_path=weights_path,
        feature_map=feature_map,
        pool=pool,
    )
