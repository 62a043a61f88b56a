"""A node's session records live in its ledger-dir (deploy/node_state.py), written before each reply,
not in Flower's ``context.state``: Flower 1.42 stores a ClientApp's context when its process exits,
after the reply left, and keeps whichever context arrives last, so a ClientApp may start from the
state before the last answer and one that did may store it over the newer.  Flower's Grid and
SuperNode are stand-ins over the in-process federation, with a fake clock."""

from __future__ import annotations

import copy
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict

from secure_afl.deploy import apps
from secure_afl.deploy.apps import GridTransport, answer
from secure_afl.deploy.audit import node_audit_log
from secure_afl.deploy.errors import ConfigurationError
from secure_afl.deploy.node_state import STATE_DIR, NodeStateFiles
from secure_afl.deploy.wire import Envelope, to_record_dict
from secure_afl.keys.auditlog import read_log

from .helpers import Clock, check_study, flower_reply, make_federation, run_server

RUN = 7
RACED = {(1001, "s1-R3"), (1002, "s1-R1"), (1003, "classifier"), (1000, "verify-sums")}


@pytest.fixture
def plain_messages(monkeypatch):
    # Flower's Message needs a running ServerApp's context: a plain record stands in for it.
    monkeypatch.setattr(
        "secure_afl.deploy.apps.Message", lambda content, **meta: SimpleNamespace(content=content, **meta)
    )


def _context(node: int = 1, config: dict[str, str] | None = None, run: int = RUN) -> Context:
    return Context(run_id=run, node_id=node, node_config=config or {}, state=RecordDict(), run_config={})


def _node_config(settings) -> dict[str, str]:
    return {
        "identity-key": str(settings.identity_key), "passphrase-file": str(settings.passphrase_file),
        "roster": str(settings.roster), "features": str(settings.features), "out-dir": str(settings.out_dir),
        "ledger-dir": str(settings.ledger_dir), "device": "cpu", "protection": "mask", "colluders": "0",
    }  # fmt: skip


class SuperNodes:
    """Each node's context as a SuperNode keeps it: a ClientApp gets a copy when it starts, and its
    copy is stored back when it ends.  At a ``(node, group)`` in ``raced`` the ClientApp starts from
    the context before the node's last answer and, ending after that answer's context was stored,
    stores its own over it (Flower keeps the last)."""

    def __init__(self, federation, raced=()) -> None:
        self.raced = set(raced)
        self.stored = {n: _context(n, _node_config(node.settings)) for n, node in federation.nodes.items()}
        self.previous = {n: copy.deepcopy(c) for n, c in self.stored.items()}
        self.current: Context | None = None  # the running ClientApp's context
        self.answers: list[tuple[int, str, str]] = []

    def client_app(self, node: int, group: str, content) -> Envelope:
        raced = (node, group) in self.raced
        self.current = copy.deepcopy(self.previous[node] if raced else self.stored[node])
        reply = answer(content, self.current)
        self.answers.append((node, group, reply.kind))
        self.previous[node], self.stored[node] = self.stored[node], self.current
        return reply


class Grid:
    """A SuperLink: a pushed message reaches its node's ClientApp at once; its reply is pulled."""

    def __init__(self, supernodes: SuperNodes) -> None:
        self.supernodes = supernodes
        self.held: dict[str, object] = {}
        self.pushed: list[tuple[int, str]] = []

    def get_node_ids(self):
        return sorted(self.supernodes.stored)

    def push_messages(self, messages):
        ids = []
        for message in messages:
            message_id = f"m{len(self.pushed)}"
            self.pushed.append((message.dst_node_id, message.group_id))
            reply = self.supernodes.client_app(message.dst_node_id, message.group_id, message.content)
            self.held[message_id] = flower_reply(message_id, reply)
            ids.append(message_id)
        return ids

    def pull_messages(self, ids):
        return [self.held[m] for m in ids if m in self.held]


def _run(federation, supernodes: SuperNodes):
    check_study(federation)
    clock = Clock()
    grid = Grid(supernodes)
    transport = GridTransport(grid, log=lambda s: None, clock=clock, sleep=clock.sleep, resends=3)
    server, classifier, _ = run_server(federation, transport, round_limit=100)  # type: ignore[arg-type]
    return server, classifier, grid


