"""Each party's audit log through the deployment: the nodes' sessions, refusals and releases (in
process, through ``handle``), and what ``deploy run`` records as the coordinator."""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from secure_afl.cli import main
from secure_afl.deploy.audit import node_audit_log
from secure_afl.deploy.errors import FederationAbortedError
from secure_afl.keys.auditlog import AuditRecord, read_log, verify_with

from .helpers import InProcessTransport, check_study, make_federation, row_digests, run_server
from .test_deploy_commands import _run, coordinator  # noqa: F401  (the fixture)


def _records(path: Path) -> list[AuditRecord]:
    records = read_log(path).records()
    assert all(r is not None for r in records)
    return records  # type: ignore[return-value]


def test_every_node_records_its_session_and_release_and_its_log_verifies(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=3, rows=30)
    server, _, _ = run_server(federation)
    session_id = server.report.sessions[0].session_id.hex()
    for node in federation.nodes.values():
        path = node_audit_log(node.settings)
        assert path == node.settings.ledger_dir / "audit.log"
        result = verify_with(path, roster_path=node.settings.roster)
        assert result.ok and result.parties == (node.client_id,), result.describe()
        records = _records(path)
        kinds = [r.kind for r in records]
        assert kinds == ["log-started", "roster-pinned", "session-accepted", "release"]
        accepted, release = records[2].body, records[3].body
        assert accepted["decision"] == "accepted" and accepted["session_id"] == session_id
        assert accepted["study"] == federation.study.digest()
        assert accepted["roster"] == federation.roster.fingerprint
        assert sorted(accepted["peers"]) == sorted(set(federation.roster.client_ids) - {node.client_id})
        # The release: counts and the digest of the images' sorted digests, as the ledger holds them.
        digests = sorted(bytes.fromhex(d) for d in row_digests(f"0/{node.client_id}", 30))
        assert release["session_id"] == session_id and release["study"] == federation.study.digest()
        assert release["images"] == 30 and release["round"] == "1"
        assert release["images_digest"] == hashlib.sha256(b"".join(digests)).hexdigest()
        assert sorted(release["survivors"]) == sorted(federation.roster.client_ids)
        # Never an image's digest itself, nor a feature value.
        text = path.read_text()
        assert not any(d.hex() in text for d in digests)
        features = federation.data[node.client_id][0]
        assert f"{float(features[0, 0]):.6f}"[:8] not in text


def test_a_refused_session_is_in_that_nodes_log_with_its_rule(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=3, rows=30)
    refusing, *others = sorted(federation.nodes)
    check_study(federation, nodes=others)  # the first node never checked (pinned) the study
    transport = InProcessTransport(federation)
    transport.pin = False
    with pytest.raises(FederationAbortedError):  # two of three institutions: below the threshold
        run_server(federation, transport)
    node = federation.nodes[refusing]
    path = node_audit_log(node.settings)
    assert verify_with(path, roster_path=node.settings.roster).ok
    (refused,) = [r for r in _records(path) if r.kind == "session-refused"]
    assert refused.party == node.client_id
    assert refused.body["decision"] == "refused" and refused.body["error"] == "UncheckedStudyError"
    assert refused.body["study"] == federation.study.digest() and refused.body["round"] == "R0"
    assert "checked no study" in refused.body["rule"]
    # What the coordinator received, word for word: the log reveals nothing more of the refusal.
    (sent,) = [e for n, _, e in transport.received if n == refusing and e.kind == "refused"]
    assert refused.body["rule"] == sent.meta["message"] and refused.body["error"] == sent.meta["error"]
    assert "release" not in [r.kind for r in _records(path)]
    # The others accepted, and released nothing (the session aborted before the release point).
    other = node_audit_log(federation.nodes[others[0]].settings)
    assert [r.kind for r in _records(other)][-1] == "session-accepted"


def test_a_ledger_reset_is_recorded_at_the_nodes_next_record(tmp_path: Path) -> None:
    from secure_afl.privacy.ledger import FileLedger

    federation = make_federation(tmp_path, n_clients=3, rows=30)
    node = federation.nodes[min(federation.nodes)]
    FileLedger(node.settings.ledger_dir).reset(node.client_id, "restored the machine")
    run_server(federation)
    records = _records(node_audit_log(node.settings))
    (reset,) = [r for r in records if r.kind == "ledger-reset"]
    assert reset.body["reason"] == "restored the machine" and reset.body["client_id"] == node.client_id
    assert [r.kind for r in records].index("ledger-reset") < [r.kind for r in records].index(
        "session-accepted"
    )


def test_audit_verify_exit_codes_and_the_edited_record_it_names(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=3, rows=30)
    run_server(federation)
    settings = federation.nodes[min(federation.nodes)].settings
    runner = CliRunner()

    def verify(*args: object) -> tuple[int, str]:
        result = runner.invoke(main, ["audit", "verify", *map(str, args)])
        return result.exit_code, result.output

    code, output = verify("--ledger-dir", settings.ledger_dir, "--roster", settings.roster)
    assert code == 0 and "valid: 4 record(s) by client-0" in output, output
    shown = runner.invoke(main, ["audit", "show", "--ledger-dir", str(settings.ledger_dir)])
    assert shown.exit_code == 0 and "session-accepted" in shown.output and "images=30" in shown.output

    path = node_audit_log(settings)
    lines = path.read_bytes().split(b"\n")
    lines[3] = lines[3].replace(b'"images":30', b'"images":29')  # the release, edited by hand
    path.write_bytes(b"\n".join(lines))
    code, output = verify("--log", path, "--roster", settings.roster)
    assert code == 1, output
    assert "INVALID at line 4 (record 3): its signature does not verify" in output

    assert verify("--log", path)[0] == 2  # no key to verify with
    assert verify("--log", path, "--ledger-dir", settings.ledger_dir, "--roster", settings.roster)[0] == 2
    code, output = verify("--log", path, "--roster", settings.roster, "--party", "coordinator")
    assert code == 1 and "not by the key(s) given" in output  # the coordinator's key: not the node's


