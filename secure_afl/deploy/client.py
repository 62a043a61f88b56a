"""What a hospital's ClientApp does with each server message (Flower-independent).

:func:`handle` takes one :class:`~secure_afl.deploy.wire.Envelope`, the SuperNode's local state and
the node's settings, and returns the reply.  Flower runs the ClientApp in a fresh process for every
message, so the protocol's client session cannot stay in memory: at a session's first message the
client draws a 32-byte seed (``os.urandom``), and for every later message it rebuilds the session
from that seed and the server messages received so far (the state machine is deterministic given
its randomness), then feeds the new one.  The seed, the messages and the protocol inputs live in the
node's session records (:mod:`secure_afl.deploy.node_state`, files in its ledger-dir, written before
each reply) and the secrets are deleted when the session ends or fails.

Before anything leaves it, the client checks, in this order: that every institution co-signed its
pinned roster (``RosterNotCosignedError``, :mod:`secure_afl.keys.cosign`), the server's roster
fingerprint against that roster (:class:`RosterMismatchError`), that its own key is in that roster
(:class:`IdentityNotInRosterError`), that the study is the one it checked with ``deploy check
--study`` (:class:`UncheckedStudyError`; ``ledger-dir/checked-study.json``), the study against its
feature file and its policy (:class:`StudyMismatchError`; under DP also its ε over every release
this node's ledger holds, :class:`ChainBudgetExceededError`), that the session was
not started before in this run (:class:`SessionReplayError`); then the protocol's own checks.  Any
failure answers ``refused`` with the error's class and message (and is printed in the SuperNode's
log); the session's secrets are dropped and every later message of that session is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from secure_afl import stages
from secure_afl.core.randomness import RandomSource
from secure_afl.keys.files import load_identity_key
from secure_afl.keys.identity import IdentityKey
from secure_afl.keys.roster import Roster
from secure_afl.privacy.release import Release

from .audit import record_accepted, record_refusal
from .classifier import Classifier
from .errors import (
    ChainBudgetExceededError,
    ConfigurationError,
    CoordinatorChoiceRefusedError,
    DeploymentError,
    IdentityNotInRosterError,
    RosterMismatchError,
    RoundNotInStudyError,
    SessionReplayError,
    StudyMismatchError,
    UncheckedStudyError,
)
from .study import (
    PROTECTIONS,
    Study,
    classifier_fields,
    recipe,
    round1_plan,
    round2_layout,
    round2_row_floors,
    session_context,
    statistics_dim,
)
from .verify import KEPT_DIR, begin_check, keep_inputs, loaded_once
from .wire import Envelope

if TYPE_CHECKING:
    from secure_afl.aggregation.backend import ClientSessionLike, ProtectionBackend


class LocalState(Protocol):
    """The node's session records for one run: named records of bytes, text, numbers and arrays."""

    def load(self, label: str) -> dict[str, Any] | None: ...

    def save(self, label: str, record: Mapping[str, Any]) -> None: ...


# The δ a node that sets dp-epsilon but no dp-delta accepts at most.  δ is the probability that the
# ε guarantee fails outright, so it must lie well below 1/N for the N images (or patients) protected,
# or "publish one record at random" would meet it; 1e-6 is below 1/N for every collection under a
# million images (NIH ChestX-ray14 has 112,120, CheXpert 224,316), and it is the study's default
# δ, so a node and a study left at their defaults agree.  Without a floor a node asking for ε = 1
# accepted δ = 0.999999, whose noise is 0.045 of the ε = 1, δ = 1e-6 level (measured
# when the floor was added).
DEFAULT_DP_DELTA_FLOOR = 1e-6

# What a node assumes of its coordinator (node config ``coordinator``).  "active" (the deployment
# policy's default): the coordinator may deviate arbitrarily, so the node sends nothing whose value
# depends on a coordinator's choice it cannot check against its pinned study or derive itself.
# "honest-but-curious": the consortium trusts the coordinator to follow the protocol; the node then
# also takes part in round 2, whose uploads are computed with a teacher the coordinator picks
# (SECURITY.md §3.6), and every session's release records the declaration.
COORDINATOR_ACTIVE = "active"
COORDINATOR_HONEST = "honest-but-curious"
COORDINATOR_MODELS = (COORDINATOR_ACTIVE, COORDINATOR_HONEST)


@dataclass(frozen=True)
class NodeSettings:
    """A hospital's SuperNode settings (``flower-supernode --node-config 'key="value" ...'``)."""

    identity_key: Path
    passphrase_file: Path | None  # exactly one of the file (0600) and the variable holds the passphrase
    roster: Path
    features: Path
    out_dir: Path
    ledger_dir: Path
    device: str = "auto"
    allow_class_gram: bool = False
    # This institution's own DP floor (node config ``dp-epsilon``, ``dp-delta``, ``dp-unit``): it
    # refuses a study without DP, or with a larger ε or δ (δ ≤ DEFAULT_DP_DELTA_FLOOR when dp-delta
    # is unset), or protecting images where it asks patients.
    dp_epsilon: float | None = None
    dp_delta: float | None = None
    dp_unit: str | None = None
    # The protections this institution agreed to (node config ``protection``, comma-separated):
    # masking only unless it says otherwise, so a server cannot move it to CKKS's weaker trust model.
    protections: frozenset[str] = frozenset({"mask"})
    # How many other institutions this one assumes may collude with the coordinator (node config
    # ``colluders``): "n-t" (None, the default: the active model's bound) or a smaller number, which
    # weakens its exposure check (SECURITY.md, "Colluders"); the server cannot change it.
    colluders: int | None = None
    passphrase_env: str | None = None  # node config ``passphrase-env``: the SuperNode's variable
    coordinator: str = COORDINATOR_ACTIVE  # node config ``coordinator``: see COORDINATOR_MODELS
    # node config ``require-verified-classifier`` (secure_afl.deploy.verify, SECURITY.md §5.1)
    require_verified: str = "when-offered"

    KEYS = ("identity-key", "roster", "features", "ledger-dir", "out-dir")

    @classmethod
    def from_node_config(cls, config: Mapping[str, object]) -> NodeSettings:
        missing = [key for key in cls.KEYS if not isinstance(config.get(key), str) or not config.get(key)]
        if missing:
            raise ConfigurationError(
                f"the SuperNode's --node-config lacks {missing}; it needs identity-key, passphrase-file "
                f"(or passphrase-env), roster, features, ledger-dir and out-dir (paths on this machine)"
            )
        passphrase_sources = [key for key in ("passphrase-file", "passphrase-env") if config.get(key)]
        if len(passphrase_sources) != 1:
            raise ConfigurationError(
                "the SuperNode's --node-config needs exactly one of passphrase-file (a 0600 file holding "
                "the key's passphrase) and passphrase-env (the name of an environment variable of the "
                f"SuperNode's process that holds it); it has {passphrase_sources or 'neither'}"
            )
        try:
            dp_epsilon = float(str(config["dp-epsilon"])) if "dp-epsilon" in config else None
            dp_delta = float(str(config["dp-delta"])) if "dp-delta" in config else None
        except ValueError:
            raise ConfigurationError("the node config's dp-epsilon and dp-delta must be numbers") from None
        dp_unit = str(config["dp-unit"]) if "dp-unit" in config else None
        if dp_unit not in (None, "image", "patient"):
            raise ConfigurationError(f"the node config's dp-unit must be image or patient, got {dp_unit!r}")
        if (dp_delta is not None or dp_unit is not None) and dp_epsilon is None:
            raise ConfigurationError("the node config sets dp-delta or dp-unit without dp-epsilon")
        if dp_epsilon is not None and not 0 < dp_epsilon < float("inf"):
            raise ConfigurationError(
                f"the node config's dp-epsilon must be a positive number, got {dp_epsilon}"
            )
        if dp_delta is not None and not 0 < dp_delta < 1:
            raise ConfigurationError(
                f"the node config's dp-delta must lie strictly between 0 and 1, got {dp_delta} (leave it "
                f"unset for the default floor {DEFAULT_DP_DELTA_FLOOR:g})"
            )
        return cls(
            identity_key=Path(str(config["identity-key"])),
            passphrase_file=Path(str(config["passphrase-file"])) if config.get("passphrase-file") else None,
            passphrase_env=str(config["passphrase-env"]) if config.get("passphrase-env") else None,
            roster=Path(str(config["roster"])),
            features=Path(str(config["features"])),
            out_dir=Path(str(config["out-dir"])),
            ledger_dir=Path(str(config["ledger-dir"])),
            device=str(config.get("device", "auto")),
            allow_class_gram=str(config.get("allow-class-gram", "false")).lower() == "true",
            dp_epsilon=dp_epsilon,
            dp_delta=dp_delta,
            dp_unit=dp_unit,
            protections=_protections(config.get("protection", "mask")),
            colluders=_colluders(config.get("colluders", "n-t")),
            coordinator=_coordinator(config.get("coordinator", COORDINATOR_ACTIVE)),
            require_verified=_require_verified(config),
        )


