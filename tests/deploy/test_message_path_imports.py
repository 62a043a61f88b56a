"""The ClientApp's per-message path imports no torch.

Flower starts a fresh ClientApp process for every message, so whatever ``handle`` imports for a
message is paid on every one (torch alone: about 1.7 CPU-s).  R0 computes round 1's statistics on
the CPU with numpy (``secure_afl.statistics``); every later round replays the session from the
saved seed and messages, and the classifier message checks a signature.  Each message is handled
here in a fresh interpreter, from the node's state and ledger just before it, and must answer without loading
torch (nor the simulator).  Round 2's pseudo-labels and a node asked for a GPU do import torch.
"""

from __future__ import annotations

import dataclasses
import json
import pickle  # of this test's own temporary files only: nothing from a network is unpickled
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from secure_afl.deploy.client import handle
from secure_afl.deploy.wire import Envelope

from .helpers import InProcessTransport, check_study, make_federation, run_server

ROOT = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter: the node's state and the message, from a file this test wrote.
HANDLE_ONE = """
import json, pickle, sys
from secure_afl.deploy.client import handle
from secure_afl.deploy.wire import Envelope
sys.path.insert(0, {tests!r})
from tests.deploy.helpers import DictState
with open({path!r}, "rb") as f:
    saved = pickle.load(f)
state = DictState()
state.records = saved["records"]
reply = handle(Envelope(**saved["envelope"]), state, saved["settings"])
print(json.dumps({{"kind": reply.kind, "meta": dict(reply.meta),
                  "loaded": sorted(m for m in sys.modules if m.split(".")[0] == "torch"
                                   or m.startswith("secure_afl.sim"))}}))
"""


class RecordingTransport(InProcessTransport):
    """Keeps every node's messages, each with the node's state just before it."""

    def __init__(self, federation, directory: Path) -> None:
        super().__init__(federation)
        self.directory = directory
        self.saved: dict[int, dict[str, Path]] = {}

    def exchange(self, outgoing, group, timeout):
        check_study(self.federation)  # what the in-process exchange pins first: before the snapshots
        for node_id, envelope in outgoing.items():
            node = self.federation.nodes[node_id]
            path = self.directory / f"{node_id}-{group}.pickle"
            # Its ledger as it was too: a replayed R0 of a session the ledger released is refused (R8).
            ledger = self.directory / f"{node_id}-{group}-ledger"
            shutil.copytree(node.settings.ledger_dir, ledger)
            with open(path, "wb") as handle_:
                pickle.dump(
                    {
                        "records": node.state.records,
                        "settings": dataclasses.replace(node.settings, ledger_dir=ledger),
                        "envelope": {
                            "kind": envelope.kind,
                            "meta": dict(envelope.meta),
                            "payload": bytes(envelope.payload),
                            "arrays": dict(envelope.arrays),
                        },
                    },
                    handle_,
                )
            self.saved.setdefault(node_id, {})[group] = path
        return super().exchange(outgoing, group, timeout)


@pytest.mark.parametrize("protection", ["mask", "ckks"])
def test_every_message_is_handled_without_torch(tmp_path: Path, protection: str) -> None:
    federation = make_federation(tmp_path / "fed", n_clients=4, dim=6, rows=40, protection=protection)
    snapshots = tmp_path / "snapshots"
    snapshots.mkdir()
    transport = RecordingTransport(federation, snapshots)
    run_server(federation, transport)
    # A node that received every round (CKKS sends R4 to its decryptors only).
    node_id = min(n for n, groups in transport.saved.items() if "s1-R4" in groups)
    saved = transport.saved[node_id]
    groups = list(saved)
    checked = ["verify-sums"] if protection == "mask" else []  # the classifier check's relay
    assert groups == ["s1-R0", "s1-R1", "s1-R2", "s1-R3", "s1-R4", "classifier", *checked]
    # R0 on the CPU, whatever this host has (``auto`` would use a GPU, through torch, where one is)
    with open(saved["s1-R0"], "rb") as f:
        snapshot = pickle.load(f)
    snapshot["settings"] = dataclasses.replace(snapshot["settings"], device="cpu")
    with open(saved["s1-R0"], "wb") as f:
        pickle.dump(snapshot, f)
    for group in groups:
        code = HANDLE_ONE.format(tests=str(ROOT), path=str(saved[group]))
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT
        )
        assert result.returncode == 0, f"{group}: {result.stderr[-2000:]}"
        answer = json.loads(result.stdout.strip().splitlines()[-1])
        assert answer["kind"] in ("reply", "ack"), f"{group}: {answer}"
        assert answer["loaded"] == [], f"{group} loaded {answer['loaded'][:5]}..."


def test_the_snapshot_replays_as_the_node_answered(tmp_path: Path) -> None:
    """The fresh-process replay is faithful: the same state and message give the in-process answer."""
    federation = make_federation(tmp_path / "fed", n_clients=4, dim=6, rows=40)
    node_id = min(federation.nodes)
    transport = RecordingTransport(federation, tmp_path)
    run_server(federation, transport)
    with open(transport.saved[node_id]["s1-R3"], "rb") as f:
        saved = pickle.load(f)
    from .helpers import DictState

    state = DictState()
    state.records = saved["records"]
    reply = handle(Envelope(**saved["envelope"]), state, saved["settings"])
    recorded = [r for n, g, r in transport.received if n == node_id and g == "s1-R3"]
    assert reply.payload == recorded[0].payload


def test_a_dp_round_one_is_handled_without_torch(tmp_path: Path) -> None:
    """Under DP, R0 clips, rounds and noises the statistics: numpy too."""
    from secure_afl.deploy.study import Method, StudyDp

    federation = make_federation(
        tmp_path / "fed", n_clients=4, dim=6, rows=40, method=Method(balance="global")
    )
    lists = {cid: tuple(data[2]) for cid, data in federation.data.items()}
    federation.study = dataclasses.replace(
        federation.study, dp=StudyDp(class_lists=lists, epsilon=2.0, clip=8.0)
    )
    snapshots = tmp_path / "snapshots"
    snapshots.mkdir()
    transport = RecordingTransport(federation, snapshots)
    run_server(federation, transport)
    node_id = min(transport.saved)
    path = transport.saved[node_id]["s1-R0"]
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    snapshot["settings"] = dataclasses.replace(snapshot["settings"], device="cpu")
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)
    code = HANDLE_ONE.format(tests=str(ROOT), path=str(path))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-2000:]
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert answer["kind"] == "reply" and answer["meta"].get("error") is None, answer
    assert answer["loaded"] == [], f"DP R0 loaded {answer['loaded'][:5]}..."
