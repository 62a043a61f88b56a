"""An institution's key directory and roster files: where they live and how they are read and written.

``DIR/identity.key`` (the encrypted key file of :mod:`secure_afl.keys.files`, mode 0600),
``DIR/identity.pub.json`` (its roster entry: id, name, public key, fingerprint), the passphrase (a
private file or an environment variable, never a command line) and roster files (written
atomically).  Every failure is a :class:`KeyStoreError` whose message names the file and what to
do; the commands (:mod:`secure_afl.cli_keys`) and the deployment show it as it is.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import secrets
import stat
from pathlib import Path

from .roster import Roster, RosterEntry, RosterError

__all__ = [
    "KEY_FILE",
    "PUBLIC_FILE",
    "PUBLIC_FORMAT",
    "KeyStoreError",
    "check_local_key_in",
    "check_new_passphrase",
    "decode_public_key",
    "default_key_dir",
    "load_public_entry",
    "load_roster_file",
    "read_entry_file",
    "read_passphrase",
    "read_passphrase_env",
    "read_passphrase_file",
    "write_roster_file",
    "write_roster_file_text",
]


class KeyStoreError(ValueError):
    """A key directory, passphrase, roster entry or roster file that cannot be used (the message
    names it and what to do)."""

    @property
    def message(self) -> str:  # as click.ClickException names it, for callers that show either
        return str(self)


KEY_FILE = "identity.key"
PUBLIC_FILE = "identity.pub.json"
PUBLIC_FORMAT = "secure-afl-roster-entry/v1"
MAX_PASSPHRASE_BYTES = 4096
# A new key's passphrase is what stands between a stolen key file and the institution's identity;
# scrypt slows each guess, it cannot make a short passphrase long.
MIN_PASSPHRASE_CHARS = 12


def default_key_dir() -> Path:
    """``$SECURE_AFL_HOME`` or ``~/.secure-afl``."""
    return Path(os.environ.get("SECURE_AFL_HOME") or Path.home() / ".secure-afl")


def read_passphrase_file(path: Path) -> bytes:
    """The passphrase: the file's first line (its line break removed); the file must be private."""
    try:
        info = path.stat()
    except OSError as exc:
        raise KeyStoreError(f"{path}: cannot read the passphrase file: {exc.strerror}") from None
    if os.name == "posix" and info.st_mode & 0o077:
        raise KeyStoreError(
            f"{path}: permissions {stat.S_IMODE(info.st_mode):04o} are too open for a passphrase file "
            f"(chmod 600 {path})"
        )
    data = path.read_bytes()[: MAX_PASSPHRASE_BYTES + 1]
    line = data.split(b"\n", 1)[0].rstrip(b"\r")
    if not line:
        raise KeyStoreError(f"{path}: the passphrase file is empty")
    if len(line) > MAX_PASSPHRASE_BYTES:
        raise KeyStoreError(f"{path}: the passphrase is longer than {MAX_PASSPHRASE_BYTES} bytes")
    return line


def read_passphrase_env(variable: str) -> bytes:
    """The passphrase from the environment variable ``variable`` (a SuperNode started by a service
    manager, or ``read -s`` in a shell: never on a command line, where ``ps`` shows it)."""
    value = os.environ.get(variable)
    if value is None:
        raise KeyStoreError(
            f"the environment variable {variable} is not set: export it (e.g. `read -rs {variable} && "
            f"export {variable}`) or use a passphrase file"
        )
    if not value:
        raise KeyStoreError(f"the environment variable {variable} is empty")
    data = value.encode("utf-8")
    if len(data) > MAX_PASSPHRASE_BYTES:
        raise KeyStoreError(f"{variable}: the passphrase is longer than {MAX_PASSPHRASE_BYTES} bytes")
    return data


def read_passphrase(passphrase_file: Path | None = None, passphrase_env: str | None = None) -> bytes:
    """The passphrase from exactly one of a private file and an environment variable."""
    if (passphrase_file is None) == (passphrase_env is None):
        raise KeyStoreError("give exactly one of a passphrase file and a passphrase variable")
    if passphrase_file is not None:
        return read_passphrase_file(passphrase_file)
    return read_passphrase_env(passphrase_env)  # type: ignore[arg-type]


def check_new_passphrase(passphrase: bytes) -> bytes:
    """Refuse a passphrase too short to protect a new key (fewer than MIN_PASSPHRASE_CHARS)."""
    length = len(passphrase.decode("utf-8", errors="replace"))
    if length < MIN_PASSPHRASE_CHARS:
        raise KeyStoreError(
            f"the passphrase has {length} character(s); a new key needs at least {MIN_PASSPHRASE_CHARS}: "
            "use a few random words (e.g. 'correct horse battery staple')"
        )
    return passphrase


def load_public_entry(directory: Path) -> RosterEntry:
    """The institution's own roster entry, ``DIR/identity.pub.json``."""
    return read_entry_file(directory / PUBLIC_FILE)


def read_entry_file(path: Path) -> RosterEntry:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise KeyStoreError(f"{path}: cannot read the roster entry: {exc.strerror}") from None
    except ValueError:
        raise KeyStoreError(f"{path}: not a {PUBLIC_FORMAT} file (not JSON)") from None
    if not isinstance(document, dict) or document.get("format") != PUBLIC_FORMAT:
        raise KeyStoreError(f"{path}: not a {PUBLIC_FORMAT} file")
    try:
        entry = RosterEntry(
            document["id"], document.get("name", document["id"]), decode_public_key(document["public_key"])
        )
    except (KeyError, TypeError, RosterError) as exc:
        raise KeyStoreError(f"{path}: malformed roster entry: {exc}") from None
    if document.get("fingerprint", entry.fingerprint) != entry.fingerprint:
        raise KeyStoreError(f"{path}: the fingerprint does not match the public key")
    return entry


def decode_public_key(text: object) -> bytes:
    if not isinstance(text, str):
        raise RosterError("the public key must be a base64 string")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RosterError("the public key is not base64") from None


def load_roster_file(path: Path) -> Roster:
    try:
        return Roster.from_json(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise KeyStoreError(f"{path}: cannot read the roster: {exc.strerror}") from None
    except RosterError as exc:
        raise KeyStoreError(f"{path}: {exc}") from None


def write_roster_file(path: Path, roster: Roster) -> None:
    """Atomically: a temporary file beside it, then a rename (never a half-written roster).

    The roster's co-signatures are not kept: a changed roster must be co-signed again."""
    write_roster_file_text(path, roster.to_json())


def write_roster_file_text(path: Path, text: str) -> None:
    temporary = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    try:
        temporary.write_text(text + "\n", encoding="utf-8")
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()


def check_local_key_in(roster: Roster, entry: RosterEntry, roster_path: Path) -> None:
    """Refuse a roster that lacks this institution's key (or lists its id with another key)."""
    if entry.client_id not in roster:
        raise KeyStoreError(
            f"{roster_path}: the roster lacks this institution ({entry.client_id!r}, {entry.fingerprint}); "
            f"ask the coordinator to add {PUBLIC_FILE} with `secure-afl keys roster add`"
        )
    if roster.public_key(entry.client_id) != entry.public_key:
        raise KeyStoreError(
            f"{roster_path}: the roster lists {entry.client_id!r} with the key "
            f"{roster.entry(entry.client_id).fingerprint}, but this institution's key is {entry.fingerprint}"
        )
