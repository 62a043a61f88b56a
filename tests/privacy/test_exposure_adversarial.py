"""The exposure check's adversarial rule for server-parameterised values (privacy/exposure.py):
round 2's ``b_pseudo/<c>`` are values of a function of the teacher W the server picks, so a peer's
values under several names are one unknown, and the checking client is exposed when any non-zero
combination of its own values is determined.  Beyond the named attack (two equal columns): a
cycle of near-equal columns, negated columns, a relabelled group, a member whose zeros are
predictable from its signed count, and round-1 names that must stay unlinked."""

from __future__ import annotations

import numpy as np

from secure_afl.analytic import PseudoLabelConfig, pseudo_label_contributions
from secure_afl.privacy.exposure import (
    client_exposures,
    determined,
    exposed_clients,
    linked_groups,
    own_combination_exposed,
    value_family,
)
from secure_afl.protocol.exposure_gate import zero_commitments

PEERS = ("a", "b", "c", "d")


def _own(**values: str) -> dict[tuple[str, str], str]:
    """group c -> digest: the victim's b_pseudo/<c> in pseudo/<c>."""
    return {(f"pseudo/{c}", f"b_pseudo/{c}"): digest for c, digest in values.items()}


def test_equal_columns_layout_is_an_exposure_for_the_victim_and_in_the_audit() -> None:
    groups = {"pseudo/0": (("v", *PEERS), ("b_pseudo/0",)), "pseudo/1": (PEERS, ("b_pseudo/1",))}
    found = client_exposures("v", _own(**{"0": "x"}), groups, round_name="R1")
    assert [f.clients for f in found] == [("v",)] and found[0].groups == ("pseudo/0",)
    assert exposed_clients(groups) == {"b_pseudo/0 + b_pseudo/1": ("v",)}
    # Under the old rule (each name its own unknown per peer) nothing was determined:
    rows = [{("v", "0"), *((p, "b_pseudo/0") for p in PEERS)}, {(p, "b_pseudo/1") for p in PEERS}]
    assert determined(rows) == frozenset()


def test_a_cycle_of_four_near_equal_columns_isolates_the_victim_and_is_refused() -> None:
    """S0 - S1 - S2 + S3 = v with every peer in two groups: no two groups alone differ by one
    member, so no pairwise rule catches it; the rank test over the linked family does."""
    groups = {
        "pseudo/0": (("v", "a", "b"), ("b_pseudo/0",)),
        "pseudo/1": (("a", "c"), ("b_pseudo/1",)),
        "pseudo/2": (("b", "d"), ("b_pseudo/2",)),
        "pseudo/3": (("c", "d"), ("b_pseudo/3",)),
    }
    found = client_exposures("v", _own(**{"0": "x"}), groups, round_name="R1")
    assert found and found[0].clients == ("v",)
    assert set(found[0].groups) == {"pseudo/0"}  # the victim's own group; the others are linked
    # A peer in no danger itself refuses too: it sees the victim determined.
    peer = client_exposures("a", _own(**{"0": "y", "1": "y"}), groups, round_name="R1")
    assert any("v" in f.clients for f in peer)


def test_negated_columns_give_minus_the_value_exactly_and_the_same_layout_is_refused() -> None:
    """W's column 1 = -column 0 swaps pseudo-positives and -negatives: b_pseudo/1 = -b_pseudo/0
    exactly (min_pos = min_neg), so S0 + S1 isolates the victim.  A common per-name scale changes
    no rank, so the linked family (one unknown per peer) refuses this layout as it refuses equal
    columns."""
    rng = np.random.default_rng(3)
    w = rng.normal(size=(6, 3))
    w[:, 1] = -w[:, 0]
    config = PseudoLabelConfig(min_pos=3, min_neg=3)
    peers = []
    for _ in PEERS:
        out, _ = pseudo_label_contributions(rng.normal(size=(80, 6)), w, (2,), config=config, device="cpu")
        peers.append((out["pseudo/0"]["b_pseudo/0"], out["pseudo/1"]["b_pseudo/1"]))
    victim, _ = pseudo_label_contributions(rng.normal(size=(80, 6)), w, (1, 2), config=config, device="cpu")
    v = victim["pseudo/0"]["b_pseudo/0"]
    assert np.any(v != 0) and all(np.any(p0 != 0) for p0, _ in peers)
    for p0, p1 in peers:
        np.testing.assert_array_equal(p1, -p0)
    s0, s1 = v + sum(p0 for p0, _ in peers), sum(p1 for _, p1 in peers)
    np.testing.assert_allclose(s0 + s1, v, rtol=0, atol=1e-12)
    groups = {"pseudo/0": (("v", *PEERS), ("b_pseudo/0",)), "pseudo/1": (PEERS, ("b_pseudo/1",))}
    assert client_exposures("v", _own(**{"0": "x"}), groups, round_name="R1", colluders=0)