def test_a_clientapp_started_from_an_older_context_answers_from_the_nodes_records(
    tmp_path: Path, plain_messages
) -> None:
    federation = make_federation(tmp_path, n_clients=4)
    supernodes = SuperNodes(federation, raced=RACED)
    server, classifier, grid = _run(federation, supernodes)
    # Every raced message was answered from the node's records: no dropout or refusal, every node
    # verified the classifier.
    assert all(kind in ("reply", "ack") for _, _, kind in supernodes.answers)
    assert all(raced in grid.pushed for raced in RACED)
    assert server.report.dropouts == [] and server.report.refusals == []
    assert classifier.sessions[0]["survivors"] == sorted(federation.roster.client_ids)
    assert sorted(server.check.verified) == sorted(federation.roster.client_ids)
    for node_id, node in federation.nodes.items():
        kinds = [r.kind for r in read_log(node_audit_log(node.settings)).records()]  # type: ignore[union-attr]
        assert kinds == ["log-started", "roster-pinned", "session-accepted", "release"]
        # Flower's context holds nothing of the session: the records are the node's files.
        assert len(supernodes.stored[node_id].state) == 0


class ContextState:
    """The records in Flower's ``context.state`` (how the node kept them before deploy/node_state.py)."""

    def __init__(self, context: Context) -> None:
        self.state = context.state

    def exclusive(self):
        import contextlib

        return contextlib.nullcontext()

    def load(self, label: str) -> dict[str, Any] | None:
        if label not in self.state:
            return None
        record = dict(self.state[label])
        if label + "/inputs" in self.state:
            record["inputs"] = {k: a.numpy() for k, a in self.state[label + "/inputs"].items()}
        return record

    def save(self, label: str, record) -> None:
        from flwr.app import Array

        self.state[label] = ConfigRecord({k: v for k, v in record.items() if k != "inputs"})
        if "inputs" in record:
            self.state[label + "/inputs"] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in
                                                         record["inputs"].items()})  # fmt: skip


def test_records_in_flowers_context_fail_the_same_race(tmp_path: Path, plain_messages, monkeypatch) -> None:
    # What the node's files prevent: the same race with the records in context.state.
    federation = make_federation(tmp_path, n_clients=4)
    supernodes = SuperNodes(federation, raced={(1001, "s1-R3")})
    monkeypatch.setattr(apps, "NodeStateFiles", lambda ledger_dir, run: ContextState(supernodes.current))
    server, _, _ = _run(federation, supernodes)
    refused = [(r["from"], r["at"], r["error"]) for r in server.report.refusals]
    assert ("client-1", "session 1 R3", "OutOfOrderMessageError") in refused, refused
    # The survivor that refused R3 never reaches the classifier check: nobody verifies.
    assert server.check.verified == ()


def test_every_field_comes_back_as_saved_and_the_files_are_private(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    record = {
        "status": "active", "seed": bytes(range(32)), "messages": [b"\x00R1", b"", b"\xffR3"], "rows": 2**70,
        "gamma": 0.1 + 0.2, "finished": False, "tiny": 5e-324, "names": ["a", "b"],
        "inputs": {"all|G": np.arange(12.0).reshape(3, 4) / 7, "class/0|b/0": np.array([np.pi, -0.0])},
    }  # fmt: skip
    NodeStateFiles(ledger, RUN).save("../../escape", record)
    loaded = NodeStateFiles(ledger, RUN).load("../../escape")
    assert loaded is not None
    inputs = loaded.pop("inputs")
    assert loaded == {k: v for k, v in record.items() if k != "inputs"}
    assert all(type(loaded[k]) is type(record[k]) for k in loaded)  # bytes stay bytes, bools bools
    for name, array in record["inputs"].items():
        assert inputs[name].dtype == array.dtype and inputs[name].shape == array.shape
        assert inputs[name].tobytes() == array.tobytes()
    # The label names the file by its digest: it stays in the run's directory, 0600 in 0700.
    run_dir = ledger / STATE_DIR / str(RUN)
    files = list(ledger.rglob("*"))
    # The record and its arrays' file, both in the run's directory (beside the lock).
    assert sorted(p for p in files if p.is_file()) == sorted([*run_dir.glob("*.npz"), run_dir / ".lock"])
    assert len(files) == 5
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in run_dir.iterdir())
    assert NodeStateFiles(ledger, RUN).load("another") is None
    # A record the format cannot keep is refused and nothing is written.
    with pytest.raises(TypeError, match="'view'"):
        NodeStateFiles(ledger, RUN).save("x", {"view": {"a": 1}})
    with pytest.raises(TypeError, match="not a numeric array"):
        NodeStateFiles(ledger, RUN).save("x", {"inputs": {"g": np.array([object()])}})
    assert NodeStateFiles(ledger, RUN).load("x") is None
    # The next run forgets this run's records, secrets included.
    NodeStateFiles(ledger, RUN + 1)
    assert not run_dir.exists() and NodeStateFiles(ledger, RUN + 1).load("../../escape") is None


