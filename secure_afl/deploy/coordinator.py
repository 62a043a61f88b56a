"""``secure-afl deploy run``: the coordinator's ``flwr run``, with an exit code that tells the truth.

``flwr run APP CONNECTION --stream`` exits 0 when the ServerApp fails (a session aborted below the
threshold, every client refused, a bad run config): only the stream and ``report.json`` say so.
:func:`run_federation` runs it, relays the ServerApp's progress lines (which name the hospitals),
prints the elapsed time while a round waits for answers, and decides from the report written by
this run (and the stream) whether the run succeeded.  Before it starts, any ``classifier.json`` and
``report.json`` already in the run's out-dir are renamed (``classifier.before-<UTC time>.json``),
so a stale classifier is never mistaken for the new one; when the ServerApp wrote no report, this
module writes one holding the error.  ``deploy local`` runs the same function.

It also signs: the coordinator's key is decrypted here (:func:`load_signer`), never in a process
the SuperLink starts.  When the ServerApp prints ``sign request <content digest>``, this module
signs its ``classifier.unsigned.json`` (only that digest, this run's roster and study) into
``classifier.json``, which the ServerApp verifies and sends.  Before ``flwr run`` starts it refuses
a FEDERATION that ``config.toml`` lacks and ``--run-config`` keys the app does not declare; after,
:func:`diagnose` tells flwr's own failures apart (a SuperLink down, or lost during the run).
"""

from __future__ import annotations

import datetime
import json
import os
import queue
import re
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from secure_afl.keys.roster import Roster

from .audit import record_run, record_signed
from .classifier import (
    LATEST_NAME,
    SIGN_REQUEST,
    UNSIGNED_NAME,
    ClassifierSigner,
    sign_classifier_file,
    write_classifier_file,
)
from .errors import ClassifierFileError, ConfigurationError, DeploymentError
from .processes import ProcessGroups, flower_bin, pump_lines

Say = Callable[[str], None]
SERVER_PREFIX = "secure-afl server:"
MOVED_NAMES = ("classifier.json", "report.json", "classifier.unsigned.json")


@dataclass
class RunOutcome:
    """What one ``flwr run`` produced, and whether it succeeded."""

    ok: bool
    out_dir: Path
    report_path: Path
    log_path: Path
    report: dict[str, Any] | None = None
    error: str | None = None
    exit_code: int | None = None
    moved: list[Path] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def classifier_path(self) -> Path:
        return self.out_dir / "classifier.json"


def read_run_config(app_dir: Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The app's ``[tool.flwr.app.config]`` with ``--run-config`` overrides (Flower's own parser)."""
    import tomllib
    from flwr.common.config import parse_config_args

    toml = app_dir / "pyproject.toml"
    try:
        document = tomllib.loads(toml.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigurationError(
            f"{toml}: cannot read the app's pyproject.toml ({exc.strerror}); give the app directory"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"{toml}: not TOML: {exc}") from None
    config = document.get("tool", {}).get("flwr", {}).get("app", {}).get("config")
    if not isinstance(config, dict):
        raise ConfigurationError(f"{toml} has no [tool.flwr.app.config] section (the study and out-dir)")
    merged = dict(config)
    for text in overrides:
        parsed = parse_config_args([text])
        unknown = sorted(set(parsed) - set(config))
        if unknown:  # Flower refuses them too, with "flwr run exited with code 1" and nothing else
            raise ConfigurationError(
                f"--run-config {text!r}: {unknown} {'is' if len(unknown) == 1 else 'are'} not a key of "
                f"{toml}'s [tool.flwr.app.config], and Flower refuses keys the app does not declare; "
                f"check the spelling (the app's keys: {', '.join(sorted(config))}) or write the key into "
                "the app (`secure-afl deploy app`)"
            )
        merged.update(parsed)
    if not isinstance(merged.get("out-dir"), str) or not merged["out-dir"]:
        raise ConfigurationError(f"{toml}: the run config lacks out-dir (where the ServerApp writes)")
    return merged


def load_signer(
    app_dir: Path,
    identity_key: Path,
    passphrase_file: Path | None,
    passphrase_env: str | None,
    run_config: Sequence[str] = (),
) -> ClassifierSigner:
    """The coordinator's signing identity, in ``deploy run``'s own process: its encrypted identity
    key, decrypted with the passphrase from a 0600 file or an environment variable of this process,
    which must be the coordinator of the roster the app's run config names."""

    from secure_afl.keys.files import KeyFileError, load_identity_key
    from secure_afl.keys.store import KeyStoreError, read_passphrase

    config = read_run_config(app_dir, run_config)
    roster = _read_roster(config)
    try:
        passphrase = read_passphrase(passphrase_file, passphrase_env)
    except KeyStoreError as exc:  # a missing file, open permissions, an unset variable
        raise ConfigurationError(f"the coordinator's passphrase: {exc.message}") from None
    try:
        key = load_identity_key(identity_key, passphrase)
    except KeyFileError as exc:
        raise ConfigurationError(f"the coordinator's key {identity_key} (--key-dir): {exc}") from None
    return ClassifierSigner.for_roster(roster, key)


