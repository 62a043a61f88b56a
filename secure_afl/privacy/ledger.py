"""The client's ledger: which values it released, and which message it answered in each round.

Two rules a client keeps across sessions and across restarts (SECURITY.md, "One contribution per
value, one answer per round"):

- **One contribution per image** (where a release names its images: the deployment's always do).
  Each session that released something keeps the images it released, as sorted distinct 32-byte
  SHA-256 digests of the image files (:attr:`SessionEntry.images`; 3.2 MB at 100,000 images, 4.3 MB
  in the file as base64, under the same signature), their further names (:attr:`SessionEntry.aliases`:
  decoded pixels, DICOM SOP Instance UID; :func:`~secure_afl.privacy.release.image_keys`), and what
  it released them under (the study's digest and round).  A later session over any of them (an
  image matches when any of its names does), under any study, backbone, layout or
  protection, is refused (:class:`~secure_afl.core.errors.ImageAlreadyReleasedError`, with the
  number of such rows and the earlier session), except round 2 of the same study, which may use
  its round 1's images once (:meth:`LedgerState.released_images`).
- **One contribution per value.**  A value (by content, :mod:`secure_afl.privacy.release`) is
  released in at most one completed session: the session in which the client signed the survivor
  set (masking R3) or uploaded its ciphertexts (CKKS R2).  A later session asking for a released
  value, a part of one, or a statistic of a released source is refused in R0, before any key leaves
  the client.  A session that ends before that point spends nothing.
- **One answer per round.**  Before a client replies to a round of a session it records the digest
  of the message it answers; a different message for that round (a forked or rebuilt client state
  shown two survivor sets) is refused, and so is a second survivor set for one session id.

Two stores, one interface (:class:`Ledger`): :class:`MemoryLedger` (the simulator's, tests) and
:class:`FileLedger`: one signed JSON file per client, updated under an exclusive lock (load, check,
change, write to a temporary file, fsync, rename, fsync the directory; mode 0600), **signed with the
client's Ed25519 identity key**, so that a file modified outside secure-afl is refused
(:class:`LedgerTamperedError`).  Beside it a generation marker: a ledger that was used and is now
missing, or older than the last one written (restored from a backup), is refused
(:class:`LedgerMissingError`) until an operator resets it explicitly (:meth:`FileLedger.reset`,
``secure-afl keys ledger reset``), which archives the old file and logs the reset.

Key rotation (``secure-afl keys rotate --ledger-dir``): :meth:`FileLedger.rotate` loads the ledger
with the old key, appends the rotation statement (the old key's signature of the new public key,
:class:`~secure_afl.keys.rotation.KeyRotation`) to the ledger's ``rotations`` and writes it signed by
the new key, one generation on: every session, release and DP spend is kept, the old key no longer
opens it, and a load checks the chain of statements ends at the key that signed the file.

Hygiene: a session's record holds only what the rules need (the ids of the values this client
sends, their anchors, the survivor set it signed, one digest per round answered) and is capped at
:data:`MAX_SESSION_RECORD_BYTES`; sessions that released nothing are kept for their answers, at most
:data:`MAX_OPEN_SESSIONS` of them (the oldest go first).  A change that would take the ledger past
its cap refuses that session (:class:`LedgerFullError`) and leaves the file as it was.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import itertools
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from secure_afl.core.errors import (
    LedgerFullError,
    LedgerMissingError,
    LedgerTamperedError,
    LedgerUnreadableError,
)
from secure_afl.keys.identity import IdentityKey
from secure_afl.keys.rotation import KeyRotation, KeyRotationError
from secure_afl.privacy.release import IMAGE_DIGEST_BYTES, split_digests

FORMAT = "secure-afl-ledger/v2"
_SIGNATURE_DOMAIN = b"secure-afl/v2/client-ledger\x00"
MAX_LEDGER_BYTES = 64 << 20  # refuse to parse anything larger
MAX_SESSION_RECORD_BYTES = 256 << 10  # one session's record: a 100-class DP layout needs about 30 KB
MAX_OPEN_SESSIONS = 64  # sessions that released nothing, kept for their one-answer records

__all__ = [
    "FileLedger",
    "Ledger",
    "LedgerOwner",
    "LedgerState",
    "MemoryLedger",
    "SessionEntry",
]


@dataclass(frozen=True)
class LedgerOwner:
    """The client whose ledger it is, and the identity key that signs it."""

    client_id: str
    identity: IdentityKey


@dataclass
class SessionEntry:
    """What one session holds in the ledger."""

    answers: dict[str, str] = field(default_factory=dict)  # round -> hex SHA-256 of the message answered
    survivors: tuple[str, ...] | None = None  # the survivor set signed (the release point), if reached
    released: tuple[str, ...] = ()  # value and source ids spent in it
    anchors: tuple[str, ...] = ()  # prefix/suffix anchors of those values
    # One contribution per image: the images released in it, sorted distinct 32-byte SHA-256
    # digests concatenated (32 bytes an image: 3.2 MB at 100,000 images, 4.3 MB as base64 in the
    # file), and what they were released under ("study:<digest>/round:<r>").
    images: bytes = b""
    scope: str = ""
    spend: str = ""  # under DP, what the release spent here (a NodeSpend's canonical JSON)
    # The released images' further names (decoded pixels, SOP Instance UIDs: release.image_keys),
    # sorted distinct 32-byte keys concatenated (64 bytes an image more; absent in older ledgers).
    aliases: bytes = b""
    # The feature file's rows the release left out, with their reasons (release.RowSelection.record:
    # JSON, at most WITHHELD_LISTED rows listed, counts for all; "" when none), for the DPO.
    withheld: str = ""

    def to_json(self, *, with_images: bool = True) -> dict:
        out = {
            "answers": dict(sorted(self.answers.items())),
            "survivors": None if self.survivors is None else list(self.survivors),
            "released": list(self.released),
            "anchors": list(self.anchors),
        }
        if self.images or self.scope:  # a ledger without images keeps the document it had
            out["images"] = base64.b64encode(self.images).decode("ascii") if with_images else ""
            out["scope"] = self.scope
        if self.spend:  # a ledger without DP releases keeps the document it had
            out["spend"] = self.spend
        if self.aliases:  # a ledger written before images had further names keeps its document
            out["aliases"] = base64.b64encode(self.aliases).decode("ascii") if with_images else ""
        if self.withheld:  # a release that withheld no row keeps the document it had
            out["withheld"] = self.withheld
        return out

    @classmethod
    def from_json(cls, item: dict) -> SessionEntry:
        answers = item["answers"]
        if not isinstance(answers, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in answers.items()
        ):
            raise ValueError("answers must map rounds to digests")
        survivors = item["survivors"]
        return cls(
            answers=dict(answers),
            survivors=None if survivors is None else _strings(survivors),
            released=_strings(item["released"]),
            anchors=_strings(item["anchors"]),
            images=_packed_digests(item.get("images", "")),
            scope=str(item.get("scope", "")),
            spend=_string(item.get("spend", "")),
            aliases=_packed_digests(item.get("aliases", "")),
            withheld=_string(item.get("withheld", "")),
        )


@dataclass
class LedgerState:
    """A client's whole ledger: its sessions, oldest first, and a generation counter."""

    sessions: dict[str, SessionEntry] = field(default_factory=dict)  # hex session id -> entry
    generation: int = 0
    rotations: tuple[KeyRotation, ...] = ()  # the owner's key rotations, oldest first (FileLedger.rotate)

    def released_in(self, session_id: bytes) -> tuple[dict[str, str], dict[str, str]]:
        """(id -> session, anchor -> session) over every *other* session that released something."""
        own = session_id.hex()
        ids: dict[str, str] = {}
        anchors: dict[str, str] = {}
        for sid, entry in self.sessions.items():
            if sid == own or entry.survivors is None:
                continue
            ids.update(dict.fromkeys(entry.released, sid))
            anchors.update(dict.fromkeys(entry.anchors, sid))
        return ids, anchors

    def released_images(self, session_id: bytes, *, reuses: str = "") -> dict[bytes, str]:
        """image key (a file digest or a further name) -> session, over every *other* session that
        released images, except those released under ``reuses`` (round 2 of a study may use its
        round 1's images again)."""
        own = session_id.hex()
        out: dict[bytes, str] = {}
        for sid, entry in self.sessions.items():
            if sid == own or entry.survivors is None or not entry.images:
                continue
            if reuses and entry.scope == reuses:
                continue
            out.update(dict.fromkeys(split_digests(entry.images), sid))
            out.update(dict.fromkeys(split_digests(entry.aliases), sid))
        return out

    def entry(self, session_id: bytes) -> SessionEntry:
        return self.sessions.setdefault(session_id.hex(), SessionEntry())

    def copy(self) -> LedgerState:
        return LedgerState(
            {
                sid: SessionEntry(
                    dict(e.answers),
                    e.survivors,
                    e.released,
                    e.anchors,
                    e.images,
                    e.scope,
                    e.spend,
                    e.aliases,
                    e.withheld,
                )
                for sid, e in self.sessions.items()
            },
            self.generation,
            self.rotations,
        )


