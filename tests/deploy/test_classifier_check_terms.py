"""A node's residual terms (secure_afl/deploy/verify.py's node_terms, over check_inputs' encoded
values): the fixed-point round trip in place, a Gram carried by several groups taken once (unless
its copies differ).  The terms are those of the full matrices, computed directly."""

from __future__ import annotations

import numpy as np
import pytest

from secure_afl.deploy.verify import UnverifiedClassifierError, _encoded, node_terms

FRAC_BITS = 32


def _node(dim: int, n_classes: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    rows = rng.random((3 * dim + 5, dim))
    gram = _encoded(rows.T @ rows, FRAC_BITS)  # as check_inputs hands them over
    b = _encoded(rng.standard_normal((n_classes, dim)), FRAC_BITS)
    weights = rng.standard_normal((dim, n_classes))
    return gram, b, weights


def _expected(
    gram: np.ndarray, b: np.ndarray, weights: np.ndarray, with_gram: list[int], labelled: list[int]
) -> np.ndarray:
    """The terms from the full matrices: v_c = G w_c (c in ``with_gram``) − b_c (c labelled), then
    m = ‖G‖_F + max ‖b_c‖."""
    residual = [
        (gram @ weights[:, c] if c in with_gram else np.zeros(len(gram))) - (b[c] if c in labelled else 0.0)
        for c in range(len(b))
    ]
    scale = float(np.linalg.norm(gram)) + max(float(np.linalg.norm(b[c])) for c in labelled)
    return np.concatenate([np.ravel(residual), [scale]])


def test_the_in_place_round_trip_is_bit_for_bit_the_formula() -> None:
    values = np.random.default_rng(0).standard_normal(1000) * 1e3
    before = values.copy()
    got = _encoded(values, FRAC_BITS)
    assert np.array_equal(got, np.rint(values * 2.0**FRAC_BITS) * 2.0**-FRAC_BITS)
    assert np.array_equal(values, before)  # the node's kept values are not changed


@pytest.mark.parametrize("gram", ["global", "class"])
@pytest.mark.parametrize("dim", [1, 2, 129, 300])
def test_a_nodes_terms_are_those_of_its_full_matrices(gram: str, dim: int) -> None:
    n_classes, labelled = 4, [0, 2, 3]
    g, b, weights = _node(dim, n_classes, dim)
    packed = g[np.triu_indices(dim)]
    inputs = {f"class/{c}|b/{c}": b[c] for c in labelled}
    if gram == "global":
        inputs["all|gram"] = packed
    else:  # one copy per labelled class, as statistics.py uploads it (the same array, and equal copies)
        inputs.update({f"class/{c}|gram": packed if c != 3 else packed.copy() for c in labelled})
    got = node_terms(inputs, weights, gram=gram)
    with_gram = list(range(n_classes)) if gram == "global" else labelled  # class 1: G only if global
    expected = _expected(g, b, weights, with_gram, labelled)
    scale = np.abs(g).sum() * np.abs(weights).max() + np.abs(b).sum()
    assert got.shape == (n_classes * dim + 1,)
    assert np.allclose(got, expected, rtol=1e-12, atol=1e-12 * scale)


def test_a_gram_that_differs_between_groups_is_still_refused() -> None:
    g, b, weights = _node(20, 2, 1)
    packed = g[np.triu_indices(20)]
    other = packed.copy()
    other[5] += 2.0**-FRAC_BITS  # one step of the fixed point: another encoded Gram
    inputs = {"class/0|gram": packed, "class/1|gram": other, "class/0|b/0": b[0], "class/1|b/1": b[1]}
    with pytest.raises(UnverifiedClassifierError, match="differs between its groups"):
        node_terms(inputs, weights, gram="class")
    same = node_terms({**inputs, "class/1|gram": packed.copy()}, weights, gram="class")
    assert np.array_equal(same, node_terms({**inputs, "class/1|gram": packed}, weights, gram="class"))
