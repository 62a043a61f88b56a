"""Roster versions: how a running federation moves from one co-signed roster to the next.

A node pins one co-signed roster (its node config's ``roster`` file).  It moves to another only through
:func:`accept_successor` (``secure-afl keys roster update``), which refuses, listing every problem:

- a next roster not co-signed by **every** member of the next roster (:class:`RosterNotCosignedError`);
- a version that is not the pinned version + 1, or a predecessor digest that is not the pinned roster's
  (no rollback, no fork: :class:`RosterSuccessionError`);
- a revocation dropped (the revoked list only grows), or an entry that holds a revoked key;
- a key changed without a rotation statement signed by the pinned key
  (:class:`~secure_afl.keys.rotation.KeyRotation`) and without the old key revoked, a statement that
  does not verify, or one whose old key is not the pinned key or whose new key is not the entry's;
- a newcomer (or a key replaced after a revocation, or a new coordinator) that this member did not
  recognise (``--expect ID=FINGERPRINT`` as ``deploy join`` takes it: :class:`RosterNotRecognisedError`).

Once accepted, the next roster replaces the pinned file atomically and, with a ledger directory, the
pin record ``LEDGER_DIR/roster-pin.json`` (version and digest) is written: from then on the node
refuses any other roster at its path (:func:`check_pin`, :class:`RosterNotPinnedError`), so an older
roster copied back or a fork is refused by the node itself.  The ledger and the DP budget are the
node's, keyed by its id: a new roster version starts no fresh budget.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from .cosign import require_cosigned, roster_status
from .recognition import Recognition
from .roster import Roster, RosterEntry, RosterError
from .rotation import KeyRotationError

__all__ = [
    "PIN_FILE",
    "KeyRevokedError",
    "RosterNotPinnedError",
    "RosterSuccessionError",
    "Succession",
    "accept_successor",
    "check_not_revoked",
    "check_pin",
    "check_successor",
    "next_version",
    "write_pin",
]

PIN_FILE = "roster-pin.json"
PIN_FORMAT = "secure-afl-roster-pin/v1"


class RosterSuccessionError(RosterError):
    """A roster that does not follow the pinned one (version, predecessor, revocations, rotations)."""


class RosterNotPinnedError(RosterError):
    """A node's roster file that is not the roster it pinned last (rolled back, forked or copied by hand)."""


class KeyRevokedError(RosterError):
    """A key the roster lists as revoked or rotated away: it cannot start, sign or answer a session."""


@dataclass(frozen=True)
class Succession:
    """What changes from the pinned roster to the next."""

    pinned: Roster
    next: Roster
    added: tuple[str, ...]
    removed: tuple[str, ...]
    rotated: tuple[str, ...]  # keys changed by a verified rotation statement
    replaced: tuple[str, ...]  # keys changed after the old key's revocation (recognised like newcomers)
    revoked: tuple[str, ...]  # fingerprints revoked by this version

    @property
    def to_recognise(self) -> tuple[str, ...]:
        """The ids whose key no member has seen in a roster before (the coordinator's id included)."""
        return (*self.added, *self.replaced)

    def describe(self) -> list[str]:
        lines = [f"version {self.pinned.version} -> {self.next.version}"]
        for what, ids in (
            ("added", self.added),
            ("removed", self.removed),
            ("key rotated (statement signed by the old key)", self.rotated),
            ("key replaced after revocation", self.replaced),
            ("revoked", self.revoked),
        ):
            if ids:
                lines.append(f"{what}: {', '.join(ids)}")
        return lines


def next_version(pinned: Roster) -> Roster:
    """An unsigned draft of the next version: the same entries, version + 1, ``previous`` the pinned
    roster's digest, the revocations kept and no rotation statement yet."""
    return pinned.replace(version=pinned.version + 1, previous=pinned.digest(), rotations=())


def _members(roster: Roster) -> dict[str, RosterEntry]:
    members = {entry.client_id: entry for entry in roster}
    if roster.coordinator is not None:
        members[roster.coordinator.client_id] = roster.coordinator
    return members


