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
    ``ServerProtocolError``     the server misbehaved (seen by a client).
    ``ClientProtocolError``     a client misbehaved (seen by the server or by a peer client).
  ``SessionAbortedError``       nobody broke the protocol, but too few parties remain to continue
                                safely (dropouts).  No secret is released.

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


class BothSharesRequestedError(ServerProtocolError):
    """The server asked for both the self-mask share and the mask-key share of one client."""


class SurvivorsBelowThresholdError(ServerProtocolError):
    """The server announced fewer clients than the threshold t for a round."""


class InconsistentSurvivorsError(ServerProtocolError):
    """Clients were shown different survivor sets (the R3 signatures do not match)."""


class GroupBelowMinimumError(ServerProtocolError):
    """The server tried to unmask a group with fewer survivors than the minimum group size."""


class ClientProtocolError(RemoteProtocolError):
    """A client misbehaved (seen by the server or by a peer client)."""


class InvalidSignatureError(ClientProtocolError):
    """A signature does not verify under the roster's identity key of its claimed signer."""


class UnknownClientError(ClientProtocolError):
    """A client id that is not in the roster (or not in this round)."""


class DuplicateClientError(ClientProtocolError):
    """One client id appears twice where it must appear once."""


class InvalidShareError(ClientProtocolError):
    """An encrypted share fails authentication, or shares reconstruct to a value that does not match."""


# --- dropouts -------------------------------------------------------------------------------------


class SessionAbortedError(ProtocolError):
    """Too few parties remain to continue safely; no secret was released."""


class InsufficientParticipantsError(SessionAbortedError):
    """Fewer clients than the threshold t answered in a round."""


class GroupTooSmallError(SessionAbortedError):
    """A group's live members are fewer than the minimum group size; it is never unmasked."""
