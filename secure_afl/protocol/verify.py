"""A checked sum of every survivor's few private scalars: commit, reveal, mask, sign, add (sans I/O).

The deployment's classifier check (:mod:`secure_afl.deploy.verify`) uses it; this module knows
nothing of what the scalars mean.  Each participant draws a :class:`VerifySecret` (a 32-byte nonce
``r`` and a fresh X25519 key; the deployment derives it from the fresh seed a node draws for its
session, :meth:`VerifySecret.from_seed`) and, before the value to check exists, signs a :class:`Commitment` to
``H(r)`` and its X25519 public key with its identity key.  Once the value is fixed (its digest
``context``), every participant checks every commitment (:func:`check_commitments`), reveals ``r``;
the challenge seed is :func:`transcript` over the context, every commitment and every ``r`` (roster
order): no single party chooses it, and none can predict it before the last ``r`` is revealed.
Each participant then sends its scalars masked with pairwise masks (:func:`mask`: HKDF of the X25519
secret with every other participant, added by the smaller id and subtracted by the larger, in fixed
point with :data:`FRAC_BITS` fractional bits modulo :data:`MODULUS`), signed over the transcript
(:func:`sign_masked`).  :func:`unmask_sum` checks that every participant's signed vector is there
and adds them: the masks cancel only in the full sum, so a vector alone (or any proper subset's sum)
is uniformly distributed.  No randomness is drawn here except through the injected source.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from secure_afl.core.errors import ServerProtocolError
from secure_afl.core.randomness import RandomSource

from . import crypto
from .fields import sequence, tagged_fields

COMMIT_DOMAIN = b"secure-afl/v1/verify-commit"
COMMIT_HASH_DOMAIN = b"secure-afl/v1/verify-commit-hash"
TRANSCRIPT_DOMAIN = b"secure-afl/v1/verify-transcript"
CHALLENGE_DOMAIN = b"secure-afl/v1/verify-challenge"
MASK_DOMAIN = b"secure-afl/v1/verify-mask"
MASKED_DOMAIN = b"secure-afl/v1/verify-masked"
SECRET_DOMAIN = b"secure-afl/v1/verify-secret"

FRAC_BITS = 128  # a float64 scalar below 2^126 in magnitude is held exactly down to 2^-128
MODULUS = 2**256
WORD_BYTES = 32
MAX_VALUES = 4096  # the scalars of one check (a classifier's classes and the bound's scale)


class VerificationError(ServerProtocolError):
    """The coordinator's relayed commitments, reveals or masked values do not form a checkable sum."""


@dataclass(frozen=True)
class VerifySecret:
    nonce: bytes  # r: revealed after the checked value is fixed
    key: bytes  # the X25519 private key of the pairwise masks (never leaves the participant)

    @classmethod
    def draw(cls, random: RandomSource) -> VerifySecret:
        return cls(random.token_bytes(32), random.token_bytes(crypto.KEY_BYTES))

    @classmethod
    def from_seed(cls, seed: bytes, client_id: str, session_id: bytes) -> VerifySecret:
        """The participant's secret for one session, from the fresh secret randomness it drew for that
        session (HKDF-SHA256, info: the domain, the session id and its id).  Never from a long-term key
        and the session id alone: the session id is the coordinator's choice, and one it repeated
        would then repeat ``r`` (revealed the first time), which the coordinator could know before it
        fixes the value to check.  ``seed``: at least 32 bytes from a CSPRNG, used for one session."""
        if len(seed) < 32:
            raise VerificationError(f"the check's seed has {len(seed)} bytes; it needs 32 fresh random bytes")
        info = tagged_fields(SECRET_DOMAIN, session_id, client_id)
        kdf = HKDF(algorithm=hashes.SHA256(), length=32 + crypto.KEY_BYTES, salt=None, info=info)
        derived = kdf.derive(seed)
        return cls(derived[:32], derived[32:])

    def public_key(self) -> bytes:
        return crypto.x25519_public_bytes(X25519PrivateKey.from_private_bytes(self.key))


def nonce_digest(client_id: str, session_id: bytes, nonce: bytes) -> bytes:
    return hashlib.sha256(tagged_fields(COMMIT_HASH_DOMAIN, session_id, client_id, nonce)).digest()


