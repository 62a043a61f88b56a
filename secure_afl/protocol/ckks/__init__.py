"""Sans-I/O CKKS aggregation (TenSEAL) over named groups, beside the masking backend.

Drivers feed messages to :class:`CkksClientSession` and :class:`CkksServerSession` and carry the
replies, encoded with :mod:`secure_afl.protocol.ckks.codec`; the round structure is in
:mod:`~secure_afl.protocol.ckks.state`, what every signature binds in
:mod:`~secure_afl.protocol.ckks.binding`, and every TenSEAL call in :mod:`~secure_afl.protocol.ckks.context`.
"""

from . import binding, codec, context, errors, messages, state
from .client import CkksClientSession
from .context import CkksParameters
from .errors import (
    ExposingDecryptionError,
    InvalidCiphertextError,
    InvalidContextError,
    InvalidParametersError,
    InvalidSumCiphertextError,
    KeyHolderDroppedError,
    NoDecryptorError,
    RepeatedDecryptionError,
)
from .messages import CkksSessionConfig
from .server import CkksAggregationResult, CkksGroupSum, CkksServerSession
from .state import CkksClientState, CkksServerRound

__all__ = [
    "CkksAggregationResult",
    "CkksClientSession",
    "CkksClientState",
    "CkksGroupSum",
    "CkksParameters",
    "CkksServerRound",
    "CkksServerSession",
    "CkksSessionConfig",
    "ExposingDecryptionError",
    "InvalidCiphertextError",
    "InvalidContextError",
    "InvalidParametersError",
    "InvalidSumCiphertextError",
    "KeyHolderDroppedError",
    "NoDecryptorError",
    "RepeatedDecryptionError",
    "binding",
    "codec",
    "context",
    "errors",
    "messages",
    "state",
]
