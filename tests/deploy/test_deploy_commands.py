"""``secure-afl deploy check`` (a hospital's node, before the run) and ``secure-afl deploy run`` (the
coordinator's ``flwr run``, whose exit code must say when the ServerApp failed).

Fast: the checks run in process on a toy federation's files (tests/deploy/helpers.py); the SuperLink
is a loopback TLS listener on a free port; ``deploy run`` drives a stand-in ``flwr`` script that
streams what the ServerApp prints and exits 0 as ``flwr run`` does, whatever happened.  The real
Flower run (a dropout, round 2, an aborted session) is tests/deploy/test_deploy_local.py.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import ssl
import sys
import threading
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from secure_afl.cli_deploy import deploy
from secure_afl.deploy.check import NODE_CONFIG_KEYS
from secure_afl.deploy.processes import free_port
from secure_afl.deploy.writers import write_tls_certificates
from secure_afl.features.file import save_feature_file
from secure_afl.keys import Roster

from .helpers import CLASSES, Federation, make_federation, write_cosigned_roster


def _node_config(federation: Federation, node: int = 1000, **changes: str) -> str:
    settings = federation.nodes[node].settings
    config = {
        "identity-key": str(settings.identity_key),
        "passphrase-file": str(settings.passphrase_file),
        "roster": str(settings.roster),
        "features": str(settings.features),
        "ledger-dir": str(settings.ledger_dir),
        "out-dir": str(settings.out_dir),
        **changes,
    }
    return " ".join(f"{key}={json.dumps(value)}" for key, value in config.items())


def _study_app(directory: Path, **changes: object) -> Path:
    """A coordinator's app directory whose run config is the toy federation's study."""
    config: dict[str, object] = {
        "roster": "roster.json",
        "out-dir": str(directory / "server"),
        "classes": ",".join(CLASSES),
        "dim": 40,
        "backbone": "toy",
        "weights-id": "sha256:00",
        "preprocessing": "none",
        **changes,
    }
    directory.mkdir(parents=True, exist_ok=True)
    lines = ["[tool.flwr.app.config]", *(f"{key} = {json.dumps(value)}" for key, value in config.items())]
    (directory / "pyproject.toml").write_text("\n".join(lines) + "\n")
    return directory


def _check(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(deploy, ["check", *args])
    return result.exit_code, result.output


# --- deploy check ---------------------------------------------------------------------------------


def test_check_passes_a_good_node_and_names_every_check(tmp_path: Path) -> None:
    federation = make_federation(tmp_path / "fed")
    app = _study_app(tmp_path / "app")
    code, output = _check("--node-config", _node_config(federation), "--study", str(app))
    assert code == 0, output
    for check in ("node config", "roster", "identity key", "feature file", "ledger", "out-dir"):
        assert f"ok  {check}" in output
    assert "client-0 (" in output and "matches the study" in output
    assert "client-0: every check passed" in output
    assert "study-pinned recorded, signed by client-0" in output
    assert "ok  classifier check: every survivor verifies this study's classifier;" in output
    assert "stores it only once verified (require-verified-classifier = when-offered)" in output
    # The same keys from a file: a TOML file and a file of key="value" pairs.
    toml = tmp_path / "node.toml"
    toml.write_text(_node_config(federation).replace('" ', '"\n') + "\n")
    plain = tmp_path / "node.conf"
    plain.write_text(_node_config(federation) + "\n")
    for path in (toml, plain):
        code, output = _check("--config", str(path))
        assert code == 0 and "client-0: every check passed" in output, output
    # The check writes only the study it checked (with --study) and its audit record: no ledger file,
    # no out-dir.
    settings = federation.nodes[1000].settings
    assert sorted(p.name for p in settings.ledger_dir.iterdir()) == ["audit.log", "checked-study.json"]
    assert not settings.out_dir.exists()


def test_check_fails_with_the_runs_own_error_naming_the_hospital(tmp_path: Path) -> None:
    federation = make_federation(tmp_path / "fed")
    app = _study_app(tmp_path / "app")
    wrong = tmp_path / "wrong-passphrase"
    wrong.write_bytes(b"not the passphrase at all\n")
    wrong.chmod(0o600)
    code, output = _check("--node-config", _node_config(federation, **{"passphrase-file": str(wrong)}))
    assert code == 1
    assert "FAILED client-0: identity key: WrongPassphraseError:" in output  # named although locked
    # Open permissions on the passphrase file: the ClientApp's own message.
    wrong.chmod(0o644)
    code, output = _check("--node-config", _node_config(federation, **{"passphrase-file": str(wrong)}))
    assert code == 1 and "ConfigurationError" in output and "chmod 600" in output
    # A roster without this hospital's entry.
    roster = Roster.from_json((tmp_path / "fed" / "roster.json").read_text())
    others = tmp_path / "others.json"
    write_cosigned_roster(
        others, Roster([e for e in roster if e.client_id != "client-0"]), federation.identities
    )
    code, output = _check("--node-config", _node_config(federation, roster=str(others)))
    assert code == 1 and "identity key: IdentityNotInRosterError:" in output
    assert "client-0.key" in output and "is not in its roster" in output
    # A feature file of another backbone, against the study.
    features = tmp_path / "other-backbone.npz"
    rng = np.random.default_rng(1)
    save_feature_file(
        features, rng.random((10, 40)), labels=np.ones((10, 3), np.uint8), active=(0, 1, 2),
        classes=CLASSES, backbone="resnet50", weights_id="sha256:00", preprocessing="none",
    )  # fmt: skip
    config = _node_config(federation, features=str(features))
    assert _check("--node-config", config)[0] == 0  # without the study there is nothing to compare
    code, output = _check("--node-config", config, "--study", str(app))
    assert code == 1
    assert "FAILED client-0: feature file against the study: StudyMismatchError:" in output
    assert "backbone name is 'toy', this feature file's is 'resnet50'" in output
    # A study protected by CKKS, which this node did not agree to (its default is mask only).
    code, output = _check("--node-config", _node_config(federation), "--study", str(_study_app(
        tmp_path / "ckks-app", protection="ckks")))  # fmt: skip
    assert code == 1 and "protection: StudyMismatchError:" in output and 'protection="mask"' in output
    # A two-round study, which the classifier check does not cover: said, and refused where required.
    two_rounds = str(_study_app(tmp_path / "two-rounds", rounds=2))
    declared = {"coordinator": "honest-but-curious"}  # round 2 runs only where the node declared it
    code, output = _check("--node-config", _node_config(federation, **declared), "--study", two_rounds)
    assert code == 0 and "ok  classifier check: NOT offered: two-round studies are not checked" in output
    strict = _node_config(federation, **declared, **{"require-verified-classifier": "true"})
    code, output = _check("--node-config", strict, "--study", two_rounds)
    assert code == 1 and "classifier check: UnverifiedClassifierError:" in output
    assert 'require-verified-classifier="when-offered"' in output
    # Missing keys and a missing roster.
    code, output = _check("--node-config", 'identity-key="/nowhere"')
    assert code == 1 and "node config: ConfigurationError" in output and "passphrase-file" in output
    code, output = _check("--node-config", _node_config(federation, roster=str(tmp_path / "none.json")))
    assert code == 1 and "roster: ConfigurationError:" in output and "cannot read the roster" in output


def test_check_reads_the_passphrase_from_the_nodes_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    federation = make_federation(tmp_path / "fed")
    settings = federation.nodes[1000].settings
    assert settings.passphrase_file is not None
    passphrase = settings.passphrase_file.read_text().splitlines()[0]
    config = _node_config(federation, **{"passphrase-env": "NODE_PASSPHRASE"}).replace(
        f"passphrase-file={json.dumps(str(settings.passphrase_file))} ", ""
    )
    assert "passphrase-file" not in config
    monkeypatch.setenv("NODE_PASSPHRASE", passphrase)
    code, output = _check("--node-config", config)
    assert code == 0 and "client-0: every check passed" in output, output
    monkeypatch.setenv("NODE_PASSPHRASE", passphrase + "x")
    code, output = _check("--node-config", config)
    assert code == 1 and "identity key: WrongPassphraseError" in output
    monkeypatch.delenv("NODE_PASSPHRASE")
    code, output = _check("--node-config", config)
    assert code == 1 and "NODE_PASSPHRASE is not set" in output
    # Both sources, or neither: the node config is refused with what to keep.
    both = _node_config(federation, **{"passphrase-env": "NODE_PASSPHRASE"})
    code, output = _check("--node-config", both)
    assert code == 1 and "exactly one of passphrase-file" in output


def test_check_refuses_a_ledger_or_out_dir_it_cannot_write(tmp_path: Path) -> None:
    federation = make_federation(tmp_path / "fed")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code, output = _check("--node-config", _node_config(federation, **{"out-dir": str(blocker / "out")}))
    assert code == 1 and "out-dir: ConfigurationError:" in output and "is not a directory" in output
    code, output = _check("--node-config", _node_config(federation, **{"ledger-dir": str(blocker)}))
    assert code == 1 and "ledger: ConfigurationError:" in output and "is not a directory" in output


@contextmanager
def _tls_listener(cert: Path, key: Path) -> Iterator[int]:
    """A loopback TLS server on a free port that completes handshakes until closed."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        for _ in range(10_000):  # bounded: 0.2 s per idle turn
            if stop.is_set():
                return
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with closing(conn):
                conn.settimeout(5)
                try:
                    with context.wrap_socket(conn, server_side=True):
                        pass
                except (ssl.SSLError, OSError):
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()


