"""Known-answer vectors of the masking protocol (``tests/vectors/masking-v1.json``, SECURITY.md §2).

Two kinds of check.  ``test_code_*``: the project's code reproduces every value in the committed
file from the file's inputs (a whole session of three clients, and each primitive on its own).
``test_spec_*``: with ``cryptography`` and the standard library alone, not the project's helpers,
every derived value follows from the inputs as the file's ``conventions`` say (the encodings are
rebuilt here from the domain tags spelled out below), so the file is a specification another
implementation can be checked against.  ``tests/vectors/generate.py`` wrote the file.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from secure_afl.core import encoding
from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.deploy.classifier import ClassifierSigner, content_digest, verify_signature
from secure_afl.keys import cosign
from secure_afl.keys.identity import IdentityKey
from secure_afl.keys.roster import Roster, RosterEntry
from secure_afl.privacy.policy import ClientPolicy
from secure_afl.protocol import binding, crypto, prg
from secure_afl.protocol.client import ClientSession
from secure_afl.protocol.fields import tagged_fields
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

from .helpers import wire

VECTORS = json.loads((Path(__file__).parents[1] / "vectors" / "masking-v1.json").read_text(encoding="utf-8"))
SESSION = VECTORS["session"]
SESSION_ID = bytes.fromhex(SESSION["session_id"])
FRAC_BITS = SESSION["frac_bits"]
CLIENTS = {client["id"]: client for client in VECTORS["clients"]}
MASKS = VECTORS["masks"]
SIGNATURES = VECTORS["signatures"]
MOD = 2**64

# The specification's domain tags, written out here (not imported): a changed tag in the code fails.
SHARE_KEY = b"secure-afl/v1/share-encryption-key"
SHARE_AD = b"secure-afl/v1/share-associated-data"
SELF_MASK = b"secure-afl/v1/self-mask"
PAIR_MASK = b"secure-afl/v1/pairwise-mask"
COMMITMENT = b"secure-afl/v1/self-mask-commitment"
CONFIG = b"secure-afl/v1/session-config/nested-layout"
LAYOUT_GROUP = b"secure-afl/v1/layout-group"
LAYOUT_TENSOR = b"secure-afl/v1/layout-tensor"
ADVERTISE = b"secure-afl/v1/advertise-keys"
ADVERTISEMENTS = b"secure-afl/v1/accepted-advertisements"
ADVERTISEMENT_ENTRY = b"secure-afl/v1/accepted-advertisement"
SURVIVORS = b"secure-afl/v1/consistency-transcript"
ROSTER_COSIGNATURE = b"secure-afl roster co-signature v1\x00"
CLASSIFIER_SIGNATURE = b"secure-afl classifier signature/v2\x00"
SHAMIR_PRIME = 2**521 - 1


def h(text: str) -> bytes:
    return bytes.fromhex(text)


def words(texts: list[str]) -> list[int]:
    return [int(text, 16) for text in texts]


# --- the specification, from cryptography and the standard library alone -------------------------


def _p(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def _t(domain: bytes, *fields: bytes | str | int | list[str]) -> bytes:
    """T(domain, f1, ...) of the file's conventions."""
    out = _p(domain)
    for f in fields:
        if isinstance(f, bytes):
            out += _p(b"b" + f)
        elif isinstance(f, str):
            out += _p(b"s" + f.encode())
        elif isinstance(f, int):
            out += _p(b"i" + f.to_bytes(8, "big"))
        else:
            out += _p(b"l" + b"".join(_p(s.encode()) for s in f))
    return out


def _s(items: list[bytes]) -> bytes:
    return len(items).to_bytes(4, "big") + b"".join(_p(item) for item in items)


