"""What a hospital's ClientApp does with each server message (Flower-independent).

:func:`handle` takes one :class:`~secure_afl.deploy.wire.Envelope`, the SuperNode's local state and
the node's settings, and returns the reply.  Flower runs the ClientApp in a fresh process for every
message, so the protocol's client session cannot stay in memory: at a session's first message the
client draws a 32-byte seed (``os.urandom``), and for every later message it rebuilds the session
from that seed and the server messages received so far (the state machine is deterministic given
its randomness), then feeds the new one.  The seed, the messages and the protocol inputs live in the
SuperNode's local state (Flower's ``context.state``, which stays on the hospital's machine) and are
deleted when the session ends or fails.

Before anything leaves it, the client checks, in this order: the server's roster fingerprint against
its own pinned roster (:class:`RosterMismatchError`), that its own key is in that roster
(:class:`IdentityNotInRosterError`), the study against its feature file and its policy
(:class:`StudyMismatchError`), that the session was not started before in this run
(:class:`SessionReplayError`); then the protocol's own checks.  Any failure answers ``refused`` with
the error's class and message (and is printed in the SuperNode's log); the session's secrets are
dropped and every later message of that session is refused.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from secure_afl.keys.files import load_identity_key
from secure_afl.keys.identity import IdentityKey
from secure_afl.keys.roster import Roster

from .backend import BACKENDS, Backend
from .classifier import Classifier
from .errors import (
    ConfigurationError,
    IdentityNotInRosterError,
    RosterMismatchError,
    SessionReplayError,
    StudyMismatchError,
)
from .study import Study, round1_layout, round2_layout
from .wire import Envelope


class LocalState(Protocol):
    """The SuperNode's local state for one run: named records of bytes, text and arrays."""

    def load(self, label: str) -> dict[str, Any] | None: ...

    def save(self, label: str, record: Mapping[str, Any]) -> None: ...


@dataclass(frozen=True)
class NodeSettings:
    """A hospital's SuperNode settings (``flower-supernode --node-config 'key="value" ...'``)."""

    identity_key: Path
    passphrase_file: Path
    roster: Path
    features: Path
    out_dir: Path
    ledger_dir: Path
    device: str = "auto"
    allow_class_gram: bool = False

    KEYS = ("identity-key", "passphrase-file", "roster", "features", "ledger-dir", "out-dir")

    @classmethod
    def from_node_config(cls, config: Mapping[str, object]) -> NodeSettings:
        missing = [key for key in cls.KEYS if not isinstance(config.get(key), str) or not config.get(key)]
        if missing:
            raise ConfigurationError(
                f"the SuperNode's --node-config lacks {missing}; it needs identity-key, passphrase-file, "
                f"roster, features, ledger-dir and out-dir (paths on this machine)"
            )
        return cls(
            identity_key=Path(str(config["identity-key"])),
            passphrase_file=Path(str(config["passphrase-file"])),
            roster=Path(str(config["roster"])),
            features=Path(str(config["features"])),
            out_dir=Path(str(config["out-dir"])),
            ledger_dir=Path(str(config["ledger-dir"])),
            device=str(config.get("device", "auto")),
            allow_class_gram=str(config.get("allow-class-gram", "false")).lower() == "true",
        )


class ReplayGate:
    """The ledger as a rebuilt session sees it: silent while the answered messages are replayed.

    Those messages were checked against the ledger (and this session recorded in R3) when they
    first arrived; replaying them against the ledger would test the session against its own
    record.  So during the replay the history is empty and nothing is recorded (the replies do not
    depend on it: a check that passed with a history passes without one); the new message meets
    the real ledger.
    """

    def __init__(self, ledger: Any, *, live: bool) -> None:
        self.ledger = ledger
        self.live = live

    def history(self, owner: Any, input_digest: bytes) -> tuple:
        return tuple(self.ledger.history(owner, input_digest)) if self.live else ()

    def check_and_record(self, owner: Any, input_digest: bytes, record: Any, check: Any) -> None:
        if self.live:
            self.ledger.check_and_record(owner, input_digest, record, check)
        else:
            check(())


def _ledger(settings: NodeSettings, *, live: bool) -> ReplayGate:
    from secure_afl.privacy.ledger import FileLedger

    return ReplayGate(FileLedger(settings.ledger_dir), live=live)


def log(settings: NodeSettings | None, text: str) -> None:
    print(f"secure-afl client: {text}", file=sys.stderr, flush=True)


