"""The coordinator's key stays in ``deploy run``'s own process: the ServerApp (a process the SuperLink
starts) writes the unsigned classifier record and asks for the signature, ``deploy run`` signs only
the record of this run's study and roster whose digest the ServerApp announced, and the ServerApp
sends only a file that verifies against the roster's coordinator.  In process, no Flower; the stand-in
``flwr`` of test_deploy_commands.py plays the ServerApp's side for the CLI."""

from __future__ import annotations

import dataclasses
import json
import stat
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from secure_afl.cli_deploy import deploy
from secure_afl.deploy.apps import await_signature, server_main
from secure_afl.deploy.classifier import ClassifierSigner, sign_classifier_file
from secure_afl.deploy.errors import (
    ClassifierFileError,
    ClassifierTamperedError,
    ConfigurationError,
    FederationAbortedError,
    RosterMismatchError,
)
from secure_afl.keys import IdentityKey

from .helpers import make_federation, run_server
from .test_deploy_commands import _run, _signing, coordinator  # noqa: F401  (the fixture)


def _made(tmp_path: Path):
    federation = make_federation(tmp_path / "fed", n_clients=3)
    server, classifier, _ = run_server(federation)
    return federation, server, classifier


def test_the_signed_file_is_the_record_with_the_coordinators_signature(tmp_path: Path) -> None:
    federation, server, classifier = _made(tmp_path)
    unsigned = classifier.to_json(None).encode()
    digest = json.loads(unsigned)["content_sha256"]
    signed = sign_classifier_file(
        unsigned, federation.signer, roster=federation.roster, study_digest=federation.study.digest(),
        content_sha256=digest,
    )  # fmt: skip
    assert signed == server.sign(classifier)  # byte for byte what signing in one place wrote
    kwargs = dict(roster=federation.roster, study_digest=federation.study.digest(), content_sha256=digest)
    with pytest.raises(ClassifierFileError, match="already signed"):
        sign_classifier_file(signed, federation.signer, **kwargs)
    with pytest.raises(ClassifierTamperedError, match=r"not the .* the ServerApp announced"):
        sign_classifier_file(unsigned, federation.signer, **{**kwargs, "content_sha256": "0" * 64})
    with pytest.raises(ClassifierFileError, match="this run's study is"):
        sign_classifier_file(unsigned, federation.signer, **{**kwargs, "study_digest": "1" * 64})
    other = dataclasses.replace(classifier, roster_fingerprint="SHA256:other").to_json(None).encode()
    with pytest.raises(RosterMismatchError, match="nothing was signed"):
        sign_classifier_file(
            other, federation.signer, **{**kwargs, "content_sha256": json.loads(other)["content_sha256"]}
        )


def test_the_serverapp_sends_only_a_file_that_verifies_for_its_record(tmp_path: Path) -> None:
    federation, server, classifier = _made(tmp_path)
    out = tmp_path / "server"
    out.mkdir()
    impostor = ClassifierSigner("coordinator", IdentityKey.generate())
    (out / "classifier.json").write_text(classifier.to_json(impostor))  # not the roster's coordinator
    with pytest.raises(FederationAbortedError, match=r"no signed classifier .* within 1 s"):
        await_signature(classifier, federation.roster, out, 1.0, poll=0.05)
    unsigned = out / "classifier.unsigned.json"
    assert unsigned.read_text() == classifier.to_json(None)
    assert stat.S_IMODE(unsigned.stat().st_mode) == 0o600

    # deploy run's part, a moment later: the roster coordinator's signature over this record.
    def sign() -> None:
        time.sleep(0.3)
        (out / "classifier.json").write_bytes(server.sign(classifier))

    thread = threading.Thread(target=sign)
    thread.start()
    try:
        data = await_signature(classifier, federation.roster, out, 20.0, poll=0.05)
    finally:
        thread.join()
    assert data == server.sign(classifier)


def test_the_serverapp_refuses_a_run_config_that_names_the_key(tmp_path: Path) -> None:
    for key in ("identity-key", "passphrase-file", "passphrase-env"):
        context = SimpleNamespace(
            run_config={"out-dir": str(tmp_path / "o"), key: "/x", "roster": "/nowhere"}
        )
        with pytest.raises(ConfigurationError, match="never given to the ServerApp"):
            server_main(None, context)


def test_deploy_run_refuses_to_sign_a_replaced_record(coordinator: tuple[Path, Path]) -> None:  # noqa: F811
    app, home = coordinator
    out = app.parent / "server"
    code, output = _run(app, home, "forged")
    assert code == 1, output
    assert "deploy run did not sign the classifier: ClassifierTamperedError" in output
    assert not (out / "classifier.json").exists()


def test_deploy_run_needs_the_key_and_refuses_an_app_that_names_it(
    coordinator: tuple[Path, Path],  # noqa: F811
) -> None:
    app, home = coordinator
    base = ["run", str(app), "--flwr-home", str(home)]
    nokey = app.parent / "no-key"
    nokey.mkdir()
    result = CliRunner().invoke(deploy, base, env={"FAKE_FLWR_SCENARIO": "ok", "SECURE_AFL_HOME": str(nokey)})
    assert result.exit_code == 2 and f"--key-dir: {nokey}: no identity.key here" in result.output
    key_only = _signing(app)[:2]
    result = CliRunner().invoke(deploy, [*base, *key_only], env={"FAKE_FLWR_SCENARIO": "ok"})
    assert result.exit_code == 2 and "exactly one of --passphrase-file and --passphrase-env" in result.output
    wrong = app.parent / "wrong-pass"
    wrong.write_text("not the passphrase at all\n")
    wrong.chmod(0o600)
    result = CliRunner().invoke(
        deploy, [*base, *key_only, "--passphrase-file", str(wrong)], env={"FAKE_FLWR_SCENARIO": "ok"}
    )
    assert (
        result.exit_code == 1
        and f"the coordinator's key {app.parent / 'coordinator' / 'identity.key'} (--key-dir):"
        in result.output
    )
    assert not (app.parent / "server" / "flwr-started").exists()  # nothing started
    toml = app / "pyproject.toml"
    toml.write_text(toml.read_text() + 'identity-key = "/keys/coordinator.key"\n')
    result = CliRunner().invoke(deploy, [*base, *_signing(app)], env={"FAKE_FLWR_SCENARIO": "ok"})
    assert result.exit_code == 1 and "names ['identity-key']" in result.output, result.output
    assert not (app.parent / "server" / "flwr-started").exists()


def test_the_passphrase_variable_is_not_passed_to_flwr_run(coordinator: tuple[Path, Path]) -> None:  # noqa: F811
    app, home = coordinator
    passphrase = (app.parent / "fed" / "pass").read_text().splitlines()[0]
    script = app.parent / "flwr"
    # The stand-in flwr records whether it sees the variable, then runs the ok scenario.
    script.write_text(
        script.read_text().replace(
            "scenario = os.environ", "Path(os.environ['FAKE_UNSIGNED'] + '.env').write_text("
            "str('COORD_PASS' in os.environ))\nscenario = os.environ", 1
        )
    )  # fmt: skip
    result = CliRunner().invoke(
        deploy,
        ["run", str(app), "--flwr-home", str(home), "--key-dir", str(app.parent / "coordinator"),
         "--passphrase-env", "COORD_PASS"],
        env={"FAKE_FLWR_SCENARIO": "ok", "COORD_PASS": passphrase},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert (app.parent / "unsigned.json.env").read_text() == "False"
