"""What each signature, commitment and digest binds, in one place for auditors.

Every value is a :func:`~secure_afl.protocol.fields.tagged_fields` encoding under its own domain
tag, so a signature made for one purpose can never be replayed for another, and every one of them
includes the session id, so nothing can be replayed from another session.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import numpy as np

from secure_afl.core.errors import LocalProtocolError

from . import crypto
from .fields import sequence, tagged_fields
from .messages import AdvertiseKeys, SessionConfig

CONFIG_DOMAIN = b"secure-afl/v1/session-config/nested-layout"
LAYOUT_GROUP_DOMAIN = b"secure-afl/v1/layout-group"
LAYOUT_TENSOR_DOMAIN = b"secure-afl/v1/layout-tensor"
ADVERTISE_DOMAIN = b"secure-afl/v1/advertise-keys"
SURVIVORS_DOMAIN = b"secure-afl/v1/consistency-transcript"
ADVERTISEMENTS_DOMAIN = b"secure-afl/v1/accepted-advertisements"
ADVERTISEMENT_ENTRY_DOMAIN = b"secure-afl/v1/accepted-advertisement"
COMMITMENT_DOMAIN = b"secure-afl/v1/self-mask-commitment"
CONTEXT_DOMAIN = b"secure-afl/v1/session-context"
CONTEXT_ARRAY_DOMAIN = b"secure-afl/v1/session-context-array"
CONTEXT_BYTES = 32
NO_CONTEXT = b""  # a session bound to nothing outside its config (protocol-level tests and tools)


def session_context(study: bytes, round_label: str, arrays: Mapping[str, np.ndarray] | None = None) -> bytes:
    """SHA-256 of what shapes a release besides the session config: the one-view rule's digest.

    ``study`` is the study's canonical encoding (its digest will do: every field, DP parameters
    included, with or without DP), ``round_label`` the study's round ("1", "2"), and ``arrays`` what
    the server sent with it for that round (round 2: the teacher classifier W, named ``coef``); the
    pseudo-label parameters (τ, α, δ⁺, δ⁻, the rescaling) are the study's.  Each array is bound by
    name, shape and its float64 little-endian bytes.  Every client computes it from what *it* was
    given and passes it to its session, which folds it into the config digest that every
    advertisement signs (:func:`config_digest`): a client accepts an advertisement set only where
    all of them sign its own digest, so at least t clients were shown this one study, round and W
    before any share leaves (R1).  Both backends bind it the same way.
    """
    entries = sequence(
        tagged_fields(
            CONTEXT_ARRAY_DOMAIN,
            name,
            tuple(str(int(k)) for k in np.shape(values)),
            np.ascontiguousarray(values, dtype="<f8").tobytes(),
        )
        for name, values in sorted((arrays or {}).items())
    )
    return hashlib.sha256(tagged_fields(CONTEXT_DOMAIN, study, round_label, entries)).digest()


def check_context(context: bytes) -> bytes:
    """A session's context: :data:`NO_CONTEXT` or a :func:`session_context` digest (32 bytes)."""
    if not isinstance(context, bytes) or len(context) not in (0, CONTEXT_BYTES):
        raise LocalProtocolError(f"a session context is {CONTEXT_BYTES} bytes (session_context) or empty")
    return context


def config_digest(config: SessionConfig, context: bytes = NO_CONTEXT) -> bytes:
    """SHA-256 of the session's config: session id, t, minimum group size, encoding, group layout,
    and the session context (:func:`session_context`: the study, its round, round 2's W).

    The layout is nested, never joined with separators: a sequence of groups, each a tagged
    encoding of its name and the sequence of its tensors, each a tagged encoding of (name, length).
    Names are length-prefixed, so no two layouts share an encoding whatever characters they hold
    (config validation refuses control characters in names anyway).
    """
    layout = sequence(
        tagged_fields(
            LAYOUT_GROUP_DOMAIN,
            group.name,
            sequence(
                tagged_fields(LAYOUT_TENSOR_DOMAIN, tensor.name, tensor.length) for tensor in group.tensors
            ),
        )
        for group in config.groups
    )
    encoded = tagged_fields(
        CONFIG_DOMAIN,
        config.session_id,
        config.threshold,
        config.min_group_size,
        config.frac_bits,
        layout,
        check_context(context),
    )
    return hashlib.sha256(encoded).digest()