def test_deploy_run_records_the_classifier_it_signs_and_the_run(coordinator: tuple[Path, Path]) -> None:  # noqa: F811
    app, home = coordinator
    code, output = _run(app, home, "ok")
    assert code == 0, output
    out = app.parent / "server"
    roster = app.parent / "fed" / "roster.json"
    result = verify_with(out / "audit.log", roster_path=roster)
    assert result.ok and result.parties == ("coordinator",), result.describe()
    records = _records(out / "audit.log")
    assert [r.kind for r in records] == [
        "log-started",
        "roster-pinned",
        "classifier-signed",
        "session-run",
        "run",
    ]
    signed = json.loads((out / "classifier.json").read_text())
    assert records[2].body["content_sha256"] == signed["content_sha256"]
    assert records[3].body["survivors"] == ["hospital-a", "hospital-b", "hospital-c"]
    assert records[4].body["ok"] is True and records[4].body["sessions"] == 1


def test_under_dp_a_release_records_the_epsilon_spent_and_left(tmp_path: Path) -> None:
    import dataclasses

    from secure_afl.privacy.dp_growth import NodeSpend
    from secure_afl.privacy.ledger import FileLedger, LedgerOwner

    from .test_deploy_dp import _private_federation

    federation = _private_federation(tmp_path, n_clients=4)
    for node in federation.nodes.values():
        node.settings = dataclasses.replace(node.settings, dp_epsilon=2.0)
    server, _, _ = run_server(federation)
    session_id = server.report.sessions[0].session_id.hex()
    for node in federation.nodes.values():
        (release,) = [r.body for r in _records(node_audit_log(node.settings)) if r.kind == "release"]
        owner = LedgerOwner(node.client_id, federation.identities[node.client_id])
        spend = NodeSpend.from_text(
            FileLedger(node.settings.ledger_dir).load(owner).sessions[session_id].spend
        )
        assert release["epsilon"] == spend.epsilon and release["unit"] == "image"
        assert 0 < release["epsilon_total"] <= 2.0 and release["epsilon_limit"] == 2.0
        assert release["epsilon_left"] == pytest.approx(2.0 - release["epsilon_total"])


def test_an_accepted_session_is_recorded_as_the_round_the_node_answered(tmp_path: Path) -> None:
    """The coordinator labels its advertisement as another round: the node's signed record says what
    the node answered (R0), not the coordinator's label."""
    from secure_afl.deploy.wire import Envelope

    def relabel(node: int, group: str, envelope: Envelope) -> Envelope:
        if envelope.kind != "advertise":
            return envelope
        return Envelope(envelope.kind, {**envelope.meta, "round": "R4"}, envelope.payload, envelope.arrays)

    federation = make_federation(tmp_path, n_clients=3, rows=30)
    run_server(federation, transport=InProcessTransport(federation, tamper=relabel))
    for node in federation.nodes.values():
        accepted = [r.body for r in _records(node_audit_log(node.settings)) if r.kind == "session-accepted"]
        assert [body["round"] for body in accepted] == ["R0"]


def test_a_label_writes_no_line_of_the_nodes_log_and_a_refusal_is_recorded_at_the_nodes_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The coordinator labels client-0's R1 message with a newline and an escape sequence (a forged log
    line), then sends it junk at R2 labelled R4: no line of the node's log begins with the forged text,
    no escape sequence is printed, and its signed refusal record says R2, the step the node was at (the
    label kept apart as the coordinator's)."""
    from secure_afl.deploy.server import FederationServer
    from secure_afl.deploy.wire import Envelope

    forged = "R1\nsecure-afl client: client-0: verified the classifier\x1b[2K"

    def relabel(node: int, group: str, envelope: Envelope) -> Envelope:
        if node != 1000 or group not in ("s1-R1", "s1-R2"):
            return envelope
        if group == "s1-R1":
            return Envelope(envelope.kind, {**envelope.meta, "round": forged}, envelope.payload)
        return Envelope(envelope.kind, {**envelope.meta, "round": "R4"}, b"not a protocol message")

    federation = make_federation(tmp_path, n_clients=4, rows=30)
    transport = InProcessTransport(federation, tamper=relabel)
    server = FederationServer(
        transport, federation.roster, federation.study, round_timeout=1, signer=federation.signer,
        colluders=0, log=lambda s: None,
    )  # fmt: skip
    capsys.readouterr()
    with contextlib.suppress(FederationAbortedError):  # whether the others finish is not the point
        server.run()
    printed = capsys.readouterr().err
    assert "answered" in printed and "REFUSED" in printed  # the node did print its lines
    assert "\x1b" not in printed
    assert not any(line.startswith("secure-afl client: client-0: verified") for line in printed.splitlines())
    node = federation.nodes[1000]
    (refused,) = [r.body for r in _records(node_audit_log(node.settings)) if r.kind == "session-refused"]
    assert refused["round"] == "R2" and refused["labelled"] == "R4", refused
