"""A key rotation statement: an institution's old identity key signs its new public key.

The old key signs ``CONTEXT || len(id) || id || old public key || new public key`` (Ed25519), a
domain of its own, so no other signature of the key (a roster co-signature, a ledger, a protocol
message) can be taken for one.  The statement alone changes nothing: peers take the new key only
from a co-signed roster version that carries the statement (:mod:`secure_afl.keys.lifecycle`).
``secure-afl keys rotate`` writes it as ``DIR/rotation.json``::

    {"format": "secure-afl-key-rotation/v1", "id": "hospital-a",
     "old_public_key": b64, "new_public_key": b64, "old_fingerprint": ..., "new_fingerprint": ...,
     "signature": b64}
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from .identity import PUBLIC_KEY_BYTES, IdentityKey, fingerprint

__all__ = ["CONTEXT", "ROTATION_FORMAT", "KeyRotation", "KeyRotationError"]

CONTEXT = b"secure-afl key rotation v1\x00"
ROTATION_FORMAT = "secure-afl-key-rotation/v1"
SIGNATURE_BYTES = 64


class KeyRotationError(ValueError):
    """A rotation statement that is malformed or whose signature does not verify with the old key."""


@dataclass(frozen=True, slots=True)
class KeyRotation:
    """``client_id``'s old key vouches for its new one (``signature``: by the old key)."""

    client_id: str
    old_public_key: bytes
    new_public_key: bytes
    signature: bytes

    def __post_init__(self) -> None:
        for name in ("old_public_key", "new_public_key"):
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) != PUBLIC_KEY_BYTES:
                raise KeyRotationError(f"{self.client_id!r}: {name} must have {PUBLIC_KEY_BYTES} bytes")
        if self.old_public_key == self.new_public_key:
            raise KeyRotationError(f"{self.client_id!r}: the new key is the old key: nothing to rotate")
        if not isinstance(self.signature, bytes) or len(self.signature) != SIGNATURE_BYTES:
            raise KeyRotationError(f"{self.client_id!r}: the signature must have {SIGNATURE_BYTES} bytes")

    @staticmethod
    def message(client_id: str, old_public_key: bytes, new_public_key: bytes) -> bytes:
        ident = client_id.encode("utf-8")
        return CONTEXT + len(ident).to_bytes(4, "big") + ident + old_public_key + new_public_key

    @classmethod
    def make(cls, client_id: str, old_key: IdentityKey, new_public_key: bytes) -> KeyRotation:
        signature = old_key.private_key.sign(cls.message(client_id, old_key.public_key, new_public_key))
        return cls(client_id, old_key.public_key, new_public_key, signature)

    @property
    def old_fingerprint(self) -> str:
        return fingerprint(self.old_public_key)

    @property
    def new_fingerprint(self) -> str:
        return fingerprint(self.new_public_key)

    def verify(self) -> KeyRotation:
        """This statement, if the old key signed it (else :class:`KeyRotationError`)."""
        try:
            Ed25519PublicKey.from_public_bytes(self.old_public_key).verify(
                self.signature, self.message(self.client_id, self.old_public_key, self.new_public_key)
            )
        except InvalidSignature:
            raise KeyRotationError(
                f"the rotation of {self.client_id!r} to {self.new_fingerprint} is not signed by its old key "
                f"({self.old_fingerprint}): refuse it; ask {self.client_id} for the statement its "
                "`secure-afl keys rotate` wrote"
            ) from None
        return self

    def to_dict(self) -> dict[str, str]:
        return {
            "id": self.client_id,
            "old_public_key": base64.b64encode(self.old_public_key).decode("ascii"),
            "new_public_key": base64.b64encode(self.new_public_key).decode("ascii"),
            "old_fingerprint": self.old_fingerprint,
            "new_fingerprint": self.new_fingerprint,
            "signature": base64.b64encode(self.signature).decode("ascii"),
        }

    @classmethod
    def from_dict(cls, item: object) -> KeyRotation:
        if not isinstance(item, dict):
            raise KeyRotationError("a rotation statement must be a JSON object")
        try:
            fields = {name: item[name] for name in ("id", "old_public_key", "new_public_key", "signature")}
            if not all(isinstance(value, str) for value in fields.values()):
                raise TypeError("every field must be a string")
            rotation = cls(
                fields["id"],
                base64.b64decode(fields["old_public_key"], validate=True),
                base64.b64decode(fields["new_public_key"], validate=True),
                base64.b64decode(fields["signature"], validate=True),
            )
        except (KeyError, TypeError, binascii.Error, ValueError) as exc:
            if isinstance(exc, KeyRotationError):
                raise
            raise KeyRotationError(f"malformed rotation statement: {exc}") from None
        for name, value in (
            ("old_fingerprint", rotation.old_fingerprint),
            ("new_fingerprint", rotation.new_fingerprint),
        ):
            if name in item and item[name] != value:
                raise KeyRotationError(f"rotation of {rotation.client_id!r}: {name} does not match its key")
        return rotation

    def to_json(self) -> str:
        return json.dumps({"format": ROTATION_FORMAT, **self.to_dict()}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> KeyRotation:
        try:
            document = json.loads(text)
        except ValueError:
            raise KeyRotationError(f"not a {ROTATION_FORMAT} file (not JSON)") from None
        if not isinstance(document, dict) or document.get("format") != ROTATION_FORMAT:
            raise KeyRotationError(f"not a {ROTATION_FORMAT} file")
        return cls.from_dict(document)
