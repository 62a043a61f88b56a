"""What each signature, commitment and digest binds, in one place for auditors.

Every value is a :func:`~secure_afl.protocol.fields.tagged_fields` encoding under its own domain
tag, so a signature made for one purpose can never be replayed for another, and every one of them
includes the session id, so nothing can be replayed from another session.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

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


def config_digest(config: SessionConfig) -> bytes:
    """SHA-256 of the session's config: session id, t, minimum group size, encoding, group layout.

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
) -> tuple[bytes, tuple]:
    """(domain, fields) signed by a client's identity key in R0."""
    return ADVERTISE_DOMAIN, (
        session_id,
        client_id,
        encryption_public_key,
        mask_public_key,
        self_mask_commitment,
        config_digest_value,
        groups,
    )


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
