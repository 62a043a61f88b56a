"""Recognising every roster entry before co-signing (``deploy join --expect``) or provisioning
(``deploy provision --expect``): a mismatch, an entry not named, a name not in the roster, a
refused prompt, or no way to confirm at all refuses, and nothing is signed or written."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import secure_afl.cli_keys as key_commands
from secure_afl.cli_deploy import deploy
from secure_afl.cli_keys import keys
from secure_afl.deploy.kit import EXIT_WAITING
from secure_afl.deploy.local import free_port
from secure_afl.features.file import save_feature_file
from secure_afl.keys import IdentityKey, Roster, RosterEntry, save_identity_key
from secure_afl.keys.cosign import read_roster_document
from secure_afl.keys.recognition import (
    FingerprintSyntaxError,
    Recognition,
    RecognitionModeError,
    RosterNotRecognisedError,
    parse_expected,
    parse_fingerprint,
    unrecognised,
)

from .helpers import Site, pixel_digests, row_digests

HOSPITALS = ("hospital-a", "hospital-b", "hospital-c")
CLASSES = ("A", "B", "C")
PASSPHRASE = b"a long test passphrase"


# --- the rule, in the library --------------------------------------------------------------------


def _entry(client_id: str) -> RosterEntry:
    return RosterEntry(client_id, client_id.title(), IdentityKey.generate().public_key)


def test_fingerprints_are_read_in_any_spacing_and_case_and_only_whole() -> None:
    entry = _entry("hospital-a")
    compact = entry.fingerprint.removeprefix("SHA256:").replace(" ", "")
    for text in (entry.fingerprint, compact, compact.upper(), f"  sha256:{compact[:20]} {compact[20:]} "):
        assert parse_fingerprint(text) == entry.fingerprint
    for bad in (compact[:-4], compact + "00", compact[:-1] + "g", ""):
        with pytest.raises(FingerprintSyntaxError, match="not a fingerprint: expected 64 hex digits"):
            parse_fingerprint(bad)
    with pytest.raises(FingerprintSyntaxError, match="expected ID=FINGERPRINT"):
        parse_expected([compact])
    with pytest.raises(FingerprintSyntaxError, match="'hospital-a' is given twice"):
        parse_expected([f"hospital-a={compact}", f"hospital-a={compact}"])


def test_every_entry_must_be_named_with_its_own_fingerprint() -> None:
    a, b, c = (_entry(cid) for cid in HOSPITALS)
    entries = (a, b, c)
    good = {e.client_id: e.fingerprint for e in entries}
    assert unrecognised(entries, good) == []
    # b with c's fingerprint, c not named, a stranger named: all three reported at once.
    problems = unrecognised(
        entries, {"hospital-a": a.fingerprint, "hospital-b": c.fingerprint, "x": a.fingerprint}
    )
    assert len(problems) == 3
    assert problems[0].startswith("FINGERPRINT MISMATCH for 'hospital-b': the roster holds " + b.fingerprint)
    assert problems[1].startswith(f"'hospital-c' ({c.fingerprint}) is not expected")
    assert problems[2] == "'x' is expected but is not in the roster"
    # An entry verified otherwise (``known``) needs no expectation, but one given is still checked.
    assert (
        unrecognised(
            entries, {"hospital-b": b.fingerprint, "hospital-c": c.fingerprint}, known=("hospital-a",)
        )
        == []
    )
    assert unrecognised(entries, {**good, "hospital-a": b.fingerprint}, known=("hospital-a",))[0].startswith(
        "FINGERPRINT MISMATCH for 'hospital-a'"
    )


def test_recognition_refuses_without_a_way_to_confirm_and_on_a_no() -> None:
    entries = tuple(_entry(cid) for cid in HOSPITALS)
    with pytest.raises(RosterNotRecognisedError, match="nobody can confirm the entries here"):
        Recognition().verify(entries, what="r")
    shown: list[tuple[str, ...]] = []

    def answer(value: bool):
        def confirm(seen) -> bool:
            shown.append(tuple(e.client_id for e in seen))
            return value

        return confirm

    with pytest.raises(RosterNotRecognisedError, match="you did not confirm every entry"):
        Recognition(confirm=answer(False)).verify(entries, what="r")
    assert Recognition(confirm=answer(True)).verify(entries, what="r") == "you confirmed every entry"
    assert shown == [HOSPITALS, HOSPITALS]  # the person was shown every entry, both times
    # Expected fingerprints or --yes decide without asking; the two together are refused.
    expected = {e.client_id: e.fingerprint for e in entries}
    assert "matches" in Recognition(expected=expected, confirm=answer(False)).verify(entries, what="r")
    assert "--yes" in Recognition(assume_recognised=True, confirm=answer(False)).verify(entries, what="r")
    assert len(shown) == 2
    with pytest.raises(RecognitionModeError, match="not both"):
        Recognition(expected=expected, assume_recognised=True)
    with pytest.raises(RecognitionModeError, match="no expected fingerprint"):
        Recognition(expected={})


# --- deploy join and deploy provision ------------------------------------------------------------


def _site(root: Path, client_id: str, key: IdentityKey | None = None) -> Site:
    key = key or IdentityKey.generate()
    keys = root / client_id / "keys"
    keys.mkdir(parents=True)
    save_identity_key(keys / "identity.key", key, PASSPHRASE, scrypt_n=2**10)
    (keys / "identity.pub.json").write_text(
        json.dumps({
            "format": "secure-afl-roster-entry/v1", "id": client_id, "name": client_id.title(),
            "public_key": base64.b64encode(key.public_key).decode(), "fingerprint": key.fingerprint,
        })
    )  # fmt: skip
    (keys / "pass").write_bytes(PASSPHRASE + b"\n")
    (keys / "pass").chmod(0o600)
    rng = np.random.default_rng(len(client_id))
    save_feature_file(
        root / client_id / "features.npz", rng.random((12, 40)),
        labels=(rng.random((12, 3)) < 0.5).astype(np.uint8), active=(0, 1, 2), classes=CLASSES,
        backbone="toy", weights_id="sha256:00", preprocessing="none",
        image_sha256=row_digests(client_id, 12), pixel_sha256=pixel_digests(row_digests(client_id, 12)),
    )  # fmt: skip
    return Site(client_id, root / client_id, key)


def _invoke(*args: object, input: str | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(deploy, [str(a) for a in args], input=input)
    return result.exit_code, result.output


def _provision_args(out: Path, hospitals: list[Site], coordinator: Site) -> list[object]:
    return [
        "provision", "--federation-dir", out, *(a for s in hospitals for a in ("--hospital", s.keys)),
        "--key-dir", coordinator.keys, "--passphrase-file", coordinator.keys / "pass",
        "--ip", "127.0.0.1", "--port", free_port(), "--features", hospitals[0].features,
        "--set", "colluders=0",
    ]  # fmt: skip


def _snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (and every directory, as b"<dir>"), by relative path."""
    return {
        str(p.relative_to(directory)): (p.read_bytes() if p.is_file() else b"<dir>")
        for p in sorted(directory.rglob("*"))
    }


