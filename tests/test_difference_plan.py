"""The Gram sent by difference (secure_afl/aggregation/difference.py): the same sums bit for bit, the
same span of sums for every survivor set, the same exposure verdicts, no plan where it would
reveal more, and an abort only where the direct layout's sums would reveal a group below the
minimum (a complement left with 1..min-1 live members; one left empty is summed as zero)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from secure_afl.aggregation.backend import CkksBackend, MaskingBackend
from secure_afl.aggregation.difference import complement_group, plan_difference
from secure_afl.aggregation.inprocess import run_in_process
from secure_afl.aggregation.layout import layout_of, members_of
from secure_afl.analytic import ClientStatistics
from secure_afl.core.errors import GroupTooSmallError
from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.privacy.exposure import exposed_clients
from secure_afl.privacy.policy import ClientPolicy

N_CLASSES = 8


def _statistics(rng: np.random.Generator, rows: int, n_classes: int, d: int, rate: float) -> ClientStatistics:
    """One client's statistics of random features, with a positive and a negative in every class."""
    h = rng.exponential(size=(rows, d))
    y = (rng.random((rows, n_classes)) < rate).astype(np.float64)
    y[0], y[1] = 1.0, 0.0
    return ClientStatistics(
        gram=h.T @ h, feat_sum=h.sum(0), pos_sum=h.T @ y, n=rows, n_pos=y.sum(0).astype(np.int64)
    )


def _contributions(n: int, labelled: int, *, seed: int = 0, global_gram: bool = True, d: int = 5):
    """n clients, each labelling ``labelled`` random classes of 8 (every class by someone)."""
    rng = np.random.default_rng(seed)
    out = {}
    for k in range(n):
        stats = _statistics(rng, 12, N_CLASSES, d, 0.4)
        active = sorted(rng.choice(N_CLASSES, labelled, replace=False).tolist())
        out[f"site-{k:02d}"] = stats.contributions(active, include_global_gram=global_gram)
    return out


def _assert_same_sums(planned, direct) -> None:
    """The planned run's results are the direct run's: the method's groups only, bit for bit."""
    assert planned.outcome.sums.keys() == direct.outcome.sums.keys()
    for group, tensors in direct.outcome.sums.items():
        assert planned.outcome.sums[group].keys() == tensors.keys()
        for name, value in tensors.items():
            assert np.array_equal(planned.outcome.sums[group][name], value), (group, name)


def _run(contributions, *, difference: bool, threshold: int, dropouts=None, policy=None):
    backend = MaskingBackend(threshold=threshold, client_policy=policy or ClientPolicy.simulator())
    return run_in_process(
        backend,
        contributions,
        min_group_size=2,
        dropouts=dropouts or {},
        random=DeterministicRandomSource(b"difference"),
        difference=difference,
    )


@pytest.mark.parametrize(
    "dropouts", [{}, {"R1": ["site-03"], "R2": ["site-07", "site-11"]}, {"R3": ["site-05"]}]
)
def test_a_planned_session_gives_the_direct_sessions_sums_bit_for_bit(dropouts) -> None:
    contributions = _contributions(30, 6)
    planned = _run(contributions, difference=True, threshold=24, dropouts=dropouts)
    direct = _run(contributions, difference=False, threshold=24, dropouts=dropouts)
    complements = [g for g in planned.layout.groups if g.startswith("others/")]
    assert complements, "the layout was meant to be planned: most clients label every class"
    assert not any(g.startswith("others/") for g in direct.layout.groups)
    _assert_same_sums(planned, direct)
    sent = {
        run: sum(sum(r.values()) for r in x.costs.bytes_sent.values())
        for run, x in (("p", planned), ("d", direct))
    }
    assert sent["p"] < sent["d"]


def test_the_wire_sums_span_the_class_sums_for_every_survivor_set() -> None:
    """What the server learns of the Grams: the row space of the groups' survivor incidence.  The
    plan's wire groups and the method's groups must give the same space for any survivors."""
    contributions = _contributions(30, 6, seed=3)
    direct = layout_of(contributions)
    members = members_of(contributions)
    plan = plan_difference(members, direct, min_group_size=2)
    assert plan is not None
    wire = plan.wire_layout(direct)
    wire_members = {**members, **plan.members}
    clients = sorted(contributions)
    rng = np.random.default_rng(0)
    for trial in range(40):
        alive = set(clients) if trial == 0 else set(rng.choice(clients, 24, replace=False).tolist())

        def incidence(layout, groups_members, alive=alive):
            rows = [
                [float(cid in groups_members[g] and cid in alive) for cid in clients]
                for g, tensors in layout.groups.items()
                if "gram" in tensors
            ]
            return np.array(rows)

        a, b = incidence(direct, members), incidence(wire, wire_members)
        rank = np.linalg.matrix_rank
        assert rank(a) == rank(b) == rank(np.vstack([a, b])), trial


