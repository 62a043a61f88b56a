"""What each signature, digest and derived key of the CKKS backend binds, in one place for auditors.

Every value is a :func:`~secure_afl.protocol.fields.tagged_fields` encoding under its own domain tag
(distinct from the masking backend's), and every one includes the session id.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from secure_afl.protocol import crypto
from secure_afl.protocol.binding import NO_CONTEXT, check_context, committed_rows_field
from secure_afl.protocol.fields import sequence, tagged_fields

from .messages import (
    CkksAdvertise,
    CkksSessionConfig,
    DecryptedChunk,
    EncryptedTensor,
    SignedUpload,
    TensorDigests,
    UploadEntry,
)

CONFIG_DOMAIN = b"secure-afl/ckks/v1/session-config"
LAYOUT_GROUP_DOMAIN = b"secure-afl/ckks/v1/layout-group"
LAYOUT_TENSOR_DOMAIN = b"secure-afl/ckks/v1/layout-tensor"
ADVERTISE_DOMAIN = b"secure-afl/ckks/v1/advertise-key"
ADVERTISEMENTS_DOMAIN = b"secure-afl/ckks/v1/accepted-advertisements"
ADVERTISEMENT_ENTRY_DOMAIN = b"secure-afl/ckks/v1/accepted-advertisement"
KEY_HOLDER_DOMAIN = b"secure-afl/ckks/v1/key-holder-choice"
KEYS_DOMAIN = b"secure-afl/ckks/v1/public-context"
CONTEXT_KEY_DOMAIN = b"secure-afl/ckks/v1/context-encryption-key"
CONTEXT_AD_DOMAIN = b"secure-afl/ckks/v1/context-associated-data"
INPUT_DOMAIN = b"secure-afl/ckks/v1/encrypted-input"
INPUT_TENSOR_DOMAIN = b"secure-afl/ckks/v1/encrypted-tensor"
UPLOAD_DOMAIN = b"secure-afl/ckks/v1/upload-digest"
VIEW_DOMAIN = b"secure-afl/ckks/v1/survivor-view"
VIEW_ENTRY_DOMAIN = b"secure-afl/ckks/v1/survivor-view-entry"
# v2 (wire 0xC4): a decryption signs a chunk set of a group, named by its chunk indices.
DECRYPTION_DOMAIN = b"secure-afl/ckks/v2/decrypted-chunk-sums"
DECRYPTED_CHUNK_DOMAIN = b"secure-afl/ckks/v2/decrypted-chunk"


def config_digest(config: CkksSessionConfig, context: bytes = NO_CONTEXT) -> bytes:
    """SHA-256 of the session id, minimum group size, CKKS parameters, the nested group layout and
    the session context (:func:`secure_afl.protocol.binding.session_context`, the masking
    backend's one-view digest: the study, its round, round 2's teacher W)."""
    p = config.parameters
    layout = sequence(
        tagged_fields(
            LAYOUT_GROUP_DOMAIN,
            group.name,
            sequence(tagged_fields(LAYOUT_TENSOR_DOMAIN, t.name, t.length) for t in group.tensors),
        )
        for group in config.groups
    )
    moduli = sequence(tagged_fields(LAYOUT_TENSOR_DOMAIN, "modulus", b) for b in p.coeff_mod_bit_sizes)
    encoded = tagged_fields(
        CONFIG_DOMAIN,
        config.session_id,
        config.min_group_size,
        p.poly_modulus_degree,
        moduli,
        p.scale_bits,
        p.output_frac_bits,
        layout,
        check_context(context),
    )
    return hashlib.sha256(encoded).digest()


def advertise_fields(
    session_id: bytes,
    client_id: str,
    encryption_public_key: bytes,
    digest: bytes,
    groups: tuple[str, ...],
    rows: tuple[int, ...] = (),
) -> tuple[bytes, tuple]:
    """(domain, fields) signed in R0; the committed counts as the masking advertisement's."""
    fields: tuple = (session_id, client_id, encryption_public_key, digest, groups)
    if rows:
        fields = (*fields, committed_rows_field(rows))
    return ADVERTISE_DOMAIN, fields


def advertisement_signed_by(advert: CkksAdvertise, public_key: bytes) -> bool:
    domain, fields = advertise_fields(
        advert.session_id,
        advert.client_id,
        advert.encryption_public_key,
        advert.config_digest,
        advert.groups,
        advert.rows,
    )
    return crypto.verify(public_key, advert.signature, domain, *fields)


def advertisements_digest(session_id: bytes, advertisements: Iterable[CkksAdvertise]) -> bytes:
    """SHA-256 of every accepted advertisement, sorted by client id, signatures included."""
    entries = sequence(
        tagged_fields(
            ADVERTISEMENT_ENTRY_DOMAIN,
            a.session_id,
            a.client_id,
            a.encryption_public_key,
            a.config_digest,
            a.groups,
            a.signature,
        )
        for a in sorted(advertisements, key=lambda advert: advert.client_id)
    )
    return hashlib.sha256(tagged_fields(ADVERTISEMENTS_DOMAIN, session_id, entries)).digest()


def key_holder(session_id: bytes, adverts_digest: bytes, client_ids: Iterable[str]) -> str:
    """The client that generates the CKKS key: the smallest hash of (session, advertisements, id).

    Every client computes it from the advertisements it accepted, so the server cannot name it; the
    advertisements carry each client's fresh random key, so the server cannot predict it either
    without grinding sessions (and any key holder can decrypt everything anyway: see SECURITY.md).
    """
    return min(
        client_ids,
        key=lambda cid: hashlib.sha256(
            tagged_fields(KEY_HOLDER_DOMAIN, session_id, adverts_digest, cid)
        ).digest(),
    )


