"""The ledger's image set (issue 29): exact, signed, and quick at 100,000 images."""

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
