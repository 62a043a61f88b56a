"""Ed25519 identity keys and their fingerprints."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

if TYPE_CHECKING:
    from secure_afl.core.randomness import RandomSource

PUBLIC_KEY_BYTES = 32


def fingerprint(public_key: bytes) -> str:
    """SHA-256 of the raw Ed25519 public key, hex in groups of four: ``SHA256:ab12 cd34 ...``."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise ValueError(f"an Ed25519 public key has {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    digest = hashlib.sha256(public_key).hexdigest()
    return "SHA256:" + " ".join(digest[i : i + 4] for i in range(0, len(digest), 4))


@dataclass(frozen=True, slots=True)
class IdentityKey:
    """An institution's long-term Ed25519 signing key."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls, random: RandomSource | None = None) -> IdentityKey:
        seed = os.urandom(32) if random is None else random.token_bytes(32)
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @property
    def public_key(self) -> bytes:
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public_key)

    def __repr__(self) -> str:  # never print key material
        return f"IdentityKey({self.fingerprint})"
