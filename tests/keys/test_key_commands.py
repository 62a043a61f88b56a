"""``secure-afl keys ...``: init, show, roster add/remove/show/verify and their errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from secure_afl import cli_keys as key_commands
from secure_afl.cli import main
from secure_afl.keys import Roster, load_identity_key, load_roster


@pytest.fixture(autouse=True)
def fast_scrypt(monkeypatch: pytest.MonkeyPatch) -> None:
    # The default scrypt cost (2^17) is exercised by tests/keys/test_keys.py; here it only costs time.
    original = key_commands.save_identity_key
    monkeypatch.setattr(
        key_commands, "save_identity_key", lambda *a, **k: original(*a, **{**k, "scrypt_n": 2**10})
    )


def _passfile(tmp_path: Path, text: str = "correct horse battery staple", name: str = "pass") -> Path:
    path = tmp_path / name
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def init(tmp_path: Path, cid: str, passfile: Path) -> Path:
    directory = tmp_path / cid
    code, out = run(
        "keys", "init", "--id", cid, "--passphrase-file", str(passfile), "--key-dir", str(directory)
    )
    assert code == 0, out
    return directory


def fingerprint_of(directory: Path) -> str:
    return json.loads((directory / "identity.pub.json").read_text())["fingerprint"]


def test_init_writes_a_private_encrypted_key_and_a_public_entry(tmp_path: Path) -> None:
    passfile = _passfile(tmp_path)
    directory = init(tmp_path, "hospital-a", passfile)
    key_file = directory / "identity.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    key = load_identity_key(key_file, b"correct horse battery staple")
    entry = json.loads((directory / "identity.pub.json").read_text())
    assert entry["id"] == "hospital-a" and entry["fingerprint"] == key.fingerprint
    code, out = run("keys", "show", "--passphrase-file", str(passfile), "--key-dir", str(directory))
    assert code == 0 and key.fingerprint in out and "hospital-a" in out
    # A second init refuses to destroy the key.
    code, out = run(
        "keys", "init", "--id", "hospital-a", "--passphrase-file", str(passfile), "--key-dir", str(directory)
    )
    assert code != 0 and "already exists" in out


def test_show_names_a_wrong_passphrase_and_an_open_key_file(tmp_path: Path) -> None:
    directory = init(tmp_path, "hospital-a", _passfile(tmp_path))
    wrong = _passfile(tmp_path, "wrong", name="wrong")
    code, out = run("keys", "show", "--passphrase-file", str(wrong), "--key-dir", str(directory))
    assert code != 0 and "wrong passphrase" in out
    (directory / "identity.key").chmod(0o644)
    code, out = run(
        "keys", "show", "--passphrase-file", str(_passfile(tmp_path)), "--key-dir", str(directory)
    )
    assert code != 0 and "too open" in out and "chmod 600" in out
    open_pass = _passfile(tmp_path, name="open")
    open_pass.chmod(0o644)
    code, out = run("keys", "show", "--passphrase-file", str(open_pass), "--key-dir", str(directory))
    assert code != 0 and "passphrase file" in out


def test_roster_add_show_verify_remove(tmp_path: Path) -> None:
    passfile = _passfile(tmp_path)
    dirs = {cid: init(tmp_path, cid, passfile) for cid in ("hospital-a", "hospital-b", "hospital-c")}
    roster_path = tmp_path / "roster.json"
    for directory in dirs.values():
        fp = fingerprint_of(directory)
        code, out = run(
            "keys", "roster", "add", "--roster", str(roster_path),
            "--entry", str(directory / "identity.pub.json"), "--fingerprint", fp.lower().replace(" ", ""),
        )  # fmt: skip
        assert code == 0, out
    roster = load_roster(roster_path)
    assert roster.client_ids == ("hospital-a", "hospital-b", "hospital-c")
    code, out = run(
        "keys", "roster", "show", "--roster", str(roster_path), "--key-dir", str(dirs["hospital-b"])
    )
    assert code == 0 and "(this institution)" in out and roster.fingerprint in out
    fp_c = fingerprint_of(dirs["hospital-c"])
    code, out = run(
        "keys", "roster", "verify", "--roster", str(roster_path), "--id", "hospital-c",
        "--fingerprint", fp_c, "--key-dir", str(dirs["hospital-a"]),
    )  # fmt: skip
    assert code == 0 and "matches" in out
    code, out = run("keys", "roster", "remove", "--roster", str(roster_path), "--id", "hospital-c")
    assert code == 0 and load_roster(roster_path).client_ids == ("hospital-a", "hospital-b")


def test_roster_errors_are_specific(tmp_path: Path) -> None:
    passfile = _passfile(tmp_path)
    a, b = init(tmp_path, "hospital-a", passfile), init(tmp_path, "hospital-b", passfile)
    roster_path = tmp_path / "roster.json"
    assert (
        run("keys", "roster", "add", "--roster", str(roster_path), "--entry", str(a / "identity.pub.json"))[0]
        == 0
    )
    # Duplicate id.
    code, out = run(
        "keys", "roster", "add", "--roster", str(roster_path), "--entry", str(a / "identity.pub.json")
    )
    assert code != 0 and "already in the roster" in out
    # A fingerprint heard out of band that does not match the key: nothing is added.
    code, out = run(
        "keys", "roster", "add", "--roster", str(roster_path), "--entry", str(b / "identity.pub.json"),
        "--fingerprint", fingerprint_of(a),
    )  # fmt: skip
    assert code != 0 and "fingerprint mismatch" in out
    assert load_roster(roster_path).client_ids == ("hospital-a",)
    # verify with a wrong fingerprint.
    code, out = run(
        "keys",
        "roster",
        "verify",
        "--roster",
        str(roster_path),
        "--id",
        "hospital-a",
        "--fingerprint",
        "ab" * 32,
    )
    assert code != 0 and "FINGERPRINT MISMATCH" in out
    code, out = run(
        "keys", "roster", "verify", "--roster", str(roster_path), "--id", "hospital-a", "--fingerprint", "xyz"
    )
    assert code != 0 and "not a fingerprint" in out
    # A roster without the local key.
    code, out = run("keys", "roster", "show", "--roster", str(roster_path), "--key-dir", str(b))
    assert code != 0 and "lacks this institution" in out and "hospital-b" in out
    # A malformed roster.
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "secure-afl-roster/v1", "clients": [{"id": "x"}]}')
    code, out = run("keys", "roster", "show", "--roster", str(bad))
    assert code != 0 and "malformed roster" in out


def test_roster_fingerprint_ignores_formatting_but_not_content(tmp_path: Path) -> None:
    passfile = _passfile(tmp_path)
    a, b = init(tmp_path, "hospital-a", passfile), init(tmp_path, "hospital-b", passfile)
    path = tmp_path / "roster.json"
    for d in (a, b):
        run("keys", "roster", "add", "--roster", str(path), "--entry", str(d / "identity.pub.json"))
    roster = load_roster(path)
    reformatted = Roster.from_json(json.dumps(json.loads(path.read_text())))
    assert reformatted.fingerprint == roster.fingerprint
    fewer = Roster(e for e in roster.entries if e.client_id == "hospital-a")
    assert fewer.fingerprint != roster.fingerprint
    assert os.path.exists(path)


def test_init_refuses_a_short_passphrase_from_every_source(tmp_path: Path, monkeypatch) -> None:
    short = _passfile(tmp_path, "eleven char", name="short")  # 11 characters
    code, out = run(
        "keys", "init", "--id", "h", "--passphrase-file", str(short), "--key-dir", str(tmp_path / "a")
    )
    assert code != 0 and "has 11 character(s); a new key needs at least 12" in out
    assert not (tmp_path / "a").exists()  # nothing written
    monkeypatch.setenv("SHORT_PASS", "tiny")
    code, out = run(
        "keys", "init", "--id", "h", "--passphrase-env", "SHORT_PASS", "--key-dir", str(tmp_path / "b")
    )
    assert code != 0 and "has 4 character(s)" in out and not (tmp_path / "b").exists()
    result = CliRunner().invoke(main, ["keys", "init", "--id", "h", "--key-dir", str(tmp_path / "c")],
                                input="short\nshort\n")  # fmt: skip
    assert result.exit_code != 0 and "has 5 character(s)" in result.output
    assert not (tmp_path / "c" / "identity.key").exists()


def test_the_passphrase_from_an_environment_variable(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOSPITAL_A_PASS", "correct horse battery staple")
    directory = tmp_path / "a"
    code, out = run("keys", "init", "--id", "hospital-a", "--passphrase-env", "HOSPITAL_A_PASS",
                    "--key-dir", str(directory))  # fmt: skip
    assert code == 0, out
    key = load_identity_key(directory / "identity.key", b"correct horse battery staple")
    code, out = run("keys", "show", "--passphrase-env", "HOSPITAL_A_PASS", "--key-dir", str(directory))
    assert code == 0 and key.fingerprint in out
    code, out = run("keys", "show", "--passphrase-env", "NOT_SET_ANYWHERE", "--key-dir", str(directory))
    assert code != 0 and "NOT_SET_ANYWHERE is not set" in out
    code, out = run("keys", "show", "--passphrase-env", "HOSPITAL_A_PASS", "--passphrase-file",
                    str(_passfile(tmp_path)), "--key-dir", str(directory))  # fmt: skip
    assert code != 0 and "not both" in out
