"""A hospital's kit: what ``deploy provision`` writes for it and ``deploy join`` checks and completes.

A kit is one directory per hospital (mode 0700), named after its roster id::

    ca.crt               the SuperLink's CA (its SHA-256 is in kit.json)
    roster.json          the roster; co-signed by every institution once the coordinator collected
                         the signatures (``deploy collect``): the node refuses it before that
    app/pyproject.toml   the coordinator's app: the study the node will be asked to join (digest in kit.json)
    kit.json             the manifest: federation, this hospital's id, the SuperLink's address, the
                         roster fingerprint, the study digest, the files' SHA-256, signed by the
                         roster's coordinator with its identity key
    node-config.toml     the SuperNode's --node-config (paths on the hospital's host)
    supernode.service    a systemd unit that runs the SuperNode (logs to a file, restarts on failure)
    README.txt           what to do with the kit
    ID.reply.json        (written by ``join``) the hospital's roster co-signature and its SuperNode's
                         authentication public key, signed with its identity key: sent to the coordinator

A hospital that joins a running federation (a newcomer of a roster version after the first) gets its kit
from ``deploy collect`` once every member co-signed that version and the coordinator moved to it
(:func:`issue_kits`, which also re-signs the other members' kits for it); ``join`` then takes only a
roster that every member co-signed, and pins its version in the node's ledger directory, as ``keys
roster update`` does for the members who were there before.

``provision`` writes node-config.toml and supernode.service for a standard layout (the kit in
``/etc/secure-afl/ID``, the identity key in ``/etc/secure-afl/ID/keys``, state in
``/var/lib/secure-afl-ID``); ``join`` rewrites both for the paths the hospital gives.  Both use
:func:`render_node_files`, so the two can never differ in form.

Trust: the hospital recognises every roster entry (its co-signature says so: ``join`` signs only
after every entry, the coordinator's included, matched a fingerprint the hospital expected
(``--expect``), or a person confirmed each at a prompt, or ``--yes`` said it was checked another
way: :mod:`secure_afl.keys.recognition`); the roster names the
coordinator, whose signature on kit.json vouches for the CA and the app; the SuperLink's certificate
must chain to that CA.  So a replaced CA, an altered app or a kit for another hospital is refused
(:class:`KitTamperedError`), whoever carried the kit.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import shlex
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from secure_afl.keys.cosign import (
    CosignatureStatus,
    RosterCosignatureError,
    RosterNotCosignedError,
    check_cosignatures,
    read_roster_document,
    sign_roster,
)
from secure_afl.keys.identity import IdentityKey
from secure_afl.keys.recognition import Recognition
from secure_afl.keys.roster import Roster, RosterError

from .errors import ConfigurationError, DeploymentError
from .tls import write_with_mode

KIT_FORMAT = "secure-afl-kit/v1"
REPLY_FORMAT = "secure-afl-kit-reply/v1"
KIT_CONTEXT = b"secure-afl kit manifest v1\x00"
REPLY_CONTEXT = b"secure-afl supernode key v1\x00"
MANIFEST = "kit.json"
CA_FILE = "ca.crt"
ROSTER_FILE = "roster.json"
APP_FILE = "app/pyproject.toml"
NODE_CONFIG_FILE = "node-config.toml"
UNIT_FILE = "supernode.service"
README_FILE = "README.txt"
SIGNED_FILES = (CA_FILE, APP_FILE)
NODE_AUTH_KEY = "supernode-auth"  # in the state directory; NODE_AUTH_KEY + ".pub" beside it
LOG_FILE = "supernode.log"
DEFAULT_NODE_PORT = 9094
# join's exit status when the kit is sound but some institutions have not co-signed the roster yet.
EXIT_WAITING = 3


class KitError(DeploymentError):
    """A kit that cannot be used: a missing file, a malformed manifest, a key not in its roster."""


class KitTamperedError(KitError):
    """A kit file whose digest or signature does not match: a replaced CA, an altered app, a manifest
    not signed by the roster's coordinator, or a kit made for another hospital."""


