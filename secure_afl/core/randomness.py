"""Injected randomness: the protocol never touches global random state.

``OsRandomSource`` (``os.urandom``) is the default everywhere.  ``DeterministicRandomSource`` exists
for reproducible tests only: it is a ChaCha20 keystream from ``cryptography`` keyed by the seed, so
it is a cryptographic PRG, but anyone who knows the seed knows every key it produced.
"""

from __future__ import annotations

import os
from typing import Protocol, runtime_checkable

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

_SEED_DOMAIN = b"secure-afl/v1/deterministic-random-source"


@runtime_checkable
class RandomSource(Protocol):
    """A source of uniformly random bytes."""

    def token_bytes(self, n: int) -> bytes: ...


class OsRandomSource:
    """The operating system's CSPRNG (``os.urandom``)."""

    def token_bytes(self, n: int) -> bytes:
        if n < 0:
            raise ValueError("n must be non-negative")
        return os.urandom(n)


class DeterministicRandomSource:
    """A seeded ChaCha20 keystream, for tests: the same seed gives the same bytes."""

    def __init__(self, seed: bytes) -> None:
        if not isinstance(seed, bytes | bytearray):
            raise TypeError("seed must be bytes")
        key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_SEED_DOMAIN).derive(bytes(seed))
        # The keystream's position advances with every call, so successive calls never repeat.
        self._encryptor = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()

    def token_bytes(self, n: int) -> bytes:
        if n < 0:
            raise ValueError("n must be non-negative")
        return self._encryptor.update(bytes(n))


def default_random(random: RandomSource | None) -> RandomSource:
    """``random`` when given, else a fresh :class:`OsRandomSource`."""
    return OsRandomSource() if random is None else random
