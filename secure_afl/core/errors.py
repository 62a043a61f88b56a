"""Protocol errors, split by who is at fault.

An auditor reading a failure should know at once whose behaviour caused it:

``ProtocolError``
  ``LocalProtocolError``        the local caller misused the API (wrong shapes, dtypes, call order,
                                values that cannot be encoded).  The state machine is left unchanged.
  ``RemoteProtocolError``       a remote party broke the protocol.  A client that raises one is left
                                in the FAILED state and never sends anything again.
    ``MessageDecodeError``      malformed bytes on the wire.
    ``ReplayedMessageError``    a message bound to another session.
    ``OutOfOrderMessageError``  a message that the current round does not accept.
    ``ServerProtocolError``     the server misbehaved (seen by a client).  Everything a client
                                receives comes from the server, and an honest server verifies each
                                client message before relaying it: a bad signature on a relayed
                                advertisement, an unknown or repeated id in a list the server built,
                                a layout or survivor set whose sums would isolate one client's
                                value, are the server's doing, whoever signed the payload.
    ``ClientProtocolError``     a client misbehaved (seen by the server).
    ``ShareAuthenticationError`` an encrypted share that fails authentication at its recipient:
                                its sender or the server relaying it (the server cannot check it).
  ``SessionAbortedError``       nobody broke the protocol, but too few parties remain to continue
                                safely (dropouts).  No secret is released.

``MessageDecodeError``, ``ReplayedMessageError`` and ``OutOfOrderMessageError`` name what was wrong;
who sent it is known to the receiver (at a client: the server; at the server: the client).

Every check that raises happens before any share or masked value leaves the client.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base class of every error raised by :mod:`secure_afl.protocol`."""


# --- local misuse ---------------------------------------------------------------------------------


class LocalProtocolError(ProtocolError):
    """The local caller misused the API; nothing was sent and the state is unchanged."""


class EncodingOverflowError(LocalProtocolError):
    """A value is too large to be encoded without the group's sum wrapping around 2^64."""

    def __init__(self, tensor: str, max_abs: float, bound: float, frac_bits: int, group_size: int) -> None:
        self.tensor = tensor
        self.max_abs = max_abs
        self.bound = bound
        self.frac_bits = frac_bits
        self.group_size = group_size
        super().__init__(
            f"tensor {tensor!r}: max |value| = {max_abs:.6g} exceeds the fixed-point bound {bound:.6g} "
            f"(= (2^63 - 1) / 2^{frac_bits} / group size {group_size}); the group's sum could wrap "
            f"around 2^64. Use fewer fractional bits or scale the features down; nothing is clipped."
        )


class NonFiniteValueError(LocalProtocolError):
    """A tensor holds NaN or infinity, which has no fixed-point encoding."""


# --- remote misbehaviour --------------------------------------------------------------------------


class RemoteProtocolError(ProtocolError):
    """A remote party (the server or another client) broke the protocol."""


class MessageDecodeError(RemoteProtocolError):
    """Bytes that are not a well-formed message of this protocol version."""


class ReplayedMessageError(RemoteProtocolError):
    """A message (or a signed field inside one) bound to a different session id."""


class OutOfOrderMessageError(RemoteProtocolError):
    """A message that is not accepted in the current round."""


class ServerProtocolError(RemoteProtocolError):
    """The server misbehaved."""


class InvalidSessionConfigError(ServerProtocolError):
    """The server proposed session parameters this client does not accept (e.g. a threshold too low)."""


class DifferentSessionViewError(InvalidSessionConfigError):
    """One view: a peer's advertisement signs another session digest than this client's own.

    The digest covers the session config (id, t, minimum group size, encoding, layout) and the
    session context (the whole study, its round, round 2's teacher classifier W): the server showed
    clients different sessions, so none of them goes on (SECURITY.md, "One view")."""


class BothSharesRequestedError(ServerProtocolError):
    """The server asked for both the self-mask share and the mask-key share of one client."""


class SurvivorsBelowThresholdError(ServerProtocolError):
    """The server announced fewer clients than the threshold t for a round."""


class InconsistentSurvivorsError(ServerProtocolError):
    """Clients were shown different survivor sets (the R3 signatures do not match)."""


