"""A hospital that joins a running federation: ``deploy collect`` issues its kit at the current co-signed
roster version (re-signing the members' kits for it), ``deploy join`` checks that version (its own key in
it, every member's co-signature, every entry's fingerprint, the coordinator's included) and pins it, and
``collect`` takes its reply (secure_afl/deploy/kit.py: issue_kits, join_kit)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from click.testing import CliRunner

from secure_afl.cli import main
from secure_afl.deploy.kit import EXIT_WAITING, read_kit
from secure_afl.keys import IdentityKey
from secure_afl.keys.cosign import read_roster_document, roster_status
from secure_afl.keys.lifecycle import PIN_FILE

from .helpers import Site
from .test_provision import HOSPITALS, Provisioned, _invoke, _join, _provision, _site


def _keys_command(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["keys", *(str(a) for a in args)])
    return result.exit_code, result.output


@dataclass
class AtVersion2:
    p: Provisioned
    d: Site
    v1: str  # the text of the co-signed first roster


def _at_version_2(tmp_path: Path) -> AtVersion2:
    """Three hospitals joined under roster version 1; hospital-d is added in version 2, co-signed by all
    four, and the coordinator moved fed/roster.json to it (the walk-through's D1)."""
    p = _provision(tmp_path)
    for cid in HOSPITALS:
        assert _join(p.sites[cid])[0] == EXIT_WAITING
    replies = [p.sites[cid].kit / f"{cid}.reply.json" for cid in HOSPITALS]
    code, output = _invoke("collect", "--federation-dir", p.out, *replies, "--no-register")
    assert code == 0, output
    d = _site(tmp_path, "hospital-d")
    draft = tmp_path / "roster.v2.json"
    assert _keys_command("roster", "next", "--roster", p.out / "roster.json", "--out", draft)[0] == 0
    code, output = _keys_command(
        "roster", "add", "--roster", draft, "--entry", d.keys / "identity.pub.json", "--fingerprint",
        d.key.fingerprint,
    )  # fmt: skip
    assert code == 0, output
    for site in (*p.sites.values(), d):  # every institution of version 2 co-signs it
        code, output = _keys_command(
            "roster", "sign", "--roster", draft, "--key-dir", site.keys, "--passphrase-file", site.passfile,
            "--yes",
        )  # fmt: skip
        assert code == 0, output
    v1 = (p.out / "roster.json").read_text()
    code, output = _keys_command(
        "roster", "update", "--roster", p.out / "roster.json", "--new", draft, "--expect", d.expect()
    )
    assert code == 0 and "is now roster version 2" in output, output
    return AtVersion2(p, d, v1)


def _collect(p: Provisioned, *args: object) -> tuple[int, str]:
    return _invoke(
        "collect", "--federation-dir", p.out, *args, "--no-register", "--key-dir", p.coordinator.keys,
        "--passphrase-file", p.coordinator.passfile,
    )  # fmt: skip


def _expects(v: AtVersion2, site: Site, **wrong: str) -> list[str]:
    """--expect for every entry but ``site``'s own (a ``wrong`` fingerprint replaces an id's)."""
    everyone = [*v.p.sites.values(), v.d, v.p.coordinator]
    out = []
    for other in everyone:
        if other.client_id != site.client_id:
            out += ["--expect", f"{other.client_id}={wrong.get(other.client_id, other.key.fingerprint)}"]
    return out


def _join_newcomer(site: Site, expects: list[str]) -> tuple[int, str]:
    return _invoke(
        "join", site.kit, "--features", site.features, "--key-dir", site.keys, "--passphrase-file",
        site.passfile, "--set", "colluders=0", "--no-connect", *expects,
    )  # fmt: skip


def test_a_newcomer_gets_a_kit_at_the_current_version_joins_it_and_its_reply_is_collected(
    tmp_path: Path,
) -> None:
    v = _at_version_2(tmp_path)
    p, d = v.p, v.d
    # The kits must be signed: without the coordinator's key, collect names the kits to issue.
    code, output = _invoke("collect", "--federation-dir", p.out, "--no-register")
    assert code == 2 and "['hospital-a', 'hospital-b', 'hospital-c', 'hospital-d']" in output, output
    assert not (p.out / "kits" / "hospital-d").exists()
    code, output = _collect(p)
    assert code == EXIT_WAITING, output
    assert "WAITING for the replies of ['hospital-d']" in output
    assert f"{p.out.resolve() / 'kits' / 'hospital-d'}  -> send the whole directory to hospital-d" in output
    v2 = roster_status((p.out / "roster.json").read_text()).roster
    assert v2.version == 2
    for cid in (*HOSPITALS, "hospital-d"):  # every member's kit is now one for version 2, and verifies
        manifest, status = read_kit(p.out / "kits" / cid)
        assert manifest.roster_fingerprint == v2.fingerprint and manifest.institution == cid
        assert status.complete
    shutil.copytree(p.out / "kits" / "hospital-d", d.kit)
    code, output = _join_newcomer(d, _expects(v, d))
    assert code == 0 and "hospital-d: ready" in output, output
    assert f"ok  pinned roster version 2 in {(d.kit / 'state' / 'ledger' / PIN_FILE).resolve()}" in output
    pin = json.loads((d.kit / "state" / "ledger" / PIN_FILE).read_text())
    assert pin["version"] == 2 and pin["digest"] == v2.digest().hex()
    code, output = _collect(p, d.kit / "hospital-d.reply.json")
    assert code == 0 and "every institution has its kit at this version" in output, output
    assert (p.out / "supernodes" / "hospital-d.pub").read_text().strip() == (
        (d.kit / "state" / "supernode-auth.pub").read_text().strip()
    )
    code, output = _invoke("check", "--config", d.kit / "node-config.toml")
    assert code == 0 and "co-signed by every institution" in output, output
    # Its node refuses the first roster copied into its kit: it started at version 2.
    (d.kit / "roster.json").write_text(v.v1)
    code, output = _invoke("check", "--config", d.kit / "node-config.toml")
    assert code == 1 and "RosterNotPinnedError" in output, output


def test_a_newcomers_join_refuses_a_missing_co_signature_a_roster_without_it_and_another_coordinator(
    tmp_path: Path,
) -> None:
    v = _at_version_2(tmp_path)
    p, d = v.p, v.d
    assert _collect(p)[0] == EXIT_WAITING
    shutil.copytree(p.out / "kits" / "hospital-d", d.kit)

    def nothing_written(site: Site) -> None:
        assert not (site.kit / f"{site.client_id}.reply.json").exists() and not (site.kit / "state").exists()

    # A version-2 roster that lacks hospital-b's co-signature (the same roster: the manifest still matches).
    complete = (d.kit / "roster.json").read_text()
    document = json.loads(complete)
    del document["cosignatures"]["hospital-b"]
    (d.kit / "roster.json").write_text(json.dumps(document))
    assert read_kit(d.kit)[1].missing == ("hospital-b",)
    code, output = _join_newcomer(d, _expects(v, d))
    assert code == 1 and "FAILED RosterNotCosignedError:" in output, output
    assert "roster version 2" in output and "not co-signed by ['hospital-b']" in output
    nothing_written(d)
    (d.kit / "roster.json").write_text(complete)
    # A coordinator fingerprint that is not the one heard from the coordinator.
    stranger = IdentityKey.generate().fingerprint
    code, output = _join_newcomer(d, _expects(v, d, coordinator=stranger))
    assert code == 1 and "FAILED RosterNotRecognisedError:" in output and "'coordinator'" in output, output
    nothing_written(d)
    # A hospital whose key this version does not hold, given the newcomer's kit.
    e = _site(tmp_path, "hospital-e")
    shutil.copytree(d.kit, e.kit)
    code, output = _join_newcomer(e, _expects(v, e))
    assert code == 1 and "FAILED KeyNotInKitRosterError:" in output and "version 2" in output, output
    nothing_written(e)
    # And the roster every member signed is accepted: the refusals were for what they named.
    code, output = _join_newcomer(d, _expects(v, d))
    assert code == 0, output
    assert read_roster_document((d.kit / "roster.json").read_text())[0].version == 2
