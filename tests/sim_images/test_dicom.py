"""DICOM in: small files written here with pydicom (MONOCHROME1/2, 8/16-bit, rescale, a window, a VOI
LUT, RLE and JPEG compression, a syntax without a decoder, truncated and malformed files), read through
:func:`secure_afl.features.images.load_grayscale` and the extraction, with the pixel values checked."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pydicom
import pytest
from PIL import Image
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.encaps import encapsulate
from pydicom.pixels import get_decoder
from pydicom.sequence import Sequence
from pydicom.uid import (
    ExplicitVRLittleEndian,
    JPEGBaseline8Bit,
    JPEGLSLossless,
    RLELossless,
    SecondaryCaptureImageStorage,
    generate_uid,
)

from secure_afl.features.backbones import Backbone
from secure_afl.features.extraction import extract_features
from secure_afl.features.images import (
    CorruptImageError,
    DicomCompressionError,
    DicomError,
    ImageDataset,
    dicom_grayscale,
    image_sha256,
    load_grayscale,
    pixel_sha256,
)

SIZE = 32


def stored_pixels(bits: int, seed: int = 0, signed: bool = False) -> np.ndarray:
    """Random stored values over the whole range of ``bits`` (both ends present)."""
    low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    pixels = np.random.default_rng(seed).integers(low, high + 1, (SIZE, SIZE))
    pixels[0, 0], pixels[-1, -1] = low, high
    return pixels


def write_dicom(
    path: Path,
    pixels: np.ndarray,
    *,
    photometric: str = "MONOCHROME2",
    bits_stored: int = 8,
    signed: bool = False,
    syntax: str = ExplicitVRLittleEndian,
    preamble: bool = True,
    **attributes: object,
) -> Path:
    """A single-frame grayscale DICOM file; ``attributes`` are set on the dataset as given."""
    allocated = 8 if bits_stored <= 8 else 16
    dtype = {(8, False): np.uint8, (8, True): np.int8, (16, False): np.uint16, (16, True): np.int16}
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.MediaStorageSOPClassUID = SecondaryCaptureImageStorage
    ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.SOPClassUID = SecondaryCaptureImageStorage
    ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID
    ds.Modality = "DX"
    ds.Rows, ds.Columns = pixels.shape
    ds.SamplesPerPixel = 1
    ds.PhotometricInterpretation = photometric
    ds.BitsAllocated, ds.BitsStored, ds.HighBit = allocated, bits_stored, bits_stored - 1
    ds.PixelRepresentation = int(signed)
    for name, value in attributes.items():
        setattr(ds, name, value)
    ds.PixelData = pixels.astype(dtype[allocated, signed]).tobytes()
    if syntax == RLELossless:
        ds.compress(RLELossless, generate_instance_uid=False)
    elif syntax != ExplicitVRLittleEndian:
        raise AssertionError(f"write {syntax} with write_encapsulated")
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(path, enforce_file_format=preamble)
    return path


def write_encapsulated(path: Path, frame: bytes, syntax: str, pixels: np.ndarray) -> Path:
    """A DICOM file whose pixel data is one encapsulated frame in ``syntax`` (already compressed)."""
    write_dicom(path, pixels)
    ds = pydicom.dcmread(path)
    ds.file_meta.TransferSyntaxUID = syntax
    ds.PixelData = encapsulate([frame])
    ds["PixelData"].VR = "OB"
    ds.save_as(path, enforce_file_format=True)
    return path


def gray(path: Path) -> np.ndarray:
    image = load_grayscale(path)
    assert image.mode == "L" and image.size == (SIZE, SIZE)
    return np.asarray(image)


def to_8_bit(unit: np.ndarray) -> np.ndarray:
    return np.round(np.clip(unit, 0, 1) * 255).astype(np.uint8)


# ------------------------------------------------------------------------------- pixel values


def test_8_bit_monochrome2_reads_its_stored_values(tmp_path: Path) -> None:
    pixels = stored_pixels(8)
    assert np.array_equal(gray(write_dicom(tmp_path / "a.dcm", pixels)), pixels)


def test_monochrome1_is_the_inverted_monochrome2_image(tmp_path: Path) -> None:
    pixels = stored_pixels(12, seed=1)
    plain = gray(write_dicom(tmp_path / "m2.dcm", pixels, bits_stored=12))
    inverted = gray(write_dicom(tmp_path / "m1.dcm", pixels, bits_stored=12, photometric="MONOCHROME1"))
    assert np.array_equal(inverted, 255 - plain)
    assert not np.array_equal(inverted, plain)
    # and with a window, the inversion comes after it
    window = {"WindowCenter": 1500, "WindowWidth": 2000}
    m2 = gray(write_dicom(tmp_path / "w2.dcm", pixels, bits_stored=12, **window))
    m1 = gray(write_dicom(tmp_path / "w1.dcm", pixels, bits_stored=12, photometric="MONOCHROME1", **window))
    assert np.array_equal(m1, 255 - m2)


@pytest.mark.parametrize("bits", [10, 12, 16])
def test_16_bit_allocated_data_maps_its_bits_stored_range_onto_0_to_255(tmp_path: Path, bits: int) -> None:
    pixels = stored_pixels(bits, seed=bits)
    read = gray(write_dicom(tmp_path / "a.dcm", pixels, bits_stored=bits))
    assert np.array_equal(read, to_8_bit(pixels / (2**bits - 1)))
    assert read.min() == 0 and read.max() == 255


def test_rescale_slope_and_intercept_then_a_linear_window(tmp_path: Path) -> None:
    pixels = stored_pixels(12, seed=2)
    slope, intercept, center, width = 0.5, -1024.0, -100.0, 800.0
    path = write_dicom(
        tmp_path / "a.dcm", pixels, bits_stored=12,
        RescaleSlope=slope, RescaleIntercept=intercept, WindowCenter=center, WindowWidth=width,
    )  # fmt: skip
    values = pixels * slope + intercept  # the modality LUT
    expected = to_8_bit((values - (center - 0.5)) / (width - 1) + 0.5)  # PS3.3 C.11.2.1.2.1
    read = gray(path)
    assert np.array_equal(read, expected)
    assert (read == 0).any() and (read == 255).any() and ((read > 0) & (read < 255)).any()


def test_rescale_without_a_window_maps_the_rescaled_stored_range(tmp_path: Path) -> None:
    pixels = stored_pixels(12, seed=3)
    path = write_dicom(tmp_path / "a.dcm", pixels, bits_stored=12, RescaleSlope=-2.0, RescaleIntercept=100.0)
    values = pixels * -2.0 + 100.0
    low, high = 4095 * -2.0 + 100.0, 100.0  # a negative slope reverses the range
    assert np.array_equal(gray(path), to_8_bit((values - low) / (high - low)))


def test_signed_pixels(tmp_path: Path) -> None:
    pixels = stored_pixels(12, seed=4, signed=True)
    read = gray(write_dicom(tmp_path / "a.dcm", pixels, bits_stored=12, signed=True))
    assert np.array_equal(read, to_8_bit((pixels + 2048) / 4095))


@pytest.mark.parametrize("function", ["LINEAR_EXACT", "SIGMOID"])
def test_the_voi_lut_function_of_a_window(tmp_path: Path, function: str) -> None:
    pixels = stored_pixels(12, seed=5)
    center, width = 2000.0, 1000.0
    path = write_dicom(
        tmp_path / "a.dcm", pixels, bits_stored=12,
        WindowCenter=center, WindowWidth=width, VOILUTFunction=function,
    )  # fmt: skip
    if function == "LINEAR_EXACT":
        unit = (pixels - center) / width + 0.5
    else:
        unit = 1 / (1 + np.exp(-4 * (pixels - center) / width))
    assert np.array_equal(gray(path), to_8_bit(unit))


def test_the_first_of_several_windows_is_used(tmp_path: Path) -> None:
    pixels = stored_pixels(12, seed=6)
    several = write_dicom(
        tmp_path / "a.dcm", pixels, bits_stored=12, WindowCenter=[1000, 3000], WindowWidth=[500, 100]
    )
    first = write_dicom(tmp_path / "b.dcm", pixels, bits_stored=12, WindowCenter=1000, WindowWidth=500)
    assert np.array_equal(gray(several), gray(first))


def test_a_voi_lut_sequence_is_applied_before_any_window(tmp_path: Path) -> None:
    pixels = stored_pixels(8, seed=7)
    table = (np.arange(256) ** 2 // 255).astype(np.uint16)  # a gamma-like 8-bit LUT
    item = Dataset()
    item.LUTDescriptor = [256, 0, 8]
    item.LUTData = table.tolist()
    item["LUTData"].VR = "US"
    path = write_dicom(
        tmp_path / "a.dcm", pixels, VOILUTSequence=Sequence([item]), WindowCenter=10, WindowWidth=2
    )
    assert np.array_equal(gray(path), to_8_bit(table[pixels] / 255))


def test_a_file_without_the_preamble_is_read(tmp_path: Path) -> None:
    pixels = stored_pixels(8, seed=8)
    path = write_dicom(tmp_path / "IM0001", pixels, preamble=False)  # no suffix, no "DICM"
    assert path.read_bytes()[128:132] != b"DICM"
    assert np.array_equal(dicom_grayscale(path.read_bytes(), path), pixels)


# --------------------------------------------------------------------------- compressed syntaxes


def test_rle_lossless_reads_as_the_uncompressed_file(tmp_path: Path) -> None:
    pixels = stored_pixels(12, seed=9)
    rle = write_dicom(tmp_path / "rle.dcm", pixels, bits_stored=12, syntax=RLELossless)
    assert pydicom.dcmread(rle).file_meta.TransferSyntaxUID == RLELossless
    assert np.array_equal(gray(rle), gray(write_dicom(tmp_path / "raw.dcm", pixels, bits_stored=12)))


def test_jpeg_baseline_is_decoded(tmp_path: Path) -> None:
    pixels = np.tile(np.linspace(0, 255, SIZE).astype(np.uint8), (SIZE, 1))  # smooth: JPEG keeps it
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode="L").save(buffer, format="JPEG", quality=95)
    path = write_encapsulated(tmp_path / "jpeg.dcm", buffer.getvalue(), JPEGBaseline8Bit, pixels)
    assert np.abs(gray(path).astype(int) - pixels).max() <= 4


def test_a_compressed_syntax_without_a_decoder_is_refused_naming_the_file_and_syntax(tmp_path: Path) -> None:
    assert not get_decoder(JPEGLSLossless).is_available, "this test needs a syntax with no decoder here"
    path = write_encapsulated(tmp_path / "ls.dcm", b"\xff\xd8" + bytes(64), JPEGLSLossless, stored_pixels(8))
    with pytest.raises(DicomCompressionError) as refused:
        load_grayscale(path)
    message = str(refused.value)
    assert str(path) in message and "JPEG-LS Lossless" in message and str(JPEGLSLossless) in message
    assert "gdcmconv --raw" in message
    assert isinstance(refused.value, CorruptImageError)  # so the extraction skips it with that reason


# ----------------------------------------------------------------------------- broken files


def test_truncated_and_malformed_files_raise_a_dicom_error_naming_the_file(tmp_path: Path) -> None:
    whole = write_dicom(tmp_path / "whole.dcm", stored_pixels(16, seed=10), bits_stored=16).read_bytes()
    cases = {
        "pixels-cut.dcm": whole[: len(whole) - 700],  # the pixel data cut short
        "header-cut.dcm": whole[:200],  # cut inside the header
        "garbage.dcm": b"\x00" * 128 + b"DICM" + b"\x07" * 40,
        "text.dcm": b"this is not a DICOM file at all\n" * 8,
    }
    for name, data in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(DicomError) as raised:
            load_grayscale(path)
        assert str(path) in str(raised.value), name


def test_colour_and_multi_frame_dicom_are_refused(tmp_path: Path) -> None:
    rgb = write_dicom(tmp_path / "rgb.dcm", stored_pixels(8), photometric="MONOCHROME2")
    ds = pydicom.dcmread(rgb)
    ds.PhotometricInterpretation = "RGB"
    ds.save_as(rgb)
    with pytest.raises(DicomError, match="Photometric Interpretation 'RGB'"):
        load_grayscale(rgb)
    frames = np.concatenate([stored_pixels(8, seed=1), stored_pixels(8, seed=2)])
    multi = write_dicom(tmp_path / "multi.dcm", frames[:SIZE], NumberOfFrames=2)
    ds = pydicom.dcmread(multi)
    ds.PixelData = frames.astype(np.uint8).tobytes()
    ds.save_as(multi)
    with pytest.raises(DicomError, match="multi-frame DICOM"):
        load_grayscale(multi)


# --------------------------------------------------------------------------- through the extraction


def test_dicom_extracts_to_the_features_of_the_same_png(tmp_path: Path, toy_backbone: Backbone) -> None:
    pixels = [stored_pixels(8, seed=20 + i) for i in range(3)]
    pngs = []
    for i, p in enumerate(pixels):
        pngs.append(tmp_path / "png" / f"{i}.png")
        pngs[-1].parent.mkdir(exist_ok=True)
        Image.fromarray(p.astype(np.uint8), mode="L").save(pngs[-1])
    dicoms = [
        write_dicom(tmp_path / "dcm" / "0.dcm", pixels[0]),
        write_dicom(tmp_path / "dcm" / "1.dcm", 255 - pixels[1], photometric="MONOCHROME1"),
        write_dicom(tmp_path / "dcm" / "2.dcm", pixels[2], syntax=RLELossless),
    ]
    options = {"cache_dir": tmp_path / "cache", "num_workers": 0, "progress": False}
    from_dicom = extract_features(dicoms, toy_backbone, **options)
    from_png = extract_features(pngs, toy_backbone, **options)
    assert from_dicom.skipped == [] and from_dicom.forward_passes == 1
    np.testing.assert_array_equal(from_dicom.features, from_png.features)
    assert from_dicom.image_sha256 == tuple(image_sha256(p) for p in dicoms)  # DICOM bytes, not pixels


def test_a_broken_dicom_is_a_counted_skip_with_its_reason(tmp_path: Path, toy_backbone: Backbone) -> None:
    good = write_dicom(tmp_path / "good.dcm", stored_pixels(8))
    cut = tmp_path / "cut.dcm"
    cut.write_bytes(good.read_bytes()[:-300])
    refused = write_encapsulated(
        tmp_path / "ls.dcm", b"\xff\xd8" + bytes(64), JPEGLSLossless, stored_pixels(8)
    )
    item = ImageDataset([cut], toy_backbone.transform)[0]
    assert item.pixels is None and item.error is not None and item.error.startswith(f"DicomError: {cut}")
    result = extract_features(
        [good, cut, refused], toy_backbone, cache_dir=tmp_path / "c", num_workers=0, progress=False
    )
    assert result.skipped == [1, 2]
    assert str(cut) in result.skip_reasons[1]
    assert "DicomCompressionError" in result.skip_reasons[2] and "gdcmconv --raw" in result.skip_reasons[2]
    with pytest.raises(CorruptImageError, match=r"cut\.dcm"):
        extract_features(
            [good, cut], toy_backbone, cache_dir=tmp_path / "s", num_workers=0, progress=False, strict=True
        )


def test_a_dicom_re_exported_with_new_uids_or_as_monochrome1_keeps_its_pixel_digest(
    tmp_path: Path, toy_backbone: Backbone
) -> None:
    pixels = stored_pixels(8, seed=30)
    first = write_dicom(tmp_path / "first.dcm", pixels)
    again = write_dicom(tmp_path / "again.dcm", pixels, PatientID="re-exported")  # new UIDs, metadata
    inverted = write_dicom(tmp_path / "m1.dcm", 255 - pixels, photometric="MONOCHROME1")
    other = write_dicom(tmp_path / "other.dcm", stored_pixels(8, seed=31))
    paths = [first, again, inverted, other]
    result = extract_features(paths, toy_backbone, cache_dir=tmp_path / "c", num_workers=0, progress=False)
    assert len(set(result.image_sha256)) == 4  # four different files
    assert (
        result.pixel_sha256[0] == result.pixel_sha256[1] == result.pixel_sha256[2] != result.pixel_sha256[3]
    )
    assert result.pixel_sha256[0] == pixel_sha256(Image.fromarray(pixels.astype(np.uint8), mode="L"))