def advertise_fields(
    session_id: bytes,
    client_id: str,
    encryption_public_key: bytes,
    mask_public_key: bytes,
    self_mask_commitment: bytes,
    config_digest_value: bytes,
    groups: tuple[str, ...],
    rows: tuple[int, ...] = (),
) -> tuple[bytes, tuple]:
    """(domain, fields) signed by a client's identity key in R0; the committed counts ``rows``
    (one per group) are a field of their own, present only where the client commits to them."""
    fields: tuple = (
        session_id,
        client_id,
        encryption_public_key,
        mask_public_key,
        self_mask_commitment,
        config_digest_value,
        groups,
    )
    if rows:
        fields = (*fields, committed_rows_field(rows))
    return ADVERTISE_DOMAIN, fields


def committed_rows_field(rows: tuple[int, ...]) -> bytes:
    """The committed counts as one signed field (each count as 8 big-endian bytes)."""
    return b"".join(int(v).to_bytes(8, "big") for v in rows)


def advertisement_signed_by(advert: AdvertiseKeys, public_key: bytes) -> bool:
    """Whether ``public_key`` (the roster's identity key of ``advert.client_id``) signed ``advert``."""
    domain, fields = advertise_fields(
        advert.session_id,
        advert.client_id,
        advert.encryption_public_key,
        advert.mask_public_key,
        advert.self_mask_commitment,
        advert.config_digest,
        advert.groups,
        advert.rows,
    )
    return crypto.verify(public_key, advert.signature, domain, *fields)


def advertisements_digest(session_id: bytes, advertisements: Iterable[AdvertiseKeys]) -> bytes:
    """SHA-256 of every advertisement a client accepted in R1, sorted by client id, signatures included.

    It stands for the keys of the session's transcript: two sessions with one session id but
    different advertised keys (or a different set of participants) have different digests.
    """
    ordered = sorted(advertisements, key=lambda advert: advert.client_id)
    entries = sequence(
        tagged_fields(
            ADVERTISEMENT_ENTRY_DOMAIN,
            advert.session_id,
            advert.client_id,
            advert.encryption_public_key,
            advert.mask_public_key,
            advert.self_mask_commitment,
            advert.config_digest,
            advert.groups,
            advert.signature,
        )
        for advert in ordered
    )
    return hashlib.sha256(tagged_fields(ADVERTISEMENTS_DOMAIN, session_id, entries)).digest()


def survivors_fields(
    session_id: bytes,
    config_digest_value: bytes,
    advertisements_digest_value: bytes,
    survivors: tuple[str, ...],
) -> tuple[bytes, tuple]:
    """(domain, fields) signed by a client in R3: the transcript so far and the sorted survivor set U3.

    Besides the session id and U3, the signature covers the config digest and the digest of the
    advertisements the client accepted in R1 (as Google's fcp does), so it cannot be replayed into a
    session that has the same id but other keys, participants or layout.
    """
    return SURVIVORS_DOMAIN, (
        session_id,
        config_digest_value,
        advertisements_digest_value,
        tuple(sorted(survivors)),
    )


def self_mask_commitment(seed: bytes, session_id: bytes, client_id: str) -> bytes:
    """A hiding, binding commitment to the 32-byte self-mask seed (the seed is uniformly random).

    It lets the server check a reconstructed seed, so a wrong share is detected, not silently used.
    """
    return hashlib.sha256(tagged_fields(COMMITMENT_DOMAIN, session_id, client_id, seed)).digest()
