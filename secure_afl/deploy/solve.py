"""A study's solve: its one method fitted on the federation's sums, exact or under its noise plan.

One object decides how a study's sums become its classifier, whoever holds them: the Flower
server (:mod:`secure_afl.deploy.server`) and ``deploy local``'s in-process reference
(``secure_afl.rehearsal.StudyMechanism``, which checks the server's weights bit for bit).  Without
DP: ``AnalyticClassifier`` with the study's balance, Gram scope and γ, and Eq. 18–24's refinement.
Under DP (the plan every party derives from the study, :func:`~secure_afl.deploy.study.noise_plan`):
the private ridge on the noisy sums, sized from this session's noise and a growing chain's earlier
sessions' (:mod:`secure_afl.privacy.dp_growth`), round 2's thresholds on the noisy counts, and the
released weights lifted to the features' dimensions under ``--dp-dim`` (``W = P W_K``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from .study import STATISTICS_WEIGHTS, Study, dp_projection, has_row_map

if TYPE_CHECKING:  # torch: only a solve needs the estimator
    from secure_afl.analytic import AnalyticClassifier, Contributions
    from secure_afl.privacy.dp import NoisePlan
    from secure_afl.privacy.dp_growth import ChainNoise, SessionNoise


class StudySolver:
    """The solve of one study's session (see the module docstring): :meth:`session_noise` (DP),
    :meth:`fit`, :meth:`refine` (round 2), :meth:`weights` and :meth:`privacy_record`."""

    def __init__(
        self, study: Study, plan: NoisePlan | None = None, earlier: ChainNoise | None = None
    ) -> None:
        self.study, self.plan, self.earlier = study, plan, earlier
        self.noise: SessionNoise | None = None
        self.chain: ChainNoise | None = None
        self.round1: Contributions | None = None
        self.solved: Any = None
        self.solved2: Any = None

    def session_noise(self, gram_survivors: int) -> SessionNoise | None:
        """This session's noise record under DP (what a growing chain's later solves size their
        ridge from), from the survivors of the Gram's group; None without DP."""
        if self.plan is None:
            return None
        from secure_afl.privacy.dp_growth import ChainNoise, SessionNoise

        self.noise = SessionNoise.of(self.plan, gram_survivors, feature_dim=self.study.dim)
        self.chain = ChainNoise((self.noise,)) if self.earlier is None else self.earlier.extended(self.noise)
        return self.noise

    def fit(self, sums: Contributions, gram_survivors: int = 0) -> AnalyticClassifier:
        """Round 1's classifier on ``sums`` (a growing study's: accumulated over its sessions)."""
        method = self.study.method
        if self.plan is None:
            from secure_afl.analytic import AnalyticClassifier

            self.round1 = sums
            return AnalyticClassifier(
                self.study.n_classes, gamma=method.gamma, balance=method.balance, gram=method.gram
            ).fit(sums)
        from secure_afl.privacy.dp_solve import fit_private

        if self.noise is None:
            self.session_noise(gram_survivors)
        model, self.solved, self.round1 = fit_private(
            sums, self.plan, n_classes=self.study.n_classes, gamma=method.gamma,
            gram_survivors=gram_survivors, chain=self.chain if self.study.extends else None,
        )  # fmt: skip
        return model

    def refine(
        self, model: AnalyticClassifier, sums2: Contributions, survivors2: Mapping[str, int]
    ) -> AnalyticClassifier:
        """Round 2's classifier from round 1's ``model`` and the pseudo-label sums ``sums2``
        (``survivors2``: each pseudo group's survivors, whose count sizes DP's count noise)."""
        assert self.round1 is not None, "fit() comes first"
        method = self.study.method
        if self.plan is None:
            from secure_afl.analytic import AnalyticClassifier

            refined = AnalyticClassifier(self.study.n_classes, gamma=method.gamma, balance=method.balance)
            return refined.refine(self.round1, sums2, alpha=method.alpha)
        from secure_afl.analytic import PseudoLabelConfig
        from secure_afl.privacy.dp_solve import pseudo_count_noise_std, refine_private

        model, self.solved2 = refine_private(
            model,
            self.round1,
            sums2,
            self.solved,
            n_classes=self.study.n_classes,
            config=PseudoLabelConfig(
                tau=method.tau, alpha=method.alpha, min_pos=method.min_pos, min_neg=method.min_neg
            ),
            count_noise_std=pseudo_count_noise_std(self.plan, survivors2),
        )
        return model

    def weights(self, model: AnalyticClassifier) -> np.ndarray:
        """The released weights: the model's, lifted to the features under ``--dp-dim`` (or the row
        centring): ``W = P W_K``."""
        weights = model.coef_
        assert weights is not None, "fit() comes first"
        projection = dp_projection(self.study)
        if projection is None:
            return weights
        from secure_afl.privacy.projection import lift_weights

        return lift_weights(projection, weights)

    def privacy_record(self, model: AnalyticClassifier | None = None) -> dict[str, Any] | None:
        """Under DP the release's record (ε, noise, ridge; a growing chain's every session), else None.
        Under ``--dp-dim`` or the row centring it also holds ``model``'s weights before the lift,
        ``statistics_weights`` (K × C: the solve's, which every node checks against the sums and
        the released W = P W_K against, SECURITY.md §5.1)."""
        if self.plan is None:
            return None
        from secure_afl.privacy.dp_solve import privacy_record

        growing = self.chain if self.study.extends else None
        record = privacy_record(
            self.plan, self.solved, self.solved2, feature_dim=self.study.dim, chain=growing
        )
        if model is not None and model.coef_ is not None and has_row_map(self.study):
            record[STATISTICS_WEIGHTS] = np.asarray(model.coef_, dtype=np.float64).tolist()  # exact in JSON
        return record