def _read_roster(config: Mapping[str, Any]) -> Roster:
    path = Path(str(config.get("roster", ""))).expanduser()
    try:
        return Roster.from_json(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigurationError(f"the run config's roster {path}: cannot read it ({exc.strerror})") from None
    except ValueError as exc:
        raise ConfigurationError(f"the run config's roster {path}: {exc}") from None


def check_connection(env: Mapping[str, str], name: str) -> str:
    """``name`` is a SuperLink connection of ``$FLWR_HOME/config.toml``; return its address."""
    import tomllib

    home = Path(env.get("FLWR_HOME") or Path.home() / ".flwr")
    path = home / "config.toml"
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigurationError(
            f"{path}: cannot read Flower's connection file ({exc.strerror}); set --flwr-home (or export "
            "FLWR_HOME) to the directory holding config.toml"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"{path}: not TOML: {exc}") from None
    section = document.get("superlink", {})
    names = sorted(k for k, v in section.items() if isinstance(v, dict))
    if name not in names:
        raise ConfigurationError(
            f"no SuperLink connection named {name!r} in {path} (it names {names or 'none'}): give one of "
            f"those as FEDERATION, or add a [superlink.{name}] table with its address and root-certificates"
        )
    return str(section[name].get("address", "?"))


def move_aside(out_dir: Path, stamp: str | None = None) -> list[Path]:
    """Rename an earlier run's classifier and report in ``out_dir``; return the new names."""
    stamp = stamp or datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    moved = []
    for name in MOVED_NAMES:
        path = out_dir / name
        if path.is_file():
            target = path.with_name(f"{path.stem}.before-{stamp}{path.suffix}")
            os.replace(path, target)
            moved.append(target)
    return moved


def run_federation(
    app_dir: Path,
    connection: str,
    *,
    env: Mapping[str, str] | None = None,
    run_config: Sequence[str] = (),
    log_path: Path | None = None,
    children: ProcessGroups | None = None,
    run_timeout: float = 24 * 3600.0,
    tick: float = 10.0,
    say: Say = print,
    on_poll: Callable[[], None] | None = None,
    signer: ClassifierSigner | None = None,
    metrics: tuple[str, int] | None = None,
) -> RunOutcome:
    """Run ``flwr run APP CONNECTION --stream``; return whether the federation produced a classifier.

    ``on_poll`` is called about ten times a second while the run goes on (``deploy local`` kills
    nodes from it).  Every process started here is stopped before returning unless ``children`` (the
    caller's) is given.  ``metrics``: (host, port) where the coordinator's counters, which the
    ServerApp keeps in ``out-dir/metrics.json``, are served while the run goes on.
    """
    config = read_run_config(app_dir, run_config)
    # env: flwr run's whole environment (the caller's children carry their own)
    merged_env = dict(children.env if children is not None else os.environ if env is None else env)
    address = check_connection(merged_env, connection)
    signing = _Signing.of(config, signer)
    out_dir = Path(str(config["out-dir"])).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_path or out_dir / "flwr-run.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    report_path = out_dir / "report.json"
    moved = move_aside(out_dir)
    for path in moved:
        say(f"moved the earlier {path.name.split('.before-')[0]}.json aside: {path}")
    own = children is None
    endpoint = None
    if metrics is not None:
        from .metrics import METRICS_NAME, file_registry, serve

        endpoint = serve(file_registry(out_dir / METRICS_NAME, "coordinator"), *metrics)
        say(f"serving the coordinator's metrics on {endpoint.url}")
    # flwr run prints the ServerApp's lines with print(): unbuffered, each reaches us as it is written.
    children = children or ProcessGroups({**merged_env, "PYTHONUNBUFFERED": "1"})
    argv = [flower_bin("flwr"), "run", str(app_dir), connection, "--stream"]
    for text in run_config:
        argv += ["--run-config", text]
    started = time.perf_counter()
    outcome = RunOutcome(False, out_dir, report_path, log_path, moved=moved)
    failure: str | None = None
    progress = _Progress(say, tick)
    try:
        runner = children.start(
            "flwr run", argv, log_path, stdout=subprocess.PIPE, env={**children.env, "PYTHONUNBUFFERED": "1"}
        )
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(
            target=pump_lines, args=(runner.process.stdout, log_path, lines), daemon=True
        ).start()
        deadline = time.monotonic() + run_timeout
        done_reading = False
        for _ in range(int(run_timeout / 0.1) + 100):
            if on_poll is not None:
                on_poll()
            for _ in range(1000):
                try:
                    line = lines.get_nowait()
                except queue.Empty:
                    break
                if line is None:
                    done_reading = True
                    break
                failure = progress.line(line) or failure
                if progress.sign_request is not None:
                    request, progress.sign_request = progress.sign_request, None
                    try:
                        say(f"  {signing.sign(out_dir, request)}")
                    except DeploymentError as exc:
                        failure = f"deploy run did not sign the classifier: {type(exc).__name__}: {exc}"
            if failure is not None and failure.startswith("deploy run did not sign"):
                break  # the ServerApp waits in vain (sign-timeout); flwr run is stopped here
            if done_reading and runner.process.poll() is not None:
                break
            if time.monotonic() >= deadline:
                failure = f"the federation did not finish within {run_timeout:.0f} s (flwr run was stopped)"
                break
            progress.wait()
            time.sleep(0.1)
        outcome.exit_code = runner.process.poll()
    finally:
        if own:
            children.stop_all()
        if endpoint is not None:
            endpoint.close()
    outcome.seconds = time.perf_counter() - started
    cause = diagnose(progress.flower_lines, outcome.exit_code, started=progress.run_id, address=address,
                     connection=connection)  # fmt: skip
    outcome = _decide(outcome, failure, started_wall=time.time() - outcome.seconds, cause=cause)
    record_run(signing, outcome, say)  # the sessions and the outcome, in OUT_DIR/audit.log
    return outcome


@dataclass(frozen=True)
class _Signing:
    """What deploy run signs with: the coordinator's key, and the run's roster and study."""

    signer: ClassifierSigner
    roster: Roster
    study_digest: str

    @classmethod
    def of(cls, config: Mapping[str, Any], signer: ClassifierSigner | None) -> _Signing:
        from .apps import KEY_SETTINGS, study_from_run_config

        named = [key for key in KEY_SETTINGS if key in config]
        if named:
            raise ConfigurationError(
                f"the app's run config names {named}: Flower hands the run config to the ServerApp, a "
                "process the SuperLink starts, and the coordinator's key stays out of its reach; remove "
                "them from the app's [tool.flwr.app.config] and give deploy run --key-dir with "
                "--passphrase-env or --passphrase-file"
            )
        if signer is None:
            raise ConfigurationError(
                "deploy run signs the classifier with the roster's coordinator key: give --key-dir "
                "and --passphrase-env (or --passphrase-file)"
            )
        roster = _read_roster(config)
        ClassifierSigner.for_roster(roster, signer.key)  # the roster's coordinator, or refused now
        return cls(signer, roster, study_from_run_config(config).digest())

    def sign(self, out_dir: Path, content_sha256: str) -> str:
        """Sign ``out_dir/classifier.unsigned.json`` into ``out_dir/classifier.json``; say what."""
        unsigned = out_dir / UNSIGNED_NAME
        try:
            data = unsigned.read_bytes()
        except OSError as exc:
            raise ClassifierFileError(
                f"{unsigned}: cannot read the record to sign ({exc.strerror})"
            ) from None
        signed = sign_classifier_file(
            data,
            self.signer,
            roster=self.roster,
            study_digest=self.study_digest,
            content_sha256=content_sha256,
        )
        # Recorded in OUT_DIR/audit.log before the file is written (a failure here: nothing signed)
        record_signed(out_dir, self.signer, self.roster, self.study_digest, content_sha256)
        write_classifier_file(out_dir / LATEST_NAME, signed)
        return (
            f"signed the classifier {content_sha256[:16]}... as {self.signer.coordinator_id} "
            f"({self.signer.key.fingerprint}): {out_dir / LATEST_NAME}"
        )


# What flwr 1.42 prints (in a box, on stderr) for the failures it has words for, and what they mean here.
_SUPERLINK_UNAVAILABLE = "Connection to the SuperLink is unavailable"
_NO_CONNECTION = "not found in the Flower configuration file"
_INVALID_CONFIG = "Invalid run configuration"  # the SuperLink's answer to a key the app lacks (code 15)
_UNKNOWN_KEY = "is not present in the main dictionary"  # the same, raised where the config is fused
_AUTHENTICATION = "Authentication failed"
_BOX = re.compile(r"[\u2500-\u257f]")  # the box drawing characters of Rich's error panel


def diagnose(
    lines: Sequence[str], exit_code: int | None, *, started: str | None, address: str, connection: str
) -> str | None:
    """The cause of a failed ``flwr run``, from what it printed besides the ServerApp's lines.

    ``started``: the run id flwr printed ("Successfully started run N"), None if it never started.
    Returns None when nothing failed that ``flwr run`` itself reports (exit 0)."""
    text = " ".join(" ".join(_BOX.sub(" ", line).split()) for line in lines)
    where = f"the SuperLink {connection!r} at {address}"
    if _SUPERLINK_UNAVAILABLE in text:
        if started is not None:
            return (
                f"{where} stopped answering during run {started} (killed, restarted or unreachable): the "
                "run is lost; restart the SuperLink (`secure-afl deploy superlink` with the same "
                "--state-dir: its database keeps the nodes registered) and run again"
            )
        return (
            f"cannot reach {where}: is the SuperLink running (`secure-afl deploy superlink`, whose "
            "Control API is on 127.0.0.1 at its --control-port, default 9093) and is that address in "
            "config.toml its Control API's?"
        )
    if _NO_CONNECTION in text:
        return f"no SuperLink connection named {connection!r} in Flower's config.toml (FLWR_HOME)"
    if _UNKNOWN_KEY in text or _INVALID_CONFIG in text:
        key = re.search(r"Key '([^']*)' is not present", text)
        return (
            f"Flower refused the run config: {key.group(1) if key else 'a --run-config key'!r} is not a key "
            "of the app's [tool.flwr.app.config] (or its value has another type)"
        )
    if _AUTHENTICATION in text:
        return f"{where} refused this account (flwr: {_AUTHENTICATION})"
    if exit_code in (0, None):
        return None
    plain = [" ".join(_BOX.sub(" ", line).split()) for line in lines]
    errors = [line for line in plain if line and line != "Error" and not line.startswith(("INFO", "DEBUG"))]
    tail = " ".join(errors[-6:])
    return f"flwr run exited with code {exit_code}" + (f": {tail}" if tail else " and printed no error")


def _decide(
    outcome: RunOutcome, failure: str | None, *, started_wall: float, cause: str | None = None
) -> RunOutcome:
    """Success needs a report written by this run without an error, a classifier and exit 0."""
    report = None
    path = outcome.report_path
    if path.is_file() and path.stat().st_mtime >= started_wall - 1:
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            failure = failure or f"the ServerApp's report {path} is unreadable ({exc})"
    outcome.report = report if isinstance(report, dict) else None
    if outcome.report is not None and "error" in outcome.report:
        failure = f"the ServerApp failed: {outcome.report['error']}"
    elif outcome.exit_code not in (0, None) or (cause is not None and outcome.report is None):
        failure = failure or cause or f"flwr run exited with code {outcome.exit_code}"
    elif outcome.report is None:
        failure = failure or (
            f"the ServerApp wrote no report (flwr run exit {outcome.exit_code}): it failed before or "
            f"outside a session; its output is in {outcome.log_path}"
        )
    elif not outcome.classifier_path.is_file():
        failure = failure or f"the ServerApp wrote a report but no classifier in {outcome.out_dir}"
    if failure is None:
        outcome.ok = True
        return outcome
    outcome.error = failure
    if outcome.report is None or "error" not in outcome.report:
        # The ServerApp's own report, if any, with the error; else one that holds the error.
        document = {**(outcome.report or {}), "error": failure, "flwr_run_exit": outcome.exit_code}
        document["log"] = str(outcome.log_path)
        path.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
        outcome.report = document
    if outcome.classifier_path.is_file():  # written before the failure (e.g. delivery): not the result
        target = outcome.classifier_path.with_name("classifier.failed-run.json")
        os.replace(outcome.classifier_path, target)
    return outcome


class _Progress:
    """Relays the ServerApp's lines; while a round waits, says how long every ``tick`` seconds."""

    def __init__(self, say: Say, tick: float) -> None:
        self.say, self.tick = say, tick
        self.round: str | None = None
        self.round_started = 0.0
        self.last_output = time.monotonic()
        self.flower_lines: deque[str] = deque(maxlen=40)  # flwr's own lines: its errors, for diagnose
        self.run_id: str | None = None
        self.sign_request: str | None = None  # the content digest the ServerApp asks deploy run to sign

    def line(self, line: str) -> str | None:
        """Relay one line of the stream; return the failure it reports, if it reports one."""
        if SERVER_PREFIX not in line:
            self.flower_lines.append(line)
            started = re.search(r"Successfully started run (\d+)", line)
            if started:
                self.run_id = started.group(1)
                self.say(f"  flwr: started run {self.run_id}")
            return None
        text = line.split(SERVER_PREFIX, 1)[1].strip()
        self.say("  " + text)
        if text.startswith(SIGN_REQUEST + " "):
            self.sign_request = text.split()[2].rstrip(":")
        self.last_output = time.monotonic()
        if ": sent to " in text:  # "session 1 R2: sent to hospital-a, ...": a round starts
            self.round = text.split(":", 1)[0]
            self.round_started = self.last_output
        elif " answer(s) in " in text:
            self.round = None
        if text.startswith("FAILED: "):
            self.round = None
            return f"the ServerApp failed: {text.removeprefix('FAILED: ')}"
        return None

    def wait(self) -> None:
        now = time.monotonic()
        if self.tick > 0 and self.round is not None and now - self.last_output >= self.tick:
            self.say(f"  {self.round}: waiting for answers, {now - self.round_started:.0f} s")
            self.last_output = now
