"""Client statistics on the CPU without the extra passes: no float64 copy of float64
input, no (G + Gᵀ)/2, the finiteness check read off the batch's Gram; the same numbers."""

from __future__ import annotations

import numpy as np
import pytest

from secure_afl.analytic import StatisticsError, client_statistics


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("batch_size", [7, 64, 1000])
def test_statistics_equal_the_plain_float64_products(dtype, batch_size) -> None:
    rng = np.random.default_rng(batch_size)
    h = (rng.standard_normal((150, 12)) * 3).astype(dtype)
    y = (rng.random((150, 5)) < 0.3).astype(np.int64)
    stats = client_statistics(h, y, device="cpu", batch_size=batch_size)
    h64 = h.astype(np.float64)
    expected = sum(
        (h64[i : i + batch_size].T @ h64[i : i + batch_size] for i in range(0, 150, batch_size)),
        np.zeros((12, 12)),
    )
    assert np.array_equal(stats.gram, expected)  # bit for bit: the same products, summed alike
    assert np.array_equal(stats.gram, stats.gram.T)
    np.testing.assert_allclose(stats.feat_sum, h64.sum(axis=0), rtol=1e-12)
    np.testing.assert_allclose(stats.pos_sum, h64.T @ y, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_bad_value_in_a_later_batch_is_refused(bad) -> None:
    h = np.ones((20, 4))
    h[17, 2] = bad
    with pytest.raises(StatisticsError, match="NaN or infinite"):
        client_statistics(iter([h[:10], h[10:]]), np.zeros((20, 2)), device="cpu")


def test_finite_values_whose_squares_overflow_are_not_called_non_finite() -> None:
    h = np.ones((6, 3))
    h[0, 0] = 1e200  # finite; its square overflows: the diagonal is inf, the batch is read, it passes
    stats = client_statistics(h, np.zeros((6, 1)), device="cpu")
    assert np.isinf(stats.gram[0, 0]) and stats.n == 6


def test_auto_on_a_host_without_a_gpu_driver_never_asks_torch(monkeypatch) -> None:
    from secure_afl import statistics

    def no_torch(device: str) -> None:
        raise AssertionError(f"resolve_device({device!r}) imports torch")

    monkeypatch.setattr(statistics, "resolve_device", no_torch)
    monkeypatch.setattr(statistics, "_cuda_driver_present", lambda: False)
    assert statistics._on_cpu("auto") and statistics._on_cpu("cpu")
    stats = statistics.client_statistics(np.ones((3, 2)), np.zeros((3, 1)), device="auto")
    assert stats.n == 3
    monkeypatch.setattr(statistics, "_cuda_driver_present", lambda: True)
    with pytest.raises(AssertionError, match="imports torch"):
        statistics._on_cpu("auto")  # a driver: torch decides


def test_the_gpu_path_agrees_with_the_cpu_path() -> None:
    """The torch path (run here on torch's CPU device) gives the numpy path's statistics."""
    import torch

    from secure_afl import statistics

    rng = np.random.default_rng(3)
    h = rng.standard_normal((300, 9)).astype(np.float32)
    y = (rng.random((300, 4)) < 0.4).astype(np.int64)
    labels = statistics._check_labels(y, 300)
    on_torch = statistics._cuda_statistics(h, labels, 64, torch.device("cpu"))
    on_numpy = client_statistics(h, y, device="cpu", batch_size=64)
    for name in ("gram", "feat_sum", "pos_sum", "n_pos"):
        np.testing.assert_allclose(getattr(on_torch, name), getattr(on_numpy, name), rtol=1e-12, atol=1e-12)
    assert on_torch.n == on_numpy.n == 300
    assert np.array_equal(on_torch.gram, on_torch.gram.T)


def _statistics_the_old_way(h: np.ndarray, y: np.ndarray, batch_size: int) -> tuple[np.ndarray, ...]:
    """The CPU path as it was before the cast buffer was huge-page aligned: each batch cast to a
    fresh float64 array, its syrk, and [Y, 1]ᵀH, summed batch after batch."""
    labels = y.astype(bool)
    c = labels.shape[1]
    gram = sums = None
    for i in range(0, len(h), batch_size):
        h64 = h[i : i + batch_size].astype(np.float64)
        y1 = np.ones((len(h64), c + 1))
        y1[:, :c] = labels[i : i + batch_size]
        if gram is None:
            gram, sums = h64.T @ h64, y1.T @ h64
        else:
            gram += h64.T @ h64
            sums += y1.T @ h64
    return gram, sums[c], sums[:c].T


@pytest.mark.parametrize("rows", [4875, 4097, 2049])
@pytest.mark.parametrize("batch_size", [1000, 2049, 4096])
def test_float32_statistics_are_bit_for_bit_the_old_way(rows, batch_size) -> None:
    """float32 features (cast into one reused buffer, huge-page aligned from 4 MiB up: 2049 and
    4096 rows of 256 are) give exactly the per-batch float64 products of a plain cast."""
    rng = np.random.default_rng(rows + batch_size)
    h = (rng.standard_normal((rows, 256)) * 2).astype(np.float32)
    y = (rng.random((rows, 6)) < 0.3).astype(np.int64)
    stats = client_statistics(h, y, device="cpu", batch_size=batch_size)
    gram, feat_sum, pos_sum = _statistics_the_old_way(h, y, batch_size)
    assert np.array_equal(stats.gram, gram)
    assert np.array_equal(stats.feat_sum, feat_sum)
    assert np.array_equal(stats.pos_sum, pos_sum)


def test_a_big_cast_buffer_starts_on_a_huge_page() -> None:
    from secure_afl.statistics import _huge_page_aligned_empty

    big = _huge_page_aligned_empty(2049, 256)  # 4.2 MB: numpy asks for huge pages
    assert big.shape == (2049, 256) and big.dtype == np.float64 and big.flags.c_contiguous
    assert big.ctypes.data % (1 << 21) == 0
    small = _huge_page_aligned_empty(7, 12)
    assert small.shape == (7, 12) and small.base is None  # small: a plain array, no slack
