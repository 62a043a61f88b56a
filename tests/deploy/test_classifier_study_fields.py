"""A classifier file states what its study decides (deploy/study.py ``classifier_fields``): every node
refuses, on delivery and before the classifier check, a signed file whose classes, decision
threshold, backbone, method, dimension, study digest, protocol parameters or DP record differ from
the study it took part in.  The check verifies the weights column by column; these fields say what
the columns mean, so a coordinator that relabels two classes or moves the threshold would otherwise
deliver a "verified" classifier that names the wrong disease."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from secure_afl.deploy.classifier import Classifier

from .helpers import make_federation, run_server
from .test_classifier_check import _refused_by_all, _run, _server
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
    assert all("states privacy" in r["message"] for r in server.report.refusals)


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


def _fake_chain(c: Classifier) -> Classifier:  # a growing chain's ε record on a study that grows nothing
    growth = {"epsilon_chain": {k: 0.001 for k in c.privacy["epsilon_spent"]}, "delta_chain": 1e-12}
    return dataclasses.replace(
        c, privacy={**c.privacy, "growth": growth}, protocol={**c.protocol, "growth": {"chain": []}}
    )


RECORD_CHANGES = {
    "a chain's growth record": _fake_chain,
    "a protocol key of CKKS": lambda c: dataclasses.replace(
        c, protocol={**c.protocol, "trust_model": "none"}
    ),
    "round 2's classes": lambda c: dataclasses.replace(
        c, privacy={**c.privacy, "round2_qualified_classes": [0]}
    ),
}


@pytest.mark.parametrize("change", list(RECORD_CHANGES))
def test_a_record_part_the_study_does_not_define_is_refused_by_every_node(
    tmp_path: Path, change: str
) -> None:
    """A DP classifier of a one-session study carrying a growing chain's ε record (what `predict`
    prints as the chain's ε), a masking file naming a CKKS trust model, or round 2's classes in a
    one-round study: statements no node checks, refused on arrival, as every key beside the study's."""
    federation = _dp_ridge_federation(tmp_path, "bound")
    server, _ = _run(federation, change=RECORD_CHANGES[change])
    nodes = {n.client_id for n in federation.nodes.values()}
    _refused_by_all(server, federation, nodes, "ClassifierNotOfStudyError")
    said = "privacy" if change == "round 2's classes" else "fields its protocol or DP record does not define"
    assert all(said in r["message"] for r in server.report.refusals), server.report.refusals


def _resigned(federation, edit):
    """The coordinator edits the signed file's JSON itself (fields no Classifier holds), then signs it
    again with its key: a file every signature check accepts."""
    from secure_afl.deploy.classifier import content_digest
    from secure_afl.deploy.wire import Envelope

    def tamper(node: int, group: str, envelope: Envelope) -> Envelope:
        if group != "classifier":
            return envelope
        document = json.loads(envelope.payload)
        for key in ("content_sha256", "signature"):
            document.pop(key)
        edit(document)
        document["content_sha256"] = content_digest(document)
        document["signature"] = federation.signer.sign(document)
        return Envelope(envelope.kind, dict(envelope.meta), json.dumps(document).encode("utf-8"))

    return tamper


FILE_EDITS = {
    "a top-level note": lambda d: d.update(note="reviewed by the ethics board"),
    "another preprocessing": lambda d: d.update(preprocessing="resize 512, no normalisation"),
    "a backbone key": lambda d: d["backbone"].update(licence="research only"),
    "a session key": lambda d: d["sessions"][0].update(excluded=["client-3"]),
    "an audit part": lambda d: d["audit"].update(summary="nothing learned"),
}


@pytest.mark.parametrize("edit", list(FILE_EDITS))
def test_a_field_the_format_does_not_define_is_refused_by_every_node(tmp_path: Path, edit: str) -> None:
    """The parsed file, written again, must be the file: a field beside the format's (which no reader
    parses, or a top-level preprocessing other than the backbone's) is refused on arrival."""
    federation = make_federation(tmp_path, n_clients=4)
    server, _ = _server(federation, _resigned(federation, FILE_EDITS[edit]))
    classifier = server.run()
    server.deliver(classifier, server.sign(classifier))
    nodes = {n.client_id for n in federation.nodes.values()}
    _refused_by_all(server, federation, nodes, "ClassifierNotOfStudyError")
    assert all("the classifier format does not define" in r["message"] for r in server.report.refusals)
