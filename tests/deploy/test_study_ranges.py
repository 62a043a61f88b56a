"""A study's numeric parameters are refused out of range, by name, wherever a study is made.

The method's γ, τ, α, δ⁺ (min_pos) and δ⁻ (min_neg) follow one rule
(:data:`secure_afl.statistics.METHOD_PARAMETERS`, paper §III): γ a positive finite number, τ in
[0.5, 1), α in (0, 1], δ⁺ and δ⁻ integers ≥ 1.  With rounds, the threshold, the minimum group size,
the fractional bits and the dimension, each is refused (:class:`StudyParameterError`, naming it, its
value, its range and the run-config key that sets it) at ``deploy check --study``, at
``deploy provision`` (nothing written) and by :meth:`Study.from_json`, so a node refuses such a
study in R0 before it computes anything.  The simulator's config refuses the method's values alike.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

import secure_afl.deploy.client as client_module
from secure_afl.analytic import PseudoLabelConfig
from secure_afl.cli_deploy import deploy
from secure_afl.deploy.apps import study_from_run_config
from secure_afl.deploy.errors import ConfigurationError, FederationAbortedError, StudyParameterError
from secure_afl.deploy.server import FederationServer
from secure_afl.deploy.study import RUN_CONFIG_KEYS, Method, Study
from secure_afl.deploy.wire import Envelope
from secure_afl.statistics import METHOD_PARAMETERS, MethodParameterError

from .helpers import BACKBONE, CLASSES, Federation, InProcessTransport, make_federation
from .test_deploy_commands import _node_config
from .test_provision import HOSPITALS, _site

NAN, INF = float("nan"), float("inf")
METHOD = ("gamma", "tau", "alpha", "min_pos", "min_neg", "rounds")
# Each refused (parameter, value); a str is a number written as text, which int() or float() would pass.
BAD = {
    "gamma": (NAN, INF, -INF, -1.0, 0.0, 0, True, "1.0"),
    "tau": (NAN, INF, -0.7, 0.0, 0.3, 0.49, 1.0, 1, 1.5, True, "0.7"),
    "alpha": (NAN, INF, -0.5, 0.0, 0, 1.5, True, "0.5"),
    "min_pos": (NAN, INF, -1, 0, 2.5, 5.0, True, "5"),
    "min_neg": (NAN, INF, -1, 0, 2.5, 50.0, True, "50"),
    "rounds": (0, 3, 1.0, True, "1"),
    "threshold": (-1, 2.5, True, "3"),
    "min_group_size": (0, -2, 2.0, True, "2"),
    "frac_bits": (-1, 53, 32.0, True, "32"),
    "dim": (0, -40, 40.0, True, "40"),
}
CASES = [(name, value) for name, values in BAD.items() for value in values]
ALLOWED = {
    **{name: rule.allowed for name, rule in METHOD_PARAMETERS.items()},
    "rounds": "1 or 2",
    "threshold": "an integer ≥ 0",
    "min_group_size": "an integer ≥ 1",
    "frac_bits": "an integer in [0, 52]",
    "dim": "an integer ≥ 1",
}


def _toml(value: object) -> str:
    """``value`` as TOML writes it (and as ``--set KEY=VALUE`` reads it back: a quoted text stays text)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return json.dumps(value)


def _refusal(name: str) -> str:
    where = "method." if name in METHOD else ""
    return f"the study's {where}{name} = "


def _run_config(**changes: object) -> dict[str, object]:
    return {
        "classes": ",".join(CLASSES),
        "dim": 40,
        "backbone": BACKBONE["name"],
        "weights-id": BACKBONE["weights_id"],
        "preprocessing": BACKBONE["preprocessing"],
        **changes,
    }


def _study_app(directory: Path, key: str, value: object) -> Path:
    """A coordinator's app directory whose run config sets ``key`` to ``value`` (a TOML file)."""
    config = {"roster": "roster.json", "out-dir": str(directory / "server"), **_run_config(), key: value}
    directory.mkdir(parents=True)
    lines = ["[tool.flwr.app.config]", *(f"{k} = {_toml(v)}" for k, v in config.items())]
    (directory / "pyproject.toml").write_text("\n".join(lines) + "\n")
    return directory


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("provision")
    return {cid: _site(root, cid) for cid in (*HOSPITALS, "coordinator")}


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Federation:
    return make_federation(tmp_path_factory.mktemp("fed"), n_clients=3)


