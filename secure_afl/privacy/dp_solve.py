"""The server's side of DP: the noisy group sums turned into a well-posed ridge solve.

Everything here is post-processing of the noisy sums, so it costs no privacy.

- The class statistics arrive as positive and negative sums and counts; the server rebuilds the
  ``balance="global"`` tensors (``feat_sum = pos + neg``, ``n = n_pos + n_neg``) with the noisy
  counts rounded and floored at 1 (a count cannot be below one of the rows it divides).
- The noisy Gram ``G + E`` may be indefinite.  Following Wang (UAI 2018, "Revisiting
  differentially private linear regression"), the ridge gets a **data-independent** term ``λ``
  from the noise scale alone: for a symmetric ``d×d`` noise matrix with independent entries of
  standard deviation ``s`` (diagonal and upper triangle; the discrete Gaussian is
  ``s²``-sub-Gaussian), ``‖E‖₂ ≤ s·(2√d + 6√(ln d) + 2√(ln(1/β)))`` except with probability about
  ``β`` (Bandeira–van Handel's bound on the expectation plus Gaussian concentration).  Then
  ``G + E + λI ⪰ G ⪰ 0`` and ``A = G + E + (γ + λ)I`` is positive definite: Cholesky as always.
- Should that high-probability bound fail (Cholesky refuses), the Gram's eigenvalues are floored
  at 0 (its projection onto the positive semidefinite cone) before adding ``(γ + λ)I``; the report
  says which was used.  Still a Cholesky solve, never an inverse.

The adaptive ridge (``DpConfig.ridge``), in the style of AdaSSP (Wang 2018, Algorithm 2)
------------------------------------------------------------------------------------------
The bound ``B`` above is what it takes to make ``G + E`` positive semidefinite when nothing is
known about ``G``.  A Gram whose smallest eigenvalue is already large needs less:
``G + E + λI ⪰ (λ_min(G) + λ − ‖E‖)I ⪰ 0`` as soon as ``λ ≥ B − λ_min(G)``.  AdaSSP therefore
takes ``λ = max(0, B − λ̃_min)`` with ``λ̃_min`` a high-probability *lower* bound on
``λ_min(G)`` (the same guarantee as ``λ = B``: PSD before ``γ``, positive definite after).  Here
``λ_min(G)`` is a function of every client's rows, which no party holds, and secure aggregation
releases only sums.  Two ways to get ``λ̃_min``:

- ``"adaptive"`` (post-processing, free): from the noisy Gram itself.  By Weyl,
  ``λ_min(G) ≥ λ_min(G + E) − ‖E‖ ≥ λ_min(G + E) − B``, so ``λ̃_min = max(0, λ_min(G + E) − B)``.
  Costs no budget, but the estimate is off by up to ``‖E‖`` (the whole Gram noise), so it only
  lowers the ridge once ``λ_min(G)`` exceeds about ``2B``.
- ``"adassp"`` (AdaSSP's noise-on-λ_min form): each client also sends ``λ_min(G_k)`` of its own
  Gram (one number, sensitivity ``C²`` by Weyl, its own ρ share ``eigen_share`` composed with the
  other blocks in the accountant).  The sum ``S = Σ_k λ_min(G_k) ≤ λ_min(Σ_k G_k)`` (superadditivity
  of λ_min over PSD matrices) is a lower bound secure aggregation can carry; with noise ``Z`` of std
  ``s_λ`` (at the Gram's survivors, the same group), ``λ̃_min = max(0, S + Z − s_λ·√(2 ln(1/β)))``
  is below ``λ_min(G)`` except with probability about β.  For IID clients ``S`` is close to
  ``λ_min(G)`` (each client's smallest eigenvalue is a share of the whole), and its noise is a
  scalar's, not a matrix's: it adapts where the post-processing form cannot.

A growing chain (:mod:`secure_afl.privacy.dp_growth`): the sums accumulated over K DP sessions
carry independent noise of std ``s_k`` per session, so :func:`fit_private` with ``chain`` takes
``s = √(Σ_k s_k²)`` in the bound above (and likewise for the λ_min release), once, at β.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from secure_afl.analytic import (
    ALL_GROUP,
    AnalyticClassifier,
    GroupSums,
    PseudoLabelConfig,
    StatisticsError,
    class_group,
    pseudo_group,
)
from secure_afl.privacy.dp import (
    EIGEN_TENSOR,
    POSITIVE_COUNT,
    POSITIVE_SUM,
    TOTAL_COUNT,
    TOTAL_SUM,
    NoisePlan,
)
from secure_afl.privacy.dp_growth import ChainNoise
from secure_afl.privacy.projection import lift_weights, projection_digest


@dataclass(frozen=True)
class PrivateSolve:
    """How the noisy statistics were made solvable."""

    ridge: float  # λ added to γ
    gram_noise_std: float  # per entry of the summed Gram, at the actual survivors
    eigenvalue_floor: bool  # True when the PSD projection was needed
    qualified: tuple[int, ...] = ()  # round 2: classes whose federation counts passed δ⁺, δ⁻
    ridge_kind: str = "bound"  # DpConfig.ridge
    noise_bound: float = 0.0  # B: the high-probability bound on the Gram noise's spectral norm
    min_eigenvalue_bound: float | None = None  # λ̃_min (adaptive ridges), a lower bound on λ_min(G)


def _noisy_count(value: np.ndarray) -> int:
    return max(1, round(float(np.asarray(value).ravel()[0])))


def analytic_sums(sums: GroupSums, n_classes: int) -> dict[str, dict[str, np.ndarray]]:
    """The ``balance="global"``, ``gram="global"`` tensors of :class:`AnalyticClassifier`.

    With ``class_sums="positives"`` (the ``all`` group holds ``total_sum``): per class the tensors
    whose balanced projection is ``wpos_sum/n⁺_w − total_sum/n_total`` (the positives' weighted mean
    minus the federation's mean, see :mod:`secure_afl.privacy.dp`).
    """
    out: dict[str, dict[str, np.ndarray]] = {ALL_GROUP: {"gram": np.asarray(sums[ALL_GROUP]["gram"])}}
    if TOTAL_SUM in sums.get(ALL_GROUP, {}):
        return _positives_sums(sums, n_classes, out)
    for c in range(n_classes):
        group = sums.get(class_group(c))
        if group is None:
            raise StatisticsError(f"no sums for class {c}: every class needs an annotating survivor")
        n_pos = _noisy_count(group[f"n_pos/{c}"])
        n_neg = _noisy_count(group[f"n_neg/{c}"])
        pos = np.asarray(group[f"pos_sum/{c}"], dtype=np.float64)
        neg = np.asarray(group[f"neg_sum/{c}"], dtype=np.float64)
        out[class_group(c)] = _balanced_tensors(c, pos, n_pos, neg, n_neg)
    return out


def _balanced_tensors(
    c: int, pos: np.ndarray, n_pos: int, negatives: np.ndarray, n_neg: int
) -> dict[str, np.ndarray]:
    """The class group's tensors whose balanced projection is ``pos/n_pos − negatives/n_neg``."""
    return {
        f"pos_sum/{c}": pos,
        f"n_pos/{c}": np.array([float(n_pos)]),
        "feat_sum": pos + negatives,
        "n": np.array([float(n_pos + n_neg)]),
    }


def _positives_sums(
    sums: GroupSums, n_classes: int, out: dict[str, dict[str, np.ndarray]]
) -> dict[str, dict[str, np.ndarray]]:
    total = np.asarray(sums[ALL_GROUP][TOTAL_SUM], dtype=np.float64)
    try:
        n_total = _noisy_count(sums[ALL_GROUP][TOTAL_COUNT])
    except KeyError:
        raise StatisticsError(f"the 'all' group has {TOTAL_SUM} but not {TOTAL_COUNT}") from None
    for c in range(n_classes):
        group = sums.get(class_group(c))
        if group is None or f"{POSITIVE_SUM}/{c}" not in group:
            raise StatisticsError(f"no positive sums for class {c}: every class needs an annotating survivor")
        weighted = float(np.asarray(group[f"{POSITIVE_COUNT}/{c}"]).ravel()[0])
        # the classifier divides by a whole count: rescale the sum so that the mean is unchanged
        n_pos = _noisy_count(np.array([weighted]))
        pos = np.asarray(group[f"{POSITIVE_SUM}/{c}"], dtype=np.float64) * (n_pos / max(weighted, 1.0))
        out[class_group(c)] = _balanced_tensors(c, pos, n_pos, total, n_total)  # the federation's mean
    return out


def ridge_for_noise(noise_std: float, dim: int, failure_probability: float) -> float:
    """``λ = s·(2√d + 6√(ln d) + 2√(ln(1/β)))``: bounds ‖E‖₂ except with probability about β."""
    return noise_std * (
        2.0 * math.sqrt(dim)
        + 6.0 * math.sqrt(math.log(max(dim, 2)))
        + 2.0 * math.sqrt(math.log(1 / failure_probability))
    )


def _psd_floor(gram: np.ndarray) -> np.ndarray:
    values, vectors = np.linalg.eigh((gram + gram.T) / 2)
    return (vectors * np.maximum(values, 0.0)) @ vectors.T


def tail_multiple(failure_probability: float) -> float:
    """``√(2 ln(1/β))``: a σ-sub-Gaussian scalar exceeds this many σ with probability at most β."""
    return math.sqrt(2.0 * math.log(1.0 / failure_probability))


def adassp_lower(eigen_sum: float, eigen_std: float, failure_probability: float) -> float:
    """λ̃_min of the ``"adassp"`` ridge: the noisy sum ``S + Z`` of the clients' λ_min(G_k) less
    ``√(2 ln(1/β))`` of its noise std, floored at 0 (module docstring)."""
    return max(0.0, eigen_sum - eigen_std * tail_multiple(failure_probability))


def derived_ridge(
    kind: str,
    gram_std: float,
    dim: int,
    failure_probability: float,
    *,
    eigen_sum: float | None = None,
    eigen_std: float | None = None,
) -> float | None:
    """The ridge λ of a ``kind`` a party can size from public facts alone: ``"bound"`` from the
    Gram's noise std (``gram_std``, at its survivors) and the statistics' dimension; ``"adassp"``
    also from the noisy λ_min sum ``eigen_sum`` and its std.  None for ``"adaptive"``, which needs
    the noisy Gram's smallest eigenvalue (only the party holding the Gram can size it).  The solve
    (:func:`fit_private`) and the nodes' classifier check (deploy/verify.py) both size it here."""
    bound = ridge_for_noise(gram_std, dim, failure_probability)
    if kind == "bound":
        return bound
    if kind == "adassp":
        if eigen_sum is None or eigen_std is None:
            raise StatisticsError("the adassp ridge needs the noisy λ_min sum and its noise std")
        return max(0.0, bound - adassp_lower(eigen_sum, eigen_std, failure_probability))
    return None


def min_eigenvalue_bound(
    sums: GroupSums,
    plan: NoisePlan,
    gram: np.ndarray,
    bound: float,
    survivors: int,
    *,
    eigen_std: float | None = None,
) -> float:
    """λ̃_min, a lower bound on the Gram's smallest eigenvalue (except with probability about β),
    from the noisy release alone (post-processing): see the module docstring.

    ``eigen_std``: the noise std of the summed λ_min release when it is not one session's at
    ``survivors`` (a growing chain's, :class:`~secure_afl.privacy.dp_growth.ChainNoise`)."""
    beta = plan.config.ridge_failure_probability
    if plan.config.ridge == "adassp":
        try:
            noisy = float(np.asarray(sums[ALL_GROUP][EIGEN_TENSOR]).ravel()[0])
        except KeyError:
            raise StatisticsError(
                f"ridge 'adassp' needs the sum of every client's {EIGEN_TENSOR} in the 'all' group"
            ) from None
        std = plan.blocks[(ALL_GROUP, "eigen")].group_std(survivors) if eigen_std is None else eigen_std
        return adassp_lower(noisy, std, beta)
    values = np.linalg.eigvalsh((gram + gram.T) / 2)
    return max(0.0, float(values[0]) - bound)


def fit_private(
    sums: GroupSums,
    plan: NoisePlan,
    *,
    n_classes: int,
    gamma: float,
    gram_survivors: int,
    chain: ChainNoise | None = None,
) -> tuple[AnalyticClassifier, PrivateSolve, dict[str, dict[str, np.ndarray]]]:
    """Round 1 on noisy sums: the model, how it was made solvable, and the sums it used.

    The model lives in the statistics' space (K dimensions under ``--dp-dim``: :func:`lift`
    maps it back to the features').  The ridge is ``plan.config.ridge``'s (module docstring).

    ``chain``: a growing study's sums accumulated over several DP sessions
    (:mod:`secure_afl.privacy.dp_growth`): the ridge is sized from the chain's noise std
    ``√(Σ_k s_k²)`` (and the λ_min release's likewise), with ``plan``'s failure probability once
    for this final solve; the noisy counts are rounded and floored at 1 here, after accumulation.
    """
    converted = analytic_sums(sums, n_classes)
    block = plan.blocks[(ALL_GROUP, "gram")]
    std = block.group_std(gram_survivors) if chain is None else chain.gram_std
    dim = converted[ALL_GROUP]["gram"].shape[0]
    beta = plan.config.ridge_failure_probability
    bound = ridge_for_noise(std, dim, beta)
    kind = plan.config.ridge
    lower = None
    ridge = bound
    if kind != "bound":
        lower = min_eigenvalue_bound(
            sums,
            plan,
            converted[ALL_GROUP]["gram"],
            bound,
            gram_survivors,
            eigen_std=None if chain is None else chain.eigen_std,
        )
        ridge = max(0.0, bound - lower)  # = derived_ridge's for "adassp" (the same λ̃_min)
    model = AnalyticClassifier(n_classes, gamma=gamma + ridge, balance="global", gram="global")
    floored = False
    try:
        model.fit(converted)
    except StatisticsError:
        converted[ALL_GROUP]["gram"] = _psd_floor(converted[ALL_GROUP]["gram"])
        model.fit(converted)
        floored = True
    solve = PrivateSolve(ridge, std, floored, ridge_kind=kind, noise_bound=bound, min_eigenvalue_bound=lower)
    return model, solve, converted


def lift(model: AnalyticClassifier, projection: np.ndarray | None) -> AnalyticClassifier:
    """The classifier on the original features: ``W = P W_K`` under ``--dp-dim`` (else ``model``).

    ``lift(model, P).decision_function(x)`` equals ``model.decision_function(x @ P)`` up to float64
    rounding, so predictions need no knowledge of the projection.
    """
    if projection is None:
        return model
    out = AnalyticClassifier(model.n_classes, gamma=model.gamma, balance=model.balance, gram=model.gram)
    out.coef_ = lift_weights(projection, model._coef())
    return out


def refine_private(
    model: AnalyticClassifier,
    round1: Mapping[str, Mapping[str, np.ndarray]],
    pseudo_sums: GroupSums,
    solve: PrivateSolve,
    *,
    n_classes: int,
    config: PseudoLabelConfig,
    count_noise_std: Mapping[int, float] | None = None,
) -> tuple[AnalyticClassifier, PrivateSolve]:
    """Round 2 on noisy pseudo-label sums; Eq. 20's δ⁺/δ⁻ applied to the federation's noisy counts.

    A class qualifies only when both noisy counts exceed δ⁺ (δ⁻) by three noise standard deviations
    (``count_noise_std``, per class): otherwise noise alone would often pass the thresholds (a count
    of 0 with noise of std 40 exceeds 5 almost half the time) and a pure-noise pseudo-label sum,
    divided by a small noisy count, would be added to the class's right-hand side.
    """
    stds = count_noise_std or {}
    pseudo: dict[str, dict[str, np.ndarray]] = {}
    qualified = []
    for c in range(n_classes):
        group = pseudo_sums.get(pseudo_group(c))
        if group is None:
            continue
        n_pp = round(float(np.asarray(group[f"pseudo_n_pos/{c}"]).ravel()[0]))
        n_pn = round(float(np.asarray(group[f"pseudo_n_neg/{c}"]).ravel()[0]))
        margin = 3.0 * stds.get(c, 0.0)
        if n_pp - margin >= config.min_pos and n_pn - margin >= config.min_neg:
            b = (
                np.asarray(group[f"pseudo_pos_sum/{c}"]) / n_pp
                - np.asarray(group[f"pseudo_neg_sum/{c}"]) / n_pn
            )
            pseudo[pseudo_group(c)] = {f"b_pseudo/{c}": b}
            qualified.append(c)
    refined = AnalyticClassifier(n_classes, gamma=model.gamma, balance="global", gram="global")
    refined.refine(round1, pseudo, alpha=config.alpha)
    return refined, replace(solve, qualified=tuple(qualified))


def pseudo_count_noise_std(plan: NoisePlan, survivors: Mapping[str, int]) -> dict[int, float]:
    """Per class, the noise std of round 2's summed counts at the actual survivors of ``pseudo/c``."""
    out = {}
    for group, count in survivors.items():
        if group.startswith("pseudo/"):
            out[int(group.split("/")[1])] = plan.blocks[(group, "counts")].group_std(count)
    return out


def plan_record(plan: NoisePlan, *, feature_dim: int | None = None) -> dict[str, object]:
    """The part of a release's privacy record that the noise plan alone decides (the settings, ε spent
    per institution, the noise per block, the ridge's kind): what every party derives from the study,
    so a node can check that a classifier file states it (deploy/classifier.py), not the solve."""
    cfg = plan.config
    projection = None
    if cfg.projection_dim is not None:
        if feature_dim is None:
            raise StatisticsError("the privacy record of a projected release needs the feature dimension")
        projection = {
            "kind": "rademacher ±1/√K from SHAKE-256 (secure_afl/privacy/projection.py)",
            "feature_dim": feature_dim,
            "dim": cfg.projection_dim,
            "seed": cfg.projection_seed,
            "sha256": projection_digest(feature_dim, cfg.projection_dim, cfg.projection_seed),
        }
    blocks = [
        {
            "group": b.group,
            "block": b.kind,
            "sensitivity": b.sensitivity,
            "grid_bits": b.grid_bits,
            "rounding_clients": b.rounding_clients,
            "members": b.members,
            "fewest_survivors": b.fewest,
            "noise_std_at_fewest": b.group_std(),
            "client_noise_std": b.group_std(1),
            "rho": b.rho,
            "xi": b.xi,
        }
        for b in plan.blocks.values()
    ]
    return {
        "epsilon_target": cfg.epsilon,
        "delta": cfg.delta,
        "clip": cfg.clip,
        "unit": cfg.unit,
        "max_images_per_patient": cfg.max_images_per_patient if cfg.unit == "patient" else None,
        "rho_shares": list(cfg.rho_shares),
        "class_sums": cfg.class_sums,
        "row_centre": cfg.row_centre,
        "total_share": cfg.total_share if cfg.class_sums == "positives" else None,
        "epsilon_spent": plan.epsilons(),
        "mechanism": cfg.mechanism,
        "projection": projection,
        "ridge_kind": cfg.ridge,
        "eigen_share": cfg.eigen_share if cfg.ridge == "adassp" else None,
        "blocks": blocks,
    }


# The keys privacy_record adds to plan_record's (a node refuses a file whose record holds others).
SOLVE_RECORD_KEYS = (
    "ridge", "ridge_noise_bound", "min_eigenvalue_lower_bound", "gram_noise_std", "eigenvalue_floor",
    "round2_qualified_classes",
)  # fmt: skip


def privacy_record(
    plan: NoisePlan,
    solve: PrivateSolve,
    solve2: PrivateSolve | None,
    *,
    feature_dim: int | None = None,
    chain: ChainNoise | None = None,
) -> dict[str, object]:
    """What every party may know about the DP of a release: the settings, ε spent per institution,
    the noise per block, the solve (nothing computed from one institution's data alone).

    ``feature_dim``: the features' dimension d, for the projection's record (under ``--dp-dim``).
    ``chain``: a growing study's DP sessions (this one last): the record's ``growth`` part holds
    every session's ε per institution and the chain's (:meth:`ChainNoise.record`);
    ``epsilon_spent`` and ``blocks`` stay this session's.
    """
    return {
        **plan_record(plan, feature_dim=feature_dim),
        "ridge": solve.ridge,
        "ridge_noise_bound": solve.noise_bound,
        "min_eigenvalue_lower_bound": solve.min_eigenvalue_bound,
        "gram_noise_std": solve.gram_noise_std,
        "eigenvalue_floor": solve.eigenvalue_floor,
        "round2_qualified_classes": list(solve2.qualified) if solve2 is not None else None,
        **({} if chain is None else {"growth": chain.record()}),
    }
