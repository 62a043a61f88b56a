"""Groups one member apart (privacy.exposure.one_member_apart): what they are, and that the report's
claim about them holds: with the other members' values equal across the two groups (side
knowledge, which counts as colluding peers), the difference of the two sums is that member's value."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from secure_afl.core import encoding
from secure_afl.privacy.exposure import OneMemberApart, one_member_apart, tensor_kind
from secure_afl.sim.secure import secure_aggregate
from secure_afl.statistics import UndefinedBalanceWarning, client_statistics

CLIENTS = [f"client-{k}" for k in range(8)]


def test_missing_7s_disjoint_groups_give_no_pair() -> None:
    # missing 7: client k labels class k alone; round 2's pseudo/c is every client but client-c
    members = {f"class/{c}": [CLIENTS[c]] for c in range(8)}
    members |= {f"pseudo/{c}": [k for k in CLIENTS if k != CLIENTS[c]] for c in range(8)}
    tensors = {f"class/{c}": [f"b/{c}", "gram", "feat_sum", "n"] for c in range(8)}
    tensors |= {f"pseudo/{c}": [f"b_pseudo/{c}", f"b_pseudo_rescaled/{c}"] for c in range(8)}
    assert one_member_apart(members, tensors) == ()


def test_a_crafted_layout_gives_the_pair_and_the_member() -> None:
    members = {
        "class/0": ["a", "b", "c", "v"],
        "class/1": ["a", "b", "c"],
        "class/2": ["a", "b", "c"],  # the same members as class/1, another tensor kind only
        "all": ["a", "b", "c", "v", "w"],
    }
    tensors = {"class/0": ["b/0"], "class/1": ["b/1"], "class/2": ["n_pos/2"], "all": ["gram"]}
    assert one_member_apart(members, tensors) == (OneMemberApart("class/0", "class/1", "v", ("b",)),)
    # the same tensor in both groups: the difference is the member's value with no side knowledge
    tensors["all"] = ["b/9", "gram"]
    assert one_member_apart(members, tensors) == (
        OneMemberApart("all", "class/0", "w", ("b",)),
        OneMemberApart("class/0", "class/1", "v", ("b",)),
    )
    assert one_member_apart(members, tensors)[1].describe() == "class/0 = class/1 + v (b)"
    # a group of one is not paired with "nothing" (it is a single-member group, reported as such)
    assert one_member_apart({"g": ["v"], "h": []}, {"g": ["b/0"], "h": ["b/0"]}) == ()
    assert tensor_kind("b_pseudo_rescaled/3") == tensor_kind("b_pseudo/1") == "b_pseudo"
    assert tensor_kind("gram") == "gram" and tensor_kind("pos_sum/2") == "pos_sum"


def test_a_group_without_tensors_is_a_specific_error() -> None:
    with pytest.raises(ValueError, match="groups class/1 have members but no tensors"):
        one_member_apart({"class/0": ["a"], "class/1": ["a", "b"]}, {"class/0": ["b/0"]})


def test_with_equal_peer_values_the_difference_of_the_two_sums_is_the_victims_value_exactly() -> None:
    rng = np.random.default_rng(7)
    d = 6
    contributions = {}
    for name in ("a", "b", "c"):  # peers: label classes 0 and 1, no positive of either
        labels = np.zeros((20, 2))
        stats = client_statistics(rng.normal(size=(20, d)), labels)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UndefinedBalanceWarning)
            contributions[name] = stats.contributions([0, 1], gram="global")
        assert np.array_equal(contributions[name]["class/0"]["b/0"], contributions[name]["class/1"]["b/1"])
    victim = client_statistics(rng.normal(size=(30, d)), np.eye(2)[rng.integers(0, 2, 30)])
    contributions["v"] = victim.contributions([0], gram="global")  # labels class 0 only
    run = secure_aggregate(contributions, threshold=3)
    # the rank test sees b/0 and b/1 as different unknowns: nothing exposed by overlap
    assert "b/0" not in run.audit.exposed and "b/1" not in run.audit.exposed
    assert run.audit.one_member_apart == (OneMemberApart("class/0", "class/1", "v", ("b",)),)
    difference = run.sums["class/0"]["b/0"] - run.sums["class/1"]["b/1"]
    sent = contributions["v"]["class/0"]["b/0"]
    assert not np.allclose(sent, contributions["a"]["class/0"]["b/0"])  # a value of its own
    # bit for bit the value the victim sent, as the protocol encodes it (fixed point, 2^-32)
    assert np.array_equal(difference, encoding.decode(encoding.encode(sent, tensor="b/0", group_size=4)))
    assert np.max(np.abs(difference - sent)) <= 2.0**-33