def test_check_connects_to_the_superlink_with_tls(tmp_path: Path) -> None:
    federation = make_federation(tmp_path / "fed")
    config = _node_config(federation)
    ca, cert, key = write_tls_certificates(tmp_path / "tls")
    other_ca, _, _ = write_tls_certificates(tmp_path / "other")
    with _tls_listener(cert, key) as port:
        code, output = _check("--node-config", config, "--superlink", f"127.0.0.1:{port}",
                              "--root-certificates", str(ca))  # fmt: skip
        assert code == 0, output
        assert f"ok  SuperLink 127.0.0.1:{port}: TLSv1" in output and "127.0.0.1" in output
        code, output = _check("--node-config", config, "--superlink", f"127.0.0.1:{port}",
                              "--root-certificates", str(other_ca))  # fmt: skip
        assert code == 1 and "FAILED client-0: SuperLink: ConfigurationError:" in output
        assert "does not verify against" in output
        code, output = _check("--node-config", config, "--superlink", f"127.0.0.1:{port}", "--insecure")
        assert code == 0 and "TCP connection accepted" in output
    closed = free_port()
    code, output = _check("--node-config", config, "--superlink", f"127.0.0.1:{closed}", "--insecure")
    assert code == 1 and f"nothing listens on 127.0.0.1:{closed}" in output
    code, output = _check("--node-config", config, "--superlink", "127.0.0.1:1")
    assert code == 2 and "--root-certificates ca.crt (TLS) or --insecure" in output
    code, output = _check("--node-config", config, "--superlink", "no-port", "--insecure")
    assert code == 1 and "expected HOST:PORT" in output