Change = Callable[[LedgerState], None]


class Ledger(Protocol):
    """Where a client keeps its releases and answers."""

    def load(self, owner: LedgerOwner) -> LedgerState:
        """A snapshot (raises ``LedgerError`` when the ledger cannot be used)."""
        ...

    def update(self, owner: LedgerOwner, change: Change) -> None:
        """Atomically: load, apply ``change`` (it raises to refuse, leaving the ledger unchanged),
        enforce the caps, store."""
        ...


def _session_bytes(entry: SessionEntry) -> int:
    """A session's record without its images (their size is one to three keys an image, bounded by
    the ledger's own cap: about 1.5 million images named by their files alone, 500,000 named by their
    files, pixels and SOP Instance UIDs, in :data:`MAX_LEDGER_BYTES`)."""
    return len(json.dumps(entry.to_json(with_images=False), separators=(",", ":")))


def _apply(state: LedgerState, change: Change, owner: LedgerOwner) -> LedgerState | None:
    """``change`` on a copy of ``state``, with the caps; the new state, or None when unchanged."""
    new = state.copy()
    change(new)
    if new.sessions == state.sessions:
        return None
    for sid, entry in new.sessions.items():
        if state.sessions.get(sid) != entry and _session_bytes(entry) > MAX_SESSION_RECORD_BYTES:
            raise LedgerFullError(
                f"the record of session {sid[:16]}... would exceed {MAX_SESSION_RECORD_BYTES} bytes in "
                f"{owner.client_id}'s ledger: the session is refused (the ledger is unchanged)"
            )
    open_sessions = [sid for sid, e in new.sessions.items() if e.survivors is None]
    for sid in open_sessions[: max(0, len(open_sessions) - MAX_OPEN_SESSIONS)]:
        del new.sessions[sid]  # the oldest sessions that released nothing
    new.generation = state.generation + 1
    return new


