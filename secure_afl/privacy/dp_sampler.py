"""Exact sampling of the discrete Gaussian, from injected cryptographic randomness.

Canonne, Kamath and Steinke (NeurIPS 2020, "The discrete Gaussian for differential privacy"),
Algorithms 1–3, in integer arithmetic only: every decision is a comparison of a uniform integer
(rejection-sampled from the bytes of a :class:`~secure_afl.core.randomness.RandomSource`) with
an integer, so no floating-point rounding ever enters the output distribution (Mironov's attack on
floating-point noise does not apply).  numpy and Python's ``random`` are never used for randomness.

The algorithms, vectorised over many draws with numpy's unsigned 64-bit integers:

- ``Bernoulli(a/b)``: a uniform integer in ``[0, b)`` is below ``a``;
- ``Bernoulli(exp(-a/b))`` for ``a/b ≤ 1`` (Algorithm 1): ``K = 1``; while ``Bernoulli(a/(b·K))``:
  ``K += 1``; the result is ``K`` odd.  For ``a/b > 1``, ``⌊a/b⌋`` independent ``Bernoulli(exp(-1))``
  and one ``Bernoulli(exp(-(a mod b)/b))`` must all succeed;
- the discrete Laplace of scale ``t`` (Algorithm 2): ``U`` uniform in ``[0, t)`` accepted with
  ``Bernoulli(exp(-U/t))``, ``V`` geometric by ``Bernoulli(exp(-1))``, ``X = U + t·V``, a random sign,
  rejecting "negative zero";
- the discrete Gaussian ``N_Z(0, σ²)`` (Algorithm 3): a discrete Laplace ``Y`` of scale ``t`` accepted
  with ``Bernoulli(exp(-(|Y| - σ²/t)² / (2σ²)))``.  The algorithm is exact for every ``t > 0``.

To keep every intermediate in 64 bits, the variance ``σ²`` is an integer that is a multiple of
``t``, and ``t`` is a power of two between ``σ`` and about ``2σ`` (acceptance stays high):
then ``σ²/t = m`` is an integer and the acceptance exponent is ``(|Y| − m)² / (2·m·t)``.
:func:`admissible_variance` rounds a wanted variance *up* to such an integer (never less noise).
A draw so far in the tail that ``(|Y| − m)²`` would not fit 63 bits (probability below ``e^-40``
for the variances used here) is decided with Python's unbounded integers, with the same algorithm.
"""

from __future__ import annotations

import math

import numpy as np

from secure_afl.core.randomness import DeterministicRandomSource, RandomSource

_MAX_VARIANCE = 2**60  # 2·σ² must fit in int64 with room for the K factor of Algorithm 1
_SAFE_SQUARE = 2**62


class SamplerError(ValueError):
    """A variance the sampler cannot use (not a positive integer, not admissible, too large)."""


def laplace_scale(variance: int) -> int:
    """The proposal scale ``t`` for ``σ² = variance``: a power of two in ``(σ − 1, 2σ]``."""
    return 1 << max(1, math.isqrt(variance).bit_length())


