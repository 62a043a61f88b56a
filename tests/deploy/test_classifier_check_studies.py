"""The classifier check (SECURITY.md §5.1) for each kind of study it covers beyond client balance:
global balance (the counts enter as the solve uses them), DP (each node's noisy upload, the public
ridge beside γ), and the per-class Gram sent by difference.  For each, an honest coordinator's
classifier is verified by every survivor, and one weight changed by a millionth of its column is
refused by every node; counts relayed other than the solve's are refused too."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from secure_afl.deploy.study import Method, StudyDp, round1_plan
from secure_afl.deploy.verify import not_offered, verification_status
from secure_afl.deploy.wire import Envelope
from secure_afl.protocol.verify import Commitment, MaskedValue, decode_words

from .helpers import Federation, InProcessTransport, make_federation, run_server
from .test_classifier_check import _perturb, _refused_by_all, _run, _server

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
        mapped = {"dp-dim": {"projection_dim": 12}, "dp-centre": {"row_centre": True}}.get(kind, {})
        dp = StudyDp(class_lists=dict(DP_ACTIVE), epsilon=1.0, clip=8.0, class_sums=sums, **mapped)
        federation.study = dataclasses.replace(federation.study, dp=dp)
        return federation
    method = Method(gram="class", balance="client", min_pos=1, min_neg=1)
    federation = make_federation(tmp_path, n_clients=12, dim=8, rows=40, active=PLANNED, method=method)
    for node in federation.nodes.values():  # the per-class Gram is each node's opt-in
        node.settings = dataclasses.replace(node.settings, allow_class_gram=True)
    federation.study = dataclasses.replace(federation.study, class_lists=dict(PLANNED))
    assert round1_plan(federation.study, sorted(PLANNED))[1] is not None  # Grams sent by difference
    return federation


KINDS = ["global", "dp-split", "dp-positives", "dp-dim", "dp-centre", "difference"]


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
    if kind in ("dp-dim", "dp-centre"):  # the file holds W = M W_K and W_K, which the nodes checked
        solved = np.asarray(classifier.privacy["statistics_weights"])
        assert solved.shape == (
            12 if kind == "dp-dim" else federation.study.dim,
            len(federation.study.classes),
        )
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


@pytest.mark.parametrize("kind", ["dp-dim", "dp-centre"])
def test_a_wrong_lift_is_refused_by_every_node(tmp_path: Path, kind: str) -> None:
    """Under a row map the file holds W = M W_K and W_K: one W_K weight changed, with W lifted from it,
    fails the residual (a changed W beside the solved W_K fails the lift: the test above)."""
    federation = _federation(tmp_path, kind)

    def change(classifier):
        from secure_afl.deploy.study import dp_projection

        solved = np.asarray(classifier.privacy["statistics_weights"]).copy()
        solved[3, 1] += 1e-6 * np.linalg.norm(solved[:, 1])
        weights = dp_projection(federation.study) @ solved
        privacy = {**classifier.privacy, "statistics_weights": solved.tolist()}
        return dataclasses.replace(classifier, weights=weights, privacy=privacy)

    server, _ = _run(federation, change=change)
    nodes = {n.client_id for n in federation.nodes.values()}
    _refused_by_all(server, federation, nodes, "ClassifierCheckFailedError")
    assert all("residuals above the rounding bound" in r["message"] for r in server.report.refusals)


@pytest.mark.parametrize("kind", ["global", "dp-split"])
def test_counts_other_than_the_solves_are_refused_by_every_node(tmp_path: Path, kind: str) -> None:
    """The coordinator relays class 1's positive count one higher (a classifier solved with it would
    pass the residual): the survivors' own counts sum to the true one, and every node refuses."""
    federation = _federation(tmp_path, kind)

    def tamper(node: int, group: str, envelope: Envelope) -> Envelope:
        if group != "classifier":
            return envelope
        counts = json.loads(str(envelope.meta["verify-counts"]))
        counts["class/1|n_pos/1"] += 1.0
        return Envelope(
            envelope.kind, {**envelope.meta, "verify-counts": json.dumps(counts)}, envelope.payload
        )

    server, _ = _run(federation, tamper=tamper)
    nodes = {n.client_id for n in federation.nodes.values()}
    _refused_by_all(server, federation, nodes, "ClassifierCheckFailedError")


