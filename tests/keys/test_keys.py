"""Identity keys, fingerprints, the roster and their files."""

from __future__ import annotations

import base64
import json
import os
import stat

import pytest
from cryptography.hazmat.primitives import serialization

from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.keys import (
    IdentityKey,
    KeyFileError,
    KeyFileExistsError,
    KeyFilePermissionError,
    KeyFileTamperedError,
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


def make_roster(n: int = 3) -> tuple[Roster, dict[str, IdentityKey]]:
    random = DeterministicRandomSource(b"roster")
    keys = {f"h{i}": IdentityKey.generate(random) for i in range(n)}
    return Roster(RosterEntry(cid, f"Hospital {cid}", key.public_key) for cid, key in keys.items()), keys


FAST_N = 2**10  # scrypt cost for tests; the default (2^17) is exercised once


def save(path, key, passphrase=b"pw", **kwargs) -> None:
    save_identity_key(path, key, passphrase, scrypt_n=kwargs.pop("scrypt_n", FAST_N), **kwargs)


def test_private_key_file_round_trip_with_mode_0600_and_default_scrypt(tmp_path) -> None:
    key = IdentityKey.generate()
    path = tmp_path / "identity.key"
    save_identity_key(path, key, b"correct horse battery staple")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    document = json.loads(path.read_text())
    assert document["format"] == "secure-afl-identity-key/v1"
    assert document["kdf"] == {**document["kdf"], "name": "scrypt", "n": 2**17, "r": 8, "p": 1}
    assert document["cipher"]["name"] == "aes-256-gcm"
    assert base64.b64decode(document["public_key"]) == key.public_key
    loaded = load_identity_key(path, b"correct horse battery staple")
    assert loaded.public_key == key.public_key
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


def test_key_file_holds_no_pkcs8_and_no_plaintext_key(tmp_path) -> None:
    key = IdentityKey.generate()
    path = tmp_path / "identity.key"
    save(path, key)
    raw = key.private_key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    text = path.read_bytes()
    assert b"PRIVATE KEY" not in text and raw not in text
    assert base64.b64encode(raw) not in text


def test_an_existing_key_file_is_not_overwritten_unless_asked(tmp_path) -> None:
    path = tmp_path / "identity.key"
    first, second = IdentityKey.generate(), IdentityKey.generate()
    save(path, first)
    with pytest.raises(KeyFileExistsError, match="overwrite=True"):
        save(path, second)
    assert isinstance(KeyFileExistsError("x"), FileExistsError)
    assert load_identity_key(path, b"pw").public_key == first.public_key
    save(path, second, overwrite=True)
    assert load_identity_key(path, b"pw").public_key == second.public_key
    assert sorted(tmp_path.iterdir()) == [path]


def test_overwriting_a_key_file_gives_mode_0600(tmp_path) -> None:
    path = tmp_path / "identity.key"
    path.write_text("old")
    path.chmod(0o644)
    save(path, IdentityKey.generate(), overwrite=True)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_key_files_are_written_atomically_through_an_exclusive_0600_temporary(tmp_path, monkeypatch) -> None:
    path = tmp_path / "identity.key"
    opened: list[tuple[str, int, int]] = []
    real_open = os.open

    def spy_open(file, flags, mode=0o777, *args, **kwargs):
        opened.append((str(file), flags, mode))
        return real_open(file, flags, mode, *args, **kwargs)

    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    save(path, IdentityKey.generate())
    created = [(f, flags, mode) for f, flags, mode in opened if flags & os.O_CREAT]
    assert len(created) == 1
    temporary, flags, mode = created[0]
    assert flags & os.O_EXCL and mode == 0o600
    assert os.path.dirname(temporary) == str(tmp_path) and temporary != str(path)
    assert len(synced) >= 2  # the file, then its directory
    assert not os.path.exists(temporary) and path.exists()


def test_a_failed_write_leaves_no_file_behind(tmp_path, monkeypatch) -> None:
    path = tmp_path / "identity.key"

    def broken_fsync(fd):
        raise OSError(5, "I/O error")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="I/O"):
        save(path, IdentityKey.generate())
    assert list(tmp_path.iterdir()) == []


def test_wrong_passphrase_gives_a_clear_error(tmp_path) -> None:
    path = tmp_path / "identity.key"
    save(path, IdentityKey.generate(), b"right")
    with pytest.raises(WrongPassphraseError, match="wrong passphrase"):
        load_identity_key(path, b"wrong")
    with pytest.raises(KeyFileError):
        load_identity_key(path, None)  # type: ignore[arg-type]


def _tamper(path, change) -> None:
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))
    path.chmod(0o600)


