"""The session ledger, the exposure rank test and the client policy, as units."""

from __future__ import annotations

import json
import os
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secure_afl.core.errors import (
    LedgerFullError,
    LedgerMissingError,
    LedgerTamperedError,
    LedgerUnreadableError,
)
from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.keys.identity import IdentityKey
from secure_afl.privacy.exposure import client_exposures, determined, exposed_clients
from secure_afl.privacy.ledger import (
    MAX_OPEN_SESSIONS,
    MAX_SESSION_RECORD_BYTES,
    FileLedger,
    LedgerOwner,
    LedgerState,
    MemoryLedger,
)
from secure_afl.privacy.policy import ClientPolicy, active_threshold, majority_threshold, threat_model

from .hostile import clients_for, federation


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


def test_client_check_names_colluders_and_links_one_value_under_two_names() -> None:
    own = {("A", "x"): "v", ("B", "y"): "v"}  # one value sent as x to A and as y to B
    groups = {"A": (("c1", "c2", "c3"), ("x",)), "B": (("c1", "c2", "c3"), ("y",))}
    # Per name nothing is isolated; linked by the value, A - B = c2's x - c2's y, still nothing for c1.
    assert client_exposures("c1", own, groups, round_name="R1") == ()
    groups["B"] = (("c1", "c2"), ("y",))
    # x: c1 + c2 + c3, y: c1 + c2 (the same c1 value): c3 is isolated only if c2's x and y are one value;
    # c1's value with one colluder (c2): from B.
    (finding,) = client_exposures("c1", own, groups, round_name="R3", colluders=1)
    assert finding.clients == ("c1",) and finding.colluders == ("c2",) and finding.tensor == "x + y"


# --- ledgers --------------------------------------------------------------------------------------


def _release(session: bytes, survivors: tuple[str, ...], ids: tuple[str, ...] = ("v1",)):
    def change(state: LedgerState) -> None:
        entry = state.entry(session * 32)
        entry.survivors, entry.released = survivors, ids

    return change


def test_file_ledger_survives_a_restart_and_is_private(tmp_path) -> None:
    owner = _owner()
    ledger = FileLedger(tmp_path / "ledger")
    ledger.update(owner, _release(b"1", ("c0", "c1")))
    again = FileLedger(tmp_path / "ledger")  # a new process: only the file remains
    state = again.load(owner)
    assert state.sessions[(b"1" * 32).hex()].survivors == ("c0", "c1")
    assert state.released_in(b"2" * 32)[0] == {"v1": (b"1" * 32).hex()}
    assert state.released_in(b"1" * 32)[0] == {}  # a session is never "another" one to itself
    mode = stat.S_IMODE(os.stat(again.path("c1")).st_mode)
    assert mode == 0o600
    assert not [p for p in (tmp_path / "ledger").iterdir() if p.name.endswith(".tmp")]


def test_update_is_atomic_with_the_check(tmp_path) -> None:
    for ledger in (MemoryLedger(), FileLedger(tmp_path)):
        owner = _owner()
        ledger.update(owner, _release(b"1", ("c0",)))

        def refuse(state):
            state.entry(b"2" * 32).survivors = ("c1",)
            raise RuntimeError("refused")

        with pytest.raises(RuntimeError):
            ledger.update(owner, refuse)
        assert list(ledger.load(owner).sessions) == [(b"1" * 32).hex()]  # the refused one is not kept


@pytest.mark.parametrize("edit", ["rewrite survivors", "drop a release", "drop a session"])
def test_tampered_ledger_is_refused(tmp_path, edit) -> None:
    owner = _owner()
    ledger = FileLedger(tmp_path)
    ledger.update(owner, _release(b"1", ("c0", "c1")))
    ledger.update(owner, _release(b"2", ("c1", "c2"), ("v2",)))
    path = ledger.path("c1")
    document = json.loads(path.read_text())
    sessions = document["sessions"]
    if edit == "rewrite survivors":
        sessions[(b"1" * 32).hex()]["survivors"] = ["c1"]
    elif edit == "drop a release":
        sessions[(b"2" * 32).hex()]["released"] = []
    else:
        del sessions[(b"1" * 32).hex()]
    path.write_text(json.dumps(document))
    with pytest.raises(LedgerTamperedError, match="not signed"):
        ledger.load(owner)


