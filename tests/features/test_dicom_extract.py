"""``features extract`` on a folder of DICOM files (written here with pydicom): read like the PNGs of the
same display pixels, digests of the DICOM bytes recorded, a compressed file without a decoder left out
with the reason and how to convert it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pydicom
import pytest
import torch
from PIL import Image
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.encaps import encapsulate
from pydicom.uid import ExplicitVRLittleEndian, JPEGLSLossless, SecondaryCaptureImageStorage, generate_uid

import secure_afl.features.backbones as backbones_module
from secure_afl.features.file import load_feature_file

from .test_feature_commands import ToyNet, common, direct_features, features, load_toy, write_csv


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = ToyNet()
    path = tmp_path_factory.mktemp("toy") / "toy.pth"
    torch.save(model.state_dict(), path)
    return path


@pytest.fixture
def toy_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backbones_module, "load_backbone", load_toy)


def write_dicom(path: Path, pixels: np.ndarray, photometric: str = "MONOCHROME2") -> Path:
    """An 8-bit single-frame grayscale DICOM file, uncompressed."""
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.MediaStorageSOPClassUID = SecondaryCaptureImageStorage
    ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.SOPClassUID, ds.SOPInstanceUID = SecondaryCaptureImageStorage, ds.file_meta.MediaStorageSOPInstanceUID
    ds.Rows, ds.Columns = pixels.shape
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, photometric
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 8, 8, 7, 0
    ds.PixelData = pixels.astype(np.uint8).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(path, enforce_file_format=True)
    return path


def pixels_of(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (48, 48), dtype=np.uint8)


def test_a_folder_of_dicom_files_extracts_like_the_same_pngs(
    tmp_path: Path, weights_file: Path, toy_cli: None
) -> None:
    images = tmp_path / "dicom"
    a = write_dicom(images / "a.dcm", pixels_of(1))
    b = write_dicom(
        images / "b.dicom", 255 - pixels_of(2), photometric="MONOCHROME1"
    )  # displays pixels_of(2)
    compressed = write_dicom(images / "c.dcm", pixels_of(3))
    ds = pydicom.dcmread(compressed)
    ds.file_meta.TransferSyntaxUID = JPEGLSLossless  # no JPEG-LS decoder is installed here
    ds.PixelData = encapsulate([b"\xff\xd8" + bytes(64)])
    ds["PixelData"].VR = "OB"
    ds.save_as(compressed, enforce_file_format=True)
    pngs = []
    for seed in (1, 2):
        pngs.append(tmp_path / "png" / f"{seed}.png")
        pngs[-1].parent.mkdir(exist_ok=True)
        Image.fromarray(pixels_of(seed), mode="L").save(pngs[-1])

    out = tmp_path / "f.npz"
    result = features("extract", "--images", images, *common(weights_file, out, tmp_path / "cache"))
    assert result.exit_code == 1, result.output  # written without the unreadable one, which fails the run
    file = load_feature_file(out)
    assert file.image_ids == ("a.dcm", "b.dicom")
    reference = load_toy("toy", weights_file)
    np.testing.assert_allclose(file.features, direct_features(reference, pngs), atol=1e-6)
    assert file.image_sha256 == tuple(hashlib.sha256(p.read_bytes()).hexdigest() for p in (a, b))
    assert "CorruptImageError: 1 of the 3 images could not be read and have no row in" in result.output
    assert (
        "c.dcm" in result.output and "JPEG-LS Lossless" in result.output and "gdcmconv --raw" in result.output
    )

    # a DICOM file without a suffix, named in a labels CSV, is recognised by its DICM preamble
    (images / "IM0001").write_bytes(a.read_bytes())
    labels = write_csv(tmp_path / "labels.csv", [["image", "Effusion"], ["IM0001", 1], ["b.dicom", 0]])
    listed = features(
        "extract", "--images", images, "--labels", labels, *common(weights_file, out, tmp_path / "c")
    )
    assert listed.exit_code == 0, listed.output
    file = load_feature_file(out)
    assert file.image_ids == ("IM0001", "b.dicom")
    np.testing.assert_allclose(file.features, direct_features(reference, pngs), atol=1e-6)


class _ModelStub:
    """What ``predict``'s image path asks of a classifier file: its backbone, and a compatibility check."""

    def __init__(self) -> None:
        self.backbone = {"name": "toy"}
        self.checked: list[tuple[dict[str, str], int]] = []

    def check_features(self, backbone: dict[str, str], dim: int) -> None:
        self.checked.append((backbone, dim))


