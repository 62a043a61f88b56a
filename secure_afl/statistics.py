"""A client's sufficient statistics (paper §III, Eq. 14) and the group names they are filed under.

``HᵀH``, ``Hᵀ1``, ``HᵀY`` and the counts, from one streaming float64 pass over a client's features,
and the contributions (``{group: {tensor: array}}``) that round 1 uploads.  On the CPU this is numpy
alone: a hospital's node computes its round-1 statistics without importing torch (the server's
solve and round 2 live in :mod:`secure_afl.analytic`, which re-exports everything here).
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from secure_afl.core.encoding import pack_symmetric

if TYPE_CHECKING:
    import torch

Balance = Literal["client", "global"]
GramScope = Literal["class", "global"]
Contributions = dict[str, dict[str, np.ndarray]]
GroupSums = Mapping[str, Mapping[str, np.ndarray]]

ALL_GROUP = "all"


class StatisticsError(ValueError):
    """Features, labels or statistics that cannot be used (wrong shape, non-finite, missing class)."""


class UndefinedBalanceWarning(UserWarning):
    """Eq. 9 is undefined for a labelled class with no positive (or no negative) sample."""


def warn_undefined(c: int, n_pos: int, n: int, where: str) -> None:
    side = "no positive" if n_pos == 0 else "no negative"
    consequence = " and the class will be predicted all-negative" if n_pos == 0 else ""
    warnings.warn(
        f"{where}: class {c} is labelled but has {side} sample (of {n}), so Eq. 9 is undefined; the "
        f"empty side's term is dropped{consequence}",
        UndefinedBalanceWarning,
        stacklevel=3,
    )


def active_class_indices(active: Sequence[int] | Sequence[bool] | np.ndarray, n_classes: int) -> list[int]:
    """The sorted class indices of ``active``: class indices, or a boolean mask of length ``n_classes``.

    ``[False, False, True]`` is a mask (class 2), never the classes 0 and 1 that reading each
    boolean as an integer would give.
    """
    if isinstance(active, (set, frozenset)):
        active = sorted(active)
    items = list(active) if not isinstance(active, np.ndarray) else None
    flags = [isinstance(x, (bool, np.bool_)) for x in items or ()]
    if any(flags) and not all(flags):
        raise StatisticsError(
            f"active classes mix booleans and integers ({items!r}): pass class indices or a boolean mask"
        )
    array = np.asarray(active if items is None else items)
    if array.dtype == bool:
        if array.shape != (n_classes,):
            raise StatisticsError(
                f"a boolean mask of active classes needs one entry per class ({n_classes}), got shape "
                f"{array.shape}; or pass the class indices"
            )
        return np.flatnonzero(array).tolist()
    if array.size == 0:
        return []
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise StatisticsError(
            f"active classes must be class indices (integers) or a boolean mask of length {n_classes}, "
            f"got {active!r}"
        )
    out = sorted({int(c) for c in array})
    bad = [c for c in out if not 0 <= c < n_classes]
    if bad:
        raise StatisticsError(f"active classes {bad} are outside 0..{n_classes - 1}")
    return out


def class_group(c: int) -> str:
    return f"class/{c}"


def pseudo_group(c: int) -> str:
    return f"pseudo/{c}"


def pseudo_label_fewest_rows(tau: float, min_pos: int, min_neg: int) -> int:
    """The fewest rows with which a client can qualify for a missing class in round 2 (Eq. 20: at
    least ``min_pos`` pseudo-positive and ``min_neg`` pseudo-negative rows): with fewer it uploads
    zeros whatever the teacher, a value anyone knows from its row count.  The pseudo-positive
    (p > τ) and pseudo-negative (p < 1 - τ) rows are disjoint when τ ≥ 0.5, so it then needs
    min_pos + min_neg rows; otherwise the larger of the two."""
    if tau >= 0.5:
        return max(min_pos, 0) + max(min_neg, 0)
    return max(min_pos, min_neg, 0)


def _cuda_driver_present() -> bool:
    """Whether this host has a GPU driver at all (NVIDIA's or ROCm's device files): without one torch
    finds no CUDA device, so ``auto`` means the CPU and nothing imports torch."""
    return any(Path(p).exists() for p in ("/dev/nvidiactl", "/proc/driver/nvidia/version", "/dev/kfd"))


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` means CUDA when present, else CPU; asking for CUDA without a GPU is an error.

    torch is imported only here and only when a GPU may be used: on a host without a GPU driver
    ``auto`` is the CPU without importing it (a ClientApp process pays about 1.7 CPU-s for torch)."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but torch finds no CUDA GPU; use --device cpu or auto")
    return resolved


def _on_cpu(device: str) -> bool:
    """Whether the statistics run on the CPU (numpy, no torch import)."""
    if device == "cpu" or (device == "auto" and not _cuda_driver_present()):
        return True
    return resolve_device(device).type == "cpu"


def as_batches(features: np.ndarray | Iterable[np.ndarray], batch_size: int) -> Iterable[np.ndarray]:
    if isinstance(features, np.ndarray):
        return (features[i : i + batch_size] for i in range(0, len(features), batch_size))
    return features


def check_batch(batch: np.ndarray, d: int | None, *, finite: bool = True) -> None:
    """Shape and dtype of a feature batch; with ``finite`` also that every value is finite (the CPU
    path leaves that to :func:`_check_finite` on the batch's Gram, which reads no extra pass)."""
    if batch.ndim != 2:
        raise StatisticsError(f"features must be a 2-D array (samples × dim), got shape {batch.shape}")
    if d is not None and batch.shape[1] != d:
        raise StatisticsError(f"feature batches disagree on the dimension: {batch.shape[1]} after {d}")
    if not np.issubdtype(batch.dtype, np.floating):
        raise StatisticsError(f"features must be floating point, got dtype {batch.dtype}")
    if finite and not np.isfinite(batch).all():
        raise StatisticsError(
            "features contain NaN or infinite values; check the backbone output or the feature file"
        )


def _check_finite(batch: np.ndarray, gram: np.ndarray) -> None:
    """Every value of ``batch`` is finite, given ``gram = batchᵀbatch``: a NaN or infinite entry
    makes its column's diagonal entry NaN or infinite, so a finite diagonal proves the batch finite;
    otherwise (that, or squares that overflow) the batch itself is read."""
    if not np.isfinite(np.diagonal(gram)).all():
        check_batch(batch, None)


def _check_labels(labels: np.ndarray, n_rows: int | None = None) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 2:
        raise StatisticsError(f"labels must be a 2-D 0/1 array (samples × classes), got shape {labels.shape}")
    if n_rows is not None and labels.shape[0] != n_rows:
        raise StatisticsError(
            f"labels have {labels.shape[0]} rows but the features have {n_rows}: one label row per sample"
        )
    if not np.isin(labels, (0, 1)).all():
        raise StatisticsError("labels must contain only 0 and 1 (multi-hot)")
    return labels.astype(bool)


@dataclass(frozen=True)
class ClientStatistics:
    """One client's sufficient statistics, from one streaming float64 pass over its features.

    Everything a client might upload derives from these without touching the features again:
    ``gram = HᵀH``, ``feat_sum = Hᵀ1``, ``pos_sum = HᵀY`` (per class), the row count and the
    positive counts.  Columns of classes the client does not label are never uploaded.

    ``gram`` is the ``d×d`` matrix, or, after :meth:`packed`, its upper triangle (row-major,
    diagonal included, read-only): half the memory, and what the wire carries anyway.
    """

    gram: np.ndarray
    feat_sum: np.ndarray
    pos_sum: np.ndarray
    n: int
    n_pos: np.ndarray

    @property
    def dim(self) -> int:
        return self.feat_sum.shape[0]

    @property
    def gram_is_packed(self) -> bool:
        return self.gram.ndim == 1

    def packed(self) -> ClientStatistics:
        """These statistics with ``gram`` as its read-only upper triangle (the full matrix can go).

        The contributions then carry the triangle, which the aggregation layouts take as the
        symmetric tensor it packs, and the sums of it are triangles too (the same values, bit for
        bit, as the triangles of the full sums: the Gram is exactly symmetric).
        """
        if self.gram_is_packed:
            return self
        triangle = pack_symmetric(self.gram)
        triangle.setflags(write=False)
        return replace(self, gram=triangle)

    def balanced_projection(self, c: int) -> np.ndarray:
        """``b_{k,c} = H_kᵀ y_{k,c}`` with the balanced labels of Eq. 9 (Eq. 14).

        Warns (:class:`UndefinedBalanceWarning`) when the class has no positive or no negative here.
        """
        n_pos = int(self.n_pos[c])
        if n_pos in (0, self.n):
            warn_undefined(c, n_pos, self.n, "client statistics")
        return balanced_projection(self.pos_sum[:, c], self.feat_sum, n_pos, self.n)

    def undefined_classes(self, active: Sequence[int] | Sequence[bool] | np.ndarray) -> dict[int, str]:
        """Active classes where Eq. 9 is undefined here: ``{c: "no positive" | "no negative"}``."""
        out = {}
        for c in active_class_indices(active, self.pos_sum.shape[1]):
            if int(self.n_pos[c]) == 0:
                out[c] = "no positive"
            elif int(self.n_pos[c]) == self.n:
                out[c] = "no negative"
        return out

    def contributions(
        self,
        active: Sequence[int] | Sequence[bool] | np.ndarray,
        *,
        balance: Balance = "client",
        gram: GramScope = "class",
        include_global_gram: bool = False,
    ) -> Contributions:
        """What this client uploads in round 1, as ``{group: {tensor: float64 array}}``.

        ``active``: class indices or a boolean mask of length C.  ``include_global_gram`` adds the
        ``all`` group (round 2 needs it).
        """
        active = active_class_indices(active, self.pos_sum.shape[1])
        check_options(balance, gram)
        out: Contributions = {}
        for c in active:
            tensors: dict[str, np.ndarray] = {}
            if gram == "class":
                tensors["gram"] = self.gram
            if balance == "client":
                tensors[f"b/{c}"] = self.balanced_projection(c)
            else:
                tensors[f"pos_sum/{c}"] = self.pos_sum[:, c].copy()
                tensors[f"n_pos/{c}"] = np.array([float(self.n_pos[c])])
                tensors["feat_sum"] = self.feat_sum
                tensors["n"] = np.array([float(self.n)])
            out[class_group(c)] = tensors
        if gram == "global" or include_global_gram:
            out[ALL_GROUP] = {"gram": self.gram}
        return out


class MethodParameterError(StatisticsError):
    """A method parameter (γ, τ, α, δ⁺, δ⁻) outside its range: names it, its value, the range and
    why (:func:`check_method_parameter`).  ``name``, ``value`` and ``allowed`` are kept for callers
    that report it in their own words (the deployment's study)."""

    def __init__(self, name: str, value: object, allowed: str, why: str) -> None:
        self.name, self.value, self.allowed, self.why = name, value, allowed, why
        super().__init__(f"{name} must be {allowed}, got {value!r}: {why}")


@dataclass(frozen=True)
class ParameterRange:
    """One method parameter's range: an integer or a real number for which ``holds`` is true."""

    allowed: str  # the range in words, e.g. "a number in [0.5, 1)"
    integer: bool
    holds: Callable[[float], bool]
    why: str  # what the method needs it for, and a value to use


# The one statement of the method's ranges (paper §III): the deployment's study, the simulator's
# config and the classifier's own arguments all check with it.
METHOD_PARAMETERS: Mapping[str, ParameterRange] = {
    "gamma": ParameterRange(
        "a positive finite number",
        False,
        lambda v: 0 < v < math.inf,
        "the ridge γI of Eq. 15 makes the Gram positive definite (it is singular when a class has "
        "fewer images than dimensions); use e.g. 1.0",
    ),
    "tau": ParameterRange(
        "a number in [0.5, 1)",
        False,
        lambda v: 0.5 <= v < 1,
        "Eq. 19 labels an image pseudo-positive when σ > τ and pseudo-negative when σ < 1 − τ: below "
        "0.5 an image can be both, and from 1 none is pseudo-positive (Eq. 19 would divide by a zero "
        "count); use e.g. the paper's 0.7",
    ),
    "alpha": ParameterRange(
        "a number in (0, 1]",
        False,
        lambda v: 0 < v <= 1,
        "Eq. 23 weighs the pseudo-label sums by α: 0 discards round 2 (use rounds = 1 instead) and "
        "above 1 trusts pseudo-labels more than real ones; use e.g. the paper's 0.5",
    ),
    "min_pos": ParameterRange(
        "an integer ≥ 1",
        True,
        lambda v: v >= 1,
        "Eq. 20's δ⁺: a client qualifies with at least δ⁺ pseudo-positive images and Eq. 19 divides "
        "by their count, so it must be at least 1; use e.g. the paper's 5",
    ),
    "min_neg": ParameterRange(
        "an integer ≥ 1",
        True,
        lambda v: v >= 1,
        "Eq. 20's δ⁻: a client qualifies with at least δ⁻ pseudo-negative images and Eq. 19 divides "
        "by their count, so it must be at least 1; use e.g. the paper's 50",
    ),
}


def check_method_parameter(name: str, value: object) -> float | int:
    """``value`` as the method uses it (a float, or an int for δ⁺ and δ⁻), or
    :class:`MethodParameterError` when it is not of :data:`METHOD_PARAMETERS`' type (a bool or a
    string is not a number) or lies outside its range (NaN and ±inf included)."""
    rule = METHOD_PARAMETERS[name]
    kind = numbers.Integral if rule.integer else numbers.Real
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, kind):
        raise MethodParameterError(name, value, rule.allowed, rule.why)
    number = int(value) if rule.integer else float(value)
    if not (math.isfinite(number) and rule.holds(number)):
        raise MethodParameterError(name, value, rule.allowed, rule.why)
    return number


