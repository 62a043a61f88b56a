"""A classifier file's audit of the groups (what the coordinator learned: each group's members and
survivors, the tensors summed, how a derived sum is formed) is derived by every node, from the
advertisements it was shown and the survivor set it signed in R3, with the solve's own function
(``Layout.group_records``): a file stating other groups is refused by every node on delivery.  A
coordinator could otherwise hide a group summed over one hospital, or a member it dropped, from
whoever reads the file."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from secure_afl.deploy.classifier import Classifier

from .helpers import make_federation, run_server
from .test_classifier_check import _refused_by_all, _run
from .test_deploy_difference import _federation as _planned


def _groups(change: Callable[[list[dict]], list[dict]]) -> Callable[[Classifier], Classifier]:
    def changed(c: Classifier) -> Classifier:
        groups = change([dict(g) for g in c.audit["groups"]])
        return dataclasses.replace(c, audit={**c.audit, "groups": groups})

    return changed


def _more_survivors(groups: list[dict]) -> list[dict]:  # a dropout hidden: every member survived
    return [{**g, "survivors": list(g["members"])} for g in groups]


def _one_member_fewer(groups: list[dict]) -> list[dict]:
    g = next(g for g in groups if len(g["members"]) > 2)
    g["members"] = g["members"][1:]
    g["survivors"] = [c for c in g["survivors"] if c in g["members"]]
    return groups


def _one_group_fewer(groups: list[dict]) -> list[dict]:
    return groups[1:]


def _fewer_tensors(groups: list[dict]) -> list[dict]:  # a sum the server learned left out
    groups[0]["tensors"] = groups[0]["tensors"][:-1]
    return groups


def _stray_session(groups: list[dict]) -> list[dict]:  # groups of a session the file does not record
    return [*groups, {**groups[0], "session": "3"}]


CHANGES = {
    "survivors": _more_survivors,
    "members": _one_member_fewer,
    "a group": _one_group_fewer,
    "tensors": _fewer_tensors,
    "a stray session": _stray_session,
}


def test_an_honest_files_audit_is_what_every_node_derived(tmp_path: Path) -> None:
    """With a dropout (client-2 gone after advertising: a member, not a survivor) every node's record
    of the session's groups is the file's audit, and every node stores the file."""
    federation = make_federation(tmp_path, n_clients=4)
    federation.nodes[1002].dead_from = "s1-R1"
    server, classifier, _ = run_server(federation)
    assert server.report.refusals == []
    stated = classifier.audit["groups"]
    assert any(g["members"] != g["survivors"] for g in stated)  # the dropout is in the audit
    for node in federation.nodes.values():
        if node.client_id == "client-2":
            continue
        done = node.state.load("1")
        assert done["status"] == "done"
        view = json.loads(done["view"])
        assert view["groups"] == [{k: v for k, v in g.items() if k != "session"} for g in stated]
        assert (
            view["participants"]
            == classifier.sessions[0]["participants"]
            == [f"client-{k}" for k in range(4)]
        )
        assert (
            view["survivors"] == classifier.sessions[0]["survivors"] == ["client-0", "client-1", "client-3"]
        )


SESSION = {  # client-2 advertised (it took part) and dropped before R2
    "participants": lambda s: {**s, "participants": list(s["survivors"])},  # it never took part
    "survivors": lambda s: {**s, "survivors": list(s["participants"])},  # nobody dropped
}


@pytest.mark.parametrize("field", list(SESSION))
def test_a_misstated_session_record_is_refused_by_every_node(tmp_path: Path, field: str) -> None:
    def hidden(c: Classifier) -> Classifier:
        return dataclasses.replace(c, sessions=(SESSION[field](dict(c.sessions[0])), *c.sessions[1:]))

    federation = make_federation(tmp_path, n_clients=4)
    federation.nodes[1002].dead_from = "s1-R1"
    server, _ = _run(federation, change=hidden)
    _refused_by_all(server, federation, {"client-0", "client-1", "client-3"}, "ClassifierAuditMisstatedError")
    assert all(f"states session 1's {field} other than" in r["message"] for r in server.report.refusals)


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_misstated_audit_is_refused_by_every_node(tmp_path: Path, change: str) -> None:
    federation = make_federation(tmp_path, n_clients=4)
    federation.nodes[1002].dead_from = "s1-R1"
    server, _ = _run(federation, change=_groups(CHANGES[change]))
    _refused_by_all(server, federation, {"client-0", "client-1", "client-3"}, "ClassifierAuditMisstatedError")
    assert all("misstated what it learned" in r["message"] for r in server.report.refusals)


def test_a_difference_plans_derivation_misstated_is_refused_by_every_node(tmp_path: Path) -> None:
    """Under a difference plan the audit says which wire sums give each derived sum: a file naming
    another recipe (a derived sum said to be one wire sum alone) is refused."""
    federation = _planned(tmp_path, published=True)

    def recipe(groups: list[dict]) -> list[dict]:
        g = next(g for g in groups if "derived" in g)  # StopIteration: the plan derived no sum
        tensor, how = next(iter(g["derived"].items()))
        g["derived"] = {**g["derived"], tensor: {"added": how["added"][:1], "subtracted": []}}
        return groups

    server, _ = _run(federation, change=_groups(recipe))
    nodes = {n.client_id for n in federation.nodes.values()}
    _refused_by_all(server, federation, nodes, "ClassifierAuditMisstatedError")
