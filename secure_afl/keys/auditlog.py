"""A party's audit log: append-only, hash-chained, each record signed with its Ed25519 identity key.

One JSON line per record (UTF-8, ``\\n``-terminated), in this canonical form (sorted keys, no
spaces, ASCII)::

    {"body": {...}, "format": "secure-afl-audit/v1", "index": 0, "key": "SHA256:ab12 ...",
     "kind": "session", "party": "hospital-a", "prev": "<64 hex>", "signature": "<128 hex>",
     "time": "2026-12-07T02:09:00.123+00:00"}

``index`` counts from 0; ``prev`` is the SHA-256 of the previous record's line as stored (its bytes
without the line break; 64 zeros for the first); ``key`` is the fingerprint of the key that signed;
``signature`` is Ed25519 over :data:`SIGNATURE_DOMAIN` followed by the canonical JSON of every other
field.  So an edited record fails its signature, and a deleted, inserted or reordered one breaks the
indices and the chain: :func:`verify_log` names the first record that fails and why.

Writes (:meth:`AuditLog.append`) hold an exclusive lock on the file, append one line in one
``write`` and ``fsync`` it.  A crash mid-write leaves a last line without its line break: the
*unfinished* record.  :func:`verify_log` reports it as unfinished (every complete record before it
still verifies; it is not counted as tampering).  The next append repairs it: it copies the
unfinished bytes to ``<log>.unfinished-<UTC time>`` beside the log (0600, fsynced), truncates them
from the log, then appends a signed ``log-repaired`` record naming their length, SHA-256 and that
file, before its own record.  Only bytes that never formed a complete record are ever removed.

What the chain cannot show alone: a log deleted whole, or cut at a line boundary (its last records
removed), reads as a shorter valid log.  Keep a copy where the party cannot rewrite it (the DPO's).

A party whose key changed (rotated, or replaced after a revocation) verifies its whole log against its
roster: :func:`key_history` follows the roster versions kept beside it (``ROSTER.vN.json``, which
``keys roster update`` keeps), each the predecessor the next names by digest and followed by it under
the succession rules, and takes every key they list for the party, oldest first.  Each key verifies
only the records written while it was the party's: the log moves to a later key at a ``key-changed``
record (signed by the later key) and never back, and a key a roster version revoked or rotated away
signs nothing after the log's ``roster-pinned`` record of that version or a later one.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import fcntl
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from .identity import PUBLIC_KEY_BYTES, IdentityKey, fingerprint

__all__ = [
    "AUDIT_FILE",
    "FORMAT",
    "GENESIS",
    "AuditLog",
    "AuditLogError",
    "AuditRecord",
    "KeyHistory",
    "LogContents",
    "PartyKey",
    "Verification",
    "key_history",
    "public_key_of",
    "read_log",
    "roster_chain",
    "summary",
    "verify_log",
    "verify_with",
]

FORMAT = "secure-afl-audit/v1"
SIGNATURE_DOMAIN = b"secure-afl/v1/audit-record\x00"
AUDIT_FILE = "audit.log"  # a node's log: LEDGER_DIR/audit.log; the coordinator's: OUT_DIR/audit.log
GENESIS = "0" * 64
REPAIRED = "log-repaired"
KEY_CHANGED = "key-changed"  # body {"from": fingerprint, "to": fingerprint}, signed by the new key
ROSTER_PINNED = "roster-pinned"  # body {"roster": fingerprint, ...}
MAX_RECORD_BYTES = 64 << 10  # one record's line; a body is counts, ids and digests, never data
MAX_LOG_BYTES = 256 << 20  # refuse to read anything larger
_FIELDS = ("body", "format", "index", "key", "kind", "party", "prev", "signature", "time")


class AuditLogError(ValueError):
    """An audit log that cannot be read, written or verified (the message names the file, the record
    and what to do)."""


def _canonical(document: Mapping[str, Any]) -> bytes:
    try:
        return json.dumps(
            document, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
        ).encode("ascii")
    except (TypeError, ValueError) as exc:
        raise AuditLogError(
            f"an audit record must be JSON of finite numbers, strings and lists: {exc}"
        ) from None


@dataclass(frozen=True)
class AuditRecord:
    """One record of the log."""

    index: int
    prev: str
    time: str
    party: str
    kind: str
    body: Mapping[str, Any]
    key: str  # the fingerprint of the signing key
    signature: str = ""

    def unsigned(self) -> dict[str, Any]:
        return {"body": dict(self.body), "format": FORMAT, "index": self.index, "key": self.key,
                "kind": self.kind, "party": self.party, "prev": self.prev, "time": self.time}  # fmt: skip

    def signed_bytes(self) -> bytes:
        """What the signature covers: the domain, then the canonical JSON of every other field."""
        return SIGNATURE_DOMAIN + _canonical(self.unsigned())

    def line(self) -> bytes:
        """The record as stored, without its line break."""
        return _canonical({**self.unsigned(), "signature": self.signature})

    def digest(self) -> str:
        """The SHA-256 of its line: the next record's ``prev``."""
        return hashlib.sha256(self.line()).hexdigest()

    @classmethod
    def from_line(cls, line: bytes) -> AuditRecord:
        """Parse one stored line (signature and chain not checked); raises :class:`ValueError`."""
        document = json.loads(line.decode("utf-8"))
        if not isinstance(document, dict):
            raise ValueError("not a JSON object")
        if document.get("format") != FORMAT:
            raise ValueError(f"format {document.get('format')!r}, expected {FORMAT!r}")
        if sorted(document) != sorted(_FIELDS):
            raise ValueError(f"fields {sorted(document)}, expected {list(_FIELDS)}")
        index = document["index"]
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"index {index!r} is not a non-negative integer")
        if not isinstance(document["body"], dict):
            raise ValueError("the body is not a JSON object")
        texts = ("prev", "time", "party", "kind", "key", "signature")
        if not all(isinstance(document[name], str) for name in texts):
            raise ValueError(f"{', '.join(texts)} must be strings")
        return cls(index, document["prev"], document["time"], document["party"], document["kind"],
                   document["body"], document["key"], document["signature"])  # fmt: skip


