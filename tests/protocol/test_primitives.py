"""Fixed-point encoding, Shamir sharing, masks and randomness."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secure_afl.core import encoding
from secure_afl.core.errors import EncodingOverflowError, LocalProtocolError, NonFiniteValueError
from secure_afl.core.randomness import DeterministicRandomSource, OsRandomSource, RandomSource
from secure_afl.protocol import prg, shamir
from secure_afl.protocol.fields import tagged_fields

# --- fixed-point encoding -------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False), min_size=1, max_size=20),
    st.integers(min_value=0, max_value=40),
)
def test_encoding_error_is_at_most_half_a_unit(values, frac_bits) -> None:
    x = np.array(values)
    decoded = encoding.decode(
        encoding.encode(x, tensor="t", frac_bits=frac_bits, group_size=8), frac_bits=frac_bits
    )
    # Half a unit in the last place of the fixed point, plus float64's own relative rounding.
    assert np.all(np.abs(decoded - x) <= 2.0 ** -(frac_bits + 1) + 4 * np.finfo(float).eps * np.abs(x))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.floats(-1e5, 1e5), min_size=4, max_size=4), min_size=1, max_size=8))
def test_sum_of_encodings_decodes_to_the_sum_within_the_bound(rows) -> None:
    arrays = [np.array(r) for r in rows]
    words = sum(encoding.encode(a, tensor="t", group_size=len(arrays)) for a in arrays)
    bound = encoding.rounding_error_bound(32, len(arrays))
    exact = np.sum(arrays, axis=0)
    assert np.all(np.abs(encoding.decode(words) - exact) <= bound + 1e-9 * np.abs(exact).max())


def test_negative_values_use_twos_complement() -> None:
    words = encoding.encode(np.array([-1.0, 1.0, -0.5]), tensor="t", group_size=1)
    assert words.dtype == np.uint64
    assert int(words[0]) == 2**64 - 2**32
    np.testing.assert_array_equal(encoding.decode(words), [-1.0, 1.0, -0.5])


def test_rounding_is_half_to_even() -> None:
    words = encoding.encode(np.array([0.5, 1.5, 2.5]), tensor="t", frac_bits=0, group_size=1)
    assert [int(w) for w in words] == [0, 2, 2]


def test_values_at_the_bound_cannot_wrap_the_group_sum() -> None:
    group_size = 8
    bound = encoding.encoding_bound(20, group_size)
    x = np.array([bound * (1 - 1e-12), -bound * (1 - 1e-12)])
    words = sum(
        encoding.encode(x, tensor="t", frac_bits=20, group_size=group_size) for _ in range(group_size)
    )
    total = encoding.decode(words, frac_bits=20)
    assert total[0] > 0 > total[1]
    assert math.isclose(total[0], group_size * x[0], rel_tol=1e-9)


def test_overflow_names_the_tensor_and_the_bound() -> None:
    bound = encoding.encoding_bound(32, 4)
    with pytest.raises(EncodingOverflowError) as info:
        encoding.encode(np.array([0.0, 3 * bound]), tensor="class3/gram", group_size=4)
    message = str(info.value)
    assert "class3/gram" in message and f"{bound:.6g}" in message
    assert "fewer fractional bits" in message and "scale" in message
    assert info.value.tensor == "class3/gram" and info.value.bound == bound


@settings(max_examples=300, deadline=None)
@given(
    st.integers(min_value=0, max_value=52),
    st.integers(min_value=1, max_value=64),
    st.floats(min_value=0.999999, max_value=1.000001),
    st.booleans(),
)
def test_check_encodable_refuses_exactly_what_encode_refuses(frac_bits, group_size, scale, negative) -> None:
    x = np.array([(-1 if negative else 1) * encoding.encoding_bound(frac_bits, group_size) * scale, 0.5])
    try:
        encoding.encode(x, tensor="t", frac_bits=frac_bits, group_size=group_size)
    except EncodingOverflowError:
        with pytest.raises(EncodingOverflowError):
            encoding.check_encodable(x, tensor="t", frac_bits=frac_bits, group_size=group_size)
    else:
        encoding.check_encodable(x, tensor="t", frac_bits=frac_bits, group_size=group_size)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_rejected(bad) -> None:
    with pytest.raises(NonFiniteValueError, match="b_c"):
        encoding.encode(np.array([1.0, bad]), tensor="b_c", group_size=1)


@pytest.mark.parametrize("array", [np.zeros(3, dtype=np.float32), np.zeros((2, 2)), [1.0, 2.0]])
def test_wrong_dtype_or_shape_is_a_local_error(array) -> None:
    with pytest.raises(LocalProtocolError):
        encoding.encode(array, tensor="t", group_size=1)  # type: ignore[arg-type]


def test_symmetric_matrices_travel_as_upper_triangle() -> None:
    rng = np.random.default_rng(0)
    a = rng.normal(size=(7, 7))
    sym = a + a.T
    packed = encoding.pack_symmetric(sym)
    assert packed.shape == (encoding.upper_triangle_length(7),) == (28,)
    np.testing.assert_array_equal(encoding.unpack_symmetric(packed), sym)
    with pytest.raises(LocalProtocolError):
        encoding.unpack_symmetric(np.zeros(27))
    with pytest.raises(LocalProtocolError):
        encoding.pack_symmetric(np.zeros((2, 3)))


@pytest.mark.parametrize("d", [0, 1, 255, 256, 257, 600])
@pytest.mark.parametrize("dtype", [np.float64, np.uint64])
def test_unpacking_mirrors_every_block_of_the_triangle(d: int, dtype: type) -> None:
    """Sizes around the mirror's 256-row blocks: every entry below the diagonal is its transpose's,
    whichever block it falls in (a skipped or misplaced block leaves garbage from np.empty)."""
    rng = np.random.default_rng(d)
    upper = np.triu(rng.integers(1, 2**40, size=(d, d)).astype(dtype))
    full = upper + np.triu(upper, 1).T
    unpacked = encoding.unpack_symmetric(encoding.pack_symmetric(full))
    assert unpacked.dtype == dtype
    np.testing.assert_array_equal(unpacked, full)


# --- Shamir ---------------------------------------------------------------------------------------

secrets = st.integers(min_value=0, max_value=2**256 - 1)


@settings(max_examples=100, deadline=None)
@given(secrets, st.integers(min_value=1, max_value=8), st.integers(min_value=0, max_value=4), st.data())
def test_any_t_shares_reconstruct(secret, threshold, extra, data) -> None:
    n = threshold + extra
    shares = shamir.split(secret, threshold, list(range(1, n + 1)), DeterministicRandomSource(b"shamir"))
    subset = data.draw(st.permutations(shares)).copy()[:threshold]
    assert shamir.reconstruct(subset) == secret


@settings(max_examples=100, deadline=None)
@given(secrets, secrets, st.integers(min_value=2, max_value=8), st.binary(max_size=8))
def test_fewer_than_t_shares_are_consistent_with_every_secret(secret, other, threshold, seed) -> None:
    shares = shamir.split(secret, threshold, list(range(1, threshold + 1)), DeterministicRandomSource(seed))
    known = shares[: threshold - 1]
    # A degree t-1 polynomial through (0, other) and the t-1 known shares always exists: the known
    # shares could equally have come from a sharing of ``other``.
    completion = shamir.Share(threshold, shamir.interpolate([shamir.Share(0, other), *known], threshold))
    assert shamir.reconstruct([*known, completion]) == other
    if secret != other:
        # Interpolating the t-1 shares alone does not give the secret (except by chance ~2^-521).
        assert shamir.reconstruct(known) != secret or threshold == 1


def test_share_values_are_field_elements_and_fixed_size() -> None:
    shares = shamir.split(2**256 - 1, 3, [1, 2, 3, 4], OsRandomSource())
    for share in shares:
        assert 0 <= share.y < shamir.PRIME
        assert len(shamir.value_to_bytes(share.y)) == shamir.VALUE_BYTES


def test_split_rejects_bad_arguments() -> None:
    random = DeterministicRandomSource(b"x")
    with pytest.raises(LocalProtocolError):
        shamir.split(1, 3, [1, 2], random)
    with pytest.raises(LocalProtocolError):
        shamir.split(1, 2, [1, 1, 2], random)
    with pytest.raises(LocalProtocolError):
        shamir.split(1, 2, [0, 1], random)
    with pytest.raises(LocalProtocolError):
        shamir.split(shamir.PRIME, 2, [1, 2], random)


# --- masks ----------------------------------------------------------------------------------------


def test_pairwise_masks_cancel() -> None:
    secret = bytes(range(32))
    acc = np.arange(100, dtype=np.uint64)
    for own, peer in (("alice", "bob"), ("bob", "alice")):
        key = prg.pair_mask_key(secret, b"s" * 32, "class1", "gram", own, peer)
        prg.add_mask(acc, key, prg.pair_sign(own, peer))
    np.testing.assert_array_equal(acc, np.arange(100, dtype=np.uint64))


@given(
    n_words=st.integers(0, 300),
    signs=st.lists(st.sampled_from((1, -1)), max_size=6),
    seed=st.binary(min_size=32, max_size=32),
)
@settings(max_examples=50, deadline=None)
def test_add_masks_adds_exactly_the_keystreams_of_mask_words(
    n_words: int, signs: list[int], seed: bytes
) -> None:
    # add_masks reuses one buffer for every key: the words added must still be each key's own.
    start = np.arange(n_words, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    keys = [prg.pair_mask_key(seed, b"s" * 32, "g", f"t{k}", "a", "b") for k in range(len(signs))]
    expected = start.copy()
    for key, sign in zip(keys, signs, strict=True):
        mask = prg.mask_words(key, n_words)
        expected = expected + mask if sign > 0 else expected - mask
    default = prg.CHUNK_WORDS
    try:
        for chunk in (7, 64, default):  # chunk boundaries inside, at and past the end of the array
            prg.CHUNK_WORDS = chunk
            got = start.copy()
            prg.add_masks(got, zip(keys, signs, strict=True))
            np.testing.assert_array_equal(got, expected)
    finally:
        prg.CHUNK_WORDS = default
    with pytest.raises(ValueError, match="uint64"):
        prg.add_masks(start.astype(np.int64), zip(keys, signs, strict=True))


def test_mask_keys_are_domain_separated() -> None:
    secret = bytes(32)
    base = ("s" * 32).encode(), "g", "t", "a", "b"
    keys = {
        prg.pair_mask_key(secret, *base),
        prg.pair_mask_key(secret, b"S" * 32, "g", "t", "a", "b"),
        prg.pair_mask_key(secret, base[0], "h", "t", "a", "b"),
        prg.pair_mask_key(secret, base[0], "g", "u", "a", "b"),
        prg.pair_mask_key(secret, base[0], "g", "t", "a", "c"),
        prg.self_mask_key(secret, base[0], "g", "t", "a"),
    }
    assert len(keys) == 6
    # Length prefixes: moving a boundary between fields changes the key.
    assert prg.pair_mask_key(secret, base[0], "gt", "", "a", "b") != prg.pair_mask_key(
        secret, base[0], "g", "t", "a", "b"
    )
    assert tagged_fields(b"d", "ab", "c") != tagged_fields(b"d", "a", "bc")


def test_mask_words_are_balanced() -> None:
    words = prg.mask_words(bytes(32), 1 << 14)
    bits = np.unpackbits(words.view(np.uint8))
    assert abs(bits.mean() - 0.5) < 0.005
    assert not words.flags.writeable


def test_pair_sign() -> None:
    assert prg.pair_sign("a", "b") == 1 and prg.pair_sign("b", "a") == -1
    with pytest.raises(ValueError):
        prg.pair_sign("a", "a")


# --- randomness -----------------------------------------------------------------------------------


def test_deterministic_random_source_is_reproducible_and_advances() -> None:
    a, b = DeterministicRandomSource(b"seed"), DeterministicRandomSource(b"seed")
    first = a.token_bytes(32)
    assert first == b.token_bytes(32)
    assert a.token_bytes(32) != first
    assert DeterministicRandomSource(b"other").token_bytes(32) != first
    assert isinstance(a, RandomSource) and isinstance(OsRandomSource(), RandomSource)
    assert len(OsRandomSource().token_bytes(17)) == 17