@dataclass
class Federation:
    sites: dict[str, Site]
    coordinator: Site
    out: Path


def _federation(tmp_path: Path, keys: dict[str, IdentityKey] | None = None) -> Federation:
    """Three hospitals provisioned (``keys``: the keys the coordinator puts in the roster instead of
    the hospitals' own), each holding its kit."""
    sites = {cid: _site(tmp_path, cid) for cid in HOSPITALS}
    coordinator = _site(tmp_path, "coordinator")
    listed = [
        _site(tmp_path / "listed", cid, keys[cid]) if keys and cid in keys else sites[cid]
        for cid in HOSPITALS
    ]
    out = tmp_path / "coordinator" / "fed"
    code, output = _invoke(*_provision_args(out, listed, coordinator), "--yes")
    assert code == 0, output
    for site in sites.values():
        shutil.copytree(out / "kits" / site.client_id, site.kit)
    return Federation(sites, coordinator, out)


def _join(site: Site, *extra: object, input: str | None = None) -> tuple[int, str]:
    return _invoke(
        "join", site.kit, "--features", site.features, "--key-dir", site.keys, "--passphrase-file",
        site.keys / "pass", "--set", "colluders=0", "--no-connect", *extra, input=input,
    )  # fmt: skip


def _expect_all(f: Federation, but: str, omit: tuple[str, ...] = ()) -> list[str]:
    """--expect for every entry a hospital must name (the other hospitals and the coordinator), less
    ``omit``."""
    named = [s for cid, s in f.sites.items() if cid != but] + [f.coordinator]
    return [a for s in named if s.client_id not in omit for a in ("--expect", s.expect())]


