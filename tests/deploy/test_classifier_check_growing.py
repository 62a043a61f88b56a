"""The classifier check (SECURITY.md §5.1) over a growing chain: a growing study's sums are the sums
of the chain it extends plus this run's uploads, and each node forms its term from the values it
kept of every run that included it (LEDGER_DIR/check-values/, one record per chain).  Every run's
classifier is verified by every survivor; one changed weight in a later run is refused by every
node; a node that lost an earlier run's values, an earlier contributor absent from this session, or
a chain record that omits a run leave the classifier unverified (never wrongly verified)."""

from __future__ import annotations

import dataclasses
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from secure_afl.deploy.classifier import HISTORY_DIR, Classifier, history_name
from secure_afl.deploy.server import FederationServer
from secure_afl.deploy.study import Method, Study, StudyDp
from secure_afl.deploy.verify import KEPT_DIR, not_offered, verification_status

from .helpers import Federation, InProcessTransport, check_study, make_federation
from .test_classifier_check import _perturb
from .test_growing import _arrive as arrive

ROWS, ARRIVALS = 24, (8, 16, 24)  # each hospital's rows arrive in three batches


def _federation(tmp_path: Path, dp: bool = False, active: dict | None = None) -> tuple[Federation, dict]:
    from secure_afl.features.file import load_feature_file

    method = Method(balance="global")
    federation = make_federation(tmp_path, n_clients=4, dim=6, rows=ROWS, method=method, active=active)
    if dp:
        lists = {cid: tuple(data[2]) for cid, data in federation.data.items()}
        federation.study = dataclasses.replace(
            federation.study, dp=StudyDp(class_lists=lists, epsilon=2.0, clip=8.0)
        )
    full = {
        n.client_id: load_feature_file(n.settings.features, require_labels=True)
        for n in federation.nodes.values()
    }
    return federation, full


def _arrive(federation: Federation, full: dict, n: int) -> None:
    """Each hospital's feature file now holds its first ``n`` rows; a new Flower run (state forgotten)."""
    arrive(federation, full, {node.client_id: n for node in federation.nodes.values()})
    for node in federation.nodes.values():
        node.dead_from = None


def _run(
    federation: Federation,
    study: Study,
    earlier=None,
    change: Callable[[Classifier], Classifier] | None = None,
) -> FederationServer:
    check_study(federation, study, nodes=list(federation.nodes))
    server = FederationServer(
        InProcessTransport(federation), federation.roster, study, round_timeout=1, log=lambda s: None,
        signer=federation.signer, colluders=0, earlier=earlier,
    )  # fmt: skip
    classifier = server.run()
    if change is not None:
        classifier = change(classifier)
    server.deliver(classifier, server.sign(classifier))
    server.classifier = classifier  # type: ignore[attr-defined]
    return server


def _chain(federation: Federation, full: dict, runs: int) -> list[FederationServer]:
    """``runs`` honest runs of a growing chain, each extending the last."""
    servers: list[FederationServer] = []
    for k in range(runs):
        _arrive(federation, full, ARRIVALS[k])
        study = federation.study
        if servers:
            study = dataclasses.replace(study, extends=servers[-1].study.digest())
        servers.append(_run(federation, study, servers[-1].accumulated if servers else None))
    return servers


def _next(federation: Federation, full: dict, servers: list[FederationServer], **kwargs) -> FederationServer:
    _arrive(federation, full, ARRIVALS[len(servers)])
    study = dataclasses.replace(federation.study, extends=servers[-1].study.digest())
    for node_id, dead_from in kwargs.pop("dead", {}).items():
        federation.nodes[node_id].dead_from = dead_from
    return _run(federation, study, servers[-1].accumulated, **kwargs)


def _errors(server: FederationServer) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for refusal in server.report.refusals:
        out.setdefault(refusal["error"], set()).add(refusal["from"])
    return out