def _require_verified(config: Mapping[str, object]) -> str:
    from .verify import REQUIRE_KEY, require_setting

    return require_setting(config.get(REQUIRE_KEY, "when-offered"))


def _coordinator(value: object) -> str:
    text = str(value).strip()
    if text not in COORDINATOR_MODELS:
        raise ConfigurationError(
            f'the SuperNode\'s --node-config coordinator={text!r} must be "{COORDINATOR_ACTIVE}" (the '
            f'default: the coordinator may deviate) or "{COORDINATOR_HONEST}" (the consortium trusts it '
            f"to follow the protocol; needed for round 2, SECURITY.md §3.6)"
        )
    return text


def _colluders(value: object) -> int | None:
    text = str(value).strip()
    if text == "n-t":
        return None
    if not text.isdigit():
        raise ConfigurationError(
            f'the SuperNode\'s --node-config colluders={text!r} must be "n-t" (the default: as many '
            f"institutions as the threshold allows may collude with the coordinator) or a number of them"
        )
    return int(text)


def _protections(value: object) -> frozenset[str]:
    names = frozenset(p.strip() for p in str(value).split(",") if p.strip())
    if not names or not names <= set(PROTECTIONS):
        raise ConfigurationError(
            f"the SuperNode's --node-config protection={str(value)!r} must name one or more of "
            f'{", ".join(PROTECTIONS)} (comma-separated), e.g. protection="mask"'
        )
    return names


def _ledger(settings: NodeSettings) -> Any:
    """The node's ledger (its releases and answers).  A rebuilt session replays messages it answered
    before: the answers are the same digests (recorded once), the release the same (its own session
    is not "another" one), so the replay needs no special ledger; a *different* message for an
    answered round (a forked context state) meets the record and is refused."""
    from .audit import AuditedLedger  # the ledger that also writes each release in LEDGER_DIR/audit.log

    return AuditedLedger(settings, DEFAULT_DP_DELTA_FLOOR)


def log(settings: NodeSettings | None, text: str) -> None:
    print(f"secure-afl client: {text}", file=sys.stderr, flush=True)


def handle(envelope: Envelope, state: LocalState, settings: NodeSettings) -> Envelope:
    """Answer one server message; every refusal is a ``refused`` envelope naming the error.

    A message identical to the one this node answered last for the same record (its session, the
    classifier, the classifier check: :func:`_home`), by the SHA-256 of its canonical bytes, gets the
    reply recorded then, byte for byte, and nothing runs again: no protocol step, no release, no
    audit record.  The coordinator sends a round's message again when its answer is late (a
    connection reset may lose a pulled message: Flower delivers it once).  Any other message, a
    different one for an answered round included, goes through the checks as before (R8)."""
    home = _home(envelope)
    digest = hashlib.sha256(envelope_bytes(envelope)).hexdigest()
    try:
        recorded = _recorded_reply(state.load(home) if home else None, digest)
    except DeploymentError:  # an unreadable record: _dispatch refuses the message, in the audit log too
        recorded = None
    if recorded is not None:
        where = f"{shown(envelope.meta.get('session', '-'))} {shown(envelope.meta.get('round', ''))}".strip()
        log(settings, f"session {where}: the message answered last came again; sent the recorded reply")
        return recorded
    reply = _dispatch(envelope, state, settings)
    record = state.load(home) if home and reply.kind != "refused" else None
    if record is not None:  # the latest answer only, in its record (a refusal replaces the record)
        state.save(home, {**record, ANSWERED: digest, ANSWER: envelope_bytes(reply)})
    return reply


ANSWERED, ANSWER = "answered-sha256", "answer"  # in a record: the message answered last, its reply


def _home(envelope: Envelope) -> str:
    """The LocalState record that keeps a message's answer: its session's (``advertise``,
    ``protocol``), session 1's (the ``classifier``), the classifier check's (``verify``)."""
    from .verify import STATE_LABEL

    if envelope.kind in ("advertise", "protocol"):
        return str(envelope.meta.get("session", ""))
    return {"classifier": "1", "verify": STATE_LABEL}.get(envelope.kind, "")


def envelope_bytes(envelope: Envelope) -> bytes:
    """An envelope's canonical bytes: a length-prefixed JSON header (kind, sorted meta, payload
    length, each array's name and shape, sorted) then the payload and the arrays (little-endian
    float64).  Equal bytes, equal envelopes: :func:`envelope_from_bytes` reads them back exactly."""
    names = sorted(envelope.arrays)
    arrays = [np.ascontiguousarray(envelope.arrays[name], dtype="<f8") for name in names]
    header = json.dumps(
        {"kind": envelope.kind, "meta": dict(sorted(envelope.meta.items())), "payload": len(envelope.payload),
         "arrays": [[name, list(a.shape)] for name, a in zip(names, arrays, strict=True)]},
        sort_keys=True, separators=(",", ":"),
    ).encode("utf-8")  # fmt: skip
    return b"".join(
        [len(header).to_bytes(8, "big"), header, envelope.payload, *(a.tobytes() for a in arrays)]
    )


def envelope_from_bytes(data: bytes) -> Envelope:
    """The envelope of :func:`envelope_bytes`; anything else raises ``ValueError``."""
    from types import MappingProxyType

    try:
        size = int.from_bytes(data[:8], "big")
        header = json.loads(data[8 : 8 + size])
        at = 8 + size + int(header["payload"])
        payload = data[8 + size : at]
        arrays = {}
        for name, shape in header["arrays"]:
            count = int(np.prod(shape, dtype=np.int64))
            arrays[str(name)] = np.frombuffer(data[at : at + 8 * count], dtype="<f8").reshape(shape).copy()
            at += 8 * count
        if at != len(data):
            raise ValueError(f"{len(data) - at} bytes left over")
        return Envelope(str(header["kind"]), MappingProxyType(dict(header["meta"])), payload,
                        MappingProxyType(arrays))  # fmt: skip
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not an envelope's canonical bytes: {exc}") from None


