"""What a setting's clients upload and how the server solves: the mechanism of one data path.

Every setting of the simulator walks one pipeline (:func:`secure_afl.sim.runner.walk`, called by
:func:`~secure_afl.sim.runner.run_setting`)::

    round 1: statistics → privatize → protect → solve
    round 2: the server's teacher → statistics → privatize → protect → refine

The pipeline owns the order, the dropouts, the protection (:func:`secure_afl.sim.setting.protection`:
the layout, a difference plan, masking or CKKS or the clear), the coverage check, the metrics, the
audit and the comparison with the gradient methods.  A mechanism supplies the stages' contents:

* :class:`PaperMechanism`: the paper's AFL and its variants, not private (this module);
* :class:`secure_afl.sim.private.PrivateMechanism`: the same stages under differential privacy
  (clipped and possibly projected rows, noise before the protection, the private solve);
* ``secure_afl.rehearsal.StudyMechanism``: a study's one method over the institutions' rows, the
  in-process reference of ``deploy local``.

What one client computes (its statistics, their privatizing, round 2's pseudo-labels) is a stage of
:mod:`secure_afl.stages`, the functions a deployed node calls for its own uploads.

A mechanism is made for one setting (:func:`secure_afl.sim.runner.mechanism_for` picks the
simulator's) and keeps what its later stages need, as an estimator keeps its fit.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from secure_afl import stages
from secure_afl.analytic import (
    ALL_GROUP,
    PSEUDO_TENSOR,
    PSEUDO_TENSOR_RESCALED,
    AnalyticClassifier,
    ClientStatistics,
    Contributions,
    GramFactors,
    PseudoLabelReport,
    PseudoScoreRule,
    StatisticsError,
    UndefinedBalanceWarning,
    fit_together,
)
from secure_afl.sim.datasets import PreparedData
from secure_afl.sim.partial import LabelAssignment
from secure_afl.sim.setting import (
    AFL_1,
    AFL_2,
    AFL_2_RESCALED,
    AFL_GLOBAL_BALANCE,
    AFL_GLOBAL_GRAM,
    METHOD_UPLOADS,
    Aggregate,
    SimConfig,
    client_id,
)

# (group, tensor) -> whether a method needs that upload; None: the method needs every upload
UploadFilter = Callable[[str, str], bool] | None
# (client, its pseudo-label report) per client and class of round 2
PseudoReports = tuple[tuple[str, PseudoLabelReport], ...]


@dataclass
class Fitted:
    """A solve's released classifiers: the reported ones, and those fitted on another protection's
    sums (``"<method> via <protection>"``, reported after the others)."""

    models: dict[str, AnalyticClassifier]
    other_models: dict[str, AnalyticClassifier] = field(default_factory=dict)


class Mechanism(Protocol):
    """The stages' contents for one setting (see the module docstring)."""

    methods: tuple[str, ...]  # the mechanism's methods, in the report's order
    privatize_phase: str  # the timer's name for the privatize stage
    compares_gradient_methods: bool  # FedAvg and the baselines run beside it

    def statistics(self, clients: Sequence[str], assignment: LabelAssignment) -> Mapping[str, object]: ...

    def undefined_balance(
        self, stats: Mapping[str, object], clients: Sequence[str], assignment: LabelAssignment
    ) -> tuple[tuple[str, int, str], ...]: ...

    def privatize(
        self, stats: Mapping[str, object], clients: Sequence[str], assignment: LabelAssignment
    ) -> dict[str, Contributions]: ...

    def solve(self, agg: Aggregate) -> Fitted: ...

    def teacher(self, agg: Aggregate) -> dict[str, np.ndarray]: ...

    def round2_statistics(self, live: Sequence[str], assignment: LabelAssignment) -> Mapping[str, object]: ...

    def privatize_round2(
        self, stats: Mapping[str, object], live: Sequence[str], assignment: LabelAssignment
    ) -> dict[str, Contributions]: ...

    def refine(self, agg: Aggregate, agg2: Aggregate) -> Fitted: ...

    def pseudo_labels(self) -> tuple[PseudoReports, PseudoReports]: ...

    def method_uploads(self) -> Mapping[str, UploadFilter]: ...

    def privacy(self) -> Mapping[str, object] | None: ...


