"""Attempts to make a client release a value twice (rotating absentees, a forked client state, the
same value renamed or split, a group cut to victim and colluder), scripted as hostile servers over
the real codec, under deployment defaults.

Each runs against ``ClientSession``'s public API (bytes in, bytes out) with the clients' ledgers,
and asserts the refusing client, the round, the error class, and that no seed, key share or
unmasked value left it.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from secure_afl.core.errors import (
    ColluderExposureRefusedError,
    ConflictingAnswerError,
    ValueAlreadyReleasedError,
)
from secure_afl.privacy.ledger import FileLedger, MemoryLedger
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.protocol.messages import ConsistencyCheckRequest
from secure_afl.protocol.server import ServerSession

from .hostile import Wire, clients_for, config_for, federation, run

DEPLOYMENT = ClientPolicy.deployment()


def _ledgers(kind: str, ids, tmp_path):
    if kind == "memory":
        return {cid: MemoryLedger() for cid in ids}
    return {cid: FileLedger(tmp_path / cid) for cid in ids}


# --- 1. rotating absentees: n sessions, session j without c_j (no colluder) -----------------------


@pytest.mark.parametrize("n", [4, 5, 6, 7])
@pytest.mark.parametrize("kind", ["memory", "file"])
def test_rotating_absentees_get_one_sum_and_nothing_more(n: int, kind: str, tmp_path) -> None:
    fed = federation(n)
    ledgers = _ledgers(kind, fed.ids, tmp_path)
    threshold = DEPLOYMENT.min_threshold(n)
    sums = []
    for j, absent in enumerate(fed.ids):
        server = ServerSession(
            fed.roster,
            config_for(fed, threshold=threshold, min_group_size=2, session_id=bytes([j + 1]) * 32),
        )
        members = tuple(c for c in fed.ids if c != absent)
        wire = Wire(clients_for(fed, policy=DEPLOYMENT, ledgers=ledgers, ids=members, seed=bytes([j])))
        run(server, wire)
        if j == 0:
            assert wire.refusals == {}
            sums.append(server.result().groups["all"].sums["gram"])
            continue
        # Every client of session j but c_0 was in session 0: its Gram is spent; refused in R0.
        assert set(wire.refusals) == set(members) - {fed.ids[0]}
        for cid, refusal in wire.refusals.items():
            assert refusal.round == "R0" and type(refusal.error) is ValueAlreadyReleasedError
            assert refusal.error.session_id == bytes([1]) * 32
            assert wire.sent.get(cid, []) == []  # nothing, not even a key, left it
            wire.assert_nothing_leaked(cid)
    assert len(sums) == 1  # F = (sum of S_j) / (n - 1) needs n sums; the server has one


# --- 2. a fork of one client state answered twice -------------------------------------------------


def test_a_forked_client_cannot_sign_two_survivor_sets() -> None:
    """n = 8, t = 6: the server runs to R2, then has each client rebuilt from the same seed and the
    same messages (what a deployed client does per Flower message, from a context state that two
    concurrent messages can both start from) and shows each copy a survivor set without a
    different victim: both victims' inputs would follow.  The second copy refuses."""
    fed = federation(8)
    ledgers = {cid: MemoryLedger() for cid in fed.ids}
    server = ServerSession(fed.roster, config_for(fed, threshold=6, min_group_size=2, session_id=b"f" * 32))
    wire = Wire(clients_for(fed, policy=DEPLOYMENT, ledgers=ledgers, seed=b"same"))
    delivered: dict[str, list] = {}
    deliver = wire.deliver

    def recording(cid, round_name, message):
        delivered.setdefault(cid, []).append(message)
        return deliver(cid, round_name, message)

    wire.deliver = recording  # type: ignore[method-assign]
    requests = run(server, wire, until="R2")
    fork = Wire(clients_for(fed, policy=DEPLOYMENT, ledgers=ledgers, seed=b"same"))
    for cid, messages in delivered.items():  # the rebuild: same seed, same messages, same secrets
        for round_name, message in zip(("R0", "R1", "R2"), messages, strict=True):
            fork.deliver(cid, round_name, message)
    assert fork.refusals == {}  # the rebuilt copies answered R0..R2 exactly as before
    session_id = requests["c0"].session_id
    without_c0 = ConsistencyCheckRequest(session_id, fed.ids[1:])
    without_c1 = ConsistencyCheckRequest(session_id, (fed.ids[0], *fed.ids[2:]))
    for cid in fed.ids[2:]:
        assert wire.deliver(cid, "R3", without_c0)  # branch 1 signs {all but c0}
    for cid in fed.ids[2:]:
        assert fork.deliver(cid, "R3", without_c1) == []  # branch 2, the same secrets: refused
        refusal = fork.refusals[cid]
        assert refusal.round == "R3" and type(refusal.error) is ConflictingAnswerError
        assert "a second one" in str(refusal.error)  # the survivor set signed in branch 1 is on record
        fork.assert_nothing_leaked(cid)