def test_check_help_names_every_node_config_key() -> None:
    code, output = _check("--help")
    assert code == 0
    for key in NODE_CONFIG_KEYS:
        assert f"\n  {key} " in output, key
    assert set(NODE_CONFIG_KEYS) >= {"identity-key", "passphrase-file", "roster", "features", "ledger-dir",
                                     "out-dir", "protection", "dp-epsilon", "dp-delta", "dp-unit",
                                     "allow-class-gram", "device"}  # fmt: skip


# --- deploy run -----------------------------------------------------------------------------------

# What ``flwr run --stream`` prints of a ServerApp, and its exit code 0 whatever happened.
FAKE_FLWR = """\
import json, os, sys, time, tomllib
from pathlib import Path
args = sys.argv[1:]
assert args[:1] == ["run"] and "--stream" in args, args
config = tomllib.loads((Path(args[1]) / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
out = Path(config["out-dir"])
scenario = os.environ["FAKE_FLWR_SCENARIO"]
(out / "flwr-started").write_text(scenario)
def say(text):
    print("INFO :      secure-afl server: " + text, flush=True)
def box(text):  # flwr's error panel (Rich), on stderr, then exit 1: what flwr 1.42 prints
    width = 78
    words, lines, line = text.split(), [], ""
    for word in words:
        if len(line) + len(word) + 1 > width - 4:
            lines.append(line)
            line = word
        else:
            line = (line + " " + word).strip()
    lines.append(line)
    print("\u256d\u2500 Error " + "\u2500" * (width - 9) + "\u256e", file=sys.stderr)
    for line in lines:
        print("\u2502 " + line.ljust(width - 4) + " \u2502", file=sys.stderr)
    print("\u2570" + "\u2500" * (width - 2) + "\u256f", file=sys.stderr)
    sys.exit(1)
UNAVAILABLE = ("Connection to the SuperLink is unavailable. Please check your network connection and "
               "'address' in the SuperLink connection configuration.")
if scenario == "down":
    box(UNAVAILABLE)
if scenario == "live":  # a line, then wait (bounded) until the test has seen it
    print("INFO :      secure-afl server: session 1 R0: sent to 3 node(s)")  # no flush: PYTHONUNBUFFERED
    for _ in range(200):
        if (out / "go").exists():
            break
        time.sleep(0.05)
    print("INFO :      secure-afl server: FAILED: done waiting " + str((out / "go").exists()))
    sys.exit(0)
print("Successfully started run 77", flush=True)
say("session 1 R0: sent to 3 node(s)")
say("session 1 R0: 3 answer(s) in 0.1 s (hospital-a, hospital-b, hospital-c)")
say("session 1 R1: sent to hospital-a, hospital-b, hospital-c")
time.sleep(0.5)
if scenario == "abort":
    say("session 1 R1: hospital-c did not answer within 1 s (dropout)")
    error = "FederationAbortedError: session 1 aborted after R1: 2 clients remain, fewer than t=3"
    (out / "report.json").write_text(json.dumps({"sessions": [], "error": error}))
    say("FAILED: " + error)
elif scenario == "lost":  # the SuperLink was killed while the run waited for R1's answers
    box(UNAVAILABLE)
elif scenario == "crash":
    print("ERROR :     ServerApp raised an exception: KeyError: 'classes'", flush=True)
else:  # scenario "ok", or "forged" (the unsigned record is replaced before deploy run signs it)
    say("session 1 R1: 3 answer(s) in 0.5 s (hospital-a, hospital-b, hospital-c)")
    unsigned = Path(os.environ["FAKE_UNSIGNED"]).read_bytes()
    digest = json.loads(unsigned)["content_sha256"]
    if scenario == "forged":
        unsigned = Path(os.environ["FAKE_UNSIGNED"] + ".other").read_bytes()
    (out / "classifier.unsigned.json").write_bytes(unsigned)
    say(f"sign request {digest}: wrote {out / 'classifier.unsigned.json'}; waiting up to 10 s")
    for _ in range(200):
        if (out / "classifier.json").exists():
            break
        time.sleep(0.05)
    else:
        say("FAILED: FederationAbortedError: no signed classifier")
        sys.exit(0)
    say("classifier stored by ['hospital-a']")
    sessions = [{"label": "1", "participants": ["hospital-a", "hospital-b", "hospital-c"],
                 "survivors": ["hospital-a", "hospital-b", "hospital-c"]}]
    (out / "report.json").write_text(json.dumps({"sessions": sessions, "acknowledged": ["hospital-a"]}))
    say("wrote " + str(out / "report.json"))
sys.exit(0)
"""


