"""The session ledger: what a client's earlier sessions over the same input revealed.

A server that runs two sessions over the same inputs (one with client c0, one without it) learns
c0's value as the difference of the two sums, although each session alone hides it.  So a client
keeps, per input (a digest of its statistics before any randomisation, see
:func:`~secure_afl.privacy.exposure.input_digest`), the groups and survivor sets of every session in
which it signed a survivor set, and before signing (R3) or revealing (R4) in a new session it runs
the rank test over the old and the new sums together (:func:`~secure_afl.privacy.exposure.client_exposures`).

What a client assumes about its peers: that their inputs did not change between sessions over
*its* input (the conservative assumption; protocol v1 has no way for a peer to sign that its input
is new).  A new input of its own (new data) starts a new history: the assumption is then dropped.

Two stores, one interface (:class:`Ledger`):

- :class:`MemoryLedger`: in memory, for the simulator and tests.
- :class:`FileLedger`: one small JSON file per client in a directory the institution chooses,
  written atomically (temporary file, fsync, rename, fsync of the directory; mode 0600), locked
  during check-and-record so that two sessions of one client cannot both pass the check before
  either is recorded, and **signed with the client's Ed25519 identity key**.  It refuses to load a
  file whose signature does not verify (:class:`LedgerTamperedError`) or that cannot be read or
  parsed (:class:`LedgerUnreadableError`).  A signature rather than a digest chain because whoever
  can write the directory can recompute a chain; a signature rather than an HMAC because an auditor
  can then check the file with the roster's public key alone.

Limits (see SECURITY.md): a missing file is an empty history (first use), so an institution that
deletes its ledger, or restores an older signed copy, loses the protection for the sessions it no
longer lists; the identity key signs the ledger, so whoever holds that key can rewrite it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from secure_afl.keys.identity import IdentityKey
from secure_afl.privacy.exposure import GroupRecord, SessionRecord, input_digest
from secure_afl.protocol.errors import LedgerTamperedError, LedgerUnreadableError

FORMAT = "secure-afl-ledger/v1"
_SIGNATURE_DOMAIN = b"secure-afl/v1/session-ledger\x00"
MAX_LEDGER_BYTES = 64 << 20  # refuse to parse anything larger

Check = Callable[[tuple[SessionRecord, ...]], None]

__all__ = [
    "FileLedger",
    "Ledger",
    "LedgerOwner",
    "MemoryLedger",
    "input_digest",
]


@dataclass(frozen=True)
class LedgerOwner:
    """The client whose history it is, and the identity key that signs it."""

    client_id: str
    identity: IdentityKey


class Ledger(Protocol):
    """Where a client keeps the sessions it took part in, per input digest."""

    def history(self, owner: LedgerOwner, input_digest: bytes) -> tuple[SessionRecord, ...]:
        """Every recorded session over this input (raises ``LedgerError`` when unusable)."""
        ...

    def check_and_record(
        self, owner: LedgerOwner, input_digest: bytes, record: SessionRecord, check: Check
    ) -> None:
        """Atomically: run ``check`` on the history (it raises to refuse), then append ``record``."""
        ...


class MemoryLedger:
    """An in-memory ledger (the simulator's; lost when the process ends)."""

    def __init__(self) -> None:
        self._records: dict[tuple[str, bytes], list[SessionRecord]] = {}

    def history(self, owner: LedgerOwner, input_digest: bytes) -> tuple[SessionRecord, ...]:
        return tuple(self._records.get((owner.client_id, input_digest), ()))

    def check_and_record(
        self, owner: LedgerOwner, input_digest: bytes, record: SessionRecord, check: Check
    ) -> None:
        records = self._records.setdefault((owner.client_id, input_digest), [])
        check(tuple(records))
        if record not in records:
            records.append(record)


class FileLedger:
    """A signed JSON file per client in ``directory`` (created 0700 if missing)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def path(self, client_id: str) -> Path:
        return self.directory / f"{client_id}.ledger.json"

    def history(self, owner: LedgerOwner, input_digest: bytes) -> tuple[SessionRecord, ...]:
        return tuple(self._load(owner).get(input_digest.hex(), ()))

    def check_and_record(
        self, owner: LedgerOwner, input_digest: bytes, record: SessionRecord, check: Check
    ) -> None:
        with self._locked(owner):
            inputs = self._load(owner)
            records = inputs.setdefault(input_digest.hex(), [])
            check(tuple(records))
            if record not in records:
                records.append(record)
                self._write(owner, inputs)

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

    def _load(self, owner: LedgerOwner) -> dict[str, list[SessionRecord]]:
        path = self.path(owner.client_id)
        try:
            with open(path, "rb") as handle:
                raw = handle.read(MAX_LEDGER_BYTES + 1)
        except FileNotFoundError:
            return {}  # first use (or a deleted ledger: SECURITY.md says what that costs)
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
                f"the ledger {path} is not a {FORMAT} file ({exc}); restore it from a backup or move it "
                f"away to start an empty history (which gives up the protection of the sessions it lists)"
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
            return {
                digest: [_record_from_json(item) for item in items]
                for digest, items in document["inputs"].items()
            }
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise LedgerUnreadableError(f"the ledger {path} has a malformed record: {exc}") from exc

    def _write(self, owner: LedgerOwner, inputs: dict[str, list[SessionRecord]]) -> None:
        document = {
            "format": FORMAT,
            "client_id": owner.client_id,
            "public_key": owner.identity.public_key.hex(),
            "inputs": {digest: [_record_to_json(r) for r in records] for digest, records in inputs.items()},
        }
        signature = owner.identity.private_key.sign(_SIGNATURE_DOMAIN + _canonical(document))
        data = json.dumps({**document, "signature": signature.hex()}, indent=1, sort_keys=True).encode()
        path = self.path(owner.client_id)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
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
            directory = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        except OSError as exc:
            raise LedgerUnreadableError(f"cannot write the ledger {path}: {exc}") from exc


def _canonical(document: dict) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _record_to_json(record: SessionRecord) -> dict:
    return {
        "session_id": record.session_id.hex(),
        "groups": [
            {"name": g.name, "survivors": list(g.survivors), "tensors": list(g.tensors)}
            for g in record.groups
        ],
        "own_values": [list(item) for item in record.own_values],
    }


def _record_from_json(item: dict) -> SessionRecord:
    def strings(values: object) -> tuple[str, ...]:
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise ValueError("expected a list of strings")
        return tuple(values)

    own = item["own_values"]
    if not isinstance(own, list):
        raise ValueError("own_values must be a list")
    return SessionRecord(
        session_id=bytes.fromhex(item["session_id"]),
        groups=tuple(
            GroupRecord(str(g["name"]), strings(g["survivors"]), strings(g["tensors"]))
            for g in item["groups"]
        ),
        own_values=tuple(tuple(strings(v)) for v in own),  # type: ignore[misc]
    )
