"""A checked sum of every survivor's private vector: commit a mask key, mask, sign, add (sans I/O).

The deployment's classifier check (:mod:`secure_afl.deploy.verify`) uses it; this module knows
nothing of what the values mean.  Each participant derives a :class:`VerifySecret` (a fresh X25519
key; the deployment derives it from the fresh seed a node draws for its session,
:meth:`VerifySecret.from_seed`) and, before the value to check exists, signs a :class:`Commitment`
to its public key with its identity key.  Once the value is fixed (its digest ``context``), every
participant checks every commitment (:func:`check_commitments`); the check's digest is
:func:`transcript` over the context and every commitment.  Each participant then sends its vector
masked with pairwise masks (:func:`mask`: the AES-256-CTR keystream of :mod:`.prg`, the session's
masks' PRG, under an HKDF key of the X25519 secret with every other participant and the transcript,
added by the smaller id and subtracted by the larger, in fixed point with
:data:`FRAC_BITS` fractional bits modulo :data:`MODULUS`), signed over the transcript
(:func:`sign_masked`).  :func:`unmask_sum` checks that every participant's signed vector is there
and adds them: the masks cancel only in the full sum over one transcript, so a vector alone, any
proper subset's sum, or vectors masked for different contexts reveal nothing.  No randomness is
drawn here except through the injected source.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from secure_afl.core.errors import ServerProtocolError
from secure_afl.core.randomness import RandomSource

from . import crypto, prg
from .fields import sequence, tagged_fields

# v5: the transcript's context binds every value the coordinator sends that shapes a node's terms
# (deploy/verify.py: the file and the count sums), so nodes given different ones form no sum.
# v4: a growing DP chain's terms end with each node's count of misstated run records (deploy/verify.py).
# v3: the pads are the session's mask PRG (AES-256-CTR, .prg), no longer SHAKE-256.  Every domain
# names the version, so a node of another version fails at the commitments (VERSION_HINT), not at
# a sum that looks like a tampered classifier.  v2: one round, every coordinate (no challenge).
VERSION = "v5"
COMMIT_DOMAIN = b"secure-afl/v5/verify-commit"
TRANSCRIPT_DOMAIN = b"secure-afl/v5/verify-transcript"
MASK_DOMAIN = b"secure-afl/v5/verify-mask"
MASKED_DOMAIN = b"secure-afl/v5/verify-masked"
SECRET_DOMAIN = b"secure-afl/v5/verify-secret"
VERSION_HINT = (
    f"(a node signs its commitment for the check's protocol {VERSION}: one running another secure-afl "
    "release fails here; every node of a federation runs one release)"
)

FRAC_BITS = 128  # a float64 below 2^126 in magnitude is held exactly down to 2^-128
MODULUS = 2**256
WORD_BYTES = 32
MAX_VALUES = 1 << 20  # the values of one check: a classifier's d x C residual, the scale and counts
_COUNT = struct.Struct(">I")


class VerificationError(ServerProtocolError):
    """The coordinator's relayed commitments or masked values do not form a checkable sum."""


@dataclass(frozen=True)
class VerifySecret:
    key: bytes  # the X25519 private key of the pairwise masks (never leaves the participant)

    @classmethod
    def draw(cls, random: RandomSource) -> VerifySecret:
        return cls(random.token_bytes(crypto.KEY_BYTES))

    @classmethod
    def from_seed(cls, seed: bytes, client_id: str, session_id: bytes) -> VerifySecret:
        """The participant's secret for one session, from the fresh secret randomness it drew for that
        session (HKDF-SHA256, info: the domain, the session id and its id).  Never from a long-term key
        and the session id alone: the session id is the coordinator's choice, and one it repeated
        would then repeat the mask key of an earlier check.  ``seed``: at least 32 bytes from a CSPRNG,
        used for one session."""
        if len(seed) < 32:
            raise VerificationError(f"the check's seed has {len(seed)} bytes; it needs 32 fresh random bytes")
        info = tagged_fields(SECRET_DOMAIN, session_id, client_id)
        kdf = HKDF(algorithm=hashes.SHA256(), length=crypto.KEY_BYTES, salt=None, info=info)
        return cls(kdf.derive(seed))

    def public_key(self) -> bytes:
        return crypto.x25519_public_bytes(X25519PrivateKey.from_private_bytes(self.key))


