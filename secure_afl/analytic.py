"""The one-round analytic method of the paper (§III), as client statistics and a server-side solve.

Clients turn their features and labels into *contributions*: plain named float64 arrays filed under
named groups, ``{group: {tensor: array}}``.  The server only ever needs the per-group **sums** of those
arrays, so the same contributions can be summed in the clear (:func:`sum_contributions`) or by a
secure-aggregation protocol that knows nothing of what they mean.

Groups and tensors (one name space for the whole federation):

- ``class/<c>``: the clients that label class ``c`` (``S_c``).  Tensors ``b/<c>`` (Eq. 14), and
  ``gram`` unless ``gram="global"``.  With ``balance="global"`` the class group carries
  ``pos_sum/<c>``, ``n_pos/<c>``, ``feat_sum`` and ``n`` instead of ``b/<c>``.
- ``all``: every client; tensor ``gram``.  Present when ``gram="global"`` or round 2 is wanted.
- ``pseudo/<c>``: the clients that do *not* label ``c``; tensor ``b_pseudo/<c>`` (Eq. 21), zeros from
  clients that do not qualify (Eq. 20), so the server does not learn who qualified.

A tensor name denotes the same client value wherever it appears: ``gram`` sent to two groups is the
same ``G_k`` twice.  The privacy audit relies on that to work out what the group sums reveal.

The server adds ``γI`` once (Eq. 15) and solves each class by Cholesky (Eq. 17); it never forms an
inverse.  Prediction is positive when ``σ(h·w_c) > 0.5``, i.e. when the score ``h·w_c > 0``.

Active classes (``AC_k``) are given either as class indices or as a boolean mask of length ``C``
(:func:`active_class_indices`); anything else is refused.

**Undefined Eq. 9.**  A class that a client labels but where it has no positive (or no negative)
sample has ``N⁺ = 0`` (or ``N⁻ = 0``) and Eq. 9 divides by zero.  The convention here: the empty
side's term is dropped (its targets stay 0), so ``b_{k,c}`` is minus the mean of the negatives (or
the mean of the positives) alone.  When a whole class has no positive across ``S_c`` the class is
then fitted against negatives only and will be predicted all-negative.  Both cases raise
:class:`UndefinedBalanceWarning` (the simulator reports them per run).

**Round 2's threshold.**  With the ``±1/N`` targets of Eq. 9 the fitted scores are ``O(1/N)``, so
``σ(h·w_c)`` stays near 0.5 and never passes the paper's ``τ = 0.7``: round 2 as written adds no
pseudo-label.  :meth:`AnalyticClassifier.rescaled_scores` gives the documented variant that makes
``τ`` meaningful without looking at any test data (see there).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
import torch

from secure_afl.core.encoding import immutable, unpack_symmetric
from secure_afl.statistics import (  # the client's statistics: numpy, no torch (re-exported)
    ALL_GROUP,
    Balance,
    ClientStatistics,  # noqa: F401  (re-exported)
    Contributions,
    GramScope,
    GroupSums,
    MethodParameterError,  # noqa: F401  (re-exported)
    StatisticsError,
    UndefinedBalanceWarning,  # noqa: F401  (re-exported)
    active_class_indices,
    as_batches,
    balanced_labels,  # noqa: F401  (re-exported)
    balanced_projection,
    check_batch,
    check_method_parameter,
    check_options,
    class_group,
    client_statistics,  # noqa: F401  (re-exported)
    pseudo_group,
    pseudo_label_fewest_rows,
    resolve_device,
    warn_undefined,
)
from secure_afl.torch_threads import one_torch_thread


def _one_thread() -> AbstractContextManager[None]:
    """Small factorisations and skinny products on one torch thread: at 1024×1024 a second OpenMP
    thread saves little, and on a shared machine waiting for a busy core makes them many times
    slower."""
    return one_torch_thread()


@dataclass(frozen=True)
class PseudoLabelConfig:
    """Round-2 hyperparameters (paper Table IV)."""

    tau: float = 0.7
    alpha: float = 0.5
    min_pos: int = 5  # δ⁺
    min_neg: int = 50  # δ⁻

    def __post_init__(self) -> None:
        """Each value in its range (:data:`~secure_afl.statistics.METHOD_PARAMETERS`, the same rule
        as a deployment's study): :class:`MethodParameterError` names the first that is not."""
        for name in ("tau", "alpha", "min_pos", "min_neg"):
            object.__setattr__(self, name, check_method_parameter(name, getattr(self, name)))

    @property
    def fewest_rows(self) -> int:
        """The fewest rows with which a client can qualify for any missing class (Eq. 20):
        :func:`~secure_afl.statistics.pseudo_label_fewest_rows`."""
        return pseudo_label_fewest_rows(self.tau, self.min_pos, self.min_neg)


@dataclass(frozen=True)
class PseudoLabelReport:
    """What one client found for one missing class in round 2 (kept local; never uploaded)."""

    cls: int
    n_pseudo_pos: int
    n_pseudo_neg: int
    qualified: bool


PSEUDO_TENSOR = "b_pseudo"  # the paper's round 2 (Eq. 21)
PSEUDO_TENSOR_RESCALED = "b_pseudo_rescaled"  # the same rule on rescaled scores (not in the paper)


@dataclass(frozen=True)
class PseudoScoreRule:
    """What the server sent for round 2: clients score ``h·coef + offset`` and apply Eq. 19.

    The paper: the round-1 classifier, no offset, tensor ``b_pseudo``.  The rescaled-τ variant:
    :meth:`AnalyticClassifier.rescaled_scores`, tensor ``b_pseudo_rescaled``.
    """

    coef: np.ndarray
    offset: np.ndarray | None = None
    tensor: str = PSEUDO_TENSOR


def pseudo_label_contributions(
    features: np.ndarray | Iterable[np.ndarray],
    coef: np.ndarray,
    active: Sequence[int] | Sequence[bool] | np.ndarray,
    *,
    config: PseudoLabelConfig = PseudoLabelConfig(),
    batch_size: int = 4096,
    device: str = "auto",
    tensor: str = PSEUDO_TENSOR,
    offset: np.ndarray | None = None,
) -> tuple[Contributions, list[PseudoLabelReport]]:
    """Round 2 for one client (Eq. 18–21): pseudo-label projections for each missing class.

    Every missing class gets a ``pseudo/<c>`` contribution (tensor ``<tensor>/<c>``); a class that
    fails the minimum counts of Eq. 20 contributes zeros, so an observer of the upload cannot tell
    who qualified.  The client scores ``h·coef + offset`` with what the server sent (see
    :class:`PseudoScoreRule`).
    """
    out, reports = pseudo_label_rounds(
        features,
        [PseudoScoreRule(coef, offset, tensor)],
        active,
        config=config,
        batch_size=batch_size,
        device=device,
    )
    return out, reports[tensor]


def pseudo_label_rounds(
    features: np.ndarray | Iterable[np.ndarray],
    rules: Sequence[PseudoScoreRule],
    active: Sequence[int] | Sequence[bool] | np.ndarray,
    *,
    config: PseudoLabelConfig = PseudoLabelConfig(),
    batch_size: int = 4096,
    device: str = "auto",
) -> tuple[Contributions, dict[str, list[PseudoLabelReport]]]:
    """:func:`pseudo_label_contributions` for several rules in one pass over the features.

    Returns the contributions (every rule's tensors in the ``pseudo/<c>`` groups) and the reports
    per rule's tensor name.
    """
    if not rules or len({r.tensor for r in rules}) != len(rules):
        raise StatisticsError("give at least one rule, each with its own tensor name")
    coefs = [np.asarray(r.coef, dtype=np.float64) for r in rules]
    if any(c.ndim != 2 or c.shape != coefs[0].shape for c in coefs):
        raise StatisticsError(f"coef must be d×C (the same for every rule), got {[c.shape for c in coefs]}")
    d, n_classes = coefs[0].shape
    active = active_class_indices(active, n_classes)
    missing = [c for c in range(n_classes) if c not in active]
    m = len(missing)
    dev = resolve_device(device)
    w = torch.as_tensor(np.concatenate([c[:, missing] for c in coefs], axis=1), device=dev)
    offsets = [np.zeros(n_classes) if r.offset is None else np.asarray(r.offset, np.float64) for r in rules]
    shift = torch.as_tensor(np.concatenate([o[missing] for o in offsets]), device=dev)
    # rows: the pseudo-positive then the pseudo-negative feature sums of every (rule, class)
    sums = torch.zeros((2 * len(rules) * m, d), dtype=torch.float64, device=dev)
    counts = torch.zeros(2 * len(rules) * m, dtype=torch.float64, device=dev)
    for batch in as_batches(features, batch_size):
        batch = np.asarray(batch)
        check_batch(batch, d)
        h = torch.as_tensor(batch, device=dev).to(torch.float64)
        with _one_thread():
            p = torch.sigmoid(h @ w + shift)
        chosen = torch.cat([p > config.tau, p < 1 - config.tau], dim=1).to(torch.float64)
        with _one_thread():
            sums.addmm_(chosen.T, h)  # (selection)ᵀ·H: the long axis stays contiguous
        counts += chosen.sum(dim=0)
    out: Contributions = {pseudo_group(c): {} for c in missing}
    reports: dict[str, list[PseudoLabelReport]] = {}
    n_rules = len(rules)
    for i, rule in enumerate(rules):
        reports[rule.tensor] = []
        for j, c in enumerate(missing):
            pos, neg = i * m + j, n_rules * m + i * m + j
            npp, npn = int(counts[pos].item()), int(counts[neg].item())
            qualified = npp >= config.min_pos and npn >= config.min_neg
            b = np.zeros(d)
            if qualified:
                b = (sums[pos] / npp - sums[neg] / npn).cpu().numpy()
            out[pseudo_group(c)][f"{rule.tensor}/{c}"] = b
            reports[rule.tensor].append(PseudoLabelReport(c, npp, npn, qualified))
    return out, reports


def uploaded_by(
    *,
    balance: Balance = "client",
    gram: GramScope = "class",
    round2: bool = False,
    pseudo_tensor: str = PSEUDO_TENSOR,
) -> Callable[[str, str], bool]:
    """Which (group, tensor) pairs one configuration of the method sums (the per-method audit uses it)."""
    check_options(balance, gram)

    def needed(group: str, tensor: str) -> bool:
        if group.startswith("pseudo/"):
            return round2 and tensor.startswith(pseudo_tensor + "/")
        if group == ALL_GROUP:
            return gram == "global" or round2
        if tensor == "gram":
            return gram == "class"
        if balance == "client":
            return tensor.startswith("b/")
        return tensor.startswith(("pos_sum/", "n_pos/")) or tensor in ("feat_sum", "n")

    return needed


# ----------------------------------------------------------------------------------------------
# Aggregation and server side
# ----------------------------------------------------------------------------------------------


def sum_contributions(contributions: Iterable[Contributions]) -> Contributions:
    """Plaintext aggregation: the per-group, per-tensor sums (what secure aggregation also yields).

    A symmetric tensor given as its packed upper triangle is summed as one (the triangle of the
    full sum, bit for bit).  A group's first value is copied unless it is read-only and nothing
    writeable shares it (:func:`~secure_afl.core.encoding.immutable`): the sum of a group of one
    is then that very array."""
    sums: Contributions = {}
    for contribution in contributions:
        for group, tensors in contribution.items():
            target = sums.setdefault(group, {})
            for name, value in tensors.items():
                if name in target:
                    if target[name].shape != value.shape:
                        raise StatisticsError(
                            f"tensor {name!r} of group {group!r} has shape {value.shape} at one client "
                            f"and {target[name].shape} at another"
                        )
                    target[name] = target[name] + value
                elif isinstance(value, np.ndarray) and value.dtype == np.float64 and immutable(value):
                    target[name] = value  # no write can reach it: a sum of one needs no copy
                else:
                    target[name] = np.array(value, dtype=np.float64, copy=True)
    return sums


def _all_finite(matrix: torch.Tensor) -> bool:
    """Whether every entry is finite, a block of columns at a time (``torch.isfinite`` makes a
    temporary of the matrix's size: 128 MiB at d = 4096)."""
    values = matrix.detach().numpy()
    step = max(1, (1 << 20) // max(1, values.shape[0]))
    return all(bool(np.isfinite(values[:, j : j + step]).all()) for j in range(0, values.shape[1], step))


def _cholesky(a: np.ndarray | torch.Tensor, what: str) -> torch.Tensor:
    """Lower Cholesky factor, in float64 with torch (scipy's LAPACK fights torch's threads for cores).

    An array is copied (the caller keeps it).  A float64 torch tensor in column-major layout
    (:func:`_regularised_gram` makes one) is the caller's to give up: it is factored in its own
    memory and becomes the factor (the same LAPACK call on the same values and layout as the copy
    gets, so the same factor bit for bit; at d = 4096 no second 128 MiB matrix)."""
    in_place = (
        isinstance(a, torch.Tensor) and a.dtype == torch.float64 and a.ndim == 2 and a.mT.is_contiguous()
    )
    matrix = a if in_place else torch.as_tensor(a, dtype=torch.float64)
    if in_place and not _all_finite(matrix):  # checked before its values are overwritten
        raise StatisticsError(
            f"{what}: the regularised Gram matrix is not positive definite; "
            "check the statistics for NaN, or increase gamma"
        )
    with _one_thread():
        if in_place:
            factor, info = torch.linalg.cholesky_ex(matrix, out=(matrix, torch.empty((), dtype=torch.int32)))
        else:
            factor, info = torch.linalg.cholesky_ex(matrix)
    if int(info) != 0 or (not in_place and not _all_finite(matrix)):
        raise StatisticsError(
            f"{what}: the regularised Gram matrix is not positive definite; "
            "check the statistics for NaN, or increase gamma"
        )
    return factor


def _cho_solve(factor: torch.Tensor, b: np.ndarray) -> np.ndarray:
    rhs = torch.as_tensor(b, dtype=torch.float64).reshape(factor.shape[0], -1)
    with _one_thread():
        return torch.cholesky_solve(rhs, factor).reshape(np.shape(b)).numpy()


def solve_spd(a: np.ndarray, b: np.ndarray, what: str) -> np.ndarray:
    return _cho_solve(_cholesky(a, what), b)


def _tensor(sums: GroupSums, group: str, name: str) -> np.ndarray:
    try:
        return np.asarray(sums[group][name], dtype=np.float64)
    except KeyError:
        raise StatisticsError(
            f"no sum for tensor {name!r} of group {group!r}: every class needs at least one "
            "annotating client (and the 'all' group when gram='global' or round 2 is used)"
        ) from None


def _regularised_gram(gram: np.ndarray, gamma: float) -> torch.Tensor:
    """``G + γI`` in one fresh ``d×d`` matrix, column-major (LAPACK's layout: :func:`_cholesky`
    factors it in its own memory), from the full ``G`` or its packed upper triangle (1-D, as the
    aggregation may leave it): the triangle is unpacked straight into it, and ``γ`` added to the
    diagonal in place (the same values as ``G + γ·eye(d)``)."""
    # A triangle unpacks to an exactly symmetric matrix: its transpose is the same values, column-major.
    matrix = unpack_symmetric(gram).T if gram.ndim == 1 else np.array(gram, dtype=np.float64, order="F")
    diagonal = np.einsum("ii->i", matrix)  # a writeable view of the diagonal
    diagonal += gamma
    return torch.from_numpy(matrix)


class GramFactors:
    """Cholesky factors of one set of sums' regularised Grams ``G + γI``, each computed once.

    Models fitted on the same sums with the same ``γ`` (AFL, its global-balance and global-Gram
    variants, round 2's refinements) factorise the same matrices: give them one instance.  A Gram
    sum may be the full matrix or its packed upper triangle.  ``keep`` names the groups whose
    factors stay cached (None: every group's); :func:`fit_together` fits several models one Gram
    at a time, so a factor that is not kept is computed once and dropped after its last use (at
    d = 4096 a factor is 128 MiB).
    """

    def __init__(self, sums: GroupSums, gamma: float, *, keep: Collection[str] | None = None) -> None:
        self.sums = sums
        self.gamma = float(gamma)
        self.keep = None if keep is None else frozenset(keep)
        self._factors: dict[str, torch.Tensor] = {}

    def factor(self, group: str, what: str) -> torch.Tensor:
        """The lower factor of ``group``'s regularised Gram (``what`` names it in errors)."""
        factor = self._factors.get(group)
        if factor is None:
            factor = _cholesky(_regularised_gram(_tensor(self.sums, group, "gram"), self.gamma), what)
            if self.keep is None or group in self.keep:
                self._factors[group] = factor
        return factor

    def check_for(self, sums: GroupSums, gamma: float) -> GramFactors:
        if sums is not self.sums or float(gamma) != self.gamma:
            raise StatisticsError(
                "these Gram factors belong to other sums or another gamma: build GramFactors(sums, gamma) "
                "from the sums being fitted"
            )
        return self


def fit_together(
    models: Sequence[AnalyticClassifier], sums: GroupSums, *, factors: GramFactors | None = None
) -> None:
    """Round 1 (:meth:`AnalyticClassifier.fit`) for several models on the same sums, one Gram at a
    time: each group's factor is computed once, solves every class of every model that uses it,
    and is dropped unless ``factors`` keeps it.  Each coefficient is the same solve as a model
    fitted alone (one right-hand side at a time, the same factor), bit for bit.
    """
    if not models:
        return
    gammas = {m.gamma for m in models}
    if len(gammas) != 1:
        raise StatisticsError(f"models fitted together share one gamma, got {sorted(gammas)}")
    grams = models[0]._factors(sums, factors)
    uses: dict[str, tuple[str, list[tuple[int, int]]]] = {}  # group -> (its name in errors, (model, class))
    for i, model in enumerate(models):
        for c in range(model.n_classes):
            group, what = model._gram_group(c)
            uses.setdefault(group, (what, []))[1].append((i, c))
    columns: list[dict[int, np.ndarray]] = [{} for _ in models]
    for group, (what, needed) in uses.items():
        factor = grams.factor(group, what)
        for i, c in needed:
            columns[i][c] = _cho_solve(factor, models[i]._class_rhs(sums, c))
        del factor  # the last reference unless ``grams`` keeps it
    for model, solved in zip(models, columns, strict=True):
        model.coef_ = np.stack([solved[c] for c in range(model.n_classes)], axis=1)


class AnalyticClassifier:
    """The paper's closed-form multi-label classifier, fitted on aggregated statistics.

    >>> model = AnalyticClassifier(n_classes=8, gamma=1.0).fit(sums)   # doctest: +SKIP
    >>> model.predict(features)                                         # doctest: +SKIP
    """

    def __init__(
        self,
        n_classes: int,
        *,
        gamma: float = 1.0,
        balance: Balance = "client",
        gram: GramScope = "class",
    ) -> None:
        gamma = check_method_parameter("gamma", gamma)
        check_options(balance, gram)
        self.n_classes = n_classes
        self.gamma = float(gamma)
        self.balance = balance
        self.gram = gram
        self.coef_: np.ndarray | None = None

    def _class_rhs(self, sums: GroupSums, c: int) -> np.ndarray:
        group = class_group(c)
        if self.balance == "client":
            return _tensor(sums, group, f"b/{c}")
        # As in Eq. 9, a side with no sample (no positive anywhere in S_c) contributes nothing.
        n_pos = round(float(_tensor(sums, group, f"n_pos/{c}")[0]))
        n = round(float(_tensor(sums, group, "n")[0]))
        if n_pos in (0, n):
            warn_undefined(c, n_pos, n, "global balance over S_c")
        pos_sum = _tensor(sums, group, f"pos_sum/{c}")
        return balanced_projection(pos_sum, _tensor(sums, group, "feat_sum"), n_pos, n)

    def _factors(self, sums: GroupSums, factors: GramFactors | None) -> GramFactors:
        return GramFactors(sums, self.gamma) if factors is None else factors.check_for(sums, self.gamma)

    def fit(self, sums: GroupSums, *, factors: GramFactors | None = None) -> AnalyticClassifier:
        """Round 1 (Eq. 15–17): one Cholesky solve per class on the per-group sums.

        ``factors``: the sums' :class:`GramFactors`, shared with other models fitted on them.
        """
        fit_together([self], sums, factors=factors)
        return self

    def _gram_group(self, c: int) -> tuple[str, str]:
        """The group whose Gram class ``c``'s solve uses, and its name in errors."""
        return (ALL_GROUP, "the global Gram") if self.gram == "global" else (class_group(c), f"class {c}")

    def training_score_means(self, sums: GroupSums) -> tuple[np.ndarray, np.ndarray]:
        """Per class, the mean fitted score ``h·w_c`` of the labelled positives and of the labelled
        negatives of ``S_c``: ``(m⁺, m⁻)``, exactly, from the class group's sums of ``pos_sum/<c>``,
        ``n_pos/<c>``, ``feat_sum`` and ``n`` (the ``balance="global"`` upload)."""
        coef = self._coef()
        m_pos, m_neg = np.empty(self.n_classes), np.empty(self.n_classes)
        for c in range(self.n_classes):
            group = class_group(c)
            try:
                pos_sum = np.asarray(sums[group][f"pos_sum/{c}"], dtype=np.float64)
                n_pos = round(float(np.asarray(sums[group][f"n_pos/{c}"])[0]))
                feat_sum = np.asarray(sums[group]["feat_sum"], dtype=np.float64)
                n = round(float(np.asarray(sums[group]["n"])[0]))
            except KeyError:
                raise StatisticsError(
                    f"class {c}: the mean training scores need the class group's sums of pos_sum/{c}, "
                    f"n_pos/{c}, feat_sum and n: upload contributions(..., balance='global') as well"
                ) from None
            if n_pos in (0, n):
                raise StatisticsError(
                    f"class {c} has no labelled {'positive' if n_pos == 0 else 'negative'} in S_c: "
                    "its mean training scores are undefined"
                )
            m_pos[c] = float(coef[:, c] @ pos_sum) / n_pos
            m_neg[c] = float(coef[:, c] @ (feat_sum - pos_sum)) / (n - n_pos)
        return m_pos, m_neg

    def rescaled_scores(self, sums: GroupSums) -> tuple[np.ndarray, np.ndarray]:
        """``(coef, offset)`` of the rescaled score ``(2·h·w_c − (m⁺ + m⁻)) / (m⁺ − m⁻)``.

        The variant of round 2 that makes ``τ`` meaningful (not in the paper).  With the ``±1/N``
        targets of Eq. 9 the fitted scores are ``O(1/N)``, so ``σ(h·w_c)`` never passes τ = 0.7.
        On the rescaled score, +1 is exactly the mean training score of the labelled positives of
        ``S_c`` and −1 that of its labelled negatives (:meth:`training_score_means`), so the paper's
        unchanged rule ``σ(·) > τ`` (rescaled score > 0.85) takes samples that score like the
        average labelled positive, and ``σ(·) < 1 − τ`` those that score like the average labelled
        negative.  Only training statistics that the server holds enter (no test data, nothing
        tuned); the server sends ``coef`` and ``offset`` instead of ``W⁽¹⁾``.
        """
        coef = self._coef()
        m_pos, m_neg = self.training_score_means(sums)
        gap = m_pos - m_neg
        if not (gap > 0).all():
            bad = int(np.flatnonzero(~(gap > 0))[0])
            raise StatisticsError(
                f"class {bad}: its labelled positives do not score above its negatives on the training "
                f"data (m+ = {m_pos[bad]:.3g}, m- = {m_neg[bad]:.3g}); the rescaled score is undefined"
            )
        return coef * (2 / gap), -(m_pos + m_neg) / gap

    def refine(
        self,
        round1_sums: GroupSums,
        pseudo_sums: GroupSums,
        *,
        alpha: float = 0.5,
        pseudo_tensor: str = PSEUDO_TENSOR,
        factors: GramFactors | None = None,
    ) -> AnalyticClassifier:
        """Round 2 (Eq. 22–24): global Gram, real plus ``α``-weighted pseudo-label projections.

        ``factors``: ``round1_sums``' :class:`GramFactors`, shared with other models fitted on them.
        """
        # The solve accepts Eq. 23's limit α = 0 (round 1 with the global Gram); a configuration
        # (PseudoLabelConfig, a deployment's study) refuses it: round 2 would then be sent for nothing.
        if not 0 <= alpha <= 1:
            raise StatisticsError(f"alpha must lie in [0, 1], got {alpha}")
        factor = self._factors(round1_sums, factors).factor(ALL_GROUP, "the global Gram")
        columns = []
        for c in range(self.n_classes):
            rhs = self._class_rhs(round1_sums, c)
            if pseudo_group(c) in pseudo_sums:
                rhs = rhs + alpha * _tensor(pseudo_sums, pseudo_group(c), f"{pseudo_tensor}/{c}")
            columns.append(_cho_solve(factor, rhs))
        self.coef_ = np.stack(columns, axis=1)
        return self

    def _coef(self) -> np.ndarray:
        if self.coef_ is None:
            raise StatisticsError("the classifier is not fitted: call fit() with aggregated statistics first")
        return self.coef_

    def decision_function(self, features: np.ndarray) -> np.ndarray:
        coef = self._coef()
        features = np.asarray(features)
        check_batch(features, coef.shape[0])
        return np.asarray(features, dtype=np.float64) @ coef

    def predict_proba(self, features: np.ndarray) -> np.ndarray:
        """``σ(h·w_c)``; for ranking metrics use :meth:`decision_function` (σ saturates and ties)."""
        return torch.sigmoid(torch.as_tensor(self.decision_function(features))).numpy()

    def predict(self, features: np.ndarray) -> np.ndarray:
        """``σ(h·w_c) > 0.5``, computed as ``h·w_c > 0`` (the same decision, without rounding)."""
        return (self.decision_function(features) > 0).astype(np.int8)