class KeyNotInKitRosterError(KitError):
    """This institution's identity key is not in the kit's roster: the coordinator made the roster
    with another key (or this is another federation's kit, or a version that does not add it yet)."""


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _canonical(document: Mapping[str, Any]) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: object, what: str) -> bytes:
    if not isinstance(text, str):
        raise KitError(f"{what} must be a base64 string")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise KitError(f"{what} is not base64") from None


# --- the manifest --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """kit.json without its signature."""

    federation: str
    institution: str
    superlink: str  # HOST:PORT of the Fleet API, as the hospital's SuperNode dials it
    roster_fingerprint: str
    study_digest: str
    files: Mapping[str, str]  # kit-relative path -> SHA-256 hex

    def document(self) -> dict[str, Any]:
        return {
            "format": KIT_FORMAT,
            "federation": self.federation,
            "institution": self.institution,
            "superlink": self.superlink,
            "roster_fingerprint": self.roster_fingerprint,
            "study_digest": self.study_digest,
            "files": dict(sorted(self.files.items())),
        }

    def signed_json(self, coordinator_id: str, key: IdentityKey) -> str:
        document = self.document()
        document["signer"] = coordinator_id
        signature = key.private_key.sign(KIT_CONTEXT + _canonical(document))
        return json.dumps({**document, "signature": _b64(signature)}, indent=2)

    @classmethod
    def verified(cls, text: str, roster: Roster, source: str) -> Manifest:
        """Parse kit.json and verify its signature by the roster's coordinator."""
        try:
            document = json.loads(text)
        except ValueError:
            raise KitError(f"{source}: not a {KIT_FORMAT} manifest (not JSON)") from None
        if not isinstance(document, dict) or document.get("format") != KIT_FORMAT:
            raise KitError(f"{source}: not a {KIT_FORMAT} manifest")
        if roster.coordinator is None:
            raise KitError(
                f"{source}: the kit's roster names no coordinator, so nothing vouches for the kit; ask the "
                "coordinator for a kit made by `secure-afl deploy provision`"
            )
        signature = _unb64(document.pop("signature", None), f"{source}: the signature")
        try:
            Ed25519PublicKey.from_public_bytes(roster.coordinator.public_key).verify(
                signature, KIT_CONTEXT + _canonical(document)
            )
        except InvalidSignature:
            raise KitTamperedError(
                f"{source}: the manifest is not signed by the roster's coordinator "
                f"{roster.coordinator.client_id!r} ({roster.coordinator.fingerprint}): it was changed after "
                "provisioning, or the roster is not the one it was made with: ask the coordinator for "
                "the kit again"
            ) from None
        try:
            files = document["files"]
            manifest = cls(
                federation=str(document["federation"]),
                institution=str(document["institution"]),
                superlink=str(document["superlink"]),
                roster_fingerprint=str(document["roster_fingerprint"]),
                study_digest=str(document["study_digest"]),
                files={str(k): str(v) for k, v in files.items()},
            )
        except (KeyError, AttributeError, TypeError) as exc:
            raise KitError(f"{source}: malformed manifest ({exc})") from None
        return manifest