def check_successor(pinned: Roster, following: Roster) -> Succession:
    """What changes from ``pinned`` to ``following`` if ``following`` may replace it; else
    :class:`RosterSuccessionError` listing every problem (co-signatures are checked by the caller)."""
    problems = []
    if following.version != pinned.version + 1:
        problems.append(
            f"the new roster is version {following.version}, the pinned one {pinned.version}: a node moves "
            f"only to version {pinned.version + 1} (an older or equal version is a rollback or a fork)"
        )
    if following.previous != pinned.digest():
        named = "none" if following.previous is None else following.previous.hex()[:16] + "..."
        problems.append(
            f"the new roster names the predecessor {named}, the pinned roster is "
            f"{pinned.digest().hex()[:16]}... ({pinned.fingerprint}): it was made from another roster"
        )
    dropped = sorted(set(pinned.revoked) - set(following.revoked))
    if dropped:
        problems.append(f"the new roster drops the revocation of {dropped}: a revocation is never undone")
    old, new = _members(pinned), _members(following)
    rotations = {}
    for rotation in following.rotations:
        try:
            rotation.verify()
        except KeyRotationError as exc:
            problems.append(str(exc))
            continue
        cid = rotation.client_id
        if cid not in old or old[cid].public_key != rotation.old_public_key:
            problems.append(f"the rotation of {cid!r} is signed by a key that is not {cid}'s pinned key")
        elif cid not in new or new[cid].public_key != rotation.new_public_key:
            problems.append(f"the rotation of {cid!r} names a key that is not {cid}'s in the new roster")
        elif rotation.old_fingerprint not in following.revoked:
            problems.append(
                f"the rotation of {cid!r} leaves its old key {rotation.old_fingerprint} unrevoked"
            )
        else:
            rotations[cid] = rotation
    rotated, replaced = [], []
    for cid in sorted(set(old) & set(new)):
        if old[cid].public_key == new[cid].public_key:
            continue
        if cid in rotations:
            rotated.append(cid)
        elif old[cid].fingerprint in following.revoked:
            replaced.append(cid)
        else:
            problems.append(
                f"{cid!r} has another key ({new[cid].fingerprint}) with neither a rotation statement signed "
                f"by its pinned key ({old[cid].fingerprint}) nor that key's revocation"
            )
    if problems:
        raise RosterSuccessionError(
            f"the new roster ({following.fingerprint}) does not follow the pinned roster "
            f"({pinned.fingerprint}, version {pinned.version}):\n  " + "\n  ".join(problems)
        )
    return Succession(
        pinned=pinned,
        next=following,
        added=tuple(sorted(set(new) - set(old))),
        removed=tuple(sorted(set(old) - set(new))),
        rotated=tuple(rotated),
        replaced=tuple(replaced),
        revoked=tuple(sorted(set(following.revoked) - set(pinned.revoked))),
    )


def accept_successor(
    pinned_text: str,
    next_text: str,
    recognition: Recognition,
    *,
    own_id: str | None = None,
    what: str = "the new roster",
) -> Succession:
    """Check that ``next_text`` may replace the pinned roster ``pinned_text`` (both roster files'
    text): both co-signed by every member, the succession rules, and every newcomer recognised.
    ``own_id``: this institution (its own entry is verified by its key, not by a fingerprint)."""
    pinned = require_cosigned(roster_status(pinned_text), "the pinned roster")
    following = require_cosigned(roster_status(next_text), what)
    succession = check_successor(pinned, following)
    members = _members(following)
    if succession.to_recognise or recognition.expected is not None:
        known = [cid for cid in members if cid not in succession.to_recognise]
        if own_id is not None:
            known.append(own_id)
        recognition.verify(list(members.values()), known=known, what=f"{what} {following.fingerprint}")
    return succession


def check_not_revoked(roster: Roster, key_fingerprint: str) -> None:
    """Refuse (:class:`KeyRevokedError`) a key the roster lists as revoked or rotated away."""
    if key_fingerprint in roster.revoked:
        raise KeyRevokedError(
            f"the key {key_fingerprint} is revoked or rotated away in the roster (version {roster.version}, "
            f"{roster.fingerprint}): it cannot start, sign or answer a session. Use this institution's "
            "current key (the node config's identity-key), or get a new one into the roster (secure-afl "
            "keys init, then a new roster version co-signed by every member)"
        )


# --- the node's pin ------------------------------------------------------------------------------


def write_pin(ledger_dir: Path, roster: Roster) -> Path:
    """Record, in the node's ledger directory, the roster version it moved to (atomically, 0600)."""
    ledger_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = ledger_dir / PIN_FILE
    text = json.dumps({"format": PIN_FORMAT, "version": roster.version, "digest": roster.digest().hex()})
    temporary = ledger_dir / f".{PIN_FILE}.{secrets.token_hex(6)}.tmp"
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "w", encoding="ascii") as handle:
            handle.write(text + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()
    return path


def check_pin(roster: Roster, ledger_dir: Path, roster_path: Path) -> None:
    """Refuse a roster other than the one ``keys roster update`` pinned last (no record: nothing to
    check, the node has kept its first roster)."""
    path = ledger_dir / PIN_FILE
    try:
        document = json.loads(path.read_text(encoding="ascii"))
    except (FileNotFoundError, NotADirectoryError):  # no pin there: a ledger-dir that is a file is
        return  # the ledger's own error to name (ConfigurationError), not a roster's
    except (OSError, ValueError) as exc:
        raise RosterNotPinnedError(f"{path}: cannot read the roster pin: {exc}") from None
    if not isinstance(document, dict) or document.get("format") != PIN_FORMAT:
        raise RosterNotPinnedError(f"{path}: not a {PIN_FORMAT} file")
    if document.get("digest") == roster.digest().hex():
        return
    older = isinstance(document.get("version"), int) and roster.version <= document["version"]
    raise RosterNotPinnedError(
        f"{roster_path} is roster version {roster.version} ({roster.fingerprint}), but this node moved to "
        f"version {document.get('version')} (digest {str(document.get('digest'))[:16]}...)"
        + (": an older roster or a fork is refused" if older else "")
        + "; a node changes its roster only with `secure-afl keys roster update --roster ROSTER --new FILE "
        "--ledger-dir LEDGER_DIR`"
    )
