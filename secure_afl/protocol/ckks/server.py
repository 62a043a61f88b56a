"""The CKKS server's state machine (sans-I/O).

``start()`` returns the advertise request; ``receive(message)`` accepts one client message of the
current round (a rejected message raises and changes nothing); ``next_round()`` closes the round and
returns the messages to send, keyed by recipient (empty once every group has its sum);
``result()`` returns the decrypted float64 sums per group and tensor.

The server holds the key holder's *public* context only: it refuses one that carries a secret key
(:class:`InvalidContextError`) and never sees the secret context except AES-GCM-encrypted for a peer.
It keeps each survivor's signed upload, has every survivor sign the view (R3: every upload that
counts, by sender and digest), and splits each group's decryption by chunk (SECURITY.md §7.6): it
asks m = min(S_g, C_g, ``max_decryptors_per_group``) surviving members that signed to decrypt
disjoint, contiguous chunk sets, each from every survivor's signed ciphertexts of its chunks alone
(plus the digests of all of a member's chunks, which its signature covers), with every view
signature received.  A decryptor that does not answer has its chunk sets given to another signer
among the group's survivors; the group's sum is assembled from the chunk sums
(:func:`assemble_group_sums`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from secure_afl.core.errors import (
    ClientProtocolError,
    DuplicateClientError,
    GroupTooSmallError,
    InvalidSessionConfigError,
    InvalidSignatureError,
    LocalProtocolError,
    OutOfOrderMessageError,
    ReplayedMessageError,
    UnknownClientError,
)
from secure_afl.keys.roster import Roster
from secure_afl.privacy.policy import majority_threshold
from secure_afl.protocol import crypto
from secure_afl.protocol.binding import NO_CONTEXT

from . import binding, codec, context
from .client import validate_config
from .errors import (
    ConflictingDecryptionError,
    IncompleteDecryptionError,
    InvalidCiphertextError,
    InvalidContextError,
    KeyHolderDroppedError,
    NoDecryptorError,
    ViewQuorumError,
)
from .messages import (
    CkksAdvertise,
    CkksAdvertiseRequest,
    CkksDecryption,
    CkksDecryptRequest,
    CkksInput,
    CkksInputRequest,
    CkksKeyDistribution,
    CkksKeyRequest,
    CkksServerMessage,
    CkksSessionConfig,
    CkksViewRequest,
    CkksViewSignature,
    GroupUploads,
    SignedUpload,
    TensorDigests,
    UploadEntry,
)
from .state import SERVER_ACCEPTS, SERVER_NEXT_ROUND, CkksServerRound


@dataclass(frozen=True, slots=True)
class CkksGroupSum:
    """What the server learns about one group: members, survivors, who decrypted each chunk, the
    float64 sums."""

    name: str
    members: tuple[str, ...]
    survivors: tuple[str, ...]
    chunk_decryptors: tuple[str, ...]  # chunk index -> the client whose decryption of it was used
    sums: Mapping[str, np.ndarray]  # tensor name -> read-only float64 sum over the survivors

    @property
    def decryptors(self) -> tuple[str, ...]:
        """The clients that decrypted a part of the group's sum, sorted."""
        return tuple(sorted(set(self.chunk_decryptors)))


Layout = tuple[tuple[str, int, int], ...]  # a group's chunks (context.group_chunks)


