"""Synthetic stand-in features for the embedded default dataset.  THEY ARE NOT IMAGE FEATURES.

The labels and patient ids are the real ChestXray14 ones; only the features are made up, so that
``secure-afl sim`` runs anywhere in seconds.  Results on them say how the *methods* behave on the
real label structure (imbalance, co-occurrence, partial labels), not how well chest X-rays can be
classified.  Every report says so.

Generative model, per image ``i`` of patient ``p`` with real labels ``y_i ∈ {0,1}^8``::

    z_i = μ + B u_i + P v_p + Σ_c y_ic s_c + σ ε_i          (pre-activation, ``d`` dims)
    h_i = softplus(z_i) = log(1 + exp(z_i))                  (non-negative, like pooled ReLU maps)

- ``μ ~ N(−0.5, 0.5²)`` per dimension: a baseline, many features mostly "off" as after a ReLU;
- ``B u_i``: image-level nuisance (anatomy, exposure) of rank 32, ``u_i ~ N(0, I)``,
  ``B_jr ~ N(0, 0.8²/32)``;
- ``P v_p``: a patient effect of rank 16 shared by all images of one patient (so that image-wise
  splits leak, as they do on the real data), ``P_jr ~ N(0, 0.5²/16)``;
- ``s_c``: the signature of class ``c``: ``SIGNAL_DIMS`` = 10% of the dimensions, chosen at random
  per class (classes overlap by chance), each shifted by ``SIGNAL_SHIFT`` = 0.1 with a random sign;
  multi-label images carry the sum of their classes' signatures, so the real co-occurrence of
  ChestXray14 shapes the features;
- ``ε_i ~ N(0, I)``, ``σ = 1``.

The shift was fixed a priori so that one class's ideal linear discriminant has a signal-to-noise
ratio of about 1 (``0.1 · √102``) before the nuisance and the softplus: a moderately hard task.
It was not tuned to reproduce any published number.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
from threadpoolctl import threadpool_limits

NUISANCE_RANK = 32
PATIENT_RANK = 16
SIGNAL_FRACTION = 0.10
SIGNAL_SHIFT = 0.1
NOISE_SD = 1.0
CHUNK_ROWS = 8192
SYNTHETIC_BLAS_THREADS = 2


def synthetic_features(
    labels: np.ndarray,
    patient_ids: np.ndarray,
    *,
    dim: int = 1024,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    offsets: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    """Features (rows × ``dim``, float32) for the given label rows, from the model above.

    Deterministic in ``seed`` and the rows given.  ``progress`` is called with the number of rows
    finished after each chunk.  ``offsets``: ``(group, shifts)``, the group index of every row and a
    ``groups × dim`` array added to its pre-activation ``z`` (a site's shift,
    :mod:`secure_afl.sim.multisite`); it draws nothing from the model's generator, so the rest of
    the features are those without it.
    """
    labels = np.asarray(labels)
    if labels.ndim != 2 or len(labels) != len(patient_ids):
        raise ValueError(
            f"labels must be rows × classes and match patient_ids; got {labels.shape} and {len(patient_ids)}"
        )
    if dim < 1:
        raise ValueError(f"dim must be positive, got {dim}")
    if offsets is not None:
        group, shifts = np.asarray(offsets[0]), np.asarray(offsets[1], dtype=np.float32)
        if group.shape != (len(labels),) or shifts.ndim != 2 or shifts.shape[1] != dim:
            raise ValueError(
                f"offsets must be a group per row ({len(labels)}) and groups × dim ({dim}) shifts; "
                f"got {group.shape} and {shifts.shape}"
            )
        if len(group) and not 0 <= group.min() <= group.max() < len(shifts):
            raise ValueError(f"offsets' group indices must lie in 0..{len(shifts) - 1}")
    rng = np.random.default_rng(seed)
    n_classes = labels.shape[1]
    mean = rng.normal(-0.5, 0.5, size=dim).astype(np.float32)
    nuisance = (rng.normal(0, 0.8, size=(NUISANCE_RANK, dim)) / np.sqrt(NUISANCE_RANK)).astype(np.float32)
    patient_load = (rng.normal(0, 0.5, size=(PATIENT_RANK, dim)) / np.sqrt(PATIENT_RANK)).astype(np.float32)
    signatures = np.zeros((n_classes, dim), dtype=np.float32)
    n_signal = max(1, round(SIGNAL_FRACTION * dim))
    for c in range(n_classes):
        dims = rng.choice(dim, size=n_signal, replace=False)
        signatures[c, dims] = SIGNAL_SHIFT * rng.choice((-1.0, 1.0), size=n_signal)
    _, patient_index = np.unique(patient_ids, return_inverse=True)
    patient_effect = rng.standard_normal((patient_index.max() + 1, PATIENT_RANK), dtype=np.float32)

    out = np.empty((len(labels), dim), dtype=np.float32)
    # The random draws must stay in order (one generator stream), but the softplus of a finished
    # chunk (the costliest step: scalar libm calls; numpy releases the GIL in it) runs on other
    # threads while the next chunk is drawn, each half of the chunk on its own thread so that a
    # free core takes one.  Same operations on the same numbers: the features do not change.
    #
    # OpenBLAS splits a product differently for each thread count, and the float32 sums differ in
    # their last bits: the products run on exactly SYNTHETIC_BLAS_THREADS threads on every machine,
    # the count of the 2-core machine where the published tables were made.
    with (
        threadpool_limits(SYNTHETIC_BLAS_THREADS, user_api="blas"),
        ThreadPoolExecutor(max_workers=2) as softplus,
    ):
        pending: list[Future[None]] = []
        for start in range(0, len(labels), CHUNK_ROWS):
            stop = min(start + CHUNK_ROWS, len(labels))
            rows = stop - start
            z = rng.standard_normal((rows, dim), dtype=np.float32)
            z *= NOISE_SD
            z += mean
            z += rng.standard_normal((rows, NUISANCE_RANK), dtype=np.float32) @ nuisance
            z += patient_effect[patient_index[start:stop]] @ patient_load
            z += labels[start:stop].astype(np.float32) @ signatures
            if offsets is not None:
                z += shifts[group[start:stop]]
            if pending:
                for job in pending:
                    job.result()
                if progress is not None:
                    progress(start)
            half = rows // 2
            pending = [
                softplus.submit(_softplus_into, z[:half], out[start : start + half]),
                softplus.submit(_softplus_into, z[half:], out[start + half : stop]),
            ]
        for job in pending:
            job.result()
    if progress is not None:
        progress(len(labels))
    return out


def _softplus_into(z: np.ndarray, out: np.ndarray) -> None:
    np.logaddexp(np.float32(0), z, out=out)
