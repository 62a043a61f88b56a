"""Prometheus metrics (secure_afl/deploy/metrics.py): a real endpoint scraped while an in-process
federation runs and after, against the run's report; the counters a node's ClientApp keeps in its
ledger-dir; ``deploy status`` and ``deploy node-metrics --textfile``."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

import pytest
from click.testing import CliRunner

from secure_afl.cli import main
from secure_afl.deploy.errors import ConfigurationError, FederationAbortedError
from secure_afl.deploy.metrics import (
    METRICS_NAME,
    Metrics,
    file_registry,
    mismatches,
    parse,
    parse_address,
    record_node_message,
    registry_of,
    scrape,
    serve,
    value,
)
from secure_afl.deploy.processes import free_port
from secure_afl.deploy.study import Method, Study, StudyDp
from secure_afl.deploy.wire import Envelope

from .helpers import DictState, InProcessTransport, check_study, make_federation, run_server


class ScrapingTransport(InProcessTransport):
    """Scrapes ``url`` as round ``at`` is sent (the federation is running)."""

    def __init__(self, federation, url: str, at: str) -> None:
        super().__init__(federation)
        self.url, self.at = url, at
        self.during: dict | None = None

    def exchange(self, outgoing: Mapping[int, Envelope], group: str, timeout: float) -> dict[int, Envelope]:
        if group == self.at:
            self.during = scrape(self.url)
        return super().exchange(outgoing, group, timeout)


def test_an_endpoint_scraped_during_and_after_a_federation_matches_its_report(tmp_path: Path) -> None:
    federation = make_federation(tmp_path)
    federation.nodes[1003].dead_from = "s1-R2"  # client-3 drops out: a dropout in the report
    metrics = Metrics(tmp_path / "server" / METRICS_NAME)
    endpoint = serve(registry_of(lambda: metrics.state), "127.0.0.1", free_port())
    try:
        transport = ScrapingTransport(federation, endpoint.url, "s1-R3")
        server, _, _ = run_server(federation, transport, metrics=metrics)
        after = scrape(endpoint.url)
    finally:
        endpoint.close()
    assert endpoint.host == "127.0.0.1"
    during = transport.during
    assert during is not None  # scraped mid-session: started, not finished
    assert value(during, "secure_afl_sessions_started_total") == 1
    assert value(during, "secure_afl_sessions_finished_total") == 0
    assert value(during, "secure_afl_rounds_total") == 3  # R0, R1, R2
    report = server.report.to_dict()
    assert mismatches(after, [report]) == []
    assert value(after, "secure_afl_sessions_finished_total") == 1
    assert value(after, "secure_afl_dropouts_total") == len(report["dropouts"]) == 1
    assert value(after, "secure_afl_classifiers_total") == 1
    assert value(after, "secure_afl_round_seconds_sum") == pytest.approx(
        sum(report["sessions"][0]["round_seconds"].values())
    )
    assert ("secure_afl_last_success_timestamp_seconds", ()) in after
    # The file the ServerApp keeps holds the same counters (what deploy run --metrics serves).
    assert mismatches(parse_file(tmp_path / "server" / METRICS_NAME), [report]) == []


def parse_file(path: Path) -> dict:
    from secure_afl.deploy.metrics import samples_of

    return samples_of(file_registry(path, "coordinator"))


def test_refusals_by_rule_and_an_aborted_session_are_counted_and_carry_across_runs(tmp_path: Path) -> None:
    from secure_afl.deploy.server import FederationServer

    federation = make_federation(tmp_path)
    path = tmp_path / "server" / METRICS_NAME
    run_server(federation, metrics=Metrics(path))
    before = parse_file(path)
    # Two of the four checked another study: they refuse in R0 and the session aborts below t = 3.
    study = federation.study
    check_study(
        federation, Study(classes=study.classes, dim=study.dim + 1, backbone=study.backbone), [1000, 1001]
    )
    for node in federation.nodes.values():
        node.state = DictState()  # a new run: the nodes' context state is new
    transport = InProcessTransport(federation)
    transport.pin = False
    server = FederationServer(
        transport, federation.roster, study, round_timeout=1, signer=federation.signer, colluders=0,
        log=lambda s: None, metrics=Metrics(path),
    )  # fmt: skip
    with pytest.raises(FederationAbortedError):
        server.run()
    samples = parse_file(path)
    # The second run's increase is what its report says; the first run's counters stayed.
    assert mismatches(samples, [server.report.to_dict()], before) == []
    assert value(samples, "secure_afl_sessions_started_total") == 2
    assert value(samples, "secure_afl_sessions_finished_total") == 1
    assert value(samples, "secure_afl_sessions_aborted_total") == 1
    assert value(samples, "secure_afl_refusals_total", rule="UncheckedStudyError") == 2
    assert value(samples, "secure_afl_classifiers_total") == 1
    result = CliRunner().invoke(main, ["deploy", "status", str(path.parent)])
    assert result.exit_code == 0, result.output
    assert "sessions: 2 started, 1 finished, 1 aborted" in result.output
    assert "UncheckedStudyError 2" in result.output, result.output
    assert "classifiers delivered: 1" in result.output


def parse_text(metrics: Metrics) -> dict:
    from prometheus_client import generate_latest

    return parse(generate_latest(registry_of(lambda: metrics.state)).decode())


class NodeCountingTransport(InProcessTransport):
    """Counts every node's messages as the ClientApp does (apps._count), in its ledger-dir."""

    def exchange(self, outgoing: Mapping[int, Envelope], group: str, timeout: float) -> dict[int, Envelope]:
        replies = super().exchange(outgoing, group, timeout)
        for node_id, reply in replies.items():
            settings = self.federation.nodes[node_id].settings
            error = str(reply.meta.get("error", ""))
            kind = outgoing[node_id].kind
            record_node_message(
                settings.ledger_dir, kind, reply.kind, error, 0.5, dp_epsilon=settings.dp_epsilon
            )
        return replies


