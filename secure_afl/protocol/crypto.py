"""Signatures, key agreement and share encryption, all from ``cryptography``.

* Ed25519 identity signatures over :func:`~secure_afl.protocol.fields.tagged_fields` encodings.
* X25519 key agreement; session keys are generated from the injected :class:`RandomSource`.
* Shares are encrypted with AES-256-GCM.  The key is HKDF-SHA256 over the X25519 secret with the
  session id, the sender and the recipient in ``info`` (one key per direction per session), and the
  same three values are bound again as associated data.
"""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from secure_afl.core.errors import InvalidShareError, ShareAuthenticationError
from secure_afl.core.randomness import RandomSource

from .fields import Field, tagged_fields

KEY_BYTES = 32
SIGNATURE_BYTES = 64
NONCE_BYTES = 12
TAG_BYTES = 16

SHARE_KEY_DOMAIN = b"secure-afl/v1/share-encryption-key"
SHARE_AD_DOMAIN = b"secure-afl/v1/share-associated-data"


def sign(identity_key: Ed25519PrivateKey, domain: bytes, *fields: Field) -> bytes:
    """Ed25519 signature over the domain-tagged fields."""
    return identity_key.sign(tagged_fields(domain, *fields))


def verify(public_key: bytes, signature: bytes, domain: bytes, *fields: Field) -> bool:
    """Whether ``signature`` is a valid Ed25519 signature by ``public_key`` over the tagged fields."""
    return verify_message(public_key, signature, tagged_fields(domain, *fields))


def verify_message(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """:func:`verify` over an already encoded ``tagged_fields(domain, *fields)``: for many signatures
    over one message (n clients' signatures over one survivor set), encoded once, not n times."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


def new_x25519_key(random: RandomSource) -> X25519PrivateKey:
    """A fresh X25519 private key drawn from ``random``."""
    return X25519PrivateKey.from_private_bytes(random.token_bytes(KEY_BYTES))


def x25519_private_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )


def x25519_public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def x25519_shared_secret(private_key: X25519PrivateKey, peer_public_key: bytes) -> bytes:
    """X25519 agreement; a peer key of low order (all-zero secret) is the peer's fault."""
    try:
        return private_key.exchange(X25519PublicKey.from_public_bytes(peer_public_key))
    except ValueError as exc:
        raise InvalidShareError("peer X25519 public key is invalid (low order point)") from exc


_PROBE_KEY = bytes([0x40] + [0x11] * 30 + [0x42])  # any fixed scalar: probes a public key's order
# Built once: a public constant, not a secret (2n probes per session at n = 1,000 rebuilt it each time).
_PROBE = X25519PrivateKey.from_private_bytes(_PROBE_KEY)


def valid_x25519_public_key(public_key: bytes) -> bool:
    """Whether ``public_key`` is 32 bytes and not a low-order point (which gives an all-zero secret)."""
    if len(public_key) != KEY_BYTES:
        return False
    try:
        _PROBE.exchange(X25519PublicKey.from_public_bytes(public_key))
    except ValueError:
        return False
    return True


def share_encryption_key(shared_secret: bytes, session_id: bytes, sender: str, recipient: str) -> bytes:
    """The AES-GCM key for shares sent from ``sender`` to ``recipient`` in this session."""
    info = tagged_fields(SHARE_KEY_DOMAIN, session_id, sender, recipient)
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(shared_secret)


def share_associated_data(session_id: bytes, sender: str, recipient: str) -> bytes:
    return tagged_fields(SHARE_AD_DOMAIN, session_id, sender, recipient)


def encrypt_share(key: bytes, nonce: bytes, plaintext: bytes, associated_data: bytes) -> bytes:
    return AESGCM(key).encrypt(nonce, plaintext, associated_data)


def decrypt_share(key: bytes, nonce: bytes, ciphertext: bytes, associated_data: bytes, sender: str) -> bytes:
    try:
        return AESGCM(key).decrypt(nonce, ciphertext, associated_data)
    except InvalidTag as exc:
        raise ShareAuthenticationError(
            f"encrypted shares from {sender!r} fail authentication: {sender!r} or the server relaying "
            f"them altered or garbled them"
        ) from exc
