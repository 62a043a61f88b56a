"""A large mask split among workers: the same words as one thread, refusals as one thread's."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest

from secure_afl.core.errors import EncodingOverflowError, NonFiniteValueError
from secure_afl.core.workers import ONE_THREAD, Threads
from secure_afl.protocol import prg

from .helpers import CountingThreads

KEYS = [(bytes([k + 1]) * 32, 1 if k % 2 else -1) for k in range(4)]


@pytest.fixture
def small_split(monkeypatch: pytest.MonkeyPatch) -> None:
    # Small chunks and a small split size: several runs of several chunks in a fast test.
    monkeypatch.setattr(prg, "CHUNK_WORDS", 64)
    monkeypatch.setattr(prg, "PARALLEL_MIN_WORDS", 256)


def _expected(start: np.ndarray) -> np.ndarray:
    expected = start.copy()
    for key, sign in KEYS:
        mask = prg.mask_words(key, start.shape[0])
        expected = expected + mask if sign > 0 else expected - mask
    return expected


@pytest.mark.parametrize("n_words", [256, 257, 1000, 64 * 7 + 3])
@pytest.mark.parametrize("count", [2, 3])
def test_split_masks_add_the_same_words(small_split: None, n_words: int, count: int) -> None:
    rng = np.random.default_rng(n_words)
    start = rng.integers(0, 2**64 - 1, size=n_words, dtype=np.uint64, endpoint=True)
    expected = _expected(start)
    workers = CountingThreads(count)
    in_place = start.copy()
    prg.add_masks(in_place, KEYS, workers=workers)
    assert in_place.tobytes() == expected.tobytes()
    assert workers.splits == [count]  # type: ignore[attr-defined]
    # From a base, into an unaligned view (a tensor's place in a message frame).
    buffer = bytearray(8 * n_words + 3)
    target = np.frombuffer(buffer, dtype="<u8", count=n_words, offset=3)
    prg.add_masks(target, KEYS, base=start, workers=workers)
    assert target.tobytes() == expected.tobytes()


def test_split_encoding_masks_the_same_words_as_one_thread(small_split: None) -> None:
    values = np.random.default_rng(3).normal(size=1000)
    alone = np.zeros(1000, dtype=np.uint64)
    prg.add_masks(alone, KEYS, values=values, group_size=4, tensor="g/gram", workers=ONE_THREAD)
    split = np.zeros(1000, dtype=np.uint64)
    workers = CountingThreads(2)
    prg.add_masks(split, KEYS, values=values, group_size=4, tensor="g/gram", workers=workers)
    assert split.tobytes() == alone.tobytes()
    assert workers.splits == [2]  # type: ignore[attr-defined]


def test_below_the_split_size_one_thread_masks(small_split: None) -> None:
    workers = CountingThreads(2)
    words = np.zeros(255, dtype=np.uint64)
    prg.add_masks(words, KEYS, workers=workers)
    assert words.tobytes() == _expected(np.zeros(255, dtype=np.uint64)).tobytes()
    assert not workers.splits  # type: ignore[attr-defined]


@pytest.mark.parametrize(("bad", "error"), [(np.nan, NonFiniteValueError), (1e300, EncodingOverflowError)])
@pytest.mark.parametrize("where", [10, 990])  # in the first run, in the last
def test_a_refusal_in_any_run_raises_the_whole_error(
    small_split: None, bad: float, error: type[Exception], where: int
) -> None:
    values = np.ones(1000)
    values[where] = bad
    with pytest.raises(error) as alone:
        prg.add_masks(np.zeros(1000, dtype=np.uint64), KEYS, values=values, group_size=4, tensor="g/gram")
    before = threading.active_count()
    with pytest.raises(error) as split:
        prg.add_masks(
            np.zeros(1000, dtype=np.uint64),
            KEYS,
            values=values,
            group_size=4,
            tensor="g/gram",
            workers=Threads(3),
        )
    assert str(split.value) == str(alone.value)
    assert threading.active_count() == before  # no run left behind


@pytest.mark.parametrize("n_words", [0, 1, 255, 256, 257, 64 * 5, 64 * 7 + 3, 10_000])
@pytest.mark.parametrize("count", [1, 2, 3, 8])
def test_word_runs_cover_the_words_in_whole_chunks(small_split: None, n_words: int, count: int) -> None:
    runs = prg.word_runs(n_words, Threads(count))
    assert runs[0][0] == 0 and runs[-1][1] == n_words
    assert all(a[1] == b[0] for a, b in itertools.pairwise(runs))
    assert all(start % 64 == 0 and start < stop for start, stop in runs) or n_words == 0
    chunks = -(-n_words // 64)
    assert len(runs) == (1 if n_words < 256 else min(count, chunks))


def test_a_run_starts_on_an_aes_block(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two words to a 16-byte block: a run from an odd word would need half a block of keystream,
    # so odd chunks (here 7 words: the second run would start at word 49) are refused.
    monkeypatch.setattr(prg, "CHUNK_WORDS", 7)
    monkeypatch.setattr(prg, "PARALLEL_MIN_WORDS", 50)
    with pytest.raises(ValueError, match="even word"):
        prg.add_masks(np.zeros(100, dtype=np.uint64), KEYS, workers=Threads(2))
    words = np.zeros(100, dtype=np.uint64)
    prg.add_masks(words, KEYS)  # one thread: one run from word 0
    assert words.tobytes() == _expected(np.zeros(100, dtype=np.uint64)).tobytes()