@dataclass(frozen=True)
class Commitment:
    client_id: str
    session_id: bytes
    digest: bytes  # H(r)
    key: bytes  # the X25519 public key of the pairwise masks
    signature: bytes

    def fields(self) -> tuple[bytes, str, bytes, bytes]:
        return (self.session_id, self.client_id, self.digest, self.key)

    def signed_by(self, public_key: bytes) -> bool:
        return crypto.verify(public_key, self.signature, COMMIT_DOMAIN, *self.fields())

    def to_text(self) -> str:
        return ".".join(x.hex() for x in (self.digest, self.key, self.signature))

    @classmethod
    def from_text(cls, client_id: str, session_id: bytes, text: object) -> Commitment:
        try:
            digest, key, signature = (bytes.fromhex(part) for part in str(text).split("."))
        except ValueError:
            raise VerificationError(f"{client_id!r}'s commitment is not three hex fields") from None
        if (len(digest), len(key), len(signature)) != (32, crypto.KEY_BYTES, crypto.SIGNATURE_BYTES):
            raise VerificationError(f"{client_id!r}'s commitment has fields of the wrong lengths")
        return cls(client_id, session_id, digest, key, signature)


def commit(
    secret: VerifySecret, client_id: str, session_id: bytes, identity: Ed25519PrivateKey
) -> Commitment:
    """The signed commitment to ``secret`` (sent before the checked value exists)."""
    digest = nonce_digest(client_id, session_id, secret.nonce)
    key = secret.public_key()
    signature = crypto.sign(identity, COMMIT_DOMAIN, session_id, client_id, digest, key)
    return Commitment(client_id, session_id, digest, key, signature)


def check_commitments(
    commitments: Mapping[str, Commitment],
    participants: Sequence[str],
    public_keys: Mapping[str, bytes],
    own: Commitment,
) -> None:
    """Every participant's commitment is there, signed by its roster key for ``own``'s session, and
    this participant's is the one it sent; anything else raises :class:`VerificationError`."""
    if sorted(commitments) != sorted(participants):
        raise VerificationError(
            f"the commitments relayed are those of {sorted(commitments)}, the participants are "
            f"{sorted(participants)}"
        )
    for cid, item in commitments.items():
        if cid not in public_keys or item.client_id != cid or item.session_id != own.session_id:
            raise VerificationError(f"the commitment of {cid!r} names another participant or session")
        if not item.signed_by(public_keys[cid]) or not crypto.valid_x25519_public_key(item.key):
            raise VerificationError(f"the commitment relayed for {cid!r} is not signed by its roster key")
    if commitments.get(own.client_id) != own:
        raise VerificationError(f"the commitment relayed for {own.client_id!r} is not the one it sent")


def check_reveals(commitments: Mapping[str, Commitment], reveals: Mapping[str, bytes]) -> None:
    if sorted(reveals) != sorted(commitments):
        raise VerificationError(
            f"the nonces relayed are those of {sorted(reveals)}, the participants are {sorted(commitments)}"
        )
    for cid, nonce in reveals.items():
        item = commitments[cid]
        if nonce_digest(cid, item.session_id, nonce) != item.digest:
            raise VerificationError(f"the nonce relayed for {cid!r} does not open its commitment")


def transcript(context: bytes, commitments: Mapping[str, Commitment], reveals: Mapping[str, bytes]) -> bytes:
    """The check's digest: the checked value's ``context``, every commitment and every nonce."""
    ids = sorted(commitments)
    items = [tagged_fields(b"", *commitments[c].fields(), commitments[c].signature, reveals[c]) for c in ids]
    return hashlib.sha256(tagged_fields(TRANSCRIPT_DOMAIN, context, sequence(items))).digest()


def challenge(seed: bytes, n: int) -> np.ndarray:
    """``n`` values on the grid ``k · 2^-52 - 1`` (uniform over its 2^53 points in [-1, 1)), from
    SHAKE-256 of the transcript: the same at every participant."""
    words = np.frombuffer(hashlib.shake_256(tagged_fields(CHALLENGE_DOMAIN, seed)).digest(8 * n), dtype="<u8")
    return (words >> np.uint64(11)).astype(np.float64) * 2.0**-52 - 1.0


def to_fixed(values: Sequence[float]) -> list[int]:
    out = []
    for value in values:
        v = float(value)
        if not np.isfinite(v) or abs(v) >= 2.0**126:
            raise VerificationError(f"a value to check is not finite or too large ({v!r})")
        out.append(int(v * 2.0**FRAC_BITS) % MODULUS)
    return out


