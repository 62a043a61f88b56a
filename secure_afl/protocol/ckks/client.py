"""The CKKS client's state machine (sans-I/O): it takes a server message and returns the replies.

Like the masking client, every check on a server message runs before anything derived from a
secret is built, and the new state is committed only after the reply is complete: a failed check
leaves the client FAILED with its session secrets (X25519 key, CKKS context) dropped.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from secure_afl.core.errors import (
    ClientProtocolError,
    DifferentSessionViewError,
    DuplicateClientError,
    InconsistentSurvivorsError,
    InvalidSessionConfigError,
    InvalidShareError,
    InvalidSignatureError,
    LocalProtocolError,
    ReplayedMessageError,
    ServerProtocolError,
    ShareAuthenticationError,
    UnknownClientError,
)
from secure_afl.core.randomness import RandomSource
from secure_afl.keys.identity import IdentityKey
from secure_afl.keys.roster import Roster
from secure_afl.privacy import exposure
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.privacy.release import Release
from secure_afl.protocol import codec as masking_codec
from secure_afl.protocol import crypto
from secure_afl.protocol.binding import NO_CONTEXT, check_context
from secure_afl.protocol.driver import (
    Handled,
    SessionDriver,
    check_name,
    check_session_fits_inputs,
)
from secure_afl.protocol.exposure_gate import zero_commitments

from . import binding, codec, context
from .errors import (
    ExposingDecryptionError,
    InvalidChunkSetError,
    InvalidContextError,
    InvalidParametersError,
    InvalidSumCiphertextError,
    RepeatedDecryptionError,
    UnsignedViewError,
)
from .messages import (
    CkksAdvertise,
    CkksAdvertiseRequest,
    CkksClientMessage,
    CkksDecryption,
    CkksDecryptRequest,
    CkksInput,
    CkksInputRequest,
    CkksKeyDistribution,
    CkksKeyRequest,
    CkksSessionConfig,
    CkksViewRequest,
    CkksViewSignature,
    DecryptedChunk,
    DecryptedGroup,
    EncryptedContext,
    EncryptedTensor,
    GroupUploads,
    UploadEntry,
)
from .state import CLIENT_REPEATS, CLIENT_TRANSITIONS, CkksClientState

if TYPE_CHECKING:
    from secure_afl.privacy.ledger import Ledger


def validate_config(config: CkksSessionConfig, roster_size: int) -> None:
    """Structural checks on a CKKS session config (raises :class:`InvalidSessionConfigError`)."""
    if len(config.session_id) != 32:
        raise InvalidSessionConfigError("session id must be 32 bytes")
    if not 1 <= config.min_group_size <= roster_size:
        raise InvalidSessionConfigError(
            f"minimum group size {config.min_group_size} outside 1..{roster_size}"
        )
    try:
        config.parameters.validate()
    except InvalidParametersError as exc:
        raise InvalidSessionConfigError(f"CKKS parameters refused: {exc}") from None
    names = [group.name for group in config.groups]
    if not names or len(set(names)) != len(names):
        raise InvalidSessionConfigError("the session needs distinct group names")
    for group in config.groups:
        check_name("group", group.name)
        tensor_names = [tensor.name for tensor in group.tensors]
        if not tensor_names or len(set(tensor_names)) != len(tensor_names):
            raise InvalidSessionConfigError(f"group {group.name!r}: tensors must be non-empty and distinct")
        for tensor in group.tensors:
            check_name(f"group {group.name!r}: tensor", tensor.name)
            if not 1 <= tensor.length <= codec.MAX_TENSOR_VALUES:
                raise InvalidSessionConfigError(
                    f"group {group.name!r}: tensor {tensor.name!r} length must be "
                    f"1..{codec.MAX_TENSOR_VALUES}"
                )


class CkksClientSession(SessionDriver):
    """One client's side of one CKKS session.

    ``inputs`` maps group name -> tensor name -> 1-D float64 array (symmetric matrices packed as
    their upper triangle).  ``policy`` is the client's own (default
    :meth:`ClientPolicy.deployment`); ``min_group_size`` overrides its floor.  The exposure checks
    (:mod:`secure_afl.privacy.exposure`) run where this client can still stop its data:

    - R1, under a refusing policy: the advertised memberships alone isolate this client's values;
    - R2, before it encrypts anything: the same over the advertised members, with the ledger's
      earlier sessions over this input; the session is recorded in the ledger then (CKKS has no
      later point at which the client could still withhold its input);
    - R3, as a survivor asked to sign the view (every upload that counts), under a refusing policy,
      and R4, as a decryptor: the survivor sets of *all* the session's groups would isolate *any*
      client's value (every member is exposed by the decryption it performs).

    One view per session (SECURITY.md §7): a client signs one view in R3, and decrypts in R4 only
    under that view, when at least t survivors (t = its own threshold floor for the roster) signed
    it; its ledger keeps the view of each round, so no copy of it signs or decrypts under another.

    A refusing policy raises (:class:`~secure_afl.core.errors.ExposureRefusedError`,
    :class:`ExposingDecryptionError`); the simulator's reports in :attr:`exposure_findings`.
    """

    def __init__(
        self,
        client_id: str,
        identity_key: IdentityKey,
        roster: Roster,
        inputs: Mapping[str, Mapping[str, np.ndarray]],
        *,
        min_group_size: int | None = None,
        session_id: bytes | None = None,
        policy: ClientPolicy | None = None,
        ledger: Ledger | None = None,
        release: Release | None = None,
        random: RandomSource | None = None,
        context: bytes = NO_CONTEXT,
        rows: Mapping[str, int] | None = None,
        row_floors: Mapping[str, int] | None = None,
    ) -> None:
        self._session_context = check_context(context)  # one view: signed within the config digest (R0, R1)
        self._replaying = False  # see replay_bytes
        super().__init__(
            client_id, identity_key, roster, inputs, policy=policy, min_group_size=min_group_size,
            min_threshold=None, session_id=session_id, random=random, ledger=ledger, release=release,
            rows=rows, row_floors=row_floors,
        )  # fmt: skip
        self._message_limit = min(self._policy.max_config_bytes, masking_codec.DEFAULT_MAX_MESSAGE_BYTES)

    # --- public API -------------------------------------------------------------------------------

    @property
    def max_message_bytes(self) -> int:
        return self._message_limit

    @property
    def is_key_holder(self) -> bool:
        return self._key_holder == self.client_id

    def close(self) -> None:
        """End the session (no more decryptions) and drop the secret key."""
        if self._state is not CkksClientState.FAILED:
            self._state = CkksClientState.DONE
        self._clear_session()

    def replay_bytes(self, data: bytes) -> None:
        """Feed a server message this client already answered (a deployed client is rebuilt for
        every message from its seed and the server's messages).  The state moves exactly as with
        :meth:`receive_bytes`, every check included, but the replies, already sent, are not made
        again: R1's key (a new TenSEAL key, sealed under nonces the seeded stream already used) and
        R2's encryption of every input (the costly part of a decryptor's rebuild)."""
        self._replaying = True
        try:
            self.receive_bytes(data)
        finally:
            self._replaying = False

    def _decode(self, data: bytes) -> object:
        return codec.decode(data, max_message_bytes=self.max_message_bytes)

    def _encoded(self, reply: object) -> bytes:
        return codec.encode(reply, max_message_bytes=self.max_message_bytes)  # type: ignore[arg-type]

    def _encode_message(self, message: object) -> bytes:
        return codec.encode(message, max_message_bytes=masking_codec.DEFAULT_MAX_MESSAGE_BYTES)  # type: ignore[arg-type]

    def _handlers(self) -> Mapping[type, Callable[[Any], Handled]]:
        return {
            CkksAdvertiseRequest: self._on_advertise_request,
            CkksKeyRequest: self._on_key_request,
            CkksInputRequest: self._on_input_request,
            CkksViewRequest: self._on_view_request,
            CkksDecryptRequest: self._on_decrypt_request,
        }

    def _handle(self, message: object, repeated: bool) -> Handled:
        if repeated:  # CLIENT_REPEATS: the key request again, a re-election
            return self._on_key_reelection(message)  # type: ignore[arg-type]
        return self._handlers()[type(message)](message)

    def _records_answer(self) -> bool:
        return not self._replaying  # a replayed message was answered (and recorded) before

    # --- R0 ---------------------------------------------------------------------------------------

    def _on_advertise_request(self, request: CkksAdvertiseRequest):
        config = request.config
        if self._expected_session_id is not None and config.session_id != self._expected_session_id:
            raise ReplayedMessageError("the advertise request belongs to another session")
        validate_config(config, len(self._roster))
        check_session_fits_inputs(config.groups, config.min_group_size, self._min_group_size, self._inputs)
        self._gate.start(config.session_id)  # one contribution per value: before any key leaves
        encryption_key = crypto.new_x25519_key(self._random)
        digest = binding.config_digest(config, self._session_context)
        groups = tuple(sorted(self._inputs))
        public = crypto.x25519_public_bytes(encryption_key)
        rows = () if self._rows is None else tuple(self._rows[g] for g in groups)
        domain, fields = binding.advertise_fields(
            config.session_id, self.client_id, public, digest, groups, rows
        )
        advert = CkksAdvertise(
            config.session_id,
            self.client_id,
            public,
            digest,
            groups,
            crypto.sign(self._identity.private_key, domain, *fields),
            rows,
        )
        limit = codec.max_message_bytes(config, len(self._roster))

        def commit() -> None:
            self._config = config
            self._config_digest = digest
            self._encryption_key = encryption_key
            self._own_advert = advert
            self._message_limit = limit

        return [advert], commit

    # --- R1 ---------------------------------------------------------------------------------------

    def _on_key_request(self, request: CkksKeyRequest):
        config = self._require_config()
        self._check_session(request.session_id)
        adverts: dict[str, CkksAdvertise] = {}
        group_names = {group.name for group in config.groups}
        for advert in request.advertisements:
            if advert.session_id != config.session_id:
                raise ReplayedMessageError(
                    f"advertisement of {advert.client_id!r} belongs to another session"
                )
            if advert.client_id not in self._roster:
                raise UnknownClientError(f"advertisement from {advert.client_id!r}, who is not in the roster")
            if advert.client_id in adverts:
                raise DuplicateClientError(f"two advertisements for client {advert.client_id!r}")
            if not binding.advertisement_signed_by(advert, self._roster.public_key(advert.client_id)):
                raise InvalidSignatureError(
                    f"the key of {advert.client_id!r} is not signed by its roster identity key"
                )
            if advert.config_digest != self._config_digest:
                raise DifferentSessionViewError(
                    f"{advert.client_id!r} signed another session than this client's (its config, study, "
                    f"round or round 2's teacher differ): the server shows clients different sessions"
                )
            if len(set(advert.groups)) != len(advert.groups) or not set(advert.groups) <= group_names:
                raise ClientProtocolError(f"{advert.client_id!r} declared unknown or repeated groups")
            if advert.rows and len(advert.rows) != len(advert.groups):
                raise ClientProtocolError(
                    f"{advert.client_id!r} committed counts that do not match its groups"
                )
            adverts[advert.client_id] = advert
        if adverts.get(self.client_id) != self._own_advert:
            raise ServerProtocolError("the server omitted or altered this client's own advertisement")
        return self._elect(config, adverts)

    def _on_key_reelection(self, request: CkksKeyRequest):
        """A repeated R1: the key holder sent no key, so the server asks again without it.

        The server may only remove the key holder it could not get a key from: the advertisements
        must be exactly those accepted before, less that key holder (never this client).  The
        advertisements without it choose the next key holder, as in R1.
        """
        config = self._require_config()
        self._check_session(request.session_id)
        if self._key_holder == self.client_id:
            raise ServerProtocolError("this client is the key holder; it is not asked for a key again")
        expected = {cid: a for cid, a in self._adverts.items() if cid != self._key_holder}
        received = {advert.client_id: advert for advert in request.advertisements}
        if len(received) != len(request.advertisements) or received != expected:
            raise ServerProtocolError(
                f"a repeated key request must carry the accepted advertisements less the key holder "
                f"{self._key_holder!r}, and nothing else"
            )
        return self._elect(config, expected)

    def _elect(self, config: CkksSessionConfig, adverts: dict[str, CkksAdvertise]):
        """Group checks over ``adverts``, the key holder they choose, and its key (if it is this client)."""
        members = {
            group.name: tuple(sorted(cid for cid, a in adverts.items() if group.name in a.groups))
            for group in config.groups
        }
        self._check_group_sizes(members, set(adverts), own_groups_only=True)
        if self._policy.refuse_exposure:  # the layout alone may already isolate this client
            self._own_exposure_gate("R1", "take part (R1)", members, set(adverts), adverts=adverts)
        adverts_digest = binding.advertisements_digest(config.session_id, adverts.values())
        holder = binding.key_holder(config.session_id, adverts_digest, adverts)
        replies: list[CkksClientMessage] = []
        if holder == self.client_id and not self._replaying:
            # The key holder seals the context for itself too and keeps nothing: in R2 it opens its
            # copy like every peer.  So a client rebuilt by replaying the server's messages (the
            # deployment's drivers do) needs no state, although TenSEAL's key generation cannot be
            # seeded: a replayed R1 makes a new key whose reply the server never takes.
            secret_context = context.new_secret_context(config.parameters)
            public = context.public_bytes(secret_context)
            secret = context.secret_bytes(secret_context)
            secret_digest = binding.secret_context_digest(secret)  # every peer checks its copy against it
            del secret_context
            sealed = []
            for peer in sorted(adverts):
                shared = crypto.x25519_shared_secret(
                    self._encryption_key, adverts[peer].encryption_public_key
                )
                key = binding.context_encryption_key(shared, config.session_id, self.client_id, peer)
                nonce = self._random.token_bytes(crypto.NONCE_BYTES)
                associated = binding.context_associated_data(config.session_id, self.client_id, peer, public)
                sealed.append(
                    EncryptedContext(
                        self.client_id, peer, nonce, crypto.encrypt_share(key, nonce, secret, associated)
                    )
                )
            domain, fields = binding.public_context_fields(
                config.session_id, self._config_digest, adverts_digest, self.client_id, public, secret_digest
            )
            signature = crypto.sign(self._identity.private_key, domain, *fields)
            replies.append(
                CkksKeyDistribution(
                    config.session_id, self.client_id, public, secret_digest, signature, tuple(sealed)
                )
            )

        def commit() -> None:
            self._adverts = adverts
            self._adverts_digest = adverts_digest
            self._members = members
            self._key_holder = holder

        return replies, commit

    # --- R2 ---------------------------------------------------------------------------------------

    def _on_input_request(self, request: CkksInputRequest):
        config = self._require_config()
        self._check_session(request.session_id)
        if request.key_holder != self._key_holder:
            raise ServerProtocolError(
                f"the server names {request.key_holder!r} as key holder; "
                f"the advertisements chose {self._key_holder!r}"
            )
        domain, fields = binding.public_context_fields(
            config.session_id,
            self._config_digest,
            self._adverts_digest,
            self._key_holder,
            request.public_context,
            request.secret_digest,
        )
        if not crypto.verify(self._roster.public_key(self._key_holder), request.signature, domain, *fields):
            raise InvalidSignatureError(
                f"the public context is not signed by the key holder {self._key_holder!r} for this session"
            )
        # Every client, the key holder included, opens its sealed copy of the secret context.
        sealed = request.context
        if sealed is None or sealed.sender != self._key_holder or sealed.recipient != self.client_id:
            raise ServerProtocolError("the secret context from the key holder, addressed here, is missing")
        shared = crypto.x25519_shared_secret(
            self._encryption_key, self._adverts[self._key_holder].encryption_public_key
        )
        key = binding.context_encryption_key(shared, config.session_id, self._key_holder, self.client_id)
        associated = binding.context_associated_data(
            config.session_id, self._key_holder, self.client_id, request.public_context
        )
        try:
            secret = crypto.decrypt_share(key, sealed.nonce, sealed.ciphertext, associated, self._key_holder)
        except (InvalidShareError, ShareAuthenticationError) as exc:
            raise InvalidContextError(
                f"the secret context from {self._key_holder!r} fails authentication"
            ) from exc
        if binding.secret_context_digest(secret) != request.secret_digest:
            raise InvalidContextError(
                f"the secret context {self._key_holder!r} sealed for this client is not the one it committed "
                f"to in its signed key message: the key holder gave peers different keys"
            )
        try:
            secret_context = context.load_context(secret)
        except ValueError as exc:
            raise InvalidContextError(f"the key holder's secret context: {exc}") from None
        if not secret_context.is_private():
            raise InvalidContextError(
                f"the key holder {self._key_holder!r} sent a context without a secret key"
            )
        mismatch = context.parameters_mismatch(secret_context, config.parameters)
        if mismatch is not None:
            raise InvalidContextError(f"the key holder's context does not match the session: {mismatch}")
        if context.public_bytes(secret_context) != request.public_context:
            raise InvalidContextError("the secret context does not belong to the signed public context")
        # The point of no return: once encrypted inputs are out, a decryptor can reveal their sums.
        findings = self._own_exposure_gate(
            "R2", "upload encrypted inputs (R2)", self._members, set(self._adverts), release=True
        )
        tensors: list[EncryptedTensor] = []
        if self._replaying:  # the encrypted inputs were sent when this message first came

            def replayed() -> None:
                self._context = secret_context
                self._gate.findings.extend(findings)

            return [], replayed
        for group in sorted(self._inputs):
            for name in sorted(self._inputs[group]):
                values = self._inputs[group][name]
                bound = config.parameters.value_bound / len(self._members[group])
                largest = float(np.max(np.abs(values)))
                if largest >= bound:
                    raise LocalProtocolError(
                        f"tensor {group}/{name}: max |value| {largest:.6g} exceeds the CKKS "
                        f"range {bound:.6g} for a group of {len(self._members[group])}"
                    )
                tensors.append(
                    EncryptedTensor(group, name, context.encrypt(secret_context, values, config.parameters))
                )
        digests = binding.tensor_digests(tensors)  # every chunk hashed once: the signature and the view
        domain, fields = binding.input_fields_of_digests(
            config.session_id, self._config_digest, self.client_id, digests
        )
        reply = CkksInput(
            config.session_id,
            self.client_id,
            tuple(tensors),
            crypto.sign(self._identity.private_key, domain, *fields),
        )
        upload = binding.upload_digest(self.client_id, digests, reply.signature)

        def commit() -> None:
            self._context = secret_context
            self._gate.findings.extend(findings)
            self._upload_digest = upload

        return [reply], commit

    # --- R3 ---------------------------------------------------------------------------------------

    def _on_view_request(self, request: CkksViewRequest):
        """Sign the view (every upload that counts), once per session: the ledger's R3 record keeps
        its digest, so no copy of this client signs another."""
        config = self._require_config()
        self._check_session(request.session_id)
        live = self._check_view(request.uploads)
        own = next(entry.digest for entry in request.uploads if entry.sender == self.client_id)
        if self._upload_digest and own != self._upload_digest:
            raise InconsistentSurvivorsError(
                "the view names an upload of this client other than the one it sent"
            )
        findings: tuple[exposure.ExposureFinding, ...] = ()
        if self._policy.refuse_exposure:  # no quorum forms over a view that isolates a client
            findings = self._decryption_exposure(live, "R3", "sign the survivor view (R3)")
        view = self._view_digest(request.uploads)
        domain, fields = binding.view_fields(
            config.session_id, self._config_digest, self._adverts_digest, request.uploads
        )
        reply = CkksViewSignature(
            config.session_id, self.client_id, crypto.sign(self._identity.private_key, domain, *fields)
        )

        def commit() -> None:
            self._view = view
            self._gate.findings.extend(f for f in findings if f not in self._gate.findings)

        return [reply], commit

    def _check_view(self, uploads: tuple[UploadEntry, ...]) -> frozenset[str]:
        """A view's structure: one entry per advertised client, sorted, this client's among them, and
        every group at its minimum size over the senders.  Returns the senders (the survivors)."""
        senders = [entry.sender for entry in uploads]
        if len(set(senders)) != len(senders):
            raise DuplicateClientError("the view lists two uploads of one client")
        if senders != sorted(senders):
            raise ServerProtocolError("the view must list its uploads sorted by sender")
        unknown = set(senders) - set(self._adverts)
        if unknown:
            raise UnknownClientError(f"survivors {sorted(unknown)} never advertised keys")
        if self.client_id not in senders:
            raise InconsistentSurvivorsError("this client's own input is missing from the survivor set")
        live = frozenset(senders)
        self._check_group_sizes(self._members, live, own_groups_only=False)
        return live

    def _check_quorum(self, request: CkksDecryptRequest, live: frozenset[str]) -> None:
        """At least t distinct survivors of the view signed it, t this client's own threshold floor
        for the roster (a majority at least): two views cannot both have t honest signers, since
        each signs one view per session."""
        config = self._require_config()
        quorum = self._policy.min_threshold(len(self._roster))
        domain, fields = binding.view_fields(
            config.session_id, self._config_digest, self._adverts_digest, request.uploads
        )
        signers: set[str] = set()
        for item in request.signatures:
            if item.session_id != config.session_id:
                raise ReplayedMessageError(
                    f"the view signature of {item.sender!r} belongs to another session"
                )
            if item.sender in signers:
                raise DuplicateClientError(f"two view signatures of {item.sender!r}")
            if item.sender not in live:
                raise UnsignedViewError(f"{item.sender!r} signed the view but has no upload in it")
            if not crypto.verify(self._roster.public_key(item.sender), item.signature, domain, *fields):
                raise UnsignedViewError(
                    f"the view signature of {item.sender!r} is not over this view of this session"
                )
            signers.add(item.sender)
        if len(signers) < quorum:
            raise UnsignedViewError(
                f"{len(signers)} survivor(s) signed the view, fewer than t = {quorum} of the roster's "
                f"{len(self._roster)}: without a quorum over one view the server could show another "
                f"decryptor another survivor set"
            )

    # --- R4 ---------------------------------------------------------------------------------------

    def _on_decrypt_request(self, request: CkksDecryptRequest):
        """Decrypt the requested chunk sets (SECURITY.md §7.6): per group, the chunk indices named,
        each summed here from every survivor's signed ciphertext of that chunk.  Every value leaving
        is a chunk of a group sum over the one view this client signed; a chunk it decrypted before
        in this session, or one named twice, is refused (:class:`RepeatedDecryptionError`)."""
        config = self._require_config()
        self._check_session(request.session_id)
        live = self._check_view(request.uploads)
        view = self._view_digest(request.uploads)
        if view != self._view:
            raise InconsistentSurvivorsError(
                "the decryption request's view differs from the one this client signed in R3"
            )
        self._check_quorum(request, live)
        findings = self._decryption_exposure(live, "R4", "decrypt the group sums (R4)")
        uploads = {entry.sender: entry.digest for entry in request.uploads}
        seen: set[str] = set()
        out: list[DecryptedGroup] = []
        for item in request.groups:
            if item.group in seen:
                raise RepeatedDecryptionError(f"group {item.group!r} is named twice in one request")
            seen.add(item.group)
            if item.group not in self._inputs:
                raise ServerProtocolError(
                    f"asked to decrypt group {item.group!r}, of which this client is not a member"
                )
            layout = context.group_chunks(
                {t.name: t.length for t in config.group(item.group).tensors}, config.parameters
            )
            self._check_chunk_set(item.group, item.chunks, len(layout))
            summed = self._verified_sum(config, item, layout, live, uploads)
            plaintexts = tuple(
                DecryptedChunk(
                    k, context.decrypt(self._context, [vector], config.parameters).astype("<f8").tobytes()
                )
                for k, vector in zip(item.chunks, summed, strict=True)
            )
            domain, fields = binding.decryption_fields(
                config.session_id,
                self._config_digest,
                self._adverts_digest,
                view,
                item.group,
                item.chunks,
                tuple(c for c in self._members[item.group] if c in live),
                item.uploads,
                plaintexts,
            )
            signature = crypto.sign(self._identity.private_key, domain, *fields)
            out.append(DecryptedGroup(item.group, plaintexts, signature))
        reply = CkksDecryption(config.session_id, self.client_id, tuple(out))

        def commit() -> None:
            for item in request.groups:
                self._decrypted.setdefault(item.group, set()).update(item.chunks)
            self._gate.findings.extend(f for f in findings if f not in self._gate.findings)

        return [reply], commit

    def _check_chunk_set(self, group: str, chunks: tuple[int, ...], count: int) -> None:
        """A requested chunk set: non-empty, increasing, within the group's 0..count-1, and none of
        it decrypted by this client before (under the one view: see :meth:`_on_decrypt_request`)."""
        if not chunks:
            raise InvalidChunkSetError(f"group {group!r}: the request names no chunk to decrypt")
        if any(b <= a for a, b in itertools.pairwise(chunks)):
            if len(set(chunks)) != len(chunks):
                raise RepeatedDecryptionError(f"group {group!r}: a chunk is named twice in one request")
            raise InvalidChunkSetError(f"group {group!r}: chunk indices must increase, got {list(chunks)}")
        if chunks[0] < 0 or chunks[-1] >= count:
            raise InvalidChunkSetError(
                f"group {group!r} has chunks 0..{count - 1}; the request names {list(chunks)}"
            )
        again = sorted(set(chunks) & self._decrypted.get(group, set()))
        if again:
            raise RepeatedDecryptionError(
                f"group {group!r}: chunk(s) {again} were decrypted by this client already in this session"
            )

    def _verified_sum(
        self,
        config: CkksSessionConfig,
        item: GroupUploads,
        layout: tuple[tuple[str, int, int], ...],
        live: frozenset[str],
        view: Mapping[str, bytes],
    ) -> list:
        """The requested chunks of the group's sum, computed here from its survivors' signed uploads
        (never a ciphertext the server summed): exactly one upload from each surviving member, each
        signed by its sender over the digests of all its chunks, the one the view names, and each
        chunk given matching the digest its sender signed at that chunk's position."""
        expected = tuple(c for c in self._members[item.group] if c in live)
        senders = [upload.sender for upload in item.uploads]
        if len(set(senders)) != len(senders):
            raise DuplicateClientError(f"group {item.group!r}: two uploads from one client")
        if sorted(senders) != sorted(expected):
            raise InconsistentSurvivorsError(
                f"group {item.group!r}: the uploads are from {sorted(senders)}, its survivors are "
                f"{sorted(expected)}: a decryptor sums every survivor's upload, never fewer"
            )
        if len(expected) < config.min_group_size:  # also checked on the survivor set; never decrypt less
            raise InconsistentSurvivorsError(f"group {item.group!r} has {len(expected)} survivors")
        tensor_chunks: dict[str, int] = {}
        for tensor, _, _ in layout:
            tensor_chunks[tensor] = tensor_chunks.get(tensor, 0) + 1
        totals: list = []
        for upload in item.uploads:
            domain, fields = binding.input_fields_of_digests(
                config.session_id, self._config_digest, upload.sender, upload.digests
            )
            if not crypto.verify(self._roster.public_key(upload.sender), upload.signature, domain, *fields):
                raise InvalidSignatureError(
                    f"group {item.group!r}: the upload of {upload.sender!r} is not signed by it"
                )
            if binding.upload_digest(upload.sender, upload.digests, upload.signature) != view[upload.sender]:
                raise InconsistentSurvivorsError(
                    f"group {item.group!r}: the upload of {upload.sender!r} is not the one the signed "
                    f"view names"
                )
            listed = {d.tensor: d.chunk_digests for d in upload.digests if d.group == item.group}
            if {t: len(d) for t, d in listed.items()} != tensor_chunks:
                raise ServerProtocolError(
                    f"group {item.group!r}: the upload of {upload.sender!r} does not sign the group's "
                    f"tensors in {len(layout)} chunks"
                )
            if len(upload.chunks) != len(item.chunks):
                raise InvalidSumCiphertextError(
                    f"group {item.group!r}: {len(upload.chunks)} ciphertexts of {upload.sender!r}, "
                    f"expected one per requested chunk ({len(item.chunks)})"
                )
            for position, (k, chunk) in enumerate(zip(item.chunks, upload.chunks, strict=True)):
                tensor, i, n = layout[k]
                if hashlib.sha256(chunk).digest() != listed[tensor][i]:
                    raise InvalidSumCiphertextError(
                        f"{item.group}/{tensor}: the ciphertexts of {upload.sender!r} are not the "
                        f"ones it signed (chunk {k}, {tensor} chunk {i})"
                    )
                try:
                    vector = context.load_ciphertext(self._context, chunk, n, config.parameters)
                except ValueError as exc:
                    raise InvalidSumCiphertextError(f"{item.group}/{tensor} chunk {i}: {exc}") from None
                if position < len(totals):
                    totals[position].add_(vector)
                else:
                    totals.append(vector)
        return totals

    # --- helpers ----------------------------------------------------------------------------------

    def _relevant(self) -> dict[str, tuple[str, ...]]:
        """The session's groups that carry a tensor this client sends (or one of the same
        server-parameterised family), with their tensors."""
        config = self._require_config()
        own = {name for tensors in self._inputs.values() for name in tensors}
        return exposure.linked_groups(own, {g.name: tuple(t.name for t in g.tensors) for g in config.groups})

    def _own_exposure_gate(
        self,
        round_name: str,
        action: str,
        members: Mapping[str, tuple[str, ...]],
        live: set[str],
        *,
        release: bool = False,
        adverts: Mapping[str, CkksAdvertise] | None = None,
    ) -> tuple[exposure.ExposureFinding, ...]:
        """This client's own check, as the masking client's (:class:`ExposureGate`); raise to refuse.

        CKKS has no threshold: the colluders assumed are the deployment's c = n - t at the active
        threshold floor (any peer may be a decryptor).  ``release``: the release point (R2)."""
        groups = {
            name: (tuple(c for c in members.get(name, ()) if c in live), tensors)
            for name, tensors in self._relevant().items()
        }
        return self._gate.check(
            round_name,
            action,
            groups,
            known_zero=zero_commitments(
                (self._adverts if adverts is None else adverts).values(),
                floors=self._row_floors,
                tensors={g.name: [t.name for t in g.tensors] for g in self._require_config().groups},
            ),
            session_id=self._require_config().session_id,
            colluders=self.colluders,
            release_survivors=tuple(sorted(live)) if release else None,
        )

    def _round_key(self, message: object) -> str:
        """The one-answer record's key: one per round (a re-election repeats R1 once)."""
        if isinstance(message, CkksKeyRequest):
            return "R1/re-election" if self._state is not CkksClientState.AWAIT_KEY_REQUEST else "R1"
        return {
            CkksAdvertiseRequest: "R0",
            CkksInputRequest: "R2",
            CkksViewRequest: "R3",
            CkksDecryptRequest: "R4",
        }[type(message)]

    def _answer_digest(self, message: object, digest: str) -> str:
        """What the one-answer record keeps: the message's digest, but for R3 and R4 the view's, so
        that R4 may be asked again for other groups (a replacement decryptor) under the same view
        only: no copy of this client signs, or decrypts under, a second view."""
        if isinstance(message, CkksViewRequest | CkksDecryptRequest):
            return self._view_digest(message.uploads).hex()
        return digest

    def _view_digest(self, uploads: tuple[UploadEntry, ...]) -> bytes:
        config = self._require_config()
        return binding.view_digest(config.session_id, self._config_digest, self._adverts_digest, uploads)

    def _decryption_exposure(
        self, live: frozenset[str], round_name: str, action: str
    ) -> tuple[exposure.ExposureFinding, ...]:
        """Whether the sums over *all* the session's groups, over the survivors shown, isolate any
        client's value (a tensor name is one value per client across groups: the server cannot be
        trusted to say otherwise).  A refusing policy raises :class:`ExposingDecryptionError`."""
        config = self._require_config()
        groups = {
            group.name: (
                tuple(c for c in self._members[group.name] if c in live),
                tuple(t.name for t in group.tensors),
            )
            for group in config.groups
        }
        findings = tuple(
            exposure.ExposureFinding(
                round=round_name,
                tensor=tensor,
                clients=clients,
                groups=tuple(
                    g
                    for g, (alive, carried) in groups.items()
                    if tensor in carried and set(alive) & set(clients)
                ),
                with_history=False,
            )
            for tensor, clients in exposure.exposed_clients(groups).items()
        )
        if findings and self._policy.refuse_exposure:
            self._gate.findings.extend(findings)
            raise ExposingDecryptionError(action, findings)
        return findings

    def _clear_session(self) -> None:
        # Drop every session secret; Python cannot zeroise memory, but nothing keeps a reference.
        self._config: CkksSessionConfig | None = None
        self._config_digest = b""
        self._encryption_key = None  # type: ignore[assignment]
        self._own_advert: CkksAdvertise | None = None
        self._adverts: dict[str, CkksAdvertise] = {}
        self._adverts_digest = b""
        self._members: dict[str, tuple[str, ...]] = {}
        self._key_holder = ""
        self._context = None  # the TenSEAL context with the secret key
        self._upload_digest = b""  # this client's own upload (unknown to a client rebuilt by replay)
        self._view = b""  # the digest of the view this client signed in R3
        self._decrypted: dict[str, set[int]] = {}  # group -> chunk indices decrypted (R4)


CkksClientSession.States = CkksClientState
CkksClientSession.TRANSITIONS = CLIENT_TRANSITIONS
CkksClientSession.REPEATS = CLIENT_REPEATS
CkksClientSession.SERVER_MESSAGES = (
    CkksAdvertiseRequest,
    CkksKeyRequest,
    CkksInputRequest,
    CkksViewRequest,
    CkksDecryptRequest,
)
