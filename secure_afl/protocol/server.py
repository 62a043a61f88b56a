"""The server's state machine (sans-I/O).

``start()`` returns the advertise request; ``receive(message)`` accepts one client message of the
current round (a rejected message raises and changes nothing: that client is treated as dropped);
``next_round()`` closes the round and returns the messages to send, keyed by recipient;
``result()`` returns the unmasked uint64 sums per group and tensor once the session is DONE;
``take_result()`` hands them over instead (the server keeps none).
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from operator import itemgetter
from types import MappingProxyType
from typing import TypeVar

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from secure_afl.core.errors import (
    ClientProtocolError,
    DuplicateClientError,
    GroupTooSmallError,
    InsufficientParticipantsError,
    InvalidSessionConfigError,
    InvalidShareError,
    InvalidSignatureError,
    LocalProtocolError,
    OutOfOrderMessageError,
    ReplayedMessageError,
    UnknownClientError,
)
from secure_afl.core.workers import ONE_THREAD, Workers
from secure_afl.keys.roster import Roster

from . import binding, codec, crypto, prg, shamir
from .client import validate_config
from .fields import tagged_fields
from .messages import (
    AdvertiseKeys,
    AdvertiseRequest,
    ConsistencyCheckRequest,
    ConsistencyResponse,
    EncryptedShares,
    MaskedInput,
    MaskedInputRequest,
    RevealedShares,
    SessionConfig,
    ShareKeys,
    ShareKeysRequest,
    SurvivorSignature,
    UnmaskRequest,
    UnmaskResponse,
)
from .state import SERVER_ACCEPTS, SERVER_NEXT_ROUND, ServerRound

ServerReply = ShareKeysRequest | MaskedInputRequest | ConsistencyCheckRequest | UnmaskRequest

# R2's inputs held (as views of their messages) before they are added to the sums, a batch at a
# time: 64 MiB, about 2 clients' inputs at d = 1024 with 7 Gram copies each.  Batching saves passes
# over the sums; a larger batch holds more messages (at d = 4096 one Gram triangle is 64 MiB, so a
# client's message is added as soon as it is received).
ADD_BATCH_BYTES = 1 << 26

C = TypeVar("C", EncryptedShares, RevealedShares)


def _columns(kind: type[C], shares: object, sender: str) -> C:
    """``shares`` as ``kind``'s columns: decoded, they are already; a tuple of items handed over
    in process is converted, and one that cannot be is the sender's protocol error."""
    if type(shares) is kind:
        return shares  # type: ignore[return-value]
    try:
        return kind.of(shares)  # type: ignore[attr-defined]
    except (TypeError, ValueError) as exc:
        raise ClientProtocolError(f"{sender!r} sent malformed shares: {exc}") from exc


@dataclass(frozen=True, slots=True)
class GroupSum:
    """What the server learns about one group: its members, its survivors and its tensors' sums."""

    name: str
    members: tuple[str, ...]
    survivors: tuple[str, ...]
    sums: Mapping[str, np.ndarray]  # tensor name -> read-only uint64 sum over the survivors


@dataclass(frozen=True, slots=True)
class AggregationResult:
    session_id: bytes
    groups: Mapping[str, GroupSum]
    survivors: tuple[str, ...]  # U3: the clients whose masked inputs are in the sums