class MemoryLedger:
    """An in-memory ledger (the simulator's and tests'; lost when the process ends)."""

    def __init__(self) -> None:
        self._states: dict[str, LedgerState] = {}

    def load(self, owner: LedgerOwner) -> LedgerState:
        return self._states.get(owner.client_id, LedgerState()).copy()

    def update(self, owner: LedgerOwner, change: Change) -> None:
        new = _apply(self._states.get(owner.client_id, LedgerState()), change, owner)
        if new is not None:
            self._states[owner.client_id] = new


class FileLedger:
    """A signed JSON file per client in ``directory`` (created 0700 if missing)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def path(self, client_id: str) -> Path:
        return self.directory / f"{client_id}.ledger.json"

    def marker(self, client_id: str) -> Path:
        """The generation of the last ledger written (a deleted or restored ledger is then noticed)."""
        return self.directory / f"{client_id}.ledger.generation"

    def load(self, owner: LedgerOwner) -> LedgerState:
        return self._load(owner)

    def update(self, owner: LedgerOwner, change: Change) -> None:
        with self._locked(owner):
            state = self._load(owner)
            new = _apply(state, change, owner)
            if new is None:
                return
            self._write(owner, new)

    def reset(self, client_id: str, reason: str) -> Path | None:
        """Start an empty history: archive the ledger (if any) beside it, drop the marker, log it.

        Returns the archive's path.  The operator's decision, never the client's: a reset forgets
        which values were released, so the server may obtain a second sum of them.
        """
        if not reason.strip():
            raise ValueError("a ledger reset needs a reason (it is logged)")
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        archived = None
        path = self.path(client_id)
        if path.exists():
            archived = path.with_name(f"{path.name}.reset-{stamp}")
            os.replace(path, archived)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.marker(client_id))
        line = json.dumps(
            {"time": stamp, "client_id": client_id, "archived": str(archived), "reason": reason}
        )
        with open(self.directory / "ledger-resets.log", "a", encoding="utf-8") as log:
            log.write(line + "\n")
            log.flush()
            os.fsync(log.fileno())
        return archived

    def rotate(self, old: LedgerOwner, new: LedgerOwner, rotation: KeyRotation) -> LedgerState:
        """Move the ledger from the owner's old identity key to its new one, keeping its history.

        ``rotation`` (signed by the old key, naming the new) is verified and recorded in the ledger,
        which is then signed by the new key; a ledger that does not verify with the old key is refused
        as :meth:`load` refuses it.  Returns the state written.
        """
        if not (old.client_id == new.client_id == rotation.client_id):
            raise ValueError(
                f"a rotation moves one owner's ledger: {old.client_id!r}, {new.client_id!r}, "
                f"{rotation.client_id!r} differ"
            )
        if (rotation.old_public_key, rotation.new_public_key) != (
            old.identity.public_key,
            new.identity.public_key,
        ):
            raise ValueError("the rotation statement names other keys than the ledger's old and new keys")
        rotation.verify()
        with self._locked(old):
            state = self._load(old)
            moved = state.copy()
            moved.rotations = (*state.rotations, rotation)
            moved.generation = state.generation + 1
            self._write(new, moved)
        return moved

    # --- file format ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, owner: LedgerOwner) -> Iterator[None]:
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            handle = os.open(self.directory / f"{owner.client_id}.ledger.lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise LedgerUnreadableError(f"cannot open the ledger in {self.directory}: {exc}") from exc
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield
        finally:
            os.close(handle)  # closing releases the lock

    def _marked_generation(self, client_id: str) -> int | None:
        try:
            return int(self.marker(client_id).read_text(encoding="ascii").strip())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise LedgerUnreadableError(
                f"cannot read the ledger marker {self.marker(client_id)}: {exc}"
            ) from exc

    def _load(self, owner: LedgerOwner) -> LedgerState:
        path = self.path(owner.client_id)
        marked = self._marked_generation(owner.client_id)
        reset = (
            f"if you know why, archive it and start an empty history with `secure-afl keys ledger reset "
            f"--ledger-dir {self.directory} --client-id {owner.client_id} --reason ...` (logged; the server "
            f"may then obtain a second sum of values already released)"
        )
        try:
            with open(path, "rb") as handle:
                raw = handle.read(MAX_LEDGER_BYTES + 1)
        except FileNotFoundError:
            if marked is not None:
                raise LedgerMissingError(
                    f"the ledger {path} is missing although generation {marked} was written: restore it "
                    f"from a backup; {reset}"
                ) from None
            return LedgerState()  # first use
        except OSError as exc:
            raise LedgerUnreadableError(f"cannot read the ledger {path}: {exc}") from exc
        if len(raw) > MAX_LEDGER_BYTES:
            raise LedgerUnreadableError(f"the ledger {path} is larger than {MAX_LEDGER_BYTES} bytes")
        try:
            document = json.loads(raw.decode("utf-8"))
            signature = bytes.fromhex(document.pop("signature"))
            if document.get("format") != FORMAT:
                raise ValueError(f"format {document.get('format')!r}, expected {FORMAT!r}")
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise LedgerUnreadableError(
                f"the ledger {path} is not a {FORMAT} file ({exc}); restore it from a backup, or {reset}"
            ) from exc
        if document.get("client_id") != owner.client_id:
            raise LedgerTamperedError(f"the ledger {path} belongs to {document.get('client_id')!r}")
        try:
            Ed25519PublicKey.from_public_bytes(owner.identity.public_key).verify(
                signature, _SIGNATURE_DOMAIN + _canonical(document)
            )
        except InvalidSignature:
            raise LedgerTamperedError(
                f"the ledger {path} is not signed by {owner.client_id!r}'s identity key: it was modified "
                f"outside secure-afl. Restore it from a backup; do not delete it to go on"
            ) from None
        try:
            state = LedgerState(
                {sid: SessionEntry.from_json(item) for sid, item in document["sessions"].items()},
                int(document["generation"]),
                _rotations(document.get("rotations", []), owner),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise LedgerUnreadableError(f"the ledger {path} has a malformed record: {exc}") from exc
        if marked is not None and state.generation < marked:
            raise LedgerMissingError(
                f"the ledger {path} is generation {state.generation}, older than generation {marked} "
                f"written last (restored from an old backup?): restore the newest copy; {reset}"
            )
        return state

    def _write(self, owner: LedgerOwner, state: LedgerState) -> None:
        document = {
            "format": FORMAT,
            "client_id": owner.client_id,
            "public_key": owner.identity.public_key.hex(),
            "generation": state.generation,
            "sessions": {sid: entry.to_json() for sid, entry in state.sessions.items()},
        }
        if state.rotations:  # a ledger whose key never rotated keeps the document it had
            document["rotations"] = [rotation.to_dict() for rotation in state.rotations]
        signature = owner.identity.private_key.sign(_SIGNATURE_DOMAIN + _canonical(document))
        data = json.dumps({**document, "signature": signature.hex()}, indent=1, sort_keys=True).encode()
        if len(data) > MAX_LEDGER_BYTES:
            raise LedgerFullError(
                f"{owner.client_id}'s ledger would exceed {MAX_LEDGER_BYTES} bytes: this session is refused "
                f"(the ledger is unchanged)"
            )
        path = self.path(owner.client_id)
        try:
            _write_atomically(path, data)
            _write_atomically(self.marker(owner.client_id), f"{state.generation}\n".encode())
        except OSError as exc:
            raise LedgerUnreadableError(f"cannot write the ledger {path}: {exc}") from exc


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _rotations(items: object, owner: LedgerOwner) -> tuple[KeyRotation, ...]:
    """The ledger's key rotations, each verified, chained, and ending at the owner's key."""
    if not isinstance(items, list):
        raise ValueError("rotations must be a list")
    try:
        rotations = tuple(KeyRotation.from_dict(item).verify() for item in items)
    except KeyRotationError as exc:
        raise ValueError(str(exc)) from None
    for earlier, later in itertools.pairwise(rotations):
        if earlier.new_public_key != later.old_public_key:
            raise ValueError("the key rotations do not form a chain")
    if rotations and (
        rotations[-1].new_public_key != owner.identity.public_key
        or any(r.client_id != owner.client_id for r in rotations)
    ):
        raise ValueError(f"the key rotations do not end at {owner.client_id}'s key")
    return rotations


def _canonical(document: dict) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _packed_digests(text: object) -> bytes:
    if not isinstance(text, str):
        raise ValueError("images must be base64 text")
    packed = base64.b64decode(text, validate=True)
    if len(packed) % IMAGE_DIGEST_BYTES:  # a whole number of digests (split only where they are read)
        raise ValueError(f"packed image digests must be a multiple of {IMAGE_DIGEST_BYTES} bytes")
    return packed


def _string(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__}")
    return value


def _strings(values: object) -> tuple[str, ...]:
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ValueError("expected a list of strings")
    return tuple(values)