# --- the node's files ----------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeLayout:
    """Where a hospital's node finds its files and keeps its state (absolute paths on its host)."""

    client_id: str
    kit_dir: Path
    identity_key: Path
    features: Path
    state_dir: Path  # ledger/, out/, the SuperNode's authentication key and its log
    passphrase_file: Path | None = None
    passphrase_env: str | None = None
    user: str = "secure-afl"
    node_port: int = DEFAULT_NODE_PORT
    bin_dir: Path = Path(sys.executable).parent  # flower-supernode and flower-superexec
    protection: str = "mask"
    extra: Mapping[str, str] | None = None  # other node-config keys (dp-epsilon, colluders, ...)

    def __post_init__(self) -> None:
        if (self.passphrase_file is None) == (self.passphrase_env is None):
            raise ConfigurationError("give exactly one of a passphrase file and a passphrase variable")

    @classmethod
    def standard(cls, client_id: str, protection: str = "mask") -> NodeLayout:
        """The layout provision assumes: /etc/secure-afl/ID (kit, keys), /var/lib/secure-afl-ID."""
        etc = Path("/etc/secure-afl") / client_id
        return cls(
            client_id=client_id, kit_dir=etc, identity_key=etc / "keys" / "identity.key",
            features=Path(f"/var/lib/secure-afl-{client_id}/features.npz"),
            state_dir=Path(f"/var/lib/secure-afl-{client_id}"), passphrase_file=etc / "keys" / "passphrase",
            protection=protection, bin_dir=Path("/usr/local/bin"),
        )  # fmt: skip

    @property
    def node_auth_key(self) -> Path:
        return self.state_dir / NODE_AUTH_KEY

    @property
    def log(self) -> Path:
        return self.state_dir / LOG_FILE

    def node_config(self) -> dict[str, str]:
        config = {
            "identity-key": str(self.identity_key),
            **({"passphrase-file": str(self.passphrase_file)} if self.passphrase_file else {}),
            **({"passphrase-env": self.passphrase_env} if self.passphrase_env else {}),
            "roster": str(self.kit_dir / ROSTER_FILE),
            "features": str(self.features),
            "ledger-dir": str(self.state_dir / "ledger"),
            "out-dir": str(self.state_dir / "out"),
            "protection": self.protection,
        }
        config.update(self.extra or {})
        return config

    def supernode_arguments(self, superlink: str) -> list[str]:
        return [
            str(self.bin_dir / "flower-supernode"),
            "--superlink", superlink,
            "--root-certificates", str(self.kit_dir / CA_FILE),
            "--auth-supernode-private-key", str(self.node_auth_key),
            "--port", str(self.node_port),
            "--node-config", str(self.kit_dir / NODE_CONFIG_FILE),
        ]  # fmt: skip

    def start_command(self, superlink: str) -> str:
        """The one shell command that starts the SuperNode, its output appended to its log file."""
        command = " ".join(shlex.quote(a) for a in self.supernode_arguments(superlink))
        line = f"{command} >> {shlex.quote(str(self.log))} 2>&1"
        if self.passphrase_env:
            line = f"export {self.passphrase_env}; {line}"
        return line


def render_node_config(layout: NodeLayout) -> str:
    """node-config.toml: the keys the ClientApp reads (``deploy check --help`` lists them)."""
    lines = [f"# secure-afl node config of {layout.client_id}: flower-supernode --node-config THIS_FILE"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in layout.node_config().items()]
    return "\n".join(lines) + "\n"


def _unit_quote(argument: str) -> str:
    """An ExecStart= argument: double-quoted when it holds a space or a quote ('%' doubled)."""
    text = argument.replace("%", "%%")
    if any(c in text for c in " \"'\\;"):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


def render_unit(layout: NodeLayout, superlink: str) -> str:
    """supernode.service: the SuperNode as a systemd service (``systemctl enable --now``)."""
    command = " ".join(_unit_quote(a) for a in layout.supernode_arguments(superlink))
    state = str(layout.state_dir)
    lines = [
        "[Unit]",
        f"Description=secure-afl SuperNode of {layout.client_id}",
        "Documentation=file://" + str(layout.kit_dir / README_FILE),
        "Wants=network-online.target",
        "After=network-online.target",
        "StartLimitIntervalSec=0",
        "",
        "[Service]",
        "Type=simple",
        f"User={layout.user}",
        "UMask=0077",
    ]
    if state.startswith("/var/lib/") and state.count("/") == 3:
        lines.append(f"StateDirectory={state.removeprefix('/var/lib/')}")  # created 0700 for User=
        lines.append("StateDirectoryMode=0700")
    else:
        lines.append(f"ReadWritePaths={_unit_quote(state)}")
    lines.append(f"WorkingDirectory={_unit_quote(state)}")
    lines.append(f"Environment={_unit_quote('PATH=' + str(layout.bin_dir) + ':/usr/bin:/bin')}")
    # Flower keeps the apps it receives under FLWR_HOME: in the state directory, not the user's home.
    lines.append(f"Environment={_unit_quote('FLWR_HOME=' + str(layout.state_dir / 'flwr'))}")
    if layout.passphrase_env:
        # The variable's value lives in a root-owned 0600 file, never in this unit.
        environment = Path("/etc/secure-afl") / f"{layout.client_id}.env"
        lines.append(f"# {environment}: one line {layout.passphrase_env}=..., owned by root, mode 0600")
        lines.append(f"EnvironmentFile={_unit_quote(str(environment))}")
    else:
        lines.append(f"# the passphrase: {layout.passphrase_file} (mode 0600, owned by {layout.user})")
    lines += [
        f"ExecStart={command}",
        f"StandardOutput=append:{layout.log}",
        f"StandardError=append:{layout.log}",
        "Restart=on-failure",
        # A SuperNode quits with status 0 when a restarted SuperLink has forgotten it (no database),
        # and exits 305 while its key is not registered: retry both every 15 s, never give up.
        "RestartForceExitStatus=0",
        "RestartSec=15",
        "NoNewPrivileges=true",
        "PrivateTmp=true",
        "ProtectSystem=full",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
    ]
    return "\n".join(lines) + "\n"


