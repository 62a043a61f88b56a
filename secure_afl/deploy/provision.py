"""``secure-afl deploy provision`` and ``deploy collect``: the coordinator's side of the kits.

``provision`` turns the hospitals' public identity files and a few options into a federation
directory::

    OUT/roster.json          the roster (no co-signatures yet: ``collect`` adds them)
    OUT/tls/                 ca.crt, ca.key (0600, keep offline), superlink.pem, superlink.key (0600)
    OUT/app/pyproject.toml   the coordinator's app (the study): ``deploy run --app-dir OUT/app``
    OUT/server/              where the ServerApp writes classifier.json and report.json
    OUT/kits/ID/             one kit per hospital (0700): see :mod:`secure_afl.deploy.kit`

``collect`` takes the hospitals' ``ID.reply.json`` files (``deploy join``), verifies each
co-signature and SuperNode key against the roster, writes the co-signed roster into OUT/roster.json
and the kit of every institution it lists, keeps each SuperNode key as ``OUT/supernodes/ID.pub`` and
registers it with the SuperLink (``flwr supernode register``, through the coordinator's loopback
Control API), keeping the node id flwr gives it as ``OUT/supernodes/ID.node-id``.

A member a later roster version removed (:func:`retire_removed`) gets no new kit (its kit directory is
left as it was, made for the version it left) and its SuperNode key is unregistered (``flwr supernode
unregister NODE_ID``), its files then moved to ``OUT/supernodes/removed/``; without its node id, or with
``--no-register``, collect prints the command and reports it not done.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from secure_afl.keys.cosign import (
    CosignatureStatus,
    check_cosignatures,
    cosigned_roster_json,
    read_roster_document,
)
from secure_afl.keys.identity import IdentityKey
from secure_afl.keys.recognition import Recognition
from secure_afl.keys.roster import Roster, RosterEntry, RosterError

from .errors import ConfigurationError, DeploymentError
from .kit import (
    APP_FILE,
    CA_FILE,
    MANIFEST,
    ROSTER_FILE,
    KitError,
    Manifest,
    NodeLayout,
    Reply,
    sha256_file,
    write_node_files,
    write_text,
)
from .tls import TlsError, TlsFiles, parse_host_name, parse_ip_address, write_tls_material

Say = Callable[[str], None]
DEFAULT_FLEET_PORT = 9092


@dataclass(frozen=True)
class ProvisionResult:
    out_dir: Path
    roster: Roster
    tls: TlsFiles
    app_dir: Path
    superlink: str
    kits: Mapping[str, Path]


def backbone_record(
    features: Path | None, backbone: str | None, weights: Path | None, classes: Sequence[str]
) -> dict[str, object]:
    """The study's classes, dim, backbone, weights-id and preprocessing (run-config keys), from a
    feature file's header or from the agreed backbone and weight file (then ``classes``, the CLI's
    ChestXray14 list: deploy/ never imports the simulator)."""
    from secure_afl.features.file import FeatureFileError, describe_preprocessing, load_feature_file

    if (features is None) == (backbone is None):
        raise ConfigurationError("give --features FILE, or --backbone NAME with --weights FILE")
    if features is not None:
        try:
            data = load_feature_file(features)
        except FeatureFileError as exc:
            raise ConfigurationError(f"FeatureFileError: {exc}") from None
        described = data.describe_backbone()
        return {
            "classes": ",".join(data.classes),
            "dim": int(data.dim),
            "backbone": described["name"],
            "weights-id": described["weights_id"],
            "preprocessing": described["preprocessing"],
        }
    from secure_afl.features.backbones import UnknownBackboneError, WeightsError, load_backbone

    if weights is None:
        raise ConfigurationError(
            "--backbone needs --weights FILE (the agreed weight file; nothing is downloaded)"
        )
    try:
        loaded = load_backbone(str(backbone), weights)
    except (UnknownBackboneError, WeightsError) as exc:
        raise ConfigurationError(f"{type(exc).__name__}: {exc}") from None
    return {
        "classes": ",".join(classes),
        "dim": int(loaded.feature_dim),
        "backbone": loaded.name,
        "weights-id": loaded.weights_id,
        "preprocessing": describe_preprocessing(loaded.preprocess),
    }


def superlink_address(hosts: Sequence[str], ips: Sequence[str], port: int) -> str:
    """The Fleet API address the kits dial: the first --host, else the first --ip."""
    if hosts:
        return f"{parse_host_name(hosts[0])}:{port}"
    if ips:
        address = parse_ip_address(ips[0])
        return f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"
    raise ConfigurationError("give at least one --host NAME or --ip ADDR: the address SuperNodes dial")


def provision(
    out_dir: Path,
    hospitals: Sequence[RosterEntry],
    coordinator: RosterEntry,
    coordinator_key: IdentityKey,
    study_config: Mapping[str, object],
    *,
    hosts: Sequence[str] = (),
    ips: Sequence[str] = (),
    port: int = DEFAULT_FLEET_PORT,
    federation: str = "federation",
    days: int = 365,
    force: bool = False,
    recognition: Recognition,
    say: Say = print,
) -> ProvisionResult:
    """Write the roster, the TLS material, the coordinator's app and one kit per hospital.

    ``recognition``: how the coordinator recognises every hospital's entry (each id with the
    fingerprint heard from that hospital itself); checked after every other check, before anything
    is written (:class:`~secure_afl.keys.recognition.RosterNotRecognisedError`).

    ``coordinator_key`` (already decrypted) signs every kit's manifest; it is never written into the
    app: ``deploy run`` signs the classifier in its own process, the ServerApp never holds the key.
    ``study_config``: the other run-config keys (the study).  Nothing is written when a check fails.
    """
    from .apps import study_from_run_config
    from .study import parse_colluders
    from .writers import write_app

    if coordinator_key.public_key != coordinator.public_key:
        raise ConfigurationError(
            f"the coordinator's key ({coordinator_key.fingerprint}) does not match its identity.pub.json "
            f"({coordinator.fingerprint}): give the key directory that `keys init --id coordinator` wrote"
        )
    if len(hospitals) < 2:
        raise ConfigurationError(
            f"a federation needs at least 2 hospitals, {len(hospitals)} given (--hospital)"
        )
    if not federation.replace("-", "").replace("_", "").isalnum():
        raise ConfigurationError(f"--federation {federation!r}: use letters, digits, '-' and '_'")
    try:
        roster = Roster(hospitals, coordinator)
        address = superlink_address(hosts, ips, port)
    except (RosterError, TlsError) as exc:
        raise ConfigurationError(str(exc)) from None
    out_dir = Path(out_dir).resolve()
    targets = [out_dir / ROSTER_FILE, out_dir / "app", out_dir / "kits", out_dir / "tls"]
    existing = [str(p) for p in targets if p.exists()]
    if existing and not force:
        raise ConfigurationError(
            f"{', '.join(existing)} already exist(s): choose another --out or pass --force"
        )
    config: dict[str, object] = {
        "roster": str(out_dir / ROSTER_FILE),
        "out-dir": str(out_dir / "server"),
        **study_config,
    }
    study = study_from_run_config(config)  # every value checked before anything is written
    parse_colluders(config.get("colluders", "n-t"), len(roster), study.threshold_for(len(roster)))
    say(f"roster {roster.fingerprint}: {len(roster)} hospitals; provision it only if you recognise each:")
    for entry in roster:
        say(f"      {entry.client_id:<20} {entry.fingerprint}  {entry.name}")
    how = recognition.verify(  # RosterNotRecognisedError: nothing written yet
        (*roster.entries, coordinator),
        known=(coordinator.client_id,),
        what=f"the roster {roster.fingerprint}",
    )
    say(f"ok  roster entries: {how}")
    out_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_text(out_dir / ROSTER_FILE, roster.to_json() + "\n", 0o644)
    try:
        tls = write_tls_material(out_dir / "tls", hosts=hosts, ips=ips, days=days, force=force)
    except TlsError as exc:
        raise ConfigurationError(str(exc)) from None
    app_dir = write_app(out_dir / "app", config)
    (out_dir / "server").mkdir(exist_ok=True, mode=0o700)
    kits_dir = out_dir / "kits"
    if kits_dir.exists():
        shutil.rmtree(kits_dir)  # --force: kits of an older roster must not survive beside the new
    kits_dir.mkdir(mode=0o700)
    kits = {}
    for entry in roster:
        kit = kits_dir / entry.client_id
        kit.mkdir(mode=0o700)
        (kit / "app").mkdir(mode=0o700)
        write_text(kit / CA_FILE, tls.ca_certificate.read_text(encoding="ascii"), 0o644)
        write_text(kit / APP_FILE, (app_dir / "pyproject.toml").read_text(encoding="utf-8"), 0o644)
        write_text(kit / ROSTER_FILE, roster.to_json() + "\n", 0o644)
        manifest = Manifest(
            federation=federation, institution=entry.client_id, superlink=address,
            roster_fingerprint=roster.fingerprint, study_digest=study.digest(),
            files={name: sha256_file(kit / name) for name in (CA_FILE, APP_FILE)},
        )  # fmt: skip
        write_text(kit / MANIFEST, manifest.signed_json(coordinator.client_id, coordinator_key) + "\n", 0o644)
        write_node_files(NodeLayout.standard(entry.client_id, study.protection), manifest, kit)
        kits[entry.client_id] = kit
    return ProvisionResult(out_dir, roster, tls, app_dir, address, kits)


# --- collect -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CollectResult:
    status: CosignatureStatus
    collected: tuple[str, ...]
    supernode_keys: Mapping[str, Path]
    registered: tuple[str, ...]


def collect(
    out_dir: Path,
    replies: Sequence[Path],
    *,
    register: bool = True,
    flwr_home: Path | None = None,
    federation: str = "federation",
    flwr: str = "flwr",
    timeout: float = 60.0,
    say: Say = print,
) -> CollectResult:
    """Merge the hospitals' replies into the co-signed roster; register their SuperNode keys."""
    out_dir = Path(out_dir).resolve()
    roster_path = out_dir / ROSTER_FILE
    if not roster_path.is_file():
        raise ConfigurationError(
            f"{roster_path}: no roster here: give the directory `deploy provision --federation-dir` wrote"
        )
    try:
        roster, cosignatures = read_roster_document(roster_path.read_text(encoding="utf-8"))
        check_cosignatures(roster, cosignatures)
    except RosterError as exc:
        raise ConfigurationError(f"{roster_path}: {type(exc).__name__}: {exc}") from None
    if not replies:
        raise ConfigurationError("give the hospitals' ID.reply.json files (written by `deploy join`)")
    home = flwr_home or out_dir / "superlink" / "flwr"
    if register and not (home / "config.toml").is_file():
        raise ConfigurationError(
            f"{home / 'config.toml'} does not exist: give --flwr-home, the flwr/ directory of `secure-afl "
            "deploy superlink --state-dir` (start the SuperLink first), or --no-register"
        )
    verified: dict[str, Reply] = {}
    for path in replies:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigurationError(f"{path}: cannot read the reply: {exc.strerror}") from None
        reply = Reply.verified(text, roster, str(path))  # KitError / KitTamperedError name the file
        if reply.client_id in verified:
            raise KitError(f"{path}: a second reply of {reply.client_id}: give one per hospital")
        verified[reply.client_id] = reply
    cosignatures.update({cid: reply.cosignature for cid, reply in verified.items()})
    text = cosigned_roster_json(roster, cosignatures) + "\n"
    keys_dir = out_dir / "supernodes"
    keys_dir.mkdir(exist_ok=True, mode=0o700)
    supernode_keys = {}
    for cid, reply in verified.items():
        supernode_keys[cid] = keys_dir / f"{cid}.pub"
        write_text(supernode_keys[cid], reply.supernode_public_key + "\n", 0o644)
    write_text(roster_path, text, 0o644)
    for kit in sorted((out_dir / "kits").glob("*")):
        if kit.name in roster.client_ids and (kit / ROSTER_FILE).is_file():  # a removed member's: as it was
            write_text(kit / ROSTER_FILE, text, 0o644)
    status = check_cosignatures(roster, cosignatures)
    registered = []
    if register:
        env = {**os.environ, "FLWR_HOME": str(home)}
        for cid, path in supernode_keys.items():
            try:
                result = subprocess.run(
                    [flwr, "supernode", "register", str(path), federation],
                    env=env, capture_output=True, text=True, timeout=timeout, check=False,
                )  # fmt: skip
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise DeploymentError(f"flwr supernode register {path}: {exc}") from None
            output = (result.stdout + result.stderr).strip()
            if result.returncode != 0 and "already" not in output.lower():
                raise DeploymentError(
                    f"flwr supernode register {path} {federation} exited {result.returncode}: "
                    f"{output[-600:]} (is the SuperLink running? is {federation!r} its federation?)"
                )
            registered.append(cid)
            node = _REGISTERED.search(output)
            if node is not None:  # "already registered" names none: a node id kept before stays
                write_text(keys_dir / f"{cid}{NODE_ID_SUFFIX}", node.group(1) + "\n", 0o644)
            named = f" as node {node.group(1)}" if node is not None else ""
            say(f"registered the SuperNode key of {cid} ({path}){named}")
    return CollectResult(status, tuple(verified), supernode_keys, tuple(registered))