def test_a_malformed_run_id_or_record_is_refused_saying_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="not a number"):
        NodeStateFiles(tmp_path, "../7")
    federation = make_federation(tmp_path, n_clients=3)
    node = federation.nodes[1000]
    files = NodeStateFiles(node.settings.ledger_dir, RUN)
    files.save("1", {"status": "active"})
    path = next((node.settings.ledger_dir / STATE_DIR / str(RUN)).glob("*.npz"))
    path.write_bytes(path.read_bytes()[:40])  # truncated
    with pytest.raises(ConfigurationError, match="unreadable") as caught:
        files.load("1")
    assert "run the session again" in str(caught.value)
    # Through the ClientApp: a refusal naming the error, not a crash (Flower would call it a dropout).
    reply = answer(to_record_dict(Envelope("protocol", {"session": "1", "round": "R1"})),
                   _context(1000, _node_config(node.settings)))  # fmt: skip
    assert reply.kind == "refused" and reply.meta["error"] == "ConfigurationError"
    assert "unreadable" in str(reply.meta["message"])


def test_one_message_is_answered_at_a_time(tmp_path: Path, monkeypatch) -> None:
    # A second ClientApp of the node (a re-sent copy, a message sent at the same time) must not read
    # the records before the first wrote them and write its older ones after: handle runs under an
    # exclusive lock of the run's records, which another open of the lock file cannot take.
    import fcntl
    import os

    federation = make_federation(tmp_path, n_clients=3)
    node = federation.nodes[1000]
    check_study(federation)
    lock = node.settings.ledger_dir / STATE_DIR / str(RUN) / ".lock"
    taken: list[bool] = []

    def handle(envelope, records, settings):
        other = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            taken.append(False)
        except BlockingIOError:
            taken.append(True)
        finally:
            os.close(other)
        return Envelope("ack")

    monkeypatch.setattr(apps, "handle", handle)
    reply = answer(to_record_dict(Envelope("classifier", {})), _context(1000, _node_config(node.settings)))
    assert reply.kind == "ack" and taken == [True]
    # Released when the answer is sent: the next message's ClientApp takes it.
    with NodeStateFiles(node.settings.ledger_dir, RUN).exclusive():
        pass


