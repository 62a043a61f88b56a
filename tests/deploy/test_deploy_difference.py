"""Round 1 of a deployment with the per-class Gram sent by difference (study.round1_plan): the server
and every node plan alike from the study's published class lists, the classifier and the method's
sums are bit for bit those of the same federation without the plan, and the small federations of
the other deploy tests (and DP, CKKS, round 2) make no plan."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from secure_afl.deploy.errors import ConfigurationError, FederationAbortedError
from secure_afl.deploy.server import FederationServer
from secure_afl.deploy.study import Method, Study, StudyDp, round1_layout, round1_plan

from .helpers import Federation, InProcessTransport, make_federation

# Twelve institutions, three classes: five miss class 0, five miss class 1, two label all.  With
# t = 9 (n - t = 3 may drop) the complements of class 0 and 1 keep 5 - 3 >= 2 members, and class 2's
# group is everyone: its Gram sum is the `all` sum (an everyone-group the plan adds, hidden).
PLANNED = {
    **{f"client-{k}": (1, 2) for k in range(5)},
    **{f"client-{k}": (0, 2) for k in range(5, 10)},
    **{f"client-{k}": (0, 1, 2) for k in range(10, 12)},
}
METHOD = Method(gram="class", balance="client", min_pos=1, min_neg=1)


class RecordingServer(FederationServer):
    """The deployment's server, keeping each session's outcome (the method's sums) for comparison."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outcomes: list[Any] = []

    def _session(self, *args: Any, **kwargs: Any) -> Any:
        record, outcome = super()._session(*args, **kwargs)
        self.outcomes.append(outcome)
        return record, outcome


def _federation(tmp_path: Path, *, published: bool) -> Federation:
    federation = make_federation(tmp_path, n_clients=12, dim=8, rows=40, active=PLANNED, method=METHOD)
    for node in federation.nodes.values():  # the per-class Gram is each node's opt-in
        node.settings = dataclasses.replace(node.settings, allow_class_gram=True)
    if published:
        federation.study = dataclasses.replace(federation.study, class_lists=dict(PLANNED))
    return federation


def _run(federation: Federation) -> tuple[RecordingServer, Any, list[str]]:
    lines: list[str] = []
    transport = InProcessTransport(federation)
    server = RecordingServer(
        transport, federation.roster, federation.study, round_timeout=1, signer=federation.signer,
        colluders=federation.colluders, log=lines.append,
    )  # fmt: skip
    classifier = server.run()
    server.deliver(classifier)
    return server, classifier, lines


def test_a_planned_deployment_gives_the_unplanned_classifier_and_sums_bit_for_bit(tmp_path: Path) -> None:
    planned = _federation(tmp_path / "planned", published=True)
    direct = _federation(tmp_path / "direct", published=False)
    layout, plan = round1_plan(planned.study, PLANNED)
    assert plan is not None, "twelve institutions, most labelling each class: the planner must plan"
    assert set(plan.complements) == {"class/0", "class/1", "class/2"}
    assert plan.complements["class/2"] is None and plan.everyone_added  # everyone labels class 2
    assert plan.savings == {"direct": 7 + 7 + 12, "wire": 12 + 5 + 5}
    assert {g for g in layout.groups if g.startswith("others/")} == {"others/class/0", "others/class/1"}
    assert round1_plan(direct.study, PLANNED) == (round1_layout(direct.study), None)
    for federation in (planned, direct):  # one dropout after the keys: the complements keep >= 2
        federation.nodes[1003].dead_from = "s1-R2"  # client-3, which misses class 0
    server_p, classifier_p, log_p = _run(planned)
    server_d, classifier_d, log_d = _run(direct)

    assert np.array_equal(classifier_p.weights, classifier_d.weights)
    sums_p, sums_d = server_p.outcomes[0].sums, server_d.outcomes[0].sums
    assert sums_p.keys() == sums_d.keys() == {"class/0", "class/1", "class/2"}
    for group, tensors in sums_d.items():
        assert sums_p[group].keys() == tensors.keys()
        for name, value in tensors.items():
            assert np.array_equal(sums_p[group][name], value), (group, name)
    survivors = tuple(sorted(f"client-{k}" for k in range(12) if k != 3))
    assert server_p.report.sessions[0].survivors == server_d.report.sessions[0].survivors == survivors

    # The nodes joined the groups the plan says (their signed advertisements): `all`, the complement
    # of each class they miss, and the class groups they label (for the other tensors).
    adverts = {
        node: planned.study.backend(12).decode(reply.payload, 1 << 24)
        for node, group, reply in server_p.transport.received
        if group == "s1-R0"
    }
    assert set(adverts[1000].groups) == {"all", "others/class/0", "class/1", "class/2"}  # misses class 0
    assert set(adverts[1011].groups) == {"all", "class/0", "class/1", "class/2"}  # labels every class
    assert "round 1: 3 class Gram(s) sent by difference (22 Gram copies instead of 26)" in log_p
    assert not any("by difference" in line for line in log_d)
    # The audit names the wire groups (what the server learned) and how each class Gram was derived.
    audit = {g["name"]: g for g in classifier_p.audit["groups"]}
    assert set(audit) == {"all", "class/0", "class/1", "class/2", "others/class/0", "others/class/1"}
    assert audit["others/class/0"]["members"] == [f"client-{k}" for k in range(5)]
    assert audit["others/class/0"]["survivors"] == [f"client-{k}" for k in range(5) if k != 3]
    assert audit["others/class/0"]["tensors"] == ["gram"]
    assert audit["class/0"]["derived"] == {"gram": {"added": ["all"], "subtracted": ["others/class/0"]}}
    assert audit["class/2"]["derived"] == {"gram": {"added": ["all"], "subtracted": []}}
    assert "gram" not in audit["class/0"]["tensors"] and "b/0" in audit["class/0"]["tensors"]
    audit_d = {g["name"]: g for g in classifier_d.audit["groups"]}
    assert set(audit_d) == {"class/0", "class/1", "class/2"} and "derived" not in audit_d["class/0"]
    for name in ("class/0", "class/1", "class/2"):  # the method's groups: the same members either way
        assert audit[name]["members"] == audit_d[name]["members"]
        assert audit[name]["survivors"] == audit_d[name]["survivors"]


def test_the_small_federations_of_the_deploy_tests_make_no_plan(tmp_path: Path) -> None:
    """The other deploy tests' studies publish no class lists: their layout is the method's own.
    Published, the lists of their three to six institutions form a complement group only where it
    has at least the minimum group size (2) and fewer members than its class group; a class that
    everyone labels takes its Gram sum from the `all` group (no complement: nothing can shrink)."""
    federations = {
        "default": {f"client-{k}": tuple(c for c in range(3) if c != k) for k in range(4)},
        "five": {"client-0": (1, 2), "client-1": (1, 2), "client-2": (0, 1, 2), "client-3": (0, 1, 2),
                 "client-4": (0, 2)},
        "six": {"client-0": (0, 1, 2), "client-1": (0, 1, 2), "client-2": (0, 1, 2), "client-3": (1, 2),
                "client-4": (2,), "client-5": (2,)},
        "everyone": {f"client-{k}": (0, 1, 2) for k in range(3)},
    }  # fmt: skip
    base = make_federation(tmp_path, n_clients=3).study
    methods = (
        Method(),
        Method(gram="class"),
        Method(gram="class", rounds=2),
        Method(gram="class", balance="global"),
    )
    planned = set()
    for name, lists in federations.items():
        for method in methods:
            unpublished = dataclasses.replace(base, method=method)
            assert round1_plan(unpublished, lists) == (round1_layout(unpublished), None), (name, method)
            layout, plan = round1_plan(dataclasses.replace(unpublished, class_lists=lists), lists)
            if plan is None:
                assert not any(g.startswith("others/") for g in layout.groups), (name, method)
                continue
            for group, complement in plan.complements.items():
                inside = {cid for cid, classes in lists.items() if int(group.split("/")[1]) in classes}
                if complement is None:  # a class everyone labels: its Gram sum is the `all` group's
                    assert inside == set(lists), (name, method, group)
                    continue
                outside = set(lists) - inside
                assert set(plan.members[complement]) == outside, (name, method, group)
                assert 2 <= len(outside) < len(inside), (name, method, group)
                planned.add((name, group))
    # Two such complements, both of 2: five institutions' class 0 and six institutions' class 1.
    assert planned == {("five", "class/0"), ("six", "class/1")}


def test_no_plan_under_dp_or_ckks_and_only_with_the_rosters_lists(tmp_path: Path) -> None:
    base = make_federation(tmp_path, n_clients=3).study
    planned = dataclasses.replace(base, method=METHOD, class_lists=dict(PLANNED))
    assert round1_plan(planned, PLANNED)[1] is not None
    ckks = dataclasses.replace(planned, protection="ckks")
    assert round1_plan(ckks, PLANNED) == (round1_layout(ckks), None)  # approximate sums: never
    dp = dataclasses.replace(
        base, method=Method(gram="global", balance="global"), dp=StudyDp(epsilon=1.0, class_lists=PLANNED)
    )
    assert round1_plan(dp, PLANNED) == (round1_layout(dp), None)  # the DP layout: no per-class Gram
    with pytest.raises(ConfigurationError, match="not twice"):
        dataclasses.replace(dp, class_lists=dict(PLANNED))
    with pytest.raises(ConfigurationError, match="the roster"):
        round1_plan(planned, [*PLANNED, "client-12"])
    # The lists travel with the study (its digest covers them); a study without keeps its document.
    assert Study.from_json(planned.to_json()) == planned
    assert "class_lists" not in base.to_json() and Study.from_json(base.to_json()) == base


def test_a_node_refuses_a_published_list_that_is_not_its_own(tmp_path: Path) -> None:
    federation = make_federation(tmp_path, n_clients=3, dim=6, rows=30, method=Method(min_pos=1, min_neg=1))
    lists = {cid: active for cid, (_, _, active) in federation.data.items()}
    lists["client-0"] = (0, 1, 2)  # client-0 labels only classes 1 and 2
    federation.study = dataclasses.replace(federation.study, class_lists=lists)
    transport = InProcessTransport(federation)
    server = FederationServer(
        transport, federation.roster, federation.study, round_timeout=1, signer=federation.signer,
        colluders=0, log=lambda s: None,
    )  # fmt: skip
    with pytest.raises(FederationAbortedError):
        server.run()
    refusals = [r for r in server.report.refusals if r["from"] == "client-0"]
    assert refusals and refusals[0]["error"] == "StudyMismatchError"
    assert "round 1's groups are planned from these lists" in refusals[0]["message"]


def test_the_run_configs_class_lists_are_published_in_a_study_without_dp() -> None:
    from secure_afl.deploy.apps import study_from_run_config

    config = {
        "classes": "A,B,C",
        "dim": 4,
        "backbone": "toy",
        "weights-id": "sha256:00",
        "preprocessing": "none",
    }
    assert study_from_run_config(config).class_lists == {}
    plain = study_from_run_config({**config, "gram": "class", "class-lists": "h-a=0,1; h-b=2,1"})
    assert plain.class_lists == {"h-a": (0, 1), "h-b": (1, 2)} and plain.dp is None
    private = study_from_run_config({**config, "class-lists": "h-a=0,1; h-b=2,1", "dp-epsilon": 1.0})
    assert private.class_lists == {} and private.dp is not None  # DP keeps them in its own settings
    assert private.dp.class_lists == plain.class_lists


# Six institutions, three classes, each labelling one (two per class): the class groups partition
# the roster, so under round 2 (which needs the `all` group's Gram) that sum is the class groups'
# added, and no node sends its Gram to `all` (a partition plan).
PARTITIONED = {f"client-{k}": (k % 3,) for k in range(6)}


def test_a_partitioned_deployment_sums_the_global_gram_from_the_classes_bit_for_bit(tmp_path: Path) -> None:
    method = dataclasses.replace(METHOD, rounds=2)
    federations = {}
    for name, published in (("planned", True), ("direct", False)):
        federation = make_federation(
            tmp_path / name, n_clients=6, dim=8, rows=40, active=PARTITIONED, method=method
        )
        for node in federation.nodes.values():
            node.settings = dataclasses.replace(node.settings, allow_class_gram=True)
        if published:
            federation.study = dataclasses.replace(federation.study, class_lists=dict(PARTITIONED))
        federations[name] = federation
    layout, plan = round1_plan(federations["planned"].study, PARTITIONED)
    assert plan is not None and plan.parts == ("class/0", "class/1", "class/2")  # type: ignore[union-attr]
    assert "all" not in layout.groups and plan.savings == {"direct": 12, "wire": 6}
    server_p, classifier_p, log_p = _run(federations["planned"])
    server_d, classifier_d, _ = _run(federations["direct"])

    assert np.array_equal(classifier_p.weights, classifier_d.weights)  # round 2 solves with `all`
    sums_p, sums_d = server_p.outcomes[0].sums, server_d.outcomes[0].sums
    assert sums_p.keys() == sums_d.keys() == {"all", "class/0", "class/1", "class/2"}
    for group, tensors in sums_d.items():
        for name, value in tensors.items():
            assert np.array_equal(sums_p[group][name], value), (group, name)
    adverts = {
        node: federations["planned"].study.backend(6).decode(reply.payload, 1 << 24)
        for node, group, reply in server_p.transport.received
        if group == "s1-R0"
    }
    assert all(set(advert.groups) == {f"class/{(node - 1000) % 3}"} for node, advert in adverts.items())
    assert "round 1: the all group's Gram summed from the 3 class groups" in "\n".join(log_p)
    audit = {g["name"]: g for g in classifier_p.audit["groups"] if g["session"] == "1"}
    assert audit["all"]["derived"] == {"gram": {"added": ["class/0", "class/1", "class/2"], "subtracted": []}}
    assert audit["all"]["members"] == audit["all"]["survivors"] == sorted(PARTITIONED)
