"""The exact discrete Gaussian sampler: its distribution, its randomness, its integer decisions."""

from __future__ import annotations

import random as py_random

import numpy as np
import pytest
from scipy import stats

from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.privacy import dp_sampler
from secure_afl.privacy.dp_sampler import (
    SamplerError,
    admissible_variance,
    check_variance,
    discrete_gaussian_pmf,
    laplace_scale,
    sample_discrete_gaussian,
)


class CountingSource:
    """A RandomSource that records how many bytes were asked of it."""

    def __init__(self, seed: bytes) -> None:
        self.inner = DeterministicRandomSource(seed)
        self.bytes = 0

    def token_bytes(self, n: int) -> bytes:
        self.bytes += n
        return self.inner.token_bytes(n)


@pytest.mark.parametrize("variance", [2, 12, 112])
def test_goodness_of_fit_against_the_pmf(variance: int) -> None:
    draws = sample_discrete_gaussian(variance, 40_000, DeterministicRandomSource(b"gof-%d" % variance))
    sd = variance**0.5
    edge = int(3 * sd)
    support = np.arange(-edge, edge + 1)
    expected = discrete_gaussian_pmf(variance, support) * len(draws)
    observed = np.array([(draws == x).sum() for x in support], dtype=float)
    # both tails pooled into one cell each
    expected = np.concatenate(
        [
            [len(draws) * discrete_gaussian_pmf(variance, np.arange(-400, -edge)).sum()],
            expected,
            [len(draws) * discrete_gaussian_pmf(variance, np.arange(edge + 1, 400)).sum()],
        ]
    )
    observed = np.concatenate([[(draws < -edge).sum()], observed, [(draws > edge).sum()]])
    chi2 = ((observed - expected) ** 2 / expected).sum()
    p_value = stats.chi2.sf(chi2, len(expected) - 1)
    assert p_value > 1e-4, (chi2, p_value)


def test_a_wrong_distribution_fails_the_same_test() -> None:
    # the test above can fail: a discrete Gaussian of variance 16 is rejected against variance 12
    draws = sample_discrete_gaussian(16, 40_000, DeterministicRandomSource(b"wrong"))
    support = np.arange(-10, 11)
    expected = discrete_gaussian_pmf(12, support) * len(draws)
    observed = np.array([(draws == x).sum() for x in support], dtype=float)
    chi2 = ((observed - expected) ** 2 / expected).sum()
    assert stats.chi2.sf(chi2, len(support) - 1) < 1e-6


def test_large_variance_moments() -> None:
    variance = admissible_variance(2.0**46)
    draws = sample_discrete_gaussian(variance, 100_000, DeterministicRandomSource(b"large"))
    assert abs(draws.mean()) < 5 * (variance / len(draws)) ** 0.5
    assert abs(draws.var() / variance - 1) < 0.02
    assert abs(stats.kurtosis(draws.astype(float))) < 0.1  # Gaussian tails, not Laplace (3)


def test_draws_come_from_the_injected_source_only() -> None:
    np_state = np.random.get_state()[1].copy()
    py_state = py_random.getstate()
    source = CountingSource(b"seed")
    first = sample_discrete_gaussian(112, 1000, source)
    assert source.bytes > 0
    again = sample_discrete_gaussian(112, 1000, DeterministicRandomSource(b"seed"))
    other = sample_discrete_gaussian(112, 1000, DeterministicRandomSource(b"other"))
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    np.testing.assert_array_equal(np.random.get_state()[1], np_state)
    assert py_random.getstate() == py_state


def test_admissible_variances() -> None:
    for wanted in (0.3, 1, 2, 10, 99.5, 1e6, 2.0**50 + 3):
        v = admissible_variance(wanted)
        assert v >= wanted
        t = check_variance(v)
        assert t == laplace_scale(v) and v % t == 0
        assert t & (t - 1) == 0 and t >= v**0.5 - 1  # a power of two, about σ
    with pytest.raises(SamplerError, match="multiple"):
        check_variance(10)
    with pytest.raises(SamplerError, match="positive integer"):
        check_variance(0)
    with pytest.raises(SamplerError, match="positive finite"):
        admissible_variance(float("nan"))


def test_exact_bernoulli_word_boundaries() -> None:
    words = dp_sampler.noise_words(DeterministicRandomSource(b"b"))
    # p = 1/2: the word just below 2^63 is surely below, 2^63 surely not
    assert dp_sampler._bernoulli_word_exact(2**63 - 1, 1, 2, words) is True
    assert dp_sampler._bernoulli_word_exact(2**63, 1, 2, words) is False
    # p = 1/3 falls inside one word's interval: decided by further exact draws, with frequency ~ its share
    w = (2**64) // 3
    hits = sum(dp_sampler._bernoulli_word_exact(w, 1, 3, words) for _ in range(3000))
    share = (2**64 % 3) / 3  # the part of [w, w+1) below 2^64/3, exactly
    assert abs(hits / 3000 - share) < 0.05


def test_bernoulli_frequencies() -> None:
    words = dp_sampler.noise_words(DeterministicRandomSource(b"freq"))
    n = 60_000
    got = dp_sampler._bernoulli(np.full(n, 1), np.full(n, 3), words).mean()
    assert abs(got - 1 / 3) < 0.01
    got = dp_sampler._bernoulli_exp(np.full(n, 5), np.full(n, 2), words).mean()
    assert abs(got - np.exp(-2.5)) < 0.005
    # the unbounded-integer tail path agrees
    big = np.mean([dp_sampler._bernoulli_exp_big(5, 2, words) for _ in range(20_000)])
    assert abs(big - np.exp(-2.5)) < 0.01