def handle(envelope: Envelope, state: LocalState, settings: NodeSettings) -> Envelope:
    """Answer one server message; every refusal is a ``refused`` envelope naming the error."""
    label = str(envelope.meta.get("session", ""))
    round_name = str(envelope.meta.get("round", ""))
    try:
        if envelope.kind == "advertise":
            return _start_session(envelope, label, state, settings)
        if envelope.kind == "protocol":
            return _continue_session(envelope, label, state, settings)
        if envelope.kind == "classifier":
            return _store_classifier(envelope, state, settings)
        raise SessionReplayError(f"unexpected {envelope.kind!r} message from the server")
    except Exception as exc:  # every failure is answered (its class named), logged, and ends the session
        log(settings, f"REFUSED session {label or '-'} {round_name}: {type(exc).__name__}: {exc}")
        if label and envelope.kind in ("advertise", "protocol"):
            saved = state.load(label)
            if saved is None or saved.get("status") == "active":
                state.save(label, {"status": f"failed: {type(exc).__name__}"})
        return Envelope.refusal(exc, session=label, round=round_name)


# --- sessions ---------------------------------------------------------------------------------


def _identity(settings: NodeSettings, roster: Roster) -> tuple[str, IdentityKey]:
    from secure_afl.keys.commands import read_passphrase_file

    try:
        passphrase = read_passphrase_file(settings.passphrase_file)
    except Exception as exc:  # click.ClickException: bad permissions, missing file
        raise ConfigurationError(getattr(exc, "message", str(exc))) from None
    identity = load_identity_key(settings.identity_key, passphrase)
    for entry in roster:
        if entry.public_key == identity.public_key:
            return entry.client_id, identity
    raise IdentityNotInRosterError(
        f"this institution's identity key ({identity.fingerprint}) is not in its roster {settings.roster}; "
        f"the coordinator must add it (`secure-afl keys roster add`) and every institution pin the new roster"
    )