def check_options(balance: str, gram: str) -> None:
    if balance not in ("client", "global"):
        raise StatisticsError(f"balance must be 'client' or 'global', got {balance!r}")
    if gram not in ("class", "global"):
        raise StatisticsError(f"gram must be 'class' or 'global', got {gram!r}")


def client_statistics(
    features: np.ndarray | Iterable[np.ndarray],
    labels: np.ndarray,
    *,
    batch_size: int = 4096,
    device: str = "auto",
) -> ClientStatistics:
    """Accumulate a client's statistics in float64, streaming over row batches (CUDA when present).

    ``features`` is an ``N×d`` array or an iterable of row batches (never stacked in memory);
    ``labels`` is the ``N×C`` 0/1 matrix.  On the CPU this is numpy alone (torch is not imported).
    """
    labels = _check_labels(labels, len(features) if isinstance(features, np.ndarray) else None)
    if not _on_cpu(device):
        return _cuda_statistics(features, labels, batch_size, resolve_device(device))
    n_classes = labels.shape[1]
    gram: np.ndarray | None = None
    sums: np.ndarray | None = None  # rows 0..C-1: YᵀH; row C: 1ᵀH
    cast: np.ndarray | None = None
    seen = 0
    for raw in as_batches(features, batch_size):
        batch = np.asarray(raw)
        check_batch(batch, None if gram is None else gram.shape[0], finite=False)
        rows = len(batch)
        _check_row_count(seen + rows, len(labels))
        # numpy's BLAS computes hᵀh as a symmetric rank-k update (syrk): half the flops of the
        # general product.  float64 input is used as it is (no copy); other input is cast into
        # one reused buffer (a fresh 32 MB array per batch costs its page faults every time).
        if batch.dtype == np.float64 and batch.flags.c_contiguous:
            h64 = batch
        else:
            if cast is None or cast.shape[1] != batch.shape[1] or len(cast) < rows:
                cast = _huge_page_aligned_empty(max(rows, batch_size), batch.shape[1])
            h64 = cast[:rows]
            np.copyto(h64, batch)
        part = h64.T @ h64
        _check_finite(batch, part)
        # [Y, 1]ᵀH: the positive sums and the column sums in one product (one more pass over H
        # would cost as much as the products themselves at C = 14)
        y1 = np.ones((rows, n_classes + 1))
        y1[:, :n_classes] = labels[seen : seen + rows]
        if gram is None:
            gram, sums = part, y1.T @ h64
        else:
            gram += part
            sums += y1.T @ h64
        seen += rows
    if gram is None or sums is None:
        raise StatisticsError("a client has no samples: every client needs at least one feature row")
    if seen != len(labels):
        raise StatisticsError(f"labels have {len(labels)} rows but the features have {seen}")
    # syrk fills one triangle and mirrors it (and numpy's loop without BLAS adds the same products
    # in the same order for g_ij and g_ji): exactly symmetric, so (G + Gᵀ)/2 = G
    return ClientStatistics(
        gram=gram,
        feat_sum=sums[n_classes].copy(),
        pos_sum=np.ascontiguousarray(sums[:n_classes].T),
        n=seen,
        n_pos=labels.sum(axis=0).astype(np.int64),
    )