def admissible_variance(at_least: float) -> int:
    """The smallest integer variance ``≥ at_least`` that is a multiple of its :func:`laplace_scale`."""
    if not at_least > 0 or not math.isfinite(at_least):
        raise SamplerError(f"a variance must be a positive finite number, got {at_least}")
    variance = max(1, math.ceil(at_least))
    while True:
        t = laplace_scale(variance)
        rounded = -(-variance // t) * t
        if laplace_scale(rounded) == t:
            if rounded > _MAX_VARIANCE:
                raise SamplerError(f"variance {rounded} exceeds the sampler's limit 2^60")
            return rounded
        variance = rounded


def check_variance(variance: int) -> int:
    """Return ``t`` for an admissible ``variance``; raise :class:`SamplerError` otherwise."""
    if not isinstance(variance, int) or isinstance(variance, bool) or variance < 1:
        raise SamplerError(f"the variance must be a positive integer, got {variance!r}")
    if variance > _MAX_VARIANCE:
        raise SamplerError(f"variance {variance} exceeds the sampler's limit 2^60")
    t = laplace_scale(variance)
    if variance % t:
        raise SamplerError(
            f"variance {variance} is not a multiple of its Laplace scale {t}; "
            "round it up with admissible_variance()"
        )
    return t


class _Words:
    """Uniform 64-bit words: a ChaCha20 keystream keyed by 32 bytes drawn from the RandomSource.

    Noise needs hundreds of megabytes of randomness for a 1024-d Gram; one key from the injected
    source expanded by a stream cipher (as ``DeterministicRandomSource`` does with its seed) is a
    cryptographic PRG, and far faster than asking the operating system for every block.
    """

    def __init__(self, random: RandomSource) -> None:
        self._stream = DeterministicRandomSource(random.token_bytes(32))

    def take(self, n: int) -> np.ndarray:
        if n == 0:
            return np.empty(0, dtype=np.uint64)
        return np.frombuffer(self._stream.token_bytes(8 * n), dtype=np.uint64).copy()


def noise_words(random: RandomSource) -> _Words:
    """A fast word stream keyed from ``random`` (randomized rounding uses it too)."""
    return _Words(random)


def _uniform_below(n: np.ndarray, words: _Words) -> np.ndarray:
    """Uniform integers in ``[0, n_i)`` (``n_i ≥ 1``), by rejecting the low ``2^64 mod n`` words."""
    n = n.astype(np.uint64)
    if n.size and bool(np.all(n == n.flat[0])) and int(n.flat[0]) & (int(n.flat[0]) - 1) == 0:
        return words.take(n.size) & (n.flat[0] - np.uint64(1))  # a power of two: mask, no rejection
    out = np.empty(n.shape, dtype=np.uint64)
    threshold = (np.uint64(0) - n) % n  # 2^64 mod n: below it, u mod n would be biased
    todo = np.arange(n.size)
    while todo.size:
        u = words.take(todo.size)
        ok = u >= threshold[todo]
        out[todo[ok]] = u[ok] % n[todo[ok]]
        todo = todo[~ok]
    return out


def _bernoulli(num: np.ndarray, den: np.ndarray, words: _Words) -> np.ndarray:
    """``Bernoulli(num/den)`` elementwise (``0 ≤ num ≤ den``, ``den ≥ 1``), exactly, one word each.

    The outcome is ``[V < num/den]`` for ``V = (U + W)/2^64`` uniform in ``[0, 1)``, where ``U`` is a
    random 64-bit word and ``W`` its (never drawn) continuation.  Float arithmetic only *decides*
    the cases it decides with a margin of ``2^-40`` relative (its error is below ``2^-50``); any
    word in the margin is settled with Python integers: compare ``U·den`` and ``(U+1)·den`` with
    ``num·2^64``, and if ``num/den`` lies inside ``U``'s interval, draw ``W`` exactly.
    """
    u = words.take(num.size)
    p = num.astype(np.float64) / den.astype(np.float64)
    x = u.astype(np.float64) * 2.0**-64
    yes = x < p * (1 - 2.0**-40) - 2.0**-60
    no = x > p * (1 + 2.0**-40) + 2.0**-60
    out = yes.copy()
    for i in np.flatnonzero(~(yes | no)):
        out[i] = _bernoulli_word_exact(int(u[i]), int(num[i]), int(den[i]), words)
    return out


def _bernoulli_word_exact(word: int, num: int, den: int, words: _Words) -> bool:
    target = num << 64
    if (word + 1) * den <= target:
        return True
    if word * den >= target:
        return False
    # num/den lies inside [word, word+1)/2^64: V < num/den iff W < num·2^64/den − word
    rest_num = target - word * den
    return _uniform_below_big(den, words) < rest_num


def _bernoulli_exp_fraction(num: np.ndarray, den: np.ndarray, words: _Words) -> np.ndarray:
    """``Bernoulli(exp(-num/den))`` for ``0 ≤ num ≤ den`` (Algorithm 1)."""
    num = num.astype(np.int64)
    den = den.astype(np.int64)
    k = np.ones(num.shape, dtype=np.int64)
    result = np.empty(num.shape, dtype=bool)
    alive = np.arange(num.size)
    rounds = 0
    while alive.size:
        rounds += 1  # K exceeds r only with probability 1/r!: check the 64-bit range only then
        if rounds > 20 and rounds > (2**63 - 1) // int(np.max(den[alive])):
            raise SamplerError("Bernoulli(exp) ran past 64-bit range (probability below 1/20!)")
        more = _bernoulli(num[alive], den[alive] * k[alive], words)
        k[alive[more]] += 1
        done = alive[~more]
        result[done] = (k[done] % 2) == 1
        alive = alive[more]
    return result


def _bernoulli_exp(num: np.ndarray, den: np.ndarray, words: _Words) -> np.ndarray:
    """``Bernoulli(exp(-num/den))`` for any ``num ≥ 0``: ``⌊num/den⌋`` times ``exp(-1)``, then the rest."""
    num = num.astype(np.int64)
    den = den.astype(np.int64)
    whole = num // den
    result = _bernoulli_exp_fraction(num - whole * den, den, words)
    alive = np.flatnonzero(result & (whole > 0))
    remaining = whole.copy()
    one = np.ones(1, dtype=np.int64)
    while alive.size:
        ok = _bernoulli_exp_fraction(
            np.broadcast_to(one, alive.shape), np.broadcast_to(one, alive.shape), words
        )
        result[alive[~ok]] = False
        remaining[alive] -= 1
        alive = alive[ok & (remaining[alive] > 0)]
    return result


def _discrete_laplace(n: int, t: int, words: _Words) -> np.ndarray:
    """``n`` draws of the discrete Laplace of scale ``t`` (``P(x) ∝ exp(-|x|/t)``), Algorithm 2."""
    out = np.empty(n, dtype=np.int64)
    todo = np.arange(n)
    t_arr = np.full(1, t, dtype=np.int64)
    while todo.size:
        m = todo.size
        u = _uniform_below(np.broadcast_to(t_arr, (m,)), words).astype(np.int64)
        keep = _bernoulli_exp_fraction(u, np.broadcast_to(t_arr, (m,)), words)
        v = np.zeros(m, dtype=np.int64)
        counting = np.flatnonzero(keep)
        ones = np.ones(1, dtype=np.int64)
        while counting.size:
            more = _bernoulli_exp_fraction(
                np.broadcast_to(ones, counting.shape), np.broadcast_to(ones, counting.shape), words
            )
            v[counting[more]] += 1
            counting = counting[more]
        x = u + t * v
        negative = (words.take(m) & np.uint64(1)).astype(bool)
        keep &= ~(negative & (x == 0))
        out[todo[keep]] = np.where(negative[keep], -x[keep], x[keep])
        todo = todo[~keep]
    return out


def sample_discrete_gaussian(variance: int, size: int, random: RandomSource) -> np.ndarray:
    """``size`` independent draws of ``N_Z(0, variance)`` as int64, from ``random`` only.

    ``variance`` must be admissible (:func:`admissible_variance`): an integer multiple of its
    Laplace scale ``t``.
    """
    t = check_variance(variance)
    if size < 0:
        raise SamplerError(f"size must be non-negative, got {size}")
    words = _Words(random)
    m = variance // t
    den = 2 * m * t  # = 2σ²
    out = np.empty(size, dtype=np.int64)
    todo = np.arange(size)
    while todo.size:
        y = _discrete_laplace(todo.size, t, words)
        r = np.abs(y) - m
        # (|Y| − m)² must fit: the far tail (practically never reached) goes the unbounded way
        small = np.abs(r) < math.isqrt(_SAFE_SQUARE)
        accept = np.zeros(todo.size, dtype=bool)
        idx = np.flatnonzero(small)
        accept[idx] = _bernoulli_exp(r[idx] * r[idx], np.full(idx.size, den, dtype=np.int64), words)
        for i in np.flatnonzero(~small):
            accept[i] = _bernoulli_exp_big(int(r[i]) ** 2, den, words)
        out[todo[accept]] = y[accept]
        todo = todo[~accept]
    return out


def _uniform_below_big(n: int, words: _Words) -> int:
    """Uniform integer in ``[0, n)`` for unbounded ``n``, by rejection on whole 64-bit words."""
    n_words = max(1, (n.bit_length() + 63) // 64)
    span = 1 << (64 * n_words)
    limit = span - span % n
    while True:
        value = int.from_bytes(words.take(n_words).tobytes(), "little")
        if value < limit:
            return value % n


def _bernoulli_exp_big(num: int, den: int, words: _Words) -> bool:
    """``Bernoulli(exp(-num/den))`` with Python integers (the rare tail case)."""
    whole, rest = divmod(num, den)
    for _ in range(whole):
        if not _bernoulli_exp_fraction_big(1, 1, words):
            return False
    return _bernoulli_exp_fraction_big(rest, den, words)


def _bernoulli_exp_fraction_big(num: int, den: int, words: _Words) -> bool:
    k = 1
    while _uniform_below_big(den * k, words) < num:
        k += 1
    return k % 2 == 1


def discrete_gaussian_pmf(variance: float, support: np.ndarray) -> np.ndarray:
    """``P(X = x) = exp(-x²/(2σ²)) / Σ_y exp(-y²/(2σ²))`` (normalised over ±(12σ + 20))."""
    bound = int(12 * math.sqrt(variance)) + 20
    ys = np.arange(-bound, bound + 1, dtype=np.float64)
    norm = np.exp(-(ys**2) / (2 * variance)).sum()
    return np.exp(-(np.asarray(support, dtype=np.float64) ** 2) / (2 * variance)) / norm
