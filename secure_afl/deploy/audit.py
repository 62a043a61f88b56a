"""What each party writes in its audit log (:mod:`secure_afl.keys.auditlog`), and when.

**At a node** (``LEDGER_DIR/audit.log``, signed with the node's identity key):

- ``session-accepted``: a session this node answered in R0: the session's label and id, the study's
  digest, the roster's fingerprint, the peers (the roster's other ids) and the protection;
- ``session-refused``: every refusal it answered (any round, or the classifier): what it told the
  coordinator, the error's class and the message without this machine's paths (the rule it
  broke), with the study's digest and the session id where it knew them;
- ``release``: at the release point, when the node's ledger records the survivor set it signed
  (:class:`AuditedLedger`): the study and round, the survivors, how many values and images were
  released and the SHA-256 of the images' sorted digests (never a digest itself, never a value), and
  under DP the ε spent, the total at the node's δ and what is left of its ``dp-epsilon``;
- administrative acts: ``study-pinned`` (``deploy check --study``), and, noticed before any record
  since the log names the last ones, ``log-started`` (the signing key), ``roster-pinned`` (a new
  roster fingerprint or co-signer set), ``key-changed`` and ``ledger-reset`` (a reset logged in
  ``ledger-resets.log``, which its command writes without the key).

**At the coordinator** (``OUT_DIR/audit.log`` of ``deploy run``, signed with its key):
``classifier-signed`` (the content digest, study and roster, before the file is written) and, when
``flwr run`` ends, one ``session-run`` per session (participants, survivors, completed) and one
``run`` (whether it succeeded, and why not).

A refusal's record is best-effort (a node whose key cannot be read, or is revoked or rotated away
in its roster, refuses without one, and says so in its log); an accepted session or a release whose
record cannot be written is refused (:class:`~secure_afl.keys.auditlog.AuditLogError`), and so is a
classifier ``deploy run`` cannot record.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from secure_afl.keys.auditlog import AUDIT_FILE, AuditLog, AuditLogError, AuditRecord, read_log
from secure_afl.keys.identity import IdentityKey
from secure_afl.privacy.ledger import Change, FileLedger, LedgerOwner, LedgerState

from .errors import ConfigurationError

__all__ = [
    "AuditedLedger",
    "node_audit_log",
    "record_accepted",
    "record_refusal",
    "record_run",
    "record_signed",
    "record_study_pinned",
]

RESETS_LOG = "ledger-resets.log"  # what FileLedger.reset appends to, in the ledger directory


def node_audit_log(settings: Any) -> Path:
    """A node's audit log: ``LEDGER_DIR/audit.log`` beside its ledger."""
    return Path(settings.ledger_dir) / AUDIT_FILE


# --- administrative acts noticed before a record ------------------------------------------------


def _last(records: list[AuditRecord | None], kind: str) -> AuditRecord | None:
    return next((r for r in reversed(records) if r is not None and r.kind == kind), None)


def _append(
    path: Path,
    identity: IdentityKey,
    party: str,
    kind: str,
    body: Mapping[str, Any],
    *,
    roster: Mapping[str, Any] | None = None,
    resets: Path | None = None,
) -> AuditRecord:
    """Append ``kind``, after what the log does not name yet: its start (the signing key), a key
    change, a new ``roster`` (fingerprint and co-signers) and the ledger resets logged in ``resets``."""
    log = AuditLog(path)
    records = read_log(path).records()
    acts: list[tuple[str, dict[str, Any]]] = []
    if not records:
        acts.append(("log-started", {"key": identity.fingerprint}))
    last = next((r for r in reversed(records) if r is not None), None)
    if last is not None and last.key != identity.fingerprint:
        acts.append(("key-changed", {"from": last.key, "to": identity.fingerprint}))
    pinned = _last(records, "roster-pinned")
    if roster is not None and (pinned is None or dict(pinned.body) != dict(roster)):
        acts.append(("roster-pinned", dict(roster)))
    if resets is not None:
        done = sum(1 for r in records if r is not None and r.kind == "ledger-reset")
        for line in _reset_lines(resets)[done:]:
            acts.append(("ledger-reset", line))
    for act, act_body in acts:
        log.append(identity, party, act, act_body)
    return log.append(identity, party, kind, body)