def render_readme(layout: NodeLayout, manifest: Manifest) -> str:
    return f"""secure-afl kit of {manifest.institution} for the federation {manifest.federation!r}
SuperLink: {manifest.superlink}   roster: {manifest.roster_fingerprint}
study digest: {manifest.study_digest}

1. Check every roster entry: `secure-afl keys roster show --roster roster.json`. Each id and
   fingerprint must be one you heard from that institution itself (read aloud, not by e-mail).
2. secure-afl deploy join THIS_DIR --features FEATURES.npz --passphrase-file FILE (or
   --passphrase-env VAR) --expect ID='SHA256:...' for every other entry, the coordinator's
   included (or, at a terminal, answer its prompt) [--key-dir DIR] [--state-dir DIR]: checks the
   kit (the coordinator's signature, the CA, the app), your key, your features against the study,
   the SuperLink, every entry's fingerprint; co-signs the roster; writes
   {manifest.institution}.reply.json, node-config.toml and supernode.service.
3. Send {manifest.institution}.reply.json to the coordinator. It returns roster.json co-signed by every
   institution: put it here (same name). Running step 2 again checks it and exits 0 (optional: the
   node itself refuses a roster that an institution has not co-signed).
4. Start the node with the command join prints, or as a service:
   cp supernode.service /etc/systemd/system/secure-afl-supernode-{manifest.institution}.service &&
   systemctl enable --now secure-afl-supernode-{manifest.institution}
   Its log: {layout.log}. Keep {layout.state_dir / "ledger"} across runs.
Exit codes of join: 0 ready to start, {EXIT_WAITING} waiting for co-signatures, 1 a check failed.
"""