def test_a_records_arrays_are_written_when_they_change_and_deleted_with_them(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    run_dir = ledger / STATE_DIR / str(RUN)
    gram = np.arange(16.0).reshape(4, 4)

    def arrays_files() -> list[Path]:
        return sorted(p for p in run_dir.glob("*-*.npz"))

    records = NodeStateFiles(ledger, RUN)
    with records.exclusive():
        records.save("1", {"status": "active", "messages": [b"R0"], "inputs": {"all|G": gram}})
        (first,) = arrays_files()
        written = first.stat().st_mtime_ns, first.stat().st_ino
        # A message's saves of the record it read (the same read-only arrays) write the record alone.
        saved = records.load("1")
        records.save("1", {**saved, "messages": [b"R0", b"R1"]})
        records.save("1", {**records.load("1"), "answered-sha256": "ab"})
        assert arrays_files() == [first] and (first.stat().st_mtime_ns, first.stat().st_ino) == written
    # The next message's ClientApp reads both files back, as saved.
    again = NodeStateFiles(ledger, RUN)
    with again.exclusive():
        loaded = again.load("1")
        assert loaded["messages"] == [b"R0", b"R1"] and loaded["answered-sha256"] == "ab"
        assert loaded["inputs"]["all|G"].tobytes() == gram.tobytes()
        # New arrays (equal values, other objects): a new file, the old one deleted.
        again.save("1", {**loaded, "inputs": {"all|G": gram.copy()}})
        (second,) = arrays_files()
        assert second != first and not first.exists()
        # A record saved without arrays (a session over: its secrets dropped) leaves none on the disk.
        again.save("1", {"status": "done"})
        assert arrays_files() == [] and again.load("1") == {"status": "done"}
    assert NodeStateFiles(ledger, RUN).load("1") == {"status": "done"}
    # Any other arrays, in the same message: one replaced, one added, another record's: each written.
    records = NodeStateFiles(ledger, RUN)
    records.save("2", {"inputs": {"g": gram, "h": -gram}})
    for change in ("replace h", "add k", "drop h"):
        with records.exclusive():  # one message: the arrays held are the ones it read
            held = records.load("2")["inputs"]
            inputs = {
                "replace h": {"g": held["g"], "h": gram},
                "add k": {**held, "k": gram},
                "drop h": {"g": held["g"]},
            }[change]
            records.save("2", {"inputs": inputs})
            records.save("1", {"inputs": inputs})  # another record's arrays
        for label in ("1", "2"):  # the next message's ClientApp
            loaded = NodeStateFiles(ledger, RUN).load(label)["inputs"]
            assert sorted(loaded) == sorted(inputs), change
            assert all(loaded[k].tobytes() == inputs[k].tobytes() for k in inputs), change
    assert len(arrays_files()) == 2  # one per record, the older ones deleted
    # A record naming an arrays file that is gone, or another record's, is refused as unreadable.
    one, two = (records._path(label) for label in ("1", "2"))
    one_bytes = one.read_bytes()
    one.write_bytes(two.read_bytes().replace(records._name("2").encode(), records._name("1").encode(), 1))
    with pytest.raises(ConfigurationError, match="unreadable"):
        NodeStateFiles(ledger, RUN).load("1")  # the label inside no longer matches its own file's
    one.write_bytes(one_bytes)
    named = next(p for p in arrays_files() if p.name.startswith(records._name("1")))
    named.rename(named.with_name(records._name("1") + "-0000000000000000.npz.moved"))
    with pytest.raises(ConfigurationError, match="unreadable"):
        NodeStateFiles(ledger, RUN).load("1")
    # A temporary file a killed writer left (its Gram, in the clear) goes at the next message.
    left = run_dir / f".{named.name}.abcdef.tmp"
    left.write_bytes(b"a half-written Gram")
    with NodeStateFiles(ledger, RUN).exclusive():
        assert not left.exists()


def _save_many(ledger: Path, value: float, count: int) -> int:
    records = NodeStateFiles(ledger, RUN)
    for _ in range(count):
        records.save("1", {"status": "active", "inputs": {"g": np.full((64, 64), value)}})
    return count


def _load_many(ledger: Path, count: int) -> set[float]:
    records = NodeStateFiles(ledger, RUN)
    seen = set()
    for _ in range(count):
        loaded = records.load("1")
        if loaded is not None:
            values = np.unique(loaded["inputs"]["g"])
            assert len(values) == 1  # never a mix of two saves
            seen.add(float(values[0]))
    return seen


def test_processes_saving_and_loading_one_record_at_once_never_see_a_broken_one(tmp_path: Path) -> None:
    # Each load and save outside exclusive() takes the lock itself: two writers never leave the record
    # naming an arrays file the other deleted, and a reader never finds one half-replaced.
    import concurrent.futures
    import multiprocessing

    ledger = tmp_path / "ledger"
    NodeStateFiles(ledger, RUN)
    pool = concurrent.futures.ProcessPoolExecutor(3, mp_context=multiprocessing.get_context("fork"))
    with pool:
        writers = [pool.submit(_save_many, ledger, float(v), 40) for v in (1, 2)]
        reader = pool.submit(_load_many, ledger, 80)
        assert [w.result(timeout=120) for w in writers] == [40, 40]
        assert reader.result(timeout=120) <= {1.0, 2.0}
    last = NodeStateFiles(ledger, RUN).load("1")
    assert last is not None and float(last["inputs"]["g"][0, 0]) in (1.0, 2.0)
    assert len(list((ledger / STATE_DIR / str(RUN)).glob("*-*.npz"))) == 1
