"""What the user asks of differential privacy: (ε, δ), the clip bound, the protected unit.

Kept apart from :mod:`secure_afl.privacy.dp` (which imports the analytic method, hence torch) so that
the deployment's study can validate DP settings in processes that never compute statistics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

DpUnit = Literal["image", "patient"]
# How the server makes the noisy Gram solvable (secure_afl/privacy/dp_solve.py):
#   "bound":    λ = a high-probability bound on the Gram noise's spectral norm, data-independent;
#   "adaptive": λ = max(0, bound − λ̃_min), λ̃_min a lower bound on the Gram's smallest eigenvalue
#               read off the already-noised Gram (post-processing: no budget);
#   "adassp":   the same with λ̃_min from a separately noised release of Σ_k λ_min(G_k) (its own ρ share).
DpRidge = Literal["bound", "adaptive", "adassp"]
DP_RIDGES: tuple[str, ...] = ("bound", "adaptive", "adassp")
# The ridges any party can size from public facts (dp_solve.derived_ridge): the ones the deployment's
# classifier check covers ("adaptive" needs the noisy Gram's spectrum, which only its holder has).
DERIVABLE_RIDGES: tuple[str, ...] = ("bound", "adassp")
# The K that --dp-sweep compares with today's mechanism when --dp-dim is not given: the best mean AUC
# of the K sweep on the embedded data (bench/history/dp.md, "DP: a projection before the statistics"),
# where no K beats the unprojected statistics; --dp-dim itself has no default (off).
DEFAULT_DP_DIM = 128
# The ridge when --dp-ridge is not given: the adaptive one with a projection, today's without.
DEFAULT_RIDGE_WITH_DIM = "adaptive"
# What the class groups carry (secure_afl/privacy/dp.py, "Class sums"):
#   "split":     per class the positive and the negative sums and counts (every image moves every
#                class block of its institution: the sums' ρ is divided among the labelled classes);
#   "positives": per class only label-normalised positive sums and counts (an image with k labelled
#                positives adds h/√k to each: all class blocks together move by at most C), and one
#                total sum and count in ``all`` that stands for the negatives' mean.
DpClassSums = Literal["split", "positives"]
# --clip when not given: the default, and the one for rows centred by --dp-row-centre.  The centred
# rows of the embedded data's public generator drawn with another seed have a median norm of about
# 20.7 (bench/history/dp.md); a deployment takes its clip from public data of its own backbone.
DEFAULT_CLIP = 32.0
DEFAULT_CENTRED_CLIP = 20.0
DP_CLASS_SUMS: tuple[str, ...] = ("split", "positives")


def default_ridge(ridge: str | None, projection_dim: int | None) -> str:
    """``ridge``, or its default: :data:`DEFAULT_RIDGE_WITH_DIM` under ``--dp-dim``, else "bound"."""
    if ridge is not None:
        return ridge
    return DEFAULT_RIDGE_WITH_DIM if projection_dim is not None else "bound"


# A client's rows (after the patient cap) at most: the plan checks from it, the clip and the group
# sizes that no statistic can overflow the fixed-point encoding.  100,000 fits groups of up to 20
# institutions at the default clip 32 and 32 fractional bits (2^31 / 20 / 32² ≈ 104,857 rows).
DEFAULT_MAX_ROWS = 100_000
# Under DP, round 2's pseudo-label threshold must keep the two pseudo-label sets disjoint.
MIN_PSEUDO_TAU = 0.5


class DpError(ValueError):
    """A differential-privacy setting or input that cannot be used (with how to fix it)."""


@dataclass(frozen=True)
class DpConfig:
    """What the user asks for: (ε, δ), the clip bound, the protected unit.

    ``rho_shares``: the public split of the ρ budget between the Gram, the class feature sums and
    the class counts.  The sums carry the signal the classifier is made of; the Gram only shapes it
    (its noise is absorbed by the data-independent ridge); counts of thousands tolerate noise of a
    few units.  Fixed a priori, not tuned on any test split.
    """

    epsilon: float
    delta: float = 1e-6
    clip: float = 32.0
    unit: DpUnit = "image"
    max_images_per_patient: int = 4
    rho_shares: tuple[float, float, float] = (0.3, 0.6, 0.1)  # gram, sums, counts
    ridge_failure_probability: float = 1e-6
    max_rows: int = DEFAULT_MAX_ROWS  # rows per client at most (public, part of the plan)
    # A public, data-independent random projection of every feature row to K dimensions before
    # clipping (secure_afl/privacy/projection.py); None: the rows keep their d dimensions.
    projection_dim: int | None = None
    projection_seed: int = 0
    ridge: DpRidge = "bound"
    # ridge="adassp": the share of the total ρ spent on the release of Σ_k λ_min(G_k), taken before
    # rho_shares split the rest (fixed a priori: the release is one number).
    eigen_share: float = 0.05
    class_sums: DpClassSums = "split"
    # class_sums="positives": the share of the sums' (and of the counts') ρ spent on the total sum
    # (count) in ``all``, fixed a priori: the total is divided by every row of the federation, so
    # its noise matters far less than the positive sums'.
    total_share: float = 0.1
    # Subtract every row's own mean over its features before the projection and the clip: the
    # public map x ↦ (I − 11ᵀ/d)x (secure_afl/privacy/projection.py).  Non-negative (post-ReLU) features
    # have most of their norm along the all-ones direction, which carries no class signal but sets
    # the clip; without it the rows are shorter and a smaller clip (DEFAULT_CENTRED_CLIP) keeps them.
    row_centre: bool = False

    def validate(self) -> None:
        if not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise DpError(f"--dp-epsilon must be a positive finite number, got {self.epsilon}")
        if not 0 < self.delta < 1:
            raise DpError(f"--dp-delta must lie strictly between 0 and 1, got {self.delta}")
        if not (self.clip > 0 and math.isfinite(self.clip)):
            raise DpError(f"--clip must be a positive finite L2 bound on feature rows, got {self.clip}")
        if self.unit not in ("image", "patient"):
            raise DpError(f"--dp-unit must be 'image' or 'patient', got {self.unit!r}")
        if self.max_images_per_patient < 1:
            raise DpError(
                f"the cap on images per patient must be at least 1, got {self.max_images_per_patient}"
            )
        shares = self.rho_shares
        if len(shares) != 3 or any(not s > 0 for s in shares) or abs(sum(shares) - 1) > 1e-9:
            raise DpError(f"rho_shares must be three positive numbers summing to 1, got {shares}")
        if not 0 < self.ridge_failure_probability < 1:
            raise DpError("ridge_failure_probability must lie strictly between 0 and 1")
        if isinstance(self.max_rows, bool) or not isinstance(self.max_rows, int) or self.max_rows < 1:
            raise DpError(
                f"--dp-max-rows (the most rows one client may hold) must be a positive integer, got "
                f"{self.max_rows!r}"
            )
        k = self.projection_dim
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise DpError(
                f"--dp-dim (the dimension K the rows are projected to) must be a positive integer, got {k!r}"
            )
        seed = self.projection_seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise DpError(f"--dp-projection-seed must be an integer in 0..2^64-1, got {seed!r}")
        if self.ridge not in DP_RIDGES:
            raise DpError(f"--dp-ridge must be one of {', '.join(DP_RIDGES)}, got {self.ridge!r}")
        if not 0 < self.eigen_share < 1:
            raise DpError(f"eigen_share must lie strictly between 0 and 1, got {self.eigen_share}")
        if self.class_sums not in DP_CLASS_SUMS:
            raise DpError(
                f"--dp-class-sums must be one of {', '.join(DP_CLASS_SUMS)}, got {self.class_sums!r}"
            )
        if not isinstance(self.row_centre, bool):
            raise DpError(f"--dp-row-centre is a yes/no setting, got {self.row_centre!r}")
        if not 0 < self.total_share < 1:
            raise DpError(f"total_share must lie strictly between 0 and 1, got {self.total_share}")

    def statistics_dim(self, dim: int) -> int:
        """The dimension of the statistics for ``dim``-dimensional features: K, or ``dim``."""
        k = self.projection_dim
        if k is None:
            return dim
        if k > dim:
            raise DpError(
                f"--dp-dim {k} exceeds the feature dimension {dim}: a projection reduces the dimension "
                f"(use at most {dim}, or leave --dp-dim off)"
            )
        return k

    @property
    def mechanism(self) -> str:
        """One line naming the mechanism (the reports and the sweep say which one ran)."""
        rows = (
            "rows in d dims"
            if self.projection_dim is None
            else (f"rows projected to K = {self.projection_dim} (seed {self.projection_seed})")
        )
        sums = "" if self.class_sums == "split" else ", label-normalised positive sums + total"
        centre = "rows centred (own mean removed), " if self.row_centre else ""
        return f"{centre}{rows}, {self.ridge} ridge{sums}"

    @property
    def unit_multiplier(self) -> int:
        """Images one protected unit may contribute: 1, or the cap per patient."""
        return 1 if self.unit == "image" else self.max_images_per_patient


class PseudoLabelThresholdError(DpError):
    """Round 2's pseudo-label threshold τ breaks the sensitivity the DP noise was sized for."""


