"""Under DP, a client refuses a study whose noise plan does not hold for it: round 2's threshold
τ below 0.5 (the pseudo-label sets would overlap) or more feature rows than the plan's bound.

A study with τ below 0.5 cannot be made (:class:`StudyParameterError`, tests/deploy/test_study_ranges.py):
the tests below force one, as a hostile server would send it, to show the refusals that remain."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

import secure_afl.deploy.server as server_module
from secure_afl.deploy.errors import ConfigurationError, FederationAbortedError, StudyParameterError
from secure_afl.deploy.server import FederationServer
from secure_afl.deploy.study import Method, Study, StudyDp, noise_plan
from secure_afl.privacy.dp_config import DEFAULT_MAX_ROWS

from .helpers import InProcessTransport, make_federation, run_server

# Round 2 needs groups of two: pseudo/0 holds client-0 and client-1.
ACTIVE = {"client-0": (1, 2), "client-1": (1, 2), "client-2": (0, 1, 2), "client-3": (0, 2)}


def _federation(tmp_path: Path, *, tau: float, rounds: int = 2, **dp):
    method = Method(balance="global", rounds=rounds, min_pos=1, min_neg=1, tau=tau)
    federation = make_federation(tmp_path, n_clients=4, method=method, active=ACTIVE)
    lists = {cid: tuple(data[2]) for cid, data in federation.data.items()}
    federation.study = dataclasses.replace(
        federation.study, dp=StudyDp(epsilon=1.0, clip=8.0, class_lists=lists, **dp)
    )
    return federation


def _forced_tau(federation, tau: float):
    """The federation with its study's τ set around the study's own check (a hostile server's study)."""
    method = copy.copy(federation.study.method)
    object.__setattr__(method, "tau", tau)
    object.__setattr__(federation.study, "method", method)
    return federation


def _hostile_run(federation, monkeypatch) -> tuple[FederationServer, InProcessTransport]:
    """A server that plans its own noise as if τ were 0.5 and sends the study as it is."""
    honest = server_module.noise_plan

    def plan_anyway(study: Study, roster_size: int):
        return honest(
            dataclasses.replace(study, method=dataclasses.replace(study.method, tau=0.5)), roster_size
        )

    monkeypatch.setattr(server_module, "noise_plan", plan_anyway)
    transport = InProcessTransport(federation)
    server = FederationServer(
        transport, federation.roster, federation.study, round_timeout=1, log=lambda s: None
    )
    with pytest.raises(FederationAbortedError, match="aborted after R0"):
        server.run()
    return server, transport


def test_every_client_refuses_a_round_2_study_with_tau_below_one_half(tmp_path: Path, monkeypatch) -> None:
    federation = _forced_tau(_federation(tmp_path, tau=0.5), 0.3)
    server, transport = _hostile_run(federation, monkeypatch)
    assert [r["error"] for r in server.report.refusals] == ["StudyParameterError"] * 4
    assert all("tau = 0.3 is not a number in [0.5, 1)" in r["message"] for r in server.report.refusals)
    assert {r.kind for _, _, r in transport.received} == {"refused"}  # nothing else left any client


def test_the_same_study_at_tau_one_half_runs_both_rounds(tmp_path: Path) -> None:
    federation = _federation(tmp_path, tau=0.5)
    server, classifier, _ = run_server(federation)
    assert server.report.refusals == []
    assert len(classifier.sessions) == 2  # round 2 ran: its pseudo-label groups were summed


def test_an_honest_server_refuses_tau_below_one_half_before_any_session(tmp_path: Path) -> None:
    for rounds in (2, 1):  # the study's rule, in one round or two
        with pytest.raises(StudyParameterError, match=r"tau = 0\.3 is not a number in \[0\.5, 1\)"):
            _federation(tmp_path / str(rounds), tau=0.3, rounds=rounds)
    federation = _forced_tau(_federation(tmp_path, tau=0.5), 0.3)  # the noise plan's own check remains
    with pytest.raises(ConfigurationError, match=r"tau = 0\.3 is not in \[0\.5, 1\)"):
        noise_plan(federation.study, len(federation.roster))
    transport = InProcessTransport(federation)
    server = FederationServer(
        transport, federation.roster, federation.study, round_timeout=1, log=lambda s: None
    )
    with pytest.raises(ConfigurationError, match=r"use tau >= 0\.5"):
        server.run()
    assert transport.sent == []


def test_a_client_with_more_rows_than_the_studys_bound_refuses_it(tmp_path: Path) -> None:
    federation = _federation(tmp_path, tau=0.5, rounds=1, max_rows=59)  # every client holds 60 rows
    transport = InProcessTransport(federation)
    server = FederationServer(
        transport, federation.roster, federation.study, round_timeout=1, log=lambda s: None
    )
    with pytest.raises(FederationAbortedError, match="aborted after R0"):
        server.run()
    assert [r["error"] for r in server.report.refusals] == ["StudyMismatchError"] * 4
    assert all(
        "this feature file has 60 rows, more than the study's max_rows = 59" in r["message"]
        for r in server.report.refusals
    )
    assert {r.kind for _, _, r in transport.received} == {"refused"}


def test_the_study_document_carries_the_row_bound(tmp_path: Path) -> None:
    study = _federation(tmp_path, tau=0.5, max_rows=5_000).study
    document = json.loads(study.to_json())
    assert document["dp"]["max_rows"] == 5_000
    assert Study.from_json(study.to_json()).dp.max_rows == 5_000
    assert noise_plan(study, 4).config.max_rows == 5_000
    del document["dp"]["max_rows"]  # a study written before the bound existed: the default
    assert Study.from_json(json.dumps(document)).dp.max_rows == DEFAULT_MAX_ROWS
    with pytest.raises(ConfigurationError, match="must be a positive integer"):
        dataclasses.replace(study, dp=dataclasses.replace(study.dp, max_rows=0))
