"""The classifier check's sum (secure_afl/protocol/verify.py): masks cancel only in the full sum, the
challenge is the transcript's, and nothing but a participant's own key signs its vector."""

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
    reveals = {cid: secrets[cid].nonce for cid in IDS}
    return keys, secrets, commitments, reveals


def test_the_masked_values_add_to_the_values_and_no_proper_subset_does() -> None:
    keys, secrets, commitments, reveals = _participants()
    seed = pv.transcript(b"file digest", commitments, reveals)
    values = {cid: [float(i) + 0.25, -3.5 * i] for i, cid in enumerate(IDS)}
    masked = {
        cid: pv.sign_masked(
            cid, pv.mask(values[cid], cid, secrets[cid], commitments, seed), seed, keys[cid].private_key
        )
        for cid in IDS
    }
    public = {cid: k.public_key for cid, k in keys.items()}
    total = pv.unmask_sum(masked, commitments, public, seed, masked["a"])
    assert total == [sum(v[0] for v in values.values()), sum(v[1] for v in values.values())]
    partial = sum(masked[c].words[0] for c in IDS[:3]) % pv.MODULUS  # without d's vector
    assert abs(pv.from_fixed(partial)) > 2.0**90
    other = pv.transcript(b"another file", commitments, reveals)  # another transcript: other masks
    assert pv.mask(values["a"], "a", secrets["a"], commitments, other) != masked["a"].words
    assert not np.array_equal(pv.challenge(seed, 8), pv.challenge(other, 8))
    assert np.all(np.abs(pv.challenge(seed, 1000)) <= 1.0)


def test_a_commitment_reveal_or_vector_the_relay_changed_is_refused() -> None:
    keys, secrets, commitments, reveals = _participants()
    public = {cid: k.public_key for cid, k in keys.items()}
    pv.check_commitments(commitments, IDS, public, commitments["a"])
    with pytest.raises(pv.VerificationError, match="participants are"):
        pv.check_commitments(
            {c: x for c, x in commitments.items() if c != "d"}, IDS, public, commitments["a"]
        )
    forged = pv.commit(secrets["b"], "b", SESSION, keys["c"].private_key)  # signed by another key
    with pytest.raises(pv.VerificationError, match="not signed by its roster key"):
        pv.check_commitments({**commitments, "b": forged}, IDS, public, commitments["a"])
    with pytest.raises(pv.VerificationError, match="does not open its commitment"):
        pv.check_reveals(commitments, {**reveals, "c": bytes(32)})
