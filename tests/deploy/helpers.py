"""An in-process federation: the deployment's server and client code without Flower's processes."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from secure_afl.deploy.classifier import ClassifierSigner
from secure_afl.deploy.client import NodeSettings, handle
from secure_afl.deploy.server import FederationServer
from secure_afl.deploy.study import Method, Study
from secure_afl.deploy.wire import Envelope, from_record_dict, to_record_dict
from secure_afl.features.file import save_feature_file
from secure_afl.keys import IdentityKey, Roster, RosterEntry, save_identity_key
from secure_afl.keys.cosign import cosigned_roster_json, sign_roster

CLASSES = ("A", "B", "C")
BACKBONE = {"name": "toy", "weights_id": "sha256:00", "preprocessing": "none"}
PASSPHRASE = b"test passphrase"
COORDINATOR = "coordinator"


def row_digests(tag: str, n: int, start: int = 0) -> list[str]:
    """Stand-ins for the SHA-256 of ``n`` distinct image files (rows ``start``.. of ``tag``)."""
    return [hashlib.sha256(f"{tag}/image-{i}".encode()).hexdigest() for i in range(start, start + n)]


def pixel_digests(file_digests: Collection[str]) -> list[str]:
    """Stand-ins for the decoded pixels' SHA-256 of the images with these file digests (one each)."""
    return [hashlib.sha256(f"pixels/{digest}".encode()).hexdigest() for digest in file_digests]


class DictState:
    """A node's session records in process, holding what deploy/node_state.py keeps (checked on save)."""

    def __init__(self) -> None:
        self.records: dict[str, dict[str, Any]] = {}

    def load(self, label: str) -> dict[str, Any] | None:
        record = self.records.get(label)
        return copy.deepcopy(record) if record is not None else None

    def save(self, label: str, record: Mapping[str, Any]) -> None:
        from flwr.app import ConfigRecord

        # What NodeStateFiles keeps (ConfigRecord's value types): flat values, arrays apart.
        ConfigRecord({k: v for k, v in record.items() if k != "inputs"})
        self.records[label] = copy.deepcopy(dict(record))


@dataclass
class Node:
    client_id: str
    settings: NodeSettings
    state: DictState = field(default_factory=DictState)
    dead_from: str | None = None  # a group like "s1-R1": from then on the node does not answer


@dataclass
class Federation:
    nodes: dict[int, Node]
    roster: Roster
    study: Study
    data: dict[str, tuple[np.ndarray, np.ndarray, tuple[int, ...]]]  # client -> features, labels, active
    signer: ClassifierSigner | None = None  # the roster's coordinator: signs the classifier
    colluders: int | None = 0  # every node's own bound; the server plans round 2 with the same
    identities: dict[str, IdentityKey] = field(default_factory=dict)  # every institution's key


@dataclass
class Site:
    """A hospital's directory in a test: its keys, passphrase file, features and kit."""

    client_id: str
    root: Path
    key: IdentityKey

    @property
    def keys(self) -> Path:
        return self.root / "keys"

    @property
    def passfile(self) -> Path:
        return self.keys / "pass"

    @property
    def features(self) -> Path:
        return self.root / "features.npz"

    @property
    def kit(self) -> Path:
        return self.root / "kit"

    def expect(self) -> str:
        """``ID=FINGERPRINT`` for ``--expect``."""
        return f"{self.client_id}={self.key.fingerprint}"


def write_cosigned_roster(path: Path, roster: Roster, keys: Mapping[str, IdentityKey]) -> Path:
    """The roster file as a deployment pins it: co-signed by every institution it lists."""
    signatures = dict(sign_roster(roster, keys[entry.client_id]) for entry in roster)
    path.write_text(cosigned_roster_json(roster, signatures))
    return path


