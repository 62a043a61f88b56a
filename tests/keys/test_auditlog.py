"""The audit log: hash-chained, signed records; what verify names; a crash's unfinished line."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest

from secure_afl.keys.auditlog import (
    GENESIS,
    AuditLog,
    AuditLogError,
    AuditRecord,
    read_log,
    verify_log,
)
from secure_afl.keys.identity import IdentityKey


def _log(tmp_path: Path, key: IdentityKey, n: int = 4) -> Path:
    log = AuditLog(tmp_path / "audit.log")
    for i in range(n):
        log.append(key, "hospital-a", "session-accepted", {"session": str(i), "peers": ["b", "c"]})
    return log.path


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().split(b"\n")[:-1]


def _write(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(line + b"\n" for line in lines))


def test_appended_records_chain_and_verify(tmp_path: Path) -> None:
    key = IdentityKey.generate()
    path = _log(tmp_path, key)
    records = [AuditRecord.from_line(line) for line in _lines(path)]
    assert [r.index for r in records] == [0, 1, 2, 3]
    assert records[0].prev == GENESIS
    assert all(b.prev == a.digest() for a, b in itertools.pairwise(records))
    assert {r.key for r in records} == {key.fingerprint}
    result = verify_log(path, [key.public_key])
    assert result.ok and result.records == 4 and result.parties == ("hospital-a",)
    assert path.stat().st_mode & 0o777 == 0o600


def test_another_key_does_not_verify(tmp_path: Path) -> None:
    path = _log(tmp_path, IdentityKey.generate())
    other = IdentityKey.generate()
    result = verify_log(path, [other.public_key])
    assert not result.ok and result.bad_line == 1 and "not by the key(s) given" in result.reason


def test_a_hand_edited_record_is_named(tmp_path: Path) -> None:
    key = IdentityKey.generate()
    path = _log(tmp_path, key)
    lines = _lines(path)
    lines[2] = lines[2].replace(b'"session":"2"', b'"session":"7"')
    _write(path, lines)
    result = verify_log(path, [key.public_key])
    assert not result.ok
    assert result.bad_line == 3 and result.records == 2
    assert "signature does not verify" in result.reason
    assert "line 3 (record 2)" in result.describe()


def test_a_deleted_record_is_caught(tmp_path: Path) -> None:
    key = IdentityKey.generate()
    path = _log(tmp_path, key)
    lines = _lines(path)
    del lines[1]
    _write(path, lines)
    result = verify_log(path, [key.public_key])
    assert not result.ok and result.bad_line == 2
    assert "index 2, expected 1" in result.reason


def test_reordered_records_are_caught(tmp_path: Path) -> None:
    key = IdentityKey.generate()
    path = _log(tmp_path, key)
    lines = _lines(path)
    lines[1], lines[2] = lines[2], lines[1]
    _write(path, lines)
    result = verify_log(path, [key.public_key])
    assert not result.ok and result.bad_line == 2 and "reordered" in result.reason


def test_a_re_signed_record_with_the_right_index_still_breaks_the_chain(tmp_path: Path) -> None:
    """A record replaced by another one the key holder signed at the same index: its prev is right,
    but the next record's prev no longer is."""
    key = IdentityKey.generate()
    path = _log(tmp_path, key)
    lines = _lines(path)
    original = AuditRecord.from_line(lines[1])
    forged = dataclasses.replace(original, body={"session": "x"})
    forged = dataclasses.replace(forged, signature=key.private_key.sign(forged.signed_bytes()).hex())
    assert verify_log(path, [key.public_key]).ok
    lines[1] = forged.line()
    _write(path, lines)
    result = verify_log(path, [key.public_key])
    assert not result.ok and result.bad_line == 3 and "prev is not the SHA-256" in result.reason


def test_a_crash_mid_write_leaves_an_unfinished_line_the_next_append_repairs(tmp_path: Path) -> None:
    key = IdentityKey.generate()
    path = _log(tmp_path, key, n=3)
    whole = AuditRecord.from_line(_lines(path)[-1]).line()
    with open(path, "ab") as out:  # the first 40 bytes of a record, then the crash
        out.write(whole[:40])
    result = verify_log(path, [key.public_key])
    assert result.ok and result.records == 3 and result.unfinished == 40  # not tampering: unfinished
    assert "UNFINISHED (40 bytes" in result.describe()
    assert read_log(path).unfinished == whole[:40]

    record = AuditLog(path).append(key, "hospital-a", "session-refused", {"error": "X"})
    assert record.index == 4  # after the repair record (3)
    records = [AuditRecord.from_line(line) for line in _lines(path)]
    repair = records[3]
    assert repair.kind == "log-repaired" and repair.body["unfinished_bytes"] == 40
    kept = tmp_path / str(repair.body["kept_in"])
    assert kept.read_bytes() == whole[:40]  # the cut bytes are kept beside the log
    result = verify_log(path, [key.public_key])
    assert result.ok and result.records == 5 and result.unfinished == 0 and result.repairs == (3,)


def test_a_garbage_line_in_the_middle_is_not_taken_for_a_crash(tmp_path: Path) -> None:
    key = IdentityKey.generate()
    path = _log(tmp_path, key)
    lines = _lines(path)
    lines.insert(2, lines[2][:30])
    _write(path, lines)
    result = verify_log(path, [key.public_key])
    assert not result.ok and result.bad_line == 3 and "not an audit record" in result.reason


def test_append_refuses_a_log_whose_last_line_is_not_a_record(tmp_path: Path) -> None:
    key = IdentityKey.generate()
    path = _log(tmp_path, key, n=1)
    with open(path, "ab") as out:
        out.write(b"edited by hand\n")
    with pytest.raises(AuditLogError, match="line 2 is not an audit record"):
        AuditLog(path).append(key, "hospital-a", "x", {})


def test_a_body_must_be_finite_json(tmp_path: Path) -> None:
    with pytest.raises(AuditLogError, match="finite numbers"):
        AuditLog(tmp_path / "a.log").append(IdentityKey.generate(), "h", "x", {"e": float("nan")})
    assert not (tmp_path / "a.log").exists() or (tmp_path / "a.log").read_bytes() == b""


def test_audit_verify_of_a_log_without_a_record_exits_1(tmp_path: Path) -> None:
    import base64

    from click.testing import CliRunner

    from secure_afl.cli import main

    key = base64.b64encode(IdentityKey.generate().public_key).decode()
    empty = tmp_path / "audit.log"
    empty.write_bytes(b"")  # what a log cut to nothing looks like: it verified as "0 record(s)", exit 0
    result = CliRunner().invoke(main, ["audit", "verify", "--log", str(empty), "--public-key", key])
    assert result.exit_code == 1, result.output
    assert "valid: 0 record(s)" in result.output and "nothing verified: no complete record" in result.output
