"""The strict binary wire codec.

Layout: ``version (1 byte) || type tag (1 byte) || fields``.  Integers are big-endian; strings are a
2-byte length then UTF-8 (1..255 bytes, valid UTF-8); sequences are a 4-byte count then items;
keys, digests, signatures, nonces, share ciphertexts and revealed shares have exact fixed sizes;
masked tensors are a 4-byte length (a multiple of 8) then little-endian uint64 words.

Decoding rejects, with :class:`MessageDecodeError`: an unknown version or type, truncated data,
trailing bytes, wrong fixed sizes, invalid UTF-8, counts that cannot fit in the remaining bytes,
and anything longer than ``max_message_bytes``.  Every valid encoding is canonical: decoding then
encoding gives back the same bytes.

The size limit follows the session: :func:`max_message_bytes` derives, from the session's group
layout and the roster size, the largest message that an honest party of that session can send (in
practice a :class:`MaskedInput` carrying every tensor of every group).  Drivers pass it to
:func:`encode` and :func:`decode` (``ClientSession.max_message_bytes`` and
``ServerSession.max_message_bytes`` give it once the config is known); ``DEFAULT_MAX_MESSAGE_BYTES``
is only the limit for the first message a client decodes, the :class:`AdvertiseRequest` that
carries the config.
"""

from __future__ import annotations

import contextlib
import io
import struct
import sys
from collections.abc import Callable, Collection, Sequence
from functools import lru_cache
from itertools import chain
from typing import TypeVar

import numpy as np

from secure_afl.core.errors import LocalProtocolError, MessageDecodeError

from . import shamir
from .crypto import KEY_BYTES, NONCE_BYTES, SIGNATURE_BYTES, TAG_BYTES
from .messages import (
    AdvertiseKeys,
    AdvertiseRequest,
    ConsistencyCheckRequest,
    ConsistencyResponse,
    EncryptedShare,
    EncryptedShares,
    GroupSpec,
    MaskedInput,
    MaskedInputRequest,
    MaskedTensor,
    Message,
    RevealedShare,
    RevealedShares,
    SessionConfig,
    ShareKeys,
    ShareKeysRequest,
    SurvivorSignature,
    TensorSpec,
    UnmaskRequest,
    UnmaskResponse,
)

PROTOCOL_VERSION = 1
SESSION_ID_BYTES = 32
DIGEST_BYTES = 32
MAX_STRING_BYTES = 255
# Shares of the self-mask seed and of the mask key, each one field element.
SHARE_PLAINTEXT_BYTES = 2 * shamir.VALUE_BYTES
SHARE_CIPHERTEXT_BYTES = SHARE_PLAINTEXT_BYTES + TAG_BYTES
# The limit before a session's layout is known (the AdvertiseRequest that carries it); once it is,
# use max_message_bytes(config, n_clients), which may be larger (or much smaller).
DEFAULT_MAX_MESSAGE_BYTES = 1 << 28  # 256 MiB
_HEADER_BYTES = 2  # version, type tag
_COUNT_BYTES = 4
MAX_STRING_FIELD = 2 + MAX_STRING_BYTES
# The most uint64 words one masked tensor can carry: its byte length has a 4-byte prefix.
MAX_TENSOR_WORDS = ((1 << 32) - 1) // 8

_TYPE_TAGS: dict[type, int] = {
    AdvertiseRequest: 1,
    AdvertiseKeys: 2,
    ShareKeysRequest: 3,
    ShareKeys: 4,
    MaskedInputRequest: 5,
    MaskedInput: 6,
    ConsistencyCheckRequest: 7,
    ConsistencyResponse: 8,
    UnmaskRequest: 9,
    UnmaskResponse: 10,
}