# --- 3. the key follows the data, not the study or the name ---------------------------------------


def test_the_same_gram_under_another_name_is_refused_in_r0(tmp_path) -> None:
    fed = federation(5)
    ledgers = _ledgers("file", fed.ids, tmp_path)
    first = ServerSession(fed.roster, config_for(fed, threshold=4, min_group_size=2, session_id=b"1" * 32))
    run(first, Wire(clients_for(fed, policy=DEPLOYMENT, ledgers=ledgers)))
    renamed = federation(5)  # the same values, now sent as "second_moment" in group "other"
    renamed.identities, renamed.roster = fed.identities, fed.roster
    renamed.lengths = {"second_moment": fed.lengths["gram"]}
    renamed.groups = {"other": fed.ids[1:]}
    renamed.inputs = {cid: {"other": {"second_moment": fed.inputs[cid]["all"]["gram"]}} for cid in fed.ids}
    second = ServerSession(
        renamed.roster, config_for(renamed, threshold=4, min_group_size=2, session_id=b"2" * 32)
    )
    wire = Wire(clients_for(renamed, policy=DEPLOYMENT, ledgers=ledgers, ids=fed.ids[1:], seed=b"again"))
    run(second, wire)
    assert {cid: (r.round, type(r.error)) for cid, r in wire.refusals.items()} == dict.fromkeys(
        fed.ids[1:], ("R0", ValueAlreadyReleasedError)
    )
    assert "other/second_moment" in str(wire.refusals["c1"].error)


def test_the_halves_of_a_released_value_are_refused_across_sessions_and_within_one() -> None:
    fed = federation(5, lengths={"gram": 12})
    ledgers = {cid: MemoryLedger() for cid in fed.ids}
    first = ServerSession(fed.roster, config_for(fed, threshold=4, min_group_size=2, session_id=b"1" * 32))
    run(first, Wire(clients_for(fed, policy=DEPLOYMENT, ledgers=ledgers)))
    halves = federation(5, lengths={"lo": 6, "hi": 6})
    halves.identities, halves.roster = fed.identities, fed.roster
    halves.inputs = {
        cid: {"all": {"lo": fed.inputs[cid]["all"]["gram"][:6], "hi": fed.inputs[cid]["all"]["gram"][6:]}}
        for cid in fed.ids
    }
    second = ServerSession(
        fed.roster, config_for(halves, threshold=4, min_group_size=2, session_id=b"2" * 32)
    )
    wire = Wire(clients_for(halves, policy=DEPLOYMENT, ledgers=ledgers, seed=b"halves"))
    run(second, wire)
    assert set(wire.refusals) == set(fed.ids)
    for cid, refusal in wire.refusals.items():
        assert refusal.round == "R0" and type(refusal.error) is ValueAlreadyReleasedError
        assert "parts of a value" in str(refusal.error)
        wire.assert_nothing_leaked(cid)
    # Within one session: the whole in one group and a half under another name in another.
    both = federation(5, {"A": fed.ids, "B": fed.ids}, lengths={"gram": 12})
    for cid in fed.ids:
        whole = both.inputs[cid]["A"]["gram"]
        both.inputs[cid]["B"] = {"lo": whole[:6].copy()}
    both.lengths = {"gram": 12, "lo": 6}
    config = config_for(both, threshold=4, min_group_size=2, session_id=b"3" * 32)
    config = dataclasses.replace(
        config,
        groups=tuple(
            dataclasses.replace(
                g, tensors=tuple(t for t in g.tensors if (g.name == "A") == (t.name == "gram"))
            )
            for g in config.groups
        ),
    )
    wire = Wire(clients_for(both, policy=DEPLOYMENT, seed=b"within"))
    run(ServerSession(both.roster, config), wire)
    assert {cid: type(r.error) for cid, r in wire.refusals.items()} == dict.fromkeys(
        fed.ids, ValueAlreadyReleasedError
    )
    assert "B/lo (a part of A/gram)" in str(wire.refusals["c0"].error)


