"""Roster versions and key lifecycle (secure_afl/keys/lifecycle.py, rotation.py): a node moves from its
pinned co-signed roster only to the next version co-signed by every member of the new one, naming the
pinned digest, with each newcomer recognised; keys rotate by a statement of the old key and are revoked
for good; the commands `keys roster next/add/remove/rotate/revoke/sign/update` and `keys rotate`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest
from click.testing import CliRunner

from secure_afl import cli_keys as key_commands
from secure_afl.cli import main
from secure_afl.core.errors import LedgerTamperedError
from secure_afl.keys import IdentityKey, Roster, RosterEntry, RosterError
from secure_afl.keys.cosign import RosterNotCosignedError, cosigned_roster_json, sign_roster
from secure_afl.keys.lifecycle import (
    RosterNotPinnedError,
    RosterSuccessionError,
    accept_successor,
    check_pin,
    next_version,
    write_pin,
)
from secure_afl.keys.recognition import Recognition, RosterNotRecognisedError
from secure_afl.keys.rotation import KeyRotation, KeyRotationError
from secure_afl.privacy.ledger import FileLedger, LedgerOwner

PASS = "correct horse battery staple"


def _keys(*ids: str) -> dict[str, IdentityKey]:
    return {cid: IdentityKey.generate() for cid in ids}


def _roster(keys: Mapping[str, IdentityKey], coordinator: IdentityKey, **fields: object) -> Roster:
    entries = [RosterEntry(cid, cid, key.public_key) for cid, key in keys.items()]
    return Roster(entries, RosterEntry("coordinator", "Coordinator", coordinator.public_key), **fields)  # type: ignore[arg-type]


def _signed(roster: Roster, keys: Mapping[str, IdentityKey]) -> str:
    return cosigned_roster_json(roster, dict(sign_roster(roster, keys[e.client_id]) for e in roster))


def _expect(**keys: IdentityKey) -> Recognition:
    return Recognition(expected={cid.replace("_", "-"): key.fingerprint for cid, key in keys.items()})


@pytest.fixture
def v1() -> tuple[dict[str, IdentityKey], IdentityKey, Roster]:
    keys, coordinator = _keys("hospital-a", "hospital-b", "hospital-c"), IdentityKey.generate()
    return keys, coordinator, _roster(keys, coordinator)


def test_a_next_version_cosigned_by_every_new_member_with_the_newcomer_recognised_is_accepted(v1) -> None:
    keys, coordinator, pinned = v1
    d = IdentityKey.generate()
    following = next_version(pinned).replace(
        entries=(*pinned.entries, RosterEntry("hospital-d", "D", d.public_key))
    )
    signers = {**keys, "hospital-d": d}
    succession = accept_successor(_signed(pinned, keys), _signed(following, signers), _expect(hospital_d=d))
    assert succession.added == ("hospital-d",) and following.version == 2
    assert following.previous == pinned.digest() and following.fingerprint != pinned.fingerprint
    # co-signed by every member of the NEW roster: without the newcomer's signature it is refused
    partial = cosigned_roster_json(following, dict(sign_roster(following, keys[c]) for c in keys))
    with pytest.raises(RosterNotCosignedError, match="hospital-d"):
        accept_successor(_signed(pinned, keys), partial, _expect(hospital_d=d))
    # each member confirms the newcomer's fingerprint as join --expect does
    with pytest.raises(RosterNotRecognisedError, match="FINGERPRINT MISMATCH for 'hospital-d'"):
        accept_successor(_signed(pinned, keys), _signed(following, signers), _expect(hospital_d=coordinator))
    with pytest.raises(RosterNotRecognisedError, match="no terminal"):
        accept_successor(_signed(pinned, keys), _signed(following, signers), Recognition())


def test_rollback_fork_a_skipped_version_and_a_dropped_revocation_are_refused(v1) -> None:
    keys, _, pinned = v1
    v2 = next_version(pinned).replace(revoked=(IdentityKey.generate().fingerprint,))
    v2_text = _signed(v2, keys)
    nothing_new = Recognition()
    assert accept_successor(_signed(pinned, keys), v2_text, nothing_new).removed == ()
    with pytest.raises(RosterSuccessionError, match="only to version 3"):  # v2 -> v1: rollback
        accept_successor(v2_text, _signed(pinned, keys), nothing_new)
    with pytest.raises(RosterSuccessionError, match="only to version 3"):  # v2 -> another v2: fork
        accept_successor(v2_text, _signed(next_version(pinned), keys), nothing_new)
    skipped = next_version(v2).replace(version=4)
    with pytest.raises(RosterSuccessionError, match="only to version 3"):
        accept_successor(v2_text, _signed(skipped, keys), nothing_new)
    other_parent = next_version(next_version(pinned)).replace(revoked=v2.revoked)  # version 3, not after v2
    with pytest.raises(RosterSuccessionError, match="made from another roster"):
        accept_successor(v2_text, _signed(other_parent, keys), nothing_new)
    with pytest.raises(RosterSuccessionError, match="never undone"):
        accept_successor(v2_text, _signed(next_version(v2).replace(revoked=()), keys), nothing_new)


def test_a_key_changes_only_by_a_statement_of_the_pinned_key_or_after_its_revocation(v1) -> None:
    keys, _, pinned = v1
    new_a = IdentityKey.generate()
    rotation = KeyRotation.make("hospital-a", keys["hospital-a"], new_a.public_key)
    entries = tuple(
        RosterEntry(e.client_id, e.name, new_a.public_key) if e.client_id == "hospital-a" else e
        for e in pinned
    )
    signers = {**keys, "hospital-a": new_a}
    base = next_version(pinned).replace(entries=entries)
    rotated = base.replace(revoked=(keys["hospital-a"].fingerprint,), rotations=(rotation,))
    succession = accept_successor(_signed(pinned, keys), _signed(rotated, signers), Recognition())
    assert succession.rotated == ("hospital-a",) and succession.to_recognise == ()
    with pytest.raises(RosterSuccessionError, match="neither a rotation statement"):
        accept_successor(_signed(pinned, keys), _signed(base, signers), Recognition())
    forged = KeyRotation.make("hospital-a", keys["hospital-b"], new_a.public_key)  # signed by B's key
    bad = base.replace(rotations=(forged,))
    with pytest.raises(RosterSuccessionError, match="not hospital-a's pinned key"):
        accept_successor(_signed(pinned, keys), _signed(bad, signers), Recognition())
    # replaced after a revocation (a leaked key): recognised like a newcomer
    replaced = base.replace(revoked=(keys["hospital-a"].fingerprint,))
    with pytest.raises(RosterNotRecognisedError):
        accept_successor(_signed(pinned, keys), _signed(replaced, signers), Recognition())
    assert accept_successor(
        _signed(pinned, keys), _signed(replaced, signers), _expect(hospital_a=new_a)
    ).replaced == ("hospital-a",)
    # a revoked key never returns
    with pytest.raises(RosterError, match="hold a revoked key"):
        next_version(replaced).replace(entries=pinned.entries)


def test_the_rotation_statement_is_domain_separated_and_verified() -> None:
    old, new = IdentityKey.generate(), IdentityKey.generate()
    rotation = KeyRotation.make("hospital-a", old, new.public_key)
    assert KeyRotation.from_json(rotation.to_json()).verify() == rotation
    payload = KeyRotation.message("hospital-a", old.public_key, new.public_key)
    assert payload.startswith(b"secure-afl key rotation v1\x00")
    undomained = old.private_key.sign(payload[len(b"secure-afl key rotation v1\x00") :])
    with pytest.raises(KeyRotationError, match="not signed by its old key"):
        KeyRotation("hospital-a", old.public_key, new.public_key, undomained).verify()
    with pytest.raises(KeyRotationError, match="not signed by its old key"):  # bound to the id
        KeyRotation("hospital-b", old.public_key, new.public_key, rotation.signature).verify()


def test_a_ledger_moves_to_the_new_key_with_its_history_and_the_old_key_no_longer_opens_it(
    tmp_path: Path,
) -> None:
    from secure_afl.privacy.ledger import SessionEntry

    old, new = IdentityKey.generate(), IdentityKey.generate()
    ledger = FileLedger(tmp_path)
    owner, moved = LedgerOwner("hospital-a", old), LedgerOwner("hospital-a", new)

    def release(state) -> None:
        state.sessions["ab" * 32] = SessionEntry(
            survivors=("hospital-a",), released=("v1",), spend='{"eps":1}'
        )

    ledger.update(owner, release)
    before = ledger.load(owner)
    rotation = KeyRotation.make("hospital-a", old, new.public_key)
    ledger.rotate(owner, moved, rotation)
    after = ledger.load(moved)
    assert after.sessions == before.sessions and after.generation == before.generation + 1
    assert after.rotations == (rotation,)
    with pytest.raises(LedgerTamperedError):
        ledger.load(owner)
    ledger.update(moved, lambda s: s.entry(b"\x01" * 32).answers.update({"R1": "00"}))
    assert ledger.load(moved).rotations == (rotation,)  # kept by every later write
    document = json.loads(ledger.path("hospital-a").read_text())
    assert document["rotations"][0]["new_fingerprint"] == new.fingerprint
    with pytest.raises(ValueError, match="old and new keys"):
        ledger.rotate(moved, LedgerOwner("hospital-a", IdentityKey.generate()), rotation)
    third = LedgerOwner("hospital-a", IdentityKey.generate())
    again = KeyRotation.make("hospital-a", new, third.identity.public_key)
    ledger.rotate(moved, third, again)
    assert ledger.load(third).rotations == (rotation, again) and ledger.load(third).sessions["ab" * 32].spend
    # the recorded chain is under the signature: a statement edited out is a tampered ledger
    document = json.loads(ledger.path("hospital-a").read_text())
    document["rotations"] = document["rotations"][1:]
    ledger.path("hospital-a").write_text(json.dumps(document))
    with pytest.raises(LedgerTamperedError):
        ledger.load(third)


def test_the_node_pin_refuses_an_older_roster_or_a_fork_once_it_moved(v1, tmp_path: Path) -> None:
    _, _, pinned = v1
    check_pin(pinned, tmp_path, Path("roster.json"))  # no record yet: the node's first roster
    v2 = next_version(pinned)
    write_pin(tmp_path, v2)
    check_pin(v2, tmp_path, Path("roster.json"))
    with pytest.raises(RosterNotPinnedError, match="an older roster or a fork is refused"):
        check_pin(pinned, tmp_path, Path("roster.json"))
    with pytest.raises(RosterNotPinnedError, match="keys roster update"):
        check_pin(next_version(v2), tmp_path, Path("roster.json"))


# --- the commands -------------------------------------------------------------------------------


@pytest.fixture
def fast_scrypt(monkeypatch: pytest.MonkeyPatch) -> None:
    original = key_commands.save_identity_key
    monkeypatch.setattr(
        key_commands, "save_identity_key", lambda *a, **k: original(*a, **{**k, "scrypt_n": 2**10})
    )


def run(*args: str | Path) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.output


def _fp(directory: Path) -> str:
    return json.loads((directory / "identity.pub.json").read_text())["fingerprint"]


def test_add_rotate_revoke_and_remove_as_commands_each_checked_by_update(fast_scrypt, tmp_path: Path) -> None:
    passfile = tmp_path / "pass"
    passfile.write_text(PASS + "\n")
    passfile.chmod(0o600)
    dirs = {}
    for cid in ("hospital-a", "hospital-b", "hospital-c", "hospital-d", "coordinator"):
        dirs[cid] = tmp_path / cid
        assert run("keys", "init", "--id", cid, "--passphrase-file", passfile, "--key-dir", dirs[cid])[0] == 0
    fed = tmp_path / "roster.json"
    for cid in ("hospital-a", "hospital-b", "hospital-c"):
        assert (
            run("keys", "roster", "add", "--roster", fed, "--entry", dirs[cid] / "identity.pub.json")[0] == 0
        )
    run(
        "keys",
        "roster",
        "add",
        "--roster",
        fed,
        "--entry",
        dirs["coordinator"] / "identity.pub.json",
        "--coordinator",
    )
    members = ["hospital-a", "hospital-b", "hospital-c"]

    def sign(path: Path, who: list[str]) -> None:
        for cid in who:
            code, out = run("keys", "roster", "sign", "--roster", path, "--passphrase-file", passfile,
                            "--key-dir", dirs[cid], "--yes")  # fmt: skip
            assert code == 0, out

    sign(fed, members)
    # node A's pinned roster and its ledger dir (the pin record)
    pinned, ledger_dir = tmp_path / "node-a" / "roster.json", tmp_path / "node-a" / "ledger"
    pinned.parent.mkdir()
    pinned.write_text(fed.read_text())

    def update(new: Path, *expect: str) -> tuple[int, str]:
        args = [a for e in expect for a in ("--expect", e)] or ["--yes"]
        return run("keys", "roster", "update", "--roster", pinned, "--new", new, "--ledger-dir", ledger_dir,
                   "--key-dir", dirs["hospital-a"], *args)  # fmt: skip

    # 1. add hospital-d: a new version, co-signed by all four
    v2 = tmp_path / "roster.v2.json"
    assert run("keys", "roster", "next", "--roster", fed, "--out", v2)[0] == 0
    assert (
        run("keys", "roster", "add", "--roster", v2, "--entry", dirs["hospital-d"] / "identity.pub.json")[0]
        == 0
    )
    sign(v2, members)
    code, out = update(v2, f"hospital-d={_fp(dirs['hospital-d'])}")
    assert code == 1 and "RosterNotCosignedError" in out and "hospital-d" in out
    sign(v2, ["hospital-d"])
    code, out = update(v2, f"hospital-d={_fp(dirs['hospital-b'])}")
    assert code == 1 and "FINGERPRINT MISMATCH for 'hospital-d'" in out
    assert json.loads(pinned.read_text()).get("version") is None  # nothing written
    code, out = update(v2, f"hospital-d={_fp(dirs['hospital-d'])}")
    assert code == 0 and "added: hospital-d" in out and json.loads(pinned.read_text())["version"] == 2, out
    assert (tmp_path / "node-a" / "roster.v1.json").read_text() == fed.read_text()
    code, out = update(fed)  # back to version 1: refused
    assert code == 1 and "RosterSuccessionError" in out
    # 2. hospital-b rotates its key; the roster version carries the statement
    b_old = _fp(dirs["hospital-b"])
    code, out = run("keys", "rotate", "--passphrase-file", passfile, "--key-dir", dirs["hospital-b"])
    assert code == 0 and _fp(dirs["hospital-b"]) != b_old, out
    v3 = tmp_path / "roster.v3.json"
    run("keys", "roster", "next", "--roster", v2, "--out", v3)
    statement = dirs["hospital-b"] / "rotation.json"
    code, out = run(
        "keys",
        "roster",
        "rotate",
        "--roster",
        v3,
        "--statement",
        statement,
        "--fingerprint",
        _fp(dirs["hospital-b"]),
    )
    assert code == 0, out
    sign(v3, [*members, "hospital-d"])
    code, out = update(v3)
    assert code == 0 and "key rotated (statement signed by the old key): hospital-b" in out, out
    assert b_old in json.loads(pinned.read_text())["revoked"]
    # 3. hospital-c's key leaked: revoked; 4. hospital-d removed
    v4 = tmp_path / "roster.v4.json"
    run("keys", "roster", "next", "--roster", v3, "--out", v4)
    code, out = run("keys", "roster", "revoke", "--roster", v4, "--fingerprint", _fp(dirs["hospital-c"]))
    assert code == 0 and "held by hospital-c (removed)" in out
    assert run("keys", "roster", "remove", "--roster", v4, "--id", "hospital-d")[0] == 0
    sign(v4, ["hospital-a", "hospital-b"])
    code, out = update(v4)
    assert code == 0 and "removed: hospital-c, hospital-d" in out, out
    code, out = run(
        "keys", "roster", "add", "--roster", v4, "--entry", dirs["hospital-c"] / "identity.pub.json"
    )
    assert code == 1 and "revoked key" in out
    code, out = run("keys", "roster", "show", "--roster", pinned, "--key-dir", dirs["hospital-a"])
    assert code == 0 and "version 4" in out and f"revoked or rotated away: {_fp(dirs['hospital-c'])}" in out
    # the node itself refuses a roster copied back by hand
    pinned.write_text(v3.read_text())
    with pytest.raises(RosterNotPinnedError):
        check_pin(Roster.from_json(pinned.read_text()), ledger_dir, pinned)


def test_the_coordinators_key_rotates_by_its_statement_and_a_new_coordinator_is_recognised(v1) -> None:
    keys, coordinator, pinned = v1
    new = IdentityKey.generate()
    entry = RosterEntry("coordinator", "Coordinator", new.public_key)
    rotation = KeyRotation.make("coordinator", coordinator, new.public_key)
    rotated = next_version(pinned).replace(
        coordinator=entry, revoked=(coordinator.fingerprint,), rotations=(rotation,)
    )
    assert accept_successor(_signed(pinned, keys), _signed(rotated, keys), Recognition()).rotated == (
        "coordinator",
    )
    unvouched = next_version(pinned).replace(coordinator=entry)
    with pytest.raises(RosterSuccessionError, match="'coordinator' has another key"):
        accept_successor(_signed(pinned, keys), _signed(unvouched, keys), Recognition())
    other = next_version(pinned).replace(coordinator=RosterEntry("operator", "Operator", new.public_key))
    with pytest.raises(RosterNotRecognisedError, match="'operator'"):
        accept_successor(
            _signed(pinned, keys),
            _signed(other, keys),
            Recognition(expected={"hospital-a": keys["hospital-a"].fingerprint}),
        )


def test_keys_rotate_moves_the_ledger_and_leaves_key_and_ledger_as_they_were_when_the_ledger_is_refused(
    fast_scrypt, tmp_path: Path
) -> None:
    from secure_afl.keys import load_identity_key
    from secure_afl.privacy.ledger import SessionEntry

    passfile = tmp_path / "pass"
    passfile.write_text(PASS + "\n")
    passfile.chmod(0o600)
    keys_dir, ledger_dir = tmp_path / "keys", tmp_path / "ledger"
    assert (
        run("keys", "init", "--id", "hospital-a", "--passphrase-file", passfile, "--key-dir", keys_dir)[0]
        == 0
    )
    old = load_identity_key(keys_dir / "identity.key", PASS.encode())
    ledger = FileLedger(ledger_dir)
    ledger.update(
        LedgerOwner("hospital-a", old),
        lambda s: s.sessions.update({"cd" * 32: SessionEntry(survivors=("hospital-a",), released=("v",))}),
    )
    # a hand-edited ledger: the rotation is refused, the key and the ledger stay as they were
    good = ledger.path("hospital-a").read_bytes()
    ledger.path("hospital-a").write_bytes(good.replace(b'"v"', b'"w"'))
    args = (
        "keys",
        "rotate",
        "--passphrase-file",
        passfile,
        "--key-dir",
        keys_dir,
        "--ledger-dir",
        ledger_dir,
    )
    code, out = run(*args)
    assert code == 1 and "LedgerTamperedError" in out
    assert load_identity_key(keys_dir / "identity.key", PASS.encode()).public_key == old.public_key
    assert sorted(p.name for p in keys_dir.iterdir()) == ["identity.key", "identity.pub.json"]
    ledger.path("hospital-a").write_bytes(good)
    code, out = run(*args)
    assert code == 0 and "1 session(s) kept" in out, out
    new = load_identity_key(keys_dir / "identity.key", PASS.encode())
    assert new.public_key != old.public_key and _fp(keys_dir) == new.fingerprint
    state = ledger.load(LedgerOwner("hospital-a", new))
    assert (
        state.sessions["cd" * 32].released == ("v",) and state.rotations[0].old_public_key == old.public_key
    )
    statement = KeyRotation.from_json((keys_dir / "rotation.json").read_text()).verify()
    assert (statement.old_public_key, statement.new_public_key) == (old.public_key, new.public_key)
    retired = [p for p in keys_dir.iterdir() if p.name.startswith("identity.key.rotated-")]
    assert len(retired) == 1 and retired[0].stat().st_mode & 0o777 == 0o600