@dataclass(frozen=True)
class Commitment:
    client_id: str
    session_id: bytes
    key: bytes  # the X25519 public key of the pairwise masks
    signature: bytes

    def fields(self) -> tuple[bytes, str, bytes]:
        return (self.session_id, self.client_id, self.key)

    def signed_by(self, public_key: bytes) -> bool:
        return crypto.verify(public_key, self.signature, COMMIT_DOMAIN, *self.fields())

    def to_text(self) -> str:
        return ".".join(x.hex() for x in (self.key, self.signature))

    @classmethod
    def from_text(cls, client_id: str, session_id: bytes, text: object) -> Commitment:
        try:
            key, signature = (bytes.fromhex(part) for part in str(text).split("."))
        except ValueError:
            raise VerificationError(f"{client_id!r}'s commitment is not two hex fields") from None
        if (len(key), len(signature)) != (crypto.KEY_BYTES, crypto.SIGNATURE_BYTES):
            raise VerificationError(f"{client_id!r}'s commitment has fields of the wrong lengths")
        return cls(client_id, session_id, key, signature)


def commit(
    secret: VerifySecret, client_id: str, session_id: bytes, identity: Ed25519PrivateKey
) -> Commitment:
    """The signed commitment to ``secret``'s public key (sent before the checked value exists)."""
    key = secret.public_key()
    signature = crypto.sign(identity, COMMIT_DOMAIN, session_id, client_id, key)
    return Commitment(client_id, session_id, key, signature)


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
            raise VerificationError(
                f"the commitment relayed for {cid!r} is not signed by its roster key {VERSION_HINT}"
            )
    if commitments.get(own.client_id) != own:
        raise VerificationError(f"the commitment relayed for {own.client_id!r} is not the one it sent")


def transcript(context: bytes, commitments: Mapping[str, Commitment]) -> bytes:
    """The check's digest: the checked value's ``context`` and every commitment (roster order)."""
    ids = sorted(commitments)
    items = [tagged_fields(b"", *commitments[c].fields(), commitments[c].signature) for c in ids]
    return hashlib.sha256(tagged_fields(TRANSCRIPT_DOMAIN, context, sequence(items))).digest()


def to_fixed(values: Sequence[float] | np.ndarray) -> bytes:
    """Each value times 2^FRAC_BITS, truncated toward zero (as ``int()``), mod 2^256, as 32 big-endian
    bytes: exact, by numpy over four 64-bit limbs.  |v| = f·2^e (``frexp``) puts the 53-bit integer
    ``f·2^53`` at bit ``e − 53 + 128`` (a value below 2^-128 in magnitude truncates to 0); a negative
    value is the two's complement of its magnitude's words."""
    array = np.asarray(values, dtype=np.float64).ravel()
    if not np.all(np.isfinite(array)) or np.any(np.abs(array) >= 2.0**126):
        raise VerificationError("a value to check is not finite or too large (|x| >= 2^126)")
    fraction, exponent = np.frexp(np.abs(array))
    mantissa = (fraction * 2.0**53).astype(np.uint64)  # exact: 53 bits
    shift = exponent.astype(np.int64) - 53 + FRAC_BITS
    right = np.clip(-shift, 0, 63).astype(np.uint64)
    mantissa = np.where(shift <= -64, np.uint64(0), np.where(shift < 0, mantissa >> right, mantissa))
    shift = np.maximum(shift, 0)  # at most 126 − 53 + 128 = 201: limb 3 holds the top
    limb, offset = shift // 64, (shift % 64).astype(np.uint64)
    rows = np.arange(array.size)
    limbs = np.zeros((array.size, 4), dtype=np.uint64)  # little-endian 64-bit limbs
    limbs[rows, limb] = mantissa << offset
    spill = np.where(offset == 0, np.uint64(0), mantissa >> ((np.uint64(64) - offset) % np.uint64(64)))
    upper = limb < 3
    limbs[rows[upper], limb[upper] + 1] = spill[upper]
    negative = array < 0
    limbs[negative] = ~limbs[negative]
    carry = negative.astype(np.uint64)  # + 1: the carry runs through limbs that were all ones
    for i in range(4):
        limbs[:, i] += carry
        carry &= (limbs[:, i] == 0).astype(np.uint64)
    return limbs[:, ::-1].astype(">u8").tobytes()


