"""Sans-I/O secure aggregation by pairwise masking (Bonawitz et al. 2017) over named groups.

No sockets, files, clocks, threads or global random state: drivers feed messages to
:class:`ClientSession` and :class:`ServerSession` and carry the replies, encoded with
:mod:`secure_afl.protocol.codec`.
"""

from secure_afl.core import encoding, errors
from secure_afl.core.encoding import decode, encode, pack_symmetric, rounding_error_bound, unpack_symmetric
from secure_afl.core.errors import (
    BothSharesRequestedError,
    ClientProtocolError,
    DifferentSessionViewError,
    DuplicateClientError,
    DuplicateParticipantError,
    EncodingOverflowError,
    ExposureRefusedError,
    GroupBelowMinimumError,
    GroupTooSmallError,
    HistoryExposureRefusedError,
    InconsistentSurvivorsError,
    InsufficientParticipantsError,
    InvalidSessionConfigError,
    InvalidShareError,
    InvalidSignatureError,
    LedgerError,
    LedgerTamperedError,
    LedgerUnreadableError,
    LocalProtocolError,
    MessageDecodeError,
    NonFiniteValueError,
    OutOfOrderMessageError,
    ProtocolError,
    RelayedSignatureError,
    RemoteProtocolError,
    ReplayedMessageError,
    ServerProtocolError,
    SessionAbortedError,
    ShareAuthenticationError,
    SurvivorsBelowThresholdError,
    UnknownClientError,
    UnknownParticipantError,
)
from secure_afl.core.randomness import DeterministicRandomSource, OsRandomSource, RandomSource

from . import codec, messages, prg, shamir
from .client import ClientSession
from .messages import GroupSpec, SessionConfig, TensorSpec
from .server import AggregationResult, GroupSum, ServerSession
from .state import ClientState, ServerRound

__all__ = [
    "AggregationResult",
    "BothSharesRequestedError",
    "ClientProtocolError",
    "ClientSession",
    "ClientState",
    "DeterministicRandomSource",
    "DifferentSessionViewError",
    "DuplicateClientError",
    "DuplicateParticipantError",
    "EncodingOverflowError",
    "ExposureRefusedError",
    "GroupBelowMinimumError",
    "GroupSpec",
    "GroupSum",
    "GroupTooSmallError",
    "HistoryExposureRefusedError",
    "InconsistentSurvivorsError",
    "InsufficientParticipantsError",
    "InvalidSessionConfigError",
    "InvalidShareError",
    "InvalidSignatureError",
    "LedgerError",
    "LedgerTamperedError",
    "LedgerUnreadableError",
    "LocalProtocolError",
    "MessageDecodeError",
    "NonFiniteValueError",
    "OsRandomSource",
    "OutOfOrderMessageError",
    "ProtocolError",
    "RandomSource",
    "RelayedSignatureError",
    "RemoteProtocolError",
    "ReplayedMessageError",
    "ServerProtocolError",
    "ServerRound",
    "ServerSession",
    "SessionAbortedError",
    "SessionConfig",
    "ShareAuthenticationError",
    "SurvivorsBelowThresholdError",
    "TensorSpec",
    "UnknownClientError",
    "UnknownParticipantError",
    "codec",
    "decode",
    "encode",
    "encoding",
    "errors",
    "messages",
    "pack_symmetric",
    "prg",
    "rounding_error_bound",
    "shamir",
    "unpack_symmetric",
]
