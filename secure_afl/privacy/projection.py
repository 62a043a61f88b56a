"""A public, data-independent random projection of the feature rows before DP's statistics.

``--dp-dim K`` maps every feature row ``x ∈ R^d`` to ``Pᵀx ∈ R^K`` **before clipping**, so the
clients release a ``K×K`` Gram and ``K``-dimensional class sums instead of ``d×d`` and ``d``: the
noise scales with the released coordinates (a Gram noise of spectral norm ``∝ √K`` instead of
``√d``, ``K`` noisy coordinates per class sum instead of ``d``) while the sensitivities stay
``C²``, ``C`` and 1, since the projected rows are clipped to the same ``C``.

The matrix
----------
``P`` is ``d × K`` with entries ``±1/√K`` (Achlioptas 2003): ``E‖Pᵀx‖² = ‖x‖²``, so the clip bound
keeps its meaning in the projected space.  The signs come from SHAKE-256 over a domain tag, ``d``,
``K`` and the seed.  The projection is **public** (the study carries ``K`` and the seed; every
party may recompute it) and data-independent, so it needs no secret randomness and costs no
privacy; a hash is used rather than numpy's generators only so that every client derives the same
matrix bit for bit whatever its numpy version (numpy does not promise stable streams across
versions, and clients whose matrices differed would sum Grams in different bases).  The entries are
exact in float64 (``1/√K`` is one correctly rounded value).

The classifier
--------------
The server solves for ``W_K`` (``K × C``) on the projected statistics; the released classifier
holds ``W = P W_K`` (``d × C``), so prediction works on the original features unchanged:
``x·W = (Pᵀx)·W_K`` up to float64 rounding (:func:`lift_weights`).  Round 2's pseudo-labels are
scored in the projected space with ``W_K`` (the server sends ``W_K``), on the clipped projected rows.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from secure_afl.privacy.dp_config import DpError

PROJECTION_DOMAIN = b"secure-afl/dp-projection/v1\0"


def projection_matrix(dim: int, k: int, seed: int) -> np.ndarray:
    """The ``dim × k`` float64 matrix of ``±1/√k`` derived from ``seed`` (deterministic, public)."""
    for name, value in (("dim", dim), ("K", k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DpError(f"the projection's {name} must be a positive integer, got {value!r}")
    if k > dim:
        raise DpError(f"--dp-dim {k} exceeds the feature dimension {dim}: a projection reduces the dimension")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise DpError(f"the projection seed must be an integer in 0..2^64-1, got {seed!r}")
    header = PROJECTION_DOMAIN + b"".join(v.to_bytes(8, "big") for v in (dim, k, seed))
    n = dim * k
    raw = hashlib.shake_256(header).digest((n + 7) // 8)
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), count=n).reshape(dim, k)
    return (1.0 - 2.0 * bits.astype(np.float64)) * (1.0 / math.sqrt(k))


def projection_digest(dim: int, k: int, seed: int) -> str:
    """SHA-256 of the matrix's float64 bytes (little-endian, row-major): the record names it."""
    matrix = projection_matrix(dim, k, seed)
    return hashlib.sha256(matrix.astype("<f8").tobytes()).hexdigest()


def row_map(dim: int, k: int | None, seed: int, *, centre: bool = False) -> np.ndarray | None:
    """The public linear map of DP's rows: ``C = I − 11ᵀ/d`` when ``centre`` (every row less its own
    mean over the features), then the random projection to ``k`` dimensions when ``k`` is given;
    None when neither.  ``d × k`` (``d × d`` for the centring alone): :func:`lift_weights` turns
    weights for the mapped rows into weights for the original features, as for the projection."""
    projection = None if k is None else projection_matrix(dim, k, seed)
    if not centre:
        return projection
    centring = np.eye(dim) - np.full((dim, dim), 1.0 / dim)
    return centring if projection is None else centring @ projection


def project_rows(features: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """``features @ matrix`` in float64 (rows × K)."""
    features = np.asarray(features, dtype=np.float64)
    if features.ndim != 2 or features.shape[1] != matrix.shape[0]:
        raise DpError(
            f"features of shape {features.shape} cannot be projected by a {matrix.shape[0]} × "
            f"{matrix.shape[1]} matrix: the rows must have the study's dimension {matrix.shape[0]}"
        )
    return features @ matrix


def lift_weights(matrix: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``W = P W_K``: weights for the original ``d``-dimensional features (float64)."""
    return np.asarray(matrix, dtype=np.float64) @ np.asarray(weights, dtype=np.float64)