@dataclass(frozen=True)
class LogContents:
    """A log as read (nothing verified): its complete lines and an unfinished last line, if any."""

    lines: tuple[bytes, ...]
    unfinished: bytes = b""  # bytes after the last line break: a write a crash cut short

    def records(self) -> list[AuditRecord | None]:
        """Each complete line parsed (None where a line is not a record)."""
        out: list[AuditRecord | None] = []
        for line in self.lines:
            try:
                out.append(AuditRecord.from_line(line))
            except (ValueError, UnicodeDecodeError):
                out.append(None)
        return out


def read_log(path: Path) -> LogContents:
    """Read ``path`` without verifying it (a missing file is an empty log)."""
    try:
        with open(path, "rb") as handle:
            return _contents(handle.read(MAX_LOG_BYTES + 1), path)
    except FileNotFoundError:
        return LogContents(())
    except OSError as exc:
        raise AuditLogError(f"{path}: cannot read the audit log: {exc.strerror}") from None


def _contents(data: bytes, path: Path) -> LogContents:
    if len(data) > MAX_LOG_BYTES:
        raise AuditLogError(f"{path}: the audit log is larger than {MAX_LOG_BYTES} bytes: start a new one")
    *lines, tail = data.split(b"\n")
    return LogContents(tuple(lines), tail)


