"""Errors of the CKKS backend, split by who is at fault like :mod:`secure_afl.core.errors`.

They subclass the masking backend's classes, so a driver that catches ``RemoteProtocolError`` or
``SessionAbortedError`` handles both backends alike.
"""

from __future__ import annotations

from secure_afl.core.errors import (
    ClientProtocolError,
    ExposureRefusedError,
    LocalProtocolError,
    ServerProtocolError,
    SessionAbortedError,
)


class InvalidParametersError(LocalProtocolError):
    """CKKS parameters this code does not accept (ring degree, moduli, scale)."""


class InvalidContextError(ClientProtocolError):
    """The key holder's TenSEAL context does not parse, has other parameters than the session, holds a
    secret key where only a public one may travel (to the server), or lacks one where it must (peers)."""


class InvalidCiphertextError(ClientProtocolError):
    """A client's ciphertext bytes do not parse, do not fit the session's parameters or its signature."""


class InvalidSumCiphertextError(ServerProtocolError):
    """The server asked for the decryption of bytes that are not a ciphertext of this session."""


class ExposingDecryptionError(ExposureRefusedError):
    """A decryption whose groups' survivor sets would isolate any client's value, refused by the decryptor."""


class RepeatedDecryptionError(ServerProtocolError):
    """The server asked a decryptor twice for one group's sum (a second ciphertext could be one input)."""


class KeyHolderDroppedError(SessionAbortedError):
    """The client chosen to generate the CKKS key sent no key: nothing was encrypted; start again."""


class NoDecryptorError(SessionAbortedError):
    """No surviving member of a group is left to decrypt its sum."""


class UnsignedViewError(ServerProtocolError):
    """A decryption request without at least t survivors' valid signatures over its one view (R3): the
    server could show other decryptors another survivor set, and the difference isolates a client."""


class ViewQuorumError(SessionAbortedError):
    """Fewer survivors signed the view (R3) than a majority of the roster: no decryptor would decrypt."""
