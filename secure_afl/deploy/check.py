"""``secure-afl deploy check``: what a hospital runs before the coordinator starts the federation.

Every check runs the ClientApp's own loading code (:class:`~secure_afl.deploy.client.NodeSettings`,
``node_roster``, ``node_identity``, ``check_node_study``, ``node_backend``) on the node config the
SuperNode will be given, so a failure here is the refusal the hospital would otherwise send 15 s
into a session, with
the same error class and message, but named by hospital and before anything starts.  The ledger is
loaded and its signature checked, the output directories must be writable, and with a SuperLink
address the SuperLink must accept a TCP connection (and, with its CA, a TLS handshake whose
certificate names that host).  With ``--study`` it also looks the feature file up in the ledger
(a session over values it already released is refused in R0: the same error here), and when
every check passed it records the study's digest in ``ledger-dir/checked-study.json`` (0600): the
node then refuses any other study (:class:`~secure_afl.deploy.errors.UncheckedStudyError`).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigurationError, DeploymentError
from .study import Study

# Every key a SuperNode's --node-config may hold, and what it means (the `deploy check` help).
NODE_CONFIG_KEYS: dict[str, str] = {
    "identity-key": "(required) this hospital's encrypted identity key file (`secure-afl keys init`, "
    "mode 0600)",
    "passphrase-file": "(this or passphrase-env) a file, mode 0600, whose first line is that key's "
    "passphrase, in the clear",
    "passphrase-env": "(this or passphrase-file) the name of an environment variable of the SuperNode's "
    "process that holds the passphrase (export it in the shell or service that starts the SuperNode)",
    "roster": "(required) the roster.json every institution pinned (from the coordinator), co-signed by "
    "every institution (`deploy join`, `keys roster sign`): the node refuses it otherwise",
    "features": "(required) this hospital's labelled feature file (.npz, secure-afl-features/v1)",
    "ledger-dir": "(required) directory of this hospital's signed session history (created 0700; keep "
    "it across runs: it refuses sessions that would isolate this hospital's statistics)",
    "out-dir": "(required) directory where the node stores the classifier it receives",
    "protection": '"mask" (default), "ckks" or "mask,ckks": the protections this hospital accepts (`deploy '
    "join --accept-protection`); the study's own protection must be one of them",
    "dp-epsilon": "take part only under differential privacy with an ε at most this (optional)",
    "dp-delta": "with dp-epsilon: the largest δ accepted (optional; default 1e-6)",
    "dp-unit": '"image" or "patient" (with dp-epsilon): "patient" refuses a study protecting single '
    "images (optional)",
    "allow-class-gram": '"true" accepts a study that sums per-class Gram matrices (default "false"; '
    "SECURITY.md)",
    "device": '"auto" (default), "cpu" or "cuda": where the statistics are computed',
    "coordinator": '"active" (default) or "honest-but-curious": what this hospital assumes of the '
    "coordinator; a two-round study (its teacher is the coordinator's choice) needs the second "
    "(SECURITY.md §3.6)",
    "require-verified-classifier": '"when-offered" (default): store a classifier the check covers only '
    'once every survivor verified it against the sums; "true": also refuse studies it does not cover; '
    '"false": store every classifier on receipt (SECURITY.md §5.1)',
}

Say = Callable[[str], None]


class NodeCheckError(DeploymentError):
    """A hospital's node failed a check: names the hospital, the check and the run's own error."""

    def __init__(self, hospital: str, check: str, error: BaseException) -> None:
        self.hospital, self.check, self.error = hospital, check, error
        super().__init__(f"{hospital}: {check}: {type(error).__name__}: {_message(error)}")


def _message(error: BaseException) -> str:
    return str(getattr(error, "message", None) or error)  # click.ClickException keeps it in .message


def parse_node_config(text: str | None = None, file: Path | None = None) -> dict[str, Any]:
    """The node config as the SuperNode reads it (Flower's own parser): ``key="value" ...`` or a
    TOML file with the same keys."""
    from flwr.common.config import parse_config_args

    if (text is None) == (file is None):
        raise ConfigurationError("give exactly one of --node-config 'key=\"value\" ...' or --config FILE")
    if file is not None:
        if not file.is_file():
            raise ConfigurationError(f"{file}: no such node-config file")
        if file.suffix == ".toml":
            return dict(parse_config_args([str(file)]))
        text = file.read_text(encoding="utf-8")
    assert text is not None
    config = dict(parse_config_args([" ".join(text.split())]))
    if not config:
        raise ConfigurationError(
            'the node config is empty; it is written as \'identity-key="/path" roster="/path" ...\''
        )
    return config


def study_from_file(path: Path) -> Study:
    """The study in a Flower app directory (or its ``pyproject.toml``): what the coordinator runs."""
    import tomllib

    from .apps import study_from_run_config

    toml = path / "pyproject.toml" if path.is_dir() else path
    try:
        document = tomllib.loads(toml.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigurationError(f"{toml}: cannot read the study: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"{toml}: not TOML: {exc}") from None
    config = document.get("tool", {}).get("flwr", {}).get("app", {}).get("config")
    if not isinstance(config, dict):
        raise ConfigurationError(
            f"{toml} has no [tool.flwr.app.config] section: give the coordinator's app directory or its "
            "pyproject.toml"
        )
    return study_from_run_config(config)


def _hospital(config: Mapping[str, Any]) -> str:
    """Who this node is, as far as can be told without the passphrase (for error messages)."""
    from secure_afl.keys.roster import Roster

    from .client import key_owner

    key_path = Path(str(config.get("identity-key", "")))
    try:
        owner = key_owner(key_path, Roster.from_json(Path(str(config["roster"])).read_text(encoding="utf-8")))
        if owner is not None:
            return owner
    except Exception:
        pass
    try:
        return str(json.loads((key_path.parent / "identity.pub.json").read_text(encoding="utf-8"))["id"])
    except Exception:
        return f"the hospital of {key_path}" if str(key_path) not in ("", ".") else "this hospital"


@dataclass(frozen=True)
class CheckResult:
    client_id: str
    lines: tuple[str, ...]


def check_node(
    config: Mapping[str, Any],
    *,
    study: Study | None = None,
    superlink: str | None = None,
    root_certificates: Path | None = None,
    timeout: float = 10.0,
    say: Say = print,
    cosigned: bool = True,
) -> CheckResult:
    """Run every check in order, printing each that passes; raise :class:`NodeCheckError` at the
    first that fails.  ``cosigned=False`` (``deploy join`` while co-signatures are still being
    collected) checks the co-signatures the roster holds but lets missing ones pass, noting them."""
    from .client import NodeSettings, check_node_study, node_backend, node_identity, node_roster
    from .wire import Envelope

    hospital = _hospital(config)
    lines: list[str] = []

    def ok(text: str) -> None:
        lines.append(text)
        say(f"ok  {text}")

    def step(name: str, action: Callable[[], Any]) -> Any:
        try:
            return action()
        except Exception as exc:  # every failure is the run's own error, named by hospital
            raise NodeCheckError(hospital, name, exc) from exc

    settings = step("node config", lambda: NodeSettings.from_node_config(config))
    unknown = sorted(set(config) - set(NODE_CONFIG_KEYS))
    ok(f"node config: {', '.join(sorted(set(config) - set(unknown)))}")
    if unknown:  # Flower passes them on and secure-afl ignores them: a misspelt optional key?
        say(f"note: the node config's keys {unknown} mean nothing to secure-afl (misspelt?)")
    if cosigned:
        roster = step("roster", lambda: node_roster(settings))
        ok(f"roster {settings.roster}: {len(roster)} institutions, fingerprint {roster.fingerprint}, "
           "co-signed by every institution")  # fmt: skip
    else:
        from secure_afl.keys.cosign import roster_status

        status = step("roster", lambda: roster_status(settings.roster.read_text(encoding="utf-8")))
        roster = status.roster
        signed = list(status.signed) or "nobody yet"
        ok(f"roster {settings.roster}: {len(roster)} institutions, fingerprint {roster.fingerprint}; "
           f"co-signed by {signed}, not yet by {list(status.missing)}")  # fmt: skip
    client_id, identity = step("identity key", lambda: node_identity(settings, roster))
    hospital = client_id
    ok(f"identity key {settings.identity_key}: {client_id} ({identity.fingerprint}), in the roster")
    if study is None:
        from secure_afl.features.file import load_feature_file

        data = step("feature file", lambda: load_feature_file(settings.features, require_labels=True))
        ok(
            f"feature file {settings.features}: {len(data.features)} rows, {data.dim}-d, labels "
            f"{[data.classes[c] for c in data.active]}; backbone {data.backbone}, weights {data.weights_id} "
            "(no --study: not compared with the study)"
        )
    else:
        data = step("feature file against the study", lambda: check_node_study(study, settings))
        probe = Envelope("advertise", {"backend": study.protection})
        step("protection", lambda: node_backend(probe, study, settings, len(roster)))
        ok(
            f"feature file {settings.features}: {len(data.features)} rows, labels "
            f"{[data.classes[c] for c in data.active]}; matches the study (classes, {study.dim}-d, backbone "
            f"{study.backbone['name']}, weights id, preprocessing, policy, protection {study.protection})"
        )
    if study is not None:
        ok(step("classifier check", lambda: _classifier_check(study, roster, settings.require_verified)))
    state = step("ledger", lambda: _ledger_state(settings.ledger_dir, client_id, identity))
    ok(f"ledger {settings.ledger_dir}: {state}")
    if study is not None:
        found = step(
            "ledger against the study", lambda: _unreleased(settings, client_id, identity, study, data)
        )
        ok(f"ledger: {found}")
    step("out-dir", lambda: _writable(settings.out_dir, "out-dir"))
    ok(f"out-dir {settings.out_dir}: writable")
    if superlink is not None:
        ok(step("SuperLink", lambda: connect(superlink, root_certificates, timeout)))
    if study is not None:  # every check passed: the node takes part in this study only
        from .client import pin_study

        checked = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        path = step("checked study", lambda: pin_study(settings, study, checked))
        ok(f"recorded study {study.digest()} in {path}: this node takes part in this study only")
        from .audit import record_study_pinned

        log = step("audit log", lambda: record_study_pinned(settings, client_id, identity, study, checked))
        ok(f"audit log {log}: study-pinned recorded, signed by {client_id}")
    else:
        say("note: no --study: no study recorded; the node refuses every study until `deploy check --study`")
    return CheckResult(client_id, tuple(lines))


def _classifier_check(study: Study, roster: Any, require: str) -> str:
    """Whether every survivor will verify this study's classifier (SECURITY.md §5.1), and what this
    node does with it; a study the check does not cover is refused now where the node requires the
    check (its R0 would refuse it)."""
    from .verify import REQUIRE_KEY, coverage

    why = coverage(study, [entry.client_id for entry in roster], require)
    setting = f"{REQUIRE_KEY} = {require}"
    if why is not None:
        return f"classifier check: NOT offered: {why}; this node stores the classifier unverified ({setting})"
    stores = "stores it only once verified" if require != "false" else "stores it on receipt"
    return (
        f"classifier check: every survivor verifies this study's classifier; this node {stores} ({setting})"
    )


def _unreleased(settings: Any, client_id: str, identity: Any, study: Any, data: Any) -> str:
    """The run's one-contribution selection in R0, on what this node's ledger already holds
    (:func:`~secure_afl.privacy.release.select_rows`): a study whose every row would be withheld is
    refused with the session's own error (a study that extends another releases only the new
    images: nothing to refuse).  ``data``: the feature file the study check loaded.  Returns what the
    check found, for its line."""
    from secure_afl.privacy.ledger import FileLedger, LedgerOwner
    from secure_afl.privacy.release import select_rows

    names = data.require_image_identities()
    if study.extends:
        return f"a growing study: this node releases only its new ones of {len(names)} images"
    state = FileLedger(settings.ledger_dir).load(LedgerOwner(client_id, identity))
    selection = select_rows(names, state.released_images(b""))
    selection.require_some({sid: entry.scope for sid, entry in state.sessions.items()})
    withheld = "; ".join(line.split(":", 1)[0] for line in selection.log_lines(["-"] * len(names)))
    return f"{len(selection.kept)} of this feature file's {len(names)} images are new" + (
        f" ({withheld}: the session's log names them)" if withheld else ""
    )


def _ledger_state(directory: Path, client_id: str, identity: Any) -> str:
    from secure_afl.privacy.ledger import FileLedger, LedgerOwner

    _writable(directory, "ledger-dir")
    state = FileLedger(directory).load(LedgerOwner(client_id, identity))
    if not state.sessions:
        return "no earlier session (first use); can be written"
    return f"{len(state.sessions)} earlier session(s), signed by {client_id}, writable"


def _writable(directory: Path, key: str) -> None:
    """``directory`` is a writable directory, or can be created (its nearest existing parent is)."""
    existing = directory
    for _ in range(64):
        if existing.exists() or existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise ConfigurationError(f"the node config's {key} {directory}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = (
            "is not writable" if existing == directory else f"cannot be created ({existing} is not writable)"
        )
        raise ConfigurationError(f"the node config's {key} {directory} {what} by this user")


def connect(address: str, root_certificates: Path | None, timeout: float = 10.0) -> str:
    """Open a TCP connection to the SuperLink (and, with its CA, a TLS handshake); a line saying how."""
    from .superlink import DEFAULT_FLEET_PORT

    host, sep, port_text = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigurationError(
            f"--superlink {address!r}: expected HOST:PORT, e.g. superlink.example.org:{DEFAULT_FLEET_PORT}"
        )
    port = int(port_text)
    try:
        raw = socket.create_connection((host, port), timeout=timeout)
    except socket.gaierror as exc:
        raise ConfigurationError(
            f"{host}: cannot resolve the SuperLink's host name ({exc.strerror})"
        ) from None
    except ConnectionRefusedError:
        raise ConfigurationError(
            f"nothing listens on {host}:{port}: is the SuperLink running (the coordinator starts it with "
            "`secure-afl deploy superlink --listen ADDRESS:PORT`), on an address this hospital reaches, "
            f"and is this its port (the kits' default {DEFAULT_FLEET_PORT})?"
        ) from None
    except OSError as exc:
        raise ConfigurationError(
            f"cannot reach the SuperLink at {host}:{port}: {exc.strerror or exc}"
        ) from None
    with raw:
        if root_certificates is None:
            return f"SuperLink {host}:{port}: TCP connection accepted (no TLS checked: --insecure)"
        context = _tls_context(root_certificates)
        try:
            with context.wrap_socket(raw, server_hostname=host) as tls:
                certificate = tls.getpeercert() or {}
                version = tls.version()
        except ssl.SSLCertVerificationError as exc:
            raise ConfigurationError(
                f"the SuperLink's certificate at {host}:{port} does not verify against {root_certificates}: "
                f"{exc.verify_message}; it must be issued by that CA and name {host} among its subject "
                "alternative names (`secure-afl deploy tls --host NAME --ip ADDRESS` writes such a one)"
            ) from None
        except (ssl.SSLError, OSError) as exc:
            raise ConfigurationError(
                f"TLS handshake with the SuperLink at {host}:{port} failed: {exc} (is it started with "
                "--ssl-ca-certfile, --ssl-certfile and --ssl-keyfile?)"
            ) from None
    names = [value for kind, value in certificate.get("subjectAltName", ()) if kind in ("DNS", "IP Address")]
    return f"SuperLink {host}:{port}: {version} handshake, certificate for {names} issued by the CA"


def _tls_context(root_certificates: Path) -> ssl.SSLContext:
    try:
        context = ssl.create_default_context(cafile=str(root_certificates))
    except FileNotFoundError:
        raise ConfigurationError(f"{root_certificates}: no such CA certificate file") from None
    except ssl.SSLError as exc:
        raise ConfigurationError(f"{root_certificates}: not a PEM CA certificate ({exc})") from None
    return context
