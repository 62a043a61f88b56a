"""Files the deployment writes for its parties: throwaway TLS, SuperNode keys, identities, the app.

A leaf module shared by ``deploy local`` (the rehearsal), ``deploy provision`` and ``deploy join``.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from secure_afl.keys.cosign import cosigned_roster_json, sign_roster
from secure_afl.keys.files import save_identity_key
from secure_afl.keys.identity import IdentityKey
from secure_afl.keys.roster import Roster, RosterEntry

from .tls import write_tls_material

COORDINATOR = "coordinator"  # the roster id of the key that signs the classifier


def write_tls_certificates(directory: Path, ips: Sequence[str] = ()) -> tuple[Path, Path, Path]:
    """A throwaway CA and a SuperLink certificate for 127.0.0.1/localhost and ``ips`` (one day; see
    deploy/tls.py)."""
    files = write_tls_material(
        directory, hosts=["localhost"], ips=["127.0.0.1", *ips], days=1, keep_ca_key=False,
        ca_common_name="secure-afl deploy local CA",
    )  # fmt: skip
    return files.ca_certificate, files.certificate, files.key


def write_node_auth_key(path: Path) -> Path:
    """An ECDSA P-384 SuperNode authentication key in OpenSSH format; returns the ``.pub`` path."""
    key = ec.generate_private_key(ec.SECP384R1())
    write_private(
        path,
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        ),
    )
    public = path.with_name(path.name + ".pub")
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    )
    return public


def write_private(path: Path, data: bytes) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)


def write_identities(
    directory: Path, client_ids: Sequence[str], *, scrypt_n: int = 2**14
) -> tuple[Path, Roster, IdentityKey]:
    """One encrypted identity key per institution, one shared passphrase file, and the roster naming
    the coordinator, whose key (it signs the classifier) is returned and never written: it stays in
    this process, out of reach of the SuperLink and the ServerApp it starts (which could read the
    passphrase file).

    These keys live for one local demonstration, so scrypt runs at 2^14 rather than the default
    2^17 (every ClientApp process decrypts its key once per message).
    """
    directory.mkdir(parents=True, exist_ok=True)
    passphrase = secrets.token_urlsafe(24).encode("ascii")
    passphrase_file = directory / "passphrase"
    write_private(passphrase_file, passphrase + b"\n")
    entries, keys = [], []
    for cid in client_ids:
        key = IdentityKey.generate()
        save_identity_key(directory / f"{cid}.key", key, passphrase, scrypt_n=scrypt_n)
        entries.append(RosterEntry(cid, f"Hospital {cid}", key.public_key))
        keys.append(key)
    coordinator = IdentityKey.generate()
    roster = Roster(entries, RosterEntry(COORDINATOR, "Coordinator", coordinator.public_key))
    # Every institution co-signs the roster (its nodes refuse one that is not: keys/cosign.py).
    signatures = dict(sign_roster(roster, key) for key in keys)
    text = cosigned_roster_json(roster, signatures)
    (directory / "roster.json").write_text(text + "\n", encoding="utf-8")
    return passphrase_file, roster, coordinator


def write_app(directory: Path, run_config: Mapping[str, object]) -> Path:
    """A Flower app directory whose components are secure-afl's apps (nothing else is bundled)."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = [
        "[build-system]",
        'requires = ["setuptools>=68"]',
        'build-backend = "setuptools.build_meta"',
        "",
        "[project]",
        'name = "secure-afl-federation"',
        'version = "1.0.0"',
        'description = "secure-afl: one-round analytic FL with secure aggregation"',
        'license = "Apache-2.0"',
        "dependencies = []",
        "",
        "[tool.flwr.app]",
        'publisher = "secure-afl"',
        "",
        "[tool.flwr.app.components]",
        'serverapp = "secure_afl.deploy.apps:server_app"',
        'clientapp = "secure_afl.deploy.apps:client_app"',
        "",
        "[tool.flwr.app.config]",
    ]
    for key, value in run_config.items():
        lines.append(f"{key} = {json.dumps(value)}")
    (directory / "pyproject.toml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return directory