def from_fixed(word: int) -> float:
    signed = word - MODULUS if word >= MODULUS // 2 else word
    return float(signed) / 2.0**FRAC_BITS


def decode_words(data: bytes, exact: int = 0) -> np.ndarray:
    """The words as floats (value / 2^FRAC_BITS): by numpy over 64-bit limbs, within a few units in
    the last place; the last ``exact`` words by :func:`from_fixed`, correctly rounded (values to
    compare for equality)."""
    limbs = np.frombuffer(data, dtype=">u8").reshape(-1, 4)[:, ::-1].astype(np.uint64)  # little-endian
    negative = limbs[:, 3] >> np.uint64(63) == 1
    limbs[negative] = ~limbs[negative]
    carry = negative.astype(np.uint64)
    for i in range(4):
        limbs[:, i] += carry
        carry &= (limbs[:, i] == 0).astype(np.uint64)
    scales = 2.0 ** (64.0 * np.arange(4) - FRAC_BITS)
    values = (limbs.astype(np.float64) * scales)[:, ::-1].sum(axis=1)  # the largest limb first
    values[negative] *= -1.0
    n = len(values)
    for i in range(max(0, n - exact), n):
        values[i] = from_fixed(int.from_bytes(data[i * WORD_BYTES : (i + 1) * WORD_BYTES], "big"))
    return values


# Words are added as one Python integer with a word per slot: each 32-byte word behind GUARD zero
# bytes, so a word's carries stay in its own slot (up to 2^(8·GUARD) additions) and the slots are
# reduced mod 2^256 at the end by dropping the guard bytes.  Exactly word-wise addition mod 2^256,
# done by the integer arithmetic in C rather than a Python loop over words.
GUARD = 2
SLOT = GUARD + WORD_BYTES
MAX_TERMS = 2 ** (8 * GUARD) - 1  # words one slot may add before its guard overflows


def _slots(data: bytes, *, negate: bool = False) -> int:
    words = np.frombuffer(data, dtype=np.uint8).reshape(-1, WORD_BYTES)
    slots = np.zeros((len(words), SLOT), dtype=np.uint8)
    slots[:, GUARD:] = np.bitwise_not(words) if negate else words
    value = int.from_bytes(slots.tobytes(), "big")
    if negate:  # 2^256 − p = (~p) + 1 in each slot (p = 0 gives 2^256, which the reduction drops)
        ones = np.zeros((len(words), SLOT), dtype=np.uint8)
        ones[:, -1] = 1
        value += int.from_bytes(ones.tobytes(), "big")
    return value


def _words(value: int, n: int) -> bytes:
    """The slots' sums reduced mod 2^256: ``n`` words of 32 bytes."""
    slots = np.frombuffer(value.to_bytes(n * SLOT, "big"), dtype=np.uint8).reshape(n, SLOT)
    return slots[:, GUARD:].tobytes()


def _pair_mask(secret: VerifySecret, peer: Commitment, own_id: str, seed: bytes, n: int) -> bytes:
    shared = crypto.x25519_shared_secret(X25519PrivateKey.from_private_bytes(secret.key), peer.key)
    low, high = sorted((own_id, peer.client_id))
    info = tagged_fields(MASK_DOMAIN, seed, low, high)
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)
    return prg.keystream(key, WORD_BYTES * n)  # one key per pad: a zero counter block is safe


def mask(
    values: Sequence[float] | np.ndarray,
    own_id: str,
    secret: VerifySecret,
    commitments: Mapping[str, Commitment],
    seed: bytes,
) -> bytes:
    """``values`` in fixed point plus the pairwise masks with every other participant (the
    transcript ``seed`` is in every mask's key: another context gives other masks), as words."""
    n = int(np.size(values))
    if not 0 < n <= MAX_VALUES:
        raise VerificationError(f"a check masks 1 to {MAX_VALUES} values, got {n}")
    if len(commitments) > MAX_TERMS:
        raise VerificationError(f"a check has at most {MAX_TERMS} participants, got {len(commitments)}")
    total = _slots(to_fixed(values))
    for peer_id in sorted(commitments):
        if peer_id != own_id:
            pad = _pair_mask(secret, commitments[peer_id], own_id, seed, n)
            total += _slots(pad, negate=own_id > peer_id)  # added by the smaller id, subtracted by the larger
    return _words(total, n)


