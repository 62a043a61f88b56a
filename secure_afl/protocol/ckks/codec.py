"""The CKKS backend's strict binary wire codec (same rules as :mod:`secure_afl.protocol.codec`).

Layout: ``version (1 byte, 0xC1: never a masking message) || type tag (1 byte) || fields``.
Strings, fixed-size fields and sequences as in the masking codec; TenSEAL blobs (contexts,
ciphertexts) and float64 data are a 4-byte length then the bytes.  Decoding rejects unknown
versions or types, truncation, trailing bytes, wrong fixed sizes, blobs larger than the session's
parameters allow and anything longer than ``max_message_bytes``.  Blobs are never unpickled:
TenSEAL parses them (protocol buffers) only after the codec bounded their size.
"""

from __future__ import annotations

from collections.abc import Callable

from secure_afl.core.errors import LocalProtocolError, MessageDecodeError
from secure_afl.protocol.codec import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DIGEST_BYTES,
    MAX_STRING_FIELD,
    SESSION_ID_BYTES,
    Reader,
    Writer,
    decode_frame,
    encode_frame,
)
from secure_afl.protocol.crypto import KEY_BYTES, NONCE_BYTES, SIGNATURE_BYTES
from secure_afl.protocol.messages import GroupSpec, TensorSpec

from .context import CkksParameters
from .messages import (
    CkksAdvertise,
    CkksAdvertiseRequest,
    CkksDecryption,
    CkksDecryptRequest,
    CkksInput,
    CkksInputRequest,
    CkksKeyDistribution,
    CkksKeyRequest,
    CkksMessage,
    CkksSessionConfig,
    CkksViewRequest,
    CkksViewSignature,
    DecryptedChunk,
    DecryptedGroup,
    EncryptedContext,
    EncryptedTensor,
    GroupUploads,
    SignedUpload,
    TensorDigests,
    UploadEntry,
)

# 0xC1 sent group sums for decryption; 0xC2 the signed uploads; 0xC3 the signed view (R3); 0xC4 a
# group's decryption split by chunk (R4 names chunk indices, each decryptor gets only its chunks)
WIRE_VERSION = 0xC4
MAX_TENSOR_VALUES = ((1 << 32) - 1) // 8
_TAGS: dict[type, int] = {
    CkksAdvertiseRequest: 1,
    CkksAdvertise: 2,
    CkksKeyRequest: 3,
    CkksKeyDistribution: 4,
    CkksInputRequest: 5,
    CkksInput: 6,
    CkksDecryptRequest: 7,
    CkksDecryption: 8,
    CkksViewRequest: 9,
    CkksViewSignature: 10,
}
_BLOB_PREFIX = 4
_AEAD_TAG = 16


def max_message_bytes(config: CkksSessionConfig, n_clients: int) -> int:
    """The largest message an honest party of a session over ``config`` with ``n_clients`` sends."""
    p = config.parameters
    s = MAX_STRING_FIELD
    ct = _BLOB_PREFIX + p.max_ciphertext_bytes()
    sealed_context = s + s + NONCE_BYTES + _BLOB_PREFIX + p.max_context_bytes() + _AEAD_TAG
    public_context = _BLOB_PREFIX + p.max_context_bytes()
    encrypted = plain = digests = uploads = 0
    config_bytes = SESSION_ID_BYTES + 4 + 4 + 4 + 16 + 2 + 4
    for group in config.groups:
        config_bytes += s + 4 + len(group.tensors) * (s + 4)
        encrypted += s + 4 + SIGNATURE_BYTES
        for tensor in group.tensors:
            encrypted += s + s + 4 + p.chunks(tensor.length) * ct
            digests += s + s + 4 + p.chunks(tensor.length) * DIGEST_BYTES
            plain += s + _BLOB_PREFIX + 8 * tensor.length
    chunks = 0
    for group in config.groups:  # every survivor's upload of every group, with its digests
        group_chunks = sum(p.chunks(t.length) for t in group.tensors)
        chunks += group_chunks
        uploads += (
            s + 4 + 4 * group_chunks + 4
            + n_clients * (s + 4 + digests + SIGNATURE_BYTES + 4 + group_chunks * ct)
        )  # fmt: skip
    advert = SESSION_ID_BYTES + s + KEY_BYTES + DIGEST_BYTES + 4 + len(config.groups) * s + SIGNATURE_BYTES
    view = 4 + n_clients * (s + DIGEST_BYTES)
    view_signature = SESSION_ID_BYTES + s + SIGNATURE_BYTES
    bodies = (
        config_bytes,
        advert,
        SESSION_ID_BYTES + 4 + n_clients * advert,
        SESSION_ID_BYTES
        + s
        + public_context
        + DIGEST_BYTES
        + SIGNATURE_BYTES
        + 4
        + n_clients * sealed_context,
        SESSION_ID_BYTES + s + public_context + DIGEST_BYTES + SIGNATURE_BYTES + 1 + sealed_context,
        SESSION_ID_BYTES + s + 4 + encrypted + SIGNATURE_BYTES,  # CkksInput
        SESSION_ID_BYTES + view,  # CkksViewRequest
        SESSION_ID_BYTES + view + 4 + n_clients * view_signature + 4 + uploads,  # CkksDecryptRequest
        SESSION_ID_BYTES + s + 4 + plain + chunks * 8 + len(config.groups) * (s + 4 + SIGNATURE_BYTES),
    )
    return 2 + max(bodies)