def message_limits(
    config: SessionConfig, n_clients: int, *, groups: Collection[str] | None = None
) -> dict[type, int]:
    """Per message type, an upper bound on the encoded size an honest party of the session sends.

    Every string is taken at the codec's maximum length.  Only :class:`MaskedInput` grows with the
    tensors' lengths, and only with those of the groups its sender is in: ``groups`` names them
    (a client passes its own groups; ``None``, every group, is what the server must accept).  The
    other types grow with the number of clients and of groups (the group lists of advertisements),
    never with tensor lengths, so a layout's large tensors in groups a client is not in do not
    raise any of that client's limits.
    """
    if not isinstance(n_clients, int) or n_clients < 1:
        raise LocalProtocolError(f"n_clients must be a positive integer, got {n_clients!r}")
    n = n_clients
    s = MAX_STRING_FIELD
    n_groups = len(config.groups)
    wanted = None if groups is None else set(groups)
    config_bytes = SESSION_ID_BYTES + 4 + 4 + 1 + _COUNT_BYTES
    masked_tensors = 0
    for group in config.groups:
        config_bytes += s + _COUNT_BYTES + len(group.tensors) * (s + 4)
        for tensor in group.tensors:
            if not isinstance(tensor.length, int) or tensor.length < 0:
                raise LocalProtocolError(f"tensor {tensor.name!r}: invalid length {tensor.length!r}")
            if tensor.length > MAX_TENSOR_WORDS:
                raise LocalProtocolError(
                    f"tensor {group.name!r}/{tensor.name!r} of {tensor.length} words does not fit in one "
                    f"masked-tensor field (at most {MAX_TENSOR_WORDS} words)"
                )
            if wanted is None or group.name in wanted:
                masked_tensors += s + s + 4 + 8 * tensor.length
    advert = SESSION_ID_BYTES + s + 4 * KEY_BYTES + _COUNT_BYTES + n_groups * s + SIGNATURE_BYTES
    share = s + s + NONCE_BYTES + SHARE_CIPHERTEXT_BYTES
    bodies = {
        AdvertiseRequest: config_bytes,
        AdvertiseKeys: advert,
        ShareKeysRequest: SESSION_ID_BYTES + _COUNT_BYTES + n * advert,
        ShareKeys: SESSION_ID_BYTES + s + _COUNT_BYTES + n * share,  # n - 1 peers; n is an upper bound
        MaskedInputRequest: SESSION_ID_BYTES + _COUNT_BYTES + n * share,
        MaskedInput: SESSION_ID_BYTES + s + _COUNT_BYTES + masked_tensors,
        ConsistencyCheckRequest: SESSION_ID_BYTES + _COUNT_BYTES + n * s,
        ConsistencyResponse: SESSION_ID_BYTES + s + SIGNATURE_BYTES,
        UnmaskRequest: SESSION_ID_BYTES + 4 * _COUNT_BYTES + n * (3 * s + s + SIGNATURE_BYTES),
        UnmaskResponse: SESSION_ID_BYTES + s + 2 * _COUNT_BYTES + 2 * n * (s + shamir.VALUE_BYTES),
    }
    return {kind: _HEADER_BYTES + body for kind, body in bodies.items()}


def max_message_bytes(config: SessionConfig, n_clients: int) -> int:
    """The largest message any honest party of a session over ``config`` with ``n_clients`` sends.

    The maximum of :func:`message_limits` over every type, in practice a :class:`MaskedInput`
    carrying every tensor of every group (a client may belong to all groups).  A message above this
    bound cannot be legitimate and is rejected.  Clients bound each type separately instead.
    """
    return max(message_limits(config, n_clients).values())


# --- writing --------------------------------------------------------------------------------------


class Writer:
    """Appends fixed-width fields to one frame (both backends' codecs write with it)."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def uint(self, value: int, size: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << (8 * size):
            raise LocalProtocolError(f"integer field {value!r} does not fit in {size} bytes")
        self.parts.append(value.to_bytes(size, "big"))

    def fixed(self, value: bytes, size: int, what: str) -> None:
        if not isinstance(value, bytes) or len(value) != size:
            raise LocalProtocolError(f"{what} must be exactly {size} bytes")
        self.parts.append(value)

    def string(self, value: str) -> None:
        if not isinstance(value, str):
            raise LocalProtocolError(f"expected a string, got {type(value).__name__}")
        raw = value.encode("utf-8")
        if not 1 <= len(raw) <= MAX_STRING_BYTES:
            raise LocalProtocolError(f"string {value!r} must be 1..{MAX_STRING_BYTES} UTF-8 bytes")
        # The length is in range (checked above): no second check (n² share names at n = 1,000).
        self.parts += (len(raw).to_bytes(2, "big"), raw)

    def words(self, value: bytes | memoryview) -> None:
        # A decoded MaskedTensor carries a read-only view of the received bytes (see Reader.words):
        # it encodes again to the same bytes, so views of whole bytes are accepted as well.
        if isinstance(value, memoryview) and value.c_contiguous:
            size = value.nbytes
        elif isinstance(value, bytes):
            size = len(value)
        else:
            size = -1
        if size < 0 or size % 8:
            raise LocalProtocolError("masked tensor data must be bytes of whole uint64 words")
        self.uint(size, 4)
        self.parts.append(value)  # type: ignore[arg-type]

    def sequence(self, items: tuple, write_item: Callable[[object], None]) -> None:
        if not isinstance(items, tuple):
            raise LocalProtocolError("sequence fields must be tuples")
        self.uint(len(items), 4)
        for item in items:
            write_item(item)


def encode_frame(
    message: object,
    *,
    version: int,
    tags: dict[type, int],
    writers: dict[type, Callable[[Writer, object], object]],
    max_message_bytes: int,
    kind: str,
) -> bytes:
    """``version || tag || fields`` for any backend's message set (the CKKS codec uses it too)."""
    tag = tags.get(type(message))
    if tag is None:
        raise LocalProtocolError(f"not a {kind} message: {type(message).__name__}")
    w = Writer()
    w.uint(version, 1)
    w.uint(tag, 1)
    writers[type(message)](w, message)
    data = b"".join(w.parts)
    if len(data) > max_message_bytes:
        raise LocalProtocolError(f"message of {len(data)} bytes exceeds the limit of {max_message_bytes}")
    return data