def test_join_with_every_expected_fingerprint_co_signs(tmp_path: Path) -> None:
    f = _federation(tmp_path)
    a = f.sites["hospital-a"]
    code, output = _join(a, *_expect_all(f, "hospital-a"))
    assert code == EXIT_WAITING, output
    assert "ok  roster entries: every entry matches the fingerprint you expected (3 given)" in output
    assert (a.kit / "hospital-a.reply.json").is_file()
    # Its own entry may be named too (then it is checked): the same outcome.
    b = f.sites["hospital-b"]
    code, output = _join(b, *_expect_all(f, "hospital-b"), "--expect", b.expect())
    assert code == EXIT_WAITING and "(4 given)" in output, output


def test_join_refuses_an_entry_the_coordinator_keyed_itself_and_writes_nothing(tmp_path: Path) -> None:
    # The coordinator lists hospital-b with a key of its own making: B's true fingerprint, heard
    # from B, does not match, and hospital-a signs nothing.
    f = _federation(tmp_path, keys={"hospital-b": IdentityKey.generate()})
    a = f.sites["hospital-a"]
    before = _snapshot(a.root)
    code, output = _join(a, *_expect_all(f, "hospital-a"))
    assert code == 1, output
    assert "FAILED RosterNotRecognisedError:" in output
    assert (
        "FINGERPRINT MISMATCH for 'hospital-b'" in output
        and f"you expected {f.sites['hospital-b'].key.fingerprint}" in output
    )
    assert _snapshot(a.root) == before  # no reply, no node files, no SuperNode key, no state directory
    assert not (a.kit / "hospital-a.reply.json").exists() and not (a.kit / "state").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("drop-coordinator", "'coordinator' ("),  # the coordinator is an entry to recognise too
        ("drop-hospital", "'hospital-c' ("),
        ("stranger", "'hospital-x' is expected but is not in the roster"),
    ],
)
def test_join_refuses_an_entry_not_named_or_a_name_not_in_the_roster(
    tmp_path: Path, change: str, message: str
) -> None:
    f = _federation(tmp_path)
    a = f.sites["hospital-a"]
    omit = {"drop-coordinator": ("coordinator",), "drop-hospital": ("hospital-c",)}.get(change, ())
    expect = _expect_all(f, "hospital-a", omit)
    if change == "stranger":
        expect += ["--expect", f"hospital-x={a.key.fingerprint}"]
    before = _snapshot(a.root)
    code, output = _join(a, *expect)
    assert code == 1 and "RosterNotRecognisedError" in output and message in output, output
    assert _snapshot(a.root) == before


def test_join_asks_at_a_terminal_and_refuses_without_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = _federation(tmp_path)
    a = f.sites["hospital-a"]
    before = _snapshot(a.root)
    # No terminal, no --expect, no --yes: refused, nothing written, and the message says what to pass.
    code, output = _join(a)
    assert code == 1 and "nobody can confirm the entries here (no terminal)" in output, output
    assert "--expect ID=FINGERPRINT" in output and "--yes" in output
    assert _snapshot(a.root) == before
    monkeypatch.setattr(key_commands, "stdin_is_terminal", lambda: True)
    code, output = _join(a, input="n\n")
    assert code == 1 and "you did not confirm every entry" in output, output
    prompt = output.index("Co-sign this roster?")
    for site in (*f.sites.values(), f.coordinator):  # every entry shown before the question
        assert output.index(f"{site.client_id:<20} {site.key.fingerprint}") < prompt
    assert _snapshot(a.root) == before
    code, output = _join(a, input="y\n")
    assert code == EXIT_WAITING and "ok  roster entries: you confirmed every entry" in output, output
    assert (a.kit / "hospital-a.reply.json").is_file()


def test_join_options_are_checked_before_anything_runs(tmp_path: Path) -> None:
    f = _federation(tmp_path)
    a = f.sites["hospital-a"]
    code, output = _join(a, *_expect_all(f, "hospital-a"), "--yes")
    assert code == 2 and "--expect and --yes" in output, output
    code, output = _join(a, "--expect", "hospital-b=SHA256:ab12")
    assert code == 2 and "not a fingerprint" in output, output
    code, output = _join(a, "--expect", "hospital-b")
    assert code == 2 and "expected ID=FINGERPRINT" in output, output
    assert not (a.kit / "hospital-a.reply.json").exists()