# --- writing --------------------------------------------------------------------------------------


def _blob(w: Writer, value: bytes, what: str) -> None:
    if not isinstance(value, bytes) or len(value) >= 1 << 32:
        raise LocalProtocolError(f"{what} must be bytes shorter than 4 GiB")
    w.uint(len(value), 4)
    w.parts.append(value)


def _typed(expected: type, write: Callable[[Writer, object], None], w: Writer) -> Callable[[object], None]:
    def write_item(item: object) -> None:
        if type(item) is not expected:
            raise LocalProtocolError(f"expected {expected.__name__}, got {type(item).__name__}")
        write(w, item)

    return write_item


def _write_config(w: Writer, c: CkksSessionConfig) -> None:
    w.fixed(c.session_id, SESSION_ID_BYTES, "session id")
    w.uint(c.min_group_size, 4)
    p = c.parameters
    w.uint(p.poly_modulus_degree, 4)
    w.sequence(p.coeff_mod_bit_sizes, lambda bits: w.uint(bits, 1))  # type: ignore[arg-type]
    w.uint(p.scale_bits, 1)
    w.uint(p.output_frac_bits, 1)
    w.sequence(
        c.groups,
        lambda g: (
            w.string(g.name),
            w.sequence(g.tensors, lambda t: (w.string(t.name), w.uint(t.length, 4))),
        ),
    )  # type: ignore[arg-type,union-attr]


def _write_advert(w: Writer, m: CkksAdvertise) -> None:
    w.fixed(m.session_id, SESSION_ID_BYTES, "session id")
    w.string(m.client_id)
    w.fixed(m.encryption_public_key, KEY_BYTES, "encryption public key")
    w.fixed(m.config_digest, DIGEST_BYTES, "config digest")
    w.sequence(m.groups, w.string)  # type: ignore[arg-type]
    w.fixed(m.signature, SIGNATURE_BYTES, "signature")
    w.sequence(m.rows, lambda v: w.uint(v, 8))  # type: ignore[arg-type]


def _write_sealed(w: Writer, m: EncryptedContext) -> None:
    w.string(m.sender)
    w.string(m.recipient)
    w.fixed(m.nonce, NONCE_BYTES, "nonce")
    _blob(w, m.ciphertext, "encrypted context")


def _write_chunks(w: Writer, chunks: tuple[bytes, ...]) -> None:
    w.sequence(chunks, lambda chunk: _blob(w, chunk, "ciphertext"))  # type: ignore[arg-type]


def _write_input_request(w: Writer, m: CkksInputRequest) -> None:
    w.fixed(m.session_id, SESSION_ID_BYTES, "session id")
    w.string(m.key_holder)
    _blob(w, m.public_context, "public context")
    w.fixed(m.secret_digest, DIGEST_BYTES, "secret context digest")
    w.fixed(m.signature, SIGNATURE_BYTES, "signature")
    w.uint(0 if m.context is None else 1, 1)
    if m.context is not None:
        _typed(EncryptedContext, _write_sealed, w)(m.context)


def _write_encrypted_tensor(w: Writer, m: EncryptedTensor) -> None:
    w.string(m.group)
    w.string(m.tensor)
    _write_chunks(w, m.chunks)


def _write_digests(w: Writer, m: TensorDigests) -> None:
    w.string(m.group)
    w.string(m.tensor)
    w.sequence(m.chunk_digests, lambda d: w.fixed(d, DIGEST_BYTES, "chunk digest"))  # type: ignore[arg-type]


def _write_upload(w: Writer, m: SignedUpload) -> None:
    w.string(m.sender)
    w.sequence(m.digests, _typed(TensorDigests, _write_digests, w))  # type: ignore[arg-type]
    w.fixed(m.signature, SIGNATURE_BYTES, "signature")
    _write_chunks(w, m.chunks)