def _summed_acks(transport: InProcessTransport) -> np.ndarray:
    """What the coordinator gets by adding every survivor's masked terms (their acks) itself."""
    total, words = 0, 0
    for _, group, envelope in transport.received:
        if group == "classifier" and envelope.kind == "ack" and envelope.meta.get("verify-masked"):
            masked = MaskedValue.from_bytes("any", envelope.payload).data
            words = len(masked) // 32
            total += sum(
                int.from_bytes(masked[i : i + 32], "big") << (256 * (words - 1 - i // 32))
                for i in range(0, len(masked), 32)
            )
    total %= 2 ** (256 * words)
    return decode_words(total.to_bytes(32 * words, "big"))


def test_counts_changed_at_one_node_put_its_terms_in_no_sum(tmp_path: Path) -> None:
    """The coordinator relays to client-0 alone class 1's positive count and total one higher (its
    negatives unchanged): client-0's terms then shift by (1/(N⁺+1) − 1/N⁺) times its own class-1
    positive sum, which the coordinator could read from the sum of every ack against the honest
    one.  The counts are in the check's transcript: client-0 masks with pads no one cancels, and the
    acks add up to noise, not to its class sum; every node refuses."""
    c = 1
    honest_federation = _federation(tmp_path / "honest", "global")
    honest_server, honest_transport = _server(honest_federation)
    honest_server.deliver(classifier := honest_server.run(), honest_server.sign(classifier))
    honest = _summed_acks(honest_transport)
    d = honest_federation.study.dim
    gamma = honest_federation.study.method.gamma
    # The procedure reads the sum: the honest acks add up to −γ w_c, to rounding.
    assert np.max(np.abs(honest[c * d : (c + 1) * d] + gamma * classifier.weights[:, c])) < 1e-6
    true: dict[str, float] = {}

    def tamper(node: int, group: str, envelope: Envelope) -> Envelope:
        if group != "classifier" or node != 1000:  # client-0
            return envelope
        counts = json.loads(str(envelope.meta["verify-counts"]))
        true["n_pos"] = counts[f"class/{c}|n_pos/{c}"]
        counts[f"class/{c}|n_pos/{c}"] += 1.0
        counts[f"class/{c}|n"] += 1.0
        meta = {**envelope.meta, "verify-counts": json.dumps(counts)}
        return Envelope(envelope.kind, meta, envelope.payload)

    federation = _federation(tmp_path / "tampered", "global")
    server, transport = _server(federation, tamper)
    server.deliver(tampered := server.run(), server.sign(tampered))
    assert np.array_equal(tampered.weights, classifier.weights)  # the same data, the same classifier
    nodes = {n.client_id for n in federation.nodes.values()}
    assert server.report.verified == () and {r["from"] for r in server.report.refusals} == nodes
    features, labels, _ = federation.data["client-0"]
    positives = np.asarray(features, dtype=np.float64)[labels[:, c] == 1].sum(axis=0)
    n_pos = round(true["n_pos"])
    shift = 1.0 / (n_pos + 1) - 1.0 / n_pos
    read = -(_summed_acks(transport) - honest)[c * d : (c + 1) * d] / shift
    assert not np.allclose(read, positives, rtol=1e-3, atol=1e-3), "the sum gave client-0's class sum"


def test_the_studies_not_covered_say_why(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=3)
    ids = [n.client_id for n in federation.nodes.values()]
    study = federation.study
    cases = {
        "CKKS": dataclasses.replace(study, protection="ckks"),
        "two-round": dataclasses.replace(study, method=Method(rounds=2)),
    }
    for words, case in cases.items():
        assert words in str(not_offered(case, ids))
    # DP with --dp-dim or row centring is covered (the kinds above: W_K checked, and W = M W_K)
    lists = {cid: tuple(data[2]) for cid, data in federation.data.items()}
    projected = StudyDp(class_lists=lists, epsilon=1.0, clip=8.0, projection_dim=8, row_centre=True)
    assert not_offered(dataclasses.replace(study, method=Method(balance="global"), dp=projected), ids) is None
    # a growing chain is covered (test_classifier_check_growing.py)
    growing = dataclasses.replace(study, method=Method(balance="global"), extends="0" * 64)
    assert not_offered(growing, ids) is None
    # a DP ridge no node can derive (the adaptive one: from the noisy Gram's spectrum): a coordinator's
    # choice, not checked; a growing DP chain's is (each node's share of its runs' noise is in the sum)
    adaptive = dataclasses.replace(projected, ridge="adaptive")
    why = not_offered(dataclasses.replace(study, method=Method(balance="global"), dp=adaptive), ids)
    assert "'adaptive' is sized from the noisy Gram's smallest eigenvalue" in str(why)
    assert not_offered(dataclasses.replace(growing, dp=projected), ids) is None


@pytest.mark.parametrize("dim", [1, 127, 128, 129, 300])
def test_a_nodes_gram_times_x_from_its_packed_triangle_is_the_full_products(dim: int) -> None:
    import numpy as np

    from secure_afl.deploy.verify import _gram_times

    rng = np.random.default_rng(dim)
    rows = rng.random((20, dim))
    gram, u = rows.T @ rows, rng.uniform(-1, 1, (dim, 3))
    for x in (u, u[:, 0]):  # a d×C matrix and a vector
        got = _gram_times(gram[np.triu_indices(dim)], x)
        assert got.shape == x.shape
        assert np.abs(got - gram @ x).max() <= 1e-13 * np.abs(gram).sum(axis=1).max()


def test_the_checks_secret_comes_from_the_nodes_fresh_seed_so_a_repeated_session_id_repeats_nothing() -> None:
    """The session id is the coordinator's choice: the mask key must not be a function of it and a
    long-term key alone, or a repeated id would repeat an earlier check's pads.  From the node's
    fresh seed, the same id gives another key."""
    from secure_afl.protocol.verify import VerificationError, VerifySecret

    session_id = bytes(32)
    first, second = bytes([1]) * 32, bytes([2]) * 32  # two sessions' fresh seeds, one session id
    secret = VerifySecret.from_seed(first, "client-0", session_id)
    assert secret == VerifySecret.from_seed(first, "client-0", session_id)  # kept with its session
    others = {
        VerifySecret.from_seed(second, "client-0", session_id),
        VerifySecret.from_seed(first, "client-1", session_id),
        VerifySecret.from_seed(first, "client-0", bytes([1]) * 32),
    }
    assert len(others) == 3 and all(o.key != secret.key and len(o.key) == 32 for o in others)
    with pytest.raises(VerificationError, match="32 fresh random bytes"):
        VerifySecret.from_seed(bytes(16), "client-0", session_id)


def test_a_node_commits_to_the_mask_key_of_its_sessions_seed(tmp_path: Path) -> None:
    """Every survivor's R0 commitment names the public key of the mask key kept from its own session
    seed (and the commitments of two federations under one injected session id differ)."""
    from secure_afl.deploy.server import FederationServer
    from secure_afl.deploy.verify import STATE_LABEL
    from secure_afl.protocol.verify import VerifySecret

    session_id = bytes([7]) * 32
    keys = []
    for name in ("one", "two"):
        federation = _federation(tmp_path / name, "global")
        transport = InProcessTransport(federation)  # run_server's server, stopped before the delivery
        FederationServer(
            transport, federation.roster, federation.study, round_timeout=1, signer=federation.signer,
            colluders=federation.colluders, log=lambda s: None, session_ids=[session_id],
        ).run()  # fmt: skip
        for node in federation.nodes.values():
            record = node.state.load(STATE_LABEL)
            assert record is not None and record["session_id"] == session_id.hex()
            own = Commitment.from_text(node.client_id, session_id, str(record["commitment"]))
            assert own.key == VerifySecret(bytes(record["key"])).public_key()
            keys.append(own.key)
    assert len(set(keys)) == len(keys)


def _dp_ridge_federation(tmp_path: Path, ridge: str) -> Federation:
    federation = _federation(tmp_path, "dp-split")
    dp = dataclasses.replace(federation.study.dp, ridge=ridge)
    federation.study = dataclasses.replace(federation.study, dp=dp)
    return federation


@pytest.mark.parametrize("ridge", ["bound", "adassp"])
def test_a_dp_ridge_the_coordinator_chose_is_refused_by_every_node(
    tmp_path: Path, ridge: str, monkeypatch
) -> None:
    """Under DP the solve adds a ridge λ sized from public facts (the noise at the survivors; for
    adassp also the noisy λ_min sum, which the check's own sum gives): each node derives it and
    never takes the file's.  A coordinator that solves with four times λ and records that λ (W is
    then exactly the ridge solve with it) is refused by every node; an honest one is verified."""
    from secure_afl.analytic import AnalyticClassifier
    from secure_afl.deploy.solve import StudySolver

    honest = _dp_ridge_federation(tmp_path / "honest", ridge)
    assert not_offered(honest.study, [n.client_id for n in honest.nodes.values()]) is None
    server, classifier, _ = run_server(honest)
    assert (
        server.report.verified == tuple(classifier.sessions[0]["survivors"]) and server.report.refusals == []
    )
    assert classifier.privacy["ridge_kind"] == ridge and classifier.privacy["ridge"] > 0

    fit = StudySolver.fit

    def chosen_ridge(self, sums, gram_survivors=0):
        fit(self, sums, gram_survivors)
        lam = 4 * self.solved.ridge  # the coordinator's choice, stated in the file and solved with
        self.solved = dataclasses.replace(self.solved, ridge=lam)
        method = self.study.method
        return AnalyticClassifier(
            self.study.n_classes, gamma=method.gamma + lam, balance="global", gram="global"
        ).fit(self.round1)

    monkeypatch.setattr(StudySolver, "fit", chosen_ridge)  # the coordinator's solve only
    federation = _dp_ridge_federation(tmp_path / "chosen", ridge)
    server, data = _run(federation, change=None)
    assert json.loads(data)["differential_privacy"]["ridge"] == pytest.approx(
        4 * classifier.privacy["ridge"], rel=0.5
    )
    nodes = {n.client_id for n in federation.nodes.values()}
    _refused_by_all(server, federation, nodes, "ClassifierCheckFailedError")
    assert all(
        "DP record states ridge other than the study's" in r["message"] for r in server.report.refusals
    )


@pytest.mark.parametrize("key", ["gram_noise_std", "ridge_noise_bound"])
def test_a_misstated_dp_noise_is_refused_by_every_node(tmp_path: Path, key: str) -> None:
    """The record's noise std and bound are what the survivors' sum derives, not the coordinator's word."""
    federation = _dp_ridge_federation(tmp_path, "bound")
    server, _ = _run(
        federation,
        change=lambda c: dataclasses.replace(c, privacy={**c.privacy, key: c.privacy[key] / 2}),
    )
    nodes = {n.client_id for n in federation.nodes.values()}
    _refused_by_all(server, federation, nodes, "ClassifierCheckFailedError")
    assert all(f"DP record states {key} other than" in r["message"] for r in server.report.refusals)


def test_an_adassp_ridge_lowered_by_the_noisy_eigenvalue_sum_is_verified_by_every_node(
    tmp_path: Path,
) -> None:
    """With more rows and less noise the survivors' noisy λ_min sum gives λ̃_min > 0, which lowers the
    adassp ridge below the bound: every node derives it from that sum (one more value in the check's
    masked sum), so the honest classifier verifies only if the sum carries it right."""
    method = Method(balance="global", min_pos=1, min_neg=1, tau=0.5)
    federation = make_federation(tmp_path, n_clients=4, active=DP_ACTIVE, method=method, rows=400, dim=4)
    dp = StudyDp(class_lists=dict(DP_ACTIVE), epsilon=50.0, clip=2.0, ridge="adassp")
    federation.study = dataclasses.replace(federation.study, dp=dp)
    server, classifier, _ = run_server(federation)
    privacy = classifier.privacy
    assert privacy["min_eigenvalue_lower_bound"] > 0 and privacy["ridge"] < privacy["ridge_noise_bound"]
    assert server.report.refusals == [] and server.report.verified == tuple(
        classifier.sessions[0]["survivors"]
    )
