"""The roster's coordinator: the key that signs the classifier file (not an institution)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from secure_afl import cli_keys as key_commands
from secure_afl.cli import main
from secure_afl.keys import IdentityKey, Roster, RosterEntry, RosterError
from secure_afl.keys.roster import ROSTER_FORMAT


@pytest.fixture(autouse=True)
def fast_scrypt(monkeypatch: pytest.MonkeyPatch) -> None:
    original = key_commands.save_identity_key
    monkeypatch.setattr(
        key_commands, "save_identity_key", lambda *a, **k: original(*a, **{**k, "scrypt_n": 2**10})
    )


def _entries() -> list[RosterEntry]:
    return [RosterEntry(cid, f"Hospital {cid}", IdentityKey.generate().public_key) for cid in ("a", "b", "c")]


def test_a_roster_without_coordinator_keeps_its_digest_and_one_with_it_changes_it() -> None:
    entries = _entries()
    hasher = hashlib.sha256(ROSTER_FORMAT.encode("ascii"))  # the digest as documented before coordinators
    for entry in sorted(entries, key=lambda e: e.client_id):
        for part in (entry.client_id.encode("ascii"), entry.name.encode("utf-8"), entry.public_key):
            hasher.update(len(part).to_bytes(4, "big") + part)
    assert Roster(entries).digest() == hasher.digest()
    coordinator = RosterEntry("coordinator", "Coordinator", IdentityKey.generate().public_key)
    roster = Roster(entries, coordinator)
    assert roster.digest() != hasher.digest()
    other = Roster(entries, RosterEntry("coordinator", "Coordinator", IdentityKey.generate().public_key))
    assert other.fingerprint != roster.fingerprint  # another coordinator key: another roster
    # Not an institution: no share point, not counted, not among the client ids.
    assert len(roster) == 3 and roster.client_ids == ("a", "b", "c") and "coordinator" not in roster
    again = Roster.from_json(roster.to_json())
    assert again == roster and again.coordinator == coordinator and again.fingerprint == roster.fingerprint
    assert "coordinator" not in json.loads(Roster(entries).to_json())


def test_the_coordinator_needs_its_own_id_and_key() -> None:
    entries = _entries()
    with pytest.raises(RosterError, match="also an institution's: give the coordinator its own id"):
        Roster(entries, RosterEntry("a", "Coordinator", IdentityKey.generate().public_key))
    with pytest.raises(RosterError, match="needs its own identity key"):
        Roster(entries, RosterEntry("coordinator", "Coordinator", entries[0].public_key))
    document = json.loads(Roster(entries).to_json())
    document["coordinator"] = {"id": "coordinator", "name": "C", "public_key": 5}
    with pytest.raises(RosterError, match="must be a base64 string"):
        Roster.from_json(json.dumps(document))


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def test_keys_roster_add_coordinator_show_verify_remove(tmp_path: Path) -> None:
    passfile = tmp_path / "pass"
    passfile.write_text("correct horse battery staple\n")
    passfile.chmod(0o600)
    dirs = {}
    for cid in ("hospital-a", "coordinator"):
        dirs[cid] = tmp_path / cid
        code, out = _run(
            "keys", "init", "--id", cid, "--passphrase-file", str(passfile), "--key-dir", str(dirs[cid])
        )
        assert code == 0, out
    roster = tmp_path / "roster.json"
    entry = lambda cid: str(dirs[cid] / "identity.pub.json")  # noqa: E731
    code, out = _run(
        "keys", "roster", "add", "--roster", str(roster), "--coordinator", "--entry", entry("coordinator")
    )
    assert code == 0 and "added coordinator as the coordinator" in out
    code, out = _run("keys", "roster", "add", "--roster", str(roster), "--entry", entry("hospital-a"))
    assert code == 0, out
    pinned = Roster.from_json(roster.read_text())
    assert pinned.client_ids == ("hospital-a",) and pinned.coordinator is not None  # kept by the second add
    code, out = _run("keys", "roster", "show", "--roster", str(roster), "--key-dir", str(dirs["hospital-a"]))
    assert code == 0 and "(coordinator: signs the classifier)" in out
    fingerprint = pinned.coordinator.fingerprint
    code, out = _run(
        "keys",
        "roster",
        "verify",
        "--roster",
        str(roster),
        "--id",
        "coordinator",
        "--fingerprint",
        fingerprint,
    )
    assert code == 0 and "fingerprint matches" in out
    code, out = _run(
        "keys", "roster", "add", "--roster", str(roster), "--coordinator", "--entry", entry("coordinator")
    )
    assert code == 1 and "already names the coordinator 'coordinator'" in out
    code, out = _run("keys", "roster", "remove", "--roster", str(roster), "--id", "coordinator")
    assert code == 0 and Roster.from_json(roster.read_text()).coordinator is None
    code, out = _run("keys", "roster", "show", "--roster", str(roster))
    assert code == 0 and "no coordinator: add one" in out
