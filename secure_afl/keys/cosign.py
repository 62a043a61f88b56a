"""Roster co-signatures: every institution signs the exact roster it takes part in.

Each institution signs ``CONTEXT || roster.digest()`` with its identity key (Ed25519).  The roster
digest covers every entry's id, name and key and the coordinator's entry, in id order, so one
co-signature says "I have seen this roster: these n institutions, these keys, this coordinator".
The co-signatures travel inside the roster file, beside its entries::

    {"format": "secure-afl-roster/v1", "clients": [...], "coordinator": {...},
     "cosignatures": {"hospital-a": "<base64 Ed25519 signature>", ...}}

They do not enter the roster's digest or fingerprint (which is what they sign), and any change to
the roster (``keys roster add`` / ``remove``) drops them: the new roster must be signed again.

A node accepts its roster only when **every** institution's entry carries a valid co-signature by
that entry's own key (:func:`load_cosigned_roster`, called where the node loads its roster,
``secure_afl.deploy.client._roster``).  What this buys and what it does not:

- Every member has signed the same exact roster (n and every key): the coordinator cannot add an
  entry with a key it does not hold, cannot show members different rosters, and cannot change the
  roster after the members signed it (the node refuses any roster not signed by all).
- It does **not** stop an entry that the coordinator made with a fresh key of its own: that entry
  is "co-signed" by the coordinator itself.  Against that, each institution must recognise every
  entry it signs (its id and fingerprint, heard from that institution itself) before it sends its
  co-signature: signing says that it did.
- It costs one signature round trip per institution (the coordinator collects the co-signatures
  and sends the signed roster back to every member) and one more field in the roster file.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from .identity import IdentityKey
from .roster import ROSTER_FORMAT, Roster, RosterError

__all__ = [
    "CONTEXT",
    "COSIGNATURES_FIELD",
    "CosignatureStatus",
    "RosterCosignatureError",
    "RosterNotCosignedError",
    "check_cosignatures",
    "cosigned_roster_json",
    "load_cosigned_roster",
    "message",
    "read_roster_document",
    "require_cosigned",
    "roster_status",
    "sign_roster",
]

CONTEXT = b"secure-afl roster co-signature v1\x00"
COSIGNATURES_FIELD = "cosignatures"
SIGNATURE_BYTES = 64


class RosterCosignatureError(RosterError):
    """A co-signature that does not verify with its entry's key, or that names no roster entry."""


class RosterNotCosignedError(RosterError):
    """A roster some of whose institutions have not co-signed it (the node refuses it)."""


@dataclass(frozen=True)
class CosignatureStatus:
    """Which institutions' co-signatures a roster file holds (every one present has verified)."""

    roster: Roster
    signed: tuple[str, ...]
    missing: tuple[str, ...]

    @property
    def complete(self) -> bool:
        return not self.missing


def message(roster: Roster) -> bytes:
    """What each institution signs: a domain tag and the roster's digest."""
    return CONTEXT + roster.digest()


def sign_roster(roster: Roster, key: IdentityKey) -> tuple[str, bytes]:
    """This institution's co-signature of ``roster``: (its id, the signature).

    Refuses (:class:`RosterError`) a key that is not one of the roster's institutions: only an
    entry's own key can co-sign it.
    """
    for entry in roster:
        if entry.public_key == key.public_key:
            return entry.client_id, key.private_key.sign(message(roster))
    raise RosterError(
        f"this identity key ({key.fingerprint}) is not an institution of the roster "
        f"({roster.fingerprint}); only a roster member can co-sign it"
    )


