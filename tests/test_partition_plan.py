"""The global Gram summed from class groups that partition the clients (difference.plan_partition):
not sent to `all` at all, the same sums bit for bit (with dropouts), the same members and
survivors, no plan where the class groups overlap or miss a client, and a value that the `all`
sum could not hold refused as the method's layout refuses it."""

from __future__ import annotations

import numpy as np
import pytest

from secure_afl.aggregation.backend import MaskingBackend
from secure_afl.aggregation.difference import (
    DifferencePlan,
    PartitionPlan,
    plan_difference,
    plan_partition,
    plan_wire,
)
from secure_afl.aggregation.inprocess import run_in_process
from secure_afl.aggregation.layout import Derivation, layout_of, members_of
from secure_afl.core import encoding
from secure_afl.core.errors import EncodingOverflowError
from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.privacy.policy import ClientPolicy

D = 6


def _contributions(classes: dict[str, tuple[int, ...]], *, seed: int = 0, scale: float = 1.0):
    """Each client's Gram in each class group it labels and in `all` (one array), and a class vector."""
    rng = np.random.default_rng(seed)
    out = {}
    for cid, labelled in classes.items():
        h = rng.standard_normal((10, D)) * scale
        gram = h.T @ h
        mine = {f"class/{c}": {"gram": gram, f"b/{c}": rng.standard_normal(D)} for c in labelled}
        mine["all"] = {"gram": gram}
        out[cid] = mine
    return out


def _run(contributions, *, difference: bool, dropouts=None):
    return run_in_process(
        MaskingBackend(threshold=4, client_policy=ClientPolicy.simulator()),
        contributions,
        min_group_size=2,
        dropouts=dropouts or {},
        random=DeterministicRandomSource(b"partition"),
        difference=difference,
    )


NINE = {f"site-{k}": (k % 3,) for k in range(9)}  # three classes, three sites each, one class a site


@pytest.mark.parametrize("dropouts", [{}, {"R2": ["site-4"]}, {"R3": ["site-0", "site-8"]}])
def test_all_is_summed_from_the_parts_bit_for_bit_with_the_same_members(dropouts) -> None:
    contributions = _contributions(NINE)
    planned = _run(contributions, difference=True, dropouts=dropouts)
    direct = _run(contributions, difference=False, dropouts=dropouts)
    assert "all" not in planned.layout.groups and "all" in direct.layout.groups
    assert planned.layout.derivations() == {"all": {"gram": Derivation(("class/0", "class/1", "class/2"))}}
    assert planned.outcome.sums.keys() == direct.outcome.sums.keys()
    for group, tensors in direct.outcome.sums.items():
        assert planned.outcome.sums[group].keys() == tensors.keys()
        for name, value in tensors.items():
            assert np.array_equal(planned.outcome.sums[group][name], value), (group, name)
    assert planned.outcome.members == direct.outcome.members
    assert planned.outcome.survivors == direct.outcome.survivors
    sent = [sum(sum(r.values()) for r in run.costs.bytes_sent.values()) for run in (planned, direct)]
    triangle = 8 * D * (D + 1) // 2
    assert sent[1] - sent[0] >= (9 - sum(len(v) for v in dropouts.values())) * triangle


def test_no_plan_where_the_class_groups_overlap_or_leave_a_client_out() -> None:
    overlapping = {**NINE, "site-0": (0, 1)}
    assert plan_partition(members_of(c := _contributions(overlapping)), layout_of(c), frac_bits=32) is None
    uncovered = _contributions(NINE)
    del uncovered["site-4"]["class/1"]  # a client in `all` that labels no class
    assert plan_partition(members_of(uncovered), layout_of(uncovered), frac_bits=32) is None
    without_all = {
        cid: {g: t for g, t in groups.items() if g != "all"} for cid, groups in _contributions(NINE).items()
    }
    assert plan_partition(members_of(without_all), layout_of(without_all), frac_bits=32) is None


def test_plan_wire_takes_the_plan_that_sends_fewer_copies() -> None:
    # one large class of three and a class of one: a difference plan (class 0 as all − {site-3})
    # saves two copies, the partition four
    classes = {"site-0": (0,), "site-1": (0,), "site-2": (0,), "site-3": (1,)}
    contributions = _contributions(classes)
    members, layout = members_of(contributions), layout_of(contributions)
    plan = plan_wire(members, layout, min_group_size=1, frac_bits=32)
    assert isinstance(plan, PartitionPlan) and plan.savings == {"direct": 8, "wire": 4}
    other = plan_difference(members, layout, min_group_size=1)
    assert isinstance(other, DifferencePlan) and other.savings["wire"] == 6


def test_a_value_the_all_sum_cannot_hold_is_refused_as_without_the_plan() -> None:
    contributions = _contributions(NINE)
    frac_bits = encoding.DEFAULT_FRAC_BITS
    # an entry within its class group's bound (3 members) but not within all's (9)
    big = 0.5 * (encoding.encoding_bound(frac_bits, 3) + encoding.encoding_bound(frac_bits, 9))
    gram = contributions["site-2"]["all"]["gram"].copy()
    gram[0, 0] = big
    contributions["site-2"]["all"]["gram"] = gram
    contributions["site-2"]["class/2"]["gram"] = gram
    plan = plan_partition(members_of(contributions), layout_of(contributions), frac_bits=frac_bits)
    assert plan is not None and not plan.applies_to(contributions["site-2"])
    with pytest.raises(EncodingOverflowError, match="all/gram"):  # a deployed node's refusal
        plan.wire(contributions["site-2"])
    # the simulator's driver keeps the method's layout, whose session refuses the value itself
    errors = []
    for difference in (True, False):
        with pytest.raises(EncodingOverflowError) as caught:
            _run(contributions, difference=difference)
        errors.append(caught.value.group_size)
    assert errors == [9, 9]


def test_a_client_sending_another_gram_to_all_keeps_the_method_layout() -> None:
    contributions = _contributions(NINE)
    contributions["site-5"]["all"]["gram"] = contributions["site-5"]["all"]["gram"] + 1.0
    planned = _run(contributions, difference=True)
    assert "all" in planned.layout.groups and not planned.layout.derived


def test_a_derivation_reads_as_it_sums_and_refuses_a_sum_both_added_and_subtracted() -> None:
    assert str(Derivation(("all",), ("others/class/0",))) == "all − others/class/0"
    assert Derivation(("class/0", "class/1")).to_dict() == {"added": ["class/0", "class/1"], "subtracted": []}
    words = {g: {"gram": np.array([v], dtype=np.uint64)} for g, v in (("a", 5), ("b", 7), ("c", 2**64 - 1))}
    assert Derivation(("a", "b"), ("c",)).words(words, "gram").tolist() == [13]  # 5 + 7 − (−1) mod 2⁶⁴
    assert Derivation(("a", "b")).members({"a": ["x"], "b": ["y", "z"]}) == ("x", "y", "z")
    with pytest.raises(ValueError, match="adds and subtracts"):
        Derivation(("a",), ("a",))
    with pytest.raises(ValueError, match="at least one"):
        Derivation(())
