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
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

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
from secure_afl.privacy.dp import NoisePlan


@dataclass(frozen=True)
class PrivateSolve:
    """How the noisy statistics were made solvable."""

    ridge: float  # λ added to γ
    gram_noise_std: float  # per entry of the summed Gram, at the actual survivors
    eigenvalue_floor: bool  # True when the PSD projection was needed
    qualified: tuple[int, ...] = ()  # round 2: classes whose federation counts passed δ⁺, δ⁻


def _noisy_count(value: np.ndarray) -> int:
    return max(1, round(float(np.asarray(value).ravel()[0])))


def analytic_sums(sums: GroupSums, n_classes: int) -> dict[str, dict[str, np.ndarray]]:
    """The ``balance="global"``, ``gram="global"`` tensors of :class:`AnalyticClassifier`."""
    out: dict[str, dict[str, np.ndarray]] = {ALL_GROUP: {"gram": np.asarray(sums[ALL_GROUP]["gram"])}}
    for c in range(n_classes):
        group = sums.get(class_group(c))
        if group is None:
            raise StatisticsError(f"no sums for class {c}: every class needs an annotating survivor")
        n_pos = _noisy_count(group[f"n_pos/{c}"])
        n_neg = _noisy_count(group[f"n_neg/{c}"])
        pos = np.asarray(group[f"pos_sum/{c}"], dtype=np.float64)
        neg = np.asarray(group[f"neg_sum/{c}"], dtype=np.float64)
        out[class_group(c)] = {
            f"pos_sum/{c}": pos,
            f"n_pos/{c}": np.array([float(n_pos)]),
            "feat_sum": pos + neg,
            "n": np.array([float(n_pos + n_neg)]),
        }
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


def fit_private(
    sums: GroupSums,
    plan: NoisePlan,
    *,
    n_classes: int,
    gamma: float,
    gram_survivors: int,
) -> tuple[AnalyticClassifier, PrivateSolve, dict[str, dict[str, np.ndarray]]]:
    """Round 1 on noisy sums: the model, how it was made solvable, and the sums it used."""
    converted = analytic_sums(sums, n_classes)
    block = plan.blocks[(ALL_GROUP, "gram")]
    std = block.group_std(gram_survivors)
    dim = converted[ALL_GROUP]["gram"].shape[0]
    ridge = ridge_for_noise(std, dim, plan.config.ridge_failure_probability)
    model = AnalyticClassifier(n_classes, gamma=gamma + ridge, balance="global", gram="global")
    floored = False
    try:
        model.fit(converted)
    except StatisticsError:
        converted[ALL_GROUP]["gram"] = _psd_floor(converted[ALL_GROUP]["gram"])
        model.fit(converted)
        floored = True
    return model, PrivateSolve(ridge, std, floored), converted


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
    return refined, PrivateSolve(solve.ridge, solve.gram_noise_std, solve.eigenvalue_floor, tuple(qualified))


def pseudo_count_noise_std(plan: NoisePlan, survivors: Mapping[str, int]) -> dict[int, float]:
    """Per class, the noise std of round 2's summed counts at the actual survivors of ``pseudo/c``."""
    out = {}
    for group, count in survivors.items():
        if group.startswith("pseudo/"):
            out[int(group.split("/")[1])] = plan.blocks[(group, "counts")].group_std(count)
    return out


def privacy_record(plan: NoisePlan, solve: PrivateSolve, solve2: PrivateSolve | None) -> dict[str, object]:
    """What every party may know about the DP of a release: the settings, ε spent per institution,
    the noise per block, the solve (nothing computed from one institution's data alone)."""
    cfg = plan.config
    blocks = [
        {
            "group": b.group,
            "block": b.kind,
            "sensitivity": b.sensitivity,
            "grid_bits": b.grid_bits,
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
        "epsilon_spent": plan.epsilons(),
        "blocks": blocks,
        "ridge": solve.ridge,
        "gram_noise_std": solve.gram_noise_std,
        "eigenvalue_floor": solve.eigenvalue_floor,
        "round2_qualified_classes": list(solve2.qualified) if solve2 is not None else None,
    }