@pytest.mark.parametrize("dp", [False, True], ids=["global", "dp"])
def test_every_run_of_a_growing_chain_is_verified_by_every_survivor(tmp_path: Path, dp: bool) -> None:
    federation, full = _federation(tmp_path, dp)
    grown = dataclasses.replace(federation.study, extends="0" * 64)
    assert not_offered(grown, [n.client_id for n in federation.nodes.values()]) is None
    servers = _chain(federation, full, 3)
    everyone = tuple(sorted(n.client_id for n in federation.nodes.values()))
    for k, server in enumerate(servers):
        assert server.report.refusals == [], (k, server.report.refusals)
        assert server.report.verified == everyone and server.report.acknowledged == everyone, k
    assert len(servers[-1].classifier.protocol["growth"]["chain"]) == 3
    for node in federation.nodes.values():
        said = verification_status(node.settings.out_dir / "classifier.json")
        assert said.startswith("classifier check: verified by this node"), said
        # one record per chain (the runs folded into it), this node's alone, 0600 in a 0700 dir
        kept = node.settings.ledger_dir / KEPT_DIR
        files = sorted(p.name for p in kept.iterdir())
        assert files == [f"chain-{servers[-1].classifier.sessions[0]['session_id']}.npz"], files
        assert stat.S_IMODE(kept.stat().st_mode) == 0o700
        assert stat.S_IMODE((kept / files[0]).stat().st_mode) == 0o600


def test_one_changed_weight_in_a_later_run_is_refused_by_every_node(tmp_path: Path) -> None:
    federation, full = _federation(tmp_path)
    servers = _chain(federation, full, 2)
    third = _next(federation, full, servers, change=_perturb)
    everyone = {n.client_id for n in federation.nodes.values()}
    assert third.report.verified == () and third.report.acknowledged == ()
    assert _errors(third) == {"ClassifierCheckFailedError": everyone}, third.report.refusals
    stored = history_name(third.sign(third.classifier))  # held until verified: never stored
    assert not any((n.settings.out_dir / HISTORY_DIR / stored).exists() for n in federation.nodes.values())


def test_a_node_that_lost_an_earlier_runs_values_leaves_the_classifier_unverified(tmp_path: Path) -> None:
    federation, full = _federation(tmp_path)
    servers = _chain(federation, full, 1)
    lost = federation.nodes[1000]
    for path in (lost.settings.ledger_dir / KEPT_DIR).iterdir():  # a chain started before nodes kept them
        path.unlink()
    second = _next(federation, full, servers)
    errors = _errors(second)
    assert second.report.verified == ()
    assert errors.get("UnverifiedClassifierError") == {lost.client_id}, second.report.refusals
    assert "ClassifierCheckFailedError" not in errors  # unverified, not failed
    message = next(r["message"] for r in second.report.refusals if r["from"] == lost.client_id)
    assert "keeps no values of that run" in message and "start a new chain" in message


def test_an_earlier_contributor_absent_from_this_session_leaves_the_classifier_unverified(
    tmp_path: Path,
) -> None:
    # every hospital labels every class: three survivors' sums isolate none (the exposure check)
    federation, full = _federation(tmp_path, active={f"client-{k}": (0, 1, 2) for k in range(4)})
    servers = _chain(federation, full, 1)
    second = _next(federation, full, servers, dead={1003: "s1-R1"})  # client-3 is gone after R0
    survivors = set(second.classifier.sessions[0]["survivors"])
    assert survivors == {"client-0", "client-1", "client-2"}
    assert second.report.verified == ()
    assert _errors(second) == {"UnverifiedClassifierError": survivors}, second.report.refusals
    assert all("client-3" in r["message"] for r in second.report.refusals)


@pytest.mark.parametrize("dp", [False, True], ids=["global", "dp"])
def test_a_node_that_joins_a_later_run_verifies_it_with_its_values_alone(tmp_path: Path, dp: bool) -> None:
    """client-3 is gone after R0 of run 1 (not a survivor: nothing of it in the sums), then takes
    part in run 2: its term is its run-2 values alone, the others' both runs', and all verify.  Under
    DP the ridge is sized from both runs' noise (run 1's at its three survivors), which client-3's
    shares cover only for run 2: the sum still gives it."""
    active = {f"client-{k}": (0, 1, 2) for k in range(4)}
    federation, full = _federation(tmp_path, dp=dp, active=active)
    _arrive(federation, full, ARRIVALS[0])
    federation.nodes[1003].dead_from = "s1-R1"
    first = _run(federation, federation.study)
    assert "client-3" not in first.classifier.sessions[0]["survivors"]
    second = _next(federation, full, [first])
    assert second.report.refusals == [], second.report.refusals
    assert second.report.verified == ("client-0", "client-1", "client-2", "client-3")
    if dp:  # two runs' noise at different survivor counts: the chain's ridge is theirs, not one run's
        sessions = second.classifier.privacy["growth"]["sessions"]
        assert len(sessions) == 2 and sessions[0]["gram_noise_std"] != sessions[1]["gram_noise_std"]


