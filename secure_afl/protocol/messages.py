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

Masked tensors are carried as little-endian uint64 bytes so that messages stay immutable.
"""

from __future__ import annotations

from dataclasses import dataclass


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


@dataclass(frozen=True, slots=True)
class ShareKeys:
    session_id: bytes
    sender: str
    shares: tuple[EncryptedShare, ...]


@dataclass(frozen=True, slots=True)
class MaskedInputRequest:
    session_id: bytes
    shares: tuple[EncryptedShare, ...]


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


@dataclass(frozen=True, slots=True)
class UnmaskResponse:
    session_id: bytes
    sender: str
    self_mask_shares: tuple[RevealedShare, ...]
    mask_key_shares: tuple[RevealedShare, ...]


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