def make_federation(
    tmp_path: Path,
    *,
    n_clients: int = 4,
    dim: int = 40,
    rows: int = 60,
    active: Mapping[str, tuple[int, ...]] | None = None,
    method: Method | None = None,
    seed: int = 0,
    protection: str = "mask",
    colluders: int | None = 0,
    coordinator: str | None = None,
) -> Federation:
    """``colluders``: each node's own bound (0 here: these federations of three to five institutions,
    each missing a class, keep groups of two, which one colluder would break; None is the
    deployment's default n - t, which tests of the colluder check ask for).  ``coordinator``: what
    every node's config declares of the coordinator; None: "honest-but-curious" for a two-round
    ``method`` (the tests of round 2's mechanics; a node that declares nothing refuses round 2,
    tests/deploy/test_round2_bounds.py), else the default "active"."""
    model = coordinator
    if model is None:
        model = "honest-but-curious" if method is not None and method.rounds == 2 else "active"
    tmp_path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    identities = {f"client-{k}": IdentityKey.generate() for k in range(n_clients)}
    coordinator = IdentityKey.generate()
    roster = Roster(
        (RosterEntry(cid, cid, key.public_key) for cid, key in identities.items()),
        RosterEntry(COORDINATOR, "Coordinator", coordinator.public_key),
    )
    roster_path = write_cosigned_roster(tmp_path / "roster.json", roster, identities)
    passfile = tmp_path / "pass"
    passfile.write_bytes(PASSPHRASE + b"\n")
    passfile.chmod(0o600)
    nodes: dict[int, Node] = {}
    data = {}
    for k, (cid, key) in enumerate(identities.items()):
        key_path = tmp_path / f"{cid}.key"
        save_identity_key(key_path, key, PASSPHRASE, scrypt_n=2**10)
        features = rng.gamma(2.0, 1.0, size=(rows, dim)).astype(np.float32)
        mine = (active or {}).get(cid, tuple(c for c in range(len(CLASSES)) if c != k))
        labels = (rng.random((rows, len(CLASSES))) < 0.3).astype(np.uint8)
        labels[:, [c for c in range(len(CLASSES)) if c not in mine]] = 0
        features_path = tmp_path / f"{cid}.npz"
        save_feature_file(
            features_path, features, labels=labels, active=mine, classes=CLASSES,
            backbone="toy", weights_id="sha256:00", preprocessing="none",
            image_sha256=row_digests(f"{seed}/{cid}", rows),
            pixel_sha256=pixel_digests(row_digests(f"{seed}/{cid}", rows)),
        )  # fmt: skip
        settings = NodeSettings(
            identity_key=key_path, passphrase_file=passfile, roster=roster_path, features=features_path,
            out_dir=tmp_path / f"out-{cid}", ledger_dir=tmp_path / f"ledger-{cid}", device="cpu",
            protections=frozenset({protection}), colluders=colluders, coordinator=model,
        )  # fmt: skip
        nodes[1000 + k] = Node(cid, settings)
        data[cid] = (features, labels, mine)
    study = Study(
        classes=CLASSES, dim=dim, backbone=dict(BACKBONE), method=method or Method(), protection=protection
    )
    signer = ClassifierSigner(COORDINATOR, coordinator)
    return Federation(nodes, roster, study, data, signer, colluders, identities)


class InProcessTransport:
    """Calls each node's handler directly, through Flower's record form (as the apps do)."""

    def __init__(
        self, federation: Federation, *, tamper: Callable[[int, str, Envelope], Envelope] | None = None
    ):
        self.federation = federation
        self.tamper = tamper
        self.sent: list[tuple[int, str, Envelope]] = []
        self.pin = True  # record the federation's study at nodes that checked none (deploy check)
        self.received: list[tuple[int, str, Envelope]] = []

    def node_ids(self) -> list[int]:
        return sorted(self.federation.nodes)

    def exchange(self, outgoing: Mapping[int, Envelope], group: str, timeout: float) -> dict[int, Envelope]:
        if self.pin:
            check_study(self.federation)
        replies = {}
        for node_id, envelope in outgoing.items():
            node = self.federation.nodes[node_id]
            if node.dead_from is not None and _reached(group, node.dead_from):
                continue
            if self.tamper is not None:
                envelope = self.tamper(node_id, group, envelope)
            self.sent.append((node_id, group, envelope))
            wired = from_record_dict(to_record_dict(envelope))
            reply = from_record_dict(to_record_dict(handle(wired, node.state, node.settings)))
            self.received.append((node_id, group, reply))
            replies[node_id] = reply
        return replies