def assemble_group_sums(
    group: str, layout: Layout, decrypted: Iterable[tuple[str, int, np.ndarray]]
) -> tuple[dict[str, np.ndarray], tuple[str, ...]]:
    """A group's tensor sums from its decrypted chunk sums (decryptor, chunk index, values), and who
    decrypted each chunk.  Every chunk needs a sum of its length (else
    :class:`IncompleteDecryptionError`); a chunk decrypted twice must have the same values
    (decryption of one ciphertext sum, rounded to the output grid, is deterministic), else
    :class:`ConflictingDecryptionError` names both decryptors: the server cannot tell who lied."""
    by_chunk: dict[int, tuple[str, np.ndarray]] = {}
    for decryptor, index, values in decrypted:
        if not 0 <= index < len(layout) or values.shape != (layout[index][2],):
            raise IncompleteDecryptionError(
                f"group {group!r}: {decryptor!r} returned chunk {index} with {values.size} values; the "
                f"group has chunks 0..{len(layout) - 1}"
            )
        earlier = by_chunk.get(index)
        if earlier is None:
            by_chunk[index] = (decryptor, values)
        elif not np.array_equal(earlier[1], values):
            raise ConflictingDecryptionError(
                f"group {group!r}: {earlier[0]!r} and {decryptor!r} decrypted chunk {index} of the one "
                f"view's sum to different values"
            )
    missing = [k for k in range(len(layout)) if k not in by_chunk]
    if missing:
        raise IncompleteDecryptionError(f"group {group!r}: chunk(s) {missing} have no decrypted sum")
    parts: dict[str, list[np.ndarray]] = {}
    for k, (tensor, _, _) in enumerate(layout):
        parts.setdefault(tensor, []).append(by_chunk[k][1])
    sums = {}
    for tensor, chunks in parts.items():
        values = np.concatenate(chunks).astype(np.float64)
        values.setflags(write=False)
        sums[tensor] = values
    return sums, tuple(by_chunk[k][0] for k in range(len(layout)))


@dataclass(frozen=True, slots=True)
class CkksAggregationResult:
    session_id: bytes
    key_holder: str
    groups: Mapping[str, CkksGroupSum]
    survivors: tuple[str, ...]  # U2: the clients whose inputs are in the sums
    replaced_key_holders: tuple[str, ...] = ()  # key holders that sent no key (re-elections)