def check_cosignatures(roster: Roster, cosignatures: Mapping[str, bytes]) -> CosignatureStatus:
    """Verify every co-signature present; report which institutions have not signed yet.

    Raises :class:`RosterCosignatureError` for a signature that does not verify with its entry's
    key (a roster changed after signing, or a forged signature) or one naming no institution.
    """
    unknown = sorted(set(cosignatures) - set(roster.client_ids))
    if unknown:
        raise RosterCosignatureError(
            f"the roster's co-signatures name {unknown}, which are not institutions of this roster: the "
            "roster was changed after it was signed; the coordinator must collect new co-signatures"
        )
    signed = []
    signed_message = message(roster)  # once: the roster's digest hashes every entry
    for entry in roster:
        signature = cosignatures.get(entry.client_id)
        if signature is None:
            continue
        try:
            Ed25519PublicKey.from_public_bytes(entry.public_key).verify(signature, signed_message)
        except InvalidSignature:
            raise RosterCosignatureError(
                f"the co-signature of {entry.client_id!r} does not verify with its key "
                f"({entry.fingerprint}) over this roster ({roster.fingerprint}): the roster was changed "
                f"after {entry.client_id} signed it, or the signature is not {entry.client_id}'s. Do not "
                "use this roster; ask the coordinator for the roster every institution signed"
            ) from None
        signed.append(entry.client_id)
    missing = tuple(cid for cid in roster.client_ids if cid not in cosignatures)
    return CosignatureStatus(roster, tuple(signed), missing)


def require_cosigned(status: CosignatureStatus, source: str) -> Roster:
    """The roster, if every institution co-signed it; else :class:`RosterNotCosignedError`."""
    if status.missing:
        raise RosterNotCosignedError(
            f"{source}: the roster ({status.roster.fingerprint}) is not co-signed by "
            f"{list(status.missing)} (signed by {list(status.signed) or 'nobody'}); a node takes part "
            "only under a roster every institution signed. Each institution signs it (`secure-afl deploy "
            "join KIT` or `secure-afl keys roster sign`), the coordinator collects the signatures "
            "(`secure-afl deploy collect`) and sends the signed roster.json back to every institution"
        )
    return status.roster


def read_roster_document(text: str) -> tuple[Roster, dict[str, bytes]]:
    """The roster and the co-signatures of a roster file's text (signatures are not verified here)."""
    roster = Roster.from_json(text)
    document = json.loads(text)  # Roster.from_json has parsed it: a JSON object
    raw = document.get(COSIGNATURES_FIELD, {})
    if not isinstance(raw, dict):
        raise RosterCosignatureError(
            f"malformed roster: {COSIGNATURES_FIELD!r} must map institution ids to base64 signatures"
        )
    cosignatures = {}
    for client_id, text_signature in raw.items():
        if not isinstance(text_signature, str):
            raise RosterCosignatureError(
                f"malformed roster: the co-signature of {client_id!r} is not a string"
            )
        try:
            signature = base64.b64decode(text_signature, validate=True)
        except (binascii.Error, ValueError):
            raise RosterCosignatureError(
                f"malformed roster: the co-signature of {client_id!r} is not base64"
            ) from None
        if len(signature) != SIGNATURE_BYTES:
            raise RosterCosignatureError(
                f"malformed roster: the co-signature of {client_id!r} has {len(signature)} bytes, an "
                f"Ed25519 signature {SIGNATURE_BYTES}"
            )
        cosignatures[str(client_id)] = signature
    return roster, cosignatures


def roster_status(text: str) -> CosignatureStatus:
    """Parse a roster file's text and verify its co-signatures (missing ones are reported)."""
    roster, cosignatures = read_roster_document(text)
    return check_cosignatures(roster, cosignatures)


def load_cosigned_roster(path: Path) -> Roster:
    """The roster at ``path`` if every institution co-signed it: what a node takes part under.

    Raises ``OSError`` for an unreadable file, :class:`RosterError` for a malformed roster,
    :class:`RosterCosignatureError` for a co-signature that does not verify and
    :class:`RosterNotCosignedError` when an institution's co-signature is missing.
    """
    return require_cosigned(roster_status(path.read_text(encoding="utf-8")), str(path))


def cosigned_roster_json(roster: Roster, cosignatures: Mapping[str, bytes]) -> str:
    """The roster file's text with these co-signatures (each verified first, in roster order)."""
    status = check_cosignatures(roster, cosignatures)
    document = json.loads(roster.to_json())
    assert document["format"] == ROSTER_FORMAT
    document[COSIGNATURES_FIELD] = {
        cid: base64.b64encode(cosignatures[cid]).decode("ascii") for cid in status.signed
    }
    return json.dumps(document, indent=2)
