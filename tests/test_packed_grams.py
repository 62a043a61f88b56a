"""Grams held, summed and solved as packed triangles give the full matrices' results, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from secure_afl.aggregation.layout import flatten, layout_of
from secure_afl.analytic import AnalyticClassifier, GramFactors, fit_together, sum_contributions
from secure_afl.core import encoding
from secure_afl.sim.secure import secure_aggregate
from secure_afl.statistics import client_statistics


def _clients(d: int = 12, n_clients: int = 3) -> dict[str, object]:
    rng = np.random.default_rng(7)
    out = {}
    for k in range(n_clients):
        features = rng.standard_normal((40, d))
        labels = (rng.random((40, 3)) < 0.4).astype(np.int8)
        out[f"c{k}"] = client_statistics(features, labels, device="cpu")
    return out


def _contributions(stats: dict[str, object]) -> dict[str, dict[str, dict[str, np.ndarray]]]:
    active = {"c0": [0, 1], "c1": [1, 2], "c2": [0, 2]}
    out = {}
    for cid, s in stats.items():
        mine = s.contributions(active[cid], include_global_gram=True)  # type: ignore[attr-defined]
        for group, tensors in s.contributions(active[cid], balance="global").items():  # type: ignore[attr-defined]
            mine[group].update(tensors)
        out[cid] = mine
    return out


def test_packed_statistics_are_the_read_only_triangle() -> None:
    stats = _clients()["c0"]
    packed = stats.packed()  # type: ignore[attr-defined]
    assert packed.gram_is_packed and not packed.gram.flags.writeable
    assert np.array_equal(packed.gram, stats.gram[np.triu_indices(stats.dim)])  # type: ignore[attr-defined]
    assert packed.packed() is packed
    assert encoding.immutable(packed.gram)


def test_layout_takes_a_triangle_as_the_symmetric_tensor_it_packs() -> None:
    stats = _clients()
    full = _contributions(stats)
    packed = _contributions({c: s.packed() for c, s in stats.items()})  # type: ignore[attr-defined]
    assert layout_of(full) == layout_of(packed)
    triangle = packed["c0"]["all"]["gram"]
    assert flatten(triangle, True) is triangle  # the wire vector as it is, no copy
    with pytest.raises(ValueError, match="square matrix or its packed upper triangle"):
        layout_of({"c0": {"all": {"gram": np.zeros(5)}}})  # 5 is no triangle length


def test_sums_and_fits_from_triangles_match_the_full_matrices_bit_for_bit() -> None:
    stats = _clients()
    full_sums = sum_contributions(_contributions(stats).values())
    packed_sums = sum_contributions(_contributions({c: s.packed() for c, s in stats.items()}).values())  # type: ignore[attr-defined]
    for group, tensors in full_sums.items():
        for name, value in tensors.items():
            got = packed_sums[group][name]
            expected = encoding.pack_symmetric(value) if name == "gram" else value
            assert np.array_equal(got, expected), (group, name)

    def models() -> list[AnalyticClassifier]:
        return [
            AnalyticClassifier(3),
            AnalyticClassifier(3, balance="global"),
            AnalyticClassifier(3, gram="global"),
        ]

    alone = models()
    for m in alone:
        m.fit(full_sums)
    together = models()
    factors = GramFactors(packed_sums, 1.0, keep=("all",))
    fit_together(together, packed_sums, factors=factors)
    for a, b in zip(alone, together, strict=True):
        assert np.array_equal(a.coef_, b.coef_)
    # only the kept factor stays cached: the others are computed afresh when asked again
    assert factors.factor("all", "all") is factors.factor("all", "all")
    assert factors.factor("class/0", "class 0") is not factors.factor("class/0", "class 0")


def test_a_group_of_one_read_only_value_is_summed_without_a_copy() -> None:
    value = np.arange(6.0)
    value.setflags(write=False)
    writeable = np.arange(6.0)
    sums = sum_contributions([{"g": {"t": value, "u": writeable}}])
    assert sums["g"]["t"] is value
    assert sums["g"]["u"] is not writeable and np.array_equal(sums["g"]["u"], writeable)
    view = np.arange(6.0)[:]
    frozen_view = view.view()
    frozen_view.setflags(write=False)
    assert not encoding.immutable(frozen_view)  # its base can still be written


def test_secure_sums_left_packed_are_the_plaintext_triangles() -> None:
    stats = _clients()
    contributions = _contributions({c: s.packed() for c, s in stats.items()})  # type: ignore[attr-defined]
    plain = sum_contributions(contributions.values())
    result = secure_aggregate(contributions, unpack=False)
    full = secure_aggregate(_contributions(stats))
    for group, tensors in plain.items():
        assert result.sums[group]["gram"].ndim == 1
        np.testing.assert_allclose(result.sums[group]["gram"], tensors["gram"], rtol=0, atol=1e-8)
        assert np.array_equal(encoding.unpack_symmetric(result.sums[group]["gram"]), full.sums[group]["gram"])
