"""Sans-I/O secure aggregation by pairwise masking (Bonawitz et al. 2017) over named groups.

No sockets, files, clocks, threads or global random state: drivers feed messages to
:class:`ClientSession` and :class:`ServerSession` and carry the replies, encoded with
:mod:`secure_afl.protocol.codec`.
"""

from . import codec, encoding, errors, messages, prg, shamir
from .client import ClientSession
from .encoding import decode, encode, pack_symmetric, rounding_error_bound, unpack_symmetric
from .errors import (
    BothSharesRequestedError,
    ClientProtocolError,
    DuplicateClientError,
    EncodingOverflowError,
    GroupBelowMinimumError,
    GroupTooSmallError,
    InconsistentSurvivorsError,
    InsufficientParticipantsError,
    InvalidSessionConfigError,
    InvalidShareError,
    InvalidSignatureError,
    LocalProtocolError,
    MessageDecodeError,
    NonFiniteValueError,
    OutOfOrderMessageError,
    ProtocolError,
    RemoteProtocolError,
    ReplayedMessageError,
    ServerProtocolError,
    SessionAbortedError,
    SurvivorsBelowThresholdError,
    UnknownClientError,
)
from .messages import GroupSpec, SessionConfig, TensorSpec
from .randomness import DeterministicRandomSource, OsRandomSource, RandomSource
from .server import AggregationResult, GroupSum, ServerSession
from .state import ClientState, ServerRound

__all__ = [
    "AggregationResult",
    "BothSharesRequestedError",
    "ClientProtocolError",
    "ClientSession",
    "ClientState",
    "DeterministicRandomSource",
    "DuplicateClientError",
    "EncodingOverflowError",
    "GroupBelowMinimumError",
    "GroupSpec",
    "GroupSum",
    "GroupTooSmallError",
    "InconsistentSurvivorsError",
    "InsufficientParticipantsError",
    "InvalidSessionConfigError",
    "InvalidShareError",
    "InvalidSignatureError",
    "LocalProtocolError",
    "MessageDecodeError",
    "NonFiniteValueError",
    "OsRandomSource",
    "OutOfOrderMessageError",
    "ProtocolError",
    "RandomSource",
    "RemoteProtocolError",
    "ReplayedMessageError",
    "ServerProtocolError",
    "ServerRound",
    "ServerSession",
    "SessionAbortedError",
    "SessionConfig",
    "SurvivorsBelowThresholdError",
    "TensorSpec",
    "UnknownClientError",
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