class AuditLog:
    """The audit log at ``path`` (created 0600 with its directory 0700 on the first append)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def append(
        self, identity: IdentityKey, party: str, kind: str, body: Mapping[str, Any], *, now: str | None = None
    ) -> AuditRecord:
        """Sign and append one record; returns it.  An unfinished last line is repaired first (see
        the module's docstring); a last complete line that is not a record is refused
        (:class:`AuditLogError`): the log was changed outside secure-afl."""
        if not kind or not party:
            raise AuditLogError("an audit record needs a party and a kind")
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            handle = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as exc:
            raise AuditLogError(f"{self.path}: cannot open the audit log: {exc.strerror}") from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
            contents = _contents(_read_all(handle), self.path)
            index, prev = self._head(contents)
            if contents.unfinished:
                repair = self._repair(handle, identity, party, contents, index, prev, now)
                index, prev = index + 1, repair.digest()
            record = _signed(identity, index, prev, party, kind, body, now)
            _write_line(handle, record.line(), self.path)
            return record
        finally:
            os.close(handle)  # closing releases the lock

    def _head(self, contents: LogContents) -> tuple[int, str]:
        """The next record's index and ``prev``."""
        if not contents.lines:
            return 0, GENESIS
        last = contents.lines[-1]
        try:
            record = AuditRecord.from_line(last)
        except (ValueError, UnicodeDecodeError) as exc:
            raise AuditLogError(
                f"{self.path}: line {len(contents.lines)} is not an audit record ({exc}): the log was "
                "changed outside secure-afl. Keep it as evidence (`secure-afl audit verify` names the "
                "first bad record), move it aside, and the next record starts a new log"
            ) from None
        return record.index + 1, hashlib.sha256(last).hexdigest()

    def _repair(
        self, handle: int, identity: IdentityKey, party: str, contents: LogContents, index: int, prev: str,
        now: str | None,
    ) -> AuditRecord:  # fmt: skip
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        kept = self.path.with_name(f"{self.path.name}.unfinished-{stamp}")
        unfinished = contents.unfinished
        try:
            side = os.open(kept, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(side, unfinished)
                os.fsync(side)
            finally:
                os.close(side)
            os.ftruncate(handle, sum(len(line) + 1 for line in contents.lines))
            os.fsync(handle)
        except OSError as exc:
            raise AuditLogError(
                f"{self.path}: cannot repair the unfinished last line: {exc.strerror}"
            ) from None
        digest = hashlib.sha256(unfinished).hexdigest()
        body = {"unfinished_bytes": len(unfinished), "unfinished_sha256": digest, "kept_in": kept.name}
        record = _signed(identity, index, prev, party, REPAIRED, body, now)
        _write_line(handle, record.line(), self.path)
        return record


def _signed(
    identity: IdentityKey,
    index: int,
    prev: str,
    party: str,
    kind: str,
    body: Mapping[str, Any],
    now: str | None,
) -> AuditRecord:
    time = now or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
    record = AuditRecord(index, prev, time, party, kind, dict(body), identity.fingerprint)
    signature = identity.private_key.sign(record.signed_bytes()).hex()
    record = AuditRecord(index, prev, time, party, kind, dict(body), identity.fingerprint, signature)
    if len(record.line()) > MAX_RECORD_BYTES:
        raise AuditLogError(f"an audit record of kind {kind!r} would exceed {MAX_RECORD_BYTES} bytes")
    return record


def _read_all(handle: int) -> bytes:
    os.lseek(handle, 0, os.SEEK_SET)
    parts = []
    for _ in range(MAX_LOG_BYTES // (1 << 20) + 2):
        part = os.read(handle, 1 << 20)
        if not part:
            break
        parts.append(part)
    return b"".join(parts)


def _write_line(handle: int, line: bytes, path: Path) -> None:
    data = line + b"\n"
    try:
        written = os.write(handle, data)  # O_APPEND: at the end, in one write
        if written != len(data):
            raise OSError(0, f"wrote {written} of {len(data)} bytes")
        os.fsync(handle)
    except OSError as exc:
        raise AuditLogError(f"{path}: cannot append to the audit log: {exc.strerror}") from None


# --- verification -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verification:
    """What :func:`verify_log` found.  ``ok``: every complete record verifies (an unfinished last
    line, what a crash leaves, does not make the log invalid)."""

    path: Path
    records: int  # complete records that verified (all of them when ok)
    bad_line: int | None = None  # 1-based line of the first record that fails
    reason: str = ""
    unfinished: int = 0  # bytes of an unfinished last line (0: none)
    parties: tuple[str, ...] = ()
    repairs: tuple[int, ...] = field(default_factory=tuple)  # indices of log-repaired records

    @property
    def ok(self) -> bool:
        return self.bad_line is None

    def describe(self) -> str:
        if not self.ok:
            return (
                f"{self.path}: INVALID at line {self.bad_line} (record {self.bad_line - 1}): {self.reason}; "
                f"the {self.records} record(s) before it verify"
            )
        text = f"{self.path}: valid: {self.records} record(s) by {', '.join(self.parties) or 'nobody'}"
        if self.repairs:
            text += f"; repaired after a crash at record(s) {list(self.repairs)}"
        if self.unfinished:
            text += (
                f"; the last line is UNFINISHED ({self.unfinished} bytes without a line break: a write cut "
                "short by a crash; the next record repairs it)"
            )
        return text


def public_key_of(text: str) -> bytes:
    """A raw Ed25519 public key from base64 (as roster entries hold it)."""
    try:
        key = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise AuditLogError(f"{text!r} is not a base64 public key") from None
    if len(key) != PUBLIC_KEY_BYTES:
        raise AuditLogError(f"an Ed25519 public key has {PUBLIC_KEY_BYTES} bytes, got {len(key)}")
    return key


@dataclass(frozen=True)
class PartyKey:
    """One of a party's keys, as the roster versions list it."""

    public_key: bytes
    since: int  # the first roster version (of those read) that lists it as the party's
    revoked_in: int | None = None  # the roster version that revoked it or rotated it away

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public_key)


@dataclass(frozen=True)
class KeyHistory:
    """A party's keys over the roster versions that were read (:func:`key_history`), oldest first:
    the last is its key in the newest version."""

    party: str
    keys: tuple[PartyKey, ...]
    versions: Mapping[str, int]  # roster fingerprint -> version, for every version read
    files: tuple[str, ...] = ()  # the roster files read, oldest first


def verify_log(path: Path, public_keys: Iterable[bytes], history: KeyHistory | None = None) -> Verification:
    """Check every record of the log at ``path``: its form, its index (0, 1, ...), its ``prev`` (the
    previous line's SHA-256) and its signature by one of ``public_keys`` (accepted on any record) or
    by a key of ``history``, each only while it was the party's (the module's docstring).  Stops at
    the first record that fails and names it; an unfinished last line is reported as such.  A
    missing file raises :class:`AuditLogError`."""
    if not path.is_file():
        raise AuditLogError(
            f"{path}: no audit log here (the party has recorded nothing yet, or the path is wrong)"
        )
    given = {fingerprint(key): Ed25519PublicKey.from_public_bytes(key) for key in public_keys}
    keys = dict(given)
    if history is not None:
        keys.update(
            (k.fingerprint, Ed25519PublicKey.from_public_bytes(k.public_key))
            for k in history.keys
            if k.fingerprint not in keys
        )
    if not keys:
        raise AuditLogError("give the public key the log is signed with (the roster's, or --public-key)")
    contents = read_log(path)
    order = _KeyOrder(history, set(given)) if history is not None else None
    hint = "" if history is None else (
        f"; an earlier key of {history.party} verifies only with the roster versions that list it, kept "
        f"beside the roster as STEM.vN.json (read: {', '.join(history.files)}), or with --public-key"
    )  # fmt: skip
    prev, parties, repairs = GENESIS, [], []
    for number, line in enumerate(contents.lines, start=1):
        reason = _check(line, number - 1, prev, keys, hint)
        record = None if reason else AuditRecord.from_line(line)
        if record is not None and order is not None:
            following = contents.lines[number] if number < len(contents.lines) else None
            reason = order.check(record, following)
        if reason or record is None:
            return Verification(path, number - 1, number, reason, len(contents.unfinished), tuple(parties))
        if record.party not in parties:
            parties.append(record.party)
        if record.kind == REPAIRED:
            repairs.append(record.index)
        prev = hashlib.sha256(line).hexdigest()
    return Verification(
        path, len(contents.lines), None, "", len(contents.unfinished), tuple(parties), tuple(repairs)
    )


class _KeyOrder:
    """Which of a party's keys may sign the next record: the log starts with any of them, moves to a
    later one at a ``key-changed`` record (a ``log-repaired`` record just before it may already be
    signed by the later key: the append that repairs is the one that records the change) and never
    back; a key revoked or rotated away signs nothing after the log pinned the version that did so.
    Keys given outside the history (``--public-key``) are accepted anywhere."""

    def __init__(self, history: KeyHistory, overrides: set[str]) -> None:
        self.history = history
        self.position = {key.fingerprint: n for n, key in enumerate(history.keys)}
        self.overrides = overrides
        self.at: int | None = None  # the position of the key the log is at
        self.changed_at: int | None = None  # the record that moved the log to it
        self.pinned, self.pinned_at = 0, -1  # the newest roster version the log pinned, and where

    def check(self, record: AuditRecord, following: bytes | None) -> str:
        """Why ``record`` (its signature verified) was not the party's to sign then ("" when it was)."""
        if record.kind == ROSTER_PINNED:
            version = self.history.versions.get(str(record.body.get("roster")))
            if version is not None and version > self.pinned:
                self.pinned, self.pinned_at = version, record.index
        if record.key in self.overrides or record.key not in self.position:
            return ""
        party, position = self.history.party, self.position[record.key]
        key = self.history.keys[position]
        if key.revoked_in is not None and self.pinned >= key.revoked_in:
            return (
                f"it is signed by {record.key}, a key of {party} that roster version {key.revoked_in} "
                f"revoked or rotated away, after record {self.pinned_at} pinned roster version "
                f"{self.pinned}: a revoked key signs nothing after its revocation (a leaked key's records, "
                "or a node still using it)"
            )
        if self.at is None or position == self.at:
            self.at = position
            return ""
        current = self.history.keys[self.at].fingerprint
        if position < self.at:
            return (
                f"it is signed by {record.key}, {party}'s key before the change to {current} at record "
                f"{self.changed_at}: a key rotated away signs nothing after the change"
            )
        change = record
        if record.kind == REPAIRED and following is not None:
            try:
                change = AuditRecord.from_line(following)
            except (ValueError, UnicodeDecodeError):
                change = record
        if (
            change.kind == KEY_CHANGED
            and change.key == record.key
            and change.body.get("from") == current
            and change.body.get("to") == record.key
        ):
            self.at, self.changed_at = position, change.index
            return ""
        return (
            f"it is signed by {record.key}, a later key of {party}, but the log has not recorded the change "
            f"to it (a {KEY_CHANGED} record from {current}, signed by the new key)"
        )


def _check(line: bytes, index: int, prev: str, keys: Mapping[str, Ed25519PublicKey], hint: str = "") -> str:
    """Why the line fails as record ``index`` after ``prev`` ("" when it verifies)."""
    try:
        record = AuditRecord.from_line(line)
    except (ValueError, UnicodeDecodeError) as exc:
        return f"not an audit record ({exc})"
    if record.index != index:
        return (
            f"it says index {record.index}, expected {index}: a record before it was deleted or inserted, or "
            "the records were reordered"
        )
    if record.prev != prev:
        return (
            "its prev is not the SHA-256 of the record before it: the record before it was changed, deleted "
            "or moved"
        )
    key = keys.get(record.key)
    if key is None:
        return f"it is signed by {record.key}, not by the key(s) given ({', '.join(sorted(keys))}){hint}"
    try:
        key.verify(bytes.fromhex(record.signature), record.signed_bytes())
    except (InvalidSignature, ValueError):
        return "its signature does not verify: the record was changed after it was signed"
    return ""


def summary(record: AuditRecord) -> str:
    """One line for a person: the body's fields, lists shortened to their length."""
    parts = []
    for name, value in record.body.items():
        if isinstance(value, list):
            value = ",".join(map(str, value)) if len(value) <= 6 else f"[{len(value)}]"
        elif isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
            value = value[:16] + "..."
        parts.append(f"{name}={value}")
    return " ".join(parts)


def verify_with(
    path: Path, *, roster_path: Path | None = None, party: str | None = None, public_keys: Iterable[str] = ()
) -> Verification:
    """:func:`verify_log` against ``party``'s keys in the roster (an institution or the coordinator;
    default: the one party of the log the roster versions list): its key there and, through the
    versions kept beside it (:func:`key_history`), every key it had before, each for its own records;
    and any base64 ``public_keys`` given (accepted on every record: an override)."""
    keys = [public_key_of(text) for text in public_keys]
    if not path.is_file():
        raise AuditLogError(
            f"{path}: no audit log here (the party has recorded nothing yet, or the path is wrong)"
        )
    history = None
    if roster_path is not None:
        chain = roster_chain(roster_path)
        listed = {cid for _, roster in chain for cid in _party_keys(roster)}
        if party is None:
            named = {r.party for r in read_log(path).records() if r is not None} & listed
            if len(named) != 1:
                raise AuditLogError(
                    f"{path}: the log's records name {sorted(named) or 'no party'} of the roster "
                    f"{roster_path}: give --party ID"
                )
            party = named.pop()
        if party not in listed:
            current = sorted(_party_keys(chain[-1][1]))
            raise AuditLogError(f"{roster_path}: the roster has no {party!r} (ids: {current})")
        history = key_history(chain, party)
    return verify_log(path, keys, history)


def _party_keys(roster: Any) -> dict[str, bytes]:
    members = {entry.client_id: entry.public_key for entry in roster}
    if roster.coordinator is not None:
        members[roster.coordinator.client_id] = roster.coordinator.public_key
    return members


def roster_chain(roster_path: Path) -> list[tuple[Path, Any]]:
    """The roster at ``roster_path`` and the earlier versions kept beside it as ``STEM.vN.SUFFIX``
    (what ``keys roster update`` keeps), oldest first: down from its version until a file is missing.
    Each earlier file must be the version the next one names by digest and be followed by it under the
    succession rules (:func:`~secure_afl.keys.lifecycle.check_successor`), else
    :class:`AuditLogError`: a file kept beside the roster that is not its predecessor."""
    from .lifecycle import check_successor
    from .roster import RosterError
    from .store import KeyStoreError, load_roster_file

    def load(file: Path) -> Any:
        try:
            return load_roster_file(file)
        except KeyStoreError as exc:
            raise AuditLogError(str(exc)) from None

    chain = [(roster_path, load(roster_path))]
    for version in range(chain[0][1].version - 1, 0, -1):
        file = roster_path.with_name(f"{roster_path.stem}.v{version}{roster_path.suffix}")
        if not file.is_file():
            break
        earlier = load(file)
        try:
            check_successor(earlier, chain[0][1])
        except RosterError as exc:
            raise AuditLogError(
                f"{file} is not the roster version {chain[0][0]} follows, so it vouches for no key: {exc}. "
                "Put back the file `keys roster update` kept, or move it away"
            ) from None
        chain.insert(0, (file, earlier))
    return chain


def key_history(chain: list[tuple[Path, Any]], party: str) -> KeyHistory:
    """``party``'s keys over the roster versions ``chain`` (:func:`roster_chain`, oldest first)."""
    keys: list[PartyKey] = []
    for _, roster in chain:
        public = _party_keys(roster).get(party)
        if public is not None and all(k.public_key != public for k in keys):
            keys.append(PartyKey(public, roster.version))
    out = []
    for key in keys:
        revoked = next((r.version for _, r in chain if key.fingerprint in r.revoked), None)
        out.append(PartyKey(key.public_key, key.since, revoked))
    versions = {roster.fingerprint: roster.version for _, roster in chain}
    return KeyHistory(party, tuple(out), versions, tuple(str(file) for file, _ in chain))
