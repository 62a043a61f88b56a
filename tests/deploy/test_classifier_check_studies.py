"""The classifier check (SECURITY.md §5.1) for each kind of study it covers beyond client balance:
global balance (the counts enter as the solve uses them), DP (each node's noisy upload, the public
ridge beside γ), and the per-class Gram sent by difference.  For each, an honest coordinator's
classifier is verified by every survivor, and one weight changed by a millionth of its column is
refused by every node; counts relayed other than the solve's are refused too."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from secure_afl.deploy.study import Method, StudyDp, round1_plan
from secure_afl.deploy.verify import not_offered, verification_status
from secure_afl.deploy.wire import Envelope

from .helpers import Federation, make_federation, run_server
from .test_classifier_check import _perturb, _refused_by_all, _run

DP_ACTIVE = {"client-0": (1, 2), "client-1": (0, 2), "client-2": (0, 1, 2), "client-3": (0, 1, 2)}
# Twelve institutions: five miss class 0, five class 1, two label all (test_deploy_difference.py's).
PLANNED = {
    **{f"client-{k}": (1, 2) for k in range(5)},
    **{f"client-{k}": (0, 2) for k in range(5, 10)},
    **{f"client-{k}": (0, 1, 2) for k in range(10, 12)},
}


def _federation(tmp_path: Path, kind: str) -> Federation:
    if kind == "global":
        return make_federation(tmp_path, n_clients=4, method=Method(balance="global"))
    if kind.startswith("dp"):
        method = Method(balance="global", min_pos=1, min_neg=1, tau=0.5)
        federation = make_federation(tmp_path, n_clients=4, active=DP_ACTIVE, method=method)
        sums = "positives" if kind == "dp-positives" else "split"
        dp = StudyDp(class_lists=dict(DP_ACTIVE), epsilon=1.0, clip=8.0, class_sums=sums)
        federation.study = dataclasses.replace(federation.study, dp=dp)
        return federation
    method = Method(gram="class", balance="client", min_pos=1, min_neg=1)
    federation = make_federation(tmp_path, n_clients=12, dim=8, rows=40, active=PLANNED, method=method)
    for node in federation.nodes.values():  # the per-class Gram is each node's opt-in
        node.settings = dataclasses.replace(node.settings, allow_class_gram=True)
    federation.study = dataclasses.replace(federation.study, class_lists=dict(PLANNED))
    assert round1_plan(federation.study, sorted(PLANNED))[1] is not None  # Grams sent by difference
    return federation


KINDS = ["global", "dp-split", "dp-positives", "difference"]


@pytest.mark.parametrize("kind", KINDS)
def test_an_honest_coordinators_classifier_is_verified_by_every_survivor(tmp_path: Path, kind: str) -> None:
    federation = _federation(tmp_path, kind)
    assert not_offered(federation.study, [n.client_id for n in federation.nodes.values()]) is None
    server, classifier, _ = run_server(federation)
    survivors = tuple(classifier.sessions[0]["survivors"])
    assert len(survivors) == len(federation.nodes)
    assert server.report.verified == survivors and server.report.acknowledged == survivors
    if kind.startswith("dp"):
        assert classifier.privacy is not None and classifier.privacy["ridge"] > 0  # λ entered beside γ
    for node in federation.nodes.values():
        path = node.settings.out_dir / "classifier.json"
        assert verification_status(path).startswith("classifier check: verified by this node")
        record = json.loads((node.settings.out_dir / "classifier.verified.json").read_text())
        assert record["max_residual_over_bound"] < 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_one_changed_weight_is_refused_by_every_node(tmp_path: Path, kind: str) -> None:
    federation = _federation(tmp_path, kind)
    server, _ = _run(federation, change=_perturb)
    nodes = {n.client_id for n in federation.nodes.values()}
    _refused_by_all(server, federation, nodes, "ClassifierCheckFailedError")


@pytest.mark.parametrize("kind", ["global", "dp-split"])
def test_counts_other_than_the_solves_are_refused_by_every_node(tmp_path: Path, kind: str) -> None:
    """The coordinator relays class 1's positive count one higher (a classifier solved with it would
    pass the residual): the survivors' own counts sum to the true one, and every node refuses."""
    federation = _federation(tmp_path, kind)

    def tamper(node: int, group: str, envelope: Envelope) -> Envelope:
        if group != "verify-reveal":
            return envelope
        counts = json.loads(str(envelope.meta["counts"]))
        counts["class/1|n_pos/1"] += 1.0
        return Envelope(envelope.kind, {**envelope.meta, "counts": json.dumps(counts)}, envelope.payload)

    server, _ = _run(federation, tamper=tamper)
    nodes = {n.client_id for n in federation.nodes.values()}
    _refused_by_all(server, federation, nodes, "ClassifierCheckFailedError")


def test_the_studies_not_covered_say_why(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=3)
    ids = [n.client_id for n in federation.nodes.values()]
    study = federation.study
    lists = {cid: tuple(data[2]) for cid, data in federation.data.items()}
    projected = StudyDp(class_lists=lists, epsilon=1.0, clip=8.0, projection_dim=8)
    cases = {
        "CKKS": dataclasses.replace(study, protection="ckks"),
        "two-round": dataclasses.replace(study, method=Method(rounds=2)),
        "growing": dataclasses.replace(study, method=Method(balance="global"), extends="0" * 64),
        "--dp-dim": dataclasses.replace(study, method=Method(balance="global"), dp=projected),
    }
    for words, case in cases.items():
        assert words in str(not_offered(case, ids))


@pytest.mark.parametrize("dim", [1, 127, 128, 129, 300])
def test_a_nodes_gram_times_u_from_its_packed_triangle_is_the_full_products(dim: int) -> None:
    import numpy as np

    from secure_afl.deploy.verify import _gram_times

    rng = np.random.default_rng(dim)
    rows = rng.random((20, dim))
    gram, u = rows.T @ rows, rng.uniform(-1, 1, dim)
    expected = gram @ u
    got = _gram_times(gram[np.triu_indices(dim)], u)
    assert np.abs(got - expected).max() <= 1e-13 * np.abs(gram).sum(axis=1).max()


def test_the_checks_secret_is_derived_from_the_identity_key_for_each_session_and_node() -> None:
    from secure_afl.keys import IdentityKey
    from secure_afl.protocol.verify import VerifySecret

    key, other = IdentityKey.generate(), IdentityKey.generate()
    one, two = bytes(32), bytes([1]) * 32
    secret = VerifySecret.derive(key.private_key, "client-0", one)
    assert secret == VerifySecret.derive(key.private_key, "client-0", one)  # derived again, never stored
    others = {
        VerifySecret.derive(key.private_key, "client-0", two),
        VerifySecret.derive(key.private_key, "client-1", one),
        VerifySecret.derive(other.private_key, "client-0", one),
    }
    assert len(others) == 3 and secret not in others
    assert all(len(s.nonce) == 32 and s.nonce != s.key for s in (secret, *others))