def test_two_own_values_a_few_images_apart_count_as_an_exposure() -> None:
    """The victim in both groups with the same peers: S0 - S1 is the difference of its own two
    values (two pseudo-label sets the server made differ by a few images).  Refused when the two
    values differ; one value under both names (the same digest) gives nothing away."""
    groups = {"pseudo/0": (("v", *PEERS), ("b_pseudo/0",)), "pseudo/1": (("v", *PEERS), ("b_pseudo/1",))}
    differ = client_exposures("v", _own(**{"0": "x", "1": "y"}), groups, round_name="R1", colluders=2)
    assert differ and differ[0].clients == ("v",) and differ[0].colluders == ()
    assert client_exposures("v", _own(**{"0": "x", "1": "x"}), groups, round_name="R1", colluders=2) == ()
    rows = [{("v", "x"), *((p, "f") for p in PEERS)}, {("v", "y"), *((p, "f") for p in PEERS)}]
    assert own_combination_exposed(rows, "v") is not None and determined(rows) == frozenset()


def test_the_combination_rule_holds_with_colluders() -> None:
    """c = 1: the victim's two values in groups that differ by one peer ``e``: with e known, the
    difference of the sums is the difference of the victim's values."""
    groups = {
        "pseudo/0": (("v", *PEERS, "e"), ("b_pseudo/0",)),
        "pseudo/1": (("v", *PEERS), ("b_pseudo/1",)),
    }
    own = _own(**{"0": "x", "1": "y"})
    assert client_exposures("v", own, groups, round_name="R1", colluders=0) == ()
    found = client_exposures("v", own, groups, round_name="R1", colluders=1)
    assert found and found[0].colluders == ("e",)


def test_a_relabelled_group_keeps_its_tensors_family() -> None:
    """The family is the tensor's, never the group's name: a server naming the pseudo group
    ``class/1`` (or anything) changes neither the linking nor the known zeros."""
    groups = {"pseudo/0": (("v", *PEERS), ("b_pseudo/0",)), "class/1": (PEERS, ("b_pseudo/1",))}
    assert set(linked_groups({"b_pseudo/0"}, {g: t for g, (_, t) in groups.items()})) == {
        "pseudo/0",
        "class/1",
    }
    assert client_exposures("v", _own(**{"0": "x"}), groups, round_name="R1")

    class Advert:
        def __init__(self, cid: str, groups: tuple[str, ...], rows: tuple[int, ...]) -> None:
            self.client_id, self.groups, self.rows = cid, groups, rows

    adverts = [Advert("a", ("renamed",), (1,)), Advert("b", ("renamed",), (2,)), Advert("v", ("x",), (500,))]
    floors = {"b_pseudo/0": 2}
    known = zero_commitments(adverts, floors=floors, tensors={"renamed": ["b_pseudo/0"], "x": ["b/0"]})
    assert known == {"renamed": frozenset({"a"})}  # below the floor: known; at it: not
    # A group also carrying a tensor without a floor keeps its member (its value there is its data's).
    mixed = zero_commitments(adverts, floors=floors, tensors={"renamed": ["b_pseudo/0", "b/0"]})
    assert mixed == {}


def test_round1_names_stay_one_unknown_per_name() -> None:
    """Round 1's values are the data's own (the study fixes them): ``b/0`` and ``b/1`` are not
    linked, so a layout that linking would expose passes.  Round 2's pseudo sums cannot equal a
    round-1 value exactly without the peers' labels (an approximate, cross-session channel that
    SECURITY.md states as a limit)."""
    assert value_family("b/0") == "b/0" and value_family("gram") == "gram"
    assert value_family("b_pseudo/3") == value_family("b_pseudo_rescaled/0") == "family:b_pseudo"
    assert value_family("pseudo_pos_sum/2") == "family:pseudo_pos_sum"
    groups = {"class/0": (("v", *PEERS), ("b/0",)), "class/1": (PEERS, ("b/1",))}
    assert client_exposures("v", {("class/0", "b/0"): "x"}, groups, round_name="R1") == ()