@pytest.mark.parametrize("omitted", ["run 1", "run 2", "a survivor of run 1"])
def test_a_chain_record_that_omits_a_run_leaves_the_classifier_unverified(
    tmp_path: Path, omitted: str
) -> None:
    """The third run's classifier records its chain without run 1, run 2 (every node took part in
    both) or client-0 among run 1's survivors: without run 2 the chain does not end after the study
    the third extends; without run 1 or with run 1's survivors changed it is not the chain the nodes
    checked run 2's classifier with (their record of runs 1-2, into which run 2's values were folded)."""
    federation, full = _federation(tmp_path)
    servers = _chain(federation, full, 2)

    def omit(classifier: Classifier) -> Classifier:
        growth = dict(classifier.protocol["growth"])
        chain = [dict(e) for e in growth["chain"]]
        if omitted == "a survivor of run 1":
            chain[0]["survivors"] = [s for s in chain[0]["survivors"] if s != "client-0"]
        else:
            del chain[int(omitted[-1]) - 1]
        growth["chain"] = chain
        return dataclasses.replace(classifier, protocol={**classifier.protocol, "growth": growth})

    third = _next(federation, full, servers, change=omit)
    everyone = {n.client_id for n in federation.nodes.values()}
    assert third.report.verified == () and third.report.acknowledged == ()
    assert _errors(third) == {"UnverifiedClassifierError": everyone}, third.report.refusals
    words = {"run 1": "keeps no values of that run", "run 2": "does not match this node's run"}
    said = words.get(omitted, "differs from the one this node checked")
    assert all(said in r["message"] for r in third.report.refusals), third.report.refusals


@pytest.mark.parametrize("dp", [False, True], ids=["global", "dp"])
def test_a_withheld_runs_survivors_misstated_in_the_next_are_refused_before_any_term(
    tmp_path: Path, dp: bool
) -> None:
    """The coordinator withholds run 1's classifier (no node folded run 1 into a chain record it
    checked), then records run 1 in run 2's file without client-0.  Had client-0 believed it, it would
    leave its run-1 values out of its terms while the sums hold them: the coordinator, who knows the
    sum, would read client-0's run-1 residual and counts (under DP also the survivor count sizing the
    noise shares would be its word).  Every node compares run 1's survivors with the set it signed in
    R3 (its ledger) and refuses before sending anything; nothing is stored."""
    federation, full = _federation(tmp_path, dp)
    _arrive(federation, full, ARRIVALS[0])
    first = FederationServer(
        InProcessTransport(federation), federation.roster, federation.study, round_timeout=1,
        log=lambda s: None, signer=federation.signer, colluders=0,
    )  # fmt: skip
    first.run()  # the sums kept; the classifier never delivered

    def omit(classifier: Classifier) -> Classifier:
        growth = dict(classifier.protocol["growth"])
        chain = [dict(e) for e in growth["chain"]]
        chain[0]["survivors"] = [s for s in chain[0]["survivors"] if s != "client-0"]
        return dataclasses.replace(
            classifier, protocol={**classifier.protocol, "growth": {**growth, "chain": chain}}
        )

    second = _next(federation, full, [first], change=omit)
    everyone = {n.client_id for n in federation.nodes.values()}
    assert second.report.verified == () and second.report.acknowledged == ()
    assert _errors(second) == {"VerificationError": everyone}, second.report.refusals
    # refused as the file arrived, in place of the ack that would have carried the masked terms
    refusals = second.report.refusals
    assert all(r["at"] == "classifier" and "in its R3" in r["message"] for r in refusals), refusals
    assert not any((n.settings.out_dir / "classifier.json").exists() for n in federation.nodes.values())


