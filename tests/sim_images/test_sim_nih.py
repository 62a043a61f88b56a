"""`secure-afl sim --dataset nih` end to end on a generated ChestXray14 look-alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torchvision
import torchxrayvision as xrv
from click.testing import CliRunner

from secure_afl.cli import main

from .conftest import nih_name, write_nih_csv, write_png

N = 72  # 54 PA rows: 37 training rows over 8 clients, 17 test rows


@pytest.fixture(scope="module")
def nih_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("nih_e2e")
    names = [nih_name(i) for i in range(N)]
    for i, name in enumerate(names):
        write_png(root / f"images_{1 + i % 2:03d}" / "images" / name, i)
    write_nih_csv(root / "labels.csv", names)
    return root


def _save(model: torch.nn.Module, path: Path) -> Path:
    torch.save(model.state_dict(), path)
    return path


def _strict_json(path: Path) -> dict:
    """results.json must be strict JSON: no NaN or Infinity even for undefined metrics."""

    def reject(constant: str) -> None:
        raise AssertionError(f"{path} holds {constant}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=reject)


def _sim(args: list[str]):
    return CliRunner().invoke(
        main, ["sim", "--dataset", "nih", "--workers", "0", "--fedavg-rounds", "1", *args]
    )


def test_densenet_xrv_end_to_end_then_cache_hit(nih_dir: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    weights = _save(xrv.models.DenseNet(weights=None), tmp_path / "densenet-random.pt")
    common = [
        "--data-dir", str(nih_dir), "--csv", str(nih_dir / "labels.csv"),
        "--backbone", "densenet121-xrv", "--weights", str(weights),
        "--missing", "7", "--cache-dir", str(tmp_path / "cache"),
    ]  # fmt: skip
    first = _sim([*common, "--out", str(tmp_path / "run1")])
    assert first.exit_code == 0, first.output
    run1 = _strict_json(tmp_path / "run1" / "results.json")
    assert run1["dataset"]["name"] == "nih" and run1["dataset"]["synthetic_features"] is False
    assert run1["dataset"]["rows"] == 54 and run1["dataset"]["images_missing"] == 0
    assert run1["dataset"]["forward_passes"] > 0 and not run1["dataset"]["features_from_cache"]
    assert "FEATURES ARE SYNTHETIC" not in first.output
    assert {"AFL (1 round)", "FedAvg"} <= set(run1["settings"][0]["metrics"])
    auc = run1["settings"][0]["metrics"]["AFL (1 round)"]["per_class"]["auc"]
    assert None in auc  # 17 test rows: some classes have no positive, so their AUC is undefined

    second = _sim([*common, "--out", str(tmp_path / "run2")])
    assert second.exit_code == 0, second.output
    run2 = _strict_json(tmp_path / "run2" / "results.json")
    assert run2["dataset"]["forward_passes"] == 0 and run2["dataset"]["features_from_cache"]
    assert run2["settings"][0]["metrics"] == run1["settings"][0]["metrics"]


def test_table3_loop_over_backbones(nih_dir: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    resnet = _save(torchvision.models.resnet18(), tmp_path / "resnet18.pth")
    effnet = _save(torchvision.models.efficientnet_b0(), tmp_path / "effb0.pth")
    result = _sim([
        "--data-dir", str(nih_dir), "--csv", str(nih_dir / "labels.csv"),
        "--backbone", "resnet18,efficientnet_b0",
        "--weights", f"resnet18={resnet}", "--weights", f"efficientnet_b0={effnet}",
        "--missing", "1,7", "--rounds", "1", "--protection", "none",
        "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "out"),
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "Table III layout" in result.output
    table = json.loads((tmp_path / "out" / "table3.json").read_text())
    assert [row[0] for row in table["rows"]] == ["resnet18", "efficientnet_b0"]
    assert table["header"][1:4] == ["M1 BACC", "M1 AUC", "M1 mAP"] and len(table["header"]) == 7
    for backbone in ("resnet18", "efficientnet_b0"):
        assert (tmp_path / "out" / backbone / "results.json").is_file()


def test_missing_weight_file_names_file_and_backbone(nih_dir: Path, tmp_path: Path) -> None:
    absent = tmp_path / "nope.pt"
    result = _sim(
        ["--data-dir", str(nih_dir), "--csv", str(nih_dir / "labels.csv"), "--weights", str(absent)]
    )
    assert result.exit_code == 1
    assert str(absent) in result.output and "densenet121-xrv" in result.output


def test_nih_without_data_dir_and_unmatched_images(tmp_path: Path) -> None:
    result = _sim([])
    assert result.exit_code == 2 and "--data-dir" in result.output
    empty = tmp_path / "empty"
    empty.mkdir()
    write_nih_csv(empty / "labels.csv", [nih_name(i) for i in range(8)])
    result = _sim(["--data-dir", str(empty), "--csv", str(empty / "labels.csv")])
    assert result.exit_code == 1 and str(empty) in result.output
