"""The client's state machine (sans-I/O): it takes a server message and returns the replies.

Every check on a server message runs before anything derived from a secret is built, and the new
state is committed only after the reply is complete: a failed check leaves the client FAILED
(never half-updated) with its session secrets dropped, and it returns nothing.

The client defends itself against the server (the party we do not trust), by its own
:class:`~secure_afl.privacy.policy.ClientPolicy`, never by anything the server sends:

- R0: threshold and minimum group size not below its floors; the config within its size limits.
- R0 (deployment policy): one contribution per value: a value already released in another
  completed session (by content, :mod:`secure_afl.privacy.release`) is refused before any key leaves.
- Every round (deployment policy): one answer per round: the digest of the message answered is
  recorded in the ledger before the reply leaves; a different message for that round is refused.
- R1, every policy: one view: every advertisement relayed (at least t) signs this client's own
  config digest, which covers the session context it was given (the study, its round, round 2's
  teacher W): else :class:`DifferentSessionViewError`, before any share exists.
- R1 (deployment policy), R3 and R4: the exposure check
  (:func:`~secure_afl.privacy.exposure.client_exposures`): would the sums over the survivors
  determine one client's value, with up to c = n - t colluding peers' values known (t this client's
  own floor, never the session's t)?  The
  deployment policy refuses (:class:`ExposureRefusedError`); the simulator policy goes on and
  records the finding in :attr:`ClientSession.exposure_findings`.
- R3: the release (and the survivor set signed) is recorded in the ledger before the signature
  leaves the client; the server can obtain the sums from then on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from secure_afl.core import encoding
from secure_afl.core.errors import (
    BothSharesRequestedError,
    DifferentSessionViewError,
    DuplicateParticipantError,
    InconsistentSurvivorsError,
    InvalidSessionConfigError,
    InvalidShareError,
    RelayedSignatureError,
    ReplayedMessageError,
    ServerProtocolError,
    SurvivorsBelowThresholdError,
    UnknownParticipantError,
)
from secure_afl.core.randomness import RandomSource
from secure_afl.core.workers import ONE_THREAD, Workers
from secure_afl.keys.identity import IdentityKey
from secure_afl.keys.roster import Roster
from secure_afl.privacy import exposure
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.privacy.release import Release

from . import binding, codec, crypto, prg, shamir
from .driver import Handled, SessionDriver, check_name, check_session_fits_inputs
from .exposure_gate import zero_commitments
from .fields import tagged_fields
from .messages import (
    AdvertiseKeys,
    AdvertiseRequest,
    ClientMessage,
    ConsistencyCheckRequest,
    ConsistencyResponse,
    EncryptedShare,
    MaskedInput,
    MaskedInputRequest,
    RevealedShare,
    SessionConfig,
    ShareKeys,
    ShareKeysRequest,
    UnmaskRequest,
    UnmaskResponse,
)
from .state import CLIENT_TRANSITIONS, ClientState

if TYPE_CHECKING:
    from secure_afl.privacy.ledger import Ledger

SEED_BYTES = 32


@dataclass(frozen=True, slots=True)
class _HeldShares:
    """The shares this client holds of one peer's self-mask seed and mask key."""

    self_mask: int
    mask_key: int


@dataclass(frozen=True, slots=True)
class _PeerSecrets:
    """This client's X25519 secrets with one peer: for their shares, and for their pairwise masks."""

    encryption: bytes
    mask: bytes


