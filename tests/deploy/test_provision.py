"""``deploy provision`` / ``join`` / ``collect``: the kits, roster co-signing and the node's refusal."""

from __future__ import annotations

import base64
import configparser
import json
import shutil
import socket
import ssl
import stat
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from secure_afl.cli_deploy import deploy
from secure_afl.deploy.check import parse_node_config
from secure_afl.deploy.kit import EXIT_WAITING, Manifest
from secure_afl.deploy.processes import free_port
from secure_afl.deploy.tls import write_tls_material
from secure_afl.features.file import save_feature_file
from secure_afl.keys import IdentityKey, Roster, RosterEntry, save_identity_key
from secure_afl.keys.cosign import (
    cosigned_roster_json,
    load_cosigned_roster,
    read_roster_document,
    sign_roster,
)

from .helpers import Site, make_federation, pixel_digests, row_digests, run_server, write_cosigned_roster

HOSPITALS = ("hospital-a", "hospital-b", "hospital-c")
CLASSES = ("A", "B", "C")
PASSPHRASE = b"a long test passphrase"


def _site(root: Path, client_id: str, backbone: str = "toy") -> Site:
    key = IdentityKey.generate()
    keys = root / client_id / "keys"
    keys.mkdir(parents=True)
    save_identity_key(keys / "identity.key", key, PASSPHRASE, scrypt_n=2**10)
    (keys / "identity.pub.json").write_text(
        json.dumps(
            {
                "format": "secure-afl-roster-entry/v1",
                "id": client_id,
                "name": client_id.title(),
                "public_key": base64.b64encode(key.public_key).decode(),
                "fingerprint": key.fingerprint,
            }
        )
    )
    (keys / "pass").write_bytes(PASSPHRASE + b"\n")
    (keys / "pass").chmod(0o600)
    rng = np.random.default_rng(len(client_id))
    labels = (rng.random((12, 3)) < 0.5).astype(np.uint8)
    save_feature_file(
        root / client_id / "features.npz", rng.random((12, 40)), labels=labels, active=(0, 1, 2),
        classes=CLASSES, backbone=backbone, weights_id="sha256:00", preprocessing="none",
        image_sha256=row_digests(client_id, 12), pixel_sha256=pixel_digests(row_digests(client_id, 12)),
    )  # fmt: skip
    return Site(client_id, root / client_id, key)


def _invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(deploy, [str(a) for a in args])
    return result.exit_code, result.output


@dataclass
class Provisioned:
    root: Path
    out: Path
    sites: dict[str, Site]
    coordinator: Site
    port: int


def _provision(tmp_path: Path) -> Provisioned:
    sites = {cid: _site(tmp_path, cid) for cid in HOSPITALS}
    coordinator = _site(tmp_path, "coordinator")
    out = tmp_path / "coordinator" / "fed"
    port = free_port()
    code, output = _invoke(
        "provision", "--federation-dir", out, *(a for s in sites.values() for a in ("--hospital", s.keys)),
        "--key-dir", coordinator.keys, "--passphrase-file", coordinator.passfile,
        "--ip", "127.0.0.1", "--port", port, "--features", sites["hospital-a"].features,
        "--set", "colluders=0", "--yes",
    )  # fmt: skip
    assert code == 0, output
    for site in sites.values():  # each hospital receives its kit directory
        shutil.copytree(out / "kits" / site.client_id, site.kit)
    return Provisioned(tmp_path, out, sites, coordinator, port)


def _join(site: Site, *extra: object, connect: bool = False) -> tuple[int, str]:
    args = ["join", site.kit, "--features", site.features, "--key-dir", site.keys]
    args += ["--passphrase-file", site.passfile, "--set", "colluders=0", "--yes", *extra]
    return _invoke(*args, *([] if connect else ["--no-connect"]))


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(path.read_text())
    return parser


