"""Key and roster files.

An identity key file is a small versioned JSON document (``secure-afl-identity-key/v1``) built only
from ``cryptography`` primitives::

    {
      "format": "secure-afl-identity-key/v1",
      "kdf": {"name": "scrypt", "salt": b64(16 bytes), "n": 131072, "r": 8, "p": 1},
      "cipher": {"name": "aes-256-gcm", "nonce": b64(12 bytes)},
      "public_key": b64(raw Ed25519 public key, 32 bytes),
      "check": b64(32 bytes),
      "ciphertext": b64(AES-256-GCM of the raw 32-byte Ed25519 private key, 48 bytes)
    }

scrypt(passphrase, salt, n, r, p) gives 64 bytes: the first 32 are the AES-256-GCM key, the last 32
are stored as ``check`` so that a wrong passphrase (``check`` differs: :class:`WrongPassphraseError`)
is told apart from a modified file (``check`` matches but the ciphertext does not authenticate, or
the key does not match the public key: :class:`KeyFileTamperedError`).  The associated data of the
AEAD is a length-prefixed encoding of the format name, every KDF and cipher parameter and the public
key, so none of them can be altered without detection.  KDF parameters are bounded on load, so a
file cannot make the loader spend unbounded memory or time.

Writing never overwrites an existing key unless ``overwrite=True``; the file is written to a
temporary file in the same directory (created with ``O_EXCL`` and mode 0600), fsynced, then moved
into place atomically.  Loading refuses, like ssh, a private key file that its group or others can
read or write (:class:`KeyFilePermissionError`).  Rosters are JSON.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import os
import secrets
import stat
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from .identity import PUBLIC_KEY_BYTES, IdentityKey
from .roster import Roster

KEY_FILE_FORMAT = "secure-afl-identity-key/v1"
KDF_NAME = "scrypt"
CIPHER_NAME = "aes-256-gcm"
DEFAULT_SCRYPT_N = 2**17
DEFAULT_SCRYPT_R = 8
DEFAULT_SCRYPT_P = 1
# Bounds on the KDF parameters, checked when writing and when loading.  MIN_SCRYPT_N is low enough
# for fast tests; the memory cap (128 * n * r bytes) and work cap keep a hostile file from making the
# loader allocate gigabytes or run for minutes.
MIN_SCRYPT_N = 2**10
MAX_SCRYPT_N = 2**20
MAX_SCRYPT_R = 32
MAX_SCRYPT_P = 16
MAX_SCRYPT_MEMORY = 1 << 30  # bytes
MAX_SCRYPT_WORK = 2**24  # n * r * p
SALT_BYTES = 16
NONCE_BYTES = 12
PRIVATE_KEY_BYTES = 32
CHECK_BYTES = 32
MAX_KEY_FILE_BYTES = 64 * 1024
_LEGACY_PEM_PREFIX = b"-----BEGIN"


class KeyFileError(Exception):
    """A key file that cannot be read or written."""


class WrongPassphraseError(KeyFileError):
    """The passphrase does not decrypt the private key file."""


class KeyFileTamperedError(KeyFileError):
    """The key file was modified or corrupted: its ciphertext or public key does not authenticate."""


class KeyFilePermissionError(KeyFileError):
    """The private key file is readable or writable by its group or by others."""


class KeyFileExistsError(KeyFileError, FileExistsError):
    """A key file already exists at the path and ``overwrite`` was not given."""


def save_identity_key(
    path: str | os.PathLike[str],
    key: IdentityKey,
    passphrase: bytes,
    *,
    overwrite: bool = False,
    scrypt_n: int = DEFAULT_SCRYPT_N,
    scrypt_r: int = DEFAULT_SCRYPT_R,
    scrypt_p: int = DEFAULT_SCRYPT_P,
) -> None:
    """Write ``key`` encrypted under ``passphrase`` (scrypt, then AES-256-GCM), mode 0600, atomically.

    Refuses (:class:`KeyFileExistsError`) to replace an existing file unless ``overwrite=True``.
    """
    if not isinstance(passphrase, bytes | bytearray):
        raise TypeError(f"the passphrase must be bytes, got {type(passphrase).__name__}")
    if not passphrase:
        raise ValueError("a non-empty passphrase is required to store a private key")
    _check_kdf_parameters(scrypt_n, scrypt_r, scrypt_p, error=ValueError)
    path = Path(path)
    if not overwrite and os.path.lexists(path):  # before spending the KDF's time (checked again later)
        raise KeyFileExistsError(f"{path}: a key file already exists; pass overwrite=True to replace it")
    salt = secrets.token_bytes(SALT_BYTES)
    nonce = secrets.token_bytes(NONCE_BYTES)
    public_key = key.public_key
    derived = _derive(bytes(passphrase), salt, scrypt_n, scrypt_r, scrypt_p)
    private_bytes = key.private_key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    associated = _associated_data(salt, scrypt_n, scrypt_r, scrypt_p, nonce, public_key)
    ciphertext = AESGCM(derived[:32]).encrypt(nonce, private_bytes, associated)
    document = {
        "format": KEY_FILE_FORMAT,
        "kdf": {"name": KDF_NAME, "salt": _b64(salt), "n": scrypt_n, "r": scrypt_r, "p": scrypt_p},
        "cipher": {"name": CIPHER_NAME, "nonce": _b64(nonce)},
        "public_key": _b64(public_key),
        "check": _b64(derived[32:]),
        "ciphertext": _b64(ciphertext),
    }
    _write_private(path, (json.dumps(document, indent=2) + "\n").encode("ascii"), overwrite=overwrite)


def load_identity_key(
    path: str | os.PathLike[str], passphrase: bytes, *, allow_legacy_pkcs8: bool = False
) -> IdentityKey:
    """Read and decrypt an identity key file.

    Raises :class:`KeyFilePermissionError` if the group or others may read or write the file,
    :class:`WrongPassphraseError` for a wrong passphrase, :class:`KeyFileTamperedError` for a modified
    file and :class:`KeyFileError` for anything else malformed.  ``allow_legacy_pkcs8`` accepts the
    old PKCS#8 PEM files (PBKDF2 with 2048 iterations) once, to re-save them in the current format.
    """
    path = Path(path)
    data = _read_private(path)
    if not isinstance(passphrase, bytes | bytearray):
        raise KeyFileError(f"{path}: the passphrase must be bytes, got {type(passphrase).__name__}")
    if data.lstrip().startswith(_LEGACY_PEM_PREFIX):
        if not allow_legacy_pkcs8:
            raise KeyFileError(
                f"{path}: a legacy PKCS#8 key file (PBKDF2 with 2048 iterations) is not accepted; load it "
                f"once with allow_legacy_pkcs8=True and save it again with save_identity_key(..., "
                f"overwrite=True)"
            )
        return _load_legacy(path, data, bytes(passphrase))
    document = _parse(path, data)
    kdf, cipher = document["kdf"], document["cipher"]
    salt, nonce = kdf["salt"], cipher["nonce"]
    n, r, p = kdf["n"], kdf["r"], kdf["p"]
    public_key = document["public_key"]
    derived = _derive(bytes(passphrase), salt, n, r, p)
    if not hmac.compare_digest(derived[32:], document["check"]):
        raise WrongPassphraseError(
            f"{path}: cannot decrypt the private key: wrong passphrase (or altered KDF fields)"
        )
    associated = _associated_data(salt, n, r, p, nonce, public_key)
    try:
        private_bytes = AESGCM(derived[:32]).decrypt(nonce, document["ciphertext"], associated)
    except InvalidTag:
        raise KeyFileTamperedError(
            f"{path}: the key file was modified or corrupted (its ciphertext, nonce, public key or "
            f"parameters do not authenticate)"
        ) from None
    key = IdentityKey(Ed25519PrivateKey.from_private_bytes(private_bytes))
    if not hmac.compare_digest(key.public_key, public_key):  # cannot happen unless the writer erred
        raise KeyFileTamperedError(f"{path}: the private key does not match the file's public key")
    return key


def save_roster(path: str | os.PathLike[str], roster: Roster) -> None:
    Path(path).write_text(roster.to_json() + "\n", encoding="utf-8")


def load_roster(path: str | os.PathLike[str]) -> Roster:
    return Roster.from_json(Path(path).read_text(encoding="utf-8"))


# --- format ---------------------------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _prefixed(value: bytes | str | int) -> bytes:
    if isinstance(value, str):
        raw = b"s" + value.encode("utf-8")
    elif isinstance(value, int):
        raw = b"i" + value.to_bytes(8, "big")
    else:
        raw = b"b" + value
    return len(raw).to_bytes(4, "big") + raw


def _associated_data(salt: bytes, n: int, r: int, p: int, nonce: bytes, public_key: bytes) -> bytes:
    """Everything in the file but the check value and ciphertext, length-prefixed and typed."""
    fields: tuple[bytes | str | int, ...] = (
        KEY_FILE_FORMAT,
        KDF_NAME,
        salt,
        n,
        r,
        p,
        CIPHER_NAME,
        nonce,
        public_key,
    )
    return b"".join(_prefixed(field) for field in fields)


def _check_kdf_parameters(n: object, r: object, p: object, *, error: type[Exception]) -> None:
    for name, value in (("n", n), ("r", r), ("p", p)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise error(f"scrypt parameter {name} must be a positive integer, got {value!r}")
    assert isinstance(n, int) and isinstance(r, int) and isinstance(p, int)
    if n & (n - 1) or not MIN_SCRYPT_N <= n <= MAX_SCRYPT_N:
        raise error(f"scrypt n must be a power of two in [2^10, 2^20], got {n}")
    if r > MAX_SCRYPT_R or p > MAX_SCRYPT_P:
        raise error(f"scrypt r={r}, p={p} outside r <= {MAX_SCRYPT_R}, p <= {MAX_SCRYPT_P}")
    if 128 * n * r > MAX_SCRYPT_MEMORY or n * r * p > MAX_SCRYPT_WORK:
        raise error(f"scrypt n={n}, r={r}, p={p} needs more memory or work than allowed")


def _derive(passphrase: bytes, salt: bytes, n: int, r: int, p: int) -> bytes:
    return Scrypt(salt=salt, length=32 + CHECK_BYTES, n=n, r=r, p=p).derive(passphrase)


def _parse(path: Path, data: bytes) -> dict:
    """The file's fields, decoded and checked for type, size and bounds (raises KeyFileError)."""

    def field(container: dict, name: str, kind: type) -> object:
        if name not in container:
            raise KeyFileError(f"{path}: key file lacks the field {name!r}")
        value = container[name]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise KeyFileError(f"{path}: key file field {name!r} has the wrong type")
        return value

    def blob(container: dict, name: str, size: int) -> bytes:
        text = field(container, name, str)
        try:
            raw = base64.b64decode(text, validate=True)  # type: ignore[arg-type]
        except (binascii.Error, ValueError):
            raise KeyFileError(f"{path}: key file field {name!r} is not base64") from None
        if len(raw) != size:
            raise KeyFileError(f"{path}: key file field {name!r} must hold {size} bytes, got {len(raw)}")
        return raw

    try:
        document = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise KeyFileError(f"{path}: not a {KEY_FILE_FORMAT} key file (not JSON)") from None
    if not isinstance(document, dict) or document.get("format") != KEY_FILE_FORMAT:
        found = document.get("format") if isinstance(document, dict) else None
        raise KeyFileError(f"{path}: not a {KEY_FILE_FORMAT} key file (format {found!r})")
    kdf = field(document, "kdf", dict)
    cipher = field(document, "cipher", dict)
    assert isinstance(kdf, dict) and isinstance(cipher, dict)
    if kdf.get("name") != KDF_NAME or cipher.get("name") != CIPHER_NAME:
        raise KeyFileError(f"{path}: unsupported KDF {kdf.get('name')!r} or cipher {cipher.get('name')!r}")
    n, r, p = field(kdf, "n", int), field(kdf, "r", int), field(kdf, "p", int)
    _check_kdf_parameters(n, r, p, error=KeyFileError)
    return {
        "kdf": {"salt": blob(kdf, "salt", SALT_BYTES), "n": n, "r": r, "p": p},
        "cipher": {"nonce": blob(cipher, "nonce", NONCE_BYTES)},
        "public_key": blob(document, "public_key", PUBLIC_KEY_BYTES),
        "check": blob(document, "check", CHECK_BYTES),
        "ciphertext": blob(document, "ciphertext", PRIVATE_KEY_BYTES + 16),
    }


