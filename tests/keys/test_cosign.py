"""Roster co-signatures: every institution signs the exact roster; nodes refuse any other."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from secure_afl.cli_keys import keys
from secure_afl.keys import IdentityKey, Roster, RosterEntry, RosterError, save_identity_key
from secure_afl.keys.cosign import (
    RosterCosignatureError,
    RosterNotCosignedError,
    check_cosignatures,
    cosigned_roster_json,
    load_cosigned_roster,
    read_roster_document,
    roster_status,
    sign_roster,
)

KEYS = {cid: IdentityKey.generate() for cid in ("hospital-a", "hospital-b", "hospital-c")}
COORDINATOR = IdentityKey.generate()


def _roster(keys: dict[str, IdentityKey] = KEYS) -> Roster:
    return Roster(
        (RosterEntry(cid, cid, key.public_key) for cid, key in keys.items()),
        RosterEntry("coordinator", "Coordinator", COORDINATOR.public_key),
    )


def _signed(roster: Roster, signers: dict[str, IdentityKey]) -> dict[str, bytes]:
    return dict(sign_roster(roster, key) for key in signers.values())


def test_a_roster_signed_by_every_institution_loads(tmp_path: Path) -> None:
    roster = _roster()
    path = tmp_path / "roster.json"
    path.write_text(cosigned_roster_json(roster, _signed(roster, KEYS)))
    loaded = load_cosigned_roster(path)
    assert loaded == roster and loaded.fingerprint == roster.fingerprint  # signatures are not content
    status = roster_status(path.read_text())
    assert status.complete and status.signed == tuple(KEYS)


def test_a_missing_cosignature_is_refused_and_named(tmp_path: Path) -> None:
    roster = _roster()
    path = tmp_path / "roster.json"
    path.write_text(cosigned_roster_json(roster, _signed(roster, {"hospital-a": KEYS["hospital-a"]})))
    with pytest.raises(RosterNotCosignedError, match=r"not co-signed by \['hospital-b', 'hospital-c'\]"):
        load_cosigned_roster(path)
    path.write_text(roster.to_json())  # a plain roster, as `keys roster add` writes it
    with pytest.raises(RosterNotCosignedError, match="signed by nobody"):
        load_cosigned_roster(path)


def test_an_entry_added_after_signing_invalidates_every_signature() -> None:
    roster = _roster()
    signatures = _signed(roster, KEYS)
    # The coordinator adds an entry with a key it holds, and signs for it: the others' signatures
    # were over a roster without it, so they no longer verify.
    extra = IdentityKey.generate()
    bigger = _roster({**KEYS, "hospital-d": extra})
    forged = {**signatures, **_signed(bigger, {"hospital-d": extra})}
    with pytest.raises(RosterCosignatureError, match="'hospital-a' does not verify"):
        check_cosignatures(bigger, forged)
    # Its own entry is "co-signed" by itself, but the real members have not signed the new roster.
    status = check_cosignatures(bigger, _signed(bigger, {"hospital-d": extra}))
    assert status.missing == ("hospital-a", "hospital-b", "hospital-c")


def test_a_signature_by_another_key_or_for_no_entry_is_refused() -> None:
    roster = _roster()
    signatures = _signed(roster, KEYS)
    swapped = {**signatures, "hospital-b": signatures["hospital-c"]}
    with pytest.raises(RosterCosignatureError, match="'hospital-b' does not verify"):
        check_cosignatures(roster, swapped)
    with pytest.raises(RosterCosignatureError, match="not institutions of this roster"):
        check_cosignatures(roster, {**signatures, "hospital-z": signatures["hospital-a"]})
    with pytest.raises(RosterError, match="not an institution of the roster"):
        sign_roster(roster, COORDINATOR)  # the coordinator is not a member: it cannot co-sign


def test_a_changed_name_invalidates_the_signatures() -> None:
    roster = _roster()
    text = cosigned_roster_json(roster, _signed(roster, KEYS))
    document = json.loads(text)
    document["clients"][1]["name"] = "Hospital B (renamed)"
    with pytest.raises(RosterCosignatureError, match="does not verify"):
        roster_status(json.dumps(document))


def test_malformed_cosignatures_are_refused() -> None:
    roster = _roster()
    document = json.loads(roster.to_json())
    for value, message in (
        ([], "must map institution ids"),
        ({"hospital-a": 5}, "not a string"),
        ({"hospital-a": "***"}, "not base64"),
        ({"hospital-a": base64.b64encode(b"short").decode()}, "has 5 bytes"),
    ):
        document["cosignatures"] = value
        with pytest.raises(RosterCosignatureError, match=message):
            read_roster_document(json.dumps(document))


def test_keys_roster_sign_adds_each_signature_and_roster_add_drops_them(tmp_path: Path) -> None:
    roster = _roster()
    path = tmp_path / "roster.json"
    path.write_text(roster.to_json())
    passfile = tmp_path / "pass"
    passfile.write_text("a long test passphrase\n")
    passfile.chmod(0o600)
    runner = CliRunner()
    for cid, key in KEYS.items():
        directory = tmp_path / cid
        directory.mkdir()
        save_identity_key(directory / "identity.key", key, b"a long test passphrase", scrypt_n=2**10)
        args = ["roster", "sign", "--roster", str(path), "--key-dir", str(directory), "--yes"]
        result = runner.invoke(keys, [*args, "--passphrase-file", str(passfile)])
        assert result.exit_code == 0, result.output
        assert f"{cid} co-signed the roster {roster.fingerprint}" in result.output
    assert "every institution has co-signed it" in result.output
    assert load_cosigned_roster(path) == roster
    shown = runner.invoke(
        keys, ["roster", "show", "--roster", str(path), "--key-dir", str(tmp_path / "none")]
    )
    assert "co-signed by every institution" in shown.output
    # Any change to the roster drops the co-signatures: it must be signed again.
    extra = IdentityKey.generate()
    added = runner.invoke(
        keys,
        ["roster", "add", "--roster", str(path), "--id", "hospital-d", "--public-key",
         base64.b64encode(extra.public_key).decode()],
    )  # fmt: skip
    assert added.exit_code == 0, added.output
    with pytest.raises(RosterNotCosignedError, match="signed by nobody"):
        load_cosigned_roster(path)
    # The coordinator's key cannot co-sign.
    directory = tmp_path / "coordinator"
    directory.mkdir()
    save_identity_key(directory / "identity.key", COORDINATOR, b"a long test passphrase", scrypt_n=2**10)
    result = runner.invoke(
        keys,
        [
            "roster",
            "sign",
            "--roster",
            str(path),
            "--key-dir",
            str(directory),
            "--passphrase-file",
            str(passfile),
        ],
    )
    assert result.exit_code == 1 and "only a roster member can co-sign it" in result.output


def test_a_swapped_coordinator_key_invalidates_the_signatures() -> None:
    # Another way around the invariant: keep every institution's entry and swap the coordinator's
    # key (whoever holds the new key could sign classifiers every node accepts). The coordinator is
    # in the signed digest, so every co-signature breaks.
    roster = _roster()
    signatures = _signed(roster, KEYS)
    swapped = Roster(
        roster.entries, RosterEntry("coordinator", "Coordinator", IdentityKey.generate().public_key)
    )
    with pytest.raises(RosterCosignatureError, match="does not verify"):
        check_cosignatures(swapped, signatures)
    # And duplicated JSON keys cannot smuggle a second signature in: the one kept must verify.
    text = cosigned_roster_json(roster, signatures)
    good = json.loads(text)["cosignatures"]["hospital-a"]
    bad = base64.b64encode(bytes(64)).decode()
    duplicated = text.replace(f'"hospital-a": "{good}"', f'"hospital-a": "{good}", "hospital-a": "{bad}"')
    assert duplicated != text
    with pytest.raises(RosterCosignatureError, match="'hospital-a' does not verify"):
        roster_status(duplicated)