def plan_chunk_sets(
    groups: Mapping[str, tuple[list[str], int]], cap: int | None, load: dict[str, int]
) -> list[tuple[str, str, tuple[int, ...]]]:
    """Who decrypts which chunks: per group (its candidates, its chunk count C_g), in name order,
    m = min(candidates, C_g, cap) of the least-loaded candidates (``load``: chunks asked of each so
    far, updated here), each given a contiguous run of ⌊C_g/m⌋ or ⌈C_g/m⌉ chunks.  Returns
    (group, decryptor, chunk indices) triples.  The server's one rule, which the bench reuses."""
    plan: list[tuple[str, str, tuple[int, ...]]] = []
    for group in sorted(groups):
        candidates, count = groups[group]
        m = min(len(candidates), count, cap or count)
        chosen = sorted(candidates, key=lambda c: (load.get(c, 0), c))[:m]
        for j, decryptor in enumerate(chosen):
            chunks = tuple(range(j * count // m, (j + 1) * count // m))
            load[decryptor] = load.get(decryptor, 0) + len(chunks)
            plan.append((group, decryptor, chunks))
    return plan


class CkksServerSession:
    """The server's side of one CKKS session over ``config``'s groups, for the clients of ``roster``."""

    def __init__(
        self,
        roster: Roster,
        config: CkksSessionConfig,
        *,
        context: bytes = NO_CONTEXT,
        max_decryptors_per_group: int | None = None,
    ) -> None:
        try:
            validate_config(config, len(roster))
        except InvalidSessionConfigError as exc:
            raise LocalProtocolError(str(exc)) from exc
        if max_decryptors_per_group is not None and max_decryptors_per_group < 1:
            raise LocalProtocolError("max_decryptors_per_group must be at least 1 (or None: no cap)")
        # m = min(S_g, C_g, this cap): 1 is the decryption of a whole group by one member (the earlier
        # protocol); None splits each group over as many signers as it has chunks.
        self._max_decryptors = max_decryptors_per_group
        self._roster = roster
        self._config = config
        self._digest = binding.config_digest(config, context)  # the session context its clients bind
        self._message_limit = codec.max_message_bytes(config, len(roster))
        self._round = CkksServerRound.NOT_STARTED
        self._adverts: dict[str, CkksAdvertise] = {}
        self._adverts_digest = b""
        self._members: dict[str, tuple[str, ...]] = {}
        self._key_holder = ""
        self._replaced_key_holders: tuple[str, ...] = ()  # key holders that sent no key, in order
        self._keys: CkksKeyDistribution | None = None
        self._public_context = None  # TenSEAL context without any key
        self._uploads: dict[str, CkksInput] = {}  # sender -> its checked, signed upload
        self._upload_digests: dict[str, tuple[TensorDigests, ...]] = {}  # sender -> what it signed
        self._input_senders: set[str] = set()
        self._survivors: tuple[str, ...] = ()
        self._view: tuple[UploadEntry, ...] = ()  # R3: every upload that counts, by sender and digest
        self._view_digest = b""
        self._view_signatures: dict[str, CkksViewSignature] = {}
        self._requested: dict[str, GroupUploads] = {}  # group -> every survivor's signed upload of it
        self._layouts: dict[str, Layout] = {}  # group -> its chunks
        # This R4 round: decryptor -> group -> the chunk set it was sent (what its answer must be).
        self._asked: dict[str, dict[str, GroupUploads]] = {}
        self._answered: set[str] = set()
        self._load: dict[str, int] = {}  # decryptor -> chunks asked of it so far (to spread the work)
        self._failed_decryptors: set[str] = set()
        self._decrypted: dict[str, list[tuple[str, int, np.ndarray]]] = {}  # group -> chunk sums
        self._result: CkksAggregationResult | None = None

    @property
    def round(self) -> CkksServerRound:
        return self._round

    @property
    def config(self) -> CkksSessionConfig:
        return self._config

    @property
    def max_message_bytes(self) -> int:
        return self._message_limit

    @property
    def key_holder(self) -> str:
        return self._key_holder

    @property
    def replaced_key_holders(self) -> tuple[str, ...]:
        """The key holders that sent no key and were replaced by a re-election, in order."""
        return self._replaced_key_holders

    @property
    def public_context(self) -> bytes:
        """The serialised context the server holds (no key; empty before the key holder sent it)."""
        return b"" if self._keys is None else self._keys.public_context

    def start(self) -> CkksAdvertiseRequest:
        if self._round is not CkksServerRound.NOT_STARTED:
            raise LocalProtocolError("the session has already started")
        self._round = CkksServerRound.ADVERTISE
        return CkksAdvertiseRequest(self._config)

    def receive(self, message: object) -> None:
        """Accept one client message of the current round, or raise and change nothing."""
        expected = SERVER_ACCEPTS.get(self._round)
        if expected is None:
            raise LocalProtocolError(f"the server accepts no client messages in round {self._round.name}")
        if type(message) is not expected:
            raise OutOfOrderMessageError(f"{type(message).__name__} received in round {self._round.name}")
        assert isinstance(
            message, CkksAdvertise | CkksKeyDistribution | CkksInput | CkksViewSignature | CkksDecryption
        )
        if message.session_id != self._config.session_id:
            raise ReplayedMessageError("message from another session")
        if isinstance(message, CkksAdvertise):
            self._receive_advert(message)
        elif isinstance(message, CkksKeyDistribution):
            self._receive_keys(message)
        elif isinstance(message, CkksInput):
            self._receive_input(message)
        elif isinstance(message, CkksViewSignature):
            self._receive_view_signature(message)
        else:
            self._receive_decryption(message)

    def next_round(self) -> dict[str, CkksServerMessage]:
        """Close the current round; return the messages to send, keyed by recipient."""
        if self._round not in SERVER_ACCEPTS:
            raise LocalProtocolError(f"no round to close in {self._round.name}")
        if self._round is CkksServerRound.ADVERTISE:
            replies = self._close_advertise()
        elif self._round is CkksServerRound.KEYS and self._keys is None:
            return self._reelect()  # R1 again, without the key holder that sent no key
        elif self._round is CkksServerRound.KEYS:
            replies = self._close_keys()
        elif self._round is CkksServerRound.INPUT:
            replies = self._close_input()
        elif self._round is CkksServerRound.VIEW:
            replies = self._close_view()
        else:
            replies = self._close_decrypt()
            if not replies:
                self._round = CkksServerRound.DONE
            return replies
        self._round = SERVER_NEXT_ROUND[self._round]
        return replies

    def result(self) -> CkksAggregationResult:
        if self._result is None:
            raise LocalProtocolError(f"no result before the session is DONE (round {self._round.name})")
        return self._result

    # --- receiving --------------------------------------------------------------------------------

    def _check_sender(self, sender: str, allowed: object, seen: object) -> None:
        if sender not in self._roster:
            raise UnknownClientError(f"{sender!r} is not in the roster")
        if sender not in allowed:  # type: ignore[operator]
            raise UnknownClientError(f"{sender!r} is not a participant of this round")
        if sender in seen:  # type: ignore[operator]
            raise DuplicateClientError(f"a second message from {sender!r} in this round")

    def _receive_advert(self, advert: CkksAdvertise) -> None:
        self._check_sender(advert.client_id, self._roster.client_ids, self._adverts)
        if not binding.advertisement_signed_by(advert, self._roster.public_key(advert.client_id)):
            raise InvalidSignatureError(f"the key of {advert.client_id!r} is not signed by its identity key")
        if advert.config_digest != self._digest:
            raise ClientProtocolError(f"{advert.client_id!r} signed a different session config")
        names = {group.name for group in self._config.groups}
        if len(set(advert.groups)) != len(advert.groups) or not set(advert.groups) <= names:
            raise ClientProtocolError(f"{advert.client_id!r} declared unknown or repeated groups")
        self._adverts[advert.client_id] = advert

    def _receive_keys(self, message: CkksKeyDistribution) -> None:
        if message.sender != self._key_holder:
            raise ClientProtocolError(
                f"{message.sender!r} sent a key, but the advertisements chose {self._key_holder!r}"
            )
        self._check_sender(message.sender, self._adverts, () if self._keys is None else (message.sender,))
        domain, fields = binding.public_context_fields(
            self._config.session_id,
            self._digest,
            self._adverts_digest,
            message.sender,
            message.public_context,
            message.secret_digest,
        )
        if not crypto.verify(self._roster.public_key(message.sender), message.signature, domain, *fields):
            raise InvalidSignatureError(
                f"the public context is not signed by the key holder {message.sender!r}"
            )
        try:
            public = context.load_context(message.public_context)
        except ValueError as exc:
            raise InvalidContextError(f"the key holder's public context: {exc}") from None
        if public.is_private():
            # The server must never hold the secret key: refuse it and keep nothing.
            del public
            raise InvalidContextError(
                f"the key holder {message.sender!r} sent the server a context with the secret key"
            )
        mismatch = context.parameters_mismatch(public, self._config.parameters)
        if mismatch is not None:
            raise InvalidContextError(f"the key holder's context does not match the session: {mismatch}")
        recipients = [item.recipient for item in message.contexts]
        expected = set(self._adverts)  # the key holder's own sealed copy included
        if any(item.sender != message.sender for item in message.contexts):
            raise ClientProtocolError(f"{message.sender!r} sent contexts under another sender's name")
        if len(recipients) != len(set(recipients)) or set(recipients) != expected:
            raise ClientProtocolError(
                f"{message.sender!r} did not send one secret context to every client (itself included)"
            )
        self._keys = message
        self._public_context = public

    def _receive_input(self, message: CkksInput) -> None:
        self._check_sender(message.sender, self._adverts, self._input_senders)
        declared = self._adverts[message.sender].groups
        expected = {
            (group, tensor.name): tensor.length
            for group in declared
            for tensor in self._config.group(group).tensors
        }
        received = [(item.group, item.tensor) for item in message.tensors]
        if received != sorted(expected):
            raise ClientProtocolError(
                f"{message.sender!r} sent tensors other than those of its groups, in order"
            )
        digests = binding.tensor_digests(message.tensors)  # every chunk hashed once: kept for R3
        domain, fields = binding.input_fields_of_digests(
            self._config.session_id, self._digest, message.sender, digests
        )
        if not crypto.verify(self._roster.public_key(message.sender), message.signature, domain, *fields):
            raise InvalidCiphertextError(
                f"the ciphertexts of {message.sender!r} do not match its signature (corrupted or forged)"
            )
        parameters = self._config.parameters
        for item in message.tensors:
            lengths = context.chunk_lengths(expected[(item.group, item.tensor)], parameters)
            if len(item.chunks) != len(lengths):
                raise InvalidCiphertextError(
                    f"{message.sender!r}: {item.group}/{item.tensor} has {len(item.chunks)} ciphertexts, "
                    f"expected {len(lengths)}"
                )
            try:  # a ciphertext that does not load is refused now, not at its decryptor
                for chunk, n in zip(item.chunks, lengths, strict=True):
                    context.load_ciphertext(self._public_context, chunk, n, parameters)
            except ValueError as exc:
                raise InvalidCiphertextError(
                    f"{message.sender!r}: {item.group}/{item.tensor}: {exc}"
                ) from None
        # Every check passed: keep the signed upload (each decryptor sums its group's itself).
        self._uploads[message.sender] = message
        self._upload_digests[message.sender] = digests
        self._input_senders.add(message.sender)

    def _receive_view_signature(self, message: CkksViewSignature) -> None:
        self._check_sender(message.sender, self._survivors, self._view_signatures)
        domain, fields = binding.view_fields(
            self._config.session_id, self._digest, self._adverts_digest, self._view
        )
        if not crypto.verify(self._roster.public_key(message.sender), message.signature, domain, *fields):
            raise InvalidSignatureError(f"the view signature of {message.sender!r} does not verify")
        self._view_signatures[message.sender] = message

    def _receive_decryption(self, message: CkksDecryption) -> None:
        sender = message.sender
        if sender not in self._roster:
            raise UnknownClientError(f"{sender!r} is not in the roster")
        asked = self._asked.get(sender)
        if asked is None:
            raise UnknownClientError(f"{sender!r} was not asked to decrypt in this round")
        if sender in self._answered:
            raise DuplicateClientError(f"a second message from {sender!r} in this round")
        if [item.group for item in message.groups] != sorted(asked):
            raise ClientProtocolError(f"{sender!r} did not return exactly the group sums it was asked for")
        results: list[tuple[str, int, np.ndarray]] = []
        for item in message.groups:
            sent = asked[item.group]
            if tuple(c.index for c in item.chunks) != sent.chunks:
                raise ClientProtocolError(
                    f"{sender!r}: group {item.group!r} returned chunks "
                    f"{[c.index for c in item.chunks]}, it was asked for {list(sent.chunks)}"
                )
            layout = self._layouts[item.group]
            survivors = tuple(c for c in self._members[item.group] if c in set(self._survivors))
            domain, fields = binding.decryption_fields(
                self._config.session_id,
                self._digest,
                self._adverts_digest,
                self._view_digest,
                item.group,
                sent.chunks,
                survivors,
                sent.uploads,
                item.chunks,
            )
            if not crypto.verify(self._roster.public_key(sender), item.signature, domain, *fields):
                raise InvalidSignatureError(
                    f"the decryption of group {item.group!r} is not signed by its decryptor {sender!r}"
                )
            for chunk in item.chunks:
                tensor, i, n = layout[chunk.index]
                if len(chunk.data) != 8 * n:
                    raise ClientProtocolError(
                        f"{sender!r}: {item.group}/{tensor} chunk {i} has the wrong length"
                    )
                values = np.frombuffer(chunk.data, dtype="<f8").astype(np.float64)
                if not np.all(np.isfinite(values)):
                    raise ClientProtocolError(f"{sender!r}: {item.group}/{tensor} chunk {i} is not finite")
                results.append((item.group, chunk.index, values))
        for group, index, values in results:
            self._decrypted.setdefault(group, []).append((sender, index, values))
        self._answered.add(sender)

    # --- closing rounds ---------------------------------------------------------------------------

    def _check_groups(self, live: set[str], stage: str) -> None:
        for group, ids in self._members.items():
            count = sum(1 for cid in ids if cid in live)
            if count < self._config.min_group_size:
                raise GroupTooSmallError(
                    f"group {group!r} has {count} live member(s) {stage}, below the minimum group size "
                    f"{self._config.min_group_size}; it is never decrypted"
                )

    def _close_advertise(self) -> dict[str, CkksServerMessage]:
        if not self._adverts:
            raise GroupTooSmallError("no client advertised a key")
        members = {
            group.name: tuple(sorted(cid for cid, a in self._adverts.items() if group.name in a.groups))
            for group in self._config.groups
        }
        self._members = members
        self._check_groups(set(self._adverts), "after R0")
        adverts = tuple(self._adverts[cid] for cid in sorted(self._adverts))
        self._adverts_digest = binding.advertisements_digest(self._config.session_id, adverts)
        self._key_holder = binding.key_holder(self._config.session_id, self._adverts_digest, self._adverts)
        request = CkksKeyRequest(self._config.session_id, adverts)
        return {cid: request for cid in sorted(self._adverts)}

    def _reelect(self) -> dict[str, CkksServerMessage]:
        """The key holder sent no key: ask the other advertised clients again, without it.

        Every client checks that only the key holder was removed, and the remaining advertisements
        choose the next key holder as in R1 (the server still cannot name it).  A dropout here costs
        no secret: nothing has been encrypted yet.  Each re-election removes one client, so there
        are at most as many as advertised clients.
        """
        dropped = self._key_holder
        remaining = {cid: a for cid, a in self._adverts.items() if cid != dropped}
        if not remaining:
            raise KeyHolderDroppedError(
                f"the key holder {dropped!r} sent no key and no other advertised client is left to "
                f"hold one; nothing was encrypted, start a new session"
            )
        self._check_groups(set(remaining), f"without the key holder {dropped!r}, who sent no key")
        self._members = {g: tuple(c for c in ids if c != dropped) for g, ids in self._members.items()}
        self._adverts = remaining
        self._replaced_key_holders += (dropped,)
        adverts = tuple(remaining[cid] for cid in sorted(remaining))
        self._adverts_digest = binding.advertisements_digest(self._config.session_id, adverts)
        self._key_holder = binding.key_holder(self._config.session_id, self._adverts_digest, remaining)
        request = CkksKeyRequest(self._config.session_id, adverts)
        return {cid: request for cid in sorted(remaining)}

    def _close_keys(self) -> dict[str, CkksServerMessage]:
        keys = self._keys
        assert keys is not None  # next_round() re-elects while no key came
        sealed = {item.recipient: item for item in keys.contexts}
        return {
            cid: CkksInputRequest(
                self._config.session_id,
                keys.sender,
                keys.public_context,
                keys.secret_digest,
                keys.signature,
                sealed.get(cid),
            )
            for cid in sorted(self._adverts)
        }

    def _close_input(self) -> dict[str, CkksServerMessage]:
        self._survivors = tuple(sorted(self._input_senders))
        self._check_groups(set(self._survivors), "after R2")
        survivors = set(self._survivors)
        digests = self._upload_digests  # hashed once, in R2: every group's upload and the view
        for group in self._config.groups:
            layout = context.group_chunks({t.name: t.length for t in group.tensors}, self._config.parameters)
            self._layouts[group.name] = layout
            self._requested[group.name] = GroupUploads(
                group.name,
                tuple(range(len(layout))),
                tuple(
                    SignedUpload(
                        sender,
                        digests[sender],
                        self._uploads[sender].signature,
                        # the group's chunks in chunk-index order: its tensors are sorted by name
                        tuple(
                            c
                            for t in self._uploads[sender].tensors
                            if t.group == group.name
                            for c in t.chunks
                        ),
                    )
                    for sender in self._members[group.name]
                    if sender in survivors
                ),
            )
        self._view = tuple(
            UploadEntry(
                sender, binding.upload_digest(sender, digests[sender], self._uploads[sender].signature)
            )
            for sender in self._survivors
        )
        self._view_digest = binding.view_digest(
            self._config.session_id, self._digest, self._adverts_digest, self._view
        )
        self._uploads = {}  # the signed uploads, per group, are what the decryptors get
        self._upload_digests = {}
        request = CkksViewRequest(self._config.session_id, self._view)
        return {cid: request for cid in self._survivors}

    def _close_view(self) -> dict[str, CkksServerMessage]:
        """Every decryptor needs t signatures over the view (t its own floor, a majority of the
        roster at least): below a majority none would decrypt.  A survivor that did not sign has
        dropped, and is not asked to decrypt."""
        quorum = majority_threshold(len(self._roster))
        if len(self._view_signatures) < quorum:
            raise ViewQuorumError(
                f"{len(self._view_signatures)} survivor(s) signed the view, fewer than a majority "
                f"({quorum}) of the roster's {len(self._roster)}: no decryptor decrypts without it"
            )
        self._failed_decryptors |= set(self._survivors) - set(self._view_signatures)
        groups = {g: (self._candidates(g), len(self._layouts[g])) for g in sorted(self._requested)}
        return self._ask(plan_chunk_sets(groups, self._max_decryptors, self._load))

    def _close_decrypt(self) -> dict[str, CkksServerMessage]:
        pending = [
            (group, sent.chunks)
            for decryptor, groups in sorted(self._asked.items())
            if decryptor not in self._answered
            for group, sent in sorted(groups.items())
        ]
        if not pending:
            self._finish()
            return {}
        # A decryptor that left chunk sets without their sums has dropped: ask other signers.
        self._failed_decryptors |= set(self._asked) - self._answered
        plan = []
        for group, chunks in pending:
            decryptor = min(self._candidates(group), key=lambda c: (self._load.get(c, 0), c))
            self._load[decryptor] = self._load.get(decryptor, 0) + len(chunks)
            plan.append((group, decryptor, chunks))
        return self._ask(plan)

    def _candidates(self, group: str) -> list[str]:
        """The group's surviving members that signed the view and have not dropped since."""
        survivors = set(self._survivors)
        candidates = [c for c in self._members[group] if c in survivors and c not in self._failed_decryptors]
        if not candidates:
            raise NoDecryptorError(
                f"no surviving member of group {group!r} is left to decrypt its sum "
                f"(tried {sorted(set(self._members[group]) & self._failed_decryptors)})"
            )
        return candidates

    def _ask(self, plan: list[tuple[str, str, tuple[int, ...]]]) -> dict[str, CkksServerMessage]:
        """R4 requests for ``plan``'s chunk sets; two sets of one group for one decryptor merge."""
        wanted: dict[str, dict[str, set[int]]] = {}
        for group, decryptor, chunks in plan:
            wanted.setdefault(decryptor, {}).setdefault(group, set()).update(chunks)
        self._asked = {
            decryptor: {group: self._slice(group, tuple(sorted(chunks))) for group, chunks in groups.items()}
            for decryptor, groups in wanted.items()
        }
        self._answered = set()
        signatures = tuple(self._view_signatures[c] for c in sorted(self._view_signatures))
        return {
            decryptor: CkksDecryptRequest(
                self._config.session_id,
                self._view,
                signatures,
                tuple(groups[g] for g in sorted(groups)),
            )
            for decryptor, groups in sorted(self._asked.items())
        }

    def _slice(self, group: str, chunks: tuple[int, ...]) -> GroupUploads:
        """The group's chunk set as a decryptor gets it: every survivor's digests and signature, and
        only its ciphertexts of those chunks."""
        full = self._requested[group]
        return GroupUploads(
            group,
            chunks,
            tuple(
                SignedUpload(u.sender, u.digests, u.signature, tuple(u.chunks[k] for k in chunks))
                for u in full.uploads
            ),
        )

    def _finish(self) -> None:
        survivors = set(self._survivors)
        groups = {}
        for group in self._config.groups:
            sums, chunk_decryptors = assemble_group_sums(
                group.name, self._layouts[group.name], self._decrypted.get(group.name, ())
            )
            groups[group.name] = CkksGroupSum(
                name=group.name,
                members=self._members[group.name],
                survivors=tuple(c for c in self._members[group.name] if c in survivors),
                chunk_decryptors=chunk_decryptors,
                sums=MappingProxyType(sums),
            )
        self._result = CkksAggregationResult(
            session_id=self._config.session_id,
            key_holder=self._key_holder,
            groups=MappingProxyType(groups),
            survivors=self._survivors,
            replaced_key_holders=self._replaced_key_holders,
        )