def _roster(settings: NodeSettings) -> Roster:
    try:
        return Roster.from_json(settings.roster.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigurationError(f"{settings.roster}: cannot read the roster: {exc.strerror}") from None


def _check_study(study: Study, settings: NodeSettings) -> Any:
    from secure_afl.features.file import load_feature_file

    data = load_feature_file(settings.features, require_labels=True)
    if data.classes != study.classes:
        raise StudyMismatchError(
            f"the study's classes {study.classes} differ from this feature file's {data.classes}"
        )
    if data.dim != study.dim:
        raise StudyMismatchError(
            f"the study expects {study.dim}-d features, this feature file has {data.dim}"
        )
    for key in ("name", "weights_id", "preprocessing"):
        if data.describe_backbone()[key] != study.backbone.get(key):
            raise StudyMismatchError(
                f"the study's backbone {key} is {study.backbone.get(key)!r}, this feature file's is "
                f"{data.describe_backbone()[key]!r}: extract the features with the study's backbone"
            )
    if study.method.gram == "class" and not settings.allow_class_gram:
        raise StudyMismatchError(
            "the study sums each class's Gram matrix separately (gram='class'), which lets overlapping "
            "class groups reveal one institution's Gram (SECURITY.md); this node refuses it unless its "
            'node config sets allow-class-gram="true"'
        )
    return data


def _inputs(
    label: str, study: Study, data: Any, envelope: Envelope, groups: set[str], settings: NodeSettings
):
    """This client's protocol inputs for session ``label``: group -> tensor -> flat float64 vector."""
    from secure_afl.analytic import PseudoLabelConfig, client_statistics, pseudo_label_contributions

    method = study.method
    if label == "1":
        layout = round1_layout(study)
        stats = client_statistics(data.features, data.labels, device=settings.device)
        contributions = stats.contributions(
            data.active, balance=method.balance, gram=method.gram, include_global_gram=method.rounds == 2
        )
    elif label == "2":
        coef = envelope.arrays.get("coef")
        if coef is None or coef.shape != (study.dim, study.n_classes):
            raise StudyMismatchError(
                f"round 2 needs the round-1 coefficients ({study.dim} × {study.n_classes})"
            )
        config = PseudoLabelConfig(
            tau=method.tau, alpha=method.alpha, min_pos=method.min_pos, min_neg=method.min_neg
        )
        contributions, _ = pseudo_label_contributions(
            data.features, coef, data.active, config=config, device=settings.device
        )
        classes = [int(g.split("/")[1]) for g in groups if g.startswith("pseudo/")]
        layout = round2_layout(study, classes)
        contributions = {g: t for g, t in contributions.items() if g in groups}
    else:
        raise SessionReplayError(f"unknown session {label!r}")
    unknown = set(contributions) - groups
    if unknown:
        raise StudyMismatchError(f"the session lacks this client's groups {sorted(unknown)}")
    return {
        group: {name: layout.flatten(name, values) for name, values in tensors.items()}
        for group, tensors in contributions.items()
    }


def _start_session(envelope: Envelope, label: str, state: LocalState, settings: NodeSettings) -> Envelope:
    if state.load(label) is not None:
        raise SessionReplayError(
            f"session {label} of this run was already started: a second start over the same inputs is refused"
        )
    roster = _roster(settings)
    if envelope.text("roster") != roster.fingerprint:
        raise RosterMismatchError(
            f"the server's roster is {envelope.text('roster')}, this institution pinned {roster.fingerprint} "
            f"({settings.roster}): compare rosters with `secure-afl keys roster show`"
        )
    client_id, identity = _identity(settings, roster)
    study = Study.from_json(envelope.text("study"))
    data = _check_study(study, settings)
    backend = _backend(envelope)
    request = backend.decode(envelope.payload, backend.first_message_limit)  # type: ignore[attr-defined]
    groups = {group.name for group in request.config.groups}
    inputs = _inputs(label, study, data, envelope, groups, settings)
    seed = os.urandom(32)
    session = backend.client_session(
        client_id, identity, roster, inputs, seed, min_group_size=study.min_group_size,
        ledger=_ledger(settings, live=True),
    )  # fmt: skip
    replies = session.receive_bytes(envelope.payload)  # decoded again under the session's own limits
    state.save(
        label,
        {
            "status": "active",
            "client_id": client_id,
            "backend": backend.name,
            "study": study.to_json(),
            "session_id": request.config.session_id.hex(),
            "seed": seed,
            "messages": [envelope.payload],
            "inputs": {f"{g}|{t}": v for g, tensors in inputs.items() for t, v in tensors.items()},
        },
    )
    log(settings, f"{client_id}: session {label} R0 answered (groups {sorted(inputs)})")
    return Envelope("reply", {"session": label, "round": "R0"}, replies[0])


def _continue_session(envelope: Envelope, label: str, state: LocalState, settings: NodeSettings) -> Envelope:
    saved = state.load(label)
    if saved is None:
        raise SessionReplayError(
            f"a {envelope.meta.get('round')} message for session {label}, which this run never started"
        )
    if saved.get("status") != "active":
        raise SessionReplayError(f"session {label} is over ({saved.get('status')}); the message is refused")
    roster = _roster(settings)
    client_id, identity = _identity(settings, roster)
    if client_id != saved["client_id"]:
        raise IdentityNotInRosterError("the identity key changed during the session")
    backend = BACKENDS[str(saved["backend"])]
    study = Study.from_json(str(saved["study"]))
    inputs: dict[str, dict[str, np.ndarray]] = {}
    for key, values in saved["inputs"].items():
        group, tensor = key.split("|", 1)
        inputs.setdefault(group, {})[tensor] = np.asarray(values, dtype=np.float64)
    gate = _ledger(settings, live=False)
    session = backend.client_session(
        client_id, identity, roster, inputs, saved["seed"], min_group_size=study.min_group_size, ledger=gate
    )
    # Rebuild: the same seed and the same server messages give the same state, secrets included.
    for data in saved["messages"]:
        session.receive_bytes(data)
    gate.live = True
    replies = session.receive_bytes(envelope.payload)
    round_name = str(envelope.meta.get("round", ""))
    if getattr(session, "state", None) is not None and session.state.name == "DONE":
        # The session's secrets are no longer needed: keep only what the classifier check uses.
        state.save(label, {"status": "done", "client_id": client_id, "session_id": saved["session_id"]})
    else:
        state.save(label, {**saved, "messages": [*saved["messages"], envelope.payload]})
    log(settings, f"{client_id}: session {label} {round_name} answered")
    return Envelope("reply", {"session": label, "round": round_name}, replies[0])


def _backend(envelope: Envelope) -> Backend:
    name = envelope.text("backend")
    if name not in BACKENDS:
        raise StudyMismatchError(
            f"unknown secure-aggregation backend {name!r}; this node has {sorted(BACKENDS)}"
        )
    return BACKENDS[name]


def _store_classifier(envelope: Envelope, state: LocalState, settings: NodeSettings) -> Envelope:
    classifier = Classifier.from_json(envelope.payload, source="the server's classifier")
    roster = _roster(settings)
    if classifier.roster_fingerprint != roster.fingerprint:
        raise RosterMismatchError(
            f"the classifier was made with roster {classifier.roster_fingerprint}, not this institution's "
            f"{roster.fingerprint}"
        )
    mine = {}
    for session in classifier.sessions:
        saved = state.load(str(session["label"]))
        if saved is None or saved.get("status") != "done":
            raise SessionReplayError(
                f"this institution did not complete session {session['label']} of this run"
            )
        if saved["session_id"] != session["session_id"]:
            raise SessionReplayError(
                f"the classifier names session {session['label']} {session['session_id'][:16]}..., this "
                f"institution took part in {saved['session_id'][:16]}..."
            )
        mine[session["label"]] = saved["client_id"]
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    path = settings.out_dir / f"classifier-{classifier.sessions[0]['session_id'][:16]}.json"
    classifier.save(path)
    digest = hashlib.sha256(envelope.payload).hexdigest()
    log(settings, f"stored the classifier in {path}")
    return Envelope("ack", {"path": str(path), "sha256": digest})
