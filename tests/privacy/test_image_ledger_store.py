"""The ledger's image set: exact, signed, and quick at 100,000 images."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from secure_afl.core.errors import ImageAlreadyReleasedError, LedgerTamperedError
from secure_afl.keys.identity import IdentityKey
from secure_afl.privacy.ledger import FileLedger, LedgerOwner, MemoryLedger
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.privacy.release import Release, image_digests
from secure_afl.protocol.exposure_gate import ExposureGate


def _digests(tag: str, n: int) -> list[str]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


def _gate(ledger, owner: LedgerOwner, images: list[str], scope: str, reuses: str = "", seed: int = 0):
    inputs = {"g": {"x": np.random.default_rng(seed).normal(size=8)}}
    release = Release.of(inputs, images=images, scope=scope, reuses=reuses)
    return ExposureGate(owner.client_id, owner.identity, inputs, ClientPolicy.deployment(), ledger, release)


def _release(gate: ExposureGate, session_id: bytes) -> None:
    gate.start(session_id)
    gate.check("R3", "sign", {"g": (("a", "b", "c"), ("x",))}, session_id=session_id, colluders=0,
               release_survivors=("a", "b", "c"))  # fmt: skip


def test_a_ledger_of_100000_images_is_exact_and_signed(tmp_path) -> None:
    owner = LedgerOwner("a", IdentityKey.generate())
    ledger = FileLedger(tmp_path)
    images = _digests("first", 100_000)
    _release(_gate(ledger, owner, images, "study:s/round:1"), b"\x01" * 32)
    state = ledger.load(owner)
    released = state.released_images(b"\x02" * 32)
    assert set(released) == set(image_digests(images)) and len(released) == 100_000
    assert ledger.path("a").stat().st_size < 5_000_000  # 32 bytes an image, base64 in the file
    # one released image among 1,000 new ones is found, and named by count and session
    mixed = [*_digests("new", 1_000), images[54_321]]
    with pytest.raises(ImageAlreadyReleasedError, match=r"1 of this client's 1001 rows .* 0101010101010101"):
        _gate(ledger, owner, mixed, "study:t/round:1", seed=1).start(b"\x02" * 32)
    _gate(ledger, owner, _digests("new", 1_000), "study:t/round:1", seed=1).start(b"\x02" * 32)
    # the image set is under the identity key's signature
    document = json.loads(ledger.path("a").read_text())
    entry = document["sessions"]["01" * 32]
    entry["images"] = entry["images"][:-44] + "A" * 44  # one digest changed
    ledger.path("a").write_text(json.dumps(document))
    with pytest.raises(LedgerTamperedError):
        ledger.load(owner)


def test_only_round_two_of_the_same_study_reuses_images_and_only_once() -> None:
    owner = LedgerOwner("a", IdentityKey.generate())
    ledger = MemoryLedger()
    images = _digests("x", 10)
    _release(_gate(ledger, owner, images, "study:s/round:1"), b"\x01" * 32)
    _release(_gate(ledger, owner, images, "study:s/round:2", "study:s/round:1", seed=1), b"\x02" * 32)
    with pytest.raises(ImageAlreadyReleasedError, match="10 of this client's 10 rows"):
        _gate(ledger, owner, images, "study:s/round:2", "study:s/round:1", seed=2).start(b"\x03" * 32)
    with pytest.raises(ImageAlreadyReleasedError):  # another study's round 2 is no exception
        _gate(ledger, owner, images, "study:t/round:2", "study:t/round:1", seed=3).start(b"\x04" * 32)
    # a session that did not reach its release point spent nothing
    _gate(ledger, owner, _digests("y", 3), "study:u/round:1", seed=4).start(b"\x05" * 32)
    _gate(ledger, owner, _digests("y", 3), "study:v/round:1", seed=5).start(b"\x06" * 32)


def test_an_image_is_released_when_any_of_its_names_is_and_a_release_lists_it_once() -> None:
    """image_keys: file digest, decoded pixels, SOP Instance UID; a row matches an earlier one on any."""
    from secure_afl.privacy.release import RepeatedImageError, image_keys

    owner = LedgerOwner("a", IdentityKey.generate())
    ledger = MemoryLedger()
    files, pixels = _digests("file", 3), _digests("pixels", 3)
    rows = [
        image_keys(files[0], pixels[0], "1.2.3.4"),
        image_keys(files[1], pixels[1]),
        image_keys(files[2], pixels[2]),
    ]

    def gate(names: list[tuple[bytes, ...]], scope: str, seed: int) -> ExposureGate:
        inputs = {"g": {"x": np.random.default_rng(seed).normal(size=8)}}
        release = Release.of(
            inputs, images=[n[0] for n in names], aliases=[n[1:] for n in names], scope=scope
        )
        assert (
            Release.from_json(json.loads(json.dumps(release.to_json()))) == release
        )  # a node's state keeps it
        return ExposureGate(
            owner.client_id, owner.identity, inputs, ClientPolicy.deployment(), ledger, release
        )

    _release(gate(rows, "study:s/round:1", 0), b"\x01" * 32)
    new = _digests("new", 3)
    same_pixels = image_keys(new[0], pixels[1])  # re-encoded losslessly: other bytes, the same pixels
    same_uid = image_keys(new[1], new[2], "1.2.3.4")  # other bytes and pixels, the same instance
    for seed, copy in enumerate((same_pixels, same_uid), start=1):
        with pytest.raises(ImageAlreadyReleasedError, match="1 of this client's 2 rows"):
            gate([copy, image_keys(*_digests(f"fresh{seed}", 2))], "study:t/round:1", seed).start(
                b"\x02" * 32
            )
    gate([image_keys(*_digests("fresh", 2), "1.2.3.5")], "study:t/round:1", 9).start(b"\x02" * 32)
    # one image in two rows of one release (its file and its lossless copy) is refused, naming the rows
    with pytest.raises(RepeatedImageError, match=r"rows 0 and 2 are one image \(the same decoded pixels"):
        gate(
            [rows[0], image_keys(*_digests("other", 2)), image_keys(new[0], pixels[0])], "study:u/round:1", 10
        )


def test_a_ledger_written_before_image_aliases_still_matches_by_file_digest(tmp_path) -> None:
    """A session recorded without further names (an older ledger) keeps its document, and a new
    release over one of its files is refused on the file's digest."""
    from secure_afl.privacy.release import image_keys

    owner = LedgerOwner("a", IdentityKey.generate())
    ledger = FileLedger(tmp_path)
    files = _digests("old", 4)
    _release(_gate(ledger, owner, files, "study:s/round:1"), b"\x01" * 32)
    entry = json.loads(ledger.path("a").read_text())["sessions"]["01" * 32]
    assert "aliases" not in entry  # the document it had
    named = image_keys(files[2], _digests("pixels", 1)[0], "1.2.3")
    inputs = {"g": {"x": np.random.default_rng(5).normal(size=8)}}
    release = Release.of(inputs, images=[named[0]], aliases=[named[1:]], scope="study:t/round:1")
    gate = ExposureGate(owner.client_id, owner.identity, inputs, ClientPolicy.deployment(), ledger, release)
    with pytest.raises(ImageAlreadyReleasedError, match="1 of this client's 1 rows"):
        gate.start(b"\x02" * 32)