def _check_unit_structure(path: Path, layout_state: str) -> configparser.ConfigParser:
    unit = _unit(path)
    service = unit["Service"]
    assert service["ExecStart"].split()[0].endswith("/flower-supernode")
    assert "--node-config" in service["ExecStart"] and "--auth-supernode-private-key" in service["ExecStart"]
    assert service["User"] and service["Restart"] == "on-failure" and service["UMask"] == "0077"
    assert service["StandardOutput"] == f"append:{layout_state}/supernode.log"
    assert service["StandardError"] == service["StandardOutput"]
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    assert PASSPHRASE.decode() not in path.read_text()  # the passphrase is never in the unit
    return unit


def test_provision_writes_the_roster_tls_app_and_private_signed_kits(tmp_path: Path) -> None:
    p = _provision(tmp_path)
    roster, cosignatures = read_roster_document((p.out / "roster.json").read_text())
    assert roster.client_ids == HOSPITALS and cosignatures == {}  # to be co-signed
    assert roster.coordinator is not None and roster.coordinator.public_key == p.coordinator.key.public_key
    assert _mode(p.out / "tls" / "ca.key") == 0o600 and _mode(p.out / "tls" / "superlink.key") == 0o600
    assert _mode(p.out / "kits") == 0o700
    for cid in HOSPITALS:
        kit = p.out / "kits" / cid
        assert _mode(kit) == 0o700 and _mode(kit / "node-config.toml") == 0o600
        names = sorted(str(f.relative_to(kit)) for f in kit.rglob("*") if f.is_file())
        assert names == [
            "README.txt", "app/pyproject.toml", "ca.crt", "kit.json", "node-config.toml", "roster.json",
            "supernode.service",
        ]  # fmt: skip
        assert (kit / "ca.crt").read_bytes() == (p.out / "tls" / "ca.crt").read_bytes()
        manifest = Manifest.verified((kit / "kit.json").read_text(), roster, "kit.json")
        assert manifest.institution == cid and manifest.superlink == f"127.0.0.1:{p.port}"
        assert manifest.roster_fingerprint == roster.fingerprint
        # The kit's node files are for the standard layout (join rewrites them for the hospital's).
        config = parse_node_config(file=kit / "node-config.toml")
        assert config["roster"] == f"/etc/secure-afl/{cid}/roster.json"
        assert config["ledger-dir"] == f"/var/lib/secure-afl-{cid}/ledger"
        unit = _check_unit_structure(kit / "supernode.service", f"/var/lib/secure-afl-{cid}")
        assert unit["Service"]["StateDirectory"] == f"secure-afl-{cid}"
    # Nothing is replaced without --force.
    code, output = _invoke(
        "provision", "--federation-dir", p.out, "--hospital", p.sites["hospital-a"].keys, "--hospital",
        p.sites["hospital-b"].keys, "--key-dir", p.coordinator.keys, "--passphrase-file",
        p.coordinator.passfile, "--ip", "127.0.0.1", "--features", p.sites["hospital-a"].features,
    )  # fmt: skip
    assert code == 1 and "already exist(s)" in output