def check_study(federation: Federation, study: Study | None = None, nodes: Any = None) -> None:
    """What ``deploy check --study`` records at each node (``nodes``: those of the federation) that
    has not checked a study yet: ``study`` (default: the federation's) is the one it takes part in."""
    from secure_afl.deploy.client import pin_study, pinned_study

    for node_id in federation.nodes if nodes is None else nodes:
        settings = federation.nodes[node_id].settings
        if nodes is not None or pinned_study(settings) is None:
            pin_study(settings, study or federation.study, "2026-12-01T00:00:00+00:00")


ORDER = [
    "s1-R0",
    "s1-R1",
    "s1-R2",
    "s1-R3",
    "s1-R4",
    "s2-R0",
    "s2-R1",
    "s2-R2",
    "s2-R3",
    "s2-R4",
    "classifier",
    "verify-sums",
]


def _reached(group: str, dead_from: str) -> bool:
    return ORDER.index(group) >= ORDER.index(dead_from)


def run_server(federation: Federation, transport: InProcessTransport | None = None, **kwargs: Any):
    """The server over ``federation`` (in process, 1 s rounds, quiet); its classifier is delivered.

    Returns ``(server, classifier, transport)``."""
    transport = transport or InProcessTransport(federation)
    kwargs.setdefault("signer", federation.signer)
    kwargs.setdefault("colluders", "n-t" if federation.colluders is None else federation.colluders)
    kwargs.setdefault("log", lambda s: None)
    server = FederationServer(transport, federation.roster, federation.study, round_timeout=1, **kwargs)
    classifier = server.run()
    server.deliver(classifier)
    return server, classifier, transport


def centralised_global_fit(
    rows: Mapping[str, np.ndarray],
    labels: Mapping[str, np.ndarray],
    active: Mapping[str, Collection[int]],
    n_classes: int,
    gamma: float,
) -> np.ndarray:
    """The global-balance ridge fit on the pooled rows, by numpy alone (no secure-afl code): class c
    over the rows of the institutions that label c (positives' mean minus negatives' mean), the Gram
    over every row; ``rows[cid]`` and ``labels[cid]`` are one institution's released rows, in any
    order.  What a growing federation's classifier must equal."""
    h = np.vstack([np.asarray(rows[cid], dtype=np.float64) for cid in rows])
    gram = h.T @ h
    weights = np.empty((h.shape[1], n_classes))
    for c in range(n_classes):
        labelled = [cid for cid in rows if c in active[cid]]
        hc = np.vstack([np.asarray(rows[cid], dtype=np.float64) for cid in labelled])
        yc = np.concatenate([np.asarray(labels[cid])[:, c].astype(bool) for cid in labelled])
        b = hc[yc].mean(axis=0) - hc[~yc].mean(axis=0)
        weights[:, c] = np.linalg.solve(gram + gamma * np.eye(h.shape[1]), b)
    return weights


class Clock:
    """A clock and sleep for GridTransport (``clock=clock, sleep=clock.sleep``): sleeping moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def flower_reply(message_id: str, envelope: Envelope) -> Any:
    """A Flower reply as the Grid's pull returns it (``reply_to_message_id``, the record form)."""
    from types import SimpleNamespace

    from secure_afl.deploy.wire import to_record_dict

    return SimpleNamespace(
        metadata=SimpleNamespace(reply_to_message_id=message_id),
        has_error=lambda: False,
        content=to_record_dict(envelope),
    )


def flower_error(message_id: str, reason: str) -> Any:
    """Flower's own error reply (code 5, e.g. the node unavailable or its ClientApp dead)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        metadata=SimpleNamespace(reply_to_message_id=message_id),
        has_error=lambda: True,
        error=SimpleNamespace(code=5, reason=reason),
    )
