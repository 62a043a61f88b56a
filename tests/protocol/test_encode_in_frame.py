"""Words encoded where they are masked (``prg.add_masks(values=...)``): the words of ``encode``
plus the masks, bit for bit, into aligned and unaligned places, without an array of the words."""

from __future__ import annotations

import numpy as np
import pytest

from secure_afl.core import encoding
from secure_afl.protocol import prg


@pytest.mark.parametrize("n", [0, 1, 5, prg.CHUNK_WORDS, 2 * prg.CHUNK_WORDS + 3])
@pytest.mark.parametrize("offset", [0, 3])
@pytest.mark.parametrize("n_keys", [0, 1, 3])
def test_values_encoded_in_place_give_base_plus_masks(n: int, offset: int, n_keys: int) -> None:
    rng = np.random.default_rng(n + offset)
    values = rng.standard_normal(n) * 1e3
    keys = [(bytes([k + 1]) * 32, 1 if k % 2 == 0 else -1) for k in range(n_keys)]
    expected = np.empty(n, dtype=np.uint64)
    prg.add_masks(expected, keys, base=encoding.encode(values, tensor="x", frac_bits=20, group_size=3))
    if n_keys == 0:
        np.copyto(expected, encoding.encode(values, tensor="x", frac_bits=20, group_size=3))
    raw = bytearray(8 * n + offset)  # a tensor's place in a message frame need not be aligned
    place = np.frombuffer(raw, dtype="<u8", count=n, offset=offset)
    prg.add_masks(place, keys, values=values, frac_bits=20)
    assert place.tobytes() == expected.tobytes()


def test_encode_into_writes_encode_s_words() -> None:
    values = np.random.default_rng(1).standard_normal(70_001) * 50
    out = np.empty(values.shape[0], dtype=np.uint64)
    encoding.encode_into(values, out, frac_bits=32, buffer=np.empty(1000))
    assert out.tobytes() == encoding.encode(values, tensor="x", group_size=8).tobytes()


def test_values_and_base_are_not_both_taken() -> None:
    accumulator = np.zeros(4, dtype=np.uint64)
    with pytest.raises(ValueError, match="no base beside them"):
        prg.add_masks(accumulator, [], base=np.zeros(4, dtype=np.uint64), values=np.zeros(4))
    with pytest.raises(ValueError, match="float64 array of the accumulator's shape"):
        prg.add_masks(accumulator, [], values=np.zeros(5))