def _recorded_reply(record: Mapping[str, Any] | None, digest: str) -> Envelope | None:
    """The reply ``record`` keeps, if it answered the message of ``digest``."""
    if record is None or record.get(ANSWERED) != digest:
        return None
    try:
        return envelope_from_bytes(bytes(record[ANSWER]))
    except (KeyError, TypeError, ValueError):  # an unreadable record: the message is answered as new
        return None


def shown(value: object, limit: int = 40) -> str:
    """A label of the server's metadata as this node prints it: printable characters only (a newline
    or an escape sequence would forge a line of the node's log), at most ``limit`` of them."""
    text = "".join(ch if ch.isprintable() else "?" for ch in str(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def answered_step(envelope: Envelope, state: LocalState) -> str:
    """The step this node was at when ``envelope`` came, from its own state: the message's ``round``
    label is the coordinator's word, so the node's records say this instead."""
    fixed = {"advertise": "R0", "classifier": "classifier", "verify": "verify-sums"}
    if envelope.kind in fixed:
        return fixed[envelope.kind]
    saved = state.load(str(envelope.meta.get("session", ""))) if envelope.kind == "protocol" else None
    if not saved or saved.get("status") != "active":
        return "no session in progress"
    answered = len(saved.get("messages", []))  # R0 and each round since, in order (CKKS may repeat one)
    return f"R{answered}" if saved.get("backend") == "mask" else f"the session's message {answered + 1}"


def _dispatch(envelope: Envelope, state: LocalState, settings: NodeSettings) -> Envelope:
    label = str(envelope.meta.get("session", ""))
    try:
        if envelope.kind == "advertise":
            return _start_session(envelope, label, state, settings)
        if envelope.kind == "protocol":
            return _continue_session(envelope, label, state, settings)
        if envelope.kind == "classifier":
            return _store_classifier(envelope, state, settings)
        if envelope.kind == "verify":
            return _check_classifier(envelope, state, settings)
        raise SessionReplayError(f"unexpected {envelope.kind!r} message from the server")
    except Exception as exc:  # every failure is answered (its class named), logged, and ends the session
        try:
            step = answered_step(envelope, state)  # a failed step saved nothing: the state it came to
        except DeploymentError:  # an unreadable record: the refusal still goes out, and into the log
            step = "unknown (this node's session records are unreadable)"
        why = f"{type(exc).__name__}: {shown(exc, 2000)}"
        log(settings, f"REFUSED session {shown(label) or '-'} {step}: {why}")
        # The coordinator learns the error's class, a message without this machine's paths, and the
        # roster id this node holds the key of (read without the passphrase; a claim, not signed).
        refusal = Envelope(
            "refused",
            {"session": label, "round": str(envelope.meta.get("round", "")), "error": type(exc).__name__,
             "message": path_free(str(exc), settings), "client": roster_id(settings) or ""},
        )  # fmt: skip
        record_refusal(envelope, refusal, state, settings, step)  # as sent, in LEDGER_DIR/audit.log
        try:
            _end_refused(envelope, label, exc, state)
        except (OSError, DeploymentError) as unwritable:  # the refusal goes out; the next run deletes them
            log(settings, f"the session records were not updated after the refusal: {unwritable}")
        return refusal


def _end_refused(envelope: Envelope, label: str, exc: Exception, state: LocalState) -> None:
    """After a refusal: the session it ends drops its seed (its record says failed); a classifier or
    check message refused for what it holds ends the check, whose key and kept values are deleted."""
    from .verify import ends_check, forget_check

    if label and envelope.kind in ("advertise", "protocol"):
        saved = state.load(label)
        if saved is None or saved.get("status") == "active":
            state.save(label, {"status": f"failed: {type(exc).__name__}"})
    elif envelope.kind in ("classifier", "verify") and ends_check(exc):
        forget_check(state)


_PATH = re.compile(r"(?<![\w.~-])(?:~|\.{1,2})?/[^\s'\"`,;:()\[\]]+")


def path_free(text: str, settings: NodeSettings | None) -> str:
    """``text`` with this node's file paths replaced: its settings' by their node-config key
    (``[roster]``, ...), any other absolute path by ``[path]``.  The full text stays in the node's log."""
    if settings is None:
        return _PATH.sub("[path]", text)
    named = {
        settings.identity_key: "identity-key", settings.passphrase_file: "passphrase-file",
        settings.roster: "roster", settings.features: "features", settings.out_dir: "out-dir",
        settings.ledger_dir: "ledger-dir",
    }  # fmt: skip
    for path, key in sorted(((p, k) for p, k in named.items() if p), key=lambda item: -len(str(item[0]))):
        for form in {str(path), str(path.expanduser().absolute())}:
            if form not in ("", "."):
                text = text.replace(form, f"[{key}]")
    return _PATH.sub("[path]", text)


def roster_id(settings: NodeSettings) -> str | None:
    """The roster id of this node's identity key, from the key file's public half (no passphrase);
    None when the key file or the roster cannot be read or the key is not in the roster."""
    try:
        return key_owner(settings.identity_key, node_roster(settings))
    except Exception:  # an unreadable key or roster: the refusal itself says what is wrong
        return None


def key_owner(identity_key: Path, roster: Roster) -> str | None:
    """The roster id whose public key is the one in the key file ``identity_key`` (read without the
    passphrase), or None when the roster has no such entry; a key file that cannot be read raises."""
    import base64

    public = base64.b64decode(json.loads(identity_key.read_text(encoding="utf-8"))["public_key"])
    return next((entry.client_id for entry in roster if entry.public_key == public), None)


# --- sessions ---------------------------------------------------------------------------------


def node_identity(settings: NodeSettings, roster: Roster) -> tuple[str, IdentityKey]:
    from secure_afl.keys.store import KeyStoreError, read_passphrase

    try:
        passphrase = read_passphrase(settings.passphrase_file, settings.passphrase_env)
    except KeyStoreError as exc:  # bad permissions, a missing file, an unset variable
        raise ConfigurationError(str(exc)) from None
    identity = load_identity_key(settings.identity_key, passphrase)
    from secure_afl.keys.lifecycle import check_not_revoked

    check_not_revoked(roster, identity.fingerprint)  # KeyRevokedError: revoked or rotated away
    for entry in roster:
        if entry.public_key == identity.public_key:
            return entry.client_id, identity
    raise IdentityNotInRosterError(
        f"this institution's identity key ({identity.fingerprint}) is not in its roster {settings.roster}; "
        f"the coordinator must add it (`secure-afl keys roster add`) and every institution pin the new roster"
    )


def node_roster(settings: NodeSettings) -> Roster:
    """The pinned roster, only if every institution co-signed it (:mod:`secure_afl.keys.cosign`):
    a roster with an entry its own key has not signed is refused (``RosterNotCosignedError``), and
    so is any roster but the one ``keys roster update`` moved to last (``RosterNotPinnedError``)."""
    from secure_afl.keys.cosign import load_cosigned_roster
    from secure_afl.keys.lifecycle import check_pin

    try:
        roster = load_cosigned_roster(settings.roster)
    except OSError as exc:
        raise ConfigurationError(f"{settings.roster}: cannot read the roster: {exc.strerror}") from None
    check_pin(roster, settings.ledger_dir, settings.roster)
    return roster


CHECKED_STUDY = "checked-study.json"  # in ledger-dir: the study `deploy check --study` checked
CHECKED_FORMAT = "secure-afl-checked-study/v1"


def pin_study(settings: NodeSettings, study: Study, checked: str) -> Path:
    """Record (0600, atomically) that this node checked ``study``: from now on it takes part in that
    study only.  ``checked`` is the UTC time of the check (ISO 8601)."""
    from .tls import write_with_mode

    settings.ledger_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = settings.ledger_dir / CHECKED_STUDY
    document = {"format": CHECKED_FORMAT, "study_digest": study.digest(), "checked": checked,
                "study": json.loads(study.to_json())}  # fmt: skip
    write_with_mode(path, (json.dumps(document, indent=1) + "\n").encode("utf-8"), 0o600)
    return path


def pinned_study(settings: NodeSettings) -> dict[str, Any] | None:
    """The record :func:`pin_study` wrote, or None when this node never checked a study."""
    path = settings.ledger_dir / CHECKED_STUDY
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigurationError(
            f"the checked study (ledger-dir's {CHECKED_STUDY}) is unreadable ({exc}): run `secure-afl "
            "deploy check --study APP` again"
        ) from None
    if not isinstance(document, dict) or document.get("format") != CHECKED_FORMAT:
        raise ConfigurationError(
            f"ledger-dir's {CHECKED_STUDY} is not a {CHECKED_FORMAT} record: run `secure-afl deploy check "
            "--study APP` again"
        )
    return document


def _check_pinned_study(study: Study, settings: NodeSettings) -> None:
    """The server's study is the one this institution checked (``deploy check --study``)."""
    pinned = pinned_study(settings)
    digest = study.digest()
    if pinned is None:
        raise UncheckedStudyError(
            f"this institution has checked no study, and the server runs study {digest}: run `secure-afl "
            "deploy check --study APP --node-config ...` with the coordinator's app on this node's "
            "machine (it records the study it checked), then take part"
        )
    if pinned.get("study_digest") != digest:
        raise UncheckedStudyError(
            f"the server runs study {digest}, but this institution checked study "
            f"{pinned.get('study_digest')} (on {pinned.get('checked')}): the study changed after the check; "
            "compare the coordinator's new app with the one you checked and run `secure-afl deploy check "
            "--study APP` again if you agree to it"
        )


def _check_round(label: str, study: Study, arrays: Mapping[str, np.ndarray]) -> None:
    """The session's round is one the pinned study runs: "1", or "2" only for a two-round study.

    The label decides what the node computes (round 2 scores its rows with a teacher the server
    sends) and which earlier release the session may reuse (round 2 its own study's round 1, once:
    the release scope names the study's digest and the round).  A label the study does not run is
    refused before anything is computed (:class:`RoundNotInStudyError`), and so are arrays the round
    does not use (round 1 none, round 2 only its teacher ``coef``): the advertisement signs every
    array sent, and a node signs nothing the coordinator chose that it does not need (§3.6)."""
    used = {"2": {"coef"}}.get(label, set())
    if set(arrays) - used:
        raise CoordinatorChoiceRefusedError(
            f"the server sent the arrays {sorted(set(arrays) - used)} with session {label!r}, which uses "
            f"{sorted(used) or 'none'}: this node signs nothing the coordinator chose that it does not use"
        )
    if label == "1" or (label == "2" and study.method.rounds == 2):
        return
    if label == "2":
        raise RoundNotInStudyError(
            f"the server runs a round-2 session, but the study this institution checked has one round "
            f"(rounds = {study.method.rounds}): a round 2 nobody agreed to is refused; a two-round "
            "study must be checked (`secure-afl deploy check --study APP`) and pinned first"
        )
    raise RoundNotInStudyError(f"unknown session {label!r}: the study runs sessions 1 and 2 only")


def coordinator_choices(study: Study) -> tuple[str, ...]:
    """What of ``study`` would make this node's uploads a function of its data that the coordinator
    chooses and the node cannot check or derive (SECURITY.md §3.6): round 2's teacher W, the round-1
    classifier the server sends, with which every node scores its rows into pseudo-labels."""
    if study.method.rounds == 2:
        return ("round 2's pseudo-labels, computed with a teacher W the coordinator sends",)
    return ()


def check_coordinator_choices(study: Study, coordinator: str) -> None:
    """No lever: under the node's default model of its ``coordinator`` (active) a study that needs a
    coordinator's choice is refused, before the feature file is read (:func:`coordinator_choices`)."""
    choices = coordinator_choices(study)
    if choices and coordinator != COORDINATOR_HONEST:
        raise CoordinatorChoiceRefusedError(
            f"the study has {'; '.join(choices)}: an active coordinator can choose it so that the sums "
            "determine one hospital's values exactly, and no check by this node bounds that choice "
            "(SECURITY.md §3.6), so this node refuses the study. A consortium that trusts its coordinator "
            "to follow the protocol opts in per node with the node config "
            f'coordinator="{COORDINATOR_HONEST}" '
            "(recorded with each session in the node's ledger); otherwise run the study with one round"
        )


def check_node_study(study: Study, settings: NodeSettings) -> Any:
    from secure_afl.features.file import load_feature_file

    check_coordinator_choices(study, settings.coordinator)
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
    _check_dp_policy(study, settings)
    if study.method.gram == "class" and not settings.allow_class_gram:
        raise StudyMismatchError(
            "the study sums each class's Gram matrix separately (gram='class'), which lets overlapping "
            "class groups reveal one institution's Gram (SECURITY.md); this node refuses it unless its "
            'node config sets allow-class-gram="true"'
        )
    return data


def _check_dp_policy(study: Study, settings: NodeSettings) -> None:
    """This institution's own DP floor against the study the server sent."""
    if settings.dp_epsilon is None:
        return
    dp = study.dp
    if dp is None:
        raise StudyMismatchError(
            f"this institution takes part only under differential privacy (node config dp-epsilon = "
            f"{settings.dp_epsilon:g}); the study asks for none"
        )
    if dp.epsilon > settings.dp_epsilon:
        raise StudyMismatchError(
            f"the study's DP ε = {dp.epsilon:g} exceeds this institution's dp-epsilon {settings.dp_epsilon:g}"
        )
    delta, named = (
        (settings.dp_delta, "dp-delta")
        if settings.dp_delta is not None
        else (DEFAULT_DP_DELTA_FLOOR, "default δ floor (no dp-delta set)")
    )
    if not dp.delta <= delta:
        raise StudyMismatchError(
            f"the study's DP δ = {dp.delta:g} exceeds this institution's {named} {delta:g}"
        )
    if settings.dp_unit == "patient" and dp.unit != "patient":
        raise StudyMismatchError(
            f"the study protects one {dp.unit}; this institution's dp-unit asks for one patient"
        )


def _check_dp_session(
    study: Study,
    data: Any,
    client_id: str,
    roster: Roster,
    backend: ProtectionBackend,
    request: Any,
    nonce: str,
) -> None:
    """Under DP, before the noise is drawn: the study's plan is this session's and fits this client.

    The noise each client adds is sized from the study (class lists, threshold, minimum group size,
    grid): the session must commit to that study (its id, which every advertisement signs), run
    the masking protocol (DP with CKKS is refused, SECURITY.md §9) at the study's threshold,
    minimum group size and fractional bits, and the study must list this client's own classes.
    The noise's sensitivity and the plan's fixed-point check also assume round 2's threshold
    τ ≥ 0.5 (disjoint pseudo-label sets) and at most ``max_rows`` rows here: a study that breaks
    either is refused before anything is computed.
    """
    from secure_afl.privacy.dp_config import DpError, check_pseudo_label_threshold

    from .study import study_session_id

    dp = study.dp
    assert dp is not None
    if study.method.rounds == 2:
        try:
            check_pseudo_label_threshold(study.method.tau)
        except DpError as exc:
            raise StudyMismatchError(f"the study's round 2 breaks the noise's sensitivity: {exc}") from None
    if backend.name != "mask":
        raise StudyMismatchError(
            "differential privacy runs only with the masking protocol (secure 'mask'), not "
            f"{backend.name!r}: TenSEAL's CKKS has no threshold decryption, so one client's noise could "
            "be read alone (SECURITY.md §9)"
        )
    try:
        expected = study_session_id(study, bytes.fromhex(nonce))
    except (ValueError, ConfigurationError):
        expected = b""
    config = request.config
    if config.session_id != expected:
        raise StudyMismatchError(
            "the session id does not commit to the study this client received: under DP every participant "
            "must noise from the same study (the server must derive the id from the study and its nonce)"
        )
    threshold = study.threshold_for(len(roster))
    if (
        config.threshold < threshold
        or config.min_group_size < study.min_group_size
        or config.frac_bits != study.frac_bits
    ):
        raise StudyMismatchError(
            f"the session's threshold {config.threshold}, minimum group size {config.min_group_size} and "
            f"fractional bits {config.frac_bits} differ from the study's ({threshold}, "
            f"{study.min_group_size}, {study.frac_bits}) from which the noise is sized"
        )
    _check_class_list(
        dp.class_lists, data, client_id, roster, "the noise of every group is sized from these lists"
    )
    if dp.unit == "patient" and data.patient_ids is None:
        raise StudyMismatchError(
            "the study protects one patient (dp-unit patient) but this feature file has no patient_ids: "
            "write them with save_feature_file(..., patient_ids=...)"
        )
    rows = int(stages.unit_rows(dp.config(), len(data.features), data.patient_ids).sum())
    if rows > dp.max_rows:
        raise StudyMismatchError(
            f"this feature file has {rows} rows{' (after the patient cap)' if dp.unit == 'patient' else ''}, "
            f"more than the study's max_rows = {dp.max_rows} for which the noise plan checked the "
            "fixed-point range: the study must raise dp-max-rows (its plan refuses a bound that could "
            "overflow), or this institution must use fewer rows"
        )


def _check_class_list(
    class_lists: Mapping[str, Sequence[int]], data: Any, client_id: str, roster: Roster, why: str
) -> None:
    """The study's published class lists name the roster and this client's own classes (``why``:
    what is derived from them: DP's noise sizes, or round 1's complement groups, where a wrong list
    would put this client's Gram in a group the plan's size and span checks never saw)."""
    roster_ids = sorted(entry.client_id for entry in roster)
    if sorted(class_lists) != roster_ids:
        raise StudyMismatchError(
            f"the study's class lists name {sorted(class_lists)}, the roster {roster_ids}"
        )
    if tuple(sorted(class_lists[client_id])) != tuple(data.active):
        raise StudyMismatchError(
            f"the study lists classes {sorted(class_lists[client_id])} for {client_id}, this feature file "
            f"labels {list(data.active)}: {why}"
        )


def _check_dp_budget(
    study: Study, settings: NodeSettings, client_id: str, identity: IdentityKey, roster_size: int
) -> str:
    """This round-1 session's DP spend here (a NodeSpend's canonical JSON, which the release
    carries into the signed ledger at its release point); first, with a node ``dp-epsilon``, refuse
    the session when it would take this institution's ε past that limit at the node's δ
    (:class:`ChainBudgetExceededError`, before anything is computed).

    Under the patient unit one patient's images may fall in any of the node's sessions, growing
    chain or not, so the total is every released DP session's spend recorded in the node's ledger
    under that unit, composed with this one in one ``RdpAccountant``.  Under the image unit each
    image enters one release (the ledger's rule), so the total is the max over sessions, which the
    per-session check already bounds.  The spends come from the node's own signed ledger, each
    written from the plan the node derived from its study itself: the server's records count for
    nothing here."""
    from secure_afl.privacy.dp_config import DpError
    from secure_afl.privacy.dp_growth import COMPOSED, NodeSpend, chain_spend
    from secure_afl.privacy.ledger import LedgerOwner

    from .study import noise_plan

    spend = NodeSpend.of(noise_plan(study, roster_size), client_id)
    recorded = spend.to_text()
    if settings.dp_epsilon is None:
        return recorded
    state = _ledger(settings).load(LedgerOwner(client_id, identity))
    earlier = []
    try:
        for entry in state.sessions.values():
            if entry.survivors is not None and entry.spend:
                past = NodeSpend.from_text(entry.spend)
                if past.unit == spend.unit:
                    earlier.append(past)
    except (DpError, ValueError, KeyError, TypeError) as exc:
        raise ConfigurationError(f"this node's ledger holds a malformed DP spend: {exc}") from None
    delta = settings.dp_delta if settings.dp_delta is not None else DEFAULT_DP_DELTA_FLOOR
    total = chain_spend(earlier, spend, delta)
    how = (
        "composed in one RdpAccountant (patient unit: a patient's images may fall in any session)"
        if total.composition == COMPOSED
        else "the max over sessions (image unit: each image enters one release)"
    )
    if total.total > settings.dp_epsilon:
        spent = "nothing" if total.earlier is None else f"ε = {total.earlier:.4g}"
        raise ChainBudgetExceededError(
            f"this session would take this institution's ε past its dp-epsilon {settings.dp_epsilon:g}: "
            f"it already spent {spent} in {total.sessions} released DP session(s) under the {spend.unit} "
            f"unit (its ledger's record, any study or chain), this session spends ε = {total.session:.4g}, "
            f"and the total would be {total.total:.4g} at δ = {delta:g}, {how}. Nothing was released. "
            f"To take part, raise this node's dp-epsilon knowingly (node config), or protect the image "
            f"unit (dp-unit image), under which each image enters one release"
        )
    log(
        settings,
        f"{client_id}: DP budget: ε {total.total:.4g} of dp-epsilon {settings.dp_epsilon:g} over "
        f"{total.sessions + 1} session(s), {how}",
    )
    return recorded


def _noise_random() -> RandomSource:
    """The DP noise's randomness: the operating system's CSPRNG (tests inject a seeded stream)."""
    from secure_afl.core.randomness import OsRandomSource

    return OsRandomSource()


def _round1_coef(study: Study, envelope: Envelope) -> np.ndarray:
    dim = statistics_dim(study)  # under --dp-dim the server sends W_K: round 2 scores projected rows
    coef = envelope.arrays.get("coef")
    if coef is None or coef.shape != (dim, study.n_classes):
        raise StudyMismatchError(f"round 2 needs the round-1 coefficients ({dim} × {study.n_classes})")
    return coef


def _inputs(
    label: str, study: Study, data: Any, envelope: Envelope, groups: set[str], settings: NodeSettings,
    roster_size: int = 0, client_id: str = "", roster_ids: Sequence[str] = (), withheld: str = "",
) -> tuple[dict[str, dict[str, np.ndarray]], Release]:  # fmt: skip
    """This client's protocol inputs for session ``label`` (group -> tensor -> flat float64 vector)
    and what they release: the images the statistics are computed from (each row's image digest,
    the one-contribution rule's unit: another study, backbone, layout or protection over the same
    images, or a re-extracted file of them, is the same release), and the values before any noise
    (a rerun draws fresh noise over the same data: the same values).  The inputs are the stages of
    :mod:`secure_afl.stages` (the simulator's) for the study's recipe and the round; round 1's are
    in the groups of :func:`~secure_afl.deploy.study.round1_plan` over ``roster_ids`` (the
    server's too); ``withheld``: the record of the file's rows :func:`_unreleased` left out."""
    if label not in ("1", "2"):
        raise SessionReplayError(f"unknown session {label!r}")
    images = data.require_image_identities()  # the release's unit: each row's image by all its names
    how = recipe(study, roster_size, label)
    noise = _noise_random() if study.dp is not None else None
    if label == "1":
        layout, plan = round1_plan(study, roster_ids)
        upload = stages.node_round1(
            data.features, data.labels, data.active, how, layout=layout, wire=plan,
            patient_ids=data.patient_ids, device=settings.device, random=noise,
        )  # fmt: skip
        if upload.clipped is not None:
            projected = "" if how.projection is None else f" (projected to K = {how.projection.shape[1]})"
            log(
                settings,
                f"{client_id}: DP: {upload.clipped} of {int(upload.rows.sum())} rows{projected} clipped to "
                f"norm {how.dp.clip:g}",  # type: ignore[union-attr]
            )
    else:
        coef = _round1_coef(study, envelope)
        classes = [int(g.split("/")[1]) for g in groups if g.startswith("pseudo/")]
        upload = stages.node_round2(
            data.features, coef, data.active, how, layout=round2_layout(study, classes), groups=groups,
            patient_ids=data.patient_ids, device=settings.device, random=noise,
        )  # fmt: skip
    unknown = set(upload.inputs) - groups
    if unknown:
        raise StudyMismatchError(f"the session lacks this client's groups {sorted(unknown)}")
    if study.dp is not None:
        images = tuple(d for d, kept in zip(images, upload.rows, strict=True) if kept)
    # One contribution per image: the images are the unit (a re-extracted, re-ordered or re-exported
    # file of released images is refused), and round 2 may use its own study's round-1 images again.
    # The values' ids and anchors stay beside them (a round-2 value equal to a released one).
    scope = release_scope(study, label, settings)
    release = Release.of(
        upload.clean,
        images=[names[0] for names in images],
        aliases=[names[1:] for names in images],
        scope=scope,
        reuses=release_scope(study, "1", settings) if label == "2" else "",
    )
    return upload.inputs, replace(release, withheld=withheld)  # the rows left out (_unreleased), for the DPO


def release_scope(study: Study, label: str, settings: NodeSettings) -> str:
    """What a session's images are released under: the study's digest and the round, and the
    node's declaration of an honest-but-curious coordinator where it made one (the ledger keeps it
    with the session: ``keys ledger show`` lists it)."""
    declared = f"/coordinator:{settings.coordinator}" if settings.coordinator != COORDINATOR_ACTIVE else ""
    return f"study:{study.digest()}/round:{label}{declared}"


def _unreleased(
    data: Any,
    study: Study,
    label: str,
    settings: NodeSettings,
    client_id: str,
    identity: IdentityKey,
    session_id: bytes = b"",
) -> tuple[Any, str]:
    """The feature file's rows a release may take, and the record of the others
    (:func:`~secure_afl.privacy.release.select_rows`): a row naming an image this institution's
    ledger released (round 2 may use its own round 1's again), or repeating an image or a UID of the
    file, is withheld, named with its reason in the node's log.  A growing study's increment may have
    no rows (it commits 0 and sends zeros); another study with none left is refused."""
    import dataclasses

    from secure_afl.privacy.ledger import LedgerOwner
    from secure_afl.privacy.release import select_rows

    state = _ledger(settings).load(LedgerOwner(client_id, identity))
    entry = state.sessions.get(session_id.hex())
    if entry is not None and entry.survivors is not None:
        # Its release point passed: a session id the coordinator reuses in a new run would otherwise
        # count the images it released as this session's own (the exemption below).
        raise SessionReplayError(
            f"session {session_id.hex()[:16]}... was released by this institution (its ledger holds its "
            "survivor set): a session is run once; the coordinator must start a new one"
        )
    reuses = release_scope(study, "1", settings) if label == "2" and not study.extends else ""
    # ``session_id``: this session's own release is not "another" one (Flower may deliver its R0 again
    # before the release point)
    released = state.released_images(session_id, reuses=reuses)
    selection = select_rows(data.require_image_identities(), released)
    for line in selection.log_lines(data.image_ids, data.sop_instance_uids):
        log(settings, f"{client_id}: {line}")
    total = selection.total
    if study.extends:
        log(settings, f"{client_id}: growing study: {len(selection.kept)} of {total} rows are new images")
    if not study.extends:
        selection.require_some({sid: entry.scope for sid, entry in state.sessions.items()})
    keep = np.zeros(total, dtype=bool)
    keep[list(selection.kept)] = True

    def rows(values: Any) -> Any:
        return None if values is None else tuple(v for v, k in zip(values, keep, strict=True) if k)

    return dataclasses.replace(
        data,
        features=data.features[keep],
        labels=data.labels[keep],
        image_ids=rows(data.image_ids),
        patient_ids=rows(data.patient_ids),
        image_sha256=rows(data.image_sha256),
        pixel_sha256=rows(data.pixel_sha256),
        sop_instance_uids=rows(data.sop_instance_uids),
    ), selection.record()


def _start_session(envelope: Envelope, label: str, state: LocalState, settings: NodeSettings) -> Envelope:
    if state.load(label) is not None:
        raise SessionReplayError(
            f"session {label} of this run was already started: a second start over the same inputs is refused"
        )
    roster = node_roster(settings)
    if envelope.text("roster") != roster.fingerprint:
        raise RosterMismatchError(
            f"the server's roster is {envelope.text('roster')}, this institution pinned {roster.fingerprint} "
            f"({settings.roster}): compare rosters with `secure-afl keys roster show`"
        )
    client_id, identity = node_identity(settings, roster)
    study = Study.from_json(envelope.text("study"))
    _check_pinned_study(study, settings)
    _check_round(label, study, envelope.arrays)
    data = check_node_study(study, settings)
    backend = node_backend(envelope, study, settings, len(roster))
    # Decoded once under the client policy's bound on a first message, to read the layout.
    request = backend.decode(envelope.payload, backend.client_policy.max_config_bytes)  # type: ignore[attr-defined]
    _check_protocol_parameters(request.config, study, len(roster))  # type: ignore[attr-defined]
    groups = {group.name for group in request.config.groups}  # type: ignore[attr-defined]
    # The session's fresh randomness (drawn here, kept in its record): its keys, shares and masks, and
    # the classifier check's secret (verify.py), which thus depends on no coordinator choice.
    seed = os.urandom(32)
    commitment = _verify_commitment(label, study, roster, client_id, identity, request, seed, settings)
    if study.dp is not None:
        _check_dp_session(
            study, data, client_id, roster, backend, request, str(envelope.meta.get("study-nonce", ""))
        )
    spend = ""
    if study.dp is not None and label == "1":  # round 1 carries the study's spend (both rounds)
        spend = _check_dp_budget(study, settings, client_id, identity, len(roster))
    # Only images not yet released, none repeated in the file (a growing study: its new images)
    session_id = request.config.session_id  # type: ignore[attr-defined]
    data, withheld = _unreleased(data, study, label, settings, client_id, identity, session_id)
    if study.class_lists:  # round 1's wire groups are planned from the published lists: they must be true
        _check_class_list(
            study.class_lists, data, client_id, roster, "round 1's groups are planned from these lists"
        )
    roster_ids = [entry.client_id for entry in roster]
    inputs, release = _inputs(
        label, study, data, envelope, groups, settings, len(roster), client_id, roster_ids, withheld
    )
    # One view: the digest of the study, the round and the arrays (round 2's W) this node was given;
    # its advertisement signs it and R1 goes on only if every advertisement signs the same.
    context = session_context(study, label, envelope.arrays)
    if spend:  # into the ledger with the release, at its release point (R3), signed
        release = replace(release, spend=spend)
    _settle_earlier_sessions(label, state)
    ledger, colluders = _ledger(settings), settings.colluders
    rows = committed_rows(study, inputs, release)
    session = _client_session(
        backend, client_id, identity, roster, inputs, seed, study, ledger, release, colluders, context, rows
    )
    replies = session.receive_bytes(envelope.payload)  # decoded again under the session's own limits
    state.save(
        label,
        {
            "status": "active",
            "client_id": client_id,
            "backend": backend.name,
            "study": study.to_json(),
            "session_id": request.config.session_id.hex(),  # type: ignore[attr-defined]
            "seed": seed,
            "context": context,
            "messages": [envelope.payload],
            "inputs": {f"{g}|{t}": v for g, tensors in inputs.items() for t, v in tensors.items()},
            "release": json.dumps(release.to_json()),
            "rows": json.dumps(rows),  # the committed counts (JSON: Flower's records hold no mappings)
            **commitment,  # the classifier check's signed commitment (verify.keep_inputs keeps it)
        },
    )
    record_accepted(envelope, state, settings, client_id, identity, roster)  # or the session is refused
    log(settings, f"{client_id}: session {label} R0 answered (groups {sorted(inputs)}, {backend.name})")
    return Envelope("reply", {"session": label, "round": "R0", **commitment}, _one_reply(replies))


def _continue_session(envelope: Envelope, label: str, state: LocalState, settings: NodeSettings) -> Envelope:
    saved = state.load(label)
    if saved is None:
        raise SessionReplayError(
            f"a {shown(envelope.meta.get('round'))} message for session {shown(label)}, which this run never "
            "started"
        )
    if saved.get("status") != "active":
        raise SessionReplayError(f"session {label} is over ({saved.get('status')}); the message is refused")
    roster = node_roster(settings)
    client_id, identity = node_identity(settings, roster)
    if client_id != saved["client_id"]:
        raise IdentityNotInRosterError("the identity key changed during the session")
    study = Study.from_json(str(saved["study"]))
    backend = study.backend(len(roster))
    if backend.name != saved["backend"]:
        raise SessionReplayError(f"session {label} was started under {saved['backend']!r}")
    inputs: dict[str, dict[str, np.ndarray]] = {}
    for key, values in saved["inputs"].items():
        group, tensor = key.split("|", 1)
        inputs.setdefault(group, {})[tensor] = np.asarray(values, dtype=np.float64)
    release = Release.from_json(json.loads(str(saved["release"])))
    session = _client_session(
        backend,
        client_id,
        identity,
        roster,
        inputs,
        saved["seed"],
        study,
        _ledger(settings),
        release,
        settings.colluders,
        bytes(saved["context"]),
        json.loads(str(saved.get("rows", "null"))),
    )
    # Rebuild: the same seed and the same server messages give the same state, secrets included
    # (CKKS: the secret context is the one the key holder sealed for this client in R2's message;
    # a replayed R3 decrypts again what was decrypted before, and a new R3 asks for other groups).
    for data in saved["messages"]:
        backend.replay(session, data)
    replies = session.receive_bytes(envelope.payload)
    round_name = str(envelope.meta.get("round", ""))
    if getattr(session, "state", None) is not None and session.state.name == "DONE":  # type: ignore[attr-defined]
        # The session's secrets are no longer needed: keep only what the classifier check uses.
        # The values uploaded, for the classifier check (verify.py); those a growing study may add to
        # its sums also in the ledger dir, which outlives the run (the node's own values only, 0600).
        keep_inputs(label, saved, state, settings.ledger_dir / KEPT_DIR)
        state.save(label, _done(saved, _session_view(session, study, label, roster)))
    else:
        # ``finished``: the session needs nothing more of this client for sure (CKKS after R2); its
        # secrets are kept only for a replacement decryption, and dropped when the session is over.
        finished = backend.client_finished(session)
        state.save(label, {**saved, "messages": [*saved["messages"], envelope.payload], "finished": finished})
    log(settings, f"{client_id}: session {shown(label)} {shown(round_name)} answered")
    return Envelope("reply", {"session": label, "round": round_name}, _one_reply(replies))


def _one_reply(replies: list[bytes]) -> bytes:
    """The one reply of a round, or no bytes where the client has nothing to send (CKKS's R1 for
    all but the key holder): the server counts an empty reply as an answer without a message."""
    if len(replies) > 1:  # pragma: no cover - neither backend sends two messages in one round
        raise SessionReplayError(f"the protocol produced {len(replies)} replies to one message")
    return replies[0] if replies else b""


def _client_session(
    backend: ProtectionBackend,
    client_id: str,
    identity: IdentityKey,
    roster: Roster,
    inputs: Mapping[str, Mapping[str, np.ndarray]],
    seed: bytes,
    study: Study,
    ledger: Any,
    release: Release,
    colluders: int | None = None,
    context: bytes = b"",
    rows: Mapping[str, int] | None = None,
) -> ClientSessionLike:
    # The deployment policy is the client's own (the backend's default): t >= floor(2n/3)+1 with
    # masking, groups of at least 2 (or the study's larger minimum), the exposure check, and the
    # ledger of its earlier sessions over the same statistics.  The session's randomness is a
    # ChaCha20 stream from the seed, so replaying the server's messages rebuilds the same keys
    # (masking: shares and masks too).  ``release`` names the values (before any DP noise) and the
    # source: the ledger refuses a second session over them and a second answer to one round.
    from dataclasses import replace

    from secure_afl.core.randomness import DeterministicRandomSource

    policy = replace(backend.client_policy, max_colluders=colluders)  # type: ignore[attr-defined]
    own = replace(backend, ledgers={client_id: ledger}, client_policy=policy)  # type: ignore[type-var]
    return own.client_session(
        client_id,
        identity,
        roster,
        inputs,
        session_id=None,
        min_group_size=study.min_group_size,
        random=DeterministicRandomSource(seed),
        release=release,
        context=context,
        rows=rows,
        # From the pinned study, never the server: whose round-2 value is a known zero (too few rows).
        row_floors=round2_row_floors(study) if rows is not None else None,
    )


def committed_rows(
    study: Study, inputs: Mapping[str, Mapping[str, np.ndarray]], release: Release
) -> dict[str, int] | None:
    """The counts this node commits to in its advertisement: the rows (images) its values in each
    group are computed from.  Every client's exposure check takes a member that commits 0 as a
    known value (SECURITY.md, committed counts).  Under DP none: each member's noise is its own
    secret, so no member's value is known (and an exact count of new images would not be noised)."""
    if study.dp is not None:
        return None
    return dict.fromkeys(inputs, len(release.images))


def _check_protocol_parameters(config: Any, study: Study, roster_size: int) -> None:
    """The session's own parameters are the study's (the server sends both; they must agree): the
    study this node checked (and pinned) is the one the session runs, threshold included."""
    if study.protection == "mask" and config.threshold != study.threshold_for(roster_size):
        raise StudyMismatchError(
            f"the session's threshold t = {config.threshold} differs from the study's "
            f"t = {study.threshold_for(roster_size)} for a {roster_size}-institution roster"
        )
    if study.protection == "ckks":
        if config.parameters != study.ckks_parameters():
            raise StudyMismatchError(
                f"the session's CKKS parameters {config.parameters} differ from the study's "
                f"({study.describe_protection()})"
            )
    elif config.frac_bits != study.frac_bits:
        raise StudyMismatchError(
            f"the session encodes with {config.frac_bits} fractional bits, the study with {study.frac_bits}"
        )
    if config.min_group_size != study.min_group_size:
        raise StudyMismatchError(
            f"the session's minimum group size {config.min_group_size} differs from the study's "
            f"{study.min_group_size}"
        )


def node_backend(
    envelope: Envelope, study: Study, settings: NodeSettings, roster_size: int
) -> ProtectionBackend:
    name = envelope.text("backend")
    if study.protection not in settings.protections:
        raise StudyMismatchError(
            f"the study protects the statistics with {study.describe_protection()}, but this institution "
            f"agreed to {', '.join(sorted(settings.protections))} only (its SuperNode's node config "
            f'protection="{",".join(sorted(settings.protections))}"); CKKS and masking trust the other '
            f"clients differently (SECURITY.md §7.2): add the study's protection to the node config "
            f"only if this institution agreed to it"
        )
    if name != study.protection:
        raise StudyMismatchError(
            f"the session runs the {name!r} protection, but the study says {study.protection!r}; "
            f"the server must run the study it sends"
        )
    return study.backend(roster_size)


def _settle_earlier_sessions(label: str, state: LocalState) -> None:
    """A new session starts only after the earlier one ended at the server: drop what a finished
    client still kept of it (CKKS: the secrets held in case it had to replace a decryptor)."""
    for earlier in ("1",) if label == "2" else ():
        _settle(earlier, state)


def _done(saved: Mapping[str, Any], view: dict[str, Any] | None = None) -> dict[str, Any]:
    """A session's record once it is over: its ids, its study and (masking) this node's ``view`` of
    what the server learned (:func:`_session_view`, as JSON text: Flower's state holds flat values;
    the classifier's delivery checks the file states what that study decides and that view,
    :func:`_store_classifier`); no secret."""
    return {
        "status": "done", "client_id": saved["client_id"], "session_id": saved["session_id"],
        "study": saved["study"], **({} if view is None else {"view": json.dumps(view, sort_keys=True)}),
    }  # fmt: skip


def _session_view(session: Any, study: Study, label: str, roster: Roster) -> dict[str, Any] | None:
    """What the classifier's record of session ``label`` must state, from what this node saw: its
    ``participants`` (whose advertisements the session relayed), ``survivors`` (the set it signed
    in R3) and the audit's ``groups`` (:meth:`Layout.group_records`: the members the advertisements
    named, the survivors among them, in the session's layout: round 1's from the study and roster,
    round 2's from its pseudo-label groups), as the server forms them from its sums.  None where
    the backend keeps no such view (CKKS: its audit is not checked)."""
    summed = getattr(session, "summed_groups", None)
    if summed is None:
        return None
    members, survivors, participants = summed
    if label == "1":
        layout, _ = round1_plan(study, [entry.client_id for entry in roster])
    else:
        layout = round2_layout(study, [int(g.split("/")[1]) for g in members if g.startswith("pseudo/")])
    alive = {group: tuple(c for c in ids if c in survivors) for group, ids in members.items()}
    return {
        "participants": sorted(participants),
        "survivors": sorted(survivors),
        "groups": layout.group_records(layout.logical_members(members), layout.logical_members(alive)),
    }


def _settle(label: str, state: LocalState) -> dict[str, Any] | None:
    saved = state.load(label)
    if saved is not None and saved.get("status") == "active" and saved.get("finished"):
        saved = _done(saved)
        state.save(label, saved)
    return saved


def _store_classifier(envelope: Envelope, state: LocalState, settings: NodeSettings) -> Envelope:
    """Verify the classifier file (content digest, the roster coordinator's signature, the roster
    fingerprint, this institution's sessions), then keep the exact bytes received: in the history
    ``OUT_DIR/classifiers/<created>-<digest>.json`` and as ``OUT_DIR/classifier.json`` (the latest;
    the file it held before stays in the history)."""
    from .classifier import keep_classifier

    roster = node_roster(settings)
    # Raises ClassifierTamperedError, UnsignedClassifierError, ClassifierSignatureError (also when the
    # pinned roster names no coordinator) or RosterMismatchError (made with another roster).
    classifier = Classifier.from_json(envelope.payload, roster=roster, source="the server's classifier")
    mine, studied, views = {}, None, {}
    for session in classifier.sessions:
        saved = _settle(str(session["label"]), state)  # the classifier ends every session
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
        if "study" not in saved:
            raise SessionReplayError(
                f"this institution's record of session {session['label']} holds no study (written by an "
                "earlier release): run the session again"
            )
        studied = str(saved["study"])  # every session of a run is of one study
        if saved.get("view") is not None:  # what the server learned, as this node saw it
            views[str(session["label"])] = json.loads(str(saved["view"]))
    classifier.check_layout("the server's classifier")
    if views:
        classifier.check_session_views(views, "the server's classifier")
    if studied is not None:  # its classes, threshold, backbone, method, DP record: the study's
        expected = classifier_fields(Study.from_json(studied), len(roster))
        classifier.check_study_fields(expected, "the server's classifier")
    identity = loaded_once(lambda: node_identity(settings, roster))  # the passphrase only when needed

    def ledger_state() -> Any:
        from secure_afl.privacy.ledger import LedgerOwner

        return _ledger(settings).load(LedgerOwner(*identity()))

    ledger = loaded_once(ledger_state)  # once: a growing chain asks for each of its runs

    def signed_survivors(session_id: str) -> tuple[str, ...] | None:
        """The survivor set this node signed in the session's R3 (its ledger): the sum's members."""
        entry = ledger().sessions.get(session_id)
        return None if entry is None else entry.survivors

    held = begin_check(
        classifier, envelope.payload, envelope.meta, state, roster, mine["1"], settings.require_verified,
        identity, signed_survivors,
    )  # fmt: skip
    if held.hold:  # stored only once every survivor verified it (verify.py)
        digest = _sha256(envelope.payload)
        log(settings, f"holding the classifier until every survivor checked it (sha256 {digest[:16]}...)")
        return Envelope("ack", {"sha256": digest, "kept": "", "held": True, **held.meta}, held.payload)
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    stored = keep_classifier(settings.out_dir, envelope.payload)  # the signed bytes, as every party got them
    replaced = f"; the earlier classifier.json is kept as {stored.replaced}" if stored.replaced else ""
    log(
        settings,
        f"stored the classifier in {stored.latest} and {stored.kept} (signed by the coordinator "
        f"{classifier.signer}; sha256 {stored.sha256[:16]}..., session "
        f"{classifier.sessions[0]['session_id'][:16]}...){replaced}",
    )
    # No path in the acknowledgement: the coordinator learns only that the file was kept, and which.
    return Envelope("ack", {"sha256": stored.sha256, "kept": stored.kept.name, **held.meta}, held.payload)


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _verify_commitment(
    label: str, study: Study, roster: Roster, client_id: str, identity: IdentityKey, request: Any,
    seed: bytes, settings: NodeSettings,
) -> dict[str, str]:  # fmt: skip
    """R0: the signed commitment of the classifier check (or a refusal where this node requires it)."""
    from .verify import commit_meta

    ids = [entry.client_id for entry in roster]
    session_id = request.config.session_id  # type: ignore[attr-defined]
    return commit_meta(label, study, ids, client_id, identity, session_id, settings.require_verified, seed)


def _check_classifier(envelope: Envelope, state: LocalState, settings: NodeSettings) -> Envelope:
    """A ``verify`` message of the classifier check (secure_afl.deploy.verify)."""
    from .verify import answer_check

    roster = node_roster(settings)
    return answer_check(envelope, state, roster, settings.out_dir, lambda text: log(settings, text))
