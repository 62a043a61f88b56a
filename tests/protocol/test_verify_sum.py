"""The classifier check's sum (secure_afl/protocol/verify.py): masks cancel only in the full sum over
one transcript, and nothing but a participant's own key signs its commitment and its vector."""

from __future__ import annotations

import numpy as np
import pytest

from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.keys import IdentityKey
from secure_afl.protocol import verify as pv

IDS = ("a", "b", "c", "d")
SESSION = bytes(range(32))


def _participants():
    keys = {
        cid: IdentityKey.generate(DeterministicRandomSource(bytes([i]) * 32)) for i, cid in enumerate(IDS)
    }
    secrets = {
        cid: pv.VerifySecret.draw(DeterministicRandomSource(bytes([i + 9]) * 32)) for i, cid in enumerate(IDS)
    }
    commitments = {cid: pv.commit(secrets[cid], cid, SESSION, keys[cid].private_key) for cid in IDS}
    return keys, secrets, commitments


def _masked(keys, secrets, commitments, seed, values):
    return {
        cid: pv.sign_masked(
            cid, pv.mask(values[cid], cid, secrets[cid], commitments, seed), seed, keys[cid].private_key
        )
        for cid in values
    }


def test_the_masked_values_add_to_the_values_and_no_proper_subset_does() -> None:
    keys, secrets, commitments = _participants()
    seed = pv.transcript(b"file digest", commitments)
    values = {cid: np.array([float(i) + 0.25, -3.5 * i, 2.0**-100 * i]) for i, cid in enumerate(IDS)}
    masked = _masked(keys, secrets, commitments, seed, values)
    public = {cid: k.public_key for cid, k in keys.items()}
    ids, data = pv.pack_relay({cid: m.to_bytes() for cid, m in masked.items()})
    relayed = pv.unpack_relay(ids, data, 3)
    assert relayed == masked
    total = pv.unmask_sum(relayed, commitments, public, seed, masked["a"])
    assert total.tolist() == np.sum(list(values.values()), axis=0).tolist()  # exact: 128 fractional bits
    partial = sum(masked[c].words[0] for c in IDS[:3]) % pv.MODULUS  # without d's vector
    assert abs(pv.from_fixed(partial)) > 2.0**90
    other = pv.transcript(b"another file", commitments)  # another transcript: other masks
    assert pv.mask(values["a"], "a", secrets["a"], commitments, other) != masked["a"].data
    # Vectors masked for two files: the pads of a pair over two transcripts cancel nowhere.
    mixed = {**masked, "a": _masked(keys, secrets, commitments, other, {"a": values["a"]})["a"]}
    mixed_sum = sum(mixed[c].words[0] for c in IDS) % pv.MODULUS
    assert abs(pv.from_fixed(mixed_sum)) > 2.0**90


def test_a_commitment_or_vector_the_relay_changed_is_refused() -> None:
    keys, secrets, commitments = _participants()
    public = {cid: k.public_key for cid, k in keys.items()}
    pv.check_commitments(commitments, IDS, public, commitments["a"])
    with pytest.raises(pv.VerificationError, match="participants are"):
        pv.check_commitments(
            {c: x for c, x in commitments.items() if c != "d"}, IDS, public, commitments["a"]
        )
    forged = pv.commit(secrets["b"], "b", SESSION, keys["c"].private_key)  # signed by another key
    with pytest.raises(pv.VerificationError, match="not signed by its roster key"):
        pv.check_commitments({**commitments, "b": forged}, IDS, public, commitments["a"])
    seed = pv.transcript(b"file digest", commitments)
    masked = _masked(keys, secrets, commitments, seed, {cid: np.ones(2) for cid in IDS})
    replayed = _masked(keys, secrets, commitments, pv.transcript(b"earlier", commitments), {"b": np.ones(2)})
    with pytest.raises(pv.VerificationError, match="not signed by its roster key over this check"):
        pv.unmask_sum({**masked, "b": replayed["b"]}, commitments, public, seed, masked["a"])
    with pytest.raises(pv.VerificationError, match="cannot be formed without every one"):
        pv.unmask_sum({c: m for c, m in masked.items() if c != "c"}, commitments, public, seed, masked["a"])
    ids, data = pv.pack_relay({cid: m.to_bytes() for cid, m in masked.items()})
    with pytest.raises(pv.VerificationError, match="not 4 distinct values"):
        pv.unpack_relay(ids, data[:-1], 2)  # truncated
    with pytest.raises(pv.VerificationError, match=r"wrong lengths|two hex fields"):
        pv.Commitment.from_text("a", SESSION, "00.11")