def from_fixed(word: int) -> float:
    signed = word - MODULUS if word >= MODULUS // 2 else word
    return float(signed) / 2.0**FRAC_BITS


def _pair_mask(secret: VerifySecret, peer: Commitment, own_id: str, seed: bytes, n: int) -> list[int]:
    shared = crypto.x25519_shared_secret(X25519PrivateKey.from_private_bytes(secret.key), peer.key)
    low, high = sorted((own_id, peer.client_id))
    info = tagged_fields(MASK_DOMAIN, seed, low, high)
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)
    stream = hashlib.shake_256(key).digest(WORD_BYTES * n)
    return [int.from_bytes(stream[i * WORD_BYTES : (i + 1) * WORD_BYTES], "big") for i in range(n)]


def mask(
    values: Sequence[float],
    own_id: str,
    secret: VerifySecret,
    commitments: Mapping[str, Commitment],
    seed: bytes,
) -> list[int]:
    """``values`` in fixed point plus the pairwise masks with every other participant (the
    transcript ``seed`` is in every mask's key: another challenge gives other masks)."""
    if not 0 < len(values) <= MAX_VALUES:
        raise VerificationError(f"a check masks 1 to {MAX_VALUES} values, got {len(values)}")
    words = to_fixed(values)
    for peer_id in sorted(commitments):
        if peer_id == own_id:
            continue
        pad = _pair_mask(secret, commitments[peer_id], own_id, seed, len(words))
        sign = 1 if own_id < peer_id else -1
        words = [(w + sign * p) % MODULUS for w, p in zip(words, pad, strict=True)]
    return words


@dataclass(frozen=True)
class MaskedValue:
    client_id: str
    words: tuple[int, ...]
    signature: bytes

    def message(self, seed: bytes) -> bytes:
        data = b"".join(w.to_bytes(WORD_BYTES, "big") for w in self.words)
        return tagged_fields(MASKED_DOMAIN, seed, self.client_id, data)

    def to_text(self) -> str:
        return ".".join([*(format(w, "064x") for w in self.words), self.signature.hex()])

    @classmethod
    def from_text(cls, client_id: str, text: object) -> MaskedValue:
        parts = str(text).split(".")
        try:
            words = tuple(int(p, 16) for p in parts[:-1])
            signature = bytes.fromhex(parts[-1])
        except ValueError:
            raise VerificationError(f"{client_id!r}'s masked value is not hex fields") from None
        if not 0 < len(words) <= MAX_VALUES or any(not 0 <= w < MODULUS for w in words):
            raise VerificationError(f"{client_id!r}'s masked value has malformed words")
        return cls(client_id, words, signature)


def sign_masked(
    client_id: str, words: Sequence[int], seed: bytes, identity: Ed25519PrivateKey
) -> MaskedValue:
    unsigned = MaskedValue(client_id, tuple(words), b"")
    return MaskedValue(client_id, tuple(words), identity.sign(unsigned.message(seed)))


def unmask_sum(
    masked: Mapping[str, MaskedValue],
    commitments: Mapping[str, Commitment],
    public_keys: Mapping[str, bytes],
    seed: bytes,
    own: MaskedValue,
) -> list[float]:
    """The sum of every participant's values, after checking that every participant's masked
    vector is there, signed over this transcript, of one length, and this participant's own is the
    one it sent."""
    if sorted(masked) != sorted(commitments):
        raise VerificationError(
            f"the masked values relayed are those of {sorted(masked)}, the participants are "
            f"{sorted(commitments)}: the sum cannot be formed without every one"
        )
    n = len(own.words)
    for cid, item in masked.items():
        if item.client_id != cid or len(item.words) != n:
            raise VerificationError(f"the masked value relayed for {cid!r} is malformed")
        if not crypto.verify_message(public_keys[cid], item.signature, item.message(seed)):
            raise VerificationError(
                f"the masked value relayed for {cid!r} is not signed by its roster key over this check"
            )
    if masked[own.client_id] != own:
        raise VerificationError(f"the masked value relayed for {own.client_id!r} is not the one it sent")
    totals = [sum(item.words[i] for item in masked.values()) % MODULUS for i in range(n)]
    return [from_fixed(t) for t in totals]
