"""A client's own values, as the exposure check tells them apart: equal labels exactly where the
values are equal (shape and float64 bit patterns), without hashing them."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secure_afl.analytic import ClientStatistics
from secure_afl.privacy import exposure


def _bits(values: np.ndarray) -> tuple[tuple[int, ...], bytes]:
    array = np.ascontiguousarray(values, dtype=np.float64)
    return array.shape, array.astype("<f8").tobytes()


def _assert_labels_follow_equality(inputs: dict[str, dict[str, np.ndarray]]) -> None:
    labels = exposure.own_value_labels(inputs)
    keys = [(g, n) for g, t in inputs.items() for n in t]
    assert sorted(labels) == sorted(keys)
    for a in keys:
        for b in keys:
            same = _bits(inputs[a[0]][a[1]]) == _bits(inputs[b[0]][b[1]])
            assert (labels[a] == labels[b]) is same, (a, b)


def test_one_object_in_several_groups_is_one_value() -> None:
    gram = np.arange(10.0)
    inputs = {"class/0": {"gram": gram}, "all": {"gram": gram}, "class/1": {"b/1": np.ones(10)}}
    labels = exposure.own_value_labels(inputs)
    assert labels[("class/0", "gram")] == labels[("all", "gram")] != labels[("class/1", "b/1")]


def test_equal_values_in_distinct_objects_and_under_other_names_share_a_label() -> None:
    rng = np.random.default_rng(3)
    gram = rng.standard_normal(300)
    inputs = {
        "class/0": {"gram": gram, "b/0": gram[:20].copy()},
        "extra": {"gram_copy": gram.copy(), "strided": gram[::2], "b_same": gram[:20].copy()},
    }
    labels = exposure.own_value_labels(inputs)
    assert labels[("class/0", "gram")] == labels[("extra", "gram_copy")]
    assert labels[("class/0", "b/0")] == labels[("extra", "b_same")]
    assert labels[("class/0", "gram")] != labels[("extra", "strided")]
    _assert_labels_follow_equality(inputs)


def test_values_differing_in_one_word_between_the_samples_or_in_sign_of_zero_differ() -> None:
    base = np.linspace(1.0, 2.0, (1 << 16) + 5)  # longer than one compared slice
    late = base.copy()
    late[-3] = np.nextafter(late[-3], 3.0)  # one ulp, in the last slice, off the sampled words
    zeros, negative_zeros = np.zeros(8), -np.zeros(8)
    inputs = {"a": {"x": base, "z": zeros}, "b": {"x": late, "z": negative_zeros}}
    labels = exposure.own_value_labels(inputs)
    assert labels[("a", "x")] != labels[("b", "x")]
    assert labels[("a", "z")] != labels[("b", "z")]  # -0.0 is another value, as its bytes are
    _assert_labels_follow_equality(inputs)


def test_the_statistics_layout_labels_as_digests_would() -> None:
    """On a client's real upload, labels partition the values as SHA-256 of their bytes does."""
    rng = np.random.default_rng(5)
    h = rng.standard_normal((40, 6))
    labels_matrix = (rng.random((40, 4)) < 0.4).astype(np.float64)
    from secure_afl.statistics import client_statistics

    stats: ClientStatistics = client_statistics(h, labels_matrix, device="cpu").packed()
    inputs = stats.contributions([0, 2, 3], include_global_gram=True)
    inputs = {g: dict(t) for g, t in inputs.items()}
    inputs["copy"] = {"gram": stats.gram.copy()}
    labels = exposure.own_value_labels(inputs)

    def digest(values: np.ndarray) -> str:
        return hashlib.sha256(repr(np.shape(values)).encode() + _bits(values)[1]).hexdigest()

    by_digest: dict[str, set[str]] = {}
    for g, t in inputs.items():
        for n, v in t.items():
            by_digest.setdefault(digest(v), set()).add(labels[(g, n)])
    assert all(len(found) == 1 for found in by_digest.values())
    assert len(set(labels.values())) == len(by_digest)


@settings(max_examples=60, deadline=None)
@given(
    layout=st.lists(
        st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from(["x", "y", "z"]), st.integers(0, 6)),
        min_size=1,
        max_size=9,
    ),
    seed=st.integers(0, 2**16),
)
def test_random_layouts_label_exactly_by_equality(layout, seed) -> None:
    rng = np.random.default_rng(seed)
    base = rng.integers(-2, 3, size=12).astype(np.float64)  # a small alphabet: accidental equals
    pool = [
        base,
        base.copy(),
        base[::-1].copy(),
        np.zeros(12),
        -np.zeros(12),
        base[:3].copy(),
        rng.integers(0, 2, size=12) * 1.0,
    ]
    inputs: dict[str, dict[str, np.ndarray]] = {}
    for group, name, which in layout:
        inputs.setdefault(group, {})[name] = pool[which]
    _assert_labels_follow_equality(inputs)


@pytest.mark.parametrize("length", [0, 1, 7, 9])
def test_short_and_empty_values(length: int) -> None:
    inputs = {"a": {"x": np.ones(length)}, "b": {"x": np.ones(length), "y": np.full(length, 2.0)}}
    _assert_labels_follow_equality(inputs)