@pytest.fixture
def coordinator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """An app directory, a FLWR_HOME, a stand-in flwr, and an earlier run's classifier in out-dir."""
    script = tmp_path / "flwr"
    script.write_text(f"#!{sys.executable}\n{FAKE_FLWR}")
    script.chmod(0o700)
    monkeypatch.setattr("secure_afl.deploy.coordinator.flower_bin", lambda name: str(script))
    out = tmp_path / "server"
    out.mkdir()
    (out / "classifier.json").write_text('{"earlier": true}')
    (out / "report.json").write_text('{"earlier": true}')
    federation = make_federation(tmp_path / "fed", n_clients=3)
    _coordinator_key(federation, tmp_path)  # tmp_path/coordinator/identity.key: deploy run signs with it
    app = _study_app(
        tmp_path / "app", **{"out-dir": str(out), "roster": str(tmp_path / "fed" / "roster.json")}
    )
    # What the ServerApp would write: this study's classifier, unsigned (and another one, forged).
    from secure_afl.deploy.check import study_from_file
    from secure_afl.deploy.classifier import Classifier

    unsigned = Classifier(
        weights=np.ones((40, 3)), classes=CLASSES, backbone={"name": "toy", "weights_id": "sha256:00",
        "preprocessing": "none"}, method={"gamma": 1.0}, protocol={"backend": "mask", "threshold": 3},
        sessions=({"label": "1", "session_id": "ab" * 32, "participants": [], "survivors": []},),
        roster_fingerprint=federation.roster.fingerprint, audit={},
        study_digest=study_from_file(app).digest(), created="2026-12-01T00:00:00+00:00",
    )  # fmt: skip
    (tmp_path / "unsigned.json").write_text(unsigned.to_json(None))
    forged = dataclasses.replace(unsigned, weights=np.zeros((40, 3)))
    (tmp_path / "unsigned.json.other").write_text(forged.to_json(None))
    monkeypatch.setenv("FAKE_UNSIGNED", str(tmp_path / "unsigned.json"))
    home = tmp_path / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "federation"\n\n'
        '[superlink.federation]\naddress = "127.0.0.1:9"\ninsecure = true\n'
    )
    return app, home


