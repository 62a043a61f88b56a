"""Release.of reads each distinct value once: the same release as the per-input
definitions it replaced, on the study layouts and on small random layouts with shared objects,
equal copies, parts and constants."""

from __future__ import annotations

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from secure_afl.analytic import ClientStatistics
from secure_afl.privacy.release import Release, anchors, contained_parts, is_constant, value_id


def _words(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float64).astype("<f8", copy=False)


def _old_contained_parts(inputs) -> tuple[tuple[str, str], ...]:
    """The per-pair search Release.of ran before (one bytes copy and find per ordered pair), with
    the rule added since (a constant whole is skipped)."""
    flat = {f"{g}/{n}": _words(a).reshape(-1) for g, tensors in inputs.items() for n, a in tensors.items()}
    names = {key: key.split("/", 1)[1] for key in flat}
    out = []
    for part, small in flat.items():
        if small.size < 2:
            continue
        needle = small.tobytes()
        for whole, large in flat.items():
            if whole == part or names[whole] == names[part] or large.size <= small.size:
                continue
            if is_constant(large):  # a constant whole (an idle member's zeros) holds no part
                continue
            haystack = large.tobytes()
            start = haystack.find(needle)
            while start != -1:
                if start % 8 == 0:
                    out.append((part, whole))
                    break
                start = haystack.find(needle, start + 1)
    return tuple(out)


def _old_release(inputs, sources=()) -> Release:
    values, found = {}, {}
    for group, tensors in inputs.items():
        for name, array in tensors.items():
            values[(group, name)] = None if is_constant(array) else value_id(array)
            found[(group, name)] = anchors(array)
    return Release(values, found, frozenset(sources), _old_contained_parts(inputs))


def _old_value_id(values: np.ndarray) -> str:
    import hashlib

    array = _words(values)
    digest = hashlib.sha256(b"secure-afl/v2/value\x00")
    digest.update(repr(array.shape).encode())
    digest.update(array.tobytes())
    return digest.hexdigest()


def _assert_same(inputs, sources=()) -> Release:
    new, old = Release.of(inputs, sources=sources), _old_release(inputs, sources)
    assert new == old
    assert new.to_json() == old.to_json()
    assert contained_parts(inputs) == old.parts
    for (group, name), vid in new.values.items():
        array = inputs[group][name]
        assert vid == (None if is_constant(array) else _old_value_id(array))
    return new


def _statistics(rng: np.random.Generator, d: int = 12, classes: int = 14) -> ClientStatistics:
    h = rng.standard_normal((40, d))
    y = (rng.random((40, classes)) < 0.4).astype(np.float64)
    y[0], y[1] = 1.0, 0.0  # every class has a positive and a negative
    gram = h.T @ h
    return ClientStatistics(gram=gram, feat_sum=h.sum(0), pos_sum=h.T @ y, n=40, n_pos=y.sum(0).astype(int))


def test_study_layouts_give_the_old_release() -> None:
    rng = np.random.default_rng(30)
    stats = _statistics(rng)
    for missing in (1, 3, 5, 7):
        active = sorted(rng.choice(14, size=14 - missing, replace=False).tolist())
        for balance, gram in (("client", "class"), ("client", "global"), ("global", "global")):
            inputs = stats.contributions(active, balance=balance, gram=gram, include_global_gram=True)
            release = _assert_same(inputs, sources=["source:abc"])
            if gram == "class":  # one Gram object in every class group: one value id
                assert len({release.values[(g, "gram")] for g in inputs}) == 1


def test_the_halves_and_equal_copies_are_found_as_before() -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal(64)
    inputs = {
        "g1": {"x": x, "x_copy": x.copy(), "zeros": np.zeros(9), "n": np.array([3.0])},
        "g2": {"lo": x[:20].copy(), "hi": x[20:], "odd": x[3:9], "x": x},
        "g3/y": {"z": rng.standard_normal(5)},
        "g3": {"y/z": x[10:15].copy()},  # one full name "g3/y/z" for two inputs
    }
    release = _assert_same(inputs)
    assert ("g2/lo", "g1/x") in release.parts and ("g2/hi", "g1/x_copy") in release.parts


_pool = st.integers(0, 5)


