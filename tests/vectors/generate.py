"""Writes the masking protocol's known-answer vectors (``masking-v1.json``) to stdout.

    PYTHONPATH=. python tests/vectors/generate.py > tests/vectors/masking-v1.json

Every value comes from the project's own functions, from fixed private keys, seeds and inputs (each
a SHA-256 of a label, written out in the file): three clients run one whole session (R0..R4, no
dropout) through :class:`~secure_afl.protocol.client.ClientSession` and
:class:`~secure_afl.protocol.server.ServerSession`, each drawing its encryption key, mask key and
self-mask seed (R0's three draws, in that order) from the file and everything else (Shamir
coefficients, nonces) from a :class:`~secure_afl.core.randomness.DeterministicRandomSource`.
``tests/protocol/test_vectors.py`` checks the committed file against the code and, with
``cryptography`` alone, that every derived value follows from the inputs.
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from secure_afl.core import encoding
from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.deploy.classifier import SIGNATURE_CONTEXT, ClassifierSigner, content_digest
from secure_afl.keys import cosign
from secure_afl.keys.identity import IdentityKey
from secure_afl.keys.roster import ROSTER_FORMAT, Roster, RosterEntry
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.protocol import binding, codec, crypto, prg
from secure_afl.protocol.client import ClientSession
from secure_afl.protocol.fields import sequence, tagged_fields
from secure_afl.protocol.messages import (
    AdvertiseKeys,
    ConsistencyResponse,
    GroupSpec,
    MaskedInput,
    SessionConfig,
    ShareKeys,
    TensorSpec,
)
from secure_afl.protocol.server import ServerSession

FORMAT = "secure-afl-masking-vectors/v1"
CLIENTS = ("hospital-a", "hospital-b", "hospital-c")
COORDINATOR = "coordinator"
GROUP, TENSOR = "g", "t"
FRAC_BITS = 32
THRESHOLD = 2
INPUTS = {
    "hospital-a": [1.5, -2.25, 0.1, 1000000.0],
    "hospital-b": [-0.5, 0.75, -0.3, 2.0**-33],
    "hospital-c": [0.25, -1.0, 1.0 / 3.0, -123.456],
}
KEYSTREAM_WORDS = 8
KEYSTREAM_OFFSET = prg.CHUNK_WORDS  # where a second run of a split keystream starts (an even word)
ENCODING_CASES = [
    0.0,
    1.0,
    -1.0,
    0.1,
    -0.1,
    2.0**-33,  # 0.5 of a unit: half to even gives 0
    3 * 2.0**-33,  # 1.5 units: 2
    5 * 2.0**-33,  # 2.5 units: 2
    -3 * 2.0**-33,  # -1.5 units: -2
    -5 * 2.0**-33,  # -2.5 units: -2
    123456.789,
    -1073741824.0,  # -2^30
]
HKDF_SALT = bytes(32)  # salt absent (None in the code): HashLen zero bytes, RFC 5869 section 2.2


def fixed(label: str) -> bytes:
    """A fixed 32-byte secret: SHA-256 of a label (its value is what the file records)."""
    return hashlib.sha256(f"secure-afl test vector/{label}".encode()).digest()


class ScriptedRandom:
    """Hands out ``script`` in order (each draw of its exact length), then a deterministic stream."""

    def __init__(self, script: list[bytes], fallback: bytes) -> None:
        self._script = list(script)
        self._fallback = DeterministicRandomSource(fallback)

    def token_bytes(self, n: int) -> bytes:
        if self._script:
            value = self._script.pop(0)
            if len(value) != n:
                raise AssertionError(f"the scripted draw has {len(value)} bytes, the code asked for {n}")
            return value
        return self._fallback.token_bytes(n)


def words_hex(words: np.ndarray) -> list[str]:
    return [f"{int(w):016x}" for w in np.asarray(words, dtype=np.uint64)]


def run_session(secrets: dict[str, dict[str, bytes]], roster: Roster, config: SessionConfig) -> dict:
    """One whole session; every message each client sent, and the server's result."""
    clients = {
        cid: ClientSession(
            cid,
            IdentityKey(Ed25519PrivateKey.from_private_bytes(secrets[cid]["identity"])),
            roster,
            {GROUP: {TENSOR: np.array(INPUTS[cid])}},
            min_threshold=THRESHOLD,
            min_group_size=1,
            random=ScriptedRandom(
                [secrets[cid]["encryption"], secrets[cid]["mask"], secrets[cid]["seed"]],
                b"secure-afl test vector/fallback/" + cid.encode(),
            ),
            policy=ClientPolicy.simulator(),
        )
        for cid in CLIENTS
    }
    server = ServerSession(roster, config)
    sent: dict[type, dict[str, object]] = {}
    requests = dict.fromkeys(clients, server.start())
    for _ in range(5):
        for cid, request in sorted(requests.items()):
            for reply in clients[cid].receive(codec.decode(codec.encode(request))):
                sent.setdefault(type(reply), {})[cid] = reply
                server.receive(codec.decode(codec.encode(reply)))
        requests = server.next_round()
    return {"sent": sent, "result": server.result()}