def _write_indices(w: Writer, indices: tuple[int, ...]) -> None:
    w.sequence(indices, lambda k: w.uint(k, 4))  # type: ignore[arg-type]


def _write_group_uploads(w: Writer, m: GroupUploads) -> None:
    w.string(m.group)
    _write_indices(w, m.chunks)
    w.sequence(m.uploads, _typed(SignedUpload, _write_upload, w))  # type: ignore[arg-type]


def _write_entry(w: Writer, m: UploadEntry) -> None:
    w.string(m.sender)
    w.fixed(m.digest, DIGEST_BYTES, "upload digest")


def _write_view_signature(w: Writer, m: CkksViewSignature) -> None:
    w.fixed(m.session_id, SESSION_ID_BYTES, "session id")
    w.string(m.sender)
    w.fixed(m.signature, SIGNATURE_BYTES, "signature")


def _write_decrypted_group(w: Writer, m: DecryptedGroup) -> None:
    w.string(m.group)
    w.sequence(
        m.chunks, _typed(DecryptedChunk, lambda w, c: (w.uint(c.index, 4), _blob(w, c.data, "values")), w)
    )  # type: ignore[arg-type,union-attr]
    w.fixed(m.signature, SIGNATURE_BYTES, "signature")


_WRITERS: dict[type, Callable[[Writer, object], None]] = {
    CkksAdvertiseRequest: lambda w, m: _write_config(w, m.config),
    CkksAdvertise: _write_advert,  # type: ignore[dict-item]
    CkksKeyRequest: lambda w, m: (
        w.fixed(m.session_id, SESSION_ID_BYTES, "session id"),
        w.sequence(m.advertisements, _typed(CkksAdvertise, _write_advert, w)),  # type: ignore[arg-type]
    ),
    CkksKeyDistribution: lambda w, m: (
        w.fixed(m.session_id, SESSION_ID_BYTES, "session id"),
        w.string(m.sender),
        _blob(w, m.public_context, "public context"),
        w.fixed(m.secret_digest, DIGEST_BYTES, "secret context digest"),
        w.fixed(m.signature, SIGNATURE_BYTES, "signature"),
        w.sequence(m.contexts, _typed(EncryptedContext, _write_sealed, w)),  # type: ignore[arg-type]
    ),
    CkksInputRequest: _write_input_request,  # type: ignore[dict-item]
    CkksInput: lambda w, m: (
        w.fixed(m.session_id, SESSION_ID_BYTES, "session id"),
        w.string(m.sender),
        w.sequence(m.tensors, _typed(EncryptedTensor, _write_encrypted_tensor, w)),  # type: ignore[arg-type]
        w.fixed(m.signature, SIGNATURE_BYTES, "signature"),
    ),
    CkksViewRequest: lambda w, m: (
        w.fixed(m.session_id, SESSION_ID_BYTES, "session id"),
        w.sequence(m.uploads, _typed(UploadEntry, _write_entry, w)),  # type: ignore[arg-type]
    ),
    CkksViewSignature: _write_view_signature,  # type: ignore[dict-item]
    CkksDecryptRequest: lambda w, m: (
        w.fixed(m.session_id, SESSION_ID_BYTES, "session id"),
        w.sequence(m.uploads, _typed(UploadEntry, _write_entry, w)),  # type: ignore[arg-type]
        w.sequence(m.signatures, _typed(CkksViewSignature, _write_view_signature, w)),  # type: ignore[arg-type]
        w.sequence(m.groups, _typed(GroupUploads, _write_group_uploads, w)),  # type: ignore[arg-type]
    ),
    CkksDecryption: lambda w, m: (
        w.fixed(m.session_id, SESSION_ID_BYTES, "session id"),
        w.string(m.sender),
        w.sequence(m.groups, _typed(DecryptedGroup, _write_decrypted_group, w)),  # type: ignore[arg-type]
    ),
}