@settings(max_examples=80, deadline=None)
@given(
    layout=st.lists(
        st.tuples(st.sampled_from(["a", "b", "c/1", "c/2"]), st.sampled_from(["g", "u", "v", "w/1"]), _pool),
        min_size=1,
        max_size=10,
    ),
    seed=st.integers(0, 2**16),
)
@example(layout=[("a", "g", 4), ("a", "u", 5)], seed=200)  # zeros(3) inside zeros(4): no part
def test_random_layouts_give_the_old_release(layout, seed) -> None:
    rng = np.random.default_rng(seed)
    base = rng.integers(-2, 3, size=12).astype(np.float64)  # small alphabet: accidental parts occur
    pool = [base, base[2:7], base[5:].copy(), base.copy(), np.zeros(4), rng.integers(-2, 3, size=3) * 1.0]
    inputs: dict[str, dict[str, np.ndarray]] = {}
    for group, name, which in layout:
        inputs.setdefault(group, {})[name] = pool[which]
    _assert_same(inputs)


def _byte_search(whole: np.ndarray, part: np.ndarray) -> bool:
    haystack, needle = _words(whole).tobytes(), _words(part).tobytes()
    start = haystack.find(needle)
    while start != -1:
        if start % 8 == 0:
            return True
        start = haystack.find(needle, start + 1)
    return False


@settings(max_examples=150, deadline=None)
@given(
    whole=st.lists(st.sampled_from([0.0, -0.0, 1.0, 2.0, 1.5]), min_size=2, max_size=400),
    start=st.integers(0, 400),
    length=st.integers(2, 6),
    tweak=st.booleans(),
)
def test_the_word_search_finds_a_part_where_the_byte_search_does(whole, start, length, tweak) -> None:
    """Without copying the whole (a Gram at d = 4096 is 64 MiB): the same answer as the bytes'
    aligned find, with few or many places where the part's first word occurs (a whole of mostly
    one word is searched as bytes), and -0.0 told from 0.0 as the bytes tell them."""
    large = np.array(whole)
    start = min(start, max(0, large.size - length))
    small = large[start : start + length].copy()
    if tweak and small.size:
        small[-1] = -small[-1] if small[-1] == 0.0 else small[-1] + 0.25
    inputs = {"g": {"whole": large, "part": small}}
    expected = (("g/part", "g/whole"),) if large.size > small.size and _byte_search(large, small) else ()
    if is_constant(large):
        expected = ()
    assert contained_parts(inputs) == expected


def test_a_part_is_found_in_a_whole_of_many_repeated_words() -> None:
    whole = np.zeros(5000)
    whole[4000:4003] = (1.0, 2.0, 3.0)
    part = np.array([0.0, 0.0, 1.0, 2.0, 3.0])
    assert contained_parts({"g": {"whole": whole, "part": part}}) == (("g/part", "g/whole"),)
    assert contained_parts({"g": {"whole": whole, "part": np.array([0.0, 1.0, 3.0])}}) == ()


def test_several_parts_searched_in_one_read_of_a_large_whole_as_pair_by_pair() -> None:
    """A whole longer than the scan's slices (1 << 15 words), read once for all its parts: parts
    across a slice's edge, at its very end, absent, and one whose first word is everywhere."""
    rng = np.random.default_rng(11)
    whole = rng.standard_normal(3 * (1 << 15) + 17)
    whole[: 1 << 15] = np.round(whole[: 1 << 15])  # many repeated words in the first slice
    edge = (1 << 15) - 2
    parts = {
        "across": whole[edge : edge + 5].copy(),
        "at_end": whole[-4:].copy(),
        "absent": np.append(whole[100:103], 0.123456789),
        "common": whole[10:13].copy(),  # a first word such as 0.0 or 1.0, repeated all over
        "unaligned": np.frombuffer(whole[200:204].tobytes()[3:] + b"\0\0\0", dtype="<f8").copy(),
    }
    inputs = {"g": {"whole": whole, **parts}}
    expected = _old_contained_parts(inputs)
    assert contained_parts(inputs) == expected
    found = {part for part, whole_name in expected if whole_name == "g/whole"}
    assert found == {"g/across", "g/at_end", "g/common"}


def test_is_constant_reads_past_a_constant_head_as_before() -> None:
    for head in (np.zeros(200), np.full(200, np.nan)):
        tail_differs = np.concatenate([head, [1.0]])
        assert not is_constant(tail_differs)
        assert is_constant(np.concatenate([head, head]))
    assert not is_constant(np.array([np.nan, 1.0] + [np.nan] * 100))
    assert is_constant(np.zeros(0)) and is_constant(np.array([3.0]))