def test_a_ledger_signed_by_another_key_is_refused(tmp_path) -> None:
    ledger = FileLedger(tmp_path)
    ledger.update(_owner(), _release(b"1", ("c0", "c1")))
    with pytest.raises(LedgerTamperedError):
        ledger.load(LedgerOwner("c1", _owner("c9").identity))
    ledger.path("c1").rename(ledger.path("c2"))
    with pytest.raises(LedgerTamperedError, match="belongs to"):
        ledger.load(_owner("c2"))


@pytest.mark.parametrize(
    "content", [b"", b"{not json", b'{"format": "other", "signature": "00"}', b"\xff\xfe"]
)
def test_unreadable_ledger_is_refused(tmp_path, content) -> None:
    ledger = FileLedger(tmp_path)
    ledger.path("c1").write_bytes(content)
    with pytest.raises(LedgerUnreadableError, match="restore it from a backup"):
        ledger.load(_owner())


def test_a_client_refuses_to_start_on_a_tampered_ledger(tmp_path) -> None:
    fed = federation(3)
    FileLedger(tmp_path).path("c0").write_text("{}")
    with pytest.raises(LedgerUnreadableError):
        clients_for(fed, policy=ClientPolicy.deployment(), ledgers={"c0": FileLedger(tmp_path)}, ids=("c0",))


def test_a_deleted_or_rolled_back_ledger_is_refused_until_an_operator_resets_it(tmp_path) -> None:
    owner = _owner()
    ledger = FileLedger(tmp_path)
    ledger.update(owner, _release(b"1", ("c0", "c1")))
    old = ledger.path("c1").read_bytes()  # a backup of generation 1
    ledger.update(owner, _release(b"2", ("c1", "c2"), ("v2",)))
    ledger.path("c1").write_bytes(old)  # restored: signed, but older than the last one written
    with pytest.raises(LedgerMissingError, match="older than generation 2"):
        ledger.load(owner)
    ledger.path("c1").unlink()  # deleted
    with pytest.raises(LedgerMissingError, match="missing although generation 2 was written"):
        ledger.load(owner)
    with pytest.raises(ValueError, match="reason"):
        ledger.reset("c1", " ")
    ledger.reset("c1", "migrated to a new server, ticket 42")
    assert ledger.load(owner).sessions == {}  # a new, empty history, and the reset is logged
    (line,) = (tmp_path / "ledger-resets.log").read_text().splitlines()
    assert json.loads(line)["client_id"] == "c1" and "ticket 42" in json.loads(line)["reason"]


def test_a_session_record_over_its_cap_refuses_that_session_only(tmp_path) -> None:
    owner = _owner()
    ledger = FileLedger(tmp_path)
    huge = tuple(f"{i:064x}" for i in range(MAX_SESSION_RECORD_BYTES // 60))
    with pytest.raises(LedgerFullError, match="the session is refused"):
        ledger.update(owner, _release(b"1", ("c0", "c1"), huge))
    assert not ledger.path("c1").exists()  # nothing written
    ledger.update(owner, _release(b"2", ("c0", "c1")))  # an ordinary session still goes through
    assert list(ledger.load(owner).sessions) == [(b"2" * 32).hex()]


def test_sessions_that_released_nothing_are_kept_for_their_answers_up_to_a_cap() -> None:
    owner, ledger = _owner(), MemoryLedger()
    ledger.update(owner, _release(b"r", ("c0", "c1")))
    for k in range(MAX_OPEN_SESSIONS + 10):
        ledger.update(owner, lambda state, k=k: state.entry(k.to_bytes(32, "big")).answers.update(R0="d"))
    sessions = ledger.load(owner).sessions
    assert (b"r" * 32).hex() in sessions  # a release is never dropped
    assert len(sessions) == MAX_OPEN_SESSIONS + 1
    assert (10).to_bytes(32, "big").hex() in sessions and (9).to_bytes(32, "big").hex() not in sessions


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