def test_the_mask_key_comes_from_the_seed_and_the_session() -> None:
    seed = bytes(range(32))
    one = pv.VerifySecret.from_seed(seed, "a", SESSION)
    assert one == pv.VerifySecret.from_seed(seed, "a", SESSION)
    assert one != pv.VerifySecret.from_seed(seed, "a", bytes(32))
    assert one != pv.VerifySecret.from_seed(bytes(32), "a", SESSION)
    with pytest.raises(pv.VerificationError, match="32 fresh random bytes"):
        pv.VerifySecret.from_seed(seed[:16], "a", SESSION)


def test_the_slot_sums_are_word_wise_sums_mod_2_256() -> None:
    """The masks are added as one integer with a word per slot: extreme words (0, 1, 2^256 − 1) and
    negations carry into their own slot's guard only, never into the next word."""
    edge = [0, 1, pv.MODULUS - 1, pv.MODULUS // 2, 12345]
    rng = np.random.default_rng(3)
    vectors = [edge, edge[::-1], [int.from_bytes(rng.bytes(32), "big") for _ in edge]]
    data = [b"".join(w.to_bytes(32, "big") for w in v) for v in vectors]
    total = (
        pv._slots(data[0])
        + pv._slots(data[1], negate=True)
        + pv._slots(data[2])
        + pv._slots(data[0], negate=True)
    )
    got = pv.MaskedValue("", pv._words(total, len(edge)), b"").words
    expected = tuple((a - b + c - a) % pv.MODULUS for a, b, c in zip(*vectors, strict=True))
    assert got == expected


def test_the_fixed_point_words_are_those_of_python_integers() -> None:
    """to_fixed (numpy over 64-bit limbs) gives int(v·2^128) mod 2^256 bit for bit, truncation and
    signs included; decode_words reads them back, its exact tail correctly rounded."""
    rng = np.random.default_rng(0)
    edges = [
        0.0,
        -0.0,
        1e-40,
        -1e-40,
        2.0**-128,
        -(2.0**-128),
        2.0**-129,
        2.0**125,
        -(2.0**125),
        -1.5,
        2.0**-75,
    ]
    values = np.concatenate([rng.standard_normal(500) * 10.0 ** rng.integers(-45, 37, 500), edges])
    reference = [int(v * 2.0**128) % pv.MODULUS for v in values.tolist()]
    assert pv.to_fixed(values) == b"".join(w.to_bytes(32, "big") for w in reference)
    exact = [pv.from_fixed(w) for w in reference]
    assert pv.decode_words(pv.to_fixed(values), exact=len(values)).tolist() == exact
    assert np.allclose(pv.decode_words(pv.to_fixed(values)), exact, rtol=2.0**-50, atol=0.0)
    with pytest.raises(pv.VerificationError, match="not finite or too large"):
        pv.to_fixed([2.0**126])


def test_another_releases_commitment_is_refused() -> None:
    """A node of an earlier release signs its commitment under that release's domain: the check stops
    at the commitments and says so, before any sum that would read as a tampered classifier."""
    from secure_afl.protocol import crypto

    keys, secrets, commitments = _participants()
    public = {cid: k.public_key for cid, k in keys.items()}
    key = secrets["b"].public_key()
    old = crypto.sign(keys["b"].private_key, b"secure-afl/v2/verify-commit", SESSION, "b", key)
    earlier = pv.Commitment("b", SESSION, key, old)
    with pytest.raises(pv.VerificationError, match=f"the check's protocol {pv.VERSION}.*one release"):
        pv.check_commitments({**commitments, "b": earlier}, IDS, public, commitments["a"])


def test_the_pads_are_the_session_masks_prg_under_the_pair_key() -> None:
    """One PRG for every mask (protocol/prg.py, AES-256-CTR): a pad is the keystream of its pair's key,
    added by the lower id and subtracted by the higher; a word of 0 masked by a pair is that word."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    from secure_afl.protocol import crypto, prg
    from secure_afl.protocol.fields import tagged_fields

    _keys, secrets, commitments = _participants()
    pair = {c: commitments[c] for c in ("a", "b")}
    seed = pv.transcript(b"file digest", pair)
    shared = crypto.x25519_shared_secret(X25519PrivateKey.from_private_bytes(secrets["a"].key), pair["b"].key)
    info = tagged_fields(pv.MASK_DOMAIN, seed, "a", "b")
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)
    pad = prg.keystream(key, 2 * pv.WORD_BYTES)
    assert pv.mask(np.zeros(2), "a", secrets["a"], pair, seed) == pad
    low = [int.from_bytes(pad[i : i + 32], "big") for i in (0, 32)]
    high = pv.mask(np.zeros(2), "b", secrets["b"], pair, seed)
    assert [int.from_bytes(high[i : i + 32], "big") for i in (0, 32)] == [(-w) % pv.MODULUS for w in low]
