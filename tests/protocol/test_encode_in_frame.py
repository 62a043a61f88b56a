"""Words encoded where they are masked (``prg.add_masks(values=...)``): the words of ``encode``
plus the masks, bit for bit, into aligned and unaligned places, without an array of the words."""

from __future__ import annotations

import numpy as np
import pytest

from secure_afl.core import encoding
from secure_afl.core.errors import LocalProtocolError, NonFiniteValueError
from secure_afl.protocol import prg
from secure_afl.protocol.state import ClientState

from .helpers import make_federation, play


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


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 1, prg.CHUNK_WORDS + 7])
def test_magnitude_is_max_abs_and_not_finite_exactly_when_an_entry_is_not(bad: float, where: int) -> None:
    values = np.random.default_rng(where).standard_normal(2 * prg.CHUNK_WORDS) * 7
    assert encoding.magnitude(values) == float(np.max(np.abs(values)))
    assert encoding.magnitude(np.zeros(0)) == 0.0
    values[where] = bad
    # NaN anywhere (also where it is neither the first nor the largest) is NaN, ±inf is inf.
    found = encoding.magnitude(values)
    assert np.isnan(found) if np.isnan(bad) else found == np.inf
    with pytest.raises(NonFiniteValueError, match="holds NaN or infinity"):
        encoding.check_float_tensor(values, tensor="t")


@pytest.mark.parametrize(
    "change", ["none", "nan", "inf", "over_bound", "over_bound_negative", "at_bound_edge"]
)
@pytest.mark.parametrize("offset", [0, 3])
def test_checking_each_chunk_as_it_is_encoded_is_the_whole_check(change: str, offset: int) -> None:
    """add_masks(group_size=...) refuses exactly what check_float_tensor and check_encodable refuse
    over the whole values, with their error and message; what it accepts it encodes as before."""
    n, frac_bits, group_size = 2 * prg.CHUNK_WORDS + 5, 20, 3
    values = np.random.default_rng(5).standard_normal(n) * 1e3
    bound = encoding.encoding_bound(frac_bits, group_size)
    at = prg.CHUNK_WORDS + 2  # in the second chunk: the first is encoded and masked before it
    values[at] = {
        "none": values[at],
        "nan": np.nan,
        "inf": np.inf,
        "over_bound": bound * 1.5,
        "over_bound_negative": -bound * 1.5,
        "at_bound_edge": np.nextafter(bound, np.inf),
    }[change]
    expected: BaseException | None = None
    try:
        encoding.check_float_tensor(values, tensor="g/t")
        encoding.check_encodable(values, tensor="g/t", frac_bits=frac_bits, group_size=group_size)
    except LocalProtocolError as exc:
        expected = exc
    assert (expected is None) == (change == "none")
    keys = [(bytes([9]) * 32, 1)]
    place = np.frombuffer(bytearray(8 * n + offset), dtype="<u8", count=n, offset=offset)
    if expected is None:
        prg.add_masks(place, keys, values=values, frac_bits=frac_bits, group_size=group_size, tensor="g/t")
        words = encoding.encode(values, tensor="g/t", frac_bits=frac_bits, group_size=group_size)
        reference = np.empty(n, dtype=np.uint64)
        prg.add_masks(reference, keys, base=words)
        assert place.tobytes() == reference.tobytes()
        return
    with pytest.raises(type(expected)) as info:
        prg.add_masks(place, keys, values=values, frac_bits=frac_bits, group_size=group_size, tensor="g/t")
    assert str(info.value) == str(expected)


def test_a_value_made_non_finite_behind_r1_is_refused_in_r2_before_any_reply() -> None:
    fed = make_federation(3, threshold=2)
    play(fed, until="R1")
    client = fed.clients["c0"]
    client._inputs["all"]["x"][-1] = np.nan  # changed behind the R1 check's back, in the last chunk
    with pytest.raises(NonFiniteValueError, match="all/x"):
        client.receive(fed.requests["c0"])
    assert client.state is ClientState.AWAIT_MASKED_INPUT_REQUEST
    assert client._encoded_reply is None
