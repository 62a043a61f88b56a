"""A node's Freivalds terms (secure_afl/deploy/verify.py's node_terms) after the speed changes: the
fixed-point round trip in place, and a Gram carried by several groups encoded once (unless its
copies differ).  The terms are those of the full matrices, computed directly."""

from __future__ import annotations

import numpy as np
import pytest

from secure_afl.deploy.verify import UnverifiedClassifierError, _encoded, node_terms

FRAC_BITS = 32


def _node(dim: int, n_classes: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    rows = rng.random((3 * dim + 5, dim))
    gram = rows.T @ rows
    b = rng.standard_normal((n_classes, dim))
    weights = rng.standard_normal((dim, n_classes))
    return gram, b, weights, rng.uniform(-1, 1, dim)


def _expected(
    gram: np.ndarray,
    b: np.ndarray,
    weights: np.ndarray,
    u: np.ndarray,
    with_gram: list[int],
    labelled: list[int],
) -> list[float]:
    """The terms from the full encoded matrices: t_c = uᵀ G w_c (c in ``with_gram``) − uᵀ b_c (c
    labelled), then m = ‖G‖_F + max ‖b_c‖."""
    full = np.rint(gram * 2.0**FRAC_BITS) * 2.0**-FRAC_BITS
    enc = np.rint(b * 2.0**FRAC_BITS) * 2.0**-FRAC_BITS
    terms = [
        (float(u @ full @ weights[:, c]) if c in with_gram else 0.0)
        - (float(u @ enc[c]) if c in labelled else 0.0)
        for c in range(len(b))
    ]
    return [*terms, float(np.linalg.norm(full)) + max(float(np.linalg.norm(enc[c])) for c in labelled)]


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
    g, b, weights, u = _node(dim, n_classes, dim)
    packed = g[np.triu_indices(dim)]
    inputs = {f"class/{c}|b/{c}": b[c] for c in labelled}
    if gram == "global":
        inputs["all|gram"] = packed
    else:  # one copy per labelled class, as statistics.py uploads it (the same array, and equal copies)
        inputs.update({f"class/{c}|gram": packed if c != 3 else packed.copy() for c in labelled})
    got = node_terms(inputs, weights, u, gram=gram, frac_bits=FRAC_BITS)
    with_gram = list(range(n_classes)) if gram == "global" else labelled  # class 1: G only if global
    expected = _expected(g, b, weights, u, with_gram, labelled)
    scale = np.abs(g).sum() * np.abs(weights).max() + np.abs(b).sum()
    assert np.allclose(got, expected, rtol=1e-12, atol=1e-12 * scale)


def test_a_gram_that_differs_between_groups_is_still_refused() -> None:
    g, b, weights, u = _node(20, 2, 1)
    packed = g[np.triu_indices(20)]
    other = packed.copy()
    other[5] += 1e-3  # above the fixed point's resolution
    inputs = {"class/0|gram": packed, "class/1|gram": other, "class/0|b/0": b[0], "class/1|b/1": b[1]}
    with pytest.raises(UnverifiedClassifierError, match="differs between its groups"):
        node_terms(inputs, weights, u, gram="class", frac_bits=FRAC_BITS)
    other[5] = packed[5] + 2.0 ** -(FRAC_BITS + 3)  # below it: the same encoded Gram, as before
    assert node_terms(inputs, weights, u, gram="class", frac_bits=FRAC_BITS) == node_terms(
        {**inputs, "class/1|gram": packed}, weights, u, gram="class", frac_bits=FRAC_BITS
    )
