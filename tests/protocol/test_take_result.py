"""The server hands its sums over (``take_result``) and they are decoded in their own memory:
the same float64 sums, bit for bit, with no second array of each sum's size."""

from __future__ import annotations

import numpy as np
import pytest

from secure_afl.aggregation.backend import MaskingBackend
from secure_afl.aggregation.layout import Layout
from secure_afl.core import encoding
from secure_afl.core.errors import LocalProtocolError

from .helpers import make_federation, play


def test_decode_in_place_gives_decode_bit_for_bit_in_the_same_memory() -> None:
    rng = np.random.default_rng(3)
    # more than one chunk, the extremes of int64 and a partial last chunk
    words = rng.integers(0, 2**64, size=3 * (1 << 15) + 17, dtype=np.uint64)
    words[:2] = (2**63 - 1, 2**63)
    for frac_bits in (0, 20, 32, 52):
        expected = encoding.decode(words, frac_bits=frac_bits)
        own = words.copy()
        decoded = encoding.decode_in_place(own, frac_bits=frac_bits)
        assert decoded.dtype == np.float64 and np.shares_memory(decoded, own)
        assert decoded.tobytes() == expected.tobytes()


def test_decode_in_place_refuses_what_it_cannot_overwrite() -> None:
    frozen = np.zeros(8, dtype=np.uint64)
    frozen.setflags(write=False)
    with pytest.raises(LocalProtocolError, match="writeable, contiguous"):
        encoding.decode_in_place(frozen)
    with pytest.raises(LocalProtocolError, match="writeable, contiguous"):
        encoding.decode_in_place(np.zeros(8, dtype=np.uint64)[::2])
    with pytest.raises(LocalProtocolError, match="1-D uint64"):
        encoding.decode_in_place(np.zeros(8))
    with pytest.raises(LocalProtocolError, match="frac_bits"):
        encoding.decode_in_place(np.zeros(8, dtype=np.uint64), frac_bits=60)


def test_take_result_hands_the_sums_over_once() -> None:
    fed = make_federation(4, {"all": ("c0", "c1", "c2", "c3"), "pair": ("c0", "c1")})
    play(fed, drops={"R2": {"c3"}})
    kept = {g: {t: w.copy() for t, w in s.sums.items()} for g, s in fed.server.result().groups.items()}
    taken = fed.server.take_result()
    for group, tensors in kept.items():
        for name, words in tensors.items():
            got = taken.groups[group].sums[name]
            assert np.array_equal(got, words)
            assert got.flags.writeable and got.flags.owndata  # the caller's own
    with pytest.raises(LocalProtocolError, match="handed over"):
        fed.server.result()
    with pytest.raises(LocalProtocolError, match="handed over"):
        fed.server.take_result()


def test_the_masking_outcome_decodes_the_handed_over_sums_as_decode_does() -> None:
    lengths = {"x": 5, "y": 3}
    fed = make_federation(4, {"all": ("c0", "c1", "c2", "c3"), "pair": ("c0", "c1")}, lengths=lengths)
    play(fed, drops={"R3": {"c2"}})
    expected = {
        g: {t: encoding.decode(w, frac_bits=32) for t, w in s.sums.items()}
        for g, s in fed.server.result().groups.items()
    }
    layout = Layout(
        groups={"all": lengths, "pair": lengths},
        shapes={t: (n,) for t, n in lengths.items()},
        symmetric=frozenset(),
    )
    outcome = MaskingBackend(threshold=3).outcome(fed.server, layout)
    assert outcome.sums.keys() == expected.keys()
    for group, tensors in expected.items():
        for name, values in tensors.items():
            assert outcome.sums[group][name].tobytes() == values.tobytes()
    assert outcome.survivors["all"] == ("c0", "c1", "c2", "c3")  # c2 sent its input before R3