def _hkdf(ikm: bytes, salt: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(ikm)


def _keystream(key: bytes, first_word: int, count: int) -> list[int]:
    assert first_word % 2 == 0
    counter = (first_word // 2).to_bytes(16, "big")
    data = Cipher(algorithms.AES(key), modes.CTR(counter)).encryptor().update(bytes(8 * count))
    return [int.from_bytes(data[8 * i : 8 * i + 8], "little") for i in range(count)]


def _x25519(private: bytes, peer_public: bytes) -> bytes:
    return X25519PrivateKey.from_private_bytes(private).exchange(
        X25519PublicKey.from_public_bytes(peer_public)
    )


def _x25519_public(private: bytes) -> bytes:
    return X25519PrivateKey.from_private_bytes(private).public_key().public_bytes_raw()


def _ed25519(private: bytes) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(private)


def _signed(signer: str) -> Ed25519PrivateKey:
    return _ed25519(h(CLIENTS[signer]["identity_private_key"]))


def _encode(value: float) -> int:
    return round(value * 2**FRAC_BITS) % MOD  # exact: x * 2^f is a float; round() ties to even


def _signed_int(word: int) -> int:
    return word - MOD if word >= 2**63 else word


def _check_signature(item: dict, private: Ed25519PrivateKey) -> None:
    message, signature = h(item["message"]), h(item["signature"])
    assert private.public_key().public_bytes_raw() == h(item["public_key"])
    assert private.sign(message) == signature  # Ed25519 is deterministic
    Ed25519PublicKey.from_public_bytes(h(item["public_key"])).verify(signature, message)


def test_spec_share_keys_and_encrypted_shares_follow_from_the_x25519_keys() -> None:
    assert len(VECTORS["shares"]) == len(CLIENTS) * (len(CLIENTS) - 1)
    for item in VECTORS["shares"]:
        sender, recipient = CLIENTS[item["sender"]], CLIENTS[item["recipient"]]
        for client in (sender, recipient):
            assert _x25519_public(h(client["encryption_private_key"])) == h(client["encryption_public_key"])
        secret = _x25519(h(sender["encryption_private_key"]), h(recipient["encryption_public_key"]))
        assert secret == _x25519(h(recipient["encryption_private_key"]), h(sender["encryption_public_key"]))
        assert secret == h(item["shared_secret"])
        assert h(item["hkdf_salt"]) == bytes(32)
        info = _t(SHARE_KEY, SESSION_ID, sender["id"], recipient["id"])
        assert h(item["hkdf_info"]) == info
        key = _hkdf(secret, h(item["hkdf_salt"]), info)
        assert key == h(item["share_key"])
        associated = _t(SHARE_AD, SESSION_ID, sender["id"], recipient["id"])
        assert h(item["associated_data"]) == associated
        plaintext = AESGCM(key).decrypt(h(item["nonce"]), h(item["ciphertext"]), associated)
        assert plaintext == h(item["plaintext"]) and len(plaintext) == 2 * 66


def test_spec_shamir_shares_rebuild_each_seed_and_mask_key() -> None:
    """Any T = 2 of the shares a sender encrypted rebuild its seed and mask key (Lagrange at 0)."""
    assert SESSION["threshold"] == 2
    for cid, client in CLIENTS.items():
        held = [item for item in VECTORS["shares"] if item["sender"] == cid]
        (x1, p1), (x2, p2) = [
            (CLIENTS[item["recipient"]]["share_point"], h(item["plaintext"])) for item in held
        ]
        for offset, secret in ((0, client["self_mask_seed"]), (66, client["mask_private_key"])):
            y1, y2 = (int.from_bytes(p[offset : offset + 66], "big") for p in (p1, p2))
            value = (y1 * x2 * pow(x2 - x1, -1, SHAMIR_PRIME) + y2 * x1 * pow(x1 - x2, -1, SHAMIR_PRIME)) % (
                SHAMIR_PRIME
            )
            assert value == int(secret, 16)


def test_spec_mask_keys_and_keystream_words_follow_from_the_secrets() -> None:
    (group,) = SESSION["groups"]
    (tensor,) = group["tensors"]
    offset = VECTORS["keystream_offset"]
    assert offset % 2 == 0 and offset > 0
    kinds = []
    for mask in MASKS:
        kinds.append(mask["kind"])
        if mask["kind"] == "self":
            (cid,) = mask["clients"]
            ikm = h(CLIENTS[cid]["self_mask_seed"])
            info = _t(SELF_MASK, SESSION_ID, group["name"], tensor["name"], cid)
        else:
            low, high = mask["clients"]
            assert low.encode() < high.encode()
            ikm = _x25519(h(CLIENTS[low]["mask_private_key"]), h(CLIENTS[high]["mask_public_key"]))
            assert ikm == _x25519(h(CLIENTS[high]["mask_private_key"]), h(CLIENTS[low]["mask_public_key"]))
            info = _t(PAIR_MASK, SESSION_ID, group["name"], tensor["name"], low, high)
        assert h(mask["ikm"]) == ikm and h(mask["hkdf_info"]) == info and h(mask["hkdf_salt"]) == bytes(32)
        key = _hkdf(ikm, h(mask["hkdf_salt"]), info)
        assert key == h(mask["key"])
        assert _keystream(key, 0, len(mask["words"])) == words(mask["words"])
        assert _keystream(key, offset, len(mask["words_at_offset"])) == words(mask["words_at_offset"])
    assert (
        kinds.count("self") == len(CLIENTS) and kinds.count("pair") == len(CLIENTS) * (len(CLIENTS) - 1) // 2
    )


def test_spec_fixed_point_encoding_rounds_half_to_even() -> None:
    cases = VECTORS["encoding"]
    for case in cases:
        assert float.fromhex(case["value_hex"]) == case["value"]
        assert int(case["word"], 16) == _encode(case["value"])
    ties = [c for c in cases if (c["value"] * 2**FRAC_BITS) % 1 == 0.5]
    assert {_signed_int(int(c["word"], 16)) for c in ties} == {0, 2, -2}  # 0.5, ±1.5 and ±2.5 units
    assert any(c["value"] < 0 for c in ties)


def test_spec_masked_words_cancel_to_the_sum_of_encodings() -> None:
    (group,) = SESSION["groups"]
    (tensor,) = group["tensors"]
    length = tensor["length"]
    self_masks = {m["clients"][0]: words(m["words"])[:length] for m in MASKS if m["kind"] == "self"}
    pair_masks = {tuple(m["clients"]): words(m["words"])[:length] for m in MASKS if m["kind"] == "pair"}
    total, encoded_total = [0] * length, [0] * length
    for item in VECTORS["masked_inputs"]:
        cid = item["client"]
        assert (item["group"], item["tensor"]) == (group["name"], tensor["name"])
        encoded = [_encode(x) for x in CLIENTS[cid]["input"]]
        assert words(item["encoded"]) == encoded
        expected = [e + s for e, s in zip(encoded, self_masks[cid], strict=True)]
        for peer in CLIENTS:
            if peer != cid:
                sign = 1 if cid.encode() < peer.encode() else -1
                pair = pair_masks[tuple(sorted((cid, peer), key=str.encode))]
                expected = [y + sign * m for y, m in zip(expected, pair, strict=True)]
        assert words(item["masked"]) == [y % MOD for y in expected]
        total = [(a + y) % MOD for a, y in zip(total, words(item["masked"]), strict=True)]
        total = [(a - s) % MOD for a, s in zip(total, self_masks[cid], strict=True)]
        encoded_total = [(a + e) % MOD for a, e in zip(encoded_total, encoded, strict=True)]
    result = VECTORS["sum"]
    assert result["survivors"] == sorted(CLIENTS) == [i["client"] for i in VECTORS["masked_inputs"]]
    assert words(result["words"]) == total == encoded_total
    assert result["decoded"] == [_signed_int(w) / 2**FRAC_BITS for w in total]
    plain = [sum(values) for values in zip(*(c["input"] for c in CLIENTS.values()), strict=True)]
    assert np.allclose(result["decoded"], plain, rtol=0, atol=len(CLIENTS) * 2.0 ** -(FRAC_BITS + 1))


def test_spec_signed_messages_follow_from_their_fields() -> None:
    (group,) = SESSION["groups"]
    (tensor,) = group["tensors"]
    layout = _s([_t(LAYOUT_GROUP, group["name"], _s([_t(LAYOUT_TENSOR, tensor["name"], tensor["length"])]))])
    config = _t(
        CONFIG,
        SESSION_ID,
        SESSION["threshold"],
        SESSION["min_group_size"],
        FRAC_BITS,
        layout,
        h(SESSION["context"]),
    )
    assert h(SESSION["config_digest_preimage"]) == config
    digest = hashlib.sha256(config).digest()
    assert h(SESSION["config_digest"]) == digest
    entries = []
    for item in SIGNATURES["advertisement"]:
        client = CLIENTS[item["signer"]]
        commitment = _t(COMMITMENT, SESSION_ID, client["id"], h(client["self_mask_seed"]))
        assert h(client["commitment_preimage"]) == commitment
        assert h(client["self_mask_commitment"]) == hashlib.sha256(commitment).digest()
        assert _x25519_public(h(client["mask_private_key"])) == h(client["mask_public_key"])
        fields = (
            SESSION_ID,
            client["id"],
            h(client["encryption_public_key"]),
            h(client["mask_public_key"]),
            h(client["self_mask_commitment"]),
            digest,
            [group["name"]],
        )
        assert h(item["message"]) == _t(ADVERTISE, *fields)
        _check_signature(item, _signed(item["signer"]))
        entries.append(_t(ADVERTISEMENT_ENTRY, *fields, h(item["signature"])))
    adverts = _t(ADVERTISEMENTS, SESSION_ID, _s(entries))  # entries in client id order
    assert h(SIGNATURES["advertisements_digest_preimage"]) == adverts
    assert h(SIGNATURES["advertisements_digest"]) == hashlib.sha256(adverts).digest()
    transcript = _t(SURVIVORS, SESSION_ID, digest, hashlib.sha256(adverts).digest(), sorted(CLIENTS))
    assert [item["signer"] for item in SIGNATURES["consistency"]] == sorted(CLIENTS)
    for item in SIGNATURES["consistency"]:
        assert h(item["message"]) == transcript
        _check_signature(item, _signed(item["signer"]))


def test_spec_roster_and_classifier_signatures_follow_from_their_content() -> None:
    roster = SIGNATURES["roster"]
    preimage = roster["format"].encode()
    for entry in roster["clients"]:
        preimage += b"".join(
            _p(part) for part in (entry["id"].encode(), entry["name"].encode(), h(entry["public_key"]))
        )
    coordinator = roster["coordinator"]
    preimage += b"\xffcoordinator" + b"".join(
        _p(part)
        for part in (coordinator["id"].encode(), coordinator["name"].encode(), h(coordinator["public_key"]))
    )
    assert h(roster["digest"]) == hashlib.sha256(preimage).digest()
    assert {item["signer"] for item in roster["cosignatures"]} == set(CLIENTS)
    for item in roster["cosignatures"]:
        assert h(item["message"]) == ROSTER_COSIGNATURE + h(roster["digest"])
        _check_signature(item, _signed(item["signer"]))
    classifier = SIGNATURES["classifier"]
    content = json.dumps(classifier["document"], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert h(classifier["content_sha256"]) == hashlib.sha256(content.encode()).digest()
    message = CLASSIFIER_SIGNATURE + classifier["signer"].encode() + b"\x00" + h(classifier["content_sha256"])
    assert h(classifier["message"]) == message
    assert h(classifier["public_key"]) == h(coordinator["public_key"])
    _check_signature(classifier, _ed25519(h(classifier["private_key"])))


# --- the code reproduces the file ------------------------------------------------------------------


class _Scripted:
    """R0's three draws (encryption key, mask key, seed) from the file, then a deterministic stream."""

    def __init__(self, client: dict) -> None:
        self.script = [h(client[k]) for k in ("encryption_private_key", "mask_private_key", "self_mask_seed")]
        self.rest = DeterministicRandomSource(b"secure-afl test vector/fallback/" + client["id"].encode())

    def token_bytes(self, n: int) -> bytes:
        return self.script.pop(0) if self.script else self.rest.token_bytes(n)


def _identity(private_hex: str) -> IdentityKey:
    return IdentityKey(Ed25519PrivateKey.from_private_bytes(h(private_hex)))


def _entry(item: dict) -> RosterEntry:
    return RosterEntry(item["id"], item["name"], h(item["public_key"]))


def _roster() -> Roster:
    data = SIGNATURES["roster"]
    return Roster((_entry(item) for item in data["clients"]), coordinator=_entry(data["coordinator"]))


def _config() -> SessionConfig:
    groups = tuple(
        GroupSpec(g["name"], tuple(TensorSpec(t["name"], t["length"]) for t in g["tensors"]))
        for g in SESSION["groups"]
    )
    return SessionConfig(SESSION_ID, SESSION["threshold"], SESSION["min_group_size"], FRAC_BITS, groups)


def test_code_a_whole_session_sends_the_vectors_messages_and_sum() -> None:
    """Three ClientSessions and a ServerSession, R0..R4 over the wire codec, from the file's keys,
    seeds and inputs: every advertisement, encrypted share, masked input and R3 signature, and the
    server's sum, are the file's."""
    roster, config = _roster(), _config()
    (group,) = SESSION["groups"]
    (tensor,) = group["tensors"]
    clients = {
        cid: ClientSession(
            cid,
            _identity(client["identity_private_key"]),
            roster,
            {group["name"]: {tensor["name"]: np.array(client["input"])}},
            min_threshold=SESSION["threshold"],
            min_group_size=SESSION["min_group_size"],
            random=_Scripted(client),
            policy=ClientPolicy.simulator(),
        )
        for cid, client in CLIENTS.items()
    }
    server = ServerSession(roster, config)
    sent: dict[type, dict[str, object]] = {}
    requests = dict.fromkeys(clients, server.start())
    for _ in range(5):
        for cid, request in sorted(requests.items()):
            for reply in clients[cid].receive(wire(request)):
                sent.setdefault(type(reply), {})[cid] = reply
                server.receive(wire(reply))
        requests = server.next_round()
    for item in SIGNATURES["advertisement"]:
        advert = sent[AdvertiseKeys][item["signer"]]
        client = CLIENTS[item["signer"]]
        assert advert.encryption_public_key == h(client["encryption_public_key"])
        assert advert.mask_public_key == h(client["mask_public_key"])
        assert advert.self_mask_commitment == h(client["self_mask_commitment"])
        assert advert.config_digest == h(SESSION["config_digest"])
        assert advert.signature == h(item["signature"])
    relayed = {
        (s.sender, s.recipient): s for share_keys in sent[ShareKeys].values() for s in share_keys.shares
    }
    assert len(relayed) == len(VECTORS["shares"])
    for item in VECTORS["shares"]:
        share = relayed[(item["sender"], item["recipient"])]
        assert (share.nonce, share.ciphertext) == (h(item["nonce"]), h(item["ciphertext"]))
    for item in VECTORS["masked_inputs"]:
        (masked,) = sent[MaskedInput][item["client"]].tensors
        assert (masked.group, masked.tensor) == (item["group"], item["tensor"])
        assert [f"{w:016x}" for w in np.frombuffer(masked.data, dtype="<u8")] == item["masked"]
    for item in SIGNATURES["consistency"]:
        assert sent[ConsistencyResponse][item["signer"]].signature == h(item["signature"])
    result = server.result()
    assert list(result.survivors) == VECTORS["sum"]["survivors"]
    total = result.groups[group["name"]].sums[tensor["name"]]
    assert [f"{w:016x}" for w in total] == VECTORS["sum"]["words"]
    assert encoding.decode(total, frac_bits=FRAC_BITS).tolist() == VECTORS["sum"]["decoded"]


def test_code_derives_the_vectors_keys_and_keystreams() -> None:
    for item in VECTORS["shares"]:
        sender, recipient = item["sender"], item["recipient"]
        own = X25519PrivateKey.from_private_bytes(h(CLIENTS[sender]["encryption_private_key"]))
        assert crypto.x25519_public_bytes(own) == h(CLIENTS[sender]["encryption_public_key"])
        secret = crypto.x25519_shared_secret(own, h(CLIENTS[recipient]["encryption_public_key"]))
        assert secret == h(item["shared_secret"])
        key = crypto.share_encryption_key(secret, SESSION_ID, sender, recipient)
        assert key == h(item["share_key"])
        associated = crypto.share_associated_data(SESSION_ID, sender, recipient)
        assert associated == h(item["associated_data"])
        assert tagged_fields(crypto.SHARE_KEY_DOMAIN, SESSION_ID, sender, recipient) == h(item["hkdf_info"])
        plaintext = crypto.decrypt_share(key, h(item["nonce"]), h(item["ciphertext"]), associated, sender)
        assert plaintext == h(item["plaintext"])
    (group,) = SESSION["groups"]
    (tensor,) = group["tensors"]
    g, t = group["name"], tensor["name"]
    offset = VECTORS["keystream_offset"]
    for mask in MASKS:
        ikm = h(mask["ikm"])
        if mask["kind"] == "self":
            (cid,) = mask["clients"]
            info = tagged_fields(prg.SELF_MASK_DOMAIN, SESSION_ID, g, t, cid)
            key = prg.self_mask_key(ikm, SESSION_ID, g, t, cid)
            via_prk = prg.self_mask_key_from_prk(prg.key_prk(ikm), SESSION_ID, g, t, cid)
        else:
            low, high = mask["clients"]
            own = X25519PrivateKey.from_private_bytes(h(CLIENTS[high]["mask_private_key"]))
            assert crypto.x25519_shared_secret(own, h(CLIENTS[low]["mask_public_key"])) == ikm
            info = tagged_fields(prg.PAIR_MASK_DOMAIN, SESSION_ID, g, t, low, high)
            key = prg.pair_mask_key(ikm, SESSION_ID, g, t, high, low)  # either order: the same key
            via_prk = prg.pair_mask_key_from_prk(prg.key_prk(ikm), SESSION_ID, g, t, low, high)
            assert prg.pair_sign(low, high) == 1 and prg.pair_sign(high, low) == -1
        assert key == via_prk == h(mask["key"]) and info == h(mask["hkdf_info"])
        count = len(mask["words"])
        assert [f"{w:016x}" for w in prg.mask_words(key, count)] == mask["words"]
        assert [f"{w:016x}" for w in prg.mask_words(key, offset + count)[offset:]] == mask["words_at_offset"]
    for client in CLIENTS.values():
        seed = h(client["self_mask_seed"])
        assert binding.self_mask_commitment(seed, SESSION_ID, client["id"]) == h(
            client["self_mask_commitment"]
        )
    assert binding.config_digest(_config()) == h(SESSION["config_digest"])


@pytest.mark.parametrize("case", VECTORS["encoding"], ids=lambda case: case["value_hex"])
def test_code_encodes_the_vectors_values(case: dict) -> None:
    (word,) = encoding.encode(np.array([case["value"]]), tensor="x", frac_bits=FRAC_BITS, group_size=1)
    assert f"{int(word):016x}" == case["word"]


def test_code_signs_the_vectors_roster_and_classifier() -> None:
    roster = _roster()
    assert roster.digest() == h(SIGNATURES["roster"]["digest"])
    assert cosign.message(roster) == h(SIGNATURES["roster"]["cosignatures"][0]["message"])
    cosignatures = {}
    for item in SIGNATURES["roster"]["cosignatures"]:
        signer, signature = cosign.sign_roster(
            roster, _identity(CLIENTS[item["signer"]]["identity_private_key"])
        )
        assert (signer, signature) == (item["signer"], h(item["signature"]))
        cosignatures[signer] = signature
    assert cosign.check_cosignatures(roster, cosignatures).complete
    classifier = SIGNATURES["classifier"]
    coordinator = _identity(classifier["private_key"])
    signature = ClassifierSigner(classifier["signer"], coordinator).sign(classifier["document"])
    assert base64.b64decode(signature["value"]) == h(classifier["signature"])
    assert content_digest(classifier["document"]) == classifier["content_sha256"]
    document = {
        **classifier["document"],
        "content_sha256": classifier["content_sha256"],
        "signature": signature,
    }
    assert verify_signature(document, roster) == classifier["signer"]