def main() -> None:
    secrets = {
        cid: {part: fixed(f"{cid}/{part}") for part in ("identity", "encryption", "mask", "seed")}
        for cid in CLIENTS
    }
    identities = {
        cid: IdentityKey(Ed25519PrivateKey.from_private_bytes(secrets[cid]["identity"])) for cid in CLIENTS
    }
    coordinator_key = IdentityKey(Ed25519PrivateKey.from_private_bytes(fixed(f"{COORDINATOR}/identity")))
    roster = Roster(
        (RosterEntry(cid, f"Hospital {cid[-1].upper()}", identities[cid].public_key) for cid in CLIENTS),
        coordinator=RosterEntry(COORDINATOR, "Coordinator", coordinator_key.public_key),
    )
    session_id = fixed("session-id")
    config = SessionConfig(
        session_id=session_id,
        threshold=THRESHOLD,
        min_group_size=1,
        frac_bits=FRAC_BITS,
        groups=(GroupSpec(GROUP, (TensorSpec(TENSOR, len(INPUTS[CLIENTS[0]])),)),),
    )
    run = run_session(secrets, roster, config)
    adverts: dict[str, AdvertiseKeys] = run["sent"][AdvertiseKeys]
    length = len(INPUTS[CLIENTS[0]])

    enc_keys = {cid: X25519PrivateKey.from_private_bytes(secrets[cid]["encryption"]) for cid in CLIENTS}
    mask_keys = {cid: X25519PrivateKey.from_private_bytes(secrets[cid]["mask"]) for cid in CLIENTS}
    clients = []
    for cid in CLIENTS:
        seed = secrets[cid]["seed"]
        clients.append(
            {
                "id": cid,
                "identity_private_key": secrets[cid]["identity"].hex(),
                "identity_public_key": identities[cid].public_key.hex(),
                "share_point": roster.share_point(cid),
                "encryption_private_key": secrets[cid]["encryption"].hex(),
                "encryption_public_key": crypto.x25519_public_bytes(enc_keys[cid]).hex(),
                "mask_private_key": secrets[cid]["mask"].hex(),
                "mask_public_key": crypto.x25519_public_bytes(mask_keys[cid]).hex(),
                "self_mask_seed": seed.hex(),
                "commitment_preimage": tagged_fields(binding.COMMITMENT_DOMAIN, session_id, cid, seed).hex(),
                "self_mask_commitment": binding.self_mask_commitment(seed, session_id, cid).hex(),
                "input": INPUTS[cid],
            }
        )

    shares = []
    for sender in CLIENTS:
        for item in run["sent"][ShareKeys][sender].shares:
            recipient = item.recipient
            secret = crypto.x25519_shared_secret(
                enc_keys[sender], crypto.x25519_public_bytes(enc_keys[recipient])
            )
            key = crypto.share_encryption_key(secret, session_id, sender, recipient)
            associated = crypto.share_associated_data(session_id, sender, recipient)
            shares.append(
                {
                    "sender": sender,
                    "recipient": recipient,
                    "shared_secret": secret.hex(),
                    "hkdf_salt": HKDF_SALT.hex(),
                    "hkdf_info": tagged_fields(crypto.SHARE_KEY_DOMAIN, session_id, sender, recipient).hex(),
                    "share_key": key.hex(),
                    "associated_data": associated.hex(),
                    "nonce": item.nonce.hex(),
                    "plaintext": crypto.decrypt_share(
                        key, item.nonce, item.ciphertext, associated, sender
                    ).hex(),
                    "ciphertext": item.ciphertext.hex(),
                }
            )

    def keystream(key: bytes) -> dict:
        return {
            "words": words_hex(prg.mask_words(key, KEYSTREAM_WORDS)),
            "words_at_offset": words_hex(
                prg.mask_words(key, KEYSTREAM_OFFSET + KEYSTREAM_WORDS)[KEYSTREAM_OFFSET:]
            ),
        }

    masks = []
    for cid in CLIENTS:
        seed = secrets[cid]["seed"]
        key = prg.self_mask_key(seed, session_id, GROUP, TENSOR, cid)
        masks.append(
            {
                "kind": "self",
                "clients": [cid],
                "ikm": seed.hex(),
                "hkdf_salt": HKDF_SALT.hex(),
                "hkdf_info": tagged_fields(prg.SELF_MASK_DOMAIN, session_id, GROUP, TENSOR, cid).hex(),
                "key": key.hex(),
                **keystream(key),
            }
        )
    for i, low in enumerate(CLIENTS):
        for high in CLIENTS[i + 1 :]:
            secret = crypto.x25519_shared_secret(mask_keys[low], crypto.x25519_public_bytes(mask_keys[high]))
            key = prg.pair_mask_key(secret, session_id, GROUP, TENSOR, high, low)
            masks.append(
                {
                    "kind": "pair",
                    "clients": [low, high],
                    "ikm": secret.hex(),
                    "hkdf_salt": HKDF_SALT.hex(),
                    "hkdf_info": tagged_fields(
                        prg.PAIR_MASK_DOMAIN, session_id, GROUP, TENSOR, low, high
                    ).hex(),
                    "key": key.hex(),
                    **keystream(key),
                }
            )

    masked = []
    for cid in CLIENTS:
        (tensor,) = run["sent"][MaskedInput][cid].tensors
        masked.append(
            {
                "client": cid,
                "group": tensor.group,
                "tensor": tensor.tensor,
                "encoded": words_hex(
                    encoding.encode(
                        np.array(INPUTS[cid]), tensor=TENSOR, frac_bits=FRAC_BITS, group_size=len(CLIENTS)
                    )
                ),
                "masked": words_hex(np.frombuffer(tensor.data, dtype="<u8")),
            }
        )
    total = run["result"].groups[GROUP].sums[TENSOR]

    digest = binding.config_digest(config)
    config_preimage = tagged_fields(
        binding.CONFIG_DOMAIN,
        session_id,
        THRESHOLD,
        1,
        FRAC_BITS,
        _layout(length),
        binding.NO_CONTEXT,
    )
    assert hashlib.sha256(config_preimage).digest() == digest
    advert_signatures = []
    for cid in CLIENTS:
        advert = adverts[cid]
        domain, fields = binding.advertise_fields(
            session_id,
            cid,
            advert.encryption_public_key,
            advert.mask_public_key,
            advert.self_mask_commitment,
            advert.config_digest,
            advert.groups,
        )
        advert_signatures.append(
            {
                "signer": cid,
                "public_key": identities[cid].public_key.hex(),
                "message": tagged_fields(domain, *fields).hex(),
                "signature": advert.signature.hex(),
            }
        )
    adverts_digest = binding.advertisements_digest(session_id, adverts.values())
    survivors_domain, survivors_fields = binding.survivors_fields(
        session_id, digest, adverts_digest, tuple(CLIENTS)
    )
    consistency = [
        {
            "signer": cid,
            "public_key": identities[cid].public_key.hex(),
            "message": tagged_fields(survivors_domain, *survivors_fields).hex(),
            "signature": run["sent"][ConsistencyResponse][cid].signature.hex(),
        }
        for cid in CLIENTS
    ]
    cosignatures = []
    for cid in CLIENTS:
        signer, signature = cosign.sign_roster(roster, identities[cid])
        cosignatures.append(
            {
                "signer": signer,
                "public_key": identities[cid].public_key.hex(),
                "message": cosign.message(roster).hex(),
                "signature": signature.hex(),
            }
        )
    document = {
        "format": "secure-afl-classifier/v2",
        "classes": ["A", "B"],
        "note": "a test vector",
        "roster_fingerprint": roster.fingerprint,
    }
    classifier_signature = ClassifierSigner(COORDINATOR, coordinator_key).sign(document)
    digest_hex = content_digest(document)

    vectors = {
        "format": FORMAT,
        "conventions": [
            "Bytes are hex; a uint64 word is 16 hex digits, its value most significant digit first.",
            "P(x) = len(x) as 4 bytes big-endian || x. T(domain, f1, ..., fk) = P(domain) || P(e(f1)) || "
            "... || P(e(fk)), e(bytes b) = 'b' || b, e(str s) = 's' || UTF-8(s), e(int i) = 'i' || i as 8 "
            "bytes big-endian, e(list of str) = 'l' || P(UTF-8(s1)) || P(UTF-8(s2)) || ...; "
            "S(x1, ..., xn) = n as 4 bytes big-endian || P(x1) || ... || P(xn).",
            "HKDF = HKDF-SHA256 (RFC 5869), 32-byte output, salt hkdf_salt (32 zero bytes: the code passes "
            "no salt), info hkdf_info.",
            "Share key = HKDF(X25519(sender's encryption key, recipient's), info T('secure-afl/v1/share-"
            "encryption-key', session_id, sender, recipient)); AES-256-GCM with associated data T('secure-"
            "afl/v1/share-associated-data', session_id, sender, recipient); plaintext = the Shamir shares "
            "(at the recipient's share_point) of the seed and of the mask private key, 66 bytes "
            "big-endian each.",
            "Self-mask key = HKDF(seed, info T('secure-afl/v1/self-mask', session_id, group, tensor, "
            "client)); "
            "pair-mask key = HKDF(X25519(the two mask keys), info T('secure-afl/v1/pairwise-mask', "
            "session_id, group, tensor, low, high)), low < high comparing ids as UTF-8 bytes.",
            "Mask words: the AES-256-CTR keystream under the key from the all-zero counter block (a 128-bit "
            "big-endian counter), read 8 bytes at a time little-endian; word w (w even) starts counter "
            "block w/2.",
            "enc(x) = round(x * 2^frac_bits), ties to even, as a 64-bit two's-complement word.",
            "masked = enc(x) + self mask + sum over peers v of (pair mask if client < v, else minus it), mod "
            "2^64; the sum's words = sum of masked - sum of self masks = sum of enc(x), mod 2^64; decoded = "
            "the words as signed 64-bit integers / 2^frac_bits.",
            "Signatures are Ed25519 (RFC 8032) by public_key's private key over message.",
        ],
        "session": {
            "session_id": session_id.hex(),
            "threshold": THRESHOLD,
            "min_group_size": 1,
            "frac_bits": FRAC_BITS,
            "groups": [{"name": GROUP, "tensors": [{"name": TENSOR, "length": length}]}],
            "context": binding.NO_CONTEXT.hex(),
            "config_digest_preimage": config_preimage.hex(),
            "config_digest": digest.hex(),
        },
        "clients": clients,
        "shares": shares,
        "masks": masks,
        "keystream_offset": KEYSTREAM_OFFSET,
        "encoding": [
            {
                "value": value,
                "value_hex": float(value).hex(),
                "word": words_hex(
                    encoding.encode(np.array([value]), tensor="x", frac_bits=FRAC_BITS, group_size=1)
                )[0],
            }
            for value in ENCODING_CASES
        ],
        "masked_inputs": masked,
        "sum": {
            "group": GROUP,
            "tensor": TENSOR,
            "survivors": list(run["result"].survivors),
            "words": words_hex(total),
            "decoded": [float(v) for v in encoding.decode(np.array(total), frac_bits=FRAC_BITS)],
        },
        "signatures": {
            "advertisement": advert_signatures,
            "advertisements_digest_preimage": tagged_fields(
                binding.ADVERTISEMENTS_DOMAIN, session_id, _advert_entries(adverts)
            ).hex(),
            "advertisements_digest": adverts_digest.hex(),
            "consistency": consistency,
            "roster": {
                "format": ROSTER_FORMAT,
                "clients": [_entry(entry) for entry in roster.entries],
                "coordinator": _entry(roster.coordinator),
                "digest": roster.digest().hex(),
                "cosignatures": cosignatures,
            },
            "classifier": {
                "document": document,
                "content_sha256": digest_hex,
                "signer": COORDINATOR,
                "private_key": fixed(f"{COORDINATOR}/identity").hex(),
                "public_key": coordinator_key.public_key.hex(),
                "message": (
                    SIGNATURE_CONTEXT + COORDINATOR.encode() + b"\x00" + bytes.fromhex(digest_hex)
                ).hex(),
                "signature": base64.b64decode(classifier_signature["value"]).hex(),
            },
        },
    }
    json.dump(vectors, sys.stdout, indent=1)
    sys.stdout.write("\n")


def _entry(entry: RosterEntry) -> dict[str, str]:
    return {"id": entry.client_id, "name": entry.name, "public_key": entry.public_key.hex()}


def _layout(length: int) -> bytes:
    tensors = sequence([tagged_fields(binding.LAYOUT_TENSOR_DOMAIN, TENSOR, length)])
    return sequence([tagged_fields(binding.LAYOUT_GROUP_DOMAIN, GROUP, tensors)])


def _advert_entries(adverts: dict[str, AdvertiseKeys]) -> bytes:
    return sequence(
        tagged_fields(
            binding.ADVERTISEMENT_ENTRY_DOMAIN,
            a.session_id,
            a.client_id,
            a.encryption_public_key,
            a.mask_public_key,
            a.self_mask_commitment,
            a.config_digest,
            a.groups,
            a.signature,
        )
        for _, a in sorted(adverts.items())
    )


if __name__ == "__main__":
    main()
