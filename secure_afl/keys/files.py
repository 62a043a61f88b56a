"""Key and roster files.

Private keys are PKCS#8 PEM encrypted with the passphrase (``BestAvailableEncryption``) and written
with mode 0600 (created with that mode, never widened).  Rosters are JSON.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from .identity import IdentityKey
from .roster import Roster


class KeyFileError(Exception):
    """A key file that cannot be read."""


class WrongPassphraseError(KeyFileError):
    """The passphrase does not decrypt the private key file."""


def save_identity_key(path: str | os.PathLike[str], key: IdentityKey, passphrase: bytes) -> None:
    """Write ``key`` encrypted under ``passphrase``; the file is created with mode 0600."""
    if not passphrase:
        raise ValueError("a non-empty passphrase is required to store a private key")
    pem = key.private_key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(passphrase),
    )
    _write_private(Path(path), pem)


def load_identity_key(path: str | os.PathLike[str], passphrase: bytes) -> IdentityKey:
    data = Path(path).read_bytes()
    try:
        private_key = serialization.load_pem_private_key(data, password=passphrase)
    except TypeError as exc:  # the file is not encrypted, or no passphrase was given
        raise KeyFileError(f"{path}: {exc}") from exc
    except ValueError as exc:
        raise WrongPassphraseError(
            f"{path}: cannot decrypt the private key: wrong passphrase or corrupted file"
        ) from exc
    if not isinstance(private_key, Ed25519PrivateKey):
        raise KeyFileError(f"{path}: not an Ed25519 identity key")
    return IdentityKey(private_key)


def save_roster(path: str | os.PathLike[str], roster: Roster) -> None:
    Path(path).write_text(roster.to_json() + "\n", encoding="utf-8")


def load_roster(path: str | os.PathLike[str]) -> Roster:
    return Roster.from_json(Path(path).read_text(encoding="utf-8"))


def _write_private(path: Path, data: bytes) -> None:
    # O_EXCL|0600: the key is never readable by others, not even between open and chmod.
    if path.exists():
        path.unlink()
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)
    os.chmod(path, 0o600)  # in case the umask removed bits we asked for (it cannot add any)