def validate_config(config: SessionConfig, roster_size: int) -> None:
    """Structural checks on a session config (raises :class:`InvalidSessionConfigError`)."""
    if len(config.session_id) != 32:
        raise InvalidSessionConfigError("session id must be 32 bytes")
    if not 1 <= config.threshold <= roster_size:
        raise InvalidSessionConfigError(f"threshold {config.threshold} outside 1..{roster_size}")
    if config.min_group_size < 1:
        raise InvalidSessionConfigError("minimum group size must be at least 1")
    if not 0 <= config.frac_bits <= encoding.MAX_FRAC_BITS:
        raise InvalidSessionConfigError(f"frac_bits {config.frac_bits} outside 0..{encoding.MAX_FRAC_BITS}")
    for group in config.groups:
        check_name("group", group.name)
        for tensor in group.tensors:
            check_name(f"group {group.name!r}: tensor", tensor.name)
    names = [group.name for group in config.groups]
    if len(set(names)) != len(names):
        raise InvalidSessionConfigError("duplicate group names in the session config")
    for group in config.groups:
        tensor_names = [tensor.name for tensor in group.tensors]
        if not tensor_names or len(set(tensor_names)) != len(tensor_names):
            raise InvalidSessionConfigError(f"group {group.name!r}: tensors must be non-empty and distinct")
        if any(tensor.length < 1 for tensor in group.tensors):
            raise InvalidSessionConfigError(f"group {group.name!r}: tensor lengths must be positive")
        if any(tensor.length > codec.MAX_TENSOR_WORDS for tensor in group.tensors):
            raise InvalidSessionConfigError(
                f"group {group.name!r}: a tensor is longer than {codec.MAX_TENSOR_WORDS} words"
            )