def write_text(path: Path, text: str, mode: int = 0o600) -> None:
    """A file written with ``mode`` from the start (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_with_mode(path, text.encode("utf-8"), mode)


def write_node_files(layout: NodeLayout, manifest: Manifest, directory: Path | None = None) -> None:
    """node-config.toml, supernode.service and README.txt for ``layout``, in ``directory`` (default:
    the layout's kit directory; provision writes a kit bound for another host's layout)."""
    directory = layout.kit_dir if directory is None else directory
    write_text(directory / NODE_CONFIG_FILE, render_node_config(layout))
    write_text(directory / UNIT_FILE, render_unit(layout, manifest.superlink), 0o644)
    write_text(directory / README_FILE, render_readme(layout, manifest), 0o644)


# --- the reply: co-signature and SuperNode key ---------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """A hospital's answer to its kit: its roster co-signature and its SuperNode's public key."""

    client_id: str
    roster_fingerprint: str
    cosignature: bytes
    supernode_public_key: str  # OpenSSH, as `flwr supernode register` reads it
    binding: bytes  # the identity key's signature over the SuperNode key (and id, roster)

    @staticmethod
    def _binding_message(client_id: str, roster: Roster, supernode_public_key: str) -> bytes:
        body = {"id": client_id, "roster": roster.digest().hex(), "supernode": supernode_public_key}
        return REPLY_CONTEXT + _canonical(body)

    @classmethod
    def make(cls, roster: Roster, key: IdentityKey, supernode_public_key: str) -> Reply:
        client_id, cosignature = sign_roster(roster, key)
        binding = key.private_key.sign(cls._binding_message(client_id, roster, supernode_public_key))
        return cls(client_id, roster.fingerprint, cosignature, supernode_public_key, binding)

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": REPLY_FORMAT,
                "id": self.client_id,
                "roster_fingerprint": self.roster_fingerprint,
                "cosignature": _b64(self.cosignature),
                "supernode_public_key": self.supernode_public_key,
                "supernode_key_signature": _b64(self.binding),
            },
            indent=2,
        )

    @classmethod
    def verified(cls, text: str, roster: Roster, source: str) -> Reply:
        """Parse a reply and verify both signatures with the roster entry's key."""
        try:
            document = json.loads(text)
        except ValueError:
            raise KitError(f"{source}: not a {REPLY_FORMAT} file (not JSON)") from None
        if not isinstance(document, dict) or document.get("format") != REPLY_FORMAT:
            raise KitError(f"{source}: not a {REPLY_FORMAT} file (written by `secure-afl deploy join`)")
        client_id = str(document.get("id"))
        if client_id not in roster:
            raise KitError(f"{source}: {client_id!r} is not an institution of this roster")
        if document.get("roster_fingerprint") != roster.fingerprint:
            raise KitError(
                f"{source}: {client_id} signed the roster {document.get('roster_fingerprint')}, this one is "
                f"{roster.fingerprint}: send it the current kit and ask it to join again"
            )
        public_key = document.get("supernode_public_key")
        if not isinstance(public_key, str):
            raise KitError(f"{source}: the SuperNode public key must be an OpenSSH string")
        try:
            serialization.load_ssh_public_key(public_key.encode("ascii"))
        except (ValueError, UnicodeEncodeError, serialization.UnsupportedAlgorithm):
            raise KitError(f"{source}: the SuperNode public key is not an OpenSSH public key") from None
        reply = cls(
            client_id, roster.fingerprint, _unb64(document.get("cosignature"), f"{source}: the co-signature"),
            public_key, _unb64(document.get("supernode_key_signature"), f"{source}: the key signature"),
        )  # fmt: skip
        try:
            check_cosignatures(roster, {client_id: reply.cosignature})
        except RosterCosignatureError as exc:
            raise KitTamperedError(f"{source}: {exc}") from None
        entry = roster.entry(client_id)
        try:
            Ed25519PublicKey.from_public_bytes(entry.public_key).verify(
                reply.binding, cls._binding_message(client_id, roster, public_key)
            )
        except InvalidSignature:
            raise KitTamperedError(
                f"{source}: the SuperNode key is not signed by {client_id}'s identity key "
                f"({entry.fingerprint})"
            ) from None
        return reply


# --- join ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JoinResult:
    client_id: str
    manifest: Manifest
    status: CosignatureStatus
    reply_path: Path
    start_command: str
    unit_path: Path

    @property
    def ready(self) -> bool:
        return self.status.complete


Say = Callable[[str], None]