def test_predicts_image_path_reads_dicom_beside_png(
    tmp_path: Path, weights_file: Path, toy_cli: None
) -> None:
    from secure_afl.cli_deploy import _extract_directory

    data = tmp_path / "data"
    write_dicom(data / "images" / "x.dcm", 255 - pixels_of(4), photometric="MONOCHROME1")
    png = data / "images" / "y.png"
    Image.fromarray(pixels_of(5), mode="L").save(png)
    reference_png = tmp_path / "x.png"
    Image.fromarray(pixels_of(4), mode="L").save(reference_png)
    model = _ModelStub()
    rows, ids, unreadable = _extract_directory(
        model, data, weights_file, tmp_path / "cache", "cpu", tmp_path / "p.csv"
    )
    assert unreadable is None and ids == ["x.dcm", "y.png"] and model.checked and model.checked[0][1] == 8
    reference = load_toy("toy", weights_file)
    np.testing.assert_allclose(rows, direct_features(reference, [reference_png, png]), atol=1e-6)


def test_a_real_radiographs_lossless_encodings_record_one_pixel_digest_and_their_uids(
    tmp_path: Path, weights_file: Path, toy_cli: None
) -> None:
    """pydicom-data's PA chest CR (MONOCHROME1, 15 bits) uncompressed, JPEG 2000 lossless and lossy,
    extracted together: the lossless pair records one pixel digest (other bytes, other UIDs), the
    lossy file another; the extraction says a node withholds the lossless pair (one image in two rows)
    and releases the lossy file's row only."""
    import shutil

    from pydicom.data import get_testdata_file

    from secure_afl.privacy.release import select_rows

    images = tmp_path / "dicom"
    images.mkdir()
    for name in ("RG1_UNCR.dcm", "RG1_J2KR.dcm", "RG1_J2KI.dcm"):
        found = get_testdata_file(name, download=False)
        if found is None:
            pytest.fail(
                f"pydicom-data's {name} is not installed: install the test extra (pip install -e '.[test]')"
            )
        shutil.copyfile(str(found), images / name)
    out = tmp_path / "f.npz"
    result = features("extract", "--images", images, *common(weights_file, out, tmp_path / "cache"))
    assert result.exit_code == 0, result.output
    file = load_feature_file(out)
    assert file.image_ids == ("RG1_J2KI.dcm", "RG1_J2KR.dcm", "RG1_UNCR.dcm")
    lossy, lossless, original = range(3)
    assert len(set(file.image_sha256)) == 3
    assert file.pixel_sha256[lossless] == file.pixel_sha256[original] != file.pixel_sha256[lossy]
    assert file.sop_instance_uids == tuple(
        str(pydicom.dcmread(images / i, stop_before_pixels=True).SOPInstanceUID) for i in file.image_ids
    )
    assert len(set(file.sop_instance_uids)) == 3
    selection = select_rows(file.require_image_identities(), {})
    assert selection.kept == (lossy,)
    assert [(r.row, r.reason, r.other) for r in selection.withheld] == [
        (1, "listed-twice", 2),
        (2, "listed-twice", 1),
    ]
    assert (
        "note: a federation node releases this file's other rows only: withheld 2 of 3 rows" in result.output
    )
    assert "row 1 (RG1_J2KR.dcm, UID " in result.output and ", as row 2)" in result.output
    shown = features("show", out).output
    assert "DICOM UIDs     3 rows name their SOP Instance UID" in shown