def test_a_growing_dp_chains_ridge_the_coordinator_chose_is_refused_by_every_node(
    tmp_path: Path, monkeypatch
) -> None:
    """A growing DP chain's ridge is sized from every run's noise (√Σ_r s_r²): each node adds its share
    s_r²/m_r of every run it was among the m_r survivors of, so the survivors' sum gives it, and no
    node takes the file's λ.  A later run solved with half the chain's λ (and stating it) is refused
    by every node."""
    from secure_afl.analytic import AnalyticClassifier
    from secure_afl.deploy.solve import StudySolver

    federation, full = _federation(tmp_path, dp=True)
    servers = _chain(federation, full, 2)
    fit = StudySolver.fit

    def halved_ridge(self, sums, gram_survivors=0):
        fit(self, sums, gram_survivors)
        lam = self.solved.ridge / 2  # as if the earlier runs had added no noise
        self.solved = dataclasses.replace(self.solved, ridge=lam)
        return AnalyticClassifier(
            self.study.n_classes, gamma=self.study.method.gamma + lam, balance="global", gram="global"
        ).fit(self.round1)

    monkeypatch.setattr(StudySolver, "fit", halved_ridge)  # the coordinator's solve only
    third = _next(federation, full, servers)
    everyone = {n.client_id for n in federation.nodes.values()}
    assert third.report.verified == () and third.report.acknowledged == ()
    assert _errors(third) == {"ClassifierCheckFailedError": everyone}, third.report.refusals
    assert all("DP record states ridge" in r["message"] for r in third.report.refusals)


def _restated(classifier: Classifier, run: int, institution: str) -> Classifier:
    """The classifier with run ``run``'s ε at ``institution`` halved in its chain record, and the
    chain's growth record restated from the changed runs (consistent: only run members can tell)."""
    from secure_afl.deploy.verify import chain_record

    growth = dict(classifier.protocol["growth"])
    chain = [dict(e) for e in growth["chain"]]
    dp = dict(chain[run]["dp"])
    dp["epsilon_spent"] = {**dp["epsilon_spent"], institution: dp["epsilon_spent"][institution] / 2}
    chain[run]["dp"] = dp
    changed = dataclasses.replace(
        classifier, protocol={**classifier.protocol, "growth": {**growth, "chain": chain}}
    )
    restated = chain_record(changed)
    assert restated is not None and restated != classifier.privacy["growth"]
    return dataclasses.replace(changed, privacy={**classifier.privacy, "growth": restated})


def test_a_misstated_dp_run_is_refused_by_every_node(tmp_path: Path) -> None:
    """Run 1's record in the second run's file states half the ε client-0 spent there, and the chain's
    ε is restated from it: the noise, and so the ridge, are unchanged.  Only run 1's members (client-0,
    -1, -2) can derive its record; client-3 joined in run 2, and refuses too, from the survivors' sum
    of misstated-run counts."""
    active = {f"client-{k}": (0, 1, 2) for k in range(4)}
    federation, full = _federation(tmp_path, dp=True, active=active)
    _arrive(federation, full, ARRIVALS[0])
    federation.nodes[1003].dead_from = "s1-R1"
    first = _run(federation, federation.study)
    second = _next(federation, full, [first], change=lambda c: _restated(c, 0, "client-0"))
    everyone = {n.client_id for n in federation.nodes.values()}
    assert second.report.verified == () and second.report.acknowledged == ()
    assert _errors(second) == {"ClassifierCheckFailedError": everyone}, second.report.refusals
    assert all("3 of the survivors found" in r["message"] for r in second.report.refusals)


@pytest.mark.parametrize("change", ["epsilon_chain", "omitted"])
def test_a_misstated_chain_epsilon_is_refused_by_every_node(tmp_path: Path, change: str) -> None:
    """The chain's ε per institution (what `predict` reports of a growing DP classifier) follows
    from its runs' records, which the nodes check: a file stating another, or none (a key the study's
    file holds, missing), is refused."""
    federation, full = _federation(tmp_path, dp=True)
    servers = _chain(federation, full, 1)

    def misstate(classifier: Classifier) -> Classifier:
        privacy = dict(classifier.privacy)
        if change == "omitted":
            del privacy["growth"]
        else:
            growth = dict(privacy["growth"])
            growth["epsilon_chain"] = {k: v / 2 for k, v in growth["epsilon_chain"].items()}
            privacy["growth"] = growth
        return dataclasses.replace(classifier, privacy=privacy)

    second = _next(federation, full, servers, change=misstate)
    everyone = {n.client_id for n in federation.nodes.values()}
    assert second.report.verified == () and second.report.acknowledged == ()
    if change == "omitted":  # a record without the part a growing study's file holds: refused on arrival
        assert _errors(second) == {"ClassifierNotOfStudyError": everyone}, second.report.refusals
        assert all("does not define" in r["message"] for r in second.report.refusals)
        return
    assert _errors(second) == {"ClassifierCheckFailedError": everyone}, second.report.refusals
    assert all("DP record states growth" in r["message"] for r in second.report.refusals)
