"""A standing malicious-server suite: scripted hostile servers against ``ClientSession``'s public API.

Each attack is run twice where that shows the test has teeth: under the simulator's policy (the
clients go on and the server recovers a client's encoded input bit for bit) and under the
deployment defaults (the clients refuse, with a specific error, in a given round, and nothing
secret leaves them).
"""

from __future__ import annotations

import numpy as np
import pytest

from secure_afl.privacy.ledger import MemoryLedger
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.protocol import encoding
from secure_afl.protocol.errors import (
    ExposureRefusedError,
    GroupBelowMinimumError,
    HistoryExposureRefusedError,
    InvalidSessionConfigError,
    LocalProtocolError,
)
from secure_afl.protocol.messages import ConsistencyCheckRequest
from secure_afl.protocol.server import ServerSession

from .hostile import Wire, clients_for, config_for, federation, run

DEPLOYMENT = ClientPolicy.deployment()
SIMULATOR = ClientPolicy.simulator()


def encoded(fed, cid: str, tensor: str = "gram") -> np.ndarray:
    group = next(iter(fed.inputs[cid]))
    return encoding.encode(fed.inputs[cid][group][tensor], tensor=tensor, group_size=1)


# --- attack 1: overlapping groups plus an invented dropout ----------------------------------------

OVERLAP = {"A": ("c0", "c1", "c2", "c3"), "B": ("c1", "c2", "c3", "c4")}


def _overlap_attack(policy: ClientPolicy, threshold: int):
    fed = federation(5, OVERLAP)
    server = ServerSession(
        fed.roster, config_for(fed, threshold=threshold, min_group_size=2, session_id=b"1" * 32)
    )
    wire = Wire(clients_for(fed, policy=policy))
    run(server, wire, discard_masked_input_of={"c4"})  # the server declares c4 dropped after R2
    return fed, server, wire


def test_overlapping_groups_recover_an_input_when_clients_do_not_check() -> None:
    fed, server, wire = _overlap_attack(SIMULATOR, threshold=3)
    sums = server.result().groups
    assert sums["B"].survivors == ("c1", "c2", "c3")
    np.testing.assert_array_equal(sums["A"].sums["gram"] - sums["B"].sums["gram"], encoded(fed, "c0"))
    # The simulator's clients saw it and say so: c0 that it is exposed, c1..c3 that c0 is.
    for cid in ("c0", "c1", "c2", "c3"):
        (finding, *_) = wire.clients[cid].exposure_findings
        assert finding.clients == ("c0",) and finding.round == "R3" and finding.groups == ("A",)


def test_overlapping_groups_attack_is_refused_in_r3_under_deployment_defaults() -> None:
    _fed, server, wire = _overlap_attack(DEPLOYMENT, threshold=4)  # floor(2*5/3) + 1 = 4
    assert set(wire.refusals) == {"c0", "c1", "c2", "c3"}
    for cid, refusal in wire.refusals.items():
        assert refusal.round == "R3"
        assert type(refusal.error) is ExposureRefusedError
        assert refusal.error.groups == ("A",) and "'gram' for c0" in str(refusal.error)
        wire.assert_nothing_leaked(cid)
    with pytest.raises(LocalProtocolError, match="no result"):  # no signature ever arrived
        server.result()


# --- attack 2: two sessions over the same inputs --------------------------------------------------


def _two_sessions(policy: ClientPolicy, ledgers):
    fed = federation(5)
    threshold = policy.min_threshold(5)
    first = ServerSession(
        fed.roster, config_for(fed, threshold=threshold, min_group_size=2, session_id=b"1" * 32)
    )
    run(first, Wire(clients_for(fed, policy=policy, ledgers=ledgers, seed=b"s1")))
    second = ServerSession(
        fed.roster, config_for(fed, threshold=threshold, min_group_size=2, session_id=b"2" * 32)
    )
    wire = Wire(clients_for(fed, policy=policy, ledgers=ledgers, ids=fed.ids[1:], seed=b"s2"))
    run(second, wire, absent={"c0"})
    return fed, first, second, wire


def test_two_sessions_recover_an_input_without_a_ledger_check() -> None:
    fed, first, second, _ = _two_sessions(SIMULATOR, ledgers=None)
    difference = first.result().groups["all"].sums["gram"] - second.result().groups["all"].sums["gram"]
    np.testing.assert_array_equal(difference, encoded(fed, "c0"))


def test_second_session_without_the_victim_is_refused_by_its_peers() -> None:
    ledgers = {f"c{i}": MemoryLedger() for i in range(5)}
    fed, first, _second, wire = _two_sessions(DEPLOYMENT, ledgers)
    assert first.result().groups["all"].survivors == fed.ids  # the first session was honest
    assert set(wire.refusals) == {"c1", "c2", "c3", "c4"}
    for cid, refusal in wire.refusals.items():
        # The layout alone (everyone alive) already isolates c0 against the first session: R1.
        assert refusal.round == "R1"
        assert type(refusal.error) is HistoryExposureRefusedError
        assert "c0" in str(refusal.error) and "earlier sessions" in str(refusal.error)
        wire.assert_nothing_leaked(cid)


# --- attack 4: a group cut down to one member -----------------------------------------------------

LONE = {"pair": ("c0", "c1"), "all": ("c0", "c1", "c2", "c3")}


def test_group_cut_to_one_member_recovers_its_input_at_min_group_size_one() -> None:
    fed = federation(4, LONE)
    server = ServerSession(fed.roster, config_for(fed, threshold=3, min_group_size=1, session_id=b"1" * 32))
    wire = Wire(clients_for(fed, policy=SIMULATOR))
    run(server, wire, discard_masked_input_of={"c1"})
    np.testing.assert_array_equal(server.result().groups["pair"].sums["gram"], encoded(fed, "c0"))


def test_min_group_size_one_is_refused_in_r0_under_deployment_defaults() -> None:
    fed = federation(4, LONE)
    server = ServerSession(fed.roster, config_for(fed, threshold=3, min_group_size=1, session_id=b"1" * 32))
    wire = Wire(clients_for(fed, policy=DEPLOYMENT))
    run(server, wire, discard_masked_input_of={"c1"})
    assert set(wire.refusals) == set(fed.ids)
    for cid, refusal in wire.refusals.items():
        assert refusal.round == "R0" and type(refusal.error) is InvalidSessionConfigError
        assert "minimum group size 1" in str(refusal.error)
        wire.assert_nothing_leaked(cid)


def test_group_cut_to_one_member_is_refused_in_r3_when_the_config_says_two() -> None:
    fed = federation(4, LONE)
    server = ServerSession(fed.roster, config_for(fed, threshold=3, min_group_size=2, session_id=b"1" * 32))
    wire = Wire(clients_for(fed, policy=DEPLOYMENT))
    requests = run(server, wire, until="R2")  # honest so far: the R3 requests name all four
    # The hostile server declares c1 dropped, which leaves c0 alone in "pair" (an honest one aborts).
    cut = ConsistencyCheckRequest(requests["c0"].session_id, ("c0", "c2", "c3"))
    for cid in ("c0", "c2", "c3"):
        assert wire.deliver(cid, "R3", cut) == []
        assert wire.refusals[cid].round == "R3"
        assert type(wire.refusals[cid].error) is GroupBelowMinimumError
        wire.assert_nothing_leaked(cid)
