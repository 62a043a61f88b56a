"""The CKKS backend's messages: immutable plain data, no behaviour.

====  ==========================  =====================================================
R0    server -> all               :class:`CkksAdvertiseRequest` (the session's config)
      client -> server            :class:`CkksAdvertise` (signed X25519 key, groups)
R1    server -> each in U1        :class:`CkksKeyRequest` (every advertisement)
      key holder -> server        :class:`CkksKeyDistribution` (public context, the secret
                                  context AEAD-encrypted for each peer, signed); others: nothing
R2    server -> each in U1        :class:`CkksInputRequest` (the public context, signature and
                                  this client's encrypted secret context)
      client -> server            :class:`CkksInput` (ciphertext chunks per group and tensor, signed)
R3    server -> each in U2        :class:`CkksViewRequest` (the view: every upload received, as its
                                  sender and upload digest)
      survivor -> server          :class:`CkksViewSignature` (its signature over the view; once per
                                  session)
R4    server -> each decryptor    :class:`CkksDecryptRequest` (the view, at least t survivors'
                                  signatures over it and, per group, the chunk indices it decrypts
                                  with every surviving member's signed chunk digests and its
                                  ciphertexts of those chunks); repeated for chunk sets whose
                                  decryptor dropped
      decryptor -> server         :class:`CkksDecryption` (each chunk sum, which it computed itself
                                  from the signed chunks, signed with the chunk indices)
====  ==========================  =====================================================

Group layouts reuse the masking backend's :class:`~secure_afl.protocol.messages.GroupSpec`; a tensor's
``length`` counts float64 values (the upper triangle for symmetric matrices).  A group's *chunks* are
its tensors' ciphertexts, in tensor-name order and then in order within each tensor, numbered from 0
(:func:`~secure_afl.protocol.ckks.context.group_chunks`): the unit a decryptor is asked for (R4 splits
a group's chunks over several decryptors, SECURITY.md §7.6).
"""

from __future__ import annotations

from dataclasses import dataclass

from secure_afl.protocol.messages import GroupSpec

from .context import CkksParameters


@dataclass(frozen=True, slots=True)
class CkksSessionConfig:
    """Everything the session binds: id, minimum group size, CKKS parameters, group layout."""

    session_id: bytes
    min_group_size: int
    parameters: CkksParameters
    groups: tuple[GroupSpec, ...]

    def group(self, name: str) -> GroupSpec:
        for group in self.groups:
            if group.name == name:
                return group
        raise KeyError(name)


@dataclass(frozen=True, slots=True)
class CkksAdvertiseRequest:
    config: CkksSessionConfig


@dataclass(frozen=True, slots=True)
class CkksAdvertise:
    """A client's session X25519 key, signed by its identity key with the config digest and its groups."""

    session_id: bytes
    client_id: str
    encryption_public_key: bytes
    config_digest: bytes
    groups: tuple[str, ...]
    signature: bytes
    rows: tuple[int, ...] = ()  # committed counts per group, signed (as the masking advertisement's)


@dataclass(frozen=True, slots=True)
class CkksKeyRequest:
    session_id: bytes
    advertisements: tuple[CkksAdvertise, ...]


@dataclass(frozen=True, slots=True)
class EncryptedContext:
    """The secret context, AES-256-GCM-encrypted from the key holder to one peer."""

    sender: str
    recipient: str
    nonce: bytes
    ciphertext: bytes


@dataclass(frozen=True, slots=True)
class CkksKeyDistribution:
    """The key holder's public context (no key) and the SHA-256 of the secret context it seals for
    every peer, both signed over the transcript, and the peers' sealed secret contexts."""

    session_id: bytes
    sender: str
    public_context: bytes
    secret_digest: bytes
    signature: bytes
    contexts: tuple[EncryptedContext, ...]