def _load_legacy(path: Path, data: bytes, passphrase: bytes) -> IdentityKey:
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


# --- files ----------------------------------------------------------------------------------------


def _read_private(path: Path) -> bytes:
    """The file's bytes, after checking (on the open descriptor) that only its owner can access it."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot open the key file: {exc.strerror}") from exc
    with os.fdopen(descriptor, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise KeyFileError(f"{path}: not a regular file")
        if os.name == "posix" and info.st_mode & 0o077:
            raise KeyFilePermissionError(
                f"{path}: permissions {stat.S_IMODE(info.st_mode):04o} are too open: a private key file "
                f"must not be accessible by group or others (chmod 600 {path})"
            )
        data = handle.read(MAX_KEY_FILE_BYTES + 1)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise KeyFileError(f"{path}: larger than {MAX_KEY_FILE_BYTES} bytes: not a key file")
    return data


def _write_private(path: Path, data: bytes, *, overwrite: bool) -> None:
    """Write ``data`` to ``path`` atomically: a 0600 temporary file beside it, fsync, then move."""
    if not overwrite and os.path.lexists(path):
        raise KeyFileExistsError(f"{path}: a key file already exists; pass overwrite=True to replace it")
    directory = path.parent
    temporary = directory / f".{path.name}.{secrets.token_hex(8)}.tmp"
    # O_EXCL|0600: the key is never readable by others, not even before the final chmod.
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            if hasattr(os, "fchmod"):
                os.fchmod(handle.fileno(), 0o600)  # in case the umask removed bits (it cannot add any)
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if overwrite:
            os.replace(temporary, path)
        else:
            _move_without_overwriting(temporary, path)
    except BaseException:
        if os.path.lexists(temporary):
            os.unlink(temporary)
        raise
    _fsync_directory(directory)


def _move_without_overwriting(source: Path, destination: Path) -> None:
    # link() fails if the destination exists, so a file created meanwhile is never replaced.
    try:
        os.link(source, destination)
    except FileExistsError:
        raise KeyFileExistsError(
            f"{destination}: a key file already exists; pass overwrite=True to replace it"
        ) from None
    except OSError:  # a file system without hard links: check, then rename
        if os.path.lexists(destination):
            raise KeyFileExistsError(
                f"{destination}: a key file already exists; pass overwrite=True to replace it"
            ) from None
        os.replace(source, destination)
        return
    os.unlink(source)


def _fsync_directory(directory: Path) -> None:
    if os.name != "posix":
        return
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