def _reset_lines(path: Path) -> list[dict[str, Any]]:
    """The resets ``keys ledger reset`` logged: time, client, reason, and the archive's file name."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            item = json.loads(line)
        except ValueError:
            item = None
        if not isinstance(item, dict):
            out.append({"unreadable_line_sha256": hashlib.sha256(line.encode()).hexdigest()})
            continue
        out.append({"time": str(item.get("time", "")), "client_id": str(item.get("client_id", "")),
                    "reason": str(item.get("reason", ""))[:500],
                    "archived": Path(str(item.get("archived") or "")).name})  # fmt: skip
    return out


def _roster_act(roster_path: Path) -> dict[str, Any] | None:
    """The pinned roster as the log names it (None when it cannot be read: nothing is recorded)."""
    from secure_afl.keys.cosign import roster_status

    try:
        status = roster_status(Path(roster_path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    coordinator = status.roster.coordinator
    return {"roster": status.roster.fingerprint, "institutions": list(status.roster.client_ids),
            "cosigned_by": list(status.signed),
            "coordinator": coordinator.client_id if coordinator is not None else None}  # fmt: skip


def _node_append(
    settings: Any, identity: IdentityKey, party: str, kind: str, body: Mapping[str, Any]
) -> None:
    _append(
        node_audit_log(settings), identity, party, kind, body,
        roster=_roster_act(settings.roster), resets=Path(settings.ledger_dir) / RESETS_LOG,
    )  # fmt: skip


# --- the node -----------------------------------------------------------------------------------


def _node_key(settings: Any) -> tuple[str, IdentityKey, Any]:
    """(party, identity, roster or None): the party is the key's roster id, else its fingerprint."""
    from secure_afl.keys.cosign import roster_status
    from secure_afl.keys.files import load_identity_key
    from secure_afl.keys.store import read_passphrase

    passphrase = read_passphrase(settings.passphrase_file, settings.passphrase_env)
    identity = load_identity_key(settings.identity_key, passphrase)
    try:
        roster = roster_status(Path(settings.roster).read_text(encoding="utf-8")).roster
    except (OSError, ValueError):
        roster = None
    if roster is not None and identity.fingerprint in roster.revoked:
        raise AuditLogError(
            f"the node's key {identity.fingerprint} is revoked or rotated away in its roster: it signs no "
            "record (audit verify would name it)"
        )
    party = next((e.client_id for e in roster or () if e.public_key == identity.public_key), None)
    return party or identity.fingerprint, identity, roster


def record_accepted(
    envelope: Any, state: Any, settings: Any, party: str, identity: IdentityKey, roster: Any
) -> None:
    """``session-accepted``, after this node answered a session's R0 (raises when it cannot be
    written: the session is then refused); ``party``, ``identity``, ``roster``: what R0 loaded
    (the key is not decrypted a second time)."""
    from .study import Study

    label = str(envelope.meta.get("session", ""))
    saved = state.load(label) or {}
    body = {
        "session": label, "round": "R0",  # what this node answered, whatever the message was labelled
        "session_id": str(saved.get("session_id", "")),
        "study": Study.from_json(envelope.text("study")).digest(),
        "roster": roster.fingerprint if roster is not None else None,
        "peers": [cid for cid in (roster.client_ids if roster is not None else ()) if cid != party],
        "protection": envelope.text("backend"), "decision": "accepted",
    }  # fmt: skip
    _node_append(settings, identity, party, "session-accepted", body)


