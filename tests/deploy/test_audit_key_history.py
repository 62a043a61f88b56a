"""`audit verify --roster`: a party whose key was rotated or replaced after a revocation verifies its
whole log through the roster versions kept beside its roster (ROSTER.vN.json), each key only for the
records written while it was the party's (secure_afl/keys/auditlog.py, key_history)."""

from __future__ import annotations

import base64
import shutil
from pathlib import Path
from types import SimpleNamespace

from click.testing import CliRunner

from secure_afl.cli import main
from secure_afl.deploy.audit import _append, record_refusal
from secure_afl.keys import IdentityKey, Roster, RosterEntry
from secure_afl.keys.auditlog import AuditLog, read_log, verify_with
from secure_afl.keys.files import save_identity_key
from secure_afl.keys.lifecycle import next_version
from secure_afl.keys.rotation import KeyRotation
from secure_afl.keys.store import write_roster_file

IDS = ("hospital-a", "hospital-b", "hospital-c")


def _versions(tmp_path: Path, change: str) -> tuple[dict[str, IdentityKey], Roster, Roster]:
    """Roster version 1 (a, b, c) as ``kit/roster.v1.json`` and version 2 as ``kit/roster.json``: b's key
    rotated (``change="rotate"``) or c's key revoked and replaced (``change="revoke"``); returns the keys
    (``b0``/``b1``, ``c0``/``c1``: before and after) and both versions."""
    keys = {cid: IdentityKey.generate() for cid in IDS} | {
        "b1": IdentityKey.generate(),
        "c1": IdentityKey.generate(),
    }
    keys["b0"], keys["c0"] = keys["hospital-b"], keys["hospital-c"]
    coordinator = RosterEntry("coordinator", "Coordinator", IdentityKey.generate().public_key)
    v1 = Roster([RosterEntry(cid, cid, keys[cid].public_key) for cid in IDS], coordinator)
    draft = next_version(v1)
    if change == "rotate":
        rotation = KeyRotation.make("hospital-b", keys["b0"], keys["b1"].public_key)
        entries = [e for e in draft.entries if e.client_id != "hospital-b"]
        entries.append(RosterEntry("hospital-b", "hospital-b", keys["b1"].public_key))
        v2 = draft.replace(entries=tuple(entries), revoked=(keys["b0"].fingerprint,), rotations=(rotation,))
    else:
        entries = [e for e in draft.entries if e.client_id != "hospital-c"]
        entries.append(RosterEntry("hospital-c", "hospital-c", keys["c1"].public_key))
        v2 = draft.replace(entries=tuple(entries), revoked=(keys["c0"].fingerprint,))
    (tmp_path / "kit").mkdir()
    write_roster_file(tmp_path / "kit" / "roster.v1.json", v1)
    write_roster_file(tmp_path / "kit" / "roster.json", v2)
    return keys, v1, v2


def _record(log: Path, key: IdentityKey, party: str, roster: Roster, session: str) -> None:
    """What a node appends (the real writer: log-started, key-changed, roster-pinned before the record)."""
    _append(log, key, party, "session-accepted", {"session": session}, roster={"roster": roster.fingerprint})


def _verify(log: Path, roster: Path, *extra: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["audit", "verify", "--log", str(log), "--roster", str(roster), *extra])
    return result.exit_code, result.output


def test_a_rotated_key_verifies_through_the_roster_versions_kept_beside_the_roster(tmp_path: Path) -> None:
    keys, v1, v2 = _versions(tmp_path, "rotate")
    log, roster = tmp_path / "audit.log", tmp_path / "kit" / "roster.json"
    _record(log, keys["b0"], "hospital-b", v1, "s1")
    _record(log, keys["b0"], "hospital-b", v1, "s2")
    _record(log, keys["b1"], "hospital-b", v2, "s3")  # key-changed b0 -> b1, then roster-pinned v2
    kinds = [r.kind for r in read_log(log).records() if r is not None]
    assert kinds == ["log-started", "roster-pinned", "session-accepted", "session-accepted", "key-changed",
                     "roster-pinned", "session-accepted"]  # fmt: skip
    result = verify_with(log, roster_path=roster)
    assert result.ok and result.records == 7 and result.parties == ("hospital-b",)
    code, output = _verify(log, roster)
    assert code == 0 and "valid: 7 record(s) by hospital-b" in output
    # without the kept version 1 the old key is not the party's: named, with where to find it
    shutil.move(tmp_path / "kit" / "roster.v1.json", tmp_path / "roster.v1.json")
    code, output = _verify(log, roster)
    assert code == 1 and "INVALID at line 1 (record 0)" in output and "STEM.vN.json" in output
    # --public-key stays an override: the old key given by hand verifies every record
    old = base64.b64encode(keys["b0"].public_key).decode("ascii")
    code, output = _verify(log, roster, "--public-key", old)
    assert code == 0 and "valid: 7 record(s)" in output