class ClientSession(SessionDriver):
    """One client's side of one secure-aggregation session.

    ``inputs`` maps group name -> tensor name -> 1-D float64 array (pack symmetric matrices with
    :func:`~secure_afl.core.encoding.pack_symmetric` first).  The client joins exactly these
    groups.  ``policy`` is this client's own setting (default: :meth:`ClientPolicy.deployment`):
    its threshold floor (``policy.min_threshold(len(roster))``), its minimum group size, and
    whether it refuses a session whose sums would determine one client's value.
    ``min_threshold`` and ``min_group_size``, when given, replace the policy's floors (a server
    that proposes less is refused).  ``ledger`` keeps this client's releases and answers (see
    :mod:`secure_afl.privacy.ledger`); ``release`` names what the session releases, by default
    :meth:`Release.of(inputs) <secure_afl.privacy.release.Release.of>` (pass the release of the
    statistics before randomisation when the inputs carry fresh noise, with source ids).
    ``session_id``, when given, pins the session this client expects.  ``context`` is the one-view
    digest of what shapes the release besides the config (:func:`binding.session_context
    <secure_afl.protocol.binding.session_context>`: the study, its round, round 2's teacher W),
    computed by this client from what it was given: its advertisement signs it within the config
    digest, and in R1 it refuses (:class:`DifferentSessionViewError`) advertisements that sign another.
    ``rows``, when given, is this client's committed count per group (the rows its values there are
    computed from), signed in its advertisement; every client's exposure check treats a member that
    committed 0 rows to a group as a known value there, and refuses a session whose values come from
    fewer than c + 2 members with rows (:class:`~secure_afl.core.errors.IncrementTooSmallError`).
    ``row_floors`` (tensor -> count) extends "known" to a member that committed fewer rows than a
    non-zero value of every tensor of the group needs (round 2, from the client's own study).
    ``workers`` (:mod:`secure_afl.core.workers`, default the caller's thread) mask a large tensor
    together in R2: the same words.
    """

    def __init__(
        self,
        client_id: str,
        identity_key: IdentityKey,
        roster: Roster,
        inputs: Mapping[str, Mapping[str, np.ndarray]],
        *,
        min_threshold: int | None = None,
        min_group_size: int | None = None,
        session_id: bytes | None = None,
        random: RandomSource | None = None,
        policy: ClientPolicy | None = None,
        ledger: Ledger | None = None,
        release: Release | None = None,
        context: bytes = binding.NO_CONTEXT,
        rows: Mapping[str, int] | None = None,
        row_floors: Mapping[str, int] | None = None,
        workers: Workers = ONE_THREAD,
    ) -> None:
        self._limits: dict[type, int] = {}
        self._context = binding.check_context(context)
        self._summed: tuple[dict[str, tuple[str, ...]], frozenset[str], frozenset[str]] | None = None
        self._workers = workers
        super().__init__(
            client_id, identity_key, roster, inputs, policy=policy, min_group_size=min_group_size,
            min_threshold=min_threshold, session_id=session_id, random=random, ledger=ledger,
            release=release, rows=rows, row_floors=row_floors,
        )  # fmt: skip

    # --- public API -------------------------------------------------------------------------------

    @property
    def incoming_message_limit(self) -> int:
        """The size limit for decoding the next server message this client expects.

        Each message type has its own bound (:func:`~secure_afl.protocol.codec.message_limits` over
        this client's own groups): the advertise request ``policy.max_config_bytes``; the share-keys
        request grows with the clients and groups, the masked-input, consistency and unmask requests
        with the clients only.  Tensors of groups this client is not in raise none of them.
        :meth:`receive_bytes` decodes under it.  After the session ends it is the largest of them.
        """
        if self._state is ClientState.AWAIT_ADVERTISE_REQUEST:
            return self._policy.max_config_bytes
        expected = CLIENT_TRANSITIONS.get(self._state)
        if expected is None:
            return max((self._limits[kind] for kind in _SERVER_MESSAGES if kind in self._limits), default=0)
        return self._limits[expected[0]]

    @property
    def summed_groups(self) -> tuple[dict[str, tuple[str, ...]], frozenset[str], frozenset[str]] | None:
        """Once R3 is signed: each group's members (from the advertisements, one view), the
        survivor set this client signed, whose inputs the group sums hold, and the clients whose
        advertisements the session relayed (its participants, some perhaps in no group); None
        before.  No secret: what every member knows of the sums the server learns (the
        classifier's audit states it)."""
        return self._summed

    @property
    def max_message_bytes(self) -> int:
        """The largest message this client sends or receives in this session (one bound for all types).

        Before the config is known, ``policy.max_config_bytes``; then the largest of the per-type
        bounds over this client's own groups (its masked input is usually the largest), so tensors
        of groups it is not in never raise it.  Prefer :meth:`receive_bytes`, which bounds each
        incoming message by its own type (:attr:`incoming_message_limit`).
        """
        if not self._limits:
            return self._policy.max_config_bytes
        return max(self._limits.values())

    def reply_limit(self, message: ClientMessage) -> int:
        """The size limit for encoding one of this client's replies (its own groups only)."""
        return self._limits[type(message)]

    def _decode(self, data: bytes) -> object:
        return codec.decode(data, max_message_bytes=self.incoming_message_limit)

    def _encoded(self, reply: ClientMessage) -> bytes:
        """The wire bytes of ``reply``: R2's masked input was framed as it was masked (its bytes are
        kept with it, the same as ``codec.encode`` gives); any other reply is encoded here."""
        framed, self._encoded_reply = self._encoded_reply, None
        if framed is not None and framed[0] is reply:
            return framed[1]
        return codec.encode(reply, max_message_bytes=self.reply_limit(reply))

    def _encode_message(self, message: object) -> bytes:
        return codec.encode(message)  # type: ignore[arg-type]

    def _handlers(self) -> Mapping[type, Callable[[Any], Handled]]:
        return {
            AdvertiseRequest: self._on_advertise_request,
            ShareKeysRequest: self._on_share_keys_request,
            MaskedInputRequest: self._on_masked_input_request,
            ConsistencyCheckRequest: self._on_consistency_request,
            UnmaskRequest: self._on_unmask_request,
        }

    def _handle(self, message: object, repeated: bool) -> Handled:
        reply, commit = self._handlers()[type(message)](message)  # each handler answers once
        return [reply], commit

    def _round_key(self, message: object) -> str:
        return _ROUND_OF[type(message)]

    def _before_handler(self) -> None:
        self._encoded_reply = None  # R2's framed bytes of a reply that was never sent

    # --- R0 ---------------------------------------------------------------------------------------

    def _on_advertise_request(self, request: AdvertiseRequest):
        config = request.config
        if self._expected_session_id is not None and config.session_id != self._expected_session_id:
            raise ReplayedMessageError("the advertise request belongs to another session")
        if len(config.groups) > self._policy.max_groups:
            raise InvalidSessionConfigError(
                f"the session config has {len(config.groups)} groups, more than this client's limit "
                f"{self._policy.max_groups}"
            )
        n_tensors = sum(len(group.tensors) for group in config.groups)
        if n_tensors > self._policy.max_layout_tensors:
            raise InvalidSessionConfigError(
                f"the session config has {n_tensors} tensors, more than this client's limit "
                f"{self._policy.max_layout_tensors}"
            )
        validate_config(config, len(self._roster))
        if config.threshold < self._min_threshold:
            raise InvalidSessionConfigError(
                f"threshold {config.threshold} is below this client's minimum {self._min_threshold}"
            )
        check_session_fits_inputs(config.groups, config.min_group_size, self._min_group_size, self._inputs)
        # One contribution per value: refuse before any key leaves this client.
        self._gate.start(config.session_id)
        limits = codec.message_limits(config, len(self._roster), groups=self._inputs)
        own_tensors = {name for tensors in self._inputs.values() for name in tensors}
        # The groups whose sums matter to this client's check: those carrying a tensor it sends, or
        # one of the same server-parameterised family (round 2's pseudo groups: exposure.py).
        relevant = exposure.linked_groups(
            own_tensors, {group.name: tuple(t.name for t in group.tensors) for group in config.groups}
        )
        encryption_key = crypto.new_x25519_key(self._random)
        mask_key = crypto.new_x25519_key(self._random)
        seed = self._random.token_bytes(SEED_BYTES)
        commitment = binding.self_mask_commitment(seed, config.session_id, self.client_id)
        digest = binding.config_digest(config, self._context)
        groups = tuple(sorted(self._inputs))
        rows = () if self._rows is None else tuple(self._rows[g] for g in groups)
        domain, fields = binding.advertise_fields(
            config.session_id,
            self.client_id,
            crypto.x25519_public_bytes(encryption_key),
            crypto.x25519_public_bytes(mask_key),
            commitment,
            digest,
            groups,
            rows,
        )
        advert = AdvertiseKeys(
            session_id=config.session_id,
            client_id=self.client_id,
            encryption_public_key=fields[2],
            mask_public_key=fields[3],
            self_mask_commitment=commitment,
            config_digest=digest,
            groups=groups,
            signature=crypto.sign(self._identity.private_key, domain, *fields),
            rows=rows,
        )

        def commit() -> None:
            self._config = config
            self._config_digest = digest
            self._limits = limits
            self._relevant = relevant
            self._encryption_key = encryption_key
            self._mask_key = mask_key
            self._seed = seed
            self._own_advert = advert

        return advert, commit

    # --- R1 ---------------------------------------------------------------------------------------

    def _on_share_keys_request(self, request: ShareKeysRequest):
        config = self._require_config()
        self._check_session(request.session_id)
        adverts: dict[str, AdvertiseKeys] = {}
        secrets: dict[str, _PeerSecrets] = {}
        group_names = {group.name for group in config.groups}
        for advert in request.advertisements:
            if advert.session_id != config.session_id:
                raise ReplayedMessageError(
                    f"advertisement of {advert.client_id!r} belongs to another session"
                )
            if advert.client_id not in self._roster:
                raise UnknownParticipantError(
                    f"the server relayed an advertisement from {advert.client_id!r}, who is not in the roster"
                )
            if advert.client_id in adverts:
                raise DuplicateParticipantError(
                    f"the server relayed two advertisements for {advert.client_id!r}"
                )
            if not binding.advertisement_signed_by(advert, self._roster.public_key(advert.client_id)):
                raise RelayedSignatureError(
                    f"the server relayed keys for {advert.client_id!r} that its roster identity key did not "
                    f"sign (an honest server verifies every advertisement before relaying it)"
                )
            if advert.config_digest != self._config_digest:
                raise DifferentSessionViewError(
                    f"{advert.client_id!r} signed another session than this client's (its config, study, "
                    f"round or round 2's teacher differ): the server shows clients different sessions"
                )
            if advert.client_id != self.client_id:
                # Agree both keys now, once: the encryption key's secret serves the shares sent
                # here and received in R2, the mask key's the pairwise masks of R2.  A low-order
                # key gives an all-zero secret (cryptography refuses it): the server's fault.
                try:
                    secrets[advert.client_id] = _PeerSecrets(
                        crypto.x25519_shared_secret(self._encryption_key, advert.encryption_public_key),
                        crypto.x25519_shared_secret(self._mask_key, advert.mask_public_key),
                    )
                except InvalidShareError:
                    raise ServerProtocolError(
                        f"the server relayed a low-order X25519 key of {advert.client_id!r} (an honest "
                        f"server refuses it)"
                    ) from None
            if len(set(advert.groups)) != len(advert.groups) or not set(advert.groups) <= group_names:
                raise ServerProtocolError(
                    f"the server relayed an advertisement of {advert.client_id!r} with unknown or repeated "
                    f"groups (an honest server refuses it)"
                )
            if advert.rows and len(advert.rows) != len(advert.groups):
                raise ServerProtocolError(
                    f"the server relayed an advertisement of {advert.client_id!r} whose committed counts "
                    f"do not match its groups (an honest server refuses it)"
                )
            adverts[advert.client_id] = advert
        if adverts.get(self.client_id) != self._own_advert:
            raise ServerProtocolError("the server omitted or altered this client's own advertisement")
        if len(adverts) < config.threshold:
            raise SurvivorsBelowThresholdError(
                f"{len(adverts)} clients advertised keys, fewer than the threshold {config.threshold}"
            )
        members = {
            group.name: tuple(sorted(cid for cid, advert in adverts.items() if group.name in advert.groups))
            for group in config.groups
        }
        self._check_group_sizes(members, set(adverts), own_groups_only=True)
        if self._policy.refuse_exposure:
            # Refuse a layout that isolates a client even if everyone survives, before any share exists.
            self._exposure_gate("R1", "share keys (R1)", members, set(adverts), adverts=adverts)
        # The group sizes are known now: refuse inputs that would overflow before sharing anything,
        # so an overflow never strands this client after its shares are out (R2 checks again).
        # One array in several groups (a shared Gram) is read once, each group tests its own bound.
        magnitudes: dict[int, float] = {}
        for group in sorted(self._inputs):
            for name in sorted(self._inputs[group]):
                values = self._inputs[group][name]
                if id(values) not in magnitudes:
                    magnitudes[id(values)] = encoding.magnitude(values)
                encoding.check_encodable(
                    values,
                    tensor=f"{group}/{name}",
                    frac_bits=config.frac_bits,
                    group_size=len(members[group]),
                    max_abs=magnitudes[id(values)],
                )

        holders = sorted(adverts)
        points = [self._roster.share_point(cid) for cid in holders]
        seed_shares = shamir.split(int.from_bytes(self._seed, "big"), config.threshold, points, self._random)
        key_shares = shamir.split(
            int.from_bytes(crypto.x25519_private_bytes(self._mask_key), "big"),
            config.threshold,
            points,
            self._random,
        )
        encrypted: list[EncryptedShare] = []
        own_shares: _HeldShares | None = None
        for holder, seed_share, key_share in zip(holders, seed_shares, key_shares, strict=True):
            if holder == self.client_id:
                own_shares = _HeldShares(seed_share.y, key_share.y)
                continue
            key = crypto.share_encryption_key(
                secrets[holder].encryption, config.session_id, self.client_id, holder
            )
            nonce = self._random.token_bytes(crypto.NONCE_BYTES)
            plaintext = shamir.value_to_bytes(seed_share.y) + shamir.value_to_bytes(key_share.y)
            associated = crypto.share_associated_data(config.session_id, self.client_id, holder)
            encrypted.append(
                EncryptedShare(
                    self.client_id, holder, nonce, crypto.encrypt_share(key, nonce, plaintext, associated)
                )
            )
        assert own_shares is not None  # the own advertisement was checked above
        reply = ShareKeys(config.session_id, self.client_id, tuple(encrypted))

        adverts_digest = binding.advertisements_digest(config.session_id, adverts.values())

        def commit() -> None:
            self._adverts = adverts
            self._peer_secrets = secrets
            self._adverts_digest = adverts_digest
            self._members = members
            self._held = {self.client_id: own_shares}

        return reply, commit

    # --- R2 ---------------------------------------------------------------------------------------

    def _on_masked_input_request(self, request: MaskedInputRequest):
        config = self._require_config()
        self._check_session(request.session_id)
        senders: set[str] = set()
        for share in request.shares:
            if share.sender not in self._adverts or share.sender == self.client_id:
                raise UnknownParticipantError(
                    f"the server delivered shares from {share.sender!r}, who did not advertise keys"
                )
            if share.sender in senders:
                raise DuplicateParticipantError(
                    f"the server delivered two sets of shares from {share.sender!r}"
                )
            if share.recipient != self.client_id:
                raise ServerProtocolError(f"shares addressed to {share.recipient!r} were delivered here")
            senders.add(share.sender)
        live = senders | {self.client_id}
        if len(live) < config.threshold:
            raise SurvivorsBelowThresholdError(
                f"{len(live)} clients shared keys, fewer than the threshold {config.threshold}"
            )
        self._check_group_sizes(self._members, live, own_groups_only=True)
        held = dict(self._held)
        for share in request.shares:
            key = crypto.share_encryption_key(
                self._peer_secrets[share.sender].encryption, config.session_id, share.sender, self.client_id
            )
            associated = crypto.share_associated_data(config.session_id, share.sender, self.client_id)
            plaintext = crypto.decrypt_share(key, share.nonce, share.ciphertext, associated, share.sender)
            seed_value = shamir.value_from_bytes(plaintext[: shamir.VALUE_BYTES])
            key_value = shamir.value_from_bytes(plaintext[shamir.VALUE_BYTES :])
            if seed_value >= shamir.PRIME or key_value >= shamir.PRIME:
                raise InvalidShareError(f"shares from {share.sender!r} are not field elements")
            held[share.sender] = _HeldShares(seed_value, key_value)

        # HKDF's extract step once per secret (the own seed, each peer's shared secret), its expand
        # step per group and tensor: the same keys as prg.self_mask_key / prg.pair_mask_key.
        own_prk = prg.key_prk(self._seed)
        pair_prks: dict[str, bytes] = {}
        plan: list[tuple[str, str, np.ndarray, int, list[tuple[bytes, int]]]] = []
        # Each input's words are encoded where they are masked, in the message's frame
        # (prg.add_masks): no array of the words (at d = 4096 a fresh 64 MiB per Gram).  The
        # encoding checks them as it goes (finite, within the group's bound: encoding.encode_into),
        # each chunk while it is in cache; a refusal raises before the reply exists.
        for group in sorted(self._inputs):
            group_size = len(self._members[group])
            peers = [cid for cid in self._members[group] if cid in live and cid != self.client_id]
            for peer in peers:
                if peer not in pair_prks:
                    pair_prks[peer] = prg.key_prk(self._peer_secrets[peer].mask)
            for name in sorted(self._inputs[group]):
                base = self._inputs[group][name]
                own = prg.self_mask_key_from_prk(own_prk, config.session_id, group, name, self.client_id)
                keys = [(own, 1)] + [
                    (
                        prg.pair_mask_key_from_prk(
                            pair_prks[peer], config.session_id, group, name, self.client_id, peer
                        ),
                        prg.pair_sign(self.client_id, peer),
                    )
                    for peer in peers
                ]
                plan.append((group, name, base, group_size, keys))
        # The words are masked straight into the message's frame: no copy of them per group, no
        # bytes of each tensor, no join (the same bytes as codec.encode of the same message).
        frame = codec.MaskedInputFrame(
            config.session_id,
            self.client_id,
            [(group, name, base.shape[0]) for group, name, base, _, _ in plan],
            max_message_bytes=self._limits[MaskedInput],
        )
        for index, (group, name, base, group_size, keys) in enumerate(plan):
            prg.add_masks(
                frame.words(index),
                keys,
                values=base,
                frac_bits=config.frac_bits,
                group_size=group_size,
                tensor=f"{group}/{name}",
                workers=self._workers,
            )
        data, reply = frame.finish()
        self._encoded_reply = (reply, data)

        def commit() -> None:
            self._held = held
            self._share_senders = frozenset(live)
            # The values have gone out masked and no later round reads them (R3 and R4 need the
            # groups' names only): the session lets them go, so a driver that hands its inputs
            # over frees each client's Gram once it is sent (64 MiB a client at d = 4096).
            self._inputs = {group: {} for group in self._inputs}

        return reply, commit

    # --- R3 ---------------------------------------------------------------------------------------

    def _on_consistency_request(self, request: ConsistencyCheckRequest):
        config = self._require_config()
        self._check_session(request.session_id)
        survivors = self._survivor_set(request.survivors)
        domain, fields = self._transcript_fields(tuple(survivors))
        reply = ConsistencyResponse(
            config.session_id, self.client_id, crypto.sign(self._identity.private_key, domain, *fields)
        )
        # Last, once the reply is built: the check with colluders, and the release recorded.
        findings = self._exposure_gate(
            "R3", "sign the survivor set (R3)", self._members, set(survivors), release=True
        )

        def commit() -> None:
            self._survivors = frozenset(survivors)
            self._summed = (dict(self._members), self._survivors, frozenset(self._adverts))
            self._gate.findings.extend(findings)

        return reply, commit

    # --- R4 ---------------------------------------------------------------------------------------

    def _on_unmask_request(self, request: UnmaskRequest):
        config = self._require_config()
        self._check_session(request.session_id)
        survivors = self._survivors
        dropped = self._share_senders - survivors
        for name, ids in (
            ("self-mask", request.reveal_self_mask_of),
            ("mask-key", request.reveal_mask_key_of),
        ):
            if len(set(ids)) != len(ids):
                raise DuplicateParticipantError(f"the {name} reveal list repeats a client")
        wanted_seeds = set(request.reveal_self_mask_of)
        wanted_keys = set(request.reveal_mask_key_of)
        # The core active-server check: never release both secrets of one client.
        both = (wanted_seeds & wanted_keys) | (wanted_keys & survivors) | (wanted_seeds & dropped)
        if both:
            raise BothSharesRequestedError(
                f"the server asks for both the self-mask and the mask-key shares of {sorted(both)}"
            )
        if set(request.survivors) != survivors or len(request.survivors) != len(survivors):
            raise InconsistentSurvivorsError(
                "the unmask request's survivor set differs from the one signed in R3"
            )
        if wanted_seeds != survivors or wanted_keys != dropped:
            raise InconsistentSurvivorsError("the reveal lists do not match the signed survivor set")
        signers: set[str] = set()
        domain, fields = self._transcript_fields(tuple(sorted(survivors)))
        transcript = tagged_fields(domain, *fields)  # one encoding for every signature (n at n = 1,000)
        for item in request.signatures:
            if item.client_id in signers:
                raise DuplicateParticipantError(f"two consistency signatures from {item.client_id!r}")
            if item.client_id not in survivors:
                raise UnknownParticipantError(
                    f"consistency signature from {item.client_id!r}, not a survivor"
                )
            if not crypto.verify_message(self._roster.public_key(item.client_id), item.signature, transcript):
                raise InconsistentSurvivorsError(
                    f"{item.client_id!r} did not sign this survivor set and transcript: clients were shown "
                    f"different survivor sets, advertisements or configs"
                )
            signers.add(item.client_id)
        if len(signers) < config.threshold:
            raise SurvivorsBelowThresholdError(
                f"{len(signers)} consistency signatures, fewer than the threshold {config.threshold}"
            )
        self._check_group_sizes(self._members, survivors, own_groups_only=False)
        # Again before revealing (the same survivors: a cheap guard against a changed policy or layout).
        findings = self._exposure_gate("R4", "reveal shares (R4)", self._members, survivors)
        reply = UnmaskResponse(
            config.session_id,
            self.client_id,
            tuple(
                RevealedShare(cid, shamir.value_to_bytes(self._held[cid].self_mask))
                for cid in sorted(survivors)
            ),
            tuple(
                RevealedShare(cid, shamir.value_to_bytes(self._held[cid].mask_key)) for cid in sorted(dropped)
            ),
        )

        def commit() -> None:
            self._gate.findings.extend(findings)

        return reply, commit

    # --- helpers ----------------------------------------------------------------------------------

    def _transcript_fields(self, survivors: tuple[str, ...]) -> tuple[bytes, tuple]:
        config = self._require_config()
        return binding.survivors_fields(
            config.session_id, self._config_digest, self._adverts_digest, survivors
        )

    def _survivor_set(self, survivors: tuple[str, ...]) -> list[str]:
        config = self._require_config()
        if len(set(survivors)) != len(survivors):
            raise DuplicateParticipantError("the survivor set repeats a client")
        unknown = set(survivors) - self._share_senders
        if unknown:
            raise InconsistentSurvivorsError(
                f"survivors {sorted(unknown)} never shared keys with this client"
            )
        if self.client_id not in survivors:
            raise InconsistentSurvivorsError(
                "this client's own masked input is missing from the survivor set"
            )
        if len(survivors) < config.threshold:
            raise SurvivorsBelowThresholdError(
                f"{len(survivors)} survivors, fewer than the threshold {config.threshold}"
            )
        self._check_group_sizes(self._members, set(survivors), own_groups_only=False)
        return sorted(survivors)

    def _exposure_gate(
        self,
        round_name: str,
        action: str,
        members: Mapping[str, tuple[str, ...]],
        live: set[str] | frozenset[str],
        *,
        release: bool = False,
        adverts: Mapping[str, AdvertiseKeys] | None = None,
    ) -> tuple[exposure.ExposureFinding, ...]:
        """The exposure check over this session's sums, with the policy's colluders and the members'
        committed zeros (:class:`ExposureGate`); with ``release`` the release point (R3)."""
        groups = {
            name: (tuple(cid for cid in members.get(name, ()) if cid in live), tensors)
            for name, tensors in self._relevant.items()
        }
        config = self._require_config()
        return self._gate.check(
            round_name,
            action,
            groups,
            known_zero=zero_commitments(
                (self._adverts if adverts is None else adverts).values(),
                floors=self._row_floors,
                tensors={g.name: [t.name for t in g.tensors] for g in config.groups},
            ),
            session_id=config.session_id,
            # c = n - (this client's own floor for t), never n - (the session's t): a server that
            # raised t would otherwise shrink the colluders assumed (to none at t = n).
            colluders=self.colluders,
            release_survivors=tuple(sorted(live)) if release else None,
        )

    def _clear_session(self) -> None:
        # Drop every session secret; Python cannot zeroise memory, but nothing keeps a reference.
        self._config: SessionConfig | None = None
        self._config_digest = b""
        self._encryption_key: X25519PrivateKey | None = None  # type: ignore[assignment]
        self._mask_key: X25519PrivateKey | None = None  # type: ignore[assignment]
        self._seed = b""
        self._own_advert: AdvertiseKeys | None = None
        self._adverts: dict[str, AdvertiseKeys] = {}
        self._peer_secrets: dict[str, _PeerSecrets] = {}  # X25519 secrets with each peer, from R1
        self._adverts_digest = b""
        self._members: dict[str, tuple[str, ...]] = {}
        self._held: dict[str, _HeldShares] = {}
        self._share_senders: frozenset[str] = frozenset()
        self._survivors: frozenset[str] = frozenset()
        self._relevant: dict[str, tuple[str, ...]] = {}
        # R2's reply and its wire bytes, framed as it was masked (receive_bytes sends them).
        self._encoded_reply: tuple[MaskedInput, bytes] | None = None


ClientSession.States = ClientState
ClientSession.TRANSITIONS = CLIENT_TRANSITIONS
_ROUND_OF = {
    AdvertiseRequest: "R0",
    ShareKeysRequest: "R1",
    MaskedInputRequest: "R2",
    ConsistencyCheckRequest: "R3",
    UnmaskRequest: "R4",
}

_SERVER_MESSAGES = (
    AdvertiseRequest,
    ShareKeysRequest,
    MaskedInputRequest,
    ConsistencyCheckRequest,
    UnmaskRequest,
)
ClientSession.SERVER_MESSAGES = _SERVER_MESSAGES
