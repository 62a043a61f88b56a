"""The one client-session driver both backends share: ``(state, message) -> (handler, next state)``.

Each backend (pairwise masking in :mod:`secure_afl.protocol.client`, CKKS in
:mod:`secure_afl.protocol.ckks.client`) supplies its messages, its transition table and one handler
per server message; everything else about driving a session is decided here, once:

- **Check, then commit.**  A handler returns ``(replies, commit)`` and changes nothing itself;
  ``commit`` runs and the state moves only once every check passed and the replies are complete.
- **FAILED and DONE.**  A server's bad message (any :class:`ProtocolError` that is not local)
  leaves the client FAILED with its session secrets dropped; local misuse
  (:class:`LocalProtocolError`) changes nothing.  A session that is over refuses every message.
  Reaching DONE drops the session secrets too.
- **One answer per round.**  The digest of the message answered is recorded through the exposure
  gate (durably, with a file ledger) before the reply leaves; a different message for that round
  is refused there.
- **The colluder bound.**  ``c = n - t`` with ``t`` this client's own threshold floor for the
  roster (never the session's ``t``, which the server proposes): :attr:`SessionDriver.colluders`.
- **What a client holds.**  Its inputs are checked (finite float64, 1-D) and copied once; one
  array given to several groups stays one copy.
"""

from __future__ import annotations

import enum
import unicodedata
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from secure_afl.core import encoding
from secure_afl.core.errors import (
    GroupBelowMinimumError,
    InvalidSessionConfigError,
    LocalProtocolError,
    MessageDecodeError,
    OutOfOrderMessageError,
    ProtocolError,
    ReplayedMessageError,
)
from secure_afl.core.randomness import RandomSource, default_random
from secure_afl.keys.identity import IdentityKey
from secure_afl.keys.roster import Roster
from secure_afl.privacy import exposure
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.privacy.release import Release

from . import codec
from .exposure_gate import ExposureGate, committed_rows, message_digest
from .messages import GroupSpec

if TYPE_CHECKING:
    from secure_afl.privacy.ledger import Ledger

# Characters refused in group and tensor names: control (Cc), format (Cf: bidi overrides,
# zero-width characters), surrogates (Cs) and line/paragraph separators (Zl, Zp).
_FORBIDDEN_NAME_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def check_name(kind: str, name: object) -> None:
    """Refuse a group or tensor name that is empty, over-long or holds control characters."""
    if not isinstance(name, str):
        raise InvalidSessionConfigError(f"{kind} name must be a string, got {type(name).__name__}")
    if not name:
        raise InvalidSessionConfigError(f"{kind} names must not be empty")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidSessionConfigError(f"{kind} name {name!r} is not valid Unicode text") from None
    if size > codec.MAX_STRING_BYTES:
        raise InvalidSessionConfigError(
            f"{kind} name {name[:32]!r}... is {size} UTF-8 bytes, more than {codec.MAX_STRING_BYTES}"
        )
    if name.isprintable():  # C-speed fast path: no Cc, Cf, Cs, Zl, Zp character (nor Co, Cn, Zs but space)
        return
    bad = sorted({f"U+{ord(c):04X}" for c in name if unicodedata.category(c) in _FORBIDDEN_NAME_CATEGORIES})
    if bad:
        raise InvalidSessionConfigError(
            f"{kind} name {name!r} contains control or invisible formatting characters ({', '.join(bad)})"
        )


def check_group_sizes(
    members: Mapping[str, tuple[str, ...]],
    live: set[str] | frozenset[str],
    min_group_size: int,
    *,
    only: Collection[str] | None = None,
) -> None:
    """Refuse to go on when a group (of ``only``, if given) would be summed with 1..min-1 live members."""
    for group, group_members in members.items():
        if only is not None and group not in only:
            continue
        count = sum(1 for cid in group_members if cid in live)
        if 0 < count < min_group_size:
            raise GroupBelowMinimumError(
                f"group {group!r} would have {count} live member(s), below the minimum {min_group_size}"
            )


def check_session_fits_inputs(
    groups: Collection[GroupSpec],
    min_group_size: int,
    own_min_group_size: int,
    inputs: Mapping[str, Mapping[str, np.ndarray]],
) -> None:
    """R0, every backend: the session's minimum group size is not below this client's, and every
    group this client holds inputs for is in the session's layout with the same tensor lengths."""
    if min_group_size < own_min_group_size:
        raise InvalidSessionConfigError(
            f"minimum group size {min_group_size} is below this client's minimum {own_min_group_size}"
        )
    layouts = {group.name: {tensor.name: tensor.length for tensor in group.tensors} for group in groups}
    for group, tensors in inputs.items():
        if group not in layouts:
            raise LocalProtocolError(
                f"group {group!r} of this client's inputs is not in the session layout: "
                "check that this client and the server run the same study"
            )
        actual = {name: values.shape[0] for name, values in tensors.items()}
        if layouts[group] != actual:
            raise LocalProtocolError(
                f"group {group!r}: inputs {actual} do not match the session layout {layouts[group]}"
            )