@dataclass(frozen=True)
class MaskedValue:
    client_id: str
    data: bytes  # the words, 32 big-endian bytes each
    signature: bytes

    @property
    def words(self) -> tuple[int, ...]:
        return tuple(
            int.from_bytes(self.data[i : i + WORD_BYTES], "big") for i in range(0, len(self.data), WORD_BYTES)
        )

    def message(self, seed: bytes) -> bytes:
        return tagged_fields(MASKED_DOMAIN, seed, self.client_id, self.data)

    def to_bytes(self) -> bytes:
        """``count (4 bytes) ‖ words (32 bytes each, big-endian) ‖ signature (64 bytes)``."""
        return _COUNT.pack(len(self.data) // WORD_BYTES) + self.data + self.signature

    @classmethod
    def from_bytes(cls, client_id: str, data: bytes) -> MaskedValue:
        if len(data) < _COUNT.size:
            raise VerificationError(f"{client_id!r}'s masked value is truncated")
        (n,) = _COUNT.unpack_from(data)
        if not 0 < n <= MAX_VALUES or len(data) != _COUNT.size + n * WORD_BYTES + crypto.SIGNATURE_BYTES:
            raise VerificationError(
                f"{client_id!r}'s masked value has {len(data)} bytes, not a count of 1 to {MAX_VALUES} "
                "words and a signature"
            )
        end = _COUNT.size + n * WORD_BYTES
        return cls(client_id, bytes(data[_COUNT.size : end]), bytes(data[end:]))


def pack_relay(masked: Mapping[str, bytes]) -> tuple[list[str], bytes]:
    """The coordinator's relay: the ids (sorted) and their masked values' bytes, one after another."""
    ids = sorted(masked)
    return ids, b"".join(masked[c] for c in ids)


def unpack_relay(ids: Sequence[str], data: bytes, n_words: int) -> dict[str, MaskedValue]:
    """The relayed values, each of ``n_words`` words (this participant's own count)."""
    size = _COUNT.size + n_words * WORD_BYTES + crypto.SIGNATURE_BYTES
    if len(set(ids)) != len(ids) or len(data) != size * len(ids):
        raise VerificationError(
            f"the relayed masked values have {len(data)} bytes, not {len(ids)} distinct values of {size}"
        )
    return {cid: MaskedValue.from_bytes(cid, data[i * size : (i + 1) * size]) for i, cid in enumerate(ids)}


def sign_masked(client_id: str, data: bytes, seed: bytes, identity: Ed25519PrivateKey) -> MaskedValue:
    unsigned = MaskedValue(client_id, bytes(data), b"")
    return MaskedValue(client_id, bytes(data), identity.sign(unsigned.message(seed)))


def unmask_sum(
    masked: Mapping[str, MaskedValue],
    commitments: Mapping[str, Commitment],
    public_keys: Mapping[str, bytes],
    seed: bytes,
    own: MaskedValue,
    exact: int = 0,
) -> np.ndarray:
    """The sum of every participant's values, after checking that every participant's masked
    vector is there, signed over this transcript, of one length, and this participant's own is the
    one it sent (:func:`decode_words`: the last ``exact`` correctly rounded)."""
    if sorted(masked) != sorted(commitments):
        raise VerificationError(
            f"the masked values relayed are those of {sorted(masked)}, the participants are "
            f"{sorted(commitments)}: the sum cannot be formed without every one"
        )
    if len(masked) > MAX_TERMS:
        raise VerificationError(f"a check has at most {MAX_TERMS} participants, got {len(masked)}")
    for cid, item in masked.items():
        if item.client_id != cid or len(item.data) != len(own.data):
            raise VerificationError(f"the masked value relayed for {cid!r} is malformed")
        if not crypto.verify_message(public_keys[cid], item.signature, item.message(seed)):
            raise VerificationError(
                f"the masked value relayed for {cid!r} is not signed by its roster key over this check"
            )
    if masked[own.client_id] != own:
        raise VerificationError(f"the masked value relayed for {own.client_id!r} is not the one it sent")
    n = len(own.data) // WORD_BYTES
    return decode_words(_words(sum(_slots(item.data) for item in masked.values()), n), exact)
