"""Fixed-point encoding of float64 tensors in Z_2^64.

A value x is encoded as round(x * 2^frac_bits) (round half to even, ``numpy.rint``) stored as a
two's-complement int64 and reinterpreted as uint64, so that numpy's uint64 arithmetic (which wraps
modulo 2^64) adds encodings exactly.  A sum of encodings is decoded by reinterpreting it as int64
and dividing by 2^frac_bits.

Overflow: for a group of ``group_size`` members every member checks that each |x| is at most
``bound = (2^63 - 1) / 2^frac_bits / group_size``; then the group's integer sum lies in
[-(2^63 - 1), 2^63 - 1] and cannot wrap.  A value above the bound raises
:class:`EncodingOverflowError`; nothing is ever clipped.  NaN and infinity raise
:class:`NonFiniteValueError`.

Rounding bound: each member's encoding differs from its value by at most 2^-(frac_bits+1) per entry,
so a decoded group sum differs from the exact float sum by at most group_size * 2^-(frac_bits+1)
per entry (plus float64's own rounding when the int64 sum is converted back, a relative 2^-53).
With the default 32 fractional bits and 8 members that is 8 * 2^-33 < 1e-9.

Symmetric matrices travel as their upper triangle (row-major, diagonal included): d(d+1)/2 words.
"""

from __future__ import annotations

import math

import numpy as np

from .errors import EncodingOverflowError, LocalProtocolError, NonFiniteValueError

DEFAULT_FRAC_BITS = 32
MAX_FRAC_BITS = 52
_INT63_MAX = 2**63 - 1
_ENCODE_CHUNK = 1 << 15  # words per chunk of encode's work: 256 KiB of float64 stays in cache


def encoding_bound(frac_bits: int, group_size: int) -> float:
    """Largest |x| a member of a group of ``group_size`` may encode with ``frac_bits`` fractional bits."""
    _check_frac_bits(frac_bits)
    if group_size < 1:
        raise LocalProtocolError(f"group_size must be at least 1, got {group_size}")
    return _INT63_MAX / 2.0**frac_bits / group_size


def rounding_error_bound(frac_bits: int, group_size: int) -> float:
    """Worst-case absolute error per entry of a decoded sum of ``group_size`` encodings."""
    _check_frac_bits(frac_bits)
    return group_size * 2.0 ** -(frac_bits + 1)


def encode(
    values: np.ndarray, *, tensor: str, frac_bits: int = DEFAULT_FRAC_BITS, group_size: int
) -> np.ndarray:
    """Encode a float64 array as uint64 fixed point, refusing values whose group sum could wrap."""
    array = check_float_tensor(values, tensor=tensor)
    check_encodable(array, tensor=tensor, frac_bits=frac_bits, group_size=group_size)
    words = np.empty(array.shape[0], dtype=np.uint64)
    encode_into(array, words, frac_bits=frac_bits)
    return words


def encode_into(
    values: np.ndarray, out: np.ndarray, *, frac_bits: int, buffer: np.ndarray | None = None
) -> None:
    """Write :func:`encode`'s words of ``values`` into ``out`` (uint64, the same length), for
    values that :func:`check_float_tensor` and :func:`check_encodable` have passed (nothing is
    checked here; :func:`check_part` checks a chunk as it is encoded).  rint(x · 2^f) as int64, a
    cache-sized chunk at a time through one small float64 ``buffer`` (made here unless given): no
    array the size of the tensor but ``out``."""
    if values.shape[0] == 0:
        return
    scale = 2.0**frac_bits
    if buffer is None or buffer.shape[0] == 0:
        buffer = np.empty(min(_ENCODE_CHUNK, values.shape[0]))
    integers = out.view(np.int64)
    step = buffer.shape[0]
    for start in range(0, values.shape[0], step):
        part = buffer[: min(step, values.shape[0] - start)]
        np.multiply(values[start : start + part.shape[0]], scale, out=part)
        np.rint(part, out=part)
        integers[start : start + part.shape[0]] = part