def record_refusal(envelope: Any, refusal: Any, state: Any, settings: Any, step: str) -> None:
    """``session-refused``: what this node answered (the error's class and its path-free message, as
    the coordinator received them).  Never raises: a refusal that cannot be recorded (no readable
    key) is said in the node's log."""
    try:
        label = str(envelope.meta.get("session", ""))
        try:
            saved = (state.load(label) if label else None) or {}
        except Exception:  # an unreadable record: recorded without its session id and study
            saved = {}
        party, identity, roster = _node_key(settings)
        body = {
            "session": label, "round": step,  # the node's own step (client.answered_step), not the label
            "labelled": str(envelope.meta.get("round", ""))[:40],  # the coordinator's name for the message
            "session_id": str(saved.get("session_id", "")), "study": _study_digest(envelope, saved),
            "roster": roster.fingerprint if roster is not None else None, "decision": "refused",
            "error": str(refusal.meta.get("error", "")), "rule": str(refusal.meta.get("message", "")),
        }  # fmt: skip
        _node_append(settings, identity, party, "session-refused", body)
    except Exception as exc:  # the refusal itself goes out as it is
        print(f"secure-afl client: the audit log did not record this refusal: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)  # fmt: skip


def _study_digest(envelope: Any, saved: Mapping[str, Any]) -> str | None:
    from .study import Study

    text = envelope.meta.get("study") if envelope.kind == "advertise" else saved.get("study")
    try:
        return Study.from_json(str(text)).digest() if text else None
    except Exception:  # a study that does not parse: the refusal says why
        return None


def record_study_pinned(
    settings: Any, client_id: str, identity: IdentityKey, study: Any, checked: str
) -> Path:
    """``study-pinned``: ``deploy check --study`` recorded ``study`` as the one this node takes part in."""
    body = {"study": study.digest(), "checked": checked, "protection": study.protection,
            "rounds": study.method.rounds, "dp": study.dp is not None}  # fmt: skip
    _node_append(settings, identity, client_id, "study-pinned", body)
    return node_audit_log(settings)


class AuditedLedger(FileLedger):
    """The node's :class:`~secure_afl.privacy.ledger.FileLedger` that also writes a ``release``
    record to the audit log at each release point: an update that records a session's survivor set
    (signed with the ledger owner's key, which the session holds)."""

    def __init__(self, settings: Any, delta_floor: float) -> None:
        super().__init__(settings.ledger_dir)
        self.settings = settings
        self.delta_floor = delta_floor  # the node's δ when its config sets dp-epsilon but no dp-delta

    def update(self, owner: LedgerOwner, change: Change) -> None:
        released: list[str] = []

        def watched(state: LedgerState) -> None:
            before = {sid for sid, entry in state.sessions.items() if entry.survivors is not None}
            change(state)
            released[:] = [
                sid for sid, e in state.sessions.items() if e.survivors is not None and sid not in before
            ]

        super().update(owner, watched)
        if released:
            state = self.load(owner)
            for sid in released:
                _node_append(self.settings, owner.identity, owner.client_id, "release",
                             release_body(state, sid, self.settings, self.delta_floor))  # fmt: skip


def release_body(state: LedgerState, sid: str, settings: Any, delta_floor: float) -> dict[str, Any]:
    """What a release record says of ledger session ``sid``: counts and a digest, never the values."""
    entry = state.sessions[sid]
    scope = dict(part.split(":", 1) for part in entry.scope.split("/") if ":" in part)
    body: dict[str, Any] = {
        "session_id": sid, "study": scope.get("study"), "round": scope.get("round"), "scope": entry.scope,
        "survivors": list(entry.survivors or ()), "values": len(entry.released),
        "images": len(entry.images) // 32, "images_digest": hashlib.sha256(entry.images).hexdigest(),
    }  # fmt: skip
    if entry.spend:
        body.update(_dp_spend(state, sid, settings, delta_floor))
    return body


def _dp_spend(state: LedgerState, sid: str, settings: Any, delta_floor: float) -> dict[str, Any]:
    from secure_afl.privacy.dp_growth import NodeSpend, chain_spend

    spend = NodeSpend.from_text(state.sessions[sid].spend)
    earlier = [
        NodeSpend.from_text(e.spend)
        for other, e in state.sessions.items()
        if other != sid
        and e.survivors is not None
        and e.spend
        and NodeSpend.from_text(e.spend).unit == spend.unit
    ]
    delta = settings.dp_delta if settings.dp_delta is not None else delta_floor
    total = chain_spend(earlier, spend, delta)
    out = {"epsilon": spend.epsilon, "delta": spend.delta, "unit": spend.unit, "epsilon_total": total.total,
           "at_delta": delta, "composition": total.composition}  # fmt: skip
    if settings.dp_epsilon is not None:
        out["epsilon_limit"] = settings.dp_epsilon
        out["epsilon_left"] = max(0.0, settings.dp_epsilon - total.total)
    return out


# --- the coordinator ----------------------------------------------------------------------------


def _coordinator_append(out_dir: Path, signer: Any, roster: Any, kind: str, body: Mapping[str, Any]) -> None:
    roster_act = None
    if roster is not None:
        roster_act = {"roster": roster.fingerprint, "institutions": list(roster.client_ids)}
    try:
        _append(out_dir / AUDIT_FILE, signer.key, signer.coordinator_id, kind, body, roster=roster_act)
    except (AuditLogError, OSError) as exc:
        raise ConfigurationError(f"the coordinator's audit log {out_dir / AUDIT_FILE}: {exc}") from None


def record_signed(out_dir: Path, signer: Any, roster: Any, study_digest: str, content_sha256: str) -> None:
    """``classifier-signed``, before ``deploy run`` writes the signed classifier."""
    body = {"content_sha256": content_sha256, "study": study_digest, "roster": roster.fingerprint}
    _coordinator_append(out_dir, signer, roster, "classifier-signed", body)


def record_run(signing: Any, outcome: Any, say: Any = print) -> None:
    """``session-run`` for each session of the run's report, then ``run``: its outcome.  The run is
    over: a record that cannot be written is said, and the outcome stands."""
    if signing is None:
        return
    report = outcome.report or {}
    sessions = report.get("sessions", [])
    keys = ("label", "session_id", "participants", "survivors", "completed")
    refusals = [
        {"from": r.get("from"), "at": r.get("at"), "error": r.get("error")}
        for r in report.get("refusals", [])
    ]
    run = {"ok": outcome.ok, "error": (outcome.error or "")[:1000], "study": signing.study_digest,
           "sessions": len(sessions), "refusals": refusals,
           "dropouts": [d.get("client") for d in report.get("dropouts", [])]}  # fmt: skip
    try:
        for session in sessions:
            body = {key: session.get(key) for key in keys}
            _coordinator_append(outcome.out_dir, signing.signer, signing.roster, "session-run", body)
        _coordinator_append(outcome.out_dir, signing.signer, signing.roster, "run", run)
    except ConfigurationError as exc:
        say(f"WARNING: the run is not fully recorded: {exc}")