def read_kit(kit_dir: Path) -> tuple[Manifest, CosignatureStatus]:
    """The kit's manifest (signature, files and study verified) and its roster's co-signatures."""
    kit_dir = Path(kit_dir)
    for name in (MANIFEST, ROSTER_FILE, *SIGNED_FILES):
        if not (kit_dir / name).is_file():
            raise KitError(
                f"{kit_dir}: the kit lacks {name}; ask the coordinator for the whole kit directory "
                "(`secure-afl deploy provision` writes it)"
            )
    try:
        roster, cosignatures = read_roster_document((kit_dir / ROSTER_FILE).read_text(encoding="utf-8"))
        status = check_cosignatures(roster, cosignatures)
    except RosterError as exc:
        raise KitTamperedError(f"{kit_dir / ROSTER_FILE}: {type(exc).__name__}: {exc}") from None
    manifest = Manifest.verified(
        (kit_dir / MANIFEST).read_text(encoding="utf-8"), roster, str(kit_dir / MANIFEST)
    )
    if manifest.roster_fingerprint != roster.fingerprint:
        raise KitTamperedError(
            f"{kit_dir / ROSTER_FILE}: the roster is {roster.fingerprint}, the kit was made for "
            f"{manifest.roster_fingerprint}; use the roster.json of this kit (or the co-signed one the "
            "coordinator sent back)"
        )
    for name in SIGNED_FILES:
        if manifest.files.get(name) != sha256_file(kit_dir / name):
            what = "the CA certificate" if name == CA_FILE else "the app (the study)"
            raise KitTamperedError(
                f"{kit_dir / name}: {what} is not the one the coordinator signed in {MANIFEST} "
                f"(SHA-256 {sha256_file(kit_dir / name)[:16]}..., signed "
                f"{str(manifest.files.get(name))[:16]}...);"
                " do not use this kit: ask the coordinator for it again over a channel you trust"
            )
    from .check import study_from_file

    study = study_from_file(kit_dir / "app")
    if study.digest() != manifest.study_digest:
        raise KitTamperedError(f"{kit_dir / APP_FILE}: its study digest differs from the manifest's")
    return manifest, status