def test_exposure_verdicts_are_the_same_on_the_wire_groups() -> None:
    """The rank test (what the audit and every client run) finds the same exposed clients."""
    for seed, labelled in ((1, 6), (2, 7), (4, 5)):
        contributions = _contributions(12, labelled, seed=seed)
        direct = layout_of(contributions)
        members = members_of(contributions)
        plan = plan_difference(members, direct, min_group_size=1)
        if plan is None:
            continue
        wire = plan.wire_layout(direct)
        wire_members = {**members, **plan.members}

        def exposed(layout, groups_members):
            return exposed_clients({g: (groups_members[g], tuple(t)) for g, t in layout.groups.items()})

        assert exposed(direct, members).get("gram") == exposed(wire, wire_members).get("gram"), seed


@pytest.mark.parametrize(("colluders", "exposed"), [(0, 0), (1, 2), (2, 8), (None, 18)])
def test_clients_exposure_checks_agree_with_colluders(colluders, exposed) -> None:
    """Each client's own check (up to ``colluders`` colluding peers; None: c = n - t) finds the
    same clients exposed either way (how many: measured on the direct layout)."""
    contributions = _contributions(18, 6, seed=5)
    policy = replace(ClientPolicy.deployment(), refuse_exposure=False, max_colluders=colluders)
    planned = _run(contributions, difference=True, threshold=13, policy=policy)
    direct = _run(contributions, difference=False, threshold=13, policy=policy)
    assert any(g.startswith("others/") for g in planned.layout.groups)

    def verdicts(run):
        return {cid: any(not f.undecided for f in c.exposure_findings) for cid, c in run.clients.items()}

    assert verdicts(planned) == verdicts(direct)
    assert sum(verdicts(direct).values()) == exposed


def test_no_plan_where_the_everyone_sum_is_not_already_known() -> None:
    """Clients label different numbers of classes and no `all` group is summed: the all-sum is
    not in the span of the class sums, so sending it would tell the server more."""
    contributions = _contributions(30, 6, global_gram=False)
    for k, cid in enumerate(sorted(contributions)):
        if k % 3 == 0:  # a third of the clients also label... one class fewer
            dropped = sorted(contributions[cid])[0]
            del contributions[cid][dropped]
    members = members_of(contributions)
    assert plan_difference(members, layout_of(contributions), min_group_size=2) is None


def test_a_plan_without_an_all_group_when_every_client_labels_as_many_classes() -> None:
    contributions = _contributions(60, 7, global_gram=False)
    members = members_of(contributions)
    plan = plan_difference(members, layout_of(contributions), min_group_size=2)
    assert plan is not None and plan.everyone_added
    run = _run(contributions, difference=True, threshold=58)
    assert "all" in run.layout.groups and "all" not in run.outcome.sums  # sent, not a result
    direct = _run(contributions, difference=False, threshold=58)
    for group, tensors in direct.outcome.sums.items():
        assert np.array_equal(run.outcome.sums[group]["gram"], tensors["gram"])


def test_complements_have_the_minimum_group_size_and_fewer_members_than_their_group() -> None:
    contributions = _contributions(40, 6, seed=7)
    members = members_of(contributions)
    sizes = []
    for minimum in (2, 5, 10, 17):
        plan = plan_difference(members, layout_of(contributions), min_group_size=minimum)
        if plan is None:
            sizes.append(None)
            continue
        sizes.append(len(plan.complements))
        for group, complement in plan.complements.items():
            outside = 40 - len(members[group])
            assert complement == (complement_group(group) if outside else None)
            assert outside == 0 or outside >= minimum
            assert outside < len(members[group])
    assert sizes[0] is not None and sizes[0] > 0  # planned at the minimum of 2
    assert sizes[-1] is None or sizes[-1] < sizes[0]  # a larger minimum leaves fewer complements


def test_no_plan_when_a_client_sends_different_grams_to_different_groups() -> None:
    contributions = _contributions(30, 6)
    victim = sorted(contributions)[0]
    first = sorted(g for g in contributions[victim] if g.startswith("class/"))[0]
    contributions[victim][first] = {
        **contributions[victim][first],
        "gram": contributions[victim][first]["gram"] * 2,
    }
    run = _run(contributions, difference=True, threshold=24)
    assert not any(g.startswith("others/") for g in run.layout.groups)