def test_provision_checks_every_hospitals_fingerprint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sites = [_site(tmp_path, cid) for cid in HOSPITALS]
    coordinator = _site(tmp_path, "coordinator")
    out = tmp_path / "fed"
    args = _provision_args(out, sites, coordinator)
    true = [a for s in sites for a in ("--expect", s.expect())]
    # A mismatch (hospital-b's file carries another key than the one B read aloud): nothing written.
    swapped = [*true[:2], "--expect", f"hospital-b={sites[2].key.fingerprint}", *true[4:]]
    code, output = _invoke(*args, *swapped)
    assert (
        code == 1
        and "RosterNotRecognisedError" in output
        and "FINGERPRINT MISMATCH for 'hospital-b'" in output
    )
    assert not out.exists()
    code, output = _invoke(*args, *true[:4])  # hospital-c not named
    assert code == 1 and "'hospital-c' (" in output and "is not expected" in output, output
    assert not out.exists()
    code, output = _invoke(*args)  # no terminal, no --expect, no --yes
    assert code == 1 and "nobody can confirm" in output and "--expect ID=FINGERPRINT" in output, output
    assert not out.exists()
    monkeypatch.setattr(key_commands, "stdin_is_terminal", lambda: True)
    code, output = _invoke(*args, input="n\n")
    assert code == 1 and "Provision a roster of these hospitals?" in output and "did not confirm" in output
    assert not out.exists()
    code, output = _invoke(*args, *true)
    assert code == 0 and "every entry matches the fingerprint you expected (3 given)" in output, output
    roster = json.loads((out / "roster.json").read_text())
    assert [e["fingerprint"] for e in roster["clients"]] == [s.key.fingerprint for s in sites]
    digest = hashlib.sha256((out / "roster.json").read_bytes()).hexdigest()
    code, output = _invoke(*args, "--force", input="y\n")  # the prompt confirms
    assert code == 0 and "you confirmed every entry" in output, output
    assert hashlib.sha256((out / "roster.json").read_bytes()).hexdigest() == digest  # the same roster


def test_keys_roster_sign_checks_every_entry_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The other way to co-sign (without a kit) holds to the same rule.
    sites = [_site(tmp_path, cid) for cid in HOSPITALS]
    coordinator = _site(tmp_path, "coordinator")
    roster = Roster(
        [RosterEntry(s.client_id, s.client_id.title(), s.key.public_key) for s in sites],
        RosterEntry("coordinator", "Coordinator", coordinator.key.public_key),
    )
    path = tmp_path / "roster.json"
    path.write_text(roster.to_json())
    text = path.read_bytes()
    a = sites[0]
    args = ["roster", "sign", "--roster", path, "--key-dir", a.keys, "--passphrase-file", a.keys / "pass"]

    def sign(*extra: object, input: str | None = None) -> tuple[int, str]:
        result = CliRunner().invoke(keys, [str(x) for x in (*args, *extra)], input=input)
        return result.exit_code, result.output

    wrong = ["--expect", f"hospital-b={sites[2].key.fingerprint}", "--expect", sites[2].expect()]
    code, output = sign(*wrong, "--expect", coordinator.expect())
    assert code == 1 and "FINGERPRINT MISMATCH for 'hospital-b'" in output, output
    code, output = sign("--expect", sites[1].expect(), "--expect", sites[2].expect())  # no coordinator
    assert code == 1 and "'coordinator' (" in output and "is not expected" in output, output
    code, output = sign()  # no terminal
    assert code == 1 and "nobody can confirm" in output, output
    monkeypatch.setattr(key_commands, "stdin_is_terminal", lambda: True)
    code, output = sign(input="n\n")
    assert code == 1 and "did not confirm" in output, output
    assert path.read_bytes() == text  # nothing signed by any refusal
    code, output = sign(
        "--expect", sites[1].expect(), "--expect", sites[2].expect(), "--expect", coordinator.expect()
    )
    assert code == 0 and "every entry matches" in output, output
    assert set(read_roster_document(path.read_text())[1]) == {"hospital-a"}
