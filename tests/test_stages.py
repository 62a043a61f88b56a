"""One pipeline for every driver: a deployed node and the simulator, over the same rows, call the same
stage functions of ``secure_afl.stages`` and get the same values from them (SPEC §2)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from deploy.helpers import make_federation, run_server  # tests/deploy's in-process federation

from secure_afl import stages
from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.deploy.study import Method, StudyDp
from secure_afl.rehearsal import reference_classifier
from secure_afl.sim.data import Cohort, Split
from secure_afl.sim.datasets import PreparedData
from secure_afl.sim.partial import LabelAssignment
from secure_afl.sim.private import PrivateMechanism
from secure_afl.sim.setting import SimConfig, client_id

# The stages a client computes its uploads with (statistics, privatize, pseudo-labels).
STAGES = (
    "unit_rows",
    "clear_statistics",
    "dp_statistics",
    "dp_rows",
    "clear_contributions",
    "every_variant",
    "noised_round1",
    "noised_round2",
    "pseudo_labels",
    "pseudo_label_variants",
)
ACTIVE = {"client-0": (1, 2), "client-1": (1, 2), "client-2": (0, 1, 2), "client-3": (0, 1, 2)}


def _digest(value: object) -> str:
    """A value's fingerprint: the bytes of every array in it, in order."""
    h = hashlib.sha256()

    def feed(v: object) -> None:
        if isinstance(v, dict):
            for key in sorted(v):
                h.update(str(key).encode())
                feed(v[key])
        elif isinstance(v, tuple):
            for item in v:
                feed(item)
        elif isinstance(v, np.ndarray):
            h.update(np.ascontiguousarray(v, dtype=np.float64).tobytes())
        elif hasattr(v, "gram"):  # ClientStatistics, PrivateStatistics
            feed(v.gram)

    feed(value)
    return h.hexdigest()


class Spy:
    """Records every call of a stage under the driver that is running: (stage, its first argument's
    fingerprint, its result's)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: dict[str, list[tuple[str, str, str]]] = {}
        self.driver = ""
        for name in STAGES:
            monkeypatch.setattr(stages, name, self._wrap(name, getattr(stages, name)))

    def _wrap(self, name: str, function: Callable) -> Callable:
        def spied(*args, **kwargs):
            result = function(*args, **kwargs)
            self.calls.setdefault(self.driver, []).append((name, _digest(args[0]), _digest(result)))
            return result

        return spied

    def stages_of(self, driver: str) -> set[str]:
        return {name for name, _, _ in self.calls.get(driver, [])}

    def values_of(self, driver: str, stage: str) -> set[tuple[str, str]]:
        return {(given, made) for name, given, made in self.calls.get(driver, []) if name == stage}


def test_a_node_and_the_simulator_call_the_same_stages_over_the_same_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    method = Method(rounds=2, min_pos=1, min_neg=1, tau=0.5)
    federation = make_federation(tmp_path, n_clients=4, active=ACTIVE, method=method)
    spy = Spy(monkeypatch)
    spy.driver = "node"
    _, classifier, _ = run_server(federation)
    spy.driver = "simulator"  # sim/runner.walk over the rehearsal's StudyMechanism
    reference = reference_classifier(
        federation.data, federation.study, roster_size=4, dropouts={}, device="cpu", colluders="0"
    )
    assert classifier.weights.tobytes() == reference.coef.tobytes()
    expected = {"clear_statistics", "clear_contributions", "pseudo_labels"}
    assert spy.stages_of("node") == spy.stages_of("simulator") == expected
    for stage in expected:  # the same rows in, the same values out, client by client
        assert spy.values_of("node", stage) == spy.values_of("simulator", stage), stage
    assert len(spy.values_of("node", "clear_statistics")) == 4


def test_under_dp_a_node_and_the_private_mechanism_call_the_same_stages_over_the_same_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    method = Method(balance="global", rounds=1)
    federation = make_federation(tmp_path, n_clients=4, active=ACTIVE, method=method)
    dp = StudyDp(class_lists=dict(ACTIVE), epsilon=1.0, clip=8.0)
    federation.study = dataclasses.replace(federation.study, dp=dp)
    spy = Spy(monkeypatch)
    spy.driver = "node"
    run_server(federation)
    # The simulator's private mechanism over the same rows, one client per institution.
    names = sorted(federation.data)
    features = np.vstack([federation.data[cid][0] for cid in names]).astype(np.float64)
    labels = np.vstack([federation.data[cid][1] for cid in names])
    sizes = np.cumsum([0] + [len(federation.data[cid][0]) for cid in names])
    clients = tuple(np.arange(sizes[k], sizes[k + 1]) for k in range(len(names)))
    n = len(features)
    cohort = Cohort(np.arange(n).astype(str), np.arange(n).astype(str), labels, "test")
    data = PreparedData(cohort, features, Split(clients, np.arange(0), np.arange(0)), {})
    assignment = LabelAssignment(missing=0, n_classes=3, active=tuple(ACTIVE[cid] for cid in names))
    config = SimConfig(n_clients=4, secure="mask", rounds=1, device="cpu", dp=dp.config())
    spy.driver = "simulator"
    mechanism = PrivateMechanism(data, config, assignment, DeterministicRandomSource(b"\0" * 32))
    sim_names = [client_id(k) for k in range(4)]
    mechanism.privatize(mechanism.statistics(sim_names, assignment), sim_names, assignment)
    assert {"dp_statistics", "noised_round1"} <= spy.stages_of("node")
    assert spy.stages_of("node") - {"unit_rows"} == spy.stages_of("simulator")
    # the same clipped statistics from the same rows (the noise is each driver's own draw)
    assert spy.values_of("node", "dp_statistics") == spy.values_of("simulator", "dp_statistics")
    assert len(spy.values_of("node", "dp_statistics")) == 4


# What computes a client's statistics, noise or pseudo-labels: only secure_afl.stages calls these.
OWN_COMPUTATIONS = {
    "client_statistics", "private_statistics", "private_rows", "clip_rows", "round1_upload",
    "pseudo_label_upload", "pseudo_label_round", "pseudo_label_contributions", "pseudo_label_rounds",
    "privatize", "randomized_round", "sample_discrete_gaussian", "noise_words", "balanced_labels",
    "contributions",
}  # fmt: skip


def test_no_function_in_deploy_computes_statistics_noise_or_pseudo_labels_itself() -> None:
    import ast

    import secure_afl.deploy

    found = []
    for path in sorted(Path(secure_afl.deploy.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            found += [f"{path.name}:{node.lineno} {name}" for name in names if name in OWN_COMPUTATIONS]
    assert found == []
    # and the check sees such a call where there is one (the stages' own module makes them)
    stages_source = ast.parse(Path(stages.__file__).read_text(encoding="utf-8"))
    assert any(isinstance(n, ast.Attribute) and n.attr == "contributions" for n in ast.walk(stages_source))