class ServerSession:
    """The server's side of one session over ``config``'s groups, for the clients of ``roster``."""

    def __init__(
        self,
        roster: Roster,
        config: SessionConfig,
        *,
        context: bytes = binding.NO_CONTEXT,
        may_be_empty: Collection[str] = (),
        workers: Workers = ONE_THREAD,
    ) -> None:
        """``may_be_empty``: groups this server may finish with no live member (their sums are
        then zero and reveal nothing), where a group with fewer live members than the minimum
        aborts the session.  Only a group whose sum serves to be subtracted may be one (a
        difference plan's complement, :meth:`Layout.complement_groups`): an empty *method* group
        would leave a class without statistics, so it still aborts."""
        try:
            validate_config(config, len(roster))
        except InvalidSessionConfigError as exc:
            raise LocalProtocolError(str(exc)) from exc
        unknown = sorted(set(may_be_empty) - {group.name for group in config.groups})
        if unknown:
            raise LocalProtocolError(f"may_be_empty names groups the session does not have: {unknown}")
        self._may_be_empty = frozenset(may_be_empty)
        self._workers = workers  # who adds a large sum's inputs and removes its masks (prg.word_runs)
        self._roster = roster
        self._config = config
        self._digest = binding.config_digest(config, context)  # the session context its clients bind
        self._message_limit = codec.max_message_bytes(config, len(roster))
        self._round = ServerRound.NOT_STARTED
        self._adverts: dict[str, AdvertiseKeys] = {}
        # per R1 sender: its shares' payloads by recipient (R2's requests take one from each
        # sender); let go once R1 closes, so that the n² shares live only as long as the requests
        # that carry them
        self._shares_to: dict[str, dict[str, bytes]] = {}
        self._masked_senders: set[str] = set()
        self._sums: dict[tuple[str, str], np.ndarray] = {}
        # R2's accepted inputs not yet added: (group, tensor) -> views of the received words.  They
        # are added a batch at a time, a cache-sized slice of each sum against every input of the
        # batch, so that each sum crosses memory once per batch instead of once per input (at
        # n = 1,000 and d = 1024 the sums are larger than the caches).
        self._pending: dict[tuple[str, str], list[np.ndarray]] = {}
        self._pending_bytes = 0
        self._signatures: dict[str, bytes] = {}
        # per R4 responder: its revealed self-mask and mask-key share values, in the order revealed
        # (U3's, then the dropped clients', as _receive_unmask checked); not the n² share objects
        self._unmask: dict[str, tuple[list[int], list[int]]] = {}
        self._members: dict[str, tuple[str, ...]] = {}
        self._adverts_digest = b""
        self._u2: tuple[str, ...] = ()
        self._u3: tuple[str, ...] = ()
        self._survivors_transcript = b""
        self._u4: tuple[str, ...] = ()
        self._dropped: tuple[str, ...] = ()  # U2 - U3, sorted: whose mask keys R4 reveals
        self._result: AggregationResult | None = None
        self._handed_over = False  # take_result() gave the sums away

    @property
    def round(self) -> ServerRound:
        return self._round

    @property
    def config(self) -> SessionConfig:
        return self._config

    @property
    def max_message_bytes(self) -> int:
        """The size limit for this session's messages: the largest an honest party can send."""
        return self._message_limit

    def start(self) -> AdvertiseRequest:
        if self._round is not ServerRound.NOT_STARTED:
            raise LocalProtocolError("the session has already started")
        self._round = ServerRound.ADVERTISE
        return AdvertiseRequest(self._config)

    def receive(self, message: object) -> None:
        """Accept one client message of the current round, or raise and change nothing."""
        expected = SERVER_ACCEPTS.get(self._round)
        if expected is None:
            raise LocalProtocolError(f"the server accepts no client messages in round {self._round.name}")
        if type(message) is not expected:
            raise OutOfOrderMessageError(f"{type(message).__name__} received in round {self._round.name}")
        assert isinstance(
            message, AdvertiseKeys | ShareKeys | MaskedInput | ConsistencyResponse | UnmaskResponse
        )
        if message.session_id != self._config.session_id:
            raise ReplayedMessageError("message from another session")
        if isinstance(message, AdvertiseKeys):
            self._receive_advert(message)
        elif isinstance(message, ShareKeys):
            self._receive_shares(message)
        elif isinstance(message, MaskedInput):
            self._receive_masked_input(message)
        elif isinstance(message, ConsistencyResponse):
            self._receive_consistency(message)
        else:
            self._receive_unmask(message)

    def next_round(self) -> dict[str, ServerReply]:
        """Close the current round; return the messages to send, keyed by recipient."""
        if self._round not in SERVER_ACCEPTS:
            raise LocalProtocolError(f"no round to close in {self._round.name}")
        if self._round is ServerRound.ADVERTISE:
            replies = self._close_advertise()
        elif self._round is ServerRound.SHARE_KEYS:
            replies = self._close_share_keys()
        elif self._round is ServerRound.MASKED_INPUT:
            replies = self._close_masked_input()
        elif self._round is ServerRound.CONSISTENCY:
            replies = self._close_consistency()
        else:
            self._close_unmask()
            replies = {}
        self._round = SERVER_NEXT_ROUND[self._round]
        return replies

    def result(self) -> AggregationResult:
        if self._handed_over:
            raise LocalProtocolError("the result was handed over (take_result); the server keeps no sums")
        if self._result is None:
            raise LocalProtocolError(f"no result before the session is DONE (round {self._round.name})")
        return self._result

    def take_result(self) -> AggregationResult:
        """The result, handed over once: its sums become the caller's own (writeable, and this
        session keeps no reference to them), so that the caller can decode each in place and let
        it go as soon as it is used (at d = 4096 a group's Gram sum is 64 MiB).  Afterwards
        :meth:`result` and this method raise :class:`LocalProtocolError`."""
        result = self.result()
        self._result = None
        self._sums = {}
        self._handed_over = True
        for group in result.groups.values():
            for words in group.sums.values():
                words.setflags(write=True)  # the accumulator owns its memory: nothing else shares it
        return result

    # --- receiving --------------------------------------------------------------------------------

    def _check_sender(self, sender: str, allowed: tuple[str, ...] | dict, seen: object) -> None:
        if sender not in self._roster:
            raise UnknownClientError(f"{sender!r} is not in the roster")
        if sender not in allowed:
            raise UnknownClientError(f"{sender!r} is not a participant of this round")
        if sender in seen:  # type: ignore[operator]
            raise DuplicateClientError(f"a second message from {sender!r} in this round")

    def _receive_advert(self, advert: AdvertiseKeys) -> None:
        self._check_sender(advert.client_id, self._roster.client_ids, self._adverts)
        if not binding.advertisement_signed_by(advert, self._roster.public_key(advert.client_id)):
            raise InvalidSignatureError(
                f"the keys of {advert.client_id!r} are not signed by its identity key"
            )
        if advert.config_digest != self._digest:
            raise ClientProtocolError(f"{advert.client_id!r} signed a different session config")
        if not (
            crypto.valid_x25519_public_key(advert.encryption_public_key)
            and crypto.valid_x25519_public_key(advert.mask_public_key)
        ):
            raise ClientProtocolError(f"{advert.client_id!r} advertised a low-order X25519 public key")
        names = {group.name for group in self._config.groups}
        if len(set(advert.groups)) != len(advert.groups) or not set(advert.groups) <= names:
            raise ClientProtocolError(f"{advert.client_id!r} declared unknown or repeated groups")
        self._adverts[advert.client_id] = advert

    def _receive_shares(self, message: ShareKeys) -> None:
        self._check_sender(message.sender, self._adverts, self._shares_to)
        shares = _columns(EncryptedShares, message.shares, message.sender)
        # A column at a time (n² shares at n = 1,000); the same checks as share by share.
        senders = shares.senders
        if senders.count(message.sender) != len(senders):
            raise ClientProtocolError(f"{message.sender!r} sent shares under another sender's name")
        expected = set(self._adverts) - {message.sender}
        # recipient -> nonce || ciphertext: a dict of strings and bytes, which the cyclic collector
        # does not track, relayed to the recipient in R2 as it came
        by_recipient = dict(zip(shares.recipients, shares.payloads, strict=True))
        if len(by_recipient) != len(senders) or by_recipient.keys() != expected:
            raise ClientProtocolError(
                f"{message.sender!r} did not send exactly one share to every other client"
            )
        self._shares_to[message.sender] = by_recipient

    def _receive_masked_input(self, message: MaskedInput) -> None:
        self._check_sender(message.sender, self._u2, self._masked_senders)
        declared = self._adverts[message.sender].groups
        expected = {
            (group, tensor.name): tensor.length
            for group in declared
            for tensor in self._config.group(group).tensors
        }
        received = {(item.group, item.tensor): len(item.data) for item in message.tensors}
        if len(received) != len(message.tensors) or set(received) != set(expected):
            raise ClientProtocolError(f"{message.sender!r} sent tensors other than those of its groups")
        for key, length in expected.items():
            if received[key] != 8 * length:
                raise ClientProtocolError(f"{message.sender!r}: tensor {key} has the wrong length")
        # Every check passed: only now queue the words for the sums.  They are read in place: a
        # decoded tensor's data is a view of the received message (codec), not a copy.
        for item in message.tensors:
            words = np.frombuffer(item.data, dtype="<u8")
            if words.flags.writeable:  # a buffer its sender may still change (not the codec's bytes)
                words = words.copy()
            self._pending.setdefault((item.group, item.tensor), []).append(words)
            self._pending_bytes += words.nbytes
        self._masked_senders.add(message.sender)
        if self._pending_bytes >= ADD_BATCH_BYTES:
            self._add_pending()

    def _add_pending(self) -> None:
        """Add every queued input to its sum: per sum, one cache-sized slice at a time against all
        the queued inputs (the same sums mod 2⁶⁴, in any order); a large sum split among the
        workers as :func:`prg.add_masks <secure_afl.protocol.prg.add_masks>` splits a mask."""
        for key, inputs in self._pending.items():
            total = self._sums[key]
            runs = prg.word_runs(total.shape[0], self._workers)
            if len(runs) == 1:
                _add_inputs(total, inputs, 0, total.shape[0])
            else:
                self._workers.run([functools.partial(_add_inputs, total, inputs, lo, hi) for lo, hi in runs])
        self._pending = {}
        self._pending_bytes = 0

    def _receive_consistency(self, message: ConsistencyResponse) -> None:
        self._check_sender(message.sender, self._u3, self._signatures)
        if not crypto.verify_message(
            self._roster.public_key(message.sender), message.signature, self._survivors_transcript
        ):
            raise InvalidSignatureError(
                f"{message.sender!r} did not sign the survivor set over this session's transcript"
            )
        self._signatures[message.sender] = message.signature

    def _receive_unmask(self, message: UnmaskResponse) -> None:
        self._check_sender(message.sender, self._u4, self._unmask)
        seeds = _columns(RevealedShares, message.self_mask_shares, message.sender)
        keys = _columns(RevealedShares, message.mask_key_shares, message.sender)
        if seeds.owners != self._u3:
            raise ClientProtocolError(
                f"{message.sender!r} did not reveal exactly the survivors' self-mask shares"
            )
        if keys.owners != self._dropped:
            raise ClientProtocolError(
                f"{message.sender!r} did not reveal exactly the dropped clients' key shares"
            )
        values = (shamir.values_from_bytes(seeds.values), shamir.values_from_bytes(keys.values))
        if max((max(part, default=0) for part in values), default=0) >= shamir.PRIME:
            raise InvalidShareError(f"{message.sender!r} revealed a share that is not a field element")
        self._unmask[message.sender] = values  # read once here; R4's recovery uses them

    # --- closing rounds ---------------------------------------------------------------------------

    def _require(self, count: int, what: str) -> None:
        if count < self._config.threshold:
            raise InsufficientParticipantsError(
                f"only {count} clients {what}, fewer than the threshold t={self._config.threshold}"
            )

    def _check_groups(self, members: Mapping[str, tuple[str, ...]], live: set[str], stage: str) -> None:
        for group, ids in members.items():
            count = sum(1 for cid in ids if cid in live)
            if count == 0 and group in self._may_be_empty:
                continue  # nothing to unmask: its sum is zero, and the server learns nothing from it
            if count < self._config.min_group_size:
                raise GroupTooSmallError(
                    f"group {group!r} has {count} live member(s) {stage}, below the minimum group size "
                    f"{self._config.min_group_size}; it is never unmasked"
                )

    def _close_advertise(self) -> dict[str, ServerReply]:
        self._require(len(self._adverts), "advertised keys")
        members = {
            group.name: tuple(
                sorted(cid for cid, advert in self._adverts.items() if group.name in advert.groups)
            )
            for group in self._config.groups
        }
        self._check_groups(members, set(self._adverts), "after R0")
        self._members = members
        adverts = tuple(self._adverts[cid] for cid in sorted(self._adverts))
        self._adverts_digest = binding.advertisements_digest(self._config.session_id, adverts)
        request = ShareKeysRequest(self._config.session_id, adverts)
        return {cid: request for cid in sorted(self._adverts)}

    def _close_share_keys(self) -> dict[str, ServerReply]:
        u2 = tuple(sorted(self._shares_to))
        self._require(len(u2), "shared keys")
        self._check_groups(self._members, set(u2), "after R1")
        # Each recipient's shares in the senders' order: one from each other sender's index by
        # recipient (every sender of U2 sent exactly one share to every other client of U1).
        indexes = [self._shares_to[sender] for sender in u2]
        replies: dict[str, ServerReply] = {}
        for position, recipient in enumerate(u2):
            senders = u2[:position] + u2[position + 1 :]
            replies[recipient] = MaskedInputRequest(
                self._config.session_id,
                EncryptedShares(
                    senders,
                    (recipient,) * len(senders),
                    tuple(map(itemgetter(recipient), indexes[:position] + indexes[position + 1 :])),
                ),
            )
        self._sums = {
            (group.name, tensor.name): np.zeros(tensor.length, dtype=np.uint64)
            for group in self._config.groups
            for tensor in group.tensors
        }
        self._u2 = u2
        self._shares_to = {}  # the requests carry the shares from here on
        return replies

    def _close_masked_input(self) -> dict[str, ServerReply]:
        self._add_pending()  # before anything can fail: every accepted input is in its sum
        u3 = tuple(sorted(self._masked_senders))
        self._require(len(u3), "sent masked inputs")
        self._check_groups(self._members, set(u3), "after R2")
        self._u3 = u3
        # What every R3 signature signs, encoded once (not once per signature: n² at n = 1,000).
        domain, fields = binding.survivors_fields(
            self._config.session_id, self._digest, self._adverts_digest, u3
        )
        self._survivors_transcript = tagged_fields(domain, *fields)
        request = ConsistencyCheckRequest(self._config.session_id, u3)
        return {cid: request for cid in u3}

    def _close_consistency(self) -> dict[str, ServerReply]:
        u4 = tuple(sorted(self._signatures))
        self._require(len(u4), "signed the survivor set")
        dropped = tuple(sorted(set(self._u2) - set(self._u3)))
        request = UnmaskRequest(
            session_id=self._config.session_id,
            survivors=self._u3,
            signatures=tuple(SurvivorSignature(cid, self._signatures[cid]) for cid in u4),
            reveal_self_mask_of=self._u3,
            reveal_mask_key_of=dropped,
        )
        self._u4 = u4
        self._dropped = dropped
        return {cid: request for cid in u4}

    def _close_unmask(self) -> None:
        responders = sorted(self._unmask)
        self._require(len(responders), "revealed shares")
        chosen = responders[: self._config.threshold]
        session_id = self._config.session_id
        # Every owner's shares come from the same revealers: one Lagrange basis for all of them.
        basis = shamir.lagrange_coefficients([self._roster.share_point(cid) for cid in chosen])
        seeds: dict[str, bytes] = {}
        for owner, value in zip(self._u3, self._recover(basis, chosen, self_mask=True), strict=True):
            seed = value.to_bytes(32, "big") if value < 2**256 else b""
            if (
                binding.self_mask_commitment(seed, session_id, owner)
                != self._adverts[owner].self_mask_commitment
            ):
                raise InvalidShareError(
                    f"the self-mask shares of {owner!r} do not reconstruct its committed seed"
                )
            seeds[owner] = seed
        dropped_keys: dict[str, X25519PrivateKey] = {}
        dropped = self._dropped
        for owner, value in zip(dropped, self._recover(basis, chosen, self_mask=False), strict=True):
            if value >= 2**256:
                raise InvalidShareError(f"the mask-key shares of {owner!r} do not reconstruct a key")
            key = X25519PrivateKey.from_private_bytes(value.to_bytes(32, "big"))
            if crypto.x25519_public_bytes(key) != self._adverts[owner].mask_public_key:
                raise InvalidShareError(f"the mask-key shares of {owner!r} do not match its advertised key")
            dropped_keys[owner] = key

        survivors = set(self._u3)
        # Every check passed: the masked sums are unmasked in place (no copy; R2 is closed, nothing
        # else reads or adds to them) and become the result.  HKDF's extract step runs once per
        # seed and per shared secret, its expand step per tensor (the same keys, see prg.key_prk).
        sums = self._sums
        seed_prks = {owner: prg.key_prk(seed) for owner, seed in seeds.items()}
        pair_prks: dict[tuple[str, str], bytes] = {}
        for group in self._config.groups:
            members = self._members[group.name]
            live = [cid for cid in members if cid in survivors]
            gone = [cid for cid in members if cid in dropped_keys]
            for d in gone:
                for v in live:
                    if (d, v) not in pair_prks:
                        pair_prks[(d, v)] = prg.key_prk(
                            crypto.x25519_shared_secret(dropped_keys[d], self._adverts[v].mask_public_key)
                        )
            pairs = [(d, v) for d in gone for v in live]
            for tensor in group.tensors:
                accumulator = sums[(group.name, tensor.name)]
                prg.add_masks(
                    accumulator,
                    (
                        (prg.self_mask_key_from_prk(seed_prks[v], session_id, group.name, tensor.name, v), -1)
                        for v in live
                    ),
                    workers=self._workers,
                )
                # A survivor v added pair_sign(v, d) * PRG(s_vd) for each member d that dropped after R1.
                prg.add_masks(
                    accumulator,
                    (
                        (
                            prg.pair_mask_key_from_prk(
                                pair_prks[(d, v)], session_id, group.name, tensor.name, v, d
                            ),
                            -prg.pair_sign(v, d),
                        )
                        for d, v in pairs
                    ),
                    workers=self._workers,
                )
                accumulator.setflags(write=False)
        self._result = AggregationResult(
            session_id=session_id,
            groups=MappingProxyType(
                {
                    group.name: GroupSum(
                        name=group.name,
                        members=self._members[group.name],
                        survivors=tuple(cid for cid in self._members[group.name] if cid in survivors),
                        sums=MappingProxyType({t.name: sums[(group.name, t.name)] for t in group.tensors}),
                    )
                    for group in self._config.groups
                }
            ),
            survivors=self._u3,
        )

    def _recover(self, basis: tuple[int, ...], revealers: list[str], *, self_mask: bool) -> list[int]:
        """Every owner's secret (the survivors' seeds, or the dropped clients' mask keys, in their
        revealed order) from the shares ``revealers`` revealed, with their Lagrange ``basis``.
        Each revealer's values are in that order: _receive_unmask accepted only responses naming
        exactly these owners in this order."""
        part = 0 if self_mask else 1
        rows = [self._unmask[revealer][part] for revealer in revealers]
        # Column k: every revealer's share of owner k.
        return [shamir.combine(basis, column) for column in zip(*rows, strict=True)]


def _add_inputs(total: np.ndarray, inputs: list[np.ndarray], lo: int, hi: int) -> None:
    """``total[lo:hi] += sum(inputs[lo:hi])`` mod 2⁶⁴, a cache-sized slice at a time."""
    for start in range(lo, hi, prg.CHUNK_WORDS):
        end = min(start + prg.CHUNK_WORDS, hi)
        part = total[start:end]
        for words in inputs:
            np.add(part, words[start:end], out=part)