def _signing(app: Path) -> list[str]:
    """deploy run's key options: the toy federation's coordinator key (the coordinator fixture's)."""
    return ["--key-dir", str(app.parent / "coordinator"), "--passphrase-file",
            str(app.parent / "fed" / "pass")]  # fmt: skip


def _run(app: Path, home: Path, scenario: str) -> tuple[int, str]:
    result = CliRunner().invoke(
        deploy,
        ["run", str(app), "--flwr-home", str(home), "--tick", "0.2", *_signing(app)],
        env={"FAKE_FLWR_SCENARIO": scenario},
    )
    return result.exit_code, result.output


def test_run_exits_non_zero_when_the_session_aborts_and_leaves_no_classifier(
    coordinator: tuple[Path, Path],
) -> None:
    app, home = coordinator
    out = app.parent / "server"
    code, output = _run(app, home, "abort")
    assert code == 1, output
    assert (
        "the federation failed" in output and "FederationAbortedError: session 1 aborted after R1" in output
    )
    # Progress with hospital names, and the elapsed time while R1 waits.
    assert "session 1 R1: sent to hospital-a, hospital-b, hospital-c" in output
    assert "session 1 R1: waiting for answers," in output
    assert "hospital-c did not answer" in output
    # The earlier classifier was moved aside, not left beside the failing report.
    assert not (out / "classifier.json").exists()
    (earlier,) = out.glob("classifier.before-*.json")
    assert json.loads(earlier.read_text()) == {"earlier": True}
    assert "FederationAbortedError" in json.loads((out / "report.json").read_text())["error"]
    assert (out / "flwr-run.log").read_text().count("secure-afl server:") >= 4


def test_run_exits_non_zero_when_the_serverapp_writes_no_report(coordinator: tuple[Path, Path]) -> None:
    app, home = coordinator
    out = app.parent / "server"
    code, output = _run(app, home, "crash")
    assert code == 1, output
    assert "the ServerApp wrote no report (flwr run exit 0)" in output
    report = json.loads((out / "report.json").read_text())  # written by deploy run, with the error
    assert "wrote no report" in report["error"] and report["flwr_run_exit"] == 0
    assert not (out / "classifier.json").exists()


