"""The protocol's messages: immutable plain data, no behaviour.

Rounds (Bonawitz et al. 2017, over named groups and named tensors):

====  ==========================  =================================================
R0    server -> all               :class:`AdvertiseRequest` (the session's config)
      client -> server            :class:`AdvertiseKeys` (signed X25519 keys, groups)
R1    server -> each in U1        :class:`ShareKeysRequest` (every advertisement)
      client -> server            :class:`ShareKeys` (AEAD-encrypted Shamir shares)
R2    server -> each in U2        :class:`MaskedInputRequest` (shares addressed to it)
      client -> server            :class:`MaskedInput` (masked uint64 tensors)
R3    server -> each in U3        :class:`ConsistencyCheckRequest` (survivor set U3)
      client -> server            :class:`ConsistencyResponse` (signature over U3)
R4    server -> each in U4        :class:`UnmaskRequest` (U3, signatures, what to reveal)
      client -> server            :class:`UnmaskResponse` (shares of b or of the mask key)
====  ==========================  =================================================

Masked tensors are carried as little-endian uint64 bytes so that messages stay immutable.  The
n² shares of R1, R2 and R4 may be held a field at a time (:class:`EncryptedShares`,
:class:`RevealedShares`: immutable sequences of the share items, which the codec decodes); their
only behaviour is reading as those sequences.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar, overload

from .crypto import NONCE_BYTES

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A named tensor of ``length`` uint64 words summed within a group."""

    name: str
    length: int


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """A named group and the tensors its members sum."""

    name: str
    tensors: tuple[TensorSpec, ...]


@dataclass(frozen=True, slots=True)
class SessionConfig:
    """Everything the session binds: id, threshold t, minimum group size, encoding, group layout."""

    session_id: bytes
    threshold: int
    min_group_size: int
    frac_bits: int
    groups: tuple[GroupSpec, ...]

    def group(self, name: str) -> GroupSpec:
        for group in self.groups:
            if group.name == name:
                return group
        raise KeyError(name)


@dataclass(frozen=True, slots=True)
class AdvertiseRequest:
    config: SessionConfig


@dataclass(frozen=True, slots=True)
class AdvertiseKeys:
    """A client's session keys, signed by its identity key together with everything they bind."""

    session_id: bytes
    client_id: str
    encryption_public_key: bytes
    mask_public_key: bytes
    self_mask_commitment: bytes
    config_digest: bytes
    groups: tuple[str, ...]
    signature: bytes
    # Committed counts: the rows this client releases in each of ``groups`` (same order), signed
    # with the rest; empty where the client commits to none.  A member committing 0 rows to a group
    # contributes a value the server knows (zero): every client's exposure check treats it as known.
    rows: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ShareKeysRequest:
    session_id: bytes
    advertisements: tuple[AdvertiseKeys, ...]


@dataclass(frozen=True, slots=True)
class EncryptedShare:
    """AEAD ciphertext of one client's shares (of its self-mask seed and mask key) for one peer."""

    sender: str
    recipient: str
    nonce: bytes
    ciphertext: bytes


class _ShareColumns(Sequence[T]):
    """Items of one share type held a field at a time (n² shares cross the server: see
    :class:`EncryptedShares`).  Indexing and iteration give the items, and it equals the tuple
    of its items, so a message that carries it reads as one that carries that tuple."""

    __slots__ = ()

    def _columns(self) -> tuple[tuple, ...]:
        raise NotImplementedError

    @staticmethod
    def _item(*fields: object) -> T:
        raise NotImplementedError

    def __post_init__(self) -> None:
        columns = self._columns()
        if not all(type(column) is tuple for column in columns):
            raise TypeError(f"the columns of {type(self).__name__} must be tuples")
        if len({len(column) for column in columns}) > 1:
            raise ValueError(f"the columns of {type(self).__name__} must have one entry per share")

    def __len__(self) -> int:
        return len(self._columns()[0])

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[T, ...]: ...
    def __getitem__(self, index: int | slice) -> T | tuple[T, ...]:
        if isinstance(index, slice):
            return tuple(map(self._item, *(column[index] for column in self._columns())))
        return self._item(*(column[index] for column in self._columns()))

    def __iter__(self) -> Iterator[T]:
        return map(self._item, *self._columns())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _ShareColumns | tuple):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} shares)"