class PaperMechanism:
    """The paper's method (§III) and the variants it is compared with, in the clear or protected.

    Statistics: each client's Gram and class projections, made once for every setting by the
    caller (they do not depend on the label assignment) and handed in.  Privatize: nothing; every
    variant's tensors go in one upload (each client's class groups under both balances, and the
    global Gram).  Solve: AFL and its global-balance and global-Gram variants, one Gram at a time.
    Round 2: the pseudo-labels of Eq. 19 under the round-1 scores and their rescaled variant.
    """

    methods = (AFL_1, AFL_2, AFL_2_RESCALED, AFL_GLOBAL_BALANCE, AFL_GLOBAL_GRAM)
    privatize_phase = "statistics"
    compares_gradient_methods = True

    def __init__(self, data: PreparedData, config: SimConfig, stats: Mapping[str, ClientStatistics]) -> None:
        self.data, self.config, self.given = data, config, stats
        self.n_classes = int(data.cohort.labels.shape[1])
        self.clients = [client_id(k) for k in range(config.n_clients)]
        self.factors: GramFactors | None = None
        self.other_factors: dict[str, GramFactors] = {}
        self.afl: AnalyticClassifier | None = None
        self.rescaled: tuple[np.ndarray, np.ndarray] | None = None
        self.reports: list[tuple[str, PseudoLabelReport]] = []
        self.rescaled_reports: list[tuple[str, PseudoLabelReport]] = []

    def statistics(
        self, clients: Sequence[str], assignment: LabelAssignment
    ) -> Mapping[str, ClientStatistics]:
        return self.given

    def undefined_balance(
        self, stats: Mapping[str, ClientStatistics], clients: Sequence[str], assignment: LabelAssignment
    ) -> tuple[tuple[str, int, str], ...]:
        """Where Eq. 9 is undefined: per (client, labelled class), and per class across S_c."""
        out = []
        for k, name in enumerate(clients):
            out += [(name, c, why) for c, why in stats[name].undefined_classes(assignment.active[k]).items()]
        for c, members in enumerate(assignment.coverage()):
            n_pos = sum(int(stats[clients[k]].n_pos[c]) for k in members)
            n = sum(stats[clients[k]].n for k in members)
            if members and n_pos in (0, n):
                out.append(("S_c", c, "no positive" if n_pos == 0 else "no negative"))
        return tuple(out)

    def privatize(
        self, stats: Mapping[str, ClientStatistics], clients: Sequence[str], assignment: LabelAssignment
    ) -> dict[str, Contributions]:
        """Each client's round-1 uploads: its class groups' tensors under both balances and the
        global Gram (no local name outlives this method holding a client's Gram)."""
        round1 = {}
        with warnings.catch_warnings():
            # reported per setting (undefined_balance), not as one Python warning per client
            warnings.simplefilter("ignore", UndefinedBalanceWarning)
            for k, name in enumerate(clients):
                round1[name] = stages.every_variant(stats[name], assignment.active[k])
        return round1

    def solve(self, agg: Aggregate) -> Fitted:
        """AFL and its variants on the first protection's sums, and on each other's."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UndefinedBalanceWarning)
            models, self.factors = self._round1_models(agg.sums)
        fitted = Fitted(models)
        for name, sums in agg.other_sums.items():
            others, self.other_factors[name] = self._round1_models(sums)
            fitted.other_models.update({f"{method} via {name}": model for method, model in others.items()})
        self.afl = models[AFL_1]
        return fitted

    def _round1_models(self, sums: Contributions) -> tuple[dict[str, AnalyticClassifier], GramFactors]:
        """The three round-1 models fitted one Gram at a time (each class's factor serves both
        models that use it, then goes), and the factors round 2 reuses (the global Gram's, kept only
        when there is a round 2)."""
        gamma = self.config.gamma
        factors = GramFactors(sums, gamma, keep=(ALL_GROUP,) if self.config.rounds == 2 else ())
        models = {
            AFL_1: AnalyticClassifier(self.n_classes, gamma=gamma),
            AFL_GLOBAL_BALANCE: AnalyticClassifier(self.n_classes, gamma=gamma, balance="global"),
            AFL_GLOBAL_GRAM: AnalyticClassifier(self.n_classes, gamma=gamma, gram="global"),
        }
        fit_together(list(models.values()), sums, factors=factors)
        return models, factors

    def teacher(self, agg: Aggregate) -> dict[str, np.ndarray]:
        """What the server sends for round 2: AFL's W and, when every class's mean training scores
        are defined, the rescaled-τ variant's (the round-1 scores rescaled so that ±1 are the mean
        training scores of S_c's labelled positives / negatives; clients apply Eq. 19 unchanged)."""
        assert self.afl is not None and self.afl.coef_ is not None, "solve() comes first"
        try:
            self.rescaled = self.afl.rescaled_scores(agg.sums)
        except StatisticsError:
            self.rescaled = None
        teacher = {"coef": self.afl.coef_}
        if self.rescaled is not None:
            teacher.update({"rescaled/coef": self.rescaled[0], "rescaled/offset": self.rescaled[1]})
        return teacher

    def round2_statistics(self, live: Sequence[str], assignment: LabelAssignment) -> dict[str, Contributions]:
        """Each live client's pseudo-label projections under the teacher's score rules (Eq. 19)."""
        assert self.afl is not None and self.afl.coef_ is not None, "teacher() comes first"
        rules = [PseudoScoreRule(self.afl.coef_, None, PSEUDO_TENSOR)]
        if self.rescaled is not None:
            rules.append(PseudoScoreRule(self.rescaled[0], self.rescaled[1], PSEUDO_TENSOR_RESCALED))
        out = {}
        clients = self.data.split.clients
        for name in live:
            k = self.clients.index(name)
            out[name], reports = stages.pseudo_label_variants(
                self.data.features[clients[k]],
                rules,
                assignment.active[k],
                self.config.pseudo,
                device=self.config.device,
            )
            self.reports.extend((name, r) for r in reports[PSEUDO_TENSOR])
            self.rescaled_reports.extend((name, r) for r in reports.get(PSEUDO_TENSOR_RESCALED, []))
        return out

    def privatize_round2(
        self, stats: Mapping[str, Contributions], live: Sequence[str], assignment: LabelAssignment
    ) -> dict[str, Contributions]:
        return dict(stats)

    def refine(self, agg: Aggregate, agg2: Aggregate) -> Fitted:
        """AFL (2 rounds) and its rescaled-τ variant, reusing round 1's global-Gram factor."""
        gamma, alpha = self.config.gamma, self.config.pseudo.alpha
        fitted = Fitted({})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UndefinedBalanceWarning)
            fitted.models[AFL_2] = AnalyticClassifier(self.n_classes, gamma=gamma).refine(
                agg.sums, agg2.sums, alpha=alpha, pseudo_tensor=PSEUDO_TENSOR, factors=self.factors
            )
            for name, sums2 in agg2.other_sums.items():
                refined = AnalyticClassifier(self.n_classes, gamma=gamma)
                fitted.other_models[f"{AFL_2} via {name}"] = refined.refine(
                    agg.other_sums[name], sums2, alpha=alpha, factors=self.other_factors[name]
                )
            if self.rescaled is not None:
                fitted.models[AFL_2_RESCALED] = AnalyticClassifier(self.n_classes, gamma=gamma).refine(
                    agg.sums,
                    agg2.sums,
                    alpha=alpha,
                    pseudo_tensor=PSEUDO_TENSOR_RESCALED,
                    factors=self.factors,
                )
        return fitted

    def pseudo_labels(self) -> tuple[PseudoReports, PseudoReports]:
        return tuple(self.reports), tuple(self.rescaled_reports)

    def method_uploads(self) -> Mapping[str, UploadFilter]:
        return METHOD_UPLOADS

    def privacy(self) -> Mapping[str, object] | None:
        return None
