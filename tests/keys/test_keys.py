"""Identity keys, fingerprints, the roster and their files."""

from __future__ import annotations

import json
import os
import stat

import pytest

from secure_afl.keys import (
    IdentityKey,
    KeyFileError,
    Roster,
    RosterEntry,
    RosterError,
    WrongPassphraseError,
    fingerprint,
    load_identity_key,
    load_roster,
    save_identity_key,
    save_roster,
)
from secure_afl.protocol.randomness import DeterministicRandomSource


def make_roster(n: int = 3) -> tuple[Roster, dict[str, IdentityKey]]:
    random = DeterministicRandomSource(b"roster")
    keys = {f"h{i}": IdentityKey.generate(random) for i in range(n)}
    return Roster(RosterEntry(cid, f"Hospital {cid}", key.public_key) for cid, key in keys.items()), keys


def test_private_key_file_round_trip_with_mode_0600(tmp_path) -> None:
    key = IdentityKey.generate()
    path = tmp_path / "identity.pem"
    save_identity_key(path, key, b"correct horse battery staple")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert b"ENCRYPTED" in path.read_bytes()
    loaded = load_identity_key(path, b"correct horse battery staple")
    assert loaded.public_key == key.public_key


def test_overwriting_a_key_file_keeps_mode_0600(tmp_path) -> None:
    path = tmp_path / "identity.pem"
    path.write_text("old")
    path.chmod(0o644)
    save_identity_key(path, IdentityKey.generate(), b"pw")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_wrong_passphrase_gives_a_clear_error(tmp_path) -> None:
    path = tmp_path / "identity.pem"
    save_identity_key(path, IdentityKey.generate(), b"right")
    with pytest.raises(WrongPassphraseError, match="wrong passphrase"):
        load_identity_key(path, b"wrong")
    with pytest.raises(KeyFileError):
        load_identity_key(path, None)  # type: ignore[arg-type]


def test_empty_passphrase_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError):
        save_identity_key(tmp_path / "k.pem", IdentityKey.generate(), b"")


def test_fingerprint_format() -> None:
    key = IdentityKey.generate(DeterministicRandomSource(b"fp"))
    fp = fingerprint(key.public_key)
    assert fp.startswith("SHA256:") and len(fp.split(" ")) == 16
    assert fp == key.fingerprint
    assert repr(key) == f"IdentityKey({fp})"  # never prints key material
    with pytest.raises(ValueError):
        fingerprint(b"short")


def test_roster_json_round_trip(tmp_path) -> None:
    roster, _ = make_roster()
    path = tmp_path / "roster.json"
    save_roster(path, roster)
    loaded = load_roster(path)
    assert loaded == roster
    assert loaded.client_ids == ("h0", "h1", "h2")
    assert loaded.entry("h1").fingerprint == roster.entry("h1").fingerprint
    document = json.loads(path.read_text())
    assert all("fingerprint" in item for item in document["clients"])


def test_roster_rejects_duplicate_ids_and_keys() -> None:
    _, keys = make_roster()
    with pytest.raises(RosterError, match="duplicate"):
        Roster([RosterEntry("h0", "a", keys["h0"].public_key), RosterEntry("h0", "b", keys["h1"].public_key)])
    with pytest.raises(RosterError, match="public key"):
        Roster([RosterEntry("h0", "a", keys["h0"].public_key), RosterEntry("h1", "b", keys["h0"].public_key)])


def test_roster_json_with_a_mismatched_fingerprint_or_duplicate_is_rejected() -> None:
    roster, _ = make_roster()
    document = json.loads(roster.to_json())
    document["clients"][0]["fingerprint"] = roster.entry("h1").fingerprint
    with pytest.raises(RosterError, match="fingerprint"):
        Roster.from_json(json.dumps(document))
    document = json.loads(roster.to_json())
    document["clients"].append(dict(document["clients"][0]))
    with pytest.raises(RosterError, match="duplicate"):
        Roster.from_json(json.dumps(document))
    with pytest.raises(RosterError):
        Roster.from_json("{not json")
    with pytest.raises(RosterError):
        Roster.from_json(json.dumps({"format": "other", "clients": []}))


def test_roster_entry_validation() -> None:
    with pytest.raises(RosterError):
        RosterEntry("", "x", bytes(32))
    with pytest.raises(RosterError):
        RosterEntry("h0", "x", bytes(31))