# --- 4. one colluder: a group cut to {victim, colluder} by invented dropouts ----------------------


@pytest.mark.parametrize(("n", "t"), [(7, 5), (9, 7)])
def test_a_group_cut_to_victim_and_colluder_is_refused_in_r3(n: int, t: int) -> None:
    ids = tuple(f"c{i}" for i in range(n))
    # "small" sums b over 4 members (c = n - t = 2 colluders leave 2 honest: fine in R1), "all"
    # sums another tensor x over everyone.
    fed = federation(n, {"small": ids[:4], "all": ids}, lengths={"b": 4, "x": 4})
    fed.inputs = {
        cid: {g: {("b" if g == "small" else "x"): tensors["b"]} for g, tensors in fed.inputs[cid].items()}
        for cid in ids
    }
    base = config_for(fed, threshold=t, min_group_size=2, session_id=b"c" * 32)
    config = dataclasses.replace(
        base,
        groups=tuple(
            dataclasses.replace(
                g, tensors=tuple(x for x in g.tensors if (x.name == "b") == (g.name == "small"))
            )
            for g in base.groups
        ),
    )
    server = ServerSession(fed.roster, config)
    wire = Wire(clients_for(fed, policy=DEPLOYMENT))
    requests = run(server, wire, until="R2")
    assert wire.refusals == {}  # the layout alone was fine under c = n - t
    # Invented dropouts leave "small" = {c0, c1}; c1 colludes; the survivors stay >= t.
    survivors = tuple(c for c in ids if c not in ids[2:4])
    assert len(survivors) >= t
    cut = ConsistencyCheckRequest(requests["c0"].session_id, survivors)
    assert wire.deliver("c0", "R3", cut) == []
    refusal = wire.refusals["c0"]
    assert refusal.round == "R3" and type(refusal.error) is ColluderExposureRefusedError
    assert refusal.error.colluders == ("c1",)
    wire.assert_nothing_leaked("c0")


# --- the ledger's growth under hostile sessions ---------------------------------------------------


def test_aborted_sessions_with_long_names_do_not_grow_the_ledger_without_bound(tmp_path) -> None:
    """Before: about 287 KB per malicious session (empty groups with 250-byte names).  Now a session
    that releases nothing keeps one digest per round answered, and at most MAX_OPEN_SESSIONS such."""
    from secure_afl.privacy.ledger import MAX_OPEN_SESSIONS

    fed = federation(4)
    long = {f"{'g' * 240}{k:03d}": () for k in range(64)}  # empty groups with long names
    ledger = FileLedger(tmp_path)
    sizes = []
    for k in range(MAX_OPEN_SESSIONS + 6):
        padded = federation(4, {**fed.groups, **long})
        padded.identities, padded.roster, padded.inputs = fed.identities, fed.roster, fed.inputs
        server = ServerSession(
            fed.roster, config_for(padded, threshold=3, min_group_size=2, session_id=k.to_bytes(32, "big"))
        )
        clients = clients_for(padded, policy=DEPLOYMENT, ledgers={"c0": ledger}, ids=("c0",), seed=bytes([k]))
        wire = Wire(clients)
        run(server, wire, until="R0")  # c0 advertises, then the server walks away
        sizes.append(ledger.path("c0").stat().st_size)
    assert max(sizes) < 40_000  # about 300 bytes per open session, capped
    assert sizes[-1] == sizes[-2]  # at the cap the oldest open session goes
    document = json.loads(ledger.path("c0").read_text())
    assert len(document["sessions"]) == MAX_OPEN_SESSIONS
    assert "g" * 240 not in ledger.path("c0").read_text()  # no group name is recorded
