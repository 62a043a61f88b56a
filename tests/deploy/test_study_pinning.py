"""Study pinning: ``deploy check --study`` records the digest of the study it checked (ledger-dir,
0600), the node takes part in that study only, and ``check`` reports a ledger refusal (values
already released) as the run's R0 does.  In process: the CLI's check, then the deployment's server
and clients over tests/deploy/helpers.py."""

from __future__ import annotations

import dataclasses
import json
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from secure_afl.cli_deploy import deploy
from secure_afl.deploy.check import study_from_file
from secure_afl.deploy.client import CHECKED_STUDY
from secure_afl.deploy.errors import FederationAbortedError
from secure_afl.deploy.study import Method

from .helpers import Federation, make_federation, run_server
from .test_deploy_commands import _node_config, _study_app


def _check_all(federation: Federation, app: Path) -> list[str]:
    outputs = []
    for node_id in federation.nodes:
        result = CliRunner().invoke(
            deploy, ["check", "--node-config", _node_config(federation, node_id), "--study", str(app)]
        )
        assert result.exit_code == 0, result.output
        outputs.append(result.output)
    return outputs


def test_check_records_the_study_it_checked_and_the_node_takes_part_in_it(tmp_path: Path) -> None:
    federation = make_federation(tmp_path / "fed", n_clients=3)
    app = _study_app(tmp_path / "app")
    study = study_from_file(app)
    assert study.digest() == federation.study.digest()  # the coordinator's app is the run's study
    outputs = _check_all(federation, app)
    for node, output in zip(federation.nodes.values(), outputs, strict=True):
        path = node.settings.ledger_dir / CHECKED_STUDY
        assert f"recorded study {study.digest()} in {path}" in output
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert json.loads(path.read_text())["study_digest"] == study.digest()
    server, _, _ = run_server(federation)
    assert server.report.refusals == [] and len(server.report.acknowledged) == 3


@pytest.mark.parametrize(
    "change", [{"gamma": 1000.0}, {"rounds": 2}, {"threshold": 2}], ids=["gamma", "rounds", "threshold"]
)
def test_a_study_changed_after_the_check_is_refused_by_every_node(tmp_path: Path, change: dict) -> None:
    federation = make_federation(tmp_path / "fed", n_clients=3)
    checked = study_from_file(_study_app(tmp_path / "app"))
    _check_all(federation, tmp_path / "app")
    if "threshold" in change:
        federation.study = dataclasses.replace(federation.study, threshold=change["threshold"])
    else:
        federation.study = dataclasses.replace(
            federation.study, method=dataclasses.replace(Method(), **change)
        )
    assert federation.study.digest() != checked.digest()
    with pytest.raises(FederationAbortedError, match="aborted after R0"):
        run_server(federation)


def test_the_refusal_names_both_digests_and_says_to_check_again(tmp_path: Path) -> None:
    federation = make_federation(tmp_path / "fed", n_clients=3)
    checked = study_from_file(_study_app(tmp_path / "app"))
    _check_all(federation, tmp_path / "app")
    federation.study = dataclasses.replace(federation.study, method=Method(gamma=1000.0))
    server = _aborted(federation)
    assert [r["error"] for r in server.report.refusals] == ["UncheckedStudyError"] * 3
    message = server.report.refusals[0]["message"]
    assert federation.study.digest() in message and checked.digest() in message
    assert "deploy check --study" in message
    assert all(not (n.settings.ledger_dir / "client-0.json").exists() for n in federation.nodes.values())


def test_a_node_that_checked_no_study_refuses_every_study(tmp_path: Path) -> None:
    federation = make_federation(tmp_path / "fed", n_clients=3)
    # Checks without --study record nothing.
    for node_id in federation.nodes:
        result = CliRunner().invoke(deploy, ["check", "--node-config", _node_config(federation, node_id)])
        assert result.exit_code == 0 and "no study recorded" in result.output, result.output
    server = _aborted(federation, pin=False)
    assert [r["error"] for r in server.report.refusals] == ["UncheckedStudyError"] * 3
    assert "has checked no study" in server.report.refusals[0]["message"]


def test_check_reports_values_already_released_as_the_run_refuses_them(tmp_path: Path) -> None:
    federation = make_federation(tmp_path / "fed", n_clients=3)
    app = _study_app(tmp_path / "app")
    _check_all(federation, app)
    run_server(federation)  # every node released its round-1 values in this run
    result = CliRunner().invoke(
        deploy, ["check", "--node-config", _node_config(federation), "--study", str(app)]
    )
    assert result.exit_code == 1, result.output
    assert "FAILED client-0: ledger against the study: ImageAlreadyReleasedError:" in result.output
    assert "each image enters at most one released aggregate" in result.output
    # The run refuses the same way, in R0 (a second study over the same features: other γ).
    federation.study = dataclasses.replace(federation.study, method=Method(gamma=2.0))
    from .helpers import DictState, check_study

    check_study(federation, nodes=list(federation.nodes))  # as if the hospitals had checked it
    for node in federation.nodes.values():
        node.state = DictState()  # a new Flower run: its context state is fresh
    server = _aborted(federation, pin=False)
    assert [r["error"] for r in server.report.refusals] == ["ImageAlreadyReleasedError"] * 3
    session = server.report.refusals[0]["message"].split("in session ")[1][:16]
    assert f"in session {session}" in result.output  # the same earlier session named by both


def _aborted(federation: Federation, *, pin: bool = True):
    """Run the server expecting R0 to abort; return it (its report holds the refusals)."""
    from secure_afl.deploy.server import FederationServer

    from .helpers import InProcessTransport

    transport = InProcessTransport(federation)
    if not pin:
        transport.pin = False
    server = FederationServer(
        transport, federation.roster, federation.study, round_timeout=1, log=lambda s: None,
        signer=federation.signer, colluders=0,
    )  # fmt: skip
    with pytest.raises(FederationAbortedError, match="aborted after R0"):
        server.run()
    return server


def test_a_session_that_runs_another_threshold_than_the_checked_study_is_refused(tmp_path: Path) -> None:
    """Another way round the pin: the checked study in the message, another threshold in the session
    (still above every client's floor) — refused, the session runs the study it names or none."""
    from secure_afl.aggregation.backend import MaskingBackend
    from secure_afl.deploy.server import FederationServer

    from .helpers import InProcessTransport

    federation = make_federation(tmp_path / "fed", n_clients=4)
    federation.study = dataclasses.replace(federation.study, threshold=4)  # checked: all four needed
    server = FederationServer(
        InProcessTransport(federation), federation.roster, federation.study, round_timeout=1,
        log=lambda s: None, signer=federation.signer, colluders=0, backend=MaskingBackend(threshold=3),
    )  # fmt: skip
    with pytest.raises(FederationAbortedError, match="aborted after R0"):
        server.run()
    assert {r["error"] for r in server.report.refusals} == {"StudyMismatchError"}
    assert "threshold t = 3 differs from the study's t = 4" in server.report.refusals[0]["message"]