class GroupBelowMinimumError(ServerProtocolError):
    """The server tried to unmask a group with fewer survivors than the minimum group size."""


class RelayedSignatureError(ServerProtocolError):
    """A signature on something the server relayed (an advertisement) does not verify.

    The honest server verifies every advertisement against the roster before relaying it, so a
    bad one reaching a client means the server forged, altered or failed to check it.
    """


class UnknownParticipantError(ServerProtocolError):
    """A list the server built names an id outside the roster or outside the round."""


class DuplicateParticipantError(ServerProtocolError):
    """A list the server built names one client twice."""


class ExposureRefusedError(ServerProtocolError):
    """The session's sums, over the survivors shown, would determine one client's individual value.

    Raised by a client whose policy refuses exposure (``ClientPolicy.deployment()``) before it
    signs U3 (R3) or reveals shares (R4), and before it shares keys (R1) when the layout alone
    already isolates a client.  ``findings`` lists what it saw; ``groups`` the groups involved.
    """

    def __init__(self, action: str, findings: tuple) -> None:
        self.findings = tuple(findings)
        self.groups = tuple(sorted({g for f in self.findings for g in f.groups}))
        lines = "; ".join(f.describe() for f in self.findings)
        super().__init__(
            f"refusing to {action}: {lines}. The server chose groups or survivors (or repeated a "
            f"session) whose sums isolate one client; nothing further is sent and no share is released"
        )


class HistoryExposureRefusedError(ExposureRefusedError):
    """Only together with earlier sessions over the same input (the ledger) do the sums isolate a client."""


class ColluderExposureRefusedError(ExposureRefusedError):
    """The sums isolate this client's value once the values of up to c = n - t colluding peers are
    known to the server (the active model's colluder bound); ``colluders`` names one such set."""

    def __init__(self, action: str, findings: tuple, colluders: tuple[str, ...]) -> None:
        self.colluders = tuple(colluders)
        super().__init__(action, findings)
        self.args = (
            f"{self.args[0]} (with the values of colluding peers {', '.join(self.colluders)} known to the "
            f"server; this client assumes up to n - t peers may collude)",
        )


class ExposureCheckLimitError(ExposureRefusedError):
    """The exposure check with colluders reached its work bound without showing that no c colluding
    peers isolate this client's value (:data:`secure_afl.privacy.exposure.COLLUDER_SEARCH_LIMIT`).

    Undecided is refused, never accepted: the layout may be safe, but this client cannot show it
    within bounded work.  Smaller federations, fewer distinct label patterns, a lower ``colluders``
    setting or the global-Gram layout (``gram="global"``) keep the check decidable (SECURITY.md).
    """

    def __init__(self, action: str, findings: tuple) -> None:
        super().__init__(action, findings)
        self.args = (
            f"{self.args[0]} (the check refuses what it cannot decide within its work bound: use fewer "
            "distinct label patterns, a lower colluders setting or the global-Gram layout)",
        )


class ValueAlreadyReleasedError(ServerProtocolError):
    """The one-contribution rule: the session asks for a value (or a part of one, or a statistic of
    the same source) that this client already released in another completed session.

    The method needs one aggregation per input, so a second one can only serve to subtract sums.
    Raised in R0, before any key is advertised, or at the release point (R3 masking, R2 CKKS) when
    another session released the value in between.  ``values`` names the tensors concerned and
    ``session_id`` the earlier session.
    """

    def __init__(self, values: tuple[str, ...], session_id: bytes, how: str = "already released") -> None:
        self.values = tuple(values)
        self.session_id = session_id
        super().__init__(
            f"refusing the session: {', '.join(self.values)} {how} in session {session_id.hex()[:16]}...; "
            f"each value this client holds is released in at most one completed session (SECURITY.md, "
            f"one contribution per value). A new study needs new data; an operator who knows the earlier "
            f"session never completed can archive the ledger with `secure-afl keys ledger reset`"
        )