_HUGE_PAGE = 1 << 21  # a transparent huge page on x86-64 (2 MiB)
_NUMPY_HUGE_PAGE_MIN = 1 << 22  # numpy asks the kernel for huge pages (madvise) from 4 MiB up


def _huge_page_aligned_empty(rows: int, cols: int) -> np.ndarray:
    """An uninitialised C-contiguous float64 ``rows×cols`` array that starts on a 2 MiB boundary when
    it is big enough for numpy to ask for transparent huge pages.

    The kernel backs only the 2 MiB-aligned part of a region with huge pages, and malloc's ``mmap``
    puts a large array 16 bytes past a 4 KiB page, anywhere within a 2 MiB one: the cast buffer of
    float32 features (32 MiB at 4096 × 1024) then faults up to 2 MiB in 4 KiB pages, ~530 faults
    instead of 17 on every call (measured; about 0.9 ms of the cast's 5.5).  Aligned, all of it is
    huge pages.  The extra 2 MiB is address space only (never touched, never resident); the values,
    shape and strides the products see are the same (only the address differs, as it does from
    call to call anyway), so the statistics are bit for bit those of a plain ``np.empty`` buffer.
    """
    n = rows * cols
    if n * 8 < _NUMPY_HUGE_PAGE_MIN:
        return np.empty((rows, cols))
    raw = np.empty(n + _HUGE_PAGE // 8)
    start = (-raw.ctypes.data % _HUGE_PAGE) // 8
    return raw[start : start + n].reshape(rows, cols)


def _check_row_count(rows: int, n_labels: int) -> None:
    if rows > n_labels:
        raise StatisticsError(
            f"the features have more rows than the {n_labels} label rows: one label row per sample"
        )


def _cuda_statistics(
    features: np.ndarray | Iterable[np.ndarray], labels: np.ndarray, batch_size: int, dev: torch.device
) -> ClientStatistics:
    """:func:`client_statistics` on a GPU (torch float64)."""
    import torch

    gram_t = pos_t = sum_t = None
    d: int | None = None
    seen = 0
    for raw in as_batches(features, batch_size):
        batch = np.asarray(raw)
        check_batch(batch, d)
        if d is None:
            d = batch.shape[1]
            gram_t = torch.zeros((d, d), dtype=torch.float64, device=dev)
            pos_t = torch.zeros((labels.shape[1], d), dtype=torch.float64, device=dev)  # YᵀH
            sum_t = torch.zeros(d, dtype=torch.float64, device=dev)
        rows = len(batch)
        _check_row_count(seen + rows, len(labels))
        h = torch.as_tensor(batch, device=dev).to(torch.float64)
        gram_t.addmm_(h.T, h)
        y = torch.as_tensor(labels[seen : seen + rows], device=dev).to(torch.float64)
        pos_t.addmm_(y.T, h)  # YᵀH keeps the long axis contiguous: several times faster than HᵀY
        sum_t.add_(h.sum(dim=0))
        seen += rows
    if d is None:
        raise StatisticsError("a client has no samples: every client needs at least one feature row")
    if seen != len(labels):
        raise StatisticsError(f"labels have {len(labels)} rows but the features have {seen}")
    gram = gram_t.cpu().numpy()
    return ClientStatistics(
        gram=(gram + gram.T) / 2,  # addmm leaves rounding asymmetry; the statistic is symmetric
        feat_sum=sum_t.cpu().numpy(),
        pos_sum=pos_t.T.contiguous().cpu().numpy(),
        n=seen,
        n_pos=labels.sum(axis=0).astype(np.int64),
    )


def balanced_labels(labels: np.ndarray, active: Sequence[int] | Sequence[bool] | np.ndarray) -> np.ndarray:
    """Eq. 9: ``+1/N⁺`` for positives, ``−1/N⁻`` for negatives of active classes, 0 for missing ones.

    A class with no positive (or no negative) sample locally has that side's term left at zero, with
    an :class:`UndefinedBalanceWarning`.
    """
    labels = _check_labels(labels)
    out = np.zeros(labels.shape, dtype=np.float64)
    for c in active_class_indices(active, labels.shape[1]):
        pos = labels[:, c]
        n_pos, n_neg = int(pos.sum()), int((~pos).sum())
        if not n_pos or not n_neg:
            warn_undefined(c, n_pos, len(pos), "balanced labels")
        if n_pos:
            out[pos, c] = 1.0 / n_pos
        if n_neg:
            out[~pos, c] = -1.0 / n_neg
    return out


def balanced_projection(pos_sum: np.ndarray, feat_sum: np.ndarray, n_pos: int, n: int) -> np.ndarray:
    """``Hᵀy`` for the balanced label vector of Eq. 9, from positive and total feature sums."""
    b = np.zeros_like(feat_sum)
    if n_pos:
        b += pos_sum / n_pos
    if n - n_pos:
        b -= (feat_sum - pos_sum) / (n - n_pos)
    return b