def public_context_fields(
    session_id: bytes,
    digest: bytes,
    adverts_digest: bytes,
    key_holder_id: str,
    public_context: bytes,
    secret_digest: bytes,
) -> tuple[bytes, tuple]:
    """(domain, fields) the key holder signs: the transcript, the digest of the public context and
    the digest of the secret context it seals for every peer (each peer checks its copy)."""
    return KEYS_DOMAIN, (
        session_id,
        digest,
        adverts_digest,
        key_holder_id,
        hashlib.sha256(public_context).digest(),
        secret_digest,
    )


def secret_context_digest(secret: bytes) -> bytes:
    """SHA-256 of the serialised secret context (the key holder commits to it)."""
    return hashlib.sha256(b"secure-afl/ckks/v1/secret-context\x00" + secret).digest()


def context_encryption_key(shared_secret: bytes, session_id: bytes, sender: str, recipient: str) -> bytes:
    """AES-256-GCM key for the secret context from ``sender`` to ``recipient`` (HKDF-SHA256 of X25519)."""
    info = tagged_fields(CONTEXT_KEY_DOMAIN, session_id, sender, recipient)
    return HKDF(algorithm=hashes.SHA256(), length=crypto.KEY_BYTES, salt=None, info=info).derive(
        shared_secret
    )


def context_associated_data(session_id: bytes, sender: str, recipient: str, public_context: bytes) -> bytes:
    """The AEAD's associated data: session, both ends and the public context the secret one belongs to."""
    return tagged_fields(
        CONTEXT_AD_DOMAIN, session_id, sender, recipient, hashlib.sha256(public_context).digest()
    )


def tensor_digests(tensors: Iterable[EncryptedTensor]) -> tuple[TensorDigests, ...]:
    """Every chunk's SHA-256, per tensor, in order: what an upload's signature covers."""
    return tuple(
        TensorDigests(t.group, t.tensor, tuple(hashlib.sha256(chunk).digest() for chunk in t.chunks))
        for t in tensors
    )


def input_fields(
    session_id: bytes, digest: bytes, sender: str, tensors: Iterable[EncryptedTensor]
) -> tuple[bytes, tuple]:
    """(domain, fields) a client signs over its upload: every chunk's SHA-256, in order."""
    return input_fields_of_digests(session_id, digest, sender, tensor_digests(tensors))


def input_fields_of_digests(
    session_id: bytes, digest: bytes, sender: str, digests: Iterable[TensorDigests]
) -> tuple[bytes, tuple]:
    """:func:`input_fields` from the chunk digests alone (a decryptor checks an upload by them)."""
    entries = sequence(
        tagged_fields(INPUT_TENSOR_DOMAIN, d.group, d.tensor, sequence(d.chunk_digests)) for d in digests
    )
    return INPUT_DOMAIN, (session_id, digest, sender, entries)


def upload_digest(sender: str, digests: Iterable[TensorDigests], signature: bytes) -> bytes:
    """SHA-256 of one upload as a view names it: its sender, every chunk digest it signed, in order,
    and its signature (a second, differently encrypted upload of one client has another digest)."""
    entries = sequence(
        tagged_fields(INPUT_TENSOR_DOMAIN, d.group, d.tensor, sequence(d.chunk_digests)) for d in digests
    )
    return hashlib.sha256(tagged_fields(UPLOAD_DOMAIN, sender, entries, signature)).digest()


def view_fields(
    session_id: bytes, digest: bytes, adverts_digest: bytes, uploads: Iterable[UploadEntry]
) -> tuple[bytes, tuple]:
    """(domain, fields) a survivor signs in R3, once per session: the session (id, config and the
    accepted advertisements) and every upload that counts, as (sender, upload digest), in order."""
    entries = sequence(tagged_fields(VIEW_ENTRY_DOMAIN, u.sender, u.digest) for u in uploads)
    return VIEW_DOMAIN, (session_id, digest, adverts_digest, entries)


def view_digest(
    session_id: bytes, digest: bytes, adverts_digest: bytes, uploads: Iterable[UploadEntry]
) -> bytes:
    """SHA-256 of :func:`view_fields`: what the one-answer records of R3 and R4 keep."""
    domain, fields = view_fields(session_id, digest, adverts_digest, uploads)
    return hashlib.sha256(tagged_fields(domain, *fields)).digest()


def decryption_fields(
    session_id: bytes,
    digest: bytes,
    adverts_digest: bytes,
    view: bytes,
    group: str,
    chunks: tuple[int, ...],
    survivors: tuple[str, ...],
    uploads: Iterable[SignedUpload],
    plaintexts: Iterable[DecryptedChunk],
) -> tuple[bytes, tuple]:
    """(domain, fields) a decryptor signs: the view it decrypted under (:func:`view_digest`), the
    group and the chunk indices it decrypted (:func:`~secure_afl.protocol.ckks.context.group_chunks`),
    whose signed ciphertexts it summed (each survivor's, by digest, in the chunks' order), and each
    chunk's result."""
    cipher = sequence(
        tagged_fields(
            DECRYPTED_CHUNK_DOMAIN, u.sender, sequence(hashlib.sha256(c).digest() for c in u.chunks)
        )
        for u in sorted(uploads, key=lambda upload: upload.sender)
    )
    plain = sequence(
        tagged_fields(DECRYPTED_CHUNK_DOMAIN, c.index, hashlib.sha256(c.data).digest()) for c in plaintexts
    )
    return DECRYPTION_DOMAIN, (
        session_id,
        digest,
        adverts_digest,
        view,
        group,
        sequence(tagged_fields(DECRYPTED_CHUNK_DOMAIN, k) for k in chunks),
        tuple(sorted(survivors)),
        cipher,
        plain,
    )