class ImageAlreadyReleasedError(ValueAlreadyReleasedError):
    """One contribution per image: the session would release statistics over images (named by the
    SHA-256 of their files' bytes) that this client already released in another completed session,
    under any study, backbone, layout or protection (round 2 of the same study excepted).

    ``rows`` of the release's ``total`` rows are such images; ``session_id`` is the earlier session
    (the first found) and ``scope`` what it released them under (``study:<digest>/round:<r>``).
    Re-extracted, re-ordered or re-exported feature files of released images end here too: their
    bytes differ, their images do not.
    """

    def __init__(self, rows: int, total: int, session_id: bytes, scope: str = "") -> None:
        self.rows = rows
        self.total = total
        self.scope = scope
        self.values = (f"{rows} of {total} rows",)
        self.session_id = session_id
        under = f" ({scope.replace('/', ', ').replace(':', ' ')})" if scope else ""
        ServerProtocolError.__init__(
            self,
            f"refusing the session: {rows} of this client's {total} rows are images already released in "
            f"session {session_id.hex()[:16]}...{under}; each image enters at most one released aggregate "
            f"(SECURITY.md, one contribution per image), whatever the study, backbone, layout or "
            f"protection, and a re-extracted or re-exported feature file of released images releases "
            f"nothing new. To add images, run a study that extends the earlier one (it releases only "
            f"the new images: README, a federation that grows)",
        )


class IncrementTooSmallError(ServerProtocolError):
    """Committed counts: the session's values would come from fewer than c + 2 members with rows
    (the others committed 0 rows, a value the server knows), so c colluders and the known zeros
    would leave one member's statistics alone in a sum."""

    def __init__(self, action: str, contributors: list[str], colluders: int) -> None:
        self.contributors = tuple(contributors)
        self.colluders = colluders
        super().__init__(
            f"refusing to {action}: only {len(contributors)} member(s) {list(contributors)} release rows in "
            f"this session (the others committed 0 rows, a value the server knows), fewer than c + 2 = "
            f"{colluders + 2} with c = {colluders} colluders assumed; wait until more institutions have "
            f"new images (SECURITY.md, committed counts)"
        )


class ConflictingAnswerError(ServerProtocolError):
    """One answer per round: this client already answered a different message for this round of
    this session (a forked or replayed client state), or signed another survivor set for it."""


class LedgerFullError(ServerProtocolError):
    """Recording this session would take the ledger past its cap: this session is refused, the ledger
    is left as it was, and later sessions of ordinary size still go through."""


class ClientProtocolError(RemoteProtocolError):
    """A client misbehaved (seen by the server or by a peer client)."""


class InvalidSignatureError(ClientProtocolError):
    """A signature does not verify under the roster's identity key of its claimed signer."""


class UnknownClientError(ClientProtocolError):
    """A client id that is not in the roster (or not in this round)."""


class DuplicateClientError(ClientProtocolError):
    """One client id appears twice where it must appear once."""


class InvalidShareError(ClientProtocolError):
    """Revealed or decrypted shares that are not field elements, or that reconstruct to a value that
    does not match the owner's commitment or advertised key."""


class ShareAuthenticationError(RemoteProtocolError):
    """An encrypted share fails AEAD authentication at its recipient.

    Either its sender encrypted garbage or the server altered it in transit; the server cannot
    verify it (it has no key), so the recipient cannot tell which.
    """


# --- the client's ledger of earlier sessions --------------------------------------------------------


class LedgerError(LocalProtocolError):
    """The client's session ledger cannot be used; the client refuses to go on without it."""


class LedgerUnreadableError(LedgerError):
    """The ledger file cannot be read or parsed (I/O error, not JSON, wrong format, too large)."""


class LedgerTamperedError(LedgerError):
    """The ledger file's signature does not verify under this client's identity key."""


class LedgerMissingError(LedgerError):
    """The ledger was used before (its marker says so) but its file is gone or older than the last
    one written: a deleted or restored ledger would silently forget released values."""


# --- dropouts -------------------------------------------------------------------------------------


class SessionAbortedError(ProtocolError):
    """Too few parties remain to continue safely; no secret was released."""


class InsufficientParticipantsError(SessionAbortedError):
    """Fewer clients than the threshold t answered in a round."""


class GroupTooSmallError(SessionAbortedError):
    """A group's live members are fewer than the minimum group size; it is never unmasked."""
