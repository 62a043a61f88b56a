"""Masks: AES-256-CTR keystreams from ``cryptography``, one key per (session, group, tensor, owner).

Keys are HKDF-SHA256 outputs with every binding value in ``info`` (length-prefixed and domain
tagged, see :mod:`.fields`):

* self mask of client u: ikm = u's 32-byte self-mask seed b_u; info = (session, group, tensor, u);
* pairwise mask of u and v: ikm = X25519(s_u, s_v); info = (session, group, tensor, min(u, v), max(u, v)).

The lower id (Python string order) adds the pairwise mask, the higher subtracts it, so the two
cancel in the group's sum.  Each key is used for exactly one keystream, so a fixed zero counter
block is safe.  A mask of n words is one ``update`` call over 8n zero bytes viewed as uint64;
:func:`add_masks` adds the keystreams of several keys chunk by chunk through one reused buffer
(``update_into``): the same words, without a fresh 8n-byte input and output per key (most of a
mask's cost was their page faults, not AES) and with each slice of the accumulator in cache.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF, HKDFExpand

from secure_afl.core import encoding
from secure_afl.core.workers import ONE_THREAD, Workers

from .fields import tagged_fields

SELF_MASK_DOMAIN = b"secure-afl/v1/self-mask"
PAIR_MASK_DOMAIN = b"secure-afl/v1/pairwise-mask"
_ZERO_COUNTER = bytes(16)
CHUNK_WORDS = 1 << 15  # 256 KiB of keystream per key at a time: the accumulator's slice stays in cache
# An accumulator this long (8 MiB) is split among the workers (add_masks); a shorter one costs
# less than starting them.
PARALLEL_MIN_WORDS = 1 << 20


def self_mask_key(seed: bytes, session_id: bytes, group: str, tensor: str, client_id: str) -> bytes:
    info = tagged_fields(SELF_MASK_DOMAIN, session_id, group, tensor, client_id)
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(seed)


def pair_mask_key(shared_secret: bytes, session_id: bytes, group: str, tensor: str, a: str, b: str) -> bytes:
    low, high = sorted((a, b))
    info = tagged_fields(PAIR_MASK_DOMAIN, session_id, group, tensor, low, high)
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared_secret)


def key_prk(secret: bytes) -> bytes:
    """HKDF-SHA256's extract step over a seed or shared secret, as :func:`self_mask_key` and
    :func:`pair_mask_key` run it (``salt=None``: 32 zero bytes, RFC 5869 §2.2).  Every key derived
    from one secret (one per group and tensor) shares it: extract once, then expand per key with
    :func:`self_mask_key_from_prk` / :func:`pair_mask_key_from_prk`, which give the same keys."""
    if not isinstance(secret, bytes):
        raise TypeError("the secret must be bytes")
    return HKDF.extract(hashes.SHA256(), None, secret)  # cryptography's own extract (>= 47)


def self_mask_key_from_prk(prk: bytes, session_id: bytes, group: str, tensor: str, client_id: str) -> bytes:
    """:func:`self_mask_key` from the seed's :func:`key_prk` (HKDF's expand step alone)."""
    info = tagged_fields(SELF_MASK_DOMAIN, session_id, group, tensor, client_id)
    return HKDFExpand(algorithm=hashes.SHA256(), length=32, info=info).derive(prk)


def pair_mask_key_from_prk(prk: bytes, session_id: bytes, group: str, tensor: str, a: str, b: str) -> bytes:
    """:func:`pair_mask_key` from the shared secret's :func:`key_prk` (HKDF's expand step alone)."""
    low, high = (a, b) if a < b else (b, a)
    info = tagged_fields(PAIR_MASK_DOMAIN, session_id, group, tensor, low, high)
    return HKDFExpand(algorithm=hashes.SHA256(), length=32, info=info).derive(prk)


def pair_sign(own_id: str, peer_id: str) -> int:
    """+1 when ``own_id`` adds the pairwise mask (it is the lower id), -1 when it subtracts."""
    if own_id == peer_id:
        raise ValueError("a client has no pairwise mask with itself")
    return 1 if own_id < peer_id else -1


def keystream(key: bytes, n_bytes: int) -> bytes:
    """The first ``n_bytes`` of ``key``'s AES-256-CTR keystream (counter block 0): every mask's PRG."""
    return Cipher(algorithms.AES(key), modes.CTR(_ZERO_COUNTER)).encryptor().update(bytes(n_bytes))


def mask_words(key: bytes, n_words: int) -> np.ndarray:
    """A read-only uint64 view of n_words of AES-256-CTR keystream."""
    return np.frombuffer(keystream(key, 8 * n_words), dtype="<u8")


def add_mask(accumulator: np.ndarray, key: bytes, sign: int) -> None:
    """``accumulator += sign * mask(key)`` modulo 2^64, in place."""
    add_masks(accumulator, ((key, sign),))


def add_masks(
    accumulator: np.ndarray,
    keys: Iterable[tuple[bytes, int]],
    *,
    base: np.ndarray | None = None,
    values: np.ndarray | None = None,
    frac_bits: int = encoding.DEFAULT_FRAC_BITS,
    group_size: int | None = None,
    tensor: str = "",
    workers: Workers = ONE_THREAD,
) -> None:
    """``accumulator += sum(sign * mask(key))`` modulo 2^64 over ``(key, sign)`` pairs, in place;
    with ``base``, ``accumulator = base + sum(sign * mask(key))`` (its prior content is not read);
    with float64 ``values``, ``accumulator = encode(values) + sum(sign * mask(key))``, each chunk
    encoded where it is masked: the words of ``encode`` without an array of them (at d = 4096 a
    fresh 64 MiB per Gram, whose first touch costs more than the encoding).  The values are
    checked chunk by chunk as they are encoded, for a group of ``group_size`` members, as
    ``tensor`` (:func:`~secure_afl.core.encoding.check_part`: a refusal raises the whole's error,
    leaving the accumulator part-written); without ``group_size`` they must have passed
    :func:`~secure_afl.core.encoding.check_encodable`.

    The words added are exactly :func:`mask_words`': each key's keystream is produced in chunks of
    :data:`CHUNK_WORDS` (CTR mode continues across ``update_into`` calls) into one reused buffer,
    and every key's chunk is added while that slice of the accumulator is in cache.  An accumulator
    that is not 8-byte aligned (a tensor's place in a message frame, see
    :class:`~secure_afl.protocol.codec.MaskedInputFrame`) is summed chunk by chunk in an aligned
    buffer and each chunk copied in once: numpy adds unaligned words about twice as slowly.

    ``workers`` (:mod:`secure_afl.core.workers`): an accumulator of at least
    :data:`PARALLEL_MIN_WORDS` words (a Gram triangle from d of about 1,450) is split into
    ``workers.count`` runs of whole chunks, each with its own keystreams started at its first
    word's counter block (CTR mode is seekable: the same words, bit for bit); a refusal in any
    run raises once all have ended.  AES-CTR (``cryptography``) and numpy's adds release the GIL.
    """
    if accumulator.dtype != np.uint64 or accumulator.ndim != 1:
        raise ValueError(
            f"masks are added to a 1-D uint64 array, got {accumulator.dtype} {accumulator.shape}"
        )
    if base is not None and (base.dtype != np.uint64 or base.shape != accumulator.shape):
        raise ValueError(
            f"the base must be a uint64 array of the accumulator's shape {accumulator.shape}, "
            f"got {base.dtype} {base.shape}"
        )
    if values is not None and (
        base is not None or values.dtype != np.float64 or values.shape != accumulator.shape
    ):
        raise ValueError(
            f"the values must be a float64 array of the accumulator's shape {accumulator.shape}, "
            f"and no base beside them; got {values.dtype} {values.shape}"
        )
    keys = [(key, sign > 0) for key, sign in keys]
    n_words = accumulator.shape[0]
    if n_words == 0:
        return
    if not keys and values is None:
        if base is not None:
            np.copyto(accumulator, base)
        return
    size = min(CHUNK_WORDS, n_words)
    job = _MaskJob(accumulator, keys, base, values, frac_bits, group_size, tensor, size)
    runs = word_runs(n_words, workers)
    if len(runs) == 1:
        job.run(0, n_words)
        return
    workers.run([functools.partial(job.run, lo, hi) for lo, hi in runs])


def word_runs(n_words: int, workers: Workers) -> list[tuple[int, int]]:
    """``(start, stop)`` runs of whole :data:`CHUNK_WORDS` chunks (each start on a chunk, so on
    an AES block boundary) that ``workers`` share an array of ``n_words`` in: one run below
    :data:`PARALLEL_MIN_WORDS`, else ``workers.count`` runs (no more than the chunks)."""
    n_chunks = -(-n_words // CHUNK_WORDS)
    count = min(workers.count, n_chunks) if n_words >= PARALLEL_MIN_WORDS else 1
    bounds = [min(n_words, CHUNK_WORDS * (n_chunks * i // count)) for i in range(count)] + [n_words]
    return list(itertools.pairwise(bounds))


@dataclass(frozen=True)
class _MaskJob:
    """One :func:`add_masks` call's arguments, masked a run of chunks at a time (any thread)."""

    accumulator: np.ndarray
    keys: list[tuple[bytes, bool]]
    base: np.ndarray | None
    values: np.ndarray | None
    frac_bits: int
    group_size: int | None
    tensor: str
    size: int

    def run(self, lo: int, hi: int) -> None:
        """Words ``lo:hi`` (``lo`` a multiple of the chunk size) with their own buffers and
        keystreams started at word ``lo``'s counter block."""
        accumulator, base, values, size = self.accumulator, self.base, self.values, self.size
        if lo % 2:  # 2 words to an AES block: an odd start has no counter block of its own
            raise ValueError(f"a run of masked words starts on an even word, got {lo}")
        counter = (8 * lo // 16).to_bytes(16, "big")
        streams = [
            (Cipher(algorithms.AES(key), modes.CTR(counter)).encryptor(), add) for key, add in self.keys
        ]
        zeros = memoryview(bytearray(8 * size))
        out = bytearray(8 * size + 15)  # update_into wants block_size - 1 spare bytes
        staged = base is not None or values is not None or not accumulator.flags.aligned
        scratch = np.empty(size, dtype=np.uint64) if staged else None
        floats = np.empty(size) if values is not None else None
        for start in range(lo, hi, size):
            words = min(size, hi - start)
            target = accumulator[start : start + words]
            part = target if scratch is None else scratch[:words]
            # The first mask is added to the words where they are (the base, or the accumulator):
            # no pass copying them into the scratch first.
            source = target if base is None else base[start : start + words]
            if values is not None:
                chunk = values[start : start + words]
                if self.group_size is not None:
                    encoding.check_part(
                        chunk,
                        whole=values,
                        tensor=self.tensor,
                        frac_bits=self.frac_bits,
                        group_size=self.group_size,
                    )
                encoding.encode_into(chunk, part, frac_bits=self.frac_bits, buffer=floats)
                source = part
            mask = np.frombuffer(out, dtype="<u8", count=words)
            for stream, add in streams:
                stream.update_into(zeros[: 8 * words], out)
                if add:
                    np.add(source, mask, out=part)
                else:
                    np.subtract(source, mask, out=part)
                source = part
            if scratch is not None:
                np.copyto(target, part)