def test_the_old_key_after_the_rotation_is_refused_and_its_record_named(tmp_path: Path) -> None:
    keys, v1, v2 = _versions(tmp_path, "rotate")
    log, roster = tmp_path / "audit.log", tmp_path / "kit" / "roster.json"
    _record(log, keys["b0"], "hospital-b", v1, "s1")
    _record(log, keys["b1"], "hospital-b", v2, "s2")  # records 3-5: key-changed, roster-pinned, session
    AuditLog(log).append(keys["b0"], "hospital-b", "session-accepted", {"session": "s3"})  # record 6
    code, output = _verify(log, roster)
    assert code == 1, output
    assert "INVALID at line 7 (record 6)" in output and f"signed by {keys['b0'].fingerprint}" in output
    assert "revoked or rotated away, after record 4 pinned roster version 2" in output
    # the old key on a log that moved to the new key without pinning version 2: the change named
    other = tmp_path / "other.log"
    _record(other, keys["b0"], "hospital-b", v1, "s1")
    AuditLog(other).append(keys["b1"], "hospital-b", "key-changed",
                           {"from": keys["b0"].fingerprint, "to": keys["b1"].fingerprint})  # fmt: skip
    AuditLog(other).append(keys["b0"], "hospital-b", "session-accepted", {"session": "s2"})
    result = verify_with(other, roster_path=roster)
    assert result.bad_line == 5 and "before the change to" in result.reason and "at record 3" in result.reason
    # the new key before the log records the change to it (no key-changed record) is refused too
    third = tmp_path / "third.log"
    _record(third, keys["b0"], "hospital-b", v1, "s1")
    AuditLog(third).append(keys["b1"], "hospital-b", "session-accepted", {"session": "s2"})
    result = verify_with(third, roster_path=roster)
    assert result.bad_line == 4 and "has not recorded the change" in result.reason


def test_a_revoked_key_after_its_revocation_is_refused_and_its_record_named(tmp_path: Path) -> None:
    keys, v1, v2 = _versions(tmp_path, "revoke")
    log, roster = tmp_path / "audit.log", tmp_path / "kit" / "roster.json"
    _record(log, keys["c0"], "hospital-c", v1, "s1")
    good = tmp_path / "good.log"
    shutil.copy(log, good)
    _record(good, keys["c1"], "hospital-c", v2, "s2")  # the node moved to its new key: verifies
    assert verify_with(good, roster_path=roster).ok
    # the leaked key used after the node pinned the version that revoked it: that record named
    _record(log, keys["c0"], "hospital-c", v2, "s2")  # roster-pinned v2 (record 3), signed by c0
    code, output = _verify(log, roster)
    assert code == 1 and "INVALID at line 4 (record 3)" in output
    assert f"signed by {keys['c0'].fingerprint}, a key of hospital-c that roster version 2 revoked" in output


def test_a_file_beside_the_roster_that_is_not_its_predecessor_is_refused(tmp_path: Path) -> None:
    keys, v1, _ = _versions(tmp_path, "rotate")
    log, roster = tmp_path / "audit.log", tmp_path / "kit" / "roster.json"
    _record(log, keys["b0"], "hospital-b", v1, "s1")
    forged = Roster([RosterEntry(cid, cid, IdentityKey.generate().public_key) for cid in IDS])
    write_roster_file(tmp_path / "kit" / "roster.v1.json", forged)
    code, output = _verify(log, roster)
    assert code == 1 and "roster.v1.json is not the roster version" in output and "predecessor" in output


def test_a_node_whose_key_is_revoked_records_no_refusal_with_it(tmp_path: Path, capsys) -> None:
    keys, _, _ = _versions(tmp_path, "revoke")
    (tmp_path / "pass").write_text("correct horse battery staple\n")
    (tmp_path / "pass").chmod(0o600)
    save_identity_key(tmp_path / "identity.key", keys["c0"], b"correct horse battery staple", scrypt_n=2**10)
    settings = SimpleNamespace(
        passphrase_file=tmp_path / "pass", passphrase_env=None, identity_key=tmp_path / "identity.key",
        roster=tmp_path / "kit" / "roster.json", ledger_dir=tmp_path / "ledger",
    )  # fmt: skip
    envelope = SimpleNamespace(meta={"session": "", "round": "R0"}, kind="advertise")
    refusal = SimpleNamespace(meta={"error": "KeyRevokedError", "message": "revoked"})
    record_refusal(envelope, refusal, None, settings, "R0")
    assert not (tmp_path / "ledger" / "audit.log").exists()
    assert "did not record this refusal: AuditLogError" in capsys.readouterr().err
