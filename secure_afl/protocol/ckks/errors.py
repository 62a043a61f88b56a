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
    """The server asked a decryptor for a chunk of a group it already decrypted in this session, or
    named one chunk twice in a request.  Under the one view a chunk's sum is one value (another
    decryptor asked for it decrypts the same sum), so the server has no reason to ask again; under
    another view every chunk is refused before this check (the view this client signed, R3/R4)."""


class InvalidChunkSetError(ServerProtocolError):
    """A decryption request names no chunk of a group, chunk indices out of the group's range
    0..C_g-1, or indices not in increasing order."""


class IncompleteDecryptionError(SessionAbortedError):
    """The server's decrypted chunk sums leave a chunk of a group without a sum (or give one of the
    wrong length): the group's sum cannot be assembled."""


class ConflictingDecryptionError(ClientProtocolError):
    """Two decryptors returned different sums for one chunk of a group under the one view: one of
    them decrypted something else or lied, and the server cannot tell which."""


class KeyHolderDroppedError(SessionAbortedError):
    """The client chosen to generate the CKKS key sent no key: nothing was encrypted; start again."""


class NoDecryptorError(SessionAbortedError):
    """No surviving member of a group is left to decrypt its sum."""


class UnsignedViewError(ServerProtocolError):
    """A decryption request without at least t survivors' valid signatures over its one view (R3): the
    server could show other decryptors another survivor set, and the difference isolates a client."""


class ViewQuorumError(SessionAbortedError):
    """Fewer survivors signed the view (R3) than a majority of the roster: no decryptor would decrypt."""
