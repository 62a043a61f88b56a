"""What the user asks of differential privacy: (ε, δ), the clip bound, the protected unit.

Kept apart from :mod:`secure_afl.privacy.dp` (which imports the analytic method, hence torch) so that
the deployment's study can validate DP settings in processes that never compute statistics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

DpUnit = Literal["image", "patient"]


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

    @property
    def unit_multiplier(self) -> int:
        """Images one protected unit may contribute: 1, or the cap per patient."""
        return 1 if self.unit == "image" else self.max_images_per_patient