@dataclass(frozen=True, slots=True, eq=False)
class EncryptedShares(_ShareColumns[EncryptedShare]):
    """A sequence of :class:`EncryptedShare` held a field at a time: its senders, its recipients
    and each share's ``nonce || ciphertext`` (the share's last two wire fields, back to back).

    R1 and R2 carry n² shares between them (10⁶ at n = 1,000): as one object per share, the server
    spent about a second of each session allocating them and in the cyclic collector's passes over
    them; columns of strings and bytes are a few objects the collector does not track.
    """

    senders: tuple[str, ...]
    recipients: tuple[str, ...]
    payloads: tuple[bytes, ...]  # nonce (NONCE_BYTES) || ciphertext of each share

    @classmethod
    def of(cls, shares: Iterable[EncryptedShare]) -> EncryptedShares:
        """The columns of ``shares``, each an :class:`EncryptedShare` whose nonce has NONCE_BYTES
        bytes (the encoder checks the other fields; a nonce of another length could not be split
        out of its payload again)."""
        items = tuple(shares)
        if any(type(item) is not EncryptedShare for item in items):
            raise TypeError("expected EncryptedShare items")
        if any(type(item.nonce) is not bytes or len(item.nonce) != NONCE_BYTES for item in items):
            raise ValueError(f"nonce must be exactly {NONCE_BYTES} bytes")
        return cls(
            tuple(item.sender for item in items),
            tuple(item.recipient for item in items),
            tuple(item.nonce + item.ciphertext for item in items),
        )

    def _columns(self) -> tuple[tuple, ...]:
        return (self.senders, self.recipients, self.payloads)

    @staticmethod
    def _item(sender: str, recipient: str, payload: bytes) -> EncryptedShare:  # type: ignore[override]
        return EncryptedShare(sender, recipient, payload[:NONCE_BYTES], payload[NONCE_BYTES:])


# A sequence of shares: the codec decodes EncryptedShares; a tuple of items is accepted as well.
Shares = tuple[EncryptedShare, ...] | EncryptedShares


@dataclass(frozen=True, slots=True)
class ShareKeys:
    session_id: bytes
    sender: str
    shares: Shares


@dataclass(frozen=True, slots=True)
class MaskedInputRequest:
    session_id: bytes
    shares: Shares


@dataclass(frozen=True, slots=True)
class MaskedTensor:
    group: str
    tensor: str
    data: bytes


@dataclass(frozen=True, slots=True)
class MaskedInput:
    session_id: bytes
    sender: str
    tensors: tuple[MaskedTensor, ...]


@dataclass(frozen=True, slots=True)
class ConsistencyCheckRequest:
    session_id: bytes
    survivors: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ConsistencyResponse:
    session_id: bytes
    sender: str
    signature: bytes


@dataclass(frozen=True, slots=True)
class SurvivorSignature:
    client_id: str
    signature: bytes


@dataclass(frozen=True, slots=True)
class UnmaskRequest:
    """U3, the R3 signatures over it, and which share of which client each recipient should reveal."""

    session_id: bytes
    survivors: tuple[str, ...]
    signatures: tuple[SurvivorSignature, ...]
    reveal_self_mask_of: tuple[str, ...]
    reveal_mask_key_of: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RevealedShare:
    """The revealer's Shamir share (field element, fixed size) of ``owner``'s secret."""

    owner: str
    value: bytes


@dataclass(frozen=True, slots=True, eq=False)
class RevealedShares(_ShareColumns[RevealedShare]):
    """A sequence of :class:`RevealedShare` held a field at a time (owners, values), as the codec
    decodes it: the server reads n² of them in R4 (:class:`EncryptedShares` says why columns)."""

    owners: tuple[str, ...]
    values: tuple[bytes, ...]

    @classmethod
    def of(cls, shares: Iterable[RevealedShare]) -> RevealedShares:
        items = tuple(shares)
        if any(type(item) is not RevealedShare for item in items):
            raise TypeError("expected RevealedShare items")
        return cls(tuple(item.owner for item in items), tuple(item.value for item in items))

    def _columns(self) -> tuple[tuple, ...]:
        return (self.owners, self.values)

    @staticmethod
    def _item(owner: str, value: bytes) -> RevealedShare:  # type: ignore[override]
        return RevealedShare(owner, value)


# Revealed shares: the codec decodes RevealedShares; a tuple of items is accepted as well.
Revealed = tuple[RevealedShare, ...] | RevealedShares


@dataclass(frozen=True, slots=True)
class UnmaskResponse:
    session_id: bytes
    sender: str
    self_mask_shares: Revealed
    mask_key_shares: Revealed


Message = (
    AdvertiseRequest
    | AdvertiseKeys
    | ShareKeysRequest
    | ShareKeys
    | MaskedInputRequest
    | MaskedInput
    | ConsistencyCheckRequest
    | ConsistencyResponse
    | UnmaskRequest
    | UnmaskResponse
)
ServerMessage = (
    AdvertiseRequest | ShareKeysRequest | MaskedInputRequest | ConsistencyCheckRequest | UnmaskRequest
)
ClientMessage = AdvertiseKeys | ShareKeys | MaskedInput | ConsistencyResponse | UnmaskResponse