def check_part(part: np.ndarray, *, whole: np.ndarray, tensor: str, frac_bits: int, group_size: int) -> None:
    """:func:`check_float_tensor`'s finiteness and :func:`check_encodable`'s bound, decided on
    ``part``, a slice of the float64 1-D ``whole``: for an encoder that checks each chunk while it
    is in cache instead of reading the whole first.  The largest |x| of the whole is the largest
    over its parts, so checking every part is the whole's check; a failing part raises what those
    functions raise over ``whole`` (the same error and message)."""
    largest = magnitude(part)
    if math.isfinite(largest) and not _over_bound(largest, frac_bits, group_size):
        return
    check_float_tensor(whole, tensor=tensor)
    check_encodable(whole, tensor=tensor, frac_bits=frac_bits, group_size=group_size)
    raise AssertionError(f"{tensor!r}: a part failed the checks that its whole passed")  # unreachable


def _over_bound(max_abs: float, frac_bits: int, group_size: int) -> bool:
    """:func:`check_encodable`'s rule on the values' largest magnitude (False for NaN, which
    :func:`check_float_tensor` refuses).  The float test can pass by a rounding hair at the very
    edge, so the integer is tested too (rint is monotone: the largest |rint(x * 2^f)| is
    rint(max|x| * 2^f))."""
    return max_abs > encoding_bound(frac_bits, group_size) or (
        float(np.rint(max_abs * 2.0**frac_bits)) > _INT63_MAX // group_size
    )


def check_encodable(
    values: np.ndarray, *, tensor: str, frac_bits: int, group_size: int, max_abs: float | None = None
) -> None:
    """Raise :class:`EncodingOverflowError` unless every entry can be encoded for ``group_size``.

    Exactly the check :func:`encode` makes, without encoding: a client runs it as soon as it knows
    its groups' sizes (R1), before it shares any secret, so it never commits to a round it cannot
    finish.  ``max_abs``: :func:`magnitude` of ``values``, where the caller has just taken it (one
    array checked for several groups: the same decision without reading it again).
    """
    if max_abs is None:
        max_abs = magnitude(values)
    if values.size and _over_bound(max_abs, frac_bits, group_size):
        raise EncodingOverflowError(
            tensor, max_abs, encoding_bound(frac_bits, group_size), frac_bits, group_size
        )


def decode(words: np.ndarray, *, frac_bits: int = DEFAULT_FRAC_BITS) -> np.ndarray:
    """Decode a uint64 (sum of) encoding(s) back to float64 via two's complement."""
    _check_frac_bits(frac_bits)
    array = np.asarray(words)
    if array.dtype != np.uint64:
        raise LocalProtocolError(f"decode expects uint64 words, got {array.dtype}")
    return array.view(np.int64).astype(np.float64) / 2.0**frac_bits


def decode_in_place(words: np.ndarray, *, frac_bits: int = DEFAULT_FRAC_BITS) -> np.ndarray:
    """:func:`decode` into the words' own memory: the same float64 values (bit for bit), returned
    as a float64 view of ``words``, whose uint64 content is gone.  For a sum no one else reads:
    ``words`` must be a writeable, contiguous 1-D uint64 array.  A cache-sized chunk at a time
    through one small buffer, so the decoded sum costs no second array of its size."""
    _check_frac_bits(frac_bits)
    if not isinstance(words, np.ndarray) or words.dtype != np.uint64 or words.ndim != 1:
        raise LocalProtocolError("decode_in_place expects a 1-D uint64 array")
    if not (words.flags.writeable and words.flags.c_contiguous):
        raise LocalProtocolError("decode_in_place needs a writeable, contiguous array (decode copies)")
    integers = words.view(np.int64)
    values = words.view(np.float64)
    scale = 2.0**frac_bits
    buffer = np.empty(min(_ENCODE_CHUNK, words.shape[0]))
    for start in range(0, words.shape[0], _ENCODE_CHUNK):
        part = buffer[: min(_ENCODE_CHUNK, words.shape[0] - start)]
        part[...] = integers[start : start + part.shape[0]]  # int64 -> float64, as astype
        np.divide(part, scale, out=part)
        values[start : start + part.shape[0]] = part
    return values


def magnitude(values: np.ndarray) -> float:
    """max |x| over a float64 array (0 for an empty one), as ``max(max, -min)``: two reductions and
    no |x| array the size of the tensor.  NaN when an entry is NaN (both reductions propagate it),
    infinite when one is infinite (it is an extreme): finite exactly when every entry is."""
    if not values.size:
        return 0.0
    high, low = float(np.max(values)), float(np.min(values))
    if high != high or low != low:  # NaN: max(high, -low) would drop it where it is the second
        return float("nan")
    return max(high, -low)


