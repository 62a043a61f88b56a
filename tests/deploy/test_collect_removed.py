"""`deploy collect` at a roster version that removed a member: the member gets no new kit (its kit is
left as it was) and its SuperNode key is unregistered from the SuperLink with the node id kept at its
registration, or the command is printed and collect exits 3, not done (secure_afl/deploy/provision.py:
retire_removed).  A fake `flwr` stands in for the SuperLink's Control API."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from secure_afl.cli import main
from secure_afl.deploy import processes
from secure_afl.deploy.kit import EXIT_WAITING, read_kit
from secure_afl.keys.cosign import roster_status

from .helpers import Site
from .test_newcomer_kit import _join_newcomer
from .test_provision import HOSPITALS, Provisioned, _invoke, _join, _provision, _site

FAKE_FLWR = """#!/bin/sh
echo "$FLWR_HOME $*" >> "$FAKE_FLWR_LOG"
case "$2" in
  register) echo "SuperNode $(( $(wc -l < "$FAKE_FLWR_LOG") + 100 )) registered successfully." ;;
  unregister) if [ -n "$FAKE_FLWR_FAIL" ]; then echo "connection refused" >&2; exit 1; fi
              echo "SuperNode $3 unregistered successfully." ;;
esac
"""


@pytest.fixture
def flwr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """(the fake flwr's call log, the coordinator's flwr home)."""
    fake = tmp_path / "bin" / "flwr"
    fake.parent.mkdir()
    fake.write_text(FAKE_FLWR)
    fake.chmod(0o755)
    home = tmp_path / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text("")
    log = tmp_path / "flwr.log"
    log.write_text("")
    monkeypatch.setenv("FAKE_FLWR_LOG", str(log))
    monkeypatch.setattr(processes, "flower_bin", lambda name: str(fake))
    return log, home


def _keys(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["keys", *(str(a) for a in args)])
    return result.exit_code, result.output


def _collect(p: Provisioned, home: Path | None, *args: object) -> tuple[int, str]:
    register = ["--flwr-home", home] if home is not None else ["--no-register"]
    return _invoke(
        "collect", "--federation-dir", p.out, *args, *register, "--key-dir", p.coordinator.keys,
        "--passphrase-file", p.coordinator.passfile,
    )  # fmt: skip


def _v2_without_c(tmp_path: Path, home: Path | None) -> tuple[Provisioned, Site]:
    """Three hospitals collected (registered through ``home``'s flwr, or --no-register); roster version 2
    adds hospital-d and removes hospital-c, co-signed by A, B and D, and the coordinator moved to it."""
    p = _provision(tmp_path)
    for cid in HOSPITALS:
        _join(p.sites[cid])
    replies = [p.sites[cid].kit / f"{cid}.reply.json" for cid in HOSPITALS]
    code, output = _collect(p, home, *replies)
    assert code == 0, output
    d = _site(tmp_path, "hospital-d")
    draft = tmp_path / "roster.v2.json"
    assert _keys("roster", "next", "--roster", p.out / "roster.json", "--out", draft)[0] == 0
    code, output = _keys("roster", "add", "--roster", draft, "--entry", d.keys / "identity.pub.json",
                         "--fingerprint", d.key.fingerprint)  # fmt: skip
    assert code == 0, output
    assert _keys("roster", "remove", "--roster", draft, "--id", "hospital-c")[0] == 0
    for site in (p.sites["hospital-a"], p.sites["hospital-b"], d):
        code, output = _keys("roster", "sign", "--roster", draft, "--key-dir", site.keys, "--passphrase-file",
                             site.passfile, "--yes")  # fmt: skip
        assert code == 0, output
    code, output = _keys("roster", "update", "--roster", p.out / "roster.json", "--new", draft, "--expect",
                         d.expect())  # fmt: skip
    assert code == 0 and "removed: hospital-c" in output, output
    return p, d


def _files(kit: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(kit)): path.read_bytes() for path in sorted(kit.rglob("*")) if path.is_file()
    }


def test_a_removed_member_gets_no_new_kit_and_its_supernode_key_is_unregistered(
    tmp_path: Path, flwr: tuple[Path, Path]
) -> None:
    log, home = flwr
    p, d = _v2_without_c(tmp_path, home)
    keys = p.out / "supernodes"
    node_c = (keys / "hospital-c.node-id").read_text().strip()
    assert node_c.isdigit() and len({(keys / f"{cid}.node-id").read_text() for cid in HOSPITALS}) == 3
    kit_c = _files(p.out / "kits" / "hospital-c")
    v1 = read_kit(p.out / "kits" / "hospital-c")[0].roster_fingerprint
    code, output = _collect(p, home)
    assert code == EXIT_WAITING and "WAITING for the replies of ['hospital-d']" in output, output
    assert (
        f"hospital-c is not in roster version 2: no new kit ({p.out.resolve() / 'kits' / 'hospital-c'}"
        in output
    )
    assert f"unregistered the SuperNode key of hospital-c (node {node_c})" in output
    assert log.read_text().splitlines()[-1] == f"{home} supernode unregister {node_c} federation"
    assert not (keys / "hospital-c.pub").exists() and (keys / "removed" / "hospital-c.pub").is_file()
    assert (keys / "removed" / "hospital-c.node-id").read_text().strip() == node_c
    # hospital-d joins and its reply is collected: every member's kit is at version 2, hospital-c's as it was
    shutil.copytree(p.out / "kits" / "hospital-d", d.kit)
    expects = [a for s in (*p.sites.values(), p.coordinator) if s.client_id != "hospital-c"
               for a in ("--expect", s.expect())]  # fmt: skip
    code, output = _join_newcomer(d, expects)
    assert code == 0, output
    calls = len(log.read_text().splitlines())
    code, output = _collect(p, home, d.kit / "hospital-d.reply.json")
    assert code == 0 and "every institution has its kit at this version" in output, output
    assert len(log.read_text().splitlines()) == calls + 1  # D registered; C not unregistered again
    v2 = roster_status((p.out / "roster.json").read_text()).roster
    for cid in ("hospital-a", "hospital-b", "hospital-d"):
        manifest, status = read_kit(p.out / "kits" / cid)
        assert manifest.roster_fingerprint == v2.fingerprint and status.complete
    assert _files(p.out / "kits" / "hospital-c") == kit_c  # its manifest still matches its roster
    assert read_kit(p.out / "kits" / "hospital-c")[0].roster_fingerprint == v1 != v2.fingerprint


def test_a_removed_members_key_that_collect_cannot_unregister_is_printed_and_not_done(
    tmp_path: Path, flwr: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    log, home = flwr
    p, _ = _v2_without_c(tmp_path, None)  # registered by hand: no node id kept
    keys = p.out / "supernodes"
    assert not (keys / "hospital-c.node-id").exists()
    code, output = _collect(p, None)
    assert code == EXIT_WAITING, output
    assert "NOT DONE: hospital-c's SuperNode key" in output and "(--no-register)" in output
    assert (
        f"FLWR_HOME={p.out.resolve() / 'superlink' / 'flwr'} flwr supernode unregister NODE_ID federation"
        in output
    )
    assert "NOT DONE: ['hospital-c'] left the roster" in output and (keys / "hospital-c.pub").is_file()
    code, output = _collect(p, home)
    assert code == EXIT_WAITING and f"no node id kept in {keys.resolve() / 'hospital-c.node-id'}" in output
    assert "unregister" not in log.read_text()
    # with its node id, a SuperLink that refuses is an error (exit 1), and nothing is moved
    (keys / "hospital-c.node-id").write_text("4242\n")
    monkeypatch.setenv("FAKE_FLWR_FAIL", "1")
    code, output = _collect(p, home)
    assert code == 1 and "supernode unregister 4242 federation exited 1: connection refused" in output, output
    assert (keys / "hospital-c.pub").is_file()
    monkeypatch.delenv("FAKE_FLWR_FAIL")
    code, output = _collect(p, home)
    assert "unregistered the SuperNode key of hospital-c (node 4242)" in output and code == EXIT_WAITING
    assert (keys / "removed" / "hospital-c.pub").is_file()