def encode(message: CkksMessage, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> bytes:
    """The wire bytes of ``message``; malformed fields raise :class:`LocalProtocolError`."""
    return encode_frame(
        message,
        version=WIRE_VERSION,
        tags=_TAGS,
        writers=_WRITERS,  # type: ignore[arg-type]
        max_message_bytes=max_message_bytes,
        kind="CKKS",
    )


# --- reading --------------------------------------------------------------------------------------


def _read_blob(r: Reader) -> bytes:
    return r.take(r.uint(4))


def _read_config(r: Reader) -> CkksSessionConfig:
    session_id = r.take(SESSION_ID_BYTES)
    min_group_size = r.uint(4)
    degree = r.uint(4)
    moduli = r.sequence(lambda: r.uint(1), 1)
    parameters = CkksParameters(degree, moduli, r.uint(1), r.uint(1))
    groups = r.sequence(
        lambda: GroupSpec(r.string(), r.sequence(lambda: TensorSpec(r.string(), r.uint(4)), 7)), 7
    )
    return CkksSessionConfig(session_id, min_group_size, parameters, groups)


def _read_advert(r: Reader) -> CkksAdvertise:
    return CkksAdvertise(
        r.take(SESSION_ID_BYTES),
        r.string(),
        r.take(KEY_BYTES),
        r.take(DIGEST_BYTES),
        r.sequence(r.string, 3),
        r.take(SIGNATURE_BYTES),
        r.sequence(lambda: r.uint(8), 3),
    )


def _read_sealed(r: Reader) -> EncryptedContext:
    return EncryptedContext(r.string(), r.string(), r.take(NONCE_BYTES), _read_blob(r))


def _read_chunks(r: Reader) -> tuple[bytes, ...]:
    return r.sequence(lambda: _read_blob(r), _BLOB_PREFIX)


def _read_input_request(r: Reader) -> CkksInputRequest:
    session_id, holder, public, secret_digest, signature = (
        r.take(SESSION_ID_BYTES),
        r.string(),
        _read_blob(r),
        r.take(DIGEST_BYTES),
        r.take(SIGNATURE_BYTES),
    )
    flag = r.uint(1)
    if flag not in (0, 1):
        raise MessageDecodeError(f"context flag must be 0 or 1, got {flag}")
    sealed = _read_sealed(r) if flag else None
    return CkksInputRequest(session_id, holder, public, secret_digest, signature, sealed)


def _read_upload(r: Reader) -> SignedUpload:
    return SignedUpload(
        r.string(),
        r.sequence(
            lambda: TensorDigests(
                r.string(), r.string(), r.sequence(lambda: r.take(DIGEST_BYTES), DIGEST_BYTES)
            ),
            10,
        ),
        r.take(SIGNATURE_BYTES),
        _read_chunks(r),
    )


def _read_entries(r: Reader) -> tuple[UploadEntry, ...]:
    return r.sequence(lambda: UploadEntry(r.string(), r.take(DIGEST_BYTES)), 3 + DIGEST_BYTES)


def _read_view_signature(r: Reader) -> CkksViewSignature:
    return CkksViewSignature(r.take(SESSION_ID_BYTES), r.string(), r.take(SIGNATURE_BYTES))


_READERS: dict[int, Callable[[Reader], CkksMessage]] = {
    1: lambda r: CkksAdvertiseRequest(_read_config(r)),
    2: _read_advert,
    3: lambda r: CkksKeyRequest(r.take(SESSION_ID_BYTES), r.sequence(lambda: _read_advert(r), 140)),
    4: lambda r: CkksKeyDistribution(
        r.take(SESSION_ID_BYTES),
        r.string(),
        _read_blob(r),
        r.take(DIGEST_BYTES),
        r.take(SIGNATURE_BYTES),
        r.sequence(lambda: _read_sealed(r), 20),
    ),
    5: _read_input_request,
    6: lambda r: CkksInput(
        r.take(SESSION_ID_BYTES),
        r.string(),
        r.sequence(lambda: EncryptedTensor(r.string(), r.string(), _read_chunks(r)), 10),
        r.take(SIGNATURE_BYTES),
    ),
    7: lambda r: CkksDecryptRequest(
        r.take(SESSION_ID_BYTES),
        _read_entries(r),
        r.sequence(lambda: _read_view_signature(r), SESSION_ID_BYTES + 3 + SIGNATURE_BYTES),
        r.sequence(
            lambda: GroupUploads(
                r.string(), r.sequence(lambda: r.uint(4), 4), r.sequence(lambda: _read_upload(r), 75)
            ),
            11,
        ),
    ),
    8: lambda r: CkksDecryption(
        r.take(SESSION_ID_BYTES),
        r.string(),
        r.sequence(
            lambda: DecryptedGroup(
                r.string(),
                r.sequence(lambda: DecryptedChunk(r.uint(4), _read_blob(r)), 8),
                r.take(SIGNATURE_BYTES),
            ),
            71,
        ),
    ),
    9: lambda r: CkksViewRequest(r.take(SESSION_ID_BYTES), _read_entries(r)),
    10: _read_view_signature,
}


def decode(data: bytes, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> CkksMessage:
    """Parse wire bytes; anything but one exact, well-formed message raises :class:`MessageDecodeError`."""
    message = decode_frame(
        data, version=WIRE_VERSION, readers=_READERS, max_message_bytes=max_message_bytes, kind="CKKS"
    )
    return message  # type: ignore[return-value]
