"""Identity keys, fingerprints, the roster and their files."""

from .files import (
    KeyFileError,
    KeyFileExistsError,
    KeyFilePermissionError,
    KeyFileTamperedError,
    WrongPassphraseError,
    load_identity_key,
    load_roster,
    save_identity_key,
    save_roster,
)
from .identity import IdentityKey, fingerprint
from .roster import Roster, RosterEntry, RosterError

__all__ = [
    "IdentityKey",
    "KeyFileError",
    "KeyFileExistsError",
    "KeyFilePermissionError",
    "KeyFileTamperedError",
    "Roster",
    "RosterEntry",
    "RosterError",
    "WrongPassphraseError",
    "fingerprint",
    "load_identity_key",
    "load_roster",
    "save_identity_key",
    "save_roster",
]
