"""A classifier file states what its study decides (deploy/study.py ``classifier_fields``): every node
refuses, on delivery and before the classifier check, a signed file whose classes, decision
threshold, backbone, method, dimension, study digest, protocol parameters or DP record differ from
the study it took part in.  The check verifies the weights column by column; these fields say what
the columns mean, so a coordinator that relabels two classes or moves the threshold would otherwise
deliver a "verified" classifier that names the wrong disease."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from secure_afl.deploy.classifier import Classifier

from .helpers import make_federation, run_server
from .test_classifier_check import _refused_by_all, _run
from .test_classifier_check_studies import _dp_ridge_federation


def _relabel(c: Classifier) -> Classifier:  # the weights stay; two columns get each other's name
    return dataclasses.replace(c, classes=(c.classes[1], c.classes[0], *c.classes[2:]))


CHANGES = {
    "classes": _relabel,
    "decision_threshold": lambda c: dataclasses.replace(c, decision_threshold=0.9),
    "backbone": lambda c: dataclasses.replace(c, backbone={**c.backbone, "weights_id": "another"}),
    "method": lambda c: dataclasses.replace(c, method={**c.method, "gamma": 2.0}),
    "study_digest": lambda c: dataclasses.replace(c, study_digest="0" * 64),
    "protocol": lambda c: dataclasses.replace(c, protocol={**c.protocol, "threshold": 1}),
}


@pytest.mark.parametrize("field", list(CHANGES))
def test_a_file_stating_another_studys_field_is_refused_by_every_node(tmp_path: Path, field: str) -> None:
    federation = make_federation(tmp_path, n_clients=4)
    server, _ = _run(federation, change=CHANGES[field])
    nodes = {n.client_id for n in federation.nodes.values()}
    _refused_by_all(server, federation, nodes, "ClassifierNotOfStudyError")
    assert all(f"states {field} other than the study" in r["message"] for r in server.report.refusals)


def test_a_dp_record_on_a_study_without_dp_is_refused_by_every_node(tmp_path: Path, monkeypatch) -> None:
    """A privacy record the coordinator adds to a study without DP (a real one, from a DP study) would
    bring its ridge into the check: a W solved with γ + that ridge is refused by every node."""
    from secure_afl.analytic import AnalyticClassifier
    from secure_afl.deploy.solve import StudySolver

    _, dp_classifier, _ = run_server(_dp_ridge_federation(tmp_path / "dp", "bound"))
    record = dict(dp_classifier.privacy)

    def ridged(self, sums, gram_survivors=0):
        method = self.study.method
        return AnalyticClassifier(
            self.study.n_classes,
            gamma=method.gamma + record["ridge"],
            balance=method.balance,
            gram=method.gram,
        ).fit(sums)

    monkeypatch.setattr(StudySolver, "fit", ridged)  # the coordinator's solve only
    monkeypatch.setattr(StudySolver, "privacy_record", lambda self, model=None: record)
    federation = make_federation(tmp_path / "plain", n_clients=4)
    server, _ = _run(federation)
    nodes = {n.client_id for n in federation.nodes.values()}
    _refused_by_all(server, federation, nodes, "ClassifierNotOfStudyError")
    assert all("states privacy other than the study" in r["message"] for r in server.report.refusals)


@pytest.mark.parametrize("key", ["epsilon_target", "epsilon_spent", "clip"])
def test_a_dp_record_misstating_the_studys_privacy_is_refused_by_every_node(tmp_path: Path, key: str) -> None:
    """The ε a hospital reads in its classifier file is the study's plan, not the coordinator's word."""

    def misstate(c: Classifier) -> Classifier:
        value = c.privacy[key]
        changed = {k: v / 2 for k, v in value.items()} if isinstance(value, dict) else value / 2
        return dataclasses.replace(c, privacy={**c.privacy, key: changed})

    federation = _dp_ridge_federation(tmp_path, "bound")
    server, _ = _run(federation, change=misstate)
    nodes = {n.client_id for n in federation.nodes.values()}
    _refused_by_all(server, federation, nodes, "ClassifierNotOfStudyError")


def test_an_honest_file_states_its_studys_fields(tmp_path: Path) -> None:
    """The comparison can pass: an honest coordinator's DP classifier is stored and verified by every node."""
    federation = _dp_ridge_federation(tmp_path, "adassp")
    server, classifier, _ = run_server(federation)
    assert server.report.refusals == [] and server.report.verified == tuple(
        classifier.sessions[0]["survivors"]
    )
    assert np.all(np.isfinite(classifier.weights))