def check_pseudo_label_threshold(tau: float) -> None:
    """Refuse a round-2 threshold ``τ`` outside ``[0.5, 1)`` under differential privacy.

    A client's round-2 block for class c holds the sums and counts of its rows scored pseudo-positive
    (``σ > τ``) and pseudo-negative (``σ < 1 − τ``).  The noise gives that block the sensitivity of
    one image moving **one** of the two (C for the sums, 1 for the counts); with ``τ ≥ 0.5`` the two
    sets are disjoint.  Below 0.5 an image scored between ``1 − τ`` and ``τ`` is in both: the
    sensitivity becomes √2·C and the block spends twice the ρ it was planned for.  (``τ ≥ 1`` labels
    nothing.)  The other round-2 settings, α and the thresholds δ⁺, δ⁻, are applied by the server to
    the noisy federation sums (post-processing): the noise assumes nothing about them.
    """
    if not (math.isfinite(tau) and MIN_PSEUDO_TAU <= tau < 1):
        raise PseudoLabelThresholdError(
            f"the pseudo-label threshold tau = {tau!r} is not in [0.5, 1): under differential privacy "
            "an image scored between 1 − tau and tau would be both pseudo-positive and pseudo-negative, "
            "moving both sums of its block (sensitivity √2·clip, twice the ρ the noise was sized for); "
            "use tau >= 0.5 (the paper's 0.7)"
        )