def test_join_collect_join_makes_a_startable_node_under_a_roster_every_hospital_signed(
    tmp_path: Path,
) -> None:
    p = _provision(tmp_path)
    a = p.sites["hospital-a"]
    code, output = _join(a)
    assert code == EXIT_WAITING, output
    assert "WAITING: the roster is not yet co-signed by ['hospital-a', 'hospital-b', 'hospital-c']" in output
    # ... and the start command already (README's H4: the node itself refuses an unco-signed roster).
    assert f"flower-supernode --superlink 127.0.0.1:{p.port} " in output
    kit = a.kit.resolve()
    assert f"--node-config {kit / 'node-config.toml'} >> {kit / 'state' / 'supernode.log'} 2>&1" in output
    for cid in HOSPITALS:  # every entry is shown for the hospital to recognise
        assert f"{cid:<20} {p.sites[cid].key.fingerprint}" in output
    assert _mode(a.kit / "state" / "supernode-auth") == 0o600
    # Until every hospital co-signed, `deploy check` on the node config refuses the roster, as the node does.
    code, output = _invoke("check", "--config", a.kit / "node-config.toml", "--study", a.kit / "app")
    assert code == 1 and "FAILED hospital-a: roster: RosterNotCosignedError:" in output
    for cid in ("hospital-b", "hospital-c"):
        assert _join(p.sites[cid])[0] == EXIT_WAITING
    replies = [p.sites[cid].kit / f"{cid}.reply.json" for cid in HOSPITALS]
    code, output = _invoke("collect", "--federation-dir", p.out, *replies[:2], "--no-register")
    assert code == EXIT_WAITING and "WAITING for ['hospital-c']" in output
    code, output = _invoke("collect", "--federation-dir", p.out, *replies, "--no-register")
    assert code == 0 and "every hospital co-signed" in output, output
    assert (
        load_cosigned_roster(p.out / "roster.json").fingerprint
        == load_cosigned_roster(p.out / "kits" / "hospital-b" / "roster.json").fingerprint
    )
    for cid in HOSPITALS:
        key_text = (p.out / "supernodes" / f"{cid}.pub").read_text().strip()
        assert key_text == (p.sites[cid].kit / "state" / "supernode-auth.pub").read_text().strip()
    # The coordinator sends each hospital the co-signed roster; join is now ready.
    shutil.copyfile(p.out / "kits" / "hospital-a" / "roster.json", a.kit / "roster.json")
    code, output = _join(a, "--node-port", "9555")
    assert code == 0, output
    state = (a.kit / "state").resolve()
    command = output.split("Start its SuperNode (keep it running):\n", 1)[1].splitlines()[0].strip()
    assert command.split()[0].endswith("/flower-supernode")
    assert f"--node-config {a.kit.resolve() / 'node-config.toml'}" in command
    assert "--port 9555" in command and command.endswith(f">> {state / 'supernode.log'} 2>&1")
    assert "systemctl enable --now secure-afl-supernode-hospital-a" in output
    config = parse_node_config(file=a.kit / "node-config.toml")
    assert config["features"] == str(a.features.resolve()) and config["colluders"] == "0"
    assert config["ledger-dir"] == str(state / "ledger")
    code, output = _invoke("check", "--config", a.kit / "node-config.toml", "--study", a.kit / "app")
    assert code == 0 and "co-signed by every institution" in output, output
    # The unit join wrote is a valid systemd unit for these paths.
    unit = _check_unit_structure(a.kit / "supernode.service", str(state))
    assert unit["Service"]["ReadWritePaths"] == str(state)  # not under /var/lib: no StateDirectory=
    analyze = shutil.which("systemd-analyze")
    if analyze is not None:
        result = subprocess.run(
            [analyze, "verify", str(a.kit / "supernode.service")], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        assert "supernode.service" not in result.stderr, result.stderr  # no warning about the unit


def test_join_refuses_a_replaced_ca_an_altered_app_or_manifest_and_another_hospitals_kit(
    tmp_path: Path,
) -> None:
    p = _provision(tmp_path)
    a = p.sites["hospital-a"]
    pristine = tmp_path / "pristine"
    shutil.copytree(a.kit, pristine)

    def reset() -> None:
        shutil.rmtree(a.kit)
        shutil.copytree(pristine, a.kit)

    other = write_tls_material(tmp_path / "other-ca", ips=["127.0.0.1"])
    shutil.copyfile(other.ca_certificate, a.kit / "ca.crt")
    code, output = _join(a)
    assert (
        code == 1
        and "KitTamperedError" in output
        and "the CA certificate is not the one the coordinator" in output
    )
    assert not (a.kit / "hospital-a.reply.json").exists()  # nothing signed for a bad kit
    reset()
    app = a.kit / "app" / "pyproject.toml"
    app.write_text(app.read_text().replace("gamma = 1.0", "gamma = 1000.0"))
    code, output = _join(a)
    assert code == 1 and "the app (the study) is not the one the coordinator signed" in output
    reset()
    manifest = json.loads((a.kit / "kit.json").read_text())
    manifest["superlink"] = "evil.example.org:9092"
    (a.kit / "kit.json").write_text(json.dumps(manifest))
    code, output = _join(a)
    assert code == 1 and "the manifest is not signed by the roster's coordinator 'coordinator'" in output
    reset()
    # hospital-b's key with hospital-a's kit.
    b = p.sites["hospital-b"]
    code, output = _invoke(
        "join", a.kit, "--features", b.features, "--key-dir", b.keys, "--passphrase-file", b.passfile,
        "--no-connect",
    )  # fmt: skip
    assert code == 1 and "this kit was made for 'hospital-a', your key is 'hospital-b'" in output
    # A key that is not in the roster at all.
    stranger = _site(tmp_path, "hospital-d")
    code, output = _invoke(
        "join", a.kit, "--features", stranger.features, "--key-dir", stranger.keys, "--passphrase-file",
        stranger.passfile, "--no-connect",
    )  # fmt: skip
    assert code == 1 and "this institution's key is not in the kit's roster" in output
    # A feature file of another backbone than the study's: the node's own StudyMismatchError.
    resnet = _site(tmp_path / "resnet", "hospital-a", backbone="resnet50")
    code, output = _invoke(
        "join", a.kit, "--features", resnet.features, "--key-dir", a.keys, "--passphrase-file", a.passfile,
        "--no-connect", "--yes",
    )  # fmt: skip
    assert code == 1 and "feature file against the study: StudyMismatchError:" in output
    assert "backbone name is 'toy', this feature file's is 'resnet50'" in output
    # The SuperLink's certificate does not chain to the kit's CA (a TLS server with another CA).
    code, output = _join_against_tls_server(a, other)
    assert code == 1 and "SuperLink: ConfigurationError:" in output and "does not verify against" in output


def _join_against_tls_server(site: Site, tls) -> tuple[int, str]:
    """join, with its SuperLink check, against a TLS server on the kit's loopback address that
    presents ``tls``'s certificate (bounded: one connection, 20 s timeouts)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tls.certificate, tls.key)
    port = int(json.loads((site.kit / "kit.json").read_text())["superlink"].rsplit(":", 1)[1])
    listener = socket.create_server(("127.0.0.1", port))
    listener.settimeout(20)

    def serve() -> None:
        try:
            connection, _ = listener.accept()
            connection.settimeout(20)
            with connection, context.wrap_socket(connection, server_side=True):
                pass
        except (OSError, ssl.SSLError):
            pass  # the client aborts the handshake

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        return _join(site, connect=True)
    finally:
        listener.close()
        thread.join(timeout=20)


def test_join_and_collect_refuse_co_signatures_that_do_not_verify(tmp_path: Path) -> None:
    p = _provision(tmp_path)
    a, b = p.sites["hospital-a"], p.sites["hospital-b"]
    assert _join(a)[0] == EXIT_WAITING and _join(b)[0] == EXIT_WAITING
    reply = json.loads((b.kit / "hospital-b.reply.json").read_text())
    # A reply whose SuperNode key was swapped in transit: not signed by hospital-b's identity.
    swapped = dict(reply, supernode_public_key=(a.kit / "state" / "supernode-auth.pub").read_text().strip())
    (tmp_path / "swapped.json").write_text(json.dumps(swapped))
    code, output = _invoke("collect", "--federation-dir", p.out, tmp_path / "swapped.json", "--no-register")
    assert code == 1 and "the SuperNode key is not signed by hospital-b's identity key" in output
    # A co-signature by another key than the entry's.
    forged = dict(reply, cosignature=json.loads((a.kit / "hospital-a.reply.json").read_text())["cosignature"])
    (tmp_path / "forged.json").write_text(json.dumps(forged))
    code, output = _invoke("collect", "--federation-dir", p.out, tmp_path / "forged.json", "--no-register")
    assert code == 1 and "the co-signature of 'hospital-b' does not verify" in output
    assert read_roster_document((p.out / "roster.json").read_text())[1] == {}  # nothing merged
    # The coordinator adds an entry it controls after the hospitals signed: their signatures break,
    # and a kit re-made for the bigger roster shows the stranger among the entries to recognise.
    roster, _ = read_roster_document((a.kit / "roster.json").read_text())
    extra = IdentityKey.generate()
    bigger = Roster((*roster.entries, RosterEntry("hospital-x", "X", extra.public_key)), roster.coordinator)
    old = {
        "hospital-a": base64.b64decode(
            json.loads((a.kit / "hospital-a.reply.json").read_text())["cosignature"]
        )
    }
    text = json.loads(cosigned_roster_json(bigger, dict([sign_roster(bigger, extra)])))
    text["cosignatures"].update({k: base64.b64encode(v).decode() for k, v in old.items()})
    (a.kit / "roster.json").write_text(json.dumps(text))
    code, output = _join(a)
    assert code == 1 and "RosterCosignatureError" in output and "'hospital-a' does not verify" in output


def _pin(node, path: Path) -> None:
    node.settings = type(node.settings)(**{**node.settings.__dict__, "roster": path})


def test_the_node_refuses_a_roster_that_an_institution_has_not_co_signed(tmp_path: Path) -> None:
    federation = make_federation(tmp_path / "plain")
    # client-1 pinned the roster as the coordinator first wrote it: the same entries, no co-signatures.
    plain = tmp_path / "plain-roster.json"
    plain.write_text(federation.roster.to_json())
    _pin(federation.nodes[1001], plain)
    server, _, transport = run_server(federation)
    # A node that refuses its own roster cannot name its roster id (deploy run names refusals by
    # roster id, never by Flower node id): the coordinator sees an unidentified node's refusal.
    assert [(r["from"], r["error"]) for r in server.report.refusals] == [
        ("an unidentified node", "RosterNotCosignedError")
    ]
    assert (
        "not co-signed by ['client-0', 'client-1', 'client-2', 'client-3']"
        in server.report.refusals[0]["message"]
    )
    assert [r.kind for n, _, r in transport.received if n == 1001] == ["refused"]  # nothing else left it
    assert server.report.sessions[0].survivors == ("client-0", "client-2", "client-3")

    federation = make_federation(tmp_path / "forged")
    # client-2 pinned a roster whose client-3 co-signature is client-0's: refused, not merely missing.
    signatures = dict(sign_roster(federation.roster, k) for k in federation.identities.values())
    signatures["client-3"] = signatures["client-0"]
    forged = tmp_path / "forged-roster.json"
    document = json.loads(
        cosigned_roster_json(federation.roster, {k: v for k, v in signatures.items() if k != "client-3"})
    )
    document["cosignatures"]["client-3"] = base64.b64encode(signatures["client-3"]).decode()
    forged.write_text(json.dumps(document))
    _pin(federation.nodes[1002], forged)
    server, _, _ = run_server(federation)
    assert [(r["from"], r["error"]) for r in server.report.refusals] == [
        ("an unidentified node", "RosterCosignatureError")
    ]
    assert "the co-signature of 'client-3' does not verify" in server.report.refusals[0]["message"]


def test_deploy_local_rosters_are_co_signed(tmp_path: Path) -> None:
    from secure_afl.deploy.writers import write_identities

    _, roster, _ = write_identities(tmp_path, ["client-0", "client-1", "client-2"], scrypt_n=2**10)
    assert load_cosigned_roster(tmp_path / "roster.json") == roster
    # The test federations co-sign the same way (tests/deploy/helpers.py).
    keys = {cid: IdentityKey.generate() for cid in ("x", "y")}
    other = Roster(RosterEntry(cid, cid, k.public_key) for cid, k in keys.items())
    assert load_cosigned_roster(write_cosigned_roster(tmp_path / "other.json", other, keys)) == other