def join_kit(
    layout: NodeLayout,
    *,
    recognition: Recognition,
    key_entry_public_key: bytes | None = None,
    connect: bool = True,
    timeout: float = 10.0,
    say: Say = print,
) -> JoinResult:
    """Check a kit and complete it for this hospital: see the module's docstring.

    ``recognition``: how the hospital recognises every roster entry, the coordinator's included
    (its own entry is verified by its key); checked once the kit is verified and before the node's
    checks (which record the study in the ledger), so a refusal leaves no reply, node file,
    SuperNode key or recorded study.

    Raises :class:`KitError` / :class:`KitTamperedError` for the kit,
    :class:`~secure_afl.keys.recognition.RosterNotRecognisedError` for an entry not recognised, and
    :class:`~secure_afl.deploy.check.NodeCheckError` (the run's own error, named) for the node.
    """
    from .check import NodeCheckError, check_node, study_from_file
    from .client import NodeSettings, node_identity
    from .writers import write_node_auth_key

    kit_dir = layout.kit_dir
    manifest, status = read_kit(kit_dir)
    roster = status.roster
    say(f"ok  kit {kit_dir}: signed by the coordinator {roster.coordinator.client_id} "  # type: ignore[union-attr]
        f"({roster.coordinator.fingerprint}); CA and app match its manifest")  # type: ignore[union-attr]  # fmt: skip
    if key_entry_public_key is not None:
        mine = [e for e in roster if e.public_key == key_entry_public_key]
        if not mine:
            raise KeyNotInKitRosterError(
                f"this institution's key is not in the kit's roster ({roster.fingerprint}, version "
                f"{roster.version}): the coordinator must provision with your identity.pub.json (a newcomer: "
                "add it to a new roster version, `keys roster add`); do not sign this roster"
            )
        if mine[0].client_id != manifest.institution:
            raise KitTamperedError(
                f"{kit_dir}: this kit was made for {manifest.institution!r}, your key is "
                f"{mine[0].client_id!r} in the roster: ask the coordinator for your own kit"
            )
    if roster.version > 1 and not status.complete:
        # A later version reaches a newcomer only after every member co-signed it (keys roster sign) and
        # the members moved to it: there is nothing left to wait for, and nothing here to co-sign.
        raise RosterNotCosignedError(
            f"{kit_dir / ROSTER_FILE}: roster version {roster.version} ({roster.fingerprint}) is not "
            f"co-signed by {list(status.missing)} (signed by {list(status.signed) or 'nobody'}): a roster "
            "version after the first is co-signed by every institution it lists (`secure-afl keys roster "
            "sign`) before the coordinator issues its kits (`deploy collect`); ask the coordinator for "
            "the kit of the version every member signed"
        )
    # The human step, before anything is written (check_node records the study in the ledger): every
    # entry, the coordinator's included, must be recognised, or nothing is signed or written (no
    # reply, no node files, no SuperNode key, no recorded study).  This hospital's own entry is
    # verified by its key (here, and by node_identity below before anything is signed).
    say(f"roster {roster.fingerprint}: {len(roster)} institutions; co-sign it only if you recognise each:")
    for entry in roster:
        mark = " (you)" if entry.client_id == manifest.institution else ""
        say(f"      {entry.client_id:<20} {entry.fingerprint}  {entry.name}{mark}")
    coordinator = roster.coordinator
    assert coordinator is not None  # Manifest.verified refuses a roster without one
    say(f"      {coordinator.client_id:<20} {coordinator.fingerprint}  {coordinator.name} (coordinator)")
    how = recognition.verify(  # RosterNotRecognisedError
        (*roster.entries, coordinator), known=(manifest.institution,), what=f"the roster {roster.fingerprint}"
    )
    say(f"ok  roster entries: {how}")
    config = layout.node_config()
    # The node's own checks, on the node config it will run with (while some co-signatures are
    # missing, every other check still runs: the node itself would refuse the roster).
    study = study_from_file(kit_dir / "app")
    check_node(
        config, study=study, superlink=manifest.superlink if connect else None,
        root_certificates=kit_dir / CA_FILE, timeout=timeout, say=say, cosigned=status.complete,
    )  # fmt: skip
    settings = NodeSettings.from_node_config(config)
    try:
        client_id, key = node_identity(settings, roster)
    except Exception as exc:  # passed check_node a moment ago: a changed file
        raise NodeCheckError(manifest.institution, "identity key", exc) from exc
    if client_id != manifest.institution:
        raise KitTamperedError(
            f"{kit_dir}: this kit was made for {manifest.institution!r}, this key is {client_id!r}: ask the "
            "coordinator for your own kit"
        )
    if roster.version > 1:
        # A newcomer's node starts at this version: from now on it refuses any other roster at its path
        # (an older one copied back, a fork), as a member's node does after `keys roster update`.
        # check_node accepted this roster against any pin the ledger directory held already.
        from secure_afl.keys.lifecycle import write_pin

        say(f"ok  pinned roster version {roster.version} in {write_pin(settings.ledger_dir, roster)}")
    layout.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    public_path = layout.node_auth_key.with_name(NODE_AUTH_KEY + ".pub")
    if not layout.node_auth_key.exists():
        write_node_auth_key(layout.node_auth_key)
        say(f"ok  wrote the SuperNode's authentication key {layout.node_auth_key} (0600)")
    public_key = public_path.read_text(encoding="ascii").strip()
    reply_path = kit_dir / f"{client_id}.reply.json"
    write_text(reply_path, Reply.make(roster, key, public_key).to_json() + "\n", 0o644)
    write_node_files(layout, manifest)
    return JoinResult(
        client_id, manifest, status, reply_path, layout.start_command(manifest.superlink), kit_dir / UNIT_FILE
    )


# --- a later roster version: the coordinator issues the kits (deploy collect) --------------------


@dataclass(frozen=True)
class KitsAtVersion:
    """A federation directory's kits against its current roster (``FED/roster.json``)."""

    roster: Roster
    roster_text: str
    stale: tuple[str, ...]  # members whose kit is missing, or made for another roster
    unregistered: tuple[str, ...]  # members without a SuperNode key in FED/supernodes/ (no reply yet)