NODE_ID_SUFFIX = ".node-id"  # OUT/supernodes/ID.node-id: the node id flwr gave ID's SuperNode key
REMOVED_DIR = "removed"  # OUT/supernodes/removed/: the key files of members a roster version removed
_REGISTERED = re.compile(r"SuperNode (\d+) registered")


def retire_removed(
    out_dir: Path,
    roster: Roster,
    *,
    register: bool = True,
    flwr_home: Path | None = None,
    federation: str = "federation",
    flwr: str = "flwr",
    timeout: float = 60.0,
    say: Say = print,
) -> tuple[str, ...]:
    """For each member with a kit or a SuperNode key in ``out_dir`` whom ``roster`` (the federation's
    current version) no longer lists: say that it gets no new kit (its kit is left as it was), and
    unregister its SuperNode key (``flwr supernode unregister NODE_ID FEDERATION``, the node id kept at
    its registration), then move its key files to ``OUT/supernodes/removed/``.  Returns the ids whose key
    is still registered: no node id kept, or ``register`` false; their command is printed."""
    out_dir = Path(out_dir).resolve()
    keys_dir, home = out_dir / "supernodes", flwr_home or out_dir / "superlink" / "flwr"
    kits = {kit.name for kit in (out_dir / "kits").glob("*") if (kit / MANIFEST).is_file()}
    keys = {path.name[: -len(".pub")] for path in keys_dir.glob("*.pub")}
    not_done = []
    for cid in sorted((kits | keys) - set(roster.client_ids)):
        if cid in kits:
            say(f"{cid} is not in roster version {roster.version}: no new kit ({out_dir / 'kits' / cid} is "
                "left as it was, for the version it left)")  # fmt: skip
        if cid not in keys:
            continue
        node_file = keys_dir / f"{cid}{NODE_ID_SUFFIX}"
        node_id = node_file.read_text(encoding="ascii").strip() if node_file.is_file() else ""
        if not node_id.isdigit():
            node_id = ""
        command = f"FLWR_HOME={home} flwr supernode unregister {node_id or 'NODE_ID'} {federation}"
        if register and node_id:
            _unregister(cid, [flwr, "supernode", "unregister", node_id, federation], home, command, timeout)
            say(f"unregistered the SuperNode key of {cid} (node {node_id}): removed in roster version "
                f"{roster.version}")  # fmt: skip
        else:
            why = "--no-register" if not register else f"no node id kept in {node_file}"
            say(f"NOT DONE: {cid}'s SuperNode key ({keys_dir / f'{cid}.pub'}) is still registered with the "
                f"SuperLink ({why}): run\n  {command}")  # fmt: skip
            if not node_id:
                say(f"  NODE_ID: the number `flwr supernode register` printed for {cid}'s key (`flwr "
                    f"supernode list` shows the ids, not the keys); then move {keys_dir / f'{cid}.pub'} into "
                    f"{keys_dir / REMOVED_DIR}/")  # fmt: skip
            not_done.append(cid)
            continue
        removed = keys_dir / REMOVED_DIR
        removed.mkdir(exist_ok=True, mode=0o700)
        for name in (f"{cid}.pub", f"{cid}{NODE_ID_SUFFIX}"):
            if (keys_dir / name).exists():
                os.replace(keys_dir / name, removed / name)
    return tuple(not_done)


def _unregister(cid: str, argv: list[str], home: Path, command: str, timeout: float) -> None:
    if not (home / "config.toml").is_file():
        raise ConfigurationError(
            f"{home / 'config.toml'} does not exist: give --flwr-home, the flwr/ directory of `secure-afl "
            f"deploy superlink --state-dir`, to unregister {cid}'s SuperNode key (or --no-register)"
        )
    try:
        result = subprocess.run(
            argv, env={**os.environ, "FLWR_HOME": str(home)}, capture_output=True, text=True,
            timeout=timeout, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DeploymentError(f"{command}: {exc}") from None
    output = (result.stdout + result.stderr).strip()
    if result.returncode != 0 and "not found" not in output.lower():  # not found: unregistered already
        raise DeploymentError(
            f"{command} exited {result.returncode}: {output[-600:]} (is the SuperLink running?); {cid} was "
            "removed from the roster, so its SuperNode key must go: run collect again"
        )