def check_float_tensor(values: np.ndarray, *, tensor: str) -> np.ndarray:
    """Return ``values`` as a 1-D float64 array, rejecting other dtypes and non-finite entries
    (decided by :func:`magnitude`'s two reductions: no array of flags the size of the tensor)."""
    if not isinstance(values, np.ndarray):
        raise LocalProtocolError(f"tensor {tensor!r} must be a numpy array, got {type(values).__name__}")
    if values.dtype != np.float64:
        raise LocalProtocolError(f"tensor {tensor!r} must be float64, got {values.dtype}")
    if values.ndim != 1:
        raise LocalProtocolError(
            f"tensor {tensor!r} must be 1-D (pack matrices first), got shape {values.shape}"
        )
    if not math.isfinite(magnitude(values)):
        raise NonFiniteValueError(f"tensor {tensor!r} holds NaN or infinity, which cannot be encoded")
    return values


def immutable(array: np.ndarray) -> bool:
    """Whether no writeable array shares ``array``'s memory: it and every base it views are
    read-only numpy arrays, over memory of their own or immutable bytes.  Such an array can be
    kept without a copy: no later write can reach it."""
    base: object = array
    while isinstance(base, np.ndarray):
        if base.flags.writeable:
            return False
        base = base.base
    return base is None or isinstance(base, bytes)


def upper_triangle_length(d: int) -> int:
    """Number of entries of a d x d matrix's upper triangle, diagonal included."""
    return d * (d + 1) // 2


def dimension_from_triangle_length(n: int) -> int:
    """Inverse of :func:`upper_triangle_length`; raises when ``n`` is not a triangular number."""
    d = int((np.sqrt(8 * n + 1) - 1) // 2)
    for candidate in (d - 1, d, d + 1):
        if candidate >= 0 and upper_triangle_length(candidate) == n:
            return candidate
    raise LocalProtocolError(f"{n} is not the length of an upper triangle d(d+1)/2")


def pack_symmetric(matrix: np.ndarray) -> np.ndarray:
    """The upper triangle (diagonal included, row-major) of a square matrix as a 1-D array.

    Only the upper triangle is read: a matrix that is symmetric up to float rounding loses nothing.
    """
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise LocalProtocolError(f"a symmetric matrix must be square, got shape {matrix.shape}")
    d = matrix.shape[0]
    packed = np.empty(upper_triangle_length(d), dtype=matrix.dtype)
    start = 0
    for i in range(d):  # row i's part of the triangle: d - i consecutive entries (row-major)
        packed[start : start + d - i] = matrix[i, i:]
        start += d - i
    return packed


_MIRROR_BLOCK = 256  # 256 x 256 float64 = 512 KiB: a block and its transpose stay in cache


def unpack_symmetric(packed: np.ndarray) -> np.ndarray:
    """The full symmetric matrix whose upper triangle is ``packed``."""
    d = dimension_from_triangle_length(packed.shape[0])
    matrix = np.empty((d, d), dtype=packed.dtype)
    start = 0
    for i in range(d):  # row i's part of the triangle is d - i consecutive entries (row-major)
        matrix[i, i:] = packed[start : start + d - i]
        start += d - i
    # The lower triangle is the upper's transpose, copied block by block: a whole-matrix transpose
    # reads one column per row and misses the cache (71 ms against 15 ms at d = 2048).
    for i0 in range(0, d, _MIRROR_BLOCK):
        rows = slice(i0, i0 + _MIRROR_BLOCK)
        for j0 in range(0, i0, _MIRROR_BLOCK):
            matrix[rows, j0 : j0 + _MIRROR_BLOCK] = matrix[j0 : j0 + _MIRROR_BLOCK, rows].T
        diagonal = matrix[rows, rows]
        below = np.tril_indices(diagonal.shape[0], -1)
        diagonal[below] = diagonal.T[below]
    return matrix


def _check_frac_bits(frac_bits: int) -> None:
    if not isinstance(frac_bits, int) or not 0 <= frac_bits <= MAX_FRAC_BITS:
        raise LocalProtocolError(f"frac_bits must be an integer in [0, {MAX_FRAC_BITS}], got {frac_bits!r}")
