"""Sans-I/O CKKS aggregation (TenSEAL) over named groups, beside the masking backend.

Drivers feed messages to :class:`CkksClientSession` and :class:`CkksServerSession` and carry the
replies, encoded with :mod:`secure_afl.protocol.ckks.codec`; the round structure is in
:mod:`~secure_afl.protocol.ckks.state`, what every signature binds in
:mod:`~secure_afl.protocol.ckks.binding`, and every TenSEAL call in :mod:`~secure_afl.protocol.ckks.context`.
"""

import importlib
from typing import TYPE_CHECKING

# Loaded on first use (PEP 562): importing the package, or its TenSEAL-free ``errors``, must not load
# TenSEAL, so that a masking run (which only catches these errors) never pays for it.
_SUBMODULES = ("binding", "client", "codec", "context", "errors", "messages", "server", "state")
_EXPORTS = {
    "CkksAggregationResult": "server",
    "CkksClientSession": "client",
    "CkksClientState": "state",
    "CkksGroupSum": "server",
    "CkksParameters": "context",
    "CkksServerRound": "state",
    "CkksServerSession": "server",
    "CkksSessionConfig": "messages",
    "ConflictingDecryptionError": "errors",
    "ExposingDecryptionError": "errors",
    "IncompleteDecryptionError": "errors",
    "InvalidChunkSetError": "errors",
    "InvalidCiphertextError": "errors",
    "InvalidContextError": "errors",
    "InvalidParametersError": "errors",
    "InvalidSumCiphertextError": "errors",
    "KeyHolderDroppedError": "errors",
    "NoDecryptorError": "errors",
    "RepeatedDecryptionError": "errors",
    "UnsignedViewError": "errors",
    "ViewQuorumError": "errors",
}

if TYPE_CHECKING:
    from . import binding, codec, context, errors, messages, state
    from .client import CkksClientSession
    from .context import CkksParameters
    from .errors import (
        ConflictingDecryptionError,
        ExposingDecryptionError,
        IncompleteDecryptionError,
        InvalidChunkSetError,
        InvalidCiphertextError,
        InvalidContextError,
        InvalidParametersError,
        InvalidSumCiphertextError,
        KeyHolderDroppedError,
        NoDecryptorError,
        RepeatedDecryptionError,
        UnsignedViewError,
        ViewQuorumError,
    )
    from .messages import CkksSessionConfig
    from .server import CkksAggregationResult, CkksGroupSum, CkksServerSession
    from .state import CkksClientState, CkksServerRound


def __getattr__(name: str) -> object:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CkksAggregationResult",
    "CkksClientSession",
    "CkksClientState",
    "CkksGroupSum",
    "CkksParameters",
    "CkksServerRound",
    "CkksServerSession",
    "CkksSessionConfig",
    "ConflictingDecryptionError",
    "ExposingDecryptionError",
    "IncompleteDecryptionError",
    "InvalidChunkSetError",
    "InvalidCiphertextError",
    "InvalidContextError",
    "InvalidParametersError",
    "InvalidSumCiphertextError",
    "KeyHolderDroppedError",
    "NoDecryptorError",
    "RepeatedDecryptionError",
    "UnsignedViewError",
    "ViewQuorumError",
    "binding",
    "codec",
    "context",
    "errors",
    "messages",
    "state",
]