def test_ckks_takes_no_plan() -> None:
    contributions = _contributions(30, 6)
    members = members_of(contributions)
    plan = plan_difference(members, layout_of(contributions), min_group_size=2)
    assert plan is not None
    with pytest.raises(ValueError, match="approximate"):
        CkksBackend().outcome(None, plan.wire_layout(layout_of(contributions)))  # type: ignore[arg-type]


def _blocks(n_blocks: int, per_block: int, *, d: int = 4):
    """The "all but one" pattern: block b's clients label every class but b (one class per block),
    with only per-class Grams (no `all` group; every client labels as many classes)."""
    rng = np.random.default_rng(11)
    out = {}
    for b in range(n_blocks):
        for k in range(per_block):
            stats = _statistics(rng, 9, n_blocks, d, 0.5)
            active = [c for c in range(n_blocks) if c != b]
            out[f"b{b}-{k}"] = stats.contributions(active, include_global_gram=False)
    return out


def test_a_complement_smaller_than_the_dropouts_is_planned_and_may_lose_every_member() -> None:
    """Missing 1's pattern: complements (one block) smaller than the n - t dropouts.  The plan is
    made (2 Grams per client instead of 5), and a whole block dropping leaves its complement empty:
    the session finishes with the direct layout's class sums, bit for bit."""
    contributions = _blocks(6, 4)  # 24 clients, t = 17: up to 7 may drop, a block is 4
    members = members_of(contributions)
    plan = plan_difference(members, layout_of(contributions), min_group_size=2)
    assert plan is not None and plan.everyone_added
    assert all(len(plan.members[c]) == 4 for c in plan.complements.values() if c is not None)
    assert plan.savings == {"direct": 24 * 5, "wire": 24 * 2}
    for block, dropouts in (
        (3, {"R1": ["b3-0", "b3-1"], "R2": ["b3-2", "b3-3"]}),
        (0, {"R2": [f"b0-{k}" for k in range(4)]}),
    ):
        planned = _run(contributions, difference=True, threshold=17, dropouts=dropouts)
        direct = _run(contributions, difference=False, threshold=17, dropouts=dropouts)
        assert f"others/class/{block}" in planned.layout.complement_groups
        _assert_same_sums(planned, direct)


def test_a_complement_left_with_one_member_aborts_where_the_direct_sums_would_reveal_it() -> None:
    """Three of a block's four drop: the plan's complement has one live member, below the minimum,
    and the session aborts before anything is unmasked.  The direct layout finishes, and its class
    sums determine that member's Gram: Σ_c S_c / (k - 1) − S_b, with k = 6 classes and b its block's
    class.  The plan refuses exactly what the minimum group size exists to refuse."""
    contributions = _blocks(6, 4)
    dropouts = {"R2": ["b2-0", "b2-1", "b2-2"]}
    with pytest.raises(GroupTooSmallError, match="others/class/2"):
        _run(contributions, difference=True, threshold=17, dropouts=dropouts)
    direct = _run(contributions, difference=False, threshold=17, dropouts=dropouts)
    sums = {g: t["gram"] for g, t in direct.outcome.sums.items() if "gram" in t}
    assert len(sums) == 6
    lone = sum(sums.values()) / 5 - sums["class/2"]  # Σ_c S_c counts every live client 5 times
    np.testing.assert_allclose(lone, contributions["b2-3"]["class/0"]["gram"], rtol=0, atol=1e-9)


@pytest.mark.parametrize("colluders", [2, 3, None])
def test_clients_verdicts_agree_when_a_complement_ends_empty(colluders) -> None:
    """A whole block drops, so its complement ends empty: every client's own check (up to
    ``colluders`` peers; None: c = n - t) still finds the same clients exposed either way."""
    contributions = _blocks(6, 4)
    policy = replace(ClientPolicy.deployment(), refuse_exposure=False, max_colluders=colluders)
    dropouts = {"R1": ["b0-0"], "R2": ["b0-1", "b0-2", "b0-3"]}
    planned = _run(contributions, difference=True, threshold=17, dropouts=dropouts, policy=policy)
    direct = _run(contributions, difference=False, threshold=17, dropouts=dropouts, policy=policy)

    def verdicts(run):
        return {cid: any(not f.undecided for f in c.exposure_findings) for cid, c in run.clients.items()}

    assert verdicts(planned) == verdicts(direct)
    # Blocks of 4: 3 colluders in a block isolate its last member, 2 do not.
    assert sum(verdicts(direct).values()) == (0 if colluders == 2 else 20)