def _flip(value: str) -> str:
    raw = bytearray(base64.b64decode(value))
    raw[0] ^= 1
    return base64.b64encode(bytes(raw)).decode()


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.update(ciphertext=_flip(d["ciphertext"])),
        lambda d: d.update(public_key=_flip(d["public_key"])),
        lambda d: d["cipher"].update(nonce=_flip(d["cipher"]["nonce"])),
    ],
    ids=["ciphertext", "public_key", "nonce"],
)
def test_a_tampered_key_file_is_detected(tmp_path, change) -> None:
    path = tmp_path / "identity.key"
    save(path, IdentityKey.generate())
    _tamper(path, change)
    with pytest.raises(KeyFileTamperedError, match="modified"):
        load_identity_key(path, b"pw")


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda d: d["kdf"].update(n=2**40), KeyFileError, "power of two"),
        (lambda d: d["kdf"].update(n=3000), KeyFileError, "power of two"),
        (lambda d: d["kdf"].update(r=10**6), KeyFileError, "outside"),
        (lambda d: d["kdf"].update(p=0), KeyFileError, "positive"),
        (lambda d: d["kdf"].update(n="1024"), KeyFileError, "wrong type"),
        (lambda d: d["kdf"].update(name="pbkdf2"), KeyFileError, "unsupported"),
        (lambda d: d.update(format="secure-afl-identity-key/v9"), KeyFileError, "format"),
        (lambda d: d.pop("check"), KeyFileError, "lacks"),
        (lambda d: d.update(ciphertext="not base64!"), KeyFileError, "base64"),
        (lambda d: d["kdf"].update(salt=_flip(d["kdf"]["salt"])), WrongPassphraseError, "KDF"),
    ],
)
def test_malformed_or_absurd_key_files_are_refused_before_deriving(tmp_path, change, error, match) -> None:
    path = tmp_path / "identity.key"
    save(path, IdentityKey.generate())
    _tamper(path, change)
    with pytest.raises(error, match=match):
        load_identity_key(path, b"pw")


def test_kdf_parameters_are_bounded_when_writing(tmp_path) -> None:
    for kwargs in ({"scrypt_n": 2**9}, {"scrypt_n": 2**21}, {"scrypt_n": 1000}, {"scrypt_r": 0}):
        with pytest.raises(ValueError):
            save(tmp_path / "k.key", IdentityKey.generate(), **kwargs)
    assert not (tmp_path / "k.key").exists()


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644, 0o620])
def test_a_key_file_open_to_group_or_others_is_refused(tmp_path, mode) -> None:
    path = tmp_path / "identity.key"
    save(path, IdentityKey.generate())
    path.chmod(mode)
    with pytest.raises(KeyFilePermissionError, match="too open"):
        load_identity_key(path, b"pw")
    path.chmod(0o400)  # read-only for the owner is fine
    load_identity_key(path, b"pw")


def test_legacy_pkcs8_files_load_only_when_asked(tmp_path) -> None:
    key = IdentityKey.generate()
    path = tmp_path / "identity.pem"
    path.write_bytes(
        key.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"pw"),
        )
    )
    path.chmod(0o600)
    with pytest.raises(KeyFileError, match="legacy PKCS#8"):
        load_identity_key(path, b"pw")
    assert load_identity_key(path, b"pw", allow_legacy_pkcs8=True).public_key == key.public_key
    with pytest.raises(WrongPassphraseError):
        load_identity_key(path, b"wrong", allow_legacy_pkcs8=True)


def test_empty_passphrase_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError):
        save_identity_key(tmp_path / "k.key", IdentityKey.generate(), b"")


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


@pytest.mark.parametrize(
    "client_id",
    [
        "",
        "-h0",
        ".h0",
        "h 0",
        "h0\n",
        "h\x000",
        "h0\u202e",  # right-to-left override
        "h\u200b0",  # zero-width space
        "hоspital",  # Cyrillic 'о'
        "ｈ0",  # fullwidth 'h'
        "h/0",
        "h" * 65,
    ],
)
def test_roster_ids_must_be_plain_ascii(client_id) -> None:
    with pytest.raises(RosterError, match="invalid client id"):
        RosterEntry(client_id, "Hospital", bytes(32))


@pytest.mark.parametrize("client_id", ["h0", "H", "0", "client-0", "st.mary_s-1", "h" * 64])
def test_plain_roster_ids_are_accepted(client_id) -> None:
    assert RosterEntry(client_id, "Hospital", bytes(32)).client_id == client_id


@pytest.mark.parametrize("name", ["Saint\u202eMary", "line\nbreak", "tab\there", "nul\x00", "z\u200bw"])
def test_roster_names_must_not_hold_control_characters(name) -> None:
    with pytest.raises(RosterError, match="control"):
        RosterEntry("h0", name, bytes(32))


def test_roster_names_may_be_free_text() -> None:
    entry = RosterEntry("h0", "Hôpital Saint-Louis (Paris) — 東京", bytes(32))
    assert entry.name.startswith("Hôpital")
    with pytest.raises(RosterError, match="longer"):
        RosterEntry("h0", "x" * 257, bytes(32))


def test_roster_json_with_a_bad_id_or_name_is_rejected() -> None:
    roster, _ = make_roster()
    for field, value in (("id", "h\u202e0"), ("id", 7), ("name", "a\x1bb"), ("name", None)):
        document = json.loads(roster.to_json())
        document["clients"][0][field] = value
        with pytest.raises(RosterError):
            Roster.from_json(json.dumps(document))