def test_run_exits_zero_with_a_new_classifier(coordinator: tuple[Path, Path]) -> None:
    app, home = coordinator
    out = app.parent / "server"
    code, output = _run(app, home, "ok")
    assert code == 0, output
    # deploy run signed the ServerApp's record: the roster's coordinator's signature over its content.
    from secure_afl.deploy.classifier import Classifier

    roster = Roster.from_json((app.parent / "fed" / "roster.json").read_text())
    signed = Classifier.load(out / "classifier.json", roster=roster)
    assert signed.signer == "coordinator"
    assert signed.to_json(None) == (out / "classifier.unsigned.json").read_text()  # the record, signed
    assert "signed the classifier" in output and "as coordinator (" in output
    assert "session 1: participants ['hospital-a', 'hospital-b', 'hospital-c']" in output
    assert f"wrote {out / 'classifier.json'}" in output
    assert len(list(out.glob("classifier.before-*.json"))) == 1


def test_run_says_the_superlink_is_down_or_was_lost_during_the_run(coordinator: tuple[Path, Path]) -> None:
    app, home = coordinator
    code, down = _run(app, home, "down")
    assert code == 1 and "cannot reach the SuperLink 'federation' at 127.0.0.1:9" in down, down
    assert "is the SuperLink running" in down
    code, lost = _run(app, home, "lost")
    assert code == 1 and "flwr: started run 77" in lost, lost
    assert "the SuperLink 'federation' at 127.0.0.1:9 stopped answering during run 77" in lost
    assert "cannot reach" not in lost and "stopped answering" not in down
    # Neither is the "exited with code 1" that said nothing.
    assert "exited with code" not in down + lost


def test_run_refuses_a_federation_name_or_a_run_config_key_flower_would_refuse(
    coordinator: tuple[Path, Path],
) -> None:
    app, home = coordinator
    out = app.parent / "server"
    result = CliRunner().invoke(deploy, ["run", str(app), "--federation", "nosuch", "--flwr-home", str(home),
                                         *_signing(app)], env={"FAKE_FLWR_SCENARIO": "ok"})  # fmt: skip
    assert result.exit_code == 1
    assert "no SuperLink connection named 'nosuch'" in result.output and "['federation']" in result.output
    result = CliRunner().invoke(
        deploy,
        ["run", str(app), "--flwr-home", str(home), "--run-config", "gama=2", *_signing(app)],
        env={"FAKE_FLWR_SCENARIO": "ok"},
    )
    assert result.exit_code == 1
    assert "['gama'] is not a key of" in result.output and "classes, dim" in result.output
    assert not (out / "flwr-started").exists()  # refused before flwr run started: nothing moved aside
    assert (out / "classifier.json").read_text() == '{"earlier": true}'


@pytest.mark.parametrize(
    ("printed", "cause"),
    [
        ("An unexpected error occurred while reading the Flower configuration file (/h/config.toml). "
         "SuperLink connection 'nosuch' not found in the Flower configuration file (/h/config.toml).",
         "no SuperLink connection named 'fed'"),
        ("Key 'gama' is not present in the main dictionary", "'gama' is not a key of the app's"),
        ("[code: 15] Invalid run configuration.", "Flower refused the run config: 'a --run-config key'"),
        ("something flwr has no words for", "flwr run exited with code 1: something flwr has no words for"),
    ],
)  # fmt: skip
def test_flowers_own_errors_are_told_apart(printed: str, cause: str) -> None:
    """What flwr 1.42 prints for the failures deploy run checks before starting it, wrapped in its
    panel as it prints them: the stream's diagnosis names them too (a config.toml changed meanwhile).
    The texts are flwr's own, captured from a real SuperLink on 2026-12-02 (the unknown run-config
    key: "[code: 15] Invalid run configuration."; a SuperLink killed after "Successfully started run
    N": the same unavailable panel as one that is down, which the fake flwr above prints)."""
    import textwrap

    from secure_afl.deploy.coordinator import diagnose

    wrapped = [f"\u2502 {line.ljust(70)} \u2502" for line in textwrap.wrap(printed, 70)]
    lines = ["\u256d\u2500 Error \u2500\u256e", *wrapped, "\u2570\u2500\u256f"]
    assert cause in str(diagnose(lines, 1, started=None, address="a:1", connection="fed"))
    assert diagnose(["INFO : fine"], 0, started="5", address="a:1", connection="fed") is None


