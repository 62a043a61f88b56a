"""The session ledger, the exposure rank test and the client policy, as units."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secure_afl.keys.identity import IdentityKey
from secure_afl.privacy.exposure import (
    GroupRecord,
    SessionRecord,
    client_exposures,
    determined,
    exposed_clients,
    input_digest,
)
from secure_afl.privacy.ledger import FileLedger, LedgerOwner, MemoryLedger
from secure_afl.privacy.policy import ClientPolicy, active_threshold, majority_threshold, threat_model
from secure_afl.protocol.errors import LedgerTamperedError, LedgerUnreadableError
from secure_afl.protocol.randomness import DeterministicRandomSource

from .hostile import Wire, clients_for, config_for, federation, run


def _record(session: bytes, survivors: tuple[str, ...]) -> SessionRecord:
    return SessionRecord(session * 32, (GroupRecord("all", survivors, ("gram",)),), (("all", "gram", "ab"),))


def _owner(name: str = "c1") -> LedgerOwner:
    return LedgerOwner(name, IdentityKey.generate(DeterministicRandomSource(name.encode())))


# --- the rank test --------------------------------------------------------------------------------


def test_rank_test_is_exact_on_leave_one_out_sums() -> None:
    clients = [f"c{k}" for k in range(8)]
    all_but_one = [set(clients) - {out} for out in clients]
    assert determined(all_but_one) == frozenset(clients)  # J - I has full rank
    assert determined(all_but_one[:7]) == frozenset()  # 7 of them determine nobody
    assert determined([set(clients), set(clients[:7])]) == frozenset({"c7"})
    # A float rank would need a tolerance; 3 of {a,b}, {b,c}, {a,c}: solvable exactly (a = (s1-s2+s3)/2).
    assert determined([{"a", "b"}, {"b", "c"}, {"a", "c"}]) == frozenset({"a", "b", "c"})


def test_distinct_values_are_separate_unknowns() -> None:
    groups = {"A": (("c0", "c1"), ("t",)), "B": (("c1",), ("t",))}
    assert exposed_clients(groups) == {"t": ("c0", "c1")}
    # If c1 sends another value of t to B, only its B value is exposed (a lone member), and c0 is not.
    assert exposed_clients(groups, distinct={"c1": {"t"}}) == {"t": ("c1",)}


def test_client_check_uses_the_history_and_names_the_groups() -> None:
    own = {("all", "gram"): "ab"}
    now = {"all": (("c1", "c2", "c3"), ("gram",))}
    assert client_exposures("c1", own, now, round_name="R3") == ()
    (finding,) = client_exposures(
        "c1", own, now, round_name="R3", history=[_record(b"1", ("c0", "c1", "c2", "c3"))]
    )
    assert finding.clients == ("c0",) and finding.with_history and finding.groups == ("all",)
    # Had the client's own value changed (another digest), it would be a new unknown, and the two
    # sums would no longer isolate c0 (in a ledger, one history is one input, so this does not occur).
    other = SessionRecord(
        b"1" * 32, (GroupRecord("all", ("c0", "c1", "c2", "c3"), ("gram",)),), (("all", "gram", "cd"),)
    )
    assert client_exposures("c1", own, now, round_name="R3", history=[other]) == ()


def test_input_digest_depends_on_every_value() -> None:
    inputs = {"g": {"t": np.arange(3.0)}}
    assert input_digest(inputs) == input_digest({"g": {"t": np.arange(3.0)}})
    assert input_digest(inputs) != input_digest({"g": {"t": np.array([0.0, 1.0, 2.5])}})
    assert input_digest(inputs) != input_digest({"h": {"t": np.arange(3.0)}})


# --- ledgers --------------------------------------------------------------------------------------


def test_file_ledger_survives_a_restart_and_is_private(tmp_path) -> None:
    owner = _owner()
    ledger = FileLedger(tmp_path / "ledger")
    ledger.check_and_record(owner, b"d" * 32, _record(b"1", ("c0", "c1")), lambda history: None)
    again = FileLedger(tmp_path / "ledger")  # a new process: only the file remains
    assert again.history(owner, b"d" * 32) == (_record(b"1", ("c0", "c1")),)
    assert again.history(owner, b"e" * 32) == ()  # another input: another history
    mode = stat.S_IMODE(os.stat(again.path("c1")).st_mode)
    assert mode == 0o600
    assert not [p for p in (tmp_path / "ledger").iterdir() if p.name.endswith(".tmp")]


def test_check_and_record_is_atomic_with_the_check(tmp_path) -> None:
    for ledger in (MemoryLedger(), FileLedger(tmp_path)):
        owner = _owner()
        seen = []
        ledger.check_and_record(owner, b"d" * 32, _record(b"1", ("c0",)), seen.append)

        def refuse(history, seen=seen):
            seen.append(history)
            raise RuntimeError("refused")

        with pytest.raises(RuntimeError):
            ledger.check_and_record(owner, b"d" * 32, _record(b"2", ("c1",)), refuse)
        assert seen == [(), (_record(b"1", ("c0",)),)]
        assert ledger.history(owner, b"d" * 32) == (_record(b"1", ("c0",)),)  # the refused one is not kept


@pytest.mark.parametrize("edit", ["rewrite survivors", "drop one input's history", "drop a session"])
def test_tampered_ledger_is_refused(tmp_path, edit) -> None:
    owner = _owner()
    ledger = FileLedger(tmp_path)
    ledger.check_and_record(owner, b"d" * 32, _record(b"1", ("c0", "c1")), lambda history: None)
    ledger.check_and_record(owner, b"d" * 32, _record(b"2", ("c1", "c2")), lambda history: None)
    ledger.check_and_record(owner, b"e" * 32, _record(b"3", ("c0", "c1")), lambda history: None)
    path = ledger.path("c1")
    document = json.loads(path.read_text())
    inputs = document["inputs"]
    if edit == "rewrite survivors":
        inputs[(b"d" * 32).hex()][0]["groups"][0]["survivors"] = ["c1"]
    elif edit == "drop one input's history":
        del inputs[(b"e" * 32).hex()]
    else:
        inputs[(b"d" * 32).hex()].pop()
    path.write_text(json.dumps(document))
    with pytest.raises(LedgerTamperedError, match="not signed"):
        ledger.history(owner, b"d" * 32)


def test_a_ledger_signed_by_another_key_is_refused(tmp_path) -> None:
    ledger = FileLedger(tmp_path)
    ledger.check_and_record(_owner(), b"d" * 32, _record(b"1", ("c0", "c1")), lambda history: None)
    with pytest.raises(LedgerTamperedError):
        ledger.history(LedgerOwner("c1", _owner("c9").identity), b"d" * 32)
    ledger.path("c1").rename(ledger.path("c2"))
    with pytest.raises(LedgerTamperedError, match="belongs to"):
        ledger.history(_owner("c2"), b"d" * 32)


@pytest.mark.parametrize(
    "content", [b"", b"{not json", b'{"format": "other", "signature": "00"}', b"\xff\xfe"]
)
def test_unreadable_ledger_is_refused(tmp_path, content) -> None:
    ledger = FileLedger(tmp_path)
    ledger.path("c1").write_bytes(content)
    with pytest.raises(LedgerUnreadableError, match="restore it from a backup"):
        ledger.history(_owner(), b"d" * 32)


def test_a_client_refuses_to_start_on_a_tampered_ledger(tmp_path) -> None:
    fed = federation(3)
    FileLedger(tmp_path).path("c0").write_text("{}")
    with pytest.raises(LedgerUnreadableError):
        clients_for(fed, policy=ClientPolicy.deployment(), ledgers={"c0": FileLedger(tmp_path)}, ids=("c0",))


def test_file_ledger_refuses_the_repeat_session_after_a_restart(tmp_path) -> None:
    """Attack 2 across a restart: the ledger is read back from disk by new client objects."""
    from secure_afl.protocol.errors import HistoryExposureRefusedError
    from secure_afl.protocol.server import ServerSession

    fed = federation(5)
    policy = ClientPolicy.deployment()
    first = ServerSession(fed.roster, config_for(fed, threshold=4, min_group_size=2, session_id=b"1" * 32))
    run(first, Wire(clients_for(fed, policy=policy, ledgers={c: FileLedger(tmp_path / c) for c in fed.ids})))
    assert first.result().groups["all"].survivors == fed.ids
    second = ServerSession(fed.roster, config_for(fed, threshold=4, min_group_size=2, session_id=b"2" * 32))
    ledgers = {c: FileLedger(tmp_path / c) for c in fed.ids}
    wire = Wire(clients_for(fed, policy=policy, ledgers=ledgers, ids=fed.ids[1:], seed=b"again"))
    run(second, wire, absent={"c0"})
    assert {c: type(r.error) for c, r in wire.refusals.items()} == dict.fromkeys(
        fed.ids[1:], HistoryExposureRefusedError
    )
    # A new input starts a new history: the same layout over new data goes through.
    fresh = federation(5, seed=b"new data")
    fresh.identities, fresh.roster = fed.identities, fed.roster
    third = ServerSession(fed.roster, config_for(fed, threshold=4, min_group_size=2, session_id=b"3" * 32))
    wire = Wire(clients_for(fresh, policy=policy, ledgers=ledgers, ids=fed.ids[1:], seed=b"third"))
    run(third, wire, absent={"c0"})
    assert wire.refusals == {} and third.result().groups["all"].survivors == fed.ids[1:]


# --- policy ---------------------------------------------------------------------------------------


def test_policies_and_threat_models() -> None:
    deployment, simulator = ClientPolicy.deployment(), ClientPolicy.simulator()
    assert deployment.refuse_exposure and deployment.min_group_size == 2
    assert [deployment.min_threshold(n) for n in (3, 5, 8, 9)] == [3, 4, 6, 7]
    assert not simulator.refuse_exposure and simulator.min_group_size == 1
    assert [simulator.min_threshold(n) for n in (3, 5, 8)] == [2, 3, 5]
    assert active_threshold(8) == 6 and majority_threshold(8) == 5
    assert threat_model(8, 6, 2, refuse_exposure=True) == "active"
    assert threat_model(8, 5, 2, refuse_exposure=True) == "honest-but-curious"
    assert threat_model(8, 6, 1, refuse_exposure=True) == "honest-but-curious"
    assert threat_model(8, 6, 2, refuse_exposure=False) == "honest-but-curious"
    with pytest.raises(ValueError, match="unknown client policy"):
        ClientPolicy.named("paranoid")
    with pytest.raises(ValueError, match="min_group_size"):
        ClientPolicy("x", True, 0, "majority")


def _rational_rank(rows: list[list[int]]) -> int:
    """A reference: plain Gaussian elimination over Fractions."""
    from fractions import Fraction

    matrix = [[Fraction(v) for v in row] for row in rows]
    rank = 0
    for column in range(len(matrix[0]) if matrix else 0):
        pivot = next((i for i in range(rank, len(matrix)) if matrix[i][column]), None)
        if pivot is None:
            continue
        matrix[rank], matrix[pivot] = matrix[pivot], matrix[rank]
        for i in range(len(matrix)):
            if i != rank and matrix[i][column]:
                factor = matrix[i][column] / matrix[rank][column]
                matrix[i] = [a - factor * b for a, b in zip(matrix[i], matrix[rank], strict=True)]
        rank += 1
    return rank


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sets(st.integers(min_value=0, max_value=9), min_size=1), min_size=1, max_size=12))
def test_rank_test_agrees_with_rational_elimination(rows) -> None:
    variables = sorted(set().union(*rows))
    dense = [[int(v in row) for v in variables] for row in rows]
    base = _rational_rank(dense)
    expected = {
        v
        for j, v in enumerate(variables)
        if _rational_rank([*dense, [int(k == j) for k in range(len(variables))]]) == base
    }
    assert determined(rows) == expected