@pytest.mark.parametrize(("name", "value"), CASES, ids=[f"{n}={v!r}" for n, v in CASES])
def test_out_of_range_method_parameters_are_refused_at_check_and_provision(
    name: str, value: object, sites, federation: Federation, tmp_path: Path
) -> None:
    key = RUN_CONFIG_KEYS[name]
    # deploy check --study: the node refuses the coordinator's app before checking anything else.
    app = _study_app(tmp_path / "app", key, value)
    result = CliRunner().invoke(
        deploy, ["check", "--node-config", _node_config(federation), "--study", str(app)]
    )
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())  # click wraps a usage error's message
    assert f"{_refusal(name)}{value!r} is not {ALLOWED[name]}" in text
    assert f"--set {key}=VALUE" in text  # how to fix it
    assert not (federation.nodes[1000].settings.ledger_dir / client_module.CHECKED_STUDY).exists()

    # deploy provision --set KEY=VALUE: refused, and nothing is written.
    out = tmp_path / "fed"
    coordinator = sites["coordinator"]
    hospitals = [a for cid in HOSPITALS for a in ("--hospital", str(sites[cid].keys))]
    result = CliRunner().invoke(
        deploy,
        [
            "provision", "--federation-dir", str(out), *hospitals,
            "--key-dir", str(coordinator.keys), "--passphrase-file", str(coordinator.passfile),
            "--ip", "127.0.0.1", "--features", str(sites[HOSPITALS[0]].features), "--set", "colluders=0",
            "--set", f"{key}={_toml(value)}", "--yes",
        ],
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert f"StudyParameterError: {_refusal(name)}" in text and f"is not {ALLOWED[name]}" in text
    assert not out.exists()

    # Study.from_json: what a node does with the study the server sends (R0).
    document = json.loads(Study(classes=CLASSES, dim=40, backbone=dict(BACKBONE)).to_json())
    (document["method"] if name in METHOD else document)[name] = value
    with pytest.raises(
        StudyParameterError, match=re.escape(f"{_refusal(name)}{value!r} is not {ALLOWED[name]}")
    ):
        Study.from_json(json.dumps(document))


@pytest.mark.parametrize(("name", "value"), [c for c in CASES if c[0] in METHOD_PARAMETERS])
def test_the_simulator_refuses_the_method_values_the_study_refuses(name: str, value: object) -> None:
    from secure_afl.sim.setting import SimConfig

    with pytest.raises(MethodParameterError, match=rf"^{name} must be ") as refused:
        if name == "gamma":
            SimConfig(gamma=value).validate()  # type: ignore[arg-type]
        else:
            PseudoLabelConfig(**{name: value})  # type: ignore[arg-type]
    assert refused.value.allowed == ALLOWED[name]
    assert isinstance(refused.value, ValueError)  # the simulator's CLI reports it (StatisticsError)


def test_values_at_the_edges_of_each_range_and_the_defaults_are_accepted() -> None:
    default = study_from_run_config(_run_config())
    assert default.method == Method() and default.method == Method(tau=0.7, alpha=0.5, min_pos=5, min_neg=50)
    assert default.digest() == Study(classes=CLASSES, dim=40, backbone=dict(BACKBONE)).digest()
    edges = {"gamma": 1e-12, "tau": 0.5, "alpha": 1, "min-pos": 1, "min-neg": 1, "rounds": 2,
             "threshold": 0, "min-group-size": 1, "frac-bits": 52}  # fmt: skip
    study = study_from_run_config(_run_config(**edges))
    m = study.method
    assert (m.gamma, m.tau, m.alpha, m.min_pos, m.min_neg, m.rounds) == (1e-12, 0.5, 1.0, 1, 1, 2)
    assert type(m.alpha) is float and type(m.min_pos) is int  # stored as the method uses them
    assert Study.from_json(study.to_json()).digest() == study.digest()
    assert (
        study_from_run_config(_run_config(tau=0.999, gamma=2)).digest()
        == study_from_run_config(_run_config(tau=0.999, gamma=2.0)).digest()
    )  # γ = 2 and γ = 2.0 are one study
    assert issubclass(StudyParameterError, ConfigurationError)  # every command reports it by name


def test_a_node_refuses_an_out_of_range_study_in_r0_with_nothing_computed(
    tmp_path: Path, monkeypatch
) -> None:
    """τ = 1 with zero minimum counts: before, round 2 divided by a zero pseudo-positive count and
    the run ended in a NaN refusal; now each node refuses the study it is sent, in R0."""
    federation = make_federation(tmp_path, n_clients=3, method=Method(rounds=2, min_pos=1, min_neg=1))
    document = json.loads(federation.study.to_json())
    document["method"].update(tau=1.0, min_pos=0, min_neg=0)
    hostile = json.dumps(document)

    def send_hostile_study(node_id: int, group: str, envelope: Envelope) -> Envelope:
        if "study" not in envelope.meta:
            return envelope
        return Envelope(envelope.kind, {**envelope.meta, "study": hostile}, envelope.payload, envelope.arrays)

    read: list[object] = []  # the node's first look at its data comes after the study is parsed
    monkeypatch.setattr(client_module, "check_node_study", lambda *args: read.append(args))
    transport = InProcessTransport(federation, tamper=send_hostile_study)
    server = FederationServer(
        transport, federation.roster, federation.study, round_timeout=1, log=lambda s: None
    )
    with pytest.raises(FederationAbortedError, match="aborted after R0"):
        server.run()
    assert [r["error"] for r in server.report.refusals] == ["StudyParameterError"] * 3
    assert all(
        "the study's method.tau = 1.0 is not a number in [0.5, 1)" in r["message"]
        for r in server.report.refusals
    )
    assert read == []  # no feature file read, no statistic computed
    assert {reply.kind for _, _, reply in transport.received} == {"refused"}
    for node in federation.nodes.values():
        assert not node.settings.out_dir.exists() or not any(node.settings.out_dir.iterdir())
        assert [r["status"] for r in node.state.records.values()] == ["failed: StudyParameterError"]