def test_run_progress_is_live(coordinator: tuple[Path, Path]) -> None:
    """A line of the stream reaches deploy run's own stdout (a pipe) while flwr run still runs."""
    import os
    import subprocess
    import time

    app, home = coordinator
    out = app.parent / "server"
    script = Path(str(app.parent / "flwr"))
    code = (
        "import sys, secure_afl.deploy.coordinator as c; "
        f"c.flower_bin = lambda name: {str(script)!r}; "
        "from secure_afl.cli_deploy import deploy; "
        "sys.exit(deploy.main(sys.argv[1:], standalone_mode=True))"
    )
    env = {**os.environ, "FAKE_FLWR_SCENARIO": "live"}
    env.pop("PYTHONUNBUFFERED", None)
    process = subprocess.Popen(
        [sys.executable, "-c", code, "run", str(app), "--flwr-home", str(home), "--tick", "0",
         *_signing(app)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        seen = []
        deadline = time.monotonic() + 300  # a bound for a stuck run; a loaded host is only slow
        for _ in range(200):
            line = process.stdout.readline().decode()
            seen.append(line)
            if "session 1 R0: sent to 3 node(s)" in line or not line or time.monotonic() > deadline:
                break
        assert "session 1 R0: sent to 3 node(s)" in seen[-1], seen
        assert process.poll() is None  # still running: the line came before the end
        (out / "go").write_text("")
        rest = process.communicate(timeout=60)[0].decode()
        assert "FAILED: done waiting True" in rest  # flwr run only finished after the test saw the line
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)
            process.wait(timeout=10)


def test_run_needs_the_flower_connection_file(coordinator: tuple[Path, Path], tmp_path: Path) -> None:
    app, _ = coordinator
    code, output = _run(app, tmp_path / "nowhere", "ok")
    assert code == 2 and "config.toml does not exist" in output and "FLWR_HOME" in output


# --- deploy app / deploy node-key -------------------------------------------------------------------


def _coordinator_key(federation: Federation, directory: Path) -> Path:
    """The toy federation's coordinator key, saved as `keys init --id coordinator` would."""
    from secure_afl.keys import save_identity_key

    from .helpers import PASSPHRASE

    assert federation.signer is not None
    path = directory / "coordinator" / "identity.key"
    path.parent.mkdir(mode=0o700)
    save_identity_key(path, federation.signer.key, PASSPHRASE, scrypt_n=2**10)
    return path


def test_app_writes_a_run_config_the_serverapp_accepts(tmp_path: Path) -> None:
    import tomllib

    from secure_afl.deploy.apps import study_from_run_config

    federation = make_federation(tmp_path / "fed")
    key = _coordinator_key(federation, tmp_path)
    settings = federation.nodes[1000].settings
    ca, _, _ = write_tls_certificates(tmp_path / "tls")
    args = [
        "app", "--out", str(tmp_path / "app"), "--roster", str(tmp_path / "fed" / "roster.json"),
        "--key-dir", str(key.parent), "--passphrase-file", str(settings.passphrase_file),
        "--out-dir", str(tmp_path / "server"), "--features", str(settings.features), "--rounds", "2",
        "--set", "min-nodes=3", "--superlink", "10.0.0.5:9092", "--root-certificates", str(ca),
        "--flwr-home", str(tmp_path / "flwr"),
    ]  # fmt: skip
    result = CliRunner().invoke(deploy, args)
    assert result.exit_code == 0, result.output
    config = tomllib.loads((tmp_path / "app" / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    study = study_from_run_config(config)
    assert study.backbone == federation.study.backbone and study.dim == 40 and study.method.rounds == 2
    assert config["min-nodes"] == 3 and Path(config["roster"]).is_absolute()
    # The coordinator's key was checked but is not in the run config (the ServerApp's): deploy run
    # signs, and the next step says how.
    assert not set(config) & {"identity-key", "passphrase-file", "passphrase-env"}
    assert (
        f"--federation federation --flwr-home {(tmp_path / 'flwr').resolve()} --key-dir "
        f"{key.parent.resolve()} --passphrase-file {settings.passphrase_file.resolve()}" in result.output
    )
    from secure_afl.deploy.coordinator import load_signer

    signer = load_signer(tmp_path / "app", key, settings.passphrase_file, None)
    assert signer.coordinator_id == "coordinator"
    connection = tomllib.loads((tmp_path / "flwr" / "config.toml").read_text())
    federation_entry = connection["superlink"]["federation"]
    assert federation_entry == {"address": "10.0.0.5:9092", "root-certificates": str(ca.resolve())}
    # Written once: a second run without --force is refused and changes nothing.
    before = (tmp_path / "app" / "pyproject.toml").read_bytes()
    again = CliRunner().invoke(deploy, [*args[:-6], "--rounds", "1"])
    assert again.exit_code == 1 and "exists" in again.output
    assert (tmp_path / "app" / "pyproject.toml").read_bytes() == before


def test_app_refuses_a_key_the_roster_does_not_name_and_a_wrong_passphrase(tmp_path: Path) -> None:
    from secure_afl.keys import IdentityKey, save_identity_key

    federation = make_federation(tmp_path / "fed")
    settings = federation.nodes[1000].settings
    base = [
        "app", "--out", str(tmp_path / "app"), "--roster", str(tmp_path / "fed" / "roster.json"),
        "--out-dir", str(tmp_path / "server"), "--features", str(settings.features),
    ]  # fmt: skip
    # A hospital's key in place of the coordinator's: the ServerApp would refuse it before any session.
    hospital = tmp_path / "hospital"
    hospital.mkdir()
    (hospital / "identity.key").write_bytes(settings.identity_key.read_bytes())
    (hospital / "identity.key").chmod(0o600)
    result = CliRunner().invoke(deploy, [*base, "--key-dir", str(hospital),
                                         "--passphrase-file", str(settings.passphrase_file)])  # fmt: skip
    assert result.exit_code == 1 and "ConfigurationError" in result.output and "coordinator" in result.output
    other = tmp_path / "other" / "identity.key"
    other.parent.mkdir()
    save_identity_key(other, IdentityKey.generate(), b"test passphrase", scrypt_n=2**10)
    wrong = tmp_path / "wrong"
    wrong.write_text("not the passphrase\n")
    wrong.chmod(0o600)
    coordinator_keys = _coordinator_key(federation, tmp_path).parent
    result = CliRunner().invoke(deploy, [*base, "--key-dir", str(coordinator_keys),
                                         "--passphrase-file", str(wrong)])  # fmt: skip
    assert result.exit_code == 1 and "passphrase" in result.output
    assert f"the coordinator's key {coordinator_keys / 'identity.key'} (--key-dir):" in result.output
    assert not (tmp_path / "app").exists()
    bad_set = ["--key-dir", str(other.parent), "--passphrase-file", str(settings.passphrase_file)]
    result = CliRunner().invoke(deploy, [*base, *bad_set, "--set", "no-equals-sign"])
    assert result.exit_code == 2 and "expected KEY=VALUE" in result.output


def test_node_key_writes_an_openssh_pair_once(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

    path = tmp_path / "node" / "supernode-auth"
    result = CliRunner().invoke(deploy, ["node-key", str(path)])
    assert result.exit_code == 0, result.output
    assert path.stat().st_mode & 0o777 == 0o600
    private = load_ssh_private_key(path.read_bytes(), password=None)
    public = load_ssh_public_key(path.with_name("supernode-auth.pub").read_bytes())
    assert isinstance(private, ec.EllipticCurvePrivateKey) and private.public_key() == public
    again = CliRunner().invoke(deploy, ["node-key", str(path)])
    assert again.exit_code == 1 and "already exist" in again.output
    assert (
        load_ssh_private_key(path.read_bytes(), password=None).private_numbers() == private.private_numbers()
    )
    assert CliRunner().invoke(deploy, ["node-key", str(path), "--force"]).exit_code == 0
    assert (
        load_ssh_private_key(path.read_bytes(), password=None).private_numbers() != private.private_numbers()
    )