def decode_frame(
    data: bytes,
    *,
    version: int,
    readers: dict[int, Callable[[Reader], object]],
    max_message_bytes: int,
    kind: str,
) -> object:
    """Parse ``version || tag || fields``: anything but one exact, well-formed message of this
    message set raises :class:`MessageDecodeError`, before anything larger than the limit is read."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise LocalProtocolError(f"decode expects bytes, got {type(data).__name__}")
    if len(data) > max_message_bytes:
        raise MessageDecodeError(f"message of {len(data)} bytes exceeds the limit of {max_message_bytes}")
    r = Reader(bytes(data))
    found = r.uint(1)
    if found != version:
        raise MessageDecodeError(f"not a {kind} message (version byte {found:#x}, expected {version:#x})")
    tag = r.uint(1)
    read = readers.get(tag)
    if read is None:
        raise MessageDecodeError(f"unknown {kind} message type {tag}")
    message = read(r)
    r.finish()
    return message


def encode(message: Message, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> bytes:
    """The wire bytes of ``message``; malformed fields raise :class:`LocalProtocolError`."""
    return encode_frame(
        message,
        version=PROTOCOL_VERSION,
        tags=_TYPE_TAGS,
        writers=_WRITERS,  # type: ignore[arg-type]
        max_message_bytes=max_message_bytes,
        kind="masking protocol",
    )


def _write_config(w: Writer, config: SessionConfig) -> None:
    w.fixed(config.session_id, SESSION_ID_BYTES, "session id")
    w.uint(config.threshold, 4)
    w.uint(config.min_group_size, 4)
    w.uint(config.frac_bits, 1)
    w.sequence(config.groups, lambda group: _write_group(w, group))


def _write_group(w: Writer, group: GroupSpec) -> None:
    w.string(group.name)
    w.sequence(group.tensors, lambda tensor: _write_tensor_spec(w, tensor))


def _write_tensor_spec(w: Writer, tensor: TensorSpec) -> None:
    w.string(tensor.name)
    w.uint(tensor.length, 4)


def _write_advertise_keys(w: Writer, m: AdvertiseKeys) -> None:
    w.fixed(m.session_id, SESSION_ID_BYTES, "session id")
    w.string(m.client_id)
    w.fixed(m.encryption_public_key, KEY_BYTES, "encryption public key")
    w.fixed(m.mask_public_key, KEY_BYTES, "mask public key")
    w.fixed(m.self_mask_commitment, DIGEST_BYTES, "self-mask commitment")
    w.fixed(m.config_digest, DIGEST_BYTES, "config digest")
    w.sequence(m.groups, w.string)  # type: ignore[arg-type]
    w.fixed(m.signature, SIGNATURE_BYTES, "signature")
    w.sequence(m.rows, lambda v: w.uint(v, 8))  # type: ignore[arg-type]


def _write_encrypted_share(w: Writer, share: EncryptedShare) -> None:
    w.string(share.sender)
    w.string(share.recipient)
    w.fixed(share.nonce, NONCE_BYTES, "nonce")
    w.fixed(share.ciphertext, SHARE_CIPHERTEXT_BYTES, "share ciphertext")


def _write_encrypted_shares(w: Writer, shares: tuple | EncryptedShares) -> None:
    """A sequence of :func:`_write_encrypted_share`, each item's checks in one loop (n² shares at
    n = 1,000), the name fields from a cache of the session's names; an item that fails one is
    written by the field writers, which raise their error.  :class:`EncryptedShares` are checked
    and written a column at a time where they can be, else item by item (the same errors)."""
    if type(shares) is EncryptedShares:
        if _write_share_columns(w, shares):
            return
        shares = tuple(shares)
    if not isinstance(shares, tuple):
        raise LocalProtocolError("sequence fields must be tuples")
    w.uint(len(shares), 4)
    parts = w.parts
    # One pass, each share touched once: the requests take each share from another sender's
    # message, so a share's fields are rarely in the cache (a pass per field cost more).
    prefixed = _PREFIXED_NAMES.get
    for share in shares:
        if type(share) is EncryptedShare:
            sender, recipient, nonce, ciphertext = (
                share.sender,
                share.recipient,
                share.nonce,
                share.ciphertext,
            )
            if (
                type(sender) is str
                and type(recipient) is str
                and type(nonce) is bytes
                and type(ciphertext) is bytes
                and len(nonce) == NONCE_BYTES
                and len(ciphertext) == SHARE_CIPHERTEXT_BYTES
            ):
                raw_sender = prefixed(sender)
                raw_recipient = prefixed(recipient)
                if raw_sender is not None and raw_recipient is not None:
                    parts += (raw_sender, raw_recipient, nonce, ciphertext)
                    continue
        _check_type(share, EncryptedShare)
        start = len(parts)
        _write_encrypted_share(w, share)  # raises, or writes a valid share: remember its names
        _remember_name(share.sender, parts[start] + parts[start + 1])
        _remember_name(share.recipient, parts[start + 2] + parts[start + 3])


_SHARE_PAYLOAD_BYTES = NONCE_BYTES + SHARE_CIPHERTEXT_BYTES


def _write_share_columns(w: Writer, shares: EncryptedShares) -> bool:
    """Write ``shares`` a column at a time (each name's field from the cache, each payload as it
    is: the wire's nonce and ciphertext back to back) where every field is valid and every name is
    cached; False, having written nothing, otherwise."""
    payloads = shares.payloads
    if payloads and (
        set(map(type, payloads)) != {bytes} or set(map(len, payloads)) != {_SHARE_PAYLOAD_BYTES}
    ):
        return False
    names = (shares.senders, shares.recipients)
    if payloads and any(set(map(type, column)) != {str} for column in names):
        return False
    prefixed = _PREFIXED_NAMES.get
    senders, recipients = (list(map(prefixed, column)) for column in names)
    if None in senders or None in recipients:
        # Names not yet cached: each distinct one checked and cached once, then looked up again.
        for name in set(shares.senders).union(shares.recipients) - _PREFIXED_NAMES.keys():
            try:
                raw = name.encode("utf-8")
            except UnicodeEncodeError:
                return False  # the item writer raises the string field's error
            if not 1 <= len(raw) <= MAX_STRING_BYTES:
                return False
            _remember_name(name, len(raw).to_bytes(2, "big") + raw)
        senders, recipients = (list(map(prefixed, column)) for column in names)
        if None in senders or None in recipients:
            return False  # the cache was cleared in between: item by item
    w.uint(len(payloads), 4)
    w.parts += chain.from_iterable(zip(senders, recipients, payloads, strict=True))
    return True


# Valid string fields (str, 1..255 UTF-8 bytes) -> ``len || UTF-8``: the few thousand names of a
# session, each encoded once instead of once per share.
_PREFIXED_NAMES: dict[str, bytes] = {}
_PREFIXED_NAMES_MAX = 1 << 16


def _remember_name(name: str, field: bytes) -> None:
    if type(name) is str:
        if len(_PREFIXED_NAMES) >= _PREFIXED_NAMES_MAX:
            _PREFIXED_NAMES.clear()
        _PREFIXED_NAMES[name] = field


def _write_masked_tensor(w: Writer, tensor: MaskedTensor) -> None:
    w.string(tensor.group)
    w.string(tensor.tensor)
    w.words(tensor.data)


class MaskedInputFrame:
    """The wire bytes of one :class:`MaskedInput`, with each tensor's words written in place.

    ``encode(MaskedInput(session_id, sender, tensors))`` needs every tensor's words as bytes, then
    joins them: a client uploading a d = 1024 Gram in 8 groups copies 34 MB twice after masking it.
    Here the frame is laid out (and checked: the same field checks, errors and size limit as
    :func:`encode`) from the tensors' names and word counts, :meth:`words` gives a writable uint64
    view of a tensor's place in the frame (the caller masks straight into it), and :meth:`finish`
    returns the frame's bytes, the same bytes :func:`encode` gives for that message, without a copy,
    and the message, whose tensors' data are read-only views of those bytes.
    """

    def __init__(
        self,
        session_id: bytes,
        sender: str,
        tensors: Sequence[tuple[str, str, int]],
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        w = Writer()
        w.uint(PROTOCOL_VERSION, 1)
        w.uint(_TYPE_TAGS[MaskedInput], 1)
        w.fixed(session_id, SESSION_ID_BYTES, "session id")
        w.string(sender)
        if not isinstance(tensors, Sequence):
            raise LocalProtocolError("sequence fields must be tuples")
        w.uint(len(tensors), 4)
        # (offset, bytes) of every field before a tensor's words, and (offset, words) of each tensor.
        prefixes: list[tuple[int, bytes]] = []
        self._places: list[tuple[str, str, int, int]] = []
        size = 0
        for group, tensor, n_words in tensors:
            w.string(group)
            w.string(tensor)
            if not isinstance(n_words, int) or isinstance(n_words, bool) or n_words < 0:
                raise LocalProtocolError("masked tensor data must be bytes of whole uint64 words")
            w.uint(8 * n_words, 4)
            prefix = b"".join(w.parts)
            w.parts.clear()
            prefixes.append((size, prefix))
            size += len(prefix)
            self._places.append((group, tensor, size, n_words))
            size += 8 * n_words
        tail = b"".join(w.parts)
        prefixes.append((size, tail))
        size += len(tail)
        if size > max_message_bytes:
            raise LocalProtocolError(f"message of {size} bytes exceeds the limit of {max_message_bytes}")
        self._session_id, self._sender = session_id, sender
        # A BytesIO over a fresh zero-filled bytes object: its buffer is written through getbuffer()
        # and getvalue() then returns that bytes object itself (CPython shares it once no view of it
        # is left; were one left, getvalue() would copy, which is slower, never different).
        self._buffer: io.BytesIO | None = io.BytesIO(bytes(size))
        self._view = self._buffer.getbuffer()
        for offset, part in prefixes:
            self._view[offset : offset + len(part)] = part

    def words(self, index: int) -> np.ndarray:
        """A writable uint64 view of tensor ``index``'s words in the frame (zero until written);
        drop it before :meth:`finish`."""
        if self._buffer is None:
            raise LocalProtocolError("the frame is finished")
        _, _, offset, n_words = self._places[index]
        return np.frombuffer(self._view, dtype="<u8", count=n_words, offset=offset)

    def finish(self) -> tuple[bytes, MaskedInput]:
        """The frame's bytes and the message they encode (its tensors' data: views of the bytes)."""
        if self._buffer is None:
            raise LocalProtocolError("the frame is finished")
        # A words() view still alive keeps the buffer exported: getvalue() copies (same bytes).
        with contextlib.suppress(BufferError):
            self._view.release()
        data = self._buffer.getvalue()
        self._buffer = None
        view = memoryview(data)
        tensors = tuple(
            MaskedTensor(group, tensor, view[offset : offset + 8 * n_words])  # type: ignore[arg-type]
            for group, tensor, offset, n_words in self._places
        )
        return data, MaskedInput(self._session_id, self._sender, tensors)


def _write_survivor_signature(w: Writer, item: SurvivorSignature) -> None:
    w.string(item.client_id)
    w.fixed(item.signature, SIGNATURE_BYTES, "signature")


def _write_revealed_share(w: Writer, item: RevealedShare) -> None:
    w.string(item.owner)
    w.fixed(item.value, shamir.VALUE_BYTES, "revealed share")


def _items(shares: object) -> object:
    """Decoded :class:`RevealedShares` as the tuple of their items (the writer's input); anything
    else as it is (the sequence writer checks it)."""
    return tuple(shares) if type(shares) is RevealedShares else shares  # type: ignore[arg-type]


def _check_type(item: object, expected: type) -> None:
    if type(item) is not expected:
        raise LocalProtocolError(f"expected {expected.__name__}, got {type(item).__name__}")


def _typed(expected: type, write: Callable[[Writer, object], None], w: Writer) -> Callable[[object], None]:
    def write_item(item: object) -> None:
        _check_type(item, expected)
        write(w, item)

    return write_item


_WRITERS: dict[type, Callable[[Writer, object], None]] = {
    AdvertiseRequest: lambda w, m: _write_config(w, m.config),
    AdvertiseKeys: _write_advertise_keys,  # type: ignore[dict-item]
    ShareKeysRequest: lambda w, m: (
        w.fixed(m.session_id, SESSION_ID_BYTES, "session id"),
        w.sequence(m.advertisements, _typed(AdvertiseKeys, _write_advertise_keys, w)),  # type: ignore[arg-type]
    ),
    ShareKeys: lambda w, m: (
        w.fixed(m.session_id, SESSION_ID_BYTES, "session id"),
        w.string(m.sender),
        _write_encrypted_shares(w, m.shares),
    ),
    MaskedInputRequest: lambda w, m: (
        w.fixed(m.session_id, SESSION_ID_BYTES, "session id"),
        _write_encrypted_shares(w, m.shares),
    ),
    MaskedInput: lambda w, m: (
        w.fixed(m.session_id, SESSION_ID_BYTES, "session id"),
        w.string(m.sender),
        w.sequence(m.tensors, _typed(MaskedTensor, _write_masked_tensor, w)),  # type: ignore[arg-type]
    ),
    ConsistencyCheckRequest: lambda w, m: (
        w.fixed(m.session_id, SESSION_ID_BYTES, "session id"),
        w.sequence(m.survivors, w.string),  # type: ignore[arg-type]
    ),
    ConsistencyResponse: lambda w, m: (
        w.fixed(m.session_id, SESSION_ID_BYTES, "session id"),
        w.string(m.sender),
        w.fixed(m.signature, SIGNATURE_BYTES, "signature"),
    ),
    UnmaskRequest: lambda w, m: (
        w.fixed(m.session_id, SESSION_ID_BYTES, "session id"),
        w.sequence(m.survivors, w.string),  # type: ignore[arg-type]
        w.sequence(m.signatures, _typed(SurvivorSignature, _write_survivor_signature, w)),  # type: ignore[arg-type]
        w.sequence(m.reveal_self_mask_of, w.string),  # type: ignore[arg-type]
        w.sequence(m.reveal_mask_key_of, w.string),  # type: ignore[arg-type]
    ),
    UnmaskResponse: lambda w, m: (
        w.fixed(m.session_id, SESSION_ID_BYTES, "session id"),
        w.string(m.sender),
        w.sequence(_items(m.self_mask_shares), _typed(RevealedShare, _write_revealed_share, w)),  # type: ignore[arg-type]
        w.sequence(_items(m.mask_key_shares), _typed(RevealedShare, _write_revealed_share, w)),  # type: ignore[arg-type]
    ),
}


# --- reading --------------------------------------------------------------------------------------


class Reader:
    """Reads fixed-width fields of one frame, bounded by its size (both backends' codecs read with it)."""

    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)
        self.size = len(data)
        self.position = 0

    def take(self, size: int) -> bytes:
        end = self.position + size
        if end > self.size:
            raise MessageDecodeError(f"truncated message: needed {size} bytes at offset {self.position}")
        chunk = self.data[self.position : end].tobytes()
        self.position = end
        return chunk

    def uint(self, size: int) -> int:
        # Straight from the view, without take's copy (n² share fields at n = 1,000).
        start = self.position
        end = start + size
        if end > self.size:
            raise MessageDecodeError(f"truncated message: needed {size} bytes at offset {start}")
        self.position = end
        return int.from_bytes(self.data[start:end], "big")

    def string(self) -> str:
        length = self.uint(2)
        if not 1 <= length <= MAX_STRING_BYTES:
            raise MessageDecodeError(f"string length {length} outside 1..{MAX_STRING_BYTES}")
        start = self.position
        end = start + length
        if end > self.size:
            raise MessageDecodeError(f"truncated message: needed {length} bytes at offset {start}")
        try:
            value = str(self.data[start:end], "utf-8")
        except UnicodeDecodeError as exc:
            raise MessageDecodeError("string is not valid UTF-8") from exc
        self.position = end
        return value

    def words(self) -> memoryview:
        """A masked tensor's words as a read-only view of the received bytes, not a copy (the server
        reads every masked input of a session: 29 GB at n = 1,000, missing 1); the same checks as
        :meth:`take`.  ``np.frombuffer(view, dtype="<u8")`` reads them in place."""
        length = self.uint(4)
        if length % 8:
            raise MessageDecodeError("masked tensor length is not a whole number of uint64 words")
        start = self.position
        end = start + length
        if end > self.size:
            raise MessageDecodeError(f"truncated message: needed {length} bytes at offset {start}")
        self.position = end
        return self.data[start:end]  # the reader's data is immutable bytes: the view is read-only

    def sequence(self, read_item: Callable[[], object], min_item_bytes: int) -> tuple:
        count = self.uint(4)
        # Refuse counts that cannot fit before allocating or looping over them.
        if count * min_item_bytes > self.size - self.position:
            raise MessageDecodeError(f"sequence of {count} items cannot fit in the remaining bytes")
        return tuple(read_item() for _ in range(count))

    def finish(self) -> None:
        if self.position != self.size:
            raise MessageDecodeError(f"{self.size - self.position} trailing bytes after the message")


def decode(data: bytes, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Parse wire bytes; anything but one exact, well-formed message raises :class:`MessageDecodeError`."""
    message = decode_frame(
        data,
        version=PROTOCOL_VERSION,
        readers=_READERS,  # type: ignore[arg-type]
        max_message_bytes=max_message_bytes,
        kind="masking protocol",
    )
    return message  # type: ignore[return-value]


def _read_config(r: Reader) -> SessionConfig:
    session_id = r.take(SESSION_ID_BYTES)
    threshold = r.uint(4)
    min_group_size = r.uint(4)
    frac_bits = r.uint(1)
    groups = r.sequence(lambda: _read_group(r), 7)
    return SessionConfig(session_id, threshold, min_group_size, frac_bits, groups)


def _read_group(r: Reader) -> GroupSpec:
    name = r.string()
    return GroupSpec(name, r.sequence(lambda: TensorSpec(r.string(), r.uint(4)), 7))


def _read_advertise_keys(r: Reader) -> AdvertiseKeys:
    return AdvertiseKeys(
        session_id=r.take(SESSION_ID_BYTES),
        client_id=r.string(),
        encryption_public_key=r.take(KEY_BYTES),
        mask_public_key=r.take(KEY_BYTES),
        self_mask_commitment=r.take(DIGEST_BYTES),
        config_digest=r.take(DIGEST_BYTES),
        groups=r.sequence(r.string, 3),
        signature=r.take(SIGNATURE_BYTES),
        rows=r.sequence(lambda: r.uint(8), 3),
    )


def _read_encrypted_share(r: Reader) -> EncryptedShare:
    return EncryptedShare(r.string(), r.string(), r.take(NONCE_BYTES), r.take(SHARE_CIPHERTEXT_BYTES))


T = TypeVar("T")  # an item of a sequence read by _read_fast_sequence


def _read_fast_sequence(
    r: Reader,
    min_item_bytes: int,
    fast: Callable[[memoryview, int, int], tuple[T, int]],
    slow: Callable[[Reader], T],
    uniform: Callable[[memoryview, int, int, int], tuple[Sequence[T], int] | None] | None = None,
) -> Sequence[T]:
    """A sequence whose items ``fast(data, size, position) -> (item, next position)`` reads with
    locals, for the n² items the server decodes (10⁶ at n = 1,000: the per-field calls were most of
    it).  An item ``fast`` refuses (ValueError: not whole within the message, or names breaking the
    string rule) is read again by the field reader ``slow``, so the error is the one it gives.

    First, ``uniform(data, size, position, count) -> (items, next position)`` may read the whole
    sequence a column at a time where every item has the same layout (the same name lengths, every
    name ASCII, all within the message); it gives None otherwise, and the items are read one by one.
    """
    count = r.uint(4)
    if count * min_item_bytes > r.size - r.position:
        raise MessageDecodeError(f"sequence of {count} items cannot fit in the remaining bytes")
    data, size, position = r.data, r.size, r.position
    if uniform is not None and count:
        whole = uniform(data, size, position, count)
        if whole is not None:
            r.position = whole[1]
            return whole[0]
    items = []
    append = items.append
    for _ in range(count):
        try:
            item, position = fast(data, size, position)
        except ValueError:  # UnicodeDecodeError included
            r.position = position
            item = slow(r)
            position = r.position
        append(item)
    r.position = position
    return tuple(items)


def _name_length(data: memoryview, size: int, position: int) -> int:
    """The length of the string field at ``position`` where it is whole and in range, else 0."""
    if position + 2 > size:
        return 0
    length = int.from_bytes(data[position : position + 2], "big")
    return length if 1 <= length <= MAX_STRING_BYTES and position + 2 + length <= size else 0


_UNPACK_ITEMS = 1024  # items per struct: bounds what the cached structs hold, whatever the count


@lru_cache(maxsize=64)
def _items_struct(layout: str, count: int) -> struct.Struct:
    """``count`` items of ``layout`` (big-endian struct codes, no padding) back to back."""
    return struct.Struct(">" + layout * count)


def _unpack_items(
    data: memoryview, size: int, position: int, count: int, layout: str
) -> tuple[list, int] | None:
    """The fields of ``count`` items of ``layout`` from ``position``, flat, and the position after
    them; None where they do not fit in the message."""
    item = struct.calcsize(">" + layout)
    end = position + count * item
    if end > size:
        return None
    fields: list = []
    for first in range(0, count, _UNPACK_ITEMS):
        chunk = min(_UNPACK_ITEMS, count - first)
        fields += _items_struct(layout, chunk).unpack_from(data, position + first * item)
    return fields, end


def _names(column: list[bytes]) -> list[str] | None:
    """Each UTF-8 name of ``column`` as a string (one string where every item names the same, as
    a sender's shares do, and one string per name otherwise); None where one is not valid UTF-8."""
    first = column[0]
    try:
        if column.count(first) == len(column):
            return [sys.intern(first.decode("utf-8"))] * len(column)
        # UTF-8, strict; interned: the server relays each name in n shares, and one string per
        # name keeps the shares' names in the cache when it writes them out again.
        return list(map(sys.intern, map(bytes.decode, column)))
    except UnicodeDecodeError:
        return None


def _fast_encrypted_share(data: memoryview, size: int, position: int) -> tuple[EncryptedShare, int]:
    start = position + 2
    end = start + int.from_bytes(data[position:start], "big")
    if not start < end <= start + MAX_STRING_BYTES or end + 2 > size:
        raise ValueError
    sender = str(data[start:end], "utf-8")
    start = end + 2
    stop = start + int.from_bytes(data[end:start], "big")
    if not start < stop <= start + MAX_STRING_BYTES or stop + NONCE_BYTES + SHARE_CIPHERTEXT_BYTES > size:
        raise ValueError
    recipient = str(data[start:stop], "utf-8")
    nonce_end = stop + NONCE_BYTES
    after = nonce_end + SHARE_CIPHERTEXT_BYTES
    return EncryptedShare(
        sender, recipient, data[stop:nonce_end].tobytes(), data[nonce_end:after].tobytes()
    ), after


def _uniform_encrypted_shares(
    data: memoryview, size: int, position: int, count: int
) -> tuple[EncryptedShares, int] | None:
    """``count`` encrypted shares read a column at a time (:func:`_read_fast_sequence`'s
    ``uniform``), where every share's sender and recipient have the first share's lengths, all fit
    and all are UTF-8: then item k starts at ``position + k * stride``, and reading share by share
    gives these same items and position.  None otherwise.  Each share's nonce and ciphertext stay
    one payload (:class:`EncryptedShares`), the bytes the server relays in R2 as they came."""
    sender_length = _name_length(data, size, position)
    recipient_length = _name_length(data, size, position + 2 + sender_length) if sender_length else 0
    if not recipient_length:
        return None
    layout = f"H{sender_length}sH{recipient_length}s{_SHARE_PAYLOAD_BYTES}s"
    unpacked = _unpack_items(data, size, position, count, layout)
    if unpacked is None:
        return None
    fields, end = unpacked
    if fields[0::5].count(sender_length) != count or fields[2::5].count(recipient_length) != count:
        return None
    senders = _names(fields[1::5])
    recipients = _names(fields[3::5])
    if senders is None or recipients is None:
        return None
    return EncryptedShares(tuple(senders), tuple(recipients), tuple(fields[4::5])), end


def _read_encrypted_shares(r: Reader) -> EncryptedShares:
    """A sequence of :func:`_read_encrypted_share`: the same bytes and checks, in one loop (or a
    column at a time where the shares' layout is uniform), as :class:`EncryptedShares`."""
    shares = _read_fast_sequence(
        r, 166, _fast_encrypted_share, _read_encrypted_share, _uniform_encrypted_shares
    )
    return shares if type(shares) is EncryptedShares else EncryptedShares.of(shares)


def _read_masked_tensor(r: Reader) -> MaskedTensor:
    return MaskedTensor(r.string(), r.string(), r.words())


def _read_unmask_request(r: Reader) -> UnmaskRequest:
    return UnmaskRequest(
        session_id=r.take(SESSION_ID_BYTES),
        survivors=r.sequence(r.string, 3),
        signatures=r.sequence(lambda: SurvivorSignature(r.string(), r.take(SIGNATURE_BYTES)), 67),
        reveal_self_mask_of=r.sequence(r.string, 3),
        reveal_mask_key_of=r.sequence(r.string, 3),
    )


def _read_revealed_share(r: Reader) -> RevealedShare:
    return RevealedShare(r.string(), r.take(shamir.VALUE_BYTES))


def _fast_revealed_share(data: memoryview, size: int, position: int) -> tuple[RevealedShare, int]:
    start = position + 2
    end = start + int.from_bytes(data[position:start], "big")
    stop = end + shamir.VALUE_BYTES
    if not start < end <= start + MAX_STRING_BYTES or stop > size:
        raise ValueError
    return RevealedShare(str(data[start:end], "utf-8"), data[end:stop].tobytes()), stop


def _uniform_revealed_shares(
    data: memoryview, size: int, position: int, count: int
) -> tuple[RevealedShares, int] | None:
    """``count`` revealed shares read a column at a time, where every owner has the first one's
    length, all fit and all are UTF-8 (:func:`_uniform_encrypted_shares`)."""
    owner_length = _name_length(data, size, position)
    if not owner_length:
        return None
    unpacked = _unpack_items(data, size, position, count, f"H{owner_length}s{shamir.VALUE_BYTES}s")
    if unpacked is None:
        return None
    fields, end = unpacked
    if fields[0::3].count(owner_length) != count:
        return None
    owners = _names(fields[1::3])
    if owners is None:
        return None
    return RevealedShares(tuple(owners), tuple(fields[2::3])), end


def _read_revealed_shares(r: Reader) -> RevealedShares:
    """A sequence of :func:`_read_revealed_share` (the server decodes n² of them in R4), the same
    bytes and checks (:func:`_read_fast_sequence`), as :class:`RevealedShares`."""
    shares = _read_fast_sequence(r, 69, _fast_revealed_share, _read_revealed_share, _uniform_revealed_shares)
    return shares if type(shares) is RevealedShares else RevealedShares.of(shares)


_READERS: dict[int, Callable[[Reader], Message]] = {
    1: lambda r: AdvertiseRequest(_read_config(r)),
    2: _read_advertise_keys,
    3: lambda r: ShareKeysRequest(r.take(SESSION_ID_BYTES), r.sequence(lambda: _read_advertise_keys(r), 200)),
    4: lambda r: ShareKeys(r.take(SESSION_ID_BYTES), r.string(), _read_encrypted_shares(r)),
    5: lambda r: MaskedInputRequest(r.take(SESSION_ID_BYTES), _read_encrypted_shares(r)),
    6: lambda r: MaskedInput(
        r.take(SESSION_ID_BYTES), r.string(), r.sequence(lambda: _read_masked_tensor(r), 10)
    ),
    7: lambda r: ConsistencyCheckRequest(r.take(SESSION_ID_BYTES), r.sequence(r.string, 3)),
    8: lambda r: ConsistencyResponse(r.take(SESSION_ID_BYTES), r.string(), r.take(SIGNATURE_BYTES)),
    9: _read_unmask_request,
    10: lambda r: UnmaskResponse(
        r.take(SESSION_ID_BYTES),
        r.string(),
        _read_revealed_shares(r),
        _read_revealed_shares(r),
    ),
}