def kits_at_version(out_dir: Path) -> KitsAtVersion:
    """Which kits of ``out_dir`` (``deploy provision --federation-dir``) do not match its roster, which
    must be co-signed by every institution (:class:`RosterNotCosignedError` otherwise)."""
    from secure_afl.keys.cosign import require_cosigned, roster_status

    path = Path(out_dir) / ROSTER_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise KitError(
            f"{path}: cannot read the federation's roster ({exc.strerror}): give the directory `deploy "
            "provision --federation-dir` wrote"
        ) from None
    roster = require_cosigned(roster_status(text), str(path))
    stale, unregistered = [], []
    for cid in roster.client_ids:
        manifest = Path(out_dir) / "kits" / cid / MANIFEST
        try:
            made_for = json.loads(manifest.read_text(encoding="utf-8")).get("roster_fingerprint")
        except (OSError, ValueError, AttributeError):
            made_for = None
        if made_for != roster.fingerprint:
            stale.append(cid)
        if not (Path(out_dir) / "supernodes" / f"{cid}.pub").is_file():
            unregistered.append(cid)
    return KitsAtVersion(roster, text, tuple(stale), tuple(unregistered))


def _federation_and_superlink(kits_dir: Path) -> tuple[str, str]:
    """The federation's name and the SuperLink's address, as every kit provision wrote names them."""
    found = set()
    for manifest in sorted(kits_dir.glob(f"*/{MANIFEST}")):
        try:
            document = json.loads(manifest.read_text(encoding="utf-8"))
            found.add((str(document["federation"]), str(document["superlink"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if len(found) != 1:
        raise KitError(
            f"{kits_dir}: the kits name {len(found)} (federation, SuperLink address) pairs, not one: this is "
            "not a directory `deploy provision` wrote, or its kits were changed by hand"
        )
    return found.pop()


def issue_kits(out_dir: Path, key: IdentityKey, client_ids: tuple[str, ...], say: Say = print) -> list[Path]:
    """Write ``out_dir/kits/ID/`` for each id at the federation's current co-signed roster: its CA and
    app, that roster, and a manifest for it signed by ``key`` (the roster's coordinator); a newcomer's
    kit is made whole, like ``provision``'s.  What a hospital's ``join`` checks (:func:`read_kit`)."""
    from .check import study_from_file

    out_dir = Path(out_dir).resolve()
    state = kits_at_version(out_dir)
    roster, coordinator = state.roster, state.roster.coordinator
    if coordinator is None or coordinator.public_key != key.public_key:
        named = "none" if coordinator is None else f"{coordinator.client_id} ({coordinator.fingerprint})"
        raise KitError(
            f"the key {key.fingerprint} is not the coordinator of {out_dir / ROSTER_FILE} ({named}): the "
            "kits are signed with the roster's coordinator key (--key-dir)"
        )
    unknown = sorted(set(client_ids) - set(roster.client_ids))
    if unknown:
        raise KitError(f"{unknown} are not institutions of the roster {roster.fingerprint}: no kit for them")
    kits_dir = out_dir / "kits"
    federation, superlink = _federation_and_superlink(kits_dir)
    ca_text = (out_dir / "tls" / CA_FILE).read_text(encoding="ascii")
    app_text = (out_dir / APP_FILE).read_text(encoding="utf-8")
    study = study_from_file(out_dir / "app")
    written = []
    for cid in client_ids:
        kit = kits_dir / cid
        new = not kit.exists()
        (kit / "app").mkdir(parents=True, exist_ok=True, mode=0o700)
        kit.chmod(0o700)
        write_text(kit / CA_FILE, ca_text, 0o644)
        write_text(kit / APP_FILE, app_text, 0o644)
        write_text(kit / ROSTER_FILE, state.roster_text.rstrip("\n") + "\n", 0o644)
        manifest = Manifest(
            federation=federation, institution=cid, superlink=superlink,
            roster_fingerprint=roster.fingerprint, study_digest=study.digest(),
            files={name: sha256_file(kit / name) for name in SIGNED_FILES},
        )  # fmt: skip
        write_text(kit / MANIFEST, manifest.signed_json(coordinator.client_id, key) + "\n", 0o644)
        if new:
            write_node_files(NodeLayout.standard(cid, study.protection), manifest, kit)
        done = "wrote" if new else "renewed"
        say(f"{done} {kit} for roster version {roster.version} ({roster.fingerprint})")
        written.append(kit)
    return written