def test_a_node_counts_its_messages_in_its_ledger_dir_and_node_metrics_writes_them(tmp_path: Path) -> None:
    federation = make_federation(tmp_path)
    run_server(federation, NodeCountingTransport(federation))
    settings = federation.nodes[1000].settings
    textfile = tmp_path / "secure_afl.prom"
    result = CliRunner().invoke(
        main,
        ["deploy", "node-metrics", "--ledger-dir", str(settings.ledger_dir), "--textfile", str(textfile)],
    )
    assert result.exit_code == 0, result.output
    samples = parse(textfile.read_text())
    assert value(samples, "secure_afl_party_info", role="node") == 1
    assert value(samples, "secure_afl_sessions_started_total") == 1
    assert value(samples, "secure_afl_sessions_finished_total") == 1  # the ledger's release
    assert value(samples, "secure_afl_rounds_total") == 7  # R0..R4, classifier, the check's relay
    assert value(samples, "secure_afl_classifiers_total") == 1
    assert ("secure_afl_dropouts_total", ()) not in samples  # a node does not see dropouts
    state = json.loads((settings.ledger_dir / METRICS_NAME).read_text())
    assert state["role"] == "node" and state["refusals"] == {}
    status = CliRunner().invoke(main, ["deploy", "status", str(settings.ledger_dir)])
    assert status.exit_code == 0, status.output
    assert "sessions: 1 advertised in, 1 released" in status.output
    assert "classifiers stored: 1" in status.output


def test_node_metrics_refuses_a_ledger_dir_that_does_not_exist(tmp_path: Path) -> None:
    # A mistyped --ledger-dir would otherwise write (or serve) zeros, exit 0, for ever.
    textfile = tmp_path / "secure_afl.prom"
    missing = tmp_path / "ledgr"
    result = CliRunner().invoke(
        main, ["deploy", "node-metrics", "--ledger-dir", str(missing), "--textfile", str(textfile)]
    )
    assert result.exit_code == 2 and "--ledger-dir" in result.output and "does not exist" in result.output
    assert not textfile.exists()


def test_a_refusal_and_the_dp_budget_in_a_node_s_counters(tmp_path: Path) -> None:
    state = record_node_message(
        tmp_path, "advertise", "refused", "ChainBudgetExceededError", 0.1, dp_epsilon=2.0
    )
    assert state.refusals == {"ChainBudgetExceededError": 1} and state.sessions_started == 0
    samples = parse_text_of(tmp_path)
    assert value(samples, "secure_afl_refusals_total", rule="ChainBudgetExceededError") == 1
    assert value(samples, "secure_afl_dp_epsilon_limit") == 2.0
    assert value(samples, "secure_afl_dp_epsilon_remaining", unit="image") == 2.0  # nothing released yet


def test_dp_epsilon_spent_at_the_coordinator_and_spent_and_remaining_at_each_node(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, method=Method(balance="global", min_pos=1, min_neg=1))
    lists = {cid: tuple(data[2]) for cid, data in federation.data.items()}
    federation.study = dataclasses.replace(
        federation.study, dp=StudyDp(epsilon=1.0, clip=32.0, class_lists=lists)
    )
    for node in federation.nodes.values():
        node.settings = dataclasses.replace(node.settings, dp_epsilon=3.0)
    metrics = Metrics()
    _, classifier, _ = run_server(federation, NodeCountingTransport(federation), metrics=metrics)
    coordinator = parse_text(metrics)
    spent = classifier.privacy["epsilon_spent"]
    assert spent and 0 < max(spent.values()) <= 1.0 + 1e-9
    for cid, epsilon in spent.items():
        assert value(coordinator, "secure_afl_dp_epsilon_spent", institution=cid) == pytest.approx(epsilon)
    node = parse_text_of(federation.nodes[1000].settings.ledger_dir)
    at_node = value(node, "secure_afl_dp_epsilon_spent", unit="image")
    assert 0 < at_node <= 1.0 + 1e-9  # the ε its ledger's one DP release spent (image unit)
    assert value(node, "secure_afl_dp_epsilon_limit") == 3.0
    assert value(node, "secure_afl_dp_epsilon_remaining", unit="image") == pytest.approx(3.0 - at_node)


def parse_text_of(ledger_dir: Path) -> dict:
    from secure_afl.deploy.metrics import samples_of

    return samples_of(file_registry(ledger_dir / METRICS_NAME, "node"))


def test_addresses_default_to_loopback_and_bad_ones_are_named() -> None:
    assert parse_address("9464") == ("127.0.0.1", 9464)
    assert parse_address("0.0.0.0:9464") == ("0.0.0.0", 9464)
    assert parse_address("[::1]:9464") == ("::1", 9464)
    with pytest.raises(ConfigurationError, match="--metrics 'host:port': give HOST:PORT"):
        parse_address("host:port")
    with pytest.raises(ConfigurationError, match="give HOST:PORT"):
        parse_address("127.0.0.1:70000")
    result = CliRunner().invoke(main, ["deploy", "status"])
    assert result.exit_code == 2 and "give a DIRECTORY" in result.output


def test_status_of_a_directory_without_metrics_says_what_writes_them(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["deploy", "status", str(tmp_path)])
    assert result.exit_code == 1
    assert "does not exist: the coordinator writes it in its out-dir" in result.output