@dataclass(frozen=True, slots=True)
class CkksInputRequest:
    """The key holder's signed public context and the encrypted secret context for this recipient
    (none for the key holder itself)."""

    session_id: bytes
    key_holder: str
    public_context: bytes
    secret_digest: bytes  # what every peer's unwrapped secret context must hash to (signed)
    signature: bytes
    context: EncryptedContext | None


@dataclass(frozen=True, slots=True)
class EncryptedTensor:
    """A tensor as serialised CKKS ciphertexts of at most N/2 values each."""

    group: str
    tensor: str
    chunks: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class CkksInput:
    session_id: bytes
    sender: str
    tensors: tuple[EncryptedTensor, ...]
    signature: bytes


@dataclass(frozen=True, slots=True)
class TensorDigests:
    """The SHA-256 of each ciphertext chunk of one tensor of an upload (what its signature covers)."""

    group: str
    tensor: str
    chunk_digests: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class SignedUpload:
    """One survivor's upload as a decryptor checks it: the digests of *all* its chunks with its
    signature over them (as in :class:`CkksInput`), and its ciphertexts of the requested chunks of
    one group (:attr:`GroupUploads.chunks`, in that order)."""

    sender: str
    digests: tuple[TensorDigests, ...]
    signature: bytes
    chunks: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class GroupUploads:
    """A group's chunk set to decrypt: its chunk indices (increasing) and every surviving member's
    signed upload of those chunks."""

    group: str
    chunks: tuple[int, ...]
    uploads: tuple[SignedUpload, ...]


@dataclass(frozen=True, slots=True)
class UploadEntry:
    """One upload of a view: its sender and :func:`~secure_afl.protocol.ckks.binding.upload_digest`
    (the SHA-256 of the chunk digests the sender signed, and of its signature)."""

    sender: str
    digest: bytes


@dataclass(frozen=True, slots=True)
class CkksViewRequest:
    """R3: the view, every upload the server received (U2), sorted by sender; each survivor signs it."""

    session_id: bytes
    uploads: tuple[UploadEntry, ...]


@dataclass(frozen=True, slots=True)
class CkksViewSignature:
    """A survivor's Ed25519 signature over a view (:func:`~secure_afl.protocol.ckks.binding.view_fields`)."""

    session_id: bytes
    sender: str
    signature: bytes


@dataclass(frozen=True, slots=True)
class CkksDecryptRequest:
    """The view (the uploads that count, U2), at least t survivors' signatures over it and, per group
    to decrypt, a chunk set with the survivors' signed chunks: the decryptor sums them itself, so it
    never decrypts anything but a chunk of a group sum, and only over the one view the quorum signed."""

    session_id: bytes
    uploads: tuple[UploadEntry, ...]
    signatures: tuple[CkksViewSignature, ...]
    groups: tuple[GroupUploads, ...]

    @property
    def survivors(self) -> tuple[str, ...]:
        """The clients whose inputs count (U2): the senders of the view's uploads."""
        return tuple(entry.sender for entry in self.uploads)


@dataclass(frozen=True, slots=True)
class DecryptedChunk:
    """One chunk's decrypted sum (its index in the group) as little-endian float64 bytes."""

    index: int
    data: bytes


@dataclass(frozen=True, slots=True)
class DecryptedGroup:
    """A group's decrypted chunk sums, in the requested order, signed with their indices."""

    group: str
    chunks: tuple[DecryptedChunk, ...]
    signature: bytes


@dataclass(frozen=True, slots=True)
class CkksDecryption:
    session_id: bytes
    sender: str
    groups: tuple[DecryptedGroup, ...]


CkksServerMessage = (
    CkksAdvertiseRequest | CkksKeyRequest | CkksInputRequest | CkksViewRequest | CkksDecryptRequest
)
CkksClientMessage = CkksAdvertise | CkksKeyDistribution | CkksInput | CkksViewSignature | CkksDecryption
CkksMessage = CkksServerMessage | CkksClientMessage