# A handler's result: the replies to send and the commit that applies the state it built.
Handled = tuple[list[Any], Callable[[], None]]


def copied_inputs(inputs: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, dict[str, np.ndarray]]:
    """The client's own copy of its inputs: each checked once, one array given to several groups
    (a driver's shared Gram) one copy (the caller's later writes cannot reach it; the release and
    exposure digests then read it once too).  An input no one can write to is kept as it is (no
    copy: at d = 4096 a Gram's triangle is 64 MiB per client)."""
    copied: dict[str, dict[str, np.ndarray]] = {}
    copies: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # id -> (the input, kept alive; its copy)
    for group, tensors in inputs.items():
        if not tensors:
            raise LocalProtocolError(f"group {group!r} has no tensors")
        copied[group] = {}
        for name, values in tensors.items():
            entry = copies.get(id(values))
            if entry is None or entry[0] is not values:
                checked = encoding.check_float_tensor(values, tensor=f"{group}/{name}")
                entry = (values, checked if encoding.immutable(checked) else checked.copy())
                copies[id(values)] = entry
            copied[group][name] = entry[1]
    return copied


class SessionDriver:
    """One client's side of one session, for any backend (see the module docstring).

    A backend's session class sets the class attributes below and implements :meth:`_handlers`,
    :meth:`_round_key` and :meth:`_clear_session` (which must also reset ``_config``).
    """

    States: ClassVar[type[enum.Enum]]  # the backend's state enum: AWAIT_ADVERTISE_REQUEST, ..., FAILED, DONE
    TRANSITIONS: ClassVar[Mapping[Any, tuple[type, Any]]]  # state -> (expected message, next state)
    REPEATS: ClassVar[Mapping[Any, tuple[type, Any]]] = {}  # state -> a message it may take again
    SERVER_MESSAGES: ClassVar[Sequence[type]]
    _config: Any  # the session's config once R0 accepted it (reset by _clear_session)

    def __init__(
        self,
        client_id: str,
        identity_key: IdentityKey,
        roster: Roster,
        inputs: Mapping[str, Mapping[str, np.ndarray]],
        *,
        policy: ClientPolicy | None,
        min_group_size: int | None,
        min_threshold: int | None,
        session_id: bytes | None,
        random: RandomSource | None,
        ledger: Ledger | None,
        release: Release | None,
        rows: Mapping[str, int] | None,
        row_floors: Mapping[str, int] | None,
    ) -> None:
        if client_id not in roster:
            raise LocalProtocolError(f"client {client_id!r} is not in the roster")
        if roster.public_key(client_id) != identity_key.public_key:
            raise LocalProtocolError(f"the identity key does not match the roster's key for {client_id!r}")
        policy = ClientPolicy.deployment() if policy is None else policy
        if not isinstance(policy, ClientPolicy):
            raise LocalProtocolError(f"policy must be a ClientPolicy, got {type(policy).__name__}")
        min_group_size = policy.min_group_size if min_group_size is None else min_group_size
        if min_group_size < 1:
            raise LocalProtocolError("min_group_size must be at least 1")
        self._inputs = copied_inputs(inputs)
        self.client_id = client_id
        self._identity = identity_key
        self._roster = roster
        self._policy = policy
        self._min_threshold = policy.min_threshold(len(roster)) if min_threshold is None else min_threshold
        self._min_group_size = min_group_size
        self._expected_session_id = session_id
        self._random = default_random(random)
        self._gate = ExposureGate(client_id, identity_key, self._inputs, policy, ledger, release)
        self._asked_release: Release | None = None  # made on request where the gate made none
        self._rows = committed_rows(rows, self._inputs)
        # tensor -> the committed count below which a member's value is known (its own study's
        # rule: round 2's too-small members send zeros); the server has no say in it.
        self._row_floors = dict(row_floors or {})
        self._state: Any = self.States["AWAIT_ADVERTISE_REQUEST"]
        self._clear_session()

    # --- public API -------------------------------------------------------------------------------

    @property
    def state(self) -> Any:
        return self._state

    @property
    def groups(self) -> tuple[str, ...]:
        return tuple(sorted(self._inputs))

    @property
    def policy(self) -> ClientPolicy:
        return self._policy

    @property
    def release(self) -> Release:
        """What this client releases in the session (the one-contribution rule's unit).  Under a
        policy without that rule none is made when the session starts; it is made here from the
        inputs while the session still holds them."""
        if self._gate.release is not None:
            return self._gate.release
        if self._asked_release is None:
            if any(not tensors for tensors in self._inputs.values()):
                raise LocalProtocolError(
                    "this session made no release (its policy has no one-contribution rule) and has "
                    "let its inputs go since: read the release before R2, or use a policy with the rule"
                )
            self._asked_release = Release.of(self._inputs)
        return self._asked_release

    @property
    def exposure_findings(self) -> tuple[exposure.ExposureFinding, ...]:
        """What the exposure checks found and this client went on past (simulator policy), in order.

        Under a policy that refuses exposure the findings are in the raised error instead (and
        recorded here too).  Kept after the session ends, for the audit.
        """
        return tuple(self._gate.findings)

    @property
    def colluders(self) -> int:
        """The colluding peers every exposure check assumes: ``c = n - t`` at this client's own
        threshold floor (a server-raised ``t`` would otherwise shrink it, to none at ``t = n``)."""
        return self._policy.colluders(len(self._roster), self._min_threshold)

    @property
    def is_over(self) -> bool:
        return self._state in (self.States["FAILED"], self.States["DONE"])

    def receive_bytes(self, data: bytes) -> list[bytes]:
        """Decode ``data`` under this client's limit for the message it expects, handle it, and
        return the encoded replies.

        Bytes that do not decode (too large for the expected message, malformed), or a client's
        message sent back, are the server's doing like any other bad message: the client fails and
        drops its secrets.
        """
        if self.is_over:
            raise LocalProtocolError(f"the session is over (state {self._state.name}); start a new one")
        try:
            message = self._decode(data)
        except MessageDecodeError:
            self._fail()
            raise
        if type(message) not in self.SERVER_MESSAGES:
            self._fail()
            raise OutOfOrderMessageError(f"the server sent a client message ({type(message).__name__})")
        replies = self._receive(message, message_digest(data))
        return [self._encoded(reply) for reply in replies]

    def receive(self, message: object) -> list[Any]:
        """Handle one server message and return the replies to send to the server (maybe none)."""
        if type(message) not in self.SERVER_MESSAGES:
            raise LocalProtocolError(f"not a server message: {type(message).__name__}")
        try:
            data = self._encode_message(message)
        except ProtocolError:  # a message no codec would carry: the checks refuse it anyway
            data = repr(message).encode()
        return self._receive(message, message_digest(data))

    # --- the driver -------------------------------------------------------------------------------

    def _decode(self, data: bytes) -> object:
        """A server message from wire bytes, under this client's size limit for it."""
        raise NotImplementedError

    def _encoded(self, reply: Any) -> bytes:
        """The wire bytes of one of this client's replies."""
        raise NotImplementedError

    def _encode_message(self, message: object) -> bytes:
        """A server message's wire bytes (its digest is the one-answer record's)."""
        raise NotImplementedError

    def _handlers(self) -> Mapping[type, Callable[[Any], Handled]]:
        raise NotImplementedError

    def _round_key(self, message: object) -> str:
        """The one-answer record's key for ``message`` (one per round)."""
        raise NotImplementedError

    def _answer_digest(self, message: object, digest: str) -> str:
        """What the one-answer record keeps for ``message``: by default its digest."""
        return digest

    def _records_answer(self) -> bool:
        """Whether this message's answer is recorded (a backend replaying answered messages: no)."""
        return True

    def _before_handler(self) -> None:
        """Drop what a previous message left for its reply (a backend hook)."""

    def _clear_session(self) -> None:
        raise NotImplementedError

    def _receive(self, message: object, digest: str) -> list[Any]:
        if self.is_over:
            raise LocalProtocolError(f"the session is over (state {self._state.name}); start a new one")
        expected, next_state = self.TRANSITIONS[self._state]
        repeat = self.REPEATS.get(self._state)
        repeated = repeat is not None and type(message) is repeat[0]
        if repeated:
            assert repeat is not None
            expected, next_state = repeat
        handlers = self._handlers()
        if type(message) not in handlers:
            raise LocalProtocolError(f"not a server message: {type(message).__name__}")
        try:
            if type(message) is not expected:
                raise OutOfOrderMessageError(
                    f"{type(message).__name__} received while awaiting {expected.__name__}"
                )
            self._before_handler()
            replies, commit = self._handle(message, repeated)
            # One answer per round: recorded (durably, with a file ledger) before the reply leaves.
            if self._records_answer():
                self._gate.answer(
                    self._session_of(message), self._round_key(message), self._answer_digest(message, digest)
                )
        except LocalProtocolError:
            raise  # local misuse: nothing was sent, nothing changed
        except ProtocolError:
            self._fail()
            raise
        commit()
        self._state = next_state
        if next_state is self.States["DONE"]:
            self._clear_session()
        return replies

    def _handle(self, message: object, repeated: bool) -> Handled:
        return self._handlers()[type(message)](message)

    # --- shared checks ----------------------------------------------------------------------------

    @staticmethod
    def _session_of(message: object) -> bytes:
        """The session a server message belongs to (R0's request carries it in its config)."""
        session_id = getattr(message, "session_id", None)
        if session_id is None:
            session_id = message.config.session_id  # type: ignore[attr-defined]
        return session_id

    def _check_group_sizes(
        self,
        members: Mapping[str, tuple[str, ...]],
        live: set[str] | frozenset[str],
        *,
        own_groups_only: bool,
    ) -> None:
        own = self._inputs if own_groups_only else None
        check_group_sizes(members, live, self._require_config().min_group_size, only=own)

    def _check_session(self, session_id: bytes) -> None:
        if session_id != self._require_config().session_id:
            raise ReplayedMessageError("message from another session")

    def _require_config(self) -> Any:
        assert self._config is not None  # guaranteed by the transition table
        return self._config

    def _fail(self) -> None:
        self._state = self.States["FAILED"]
        self._clear_session()
