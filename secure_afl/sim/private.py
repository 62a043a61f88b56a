"""The simulator under differential privacy: the private mechanism of the one pipeline, its
statistics, its record, and a growing federation's noise.

Under ``--dp-epsilon`` a setting walks the same stages as every other
(:func:`secure_afl.sim.runner.run_setting`) with :class:`PrivateMechanism` supplying them: only the
private method (``balance="global"``, ``gram="global"``, rounds 1 and 2 as asked), since summing
the other variants' un-noised statistics in the same session would release them.  Each client
clips, rounds and noises its own statistics (:mod:`secure_afl.privacy.dp`) before they enter the
masking protocol; the server solves on the noisy sums (:mod:`secure_afl.privacy.dp_solve`).
FedAvg, not private, is not run.

With ``--dp-dim K`` every client first projects its rows with the public matrix of
:mod:`secure_afl.privacy.projection` (derived from ``--dp-projection-seed``), the statistics are
``K``-dimensional, the server solves in that space (round 2 scores its pseudo-labels there too) and
the released (and evaluated) classifier holds ``W = P W_K`` for the original features.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from secure_afl import stages
from secure_afl.analytic import (
    ALL_GROUP,
    AnalyticClassifier,
    Contributions,
    sum_contributions,
)
from secure_afl.core.randomness import RandomSource
from secure_afl.privacy.dp import (
    DpConfig,
    FederationLayout,
    NoisePlan,
    PrivateStatistics,
    cap_images_per_patient,
    plan_noise,
)
from secure_afl.privacy.dp_growth import ChainNoise, SessionNoise
from secure_afl.privacy.dp_solve import (
    PrivateSolve,
    fit_private,
    lift,
    privacy_record,
    pseudo_count_noise_std,
    refine_private,
)
from secure_afl.privacy.projection import row_map
from secure_afl.sim.datasets import PreparedData, Progress
from secure_afl.sim.mechanism import Fitted, PseudoReports, UploadFilter
from secure_afl.sim.partial import LabelAssignment
from secure_afl.sim.setting import Aggregate, ExperimentError, SimConfig, client_id

AFL_DP_1 = "AFL DP (1 round)"
AFL_DP_2 = "AFL DP (2 rounds)"


def dp_projection(dp: DpConfig, feature_dim: int) -> np.ndarray | None:
    """The public projection of ``--dp-dim`` for ``feature_dim``-dimensional rows (None without)."""
    dp.statistics_dim(feature_dim)  # refuses K > d
    return row_map(feature_dim, dp.projection_dim, dp.projection_seed, centre=dp.row_centre)


def client_rows(data: PreparedData, dp: DpConfig) -> list[np.ndarray]:
    """Each client's training rows; for the patient unit, at most the cap per patient overall.

    The simulator knows every patient id, so it enforces the cap across clients (a patient whose
    images were split over several clients still contributes at most the cap).  A deployment can
    only enforce it per institution: see SECURITY.md.
    """
    return _capped_rows(data, dp, [np.asarray(r) for r in data.split.clients])


def _capped_rows(data: PreparedData, dp: DpConfig, rows: list[np.ndarray]) -> list[np.ndarray]:
    """``rows`` (one index array per client) with, for the patient unit, at most the cap of each
    patient's images over all of them; unchanged for the image unit.

    Each patient keeps its first images in the cohort's order (the rows' own order, public and the
    same whatever the split), not in the clients' order: no client loses rows because of its place
    in the list (capped in client order, the last of 8 clients lost a third of its rows)."""
    if dp.unit != "patient" or not sum(len(r) for r in rows):
        return rows
    together = np.concatenate(rows)
    order = np.argsort(together, kind="stable")  # the cohort's order
    kept = cap_images_per_patient(data.cohort.patient_ids[together[order]], dp.max_images_per_patient)
    keep = np.empty_like(kept)
    keep[order] = kept
    out, start = [], 0
    for r in rows:
        out.append(r[keep[start : start + len(r)]])
        start += len(r)
    return out


class PrivateMechanism:
    """The pipeline's stages under differential privacy (:mod:`secure_afl.sim.mechanism`).

    One private method, AFL under ``balance="global"`` and ``gram="global"`` (summing the other
    variants' un-noised statistics in the same session would release them).  Statistics: each
    client's rows (at most the patient cap of each patient's images, over every client) projected
    under ``--dp-dim`` and clipped.  Privatize: rounded and noised under the setting's noise plan
    (:func:`secure_afl.privacy.dp.plan_noise`), before the protection.  Solve: the private ridge on
    the noisy sums (:mod:`secure_afl.privacy.dp_solve`), released as ``W = P W_K`` for the original
    features.  Round 2: the pseudo-label sums of the same clipped rows, noised the same way.
    FedAvg and the baselines, not private, are not run beside it.
    """

    privatize_phase = "dp noise"
    compares_gradient_methods = False

    def __init__(
        self,
        data: PreparedData,
        config: SimConfig,
        assignment: LabelAssignment,
        random: RandomSource,
        stats: Mapping[str, PrivateStatistics] | None = None,
    ) -> None:
        from secure_afl.sim.secure import default_threshold

        if config.dp is None:
            raise ExperimentError("PrivateMechanism needs a DP configuration (config.dp)")
        self.data, self.config, self.dp, self.random, self.given = data, config, config.dp, random, stats
        self.n_classes = int(data.cohort.labels.shape[1])
        self.feature_dim = int(data.features.shape[1])
        self.clients = [client_id(k) for k in range(config.n_clients)]
        self.projection = dp_projection(self.dp, self.feature_dim)
        self.rows = client_rows(data, self.dp)
        self.methods = (AFL_DP_1, AFL_DP_2) if config.rounds == 2 else (AFL_DP_1,)
        layout = FederationLayout(
            active={name: assignment.active[k] for k, name in enumerate(self.clients)},
            n_classes=self.n_classes,
            dim=self.dp.statistics_dim(self.feature_dim),
            threshold=config.threshold or default_threshold(config.n_clients),
            min_group_size=config.min_group_size,
            rounds=config.rounds,
            masked=config.secure == "mask",
            # the split may spread a patient's images over clients, each rounding its own values:
            # the plan takes the public bound, every client (plan_noise caps it at the images per patient)
            patient_clients=config.n_clients,
        )
        self.plan = plan_noise(self.dp, layout)
        self.stats: Mapping[str, PrivateStatistics] = {}
        self.model: AnalyticClassifier | None = None
        self.converted: Contributions = {}
        self.solved: PrivateSolve | None = None
        self.solved2: PrivateSolve | None = None

    def statistics(
        self, clients: Sequence[str], assignment: LabelAssignment
    ) -> Mapping[str, PrivateStatistics]:
        """The clients' clipped statistics: those handed in when they fit this setting (the ε sweep
        reuses them), else made now."""
        if self.given is not None and _stats_fit(self.given, self.dp, assignment.active):
            self.stats = self.given
        else:
            self.stats = client_private_statistics(
                self.data, self.config, assignment.active, rows=self.rows, projection=self.projection
            )
        return self.stats

    def undefined_balance(
        self, stats: Mapping[str, object], clients: Sequence[str], assignment: LabelAssignment
    ) -> tuple[tuple[str, int, str], ...]:
        return ()  # the global balance: Eq. 9's per-client balance is not used

    def privatize(
        self, stats: Mapping[str, PrivateStatistics], clients: Sequence[str], assignment: LabelAssignment
    ) -> dict[str, Contributions]:
        return {
            name: stages.noised_round1(stats[name], assignment.active[k], self.plan, self.random)[0]
            for k, name in enumerate(clients)
        }

    def solve(self, agg: Aggregate) -> Fitted:
        self.model, self.solved, self.converted = fit_private(
            agg.sums,
            self.plan,
            n_classes=self.n_classes,
            gamma=self.config.gamma,
            gram_survivors=len(agg.survivors[ALL_GROUP]),
        )
        return Fitted({AFL_DP_1: lift(self.model, self.projection)})  # the released classifier

    def teacher(self, agg: Aggregate) -> dict[str, np.ndarray]:
        assert self.model is not None and self.model.coef_ is not None, "solve() comes first"
        return {"coef": self.model.coef_}  # in the statistics' K dimensions under --dp-dim

    def round2_statistics(self, live: Sequence[str], assignment: LabelAssignment) -> dict[str, np.ndarray]:
        """Each live client's clipped (and projected) rows: what its pseudo-label sums are made of."""
        return {
            name: stages.dp_rows(
                self.data.features[self.rows[self.clients.index(name)]], self.dp, self.projection
            )
            for name in live
        }

    def privatize_round2(
        self, stats: Mapping[str, np.ndarray], live: Sequence[str], assignment: LabelAssignment
    ) -> dict[str, Contributions]:
        assert self.model is not None and self.model.coef_ is not None, "solve() comes first"
        return {
            name: stages.noised_round2(
                stats[name],
                self.model.coef_,
                assignment.active[self.clients.index(name)],
                self.plan,
                self.random,
                self.config.pseudo,
            )[0]
            for name in live
        }

    def refine(self, agg: Aggregate, agg2: Aggregate) -> Fitted:
        assert self.model is not None and self.solved is not None, "solve() comes first"
        count_std = pseudo_count_noise_std(self.plan, {g: len(ids) for g, ids in agg2.survivors.items()})
        refined, self.solved2 = refine_private(
            self.model,
            self.converted,
            agg2.sums,
            self.solved,
            n_classes=self.n_classes,
            config=self.config.pseudo,
            count_noise_std=count_std,
        )
        return Fitted({AFL_DP_2: lift(refined, self.projection)})

    def pseudo_labels(self) -> tuple[PseudoReports, PseudoReports]:
        return (), ()

    def method_uploads(self) -> Mapping[str, UploadFilter]:
        # one method: the session's audit is its audit
        return {self.methods[-1]: None}

    def privacy(self) -> Mapping[str, object] | None:
        assert self.solved is not None, "solve() comes first"
        return privacy_summary(self.plan, self.stats, self.solved, self.solved2, feature_dim=self.feature_dim)


def client_private_statistics(
    data: PreparedData,
    config: SimConfig,
    active: Sequence[Sequence[int]] | None = None,
    *,
    rows: Sequence[np.ndarray] | None = None,
    projection: np.ndarray | None = None,
) -> dict[str, PrivateStatistics]:
    """Every client's clipped statistics (they depend on the clip bound, the unit and the
    projection, not on ε or the ridge); with ``active`` (each client's classes) also the
    label-normalised positive sums of ``class_sums="positives"``, which depend on those classes.
    ``rows``: :func:`client_rows`, where the caller has them; with them, ``projection`` is taken as
    given (:func:`dp_projection`'s, None for none)."""

    dp: DpConfig = config.dp  # type: ignore[assignment]  (set: this path runs only with DP)
    if rows is None:
        rows = client_rows(data, dp)
        projection = dp_projection(dp, data.features.shape[1])
    return {
        client_id(k): stages.dp_statistics(
            data.features[r],
            data.cohort.labels[r],
            dp,
            projection=projection,
            device=config.device,
            active=None if active is None else active[k],
        )
        for k, r in enumerate(rows)
    }


def _stats_fit(stats: Mapping[str, PrivateStatistics], dp: DpConfig, active: Sequence[Sequence[int]]) -> bool:
    """Whether ``stats`` can make this setting's uploads: the positive sums are normalised over each
    client's classes, so a missing level with other classes needs new ones."""
    if dp.class_sums != "positives":
        return True
    return all(
        s.positive_classes is not None and set(s.positive_classes) == set(map(int, a))
        for s, a in zip(stats.values(), active, strict=True)
    )


def privacy_summary(
    plan: NoisePlan,
    stats: Mapping[str, object],
    solve: PrivateSolve,
    solve2: PrivateSolve | None,
    *,
    feature_dim: int | None = None,
) -> dict[str, object]:
    """What the report says about DP: the release's record and the public cap on each client's rows.

    No exact per-client count (rows used, rows clipped): the DP guarantee does not cover them (one
    image moves them by one, and no noise hides it), so results.json and the terminal publish only
    the public caps (``clip``, ``max_images_per_patient``, ``max_rows``; SECURITY.md §9).  ``stats``
    (the clients' statistics) is not read: it is the signature of every mechanism's record."""
    summary = privacy_record(plan, solve, solve2, feature_dim=feature_dim)
    position = list(summary).index("blocks")
    items = list(summary.items())
    return dict([*items[:position], ("max_rows", plan.config.max_rows), *items[position:]])


def _class_sums(privacy: Mapping[str, object]) -> str:
    if privacy.get("class_sums", "split") == "split":
        return "split (positive and negative sums per labelled class)"
    return (
        "label-normalised positive sums + total (one slot for every class; the total in 'all' takes "
        f"{privacy['total_share']:g} of the sums' and counts' ρ)"
    )


def privacy_lines(privacy: Mapping[str, object]) -> list[str]:
    """Human-readable DP summary for the console and report.md."""
    spent = privacy["epsilon_spent"]
    assert isinstance(spent, Mapping)
    blocks = privacy["blocks"]
    assert isinstance(blocks, list)
    unit = privacy["unit"]
    if unit == "patient":
        unit = f"patient (at most {privacy['max_images_per_patient']} images each)"
    projection = privacy.get("projection")
    if isinstance(projection, Mapping):
        rows = (
            f"rows projected from d = {projection['feature_dim']} to K = {projection['dim']} by the public "
            f"random projection of seed {projection['seed']} (sha256 {str(projection['sha256'])[:16]}…), "
            "then clipped"
        )
    else:
        rows = "rows not projected (statistics in the features' d dimensions)"
    if privacy.get("row_centre"):
        rows = f"rows centred (own mean removed, the public map I − 11ᵀ/d), {rows}"
    lines = [
        f"differential privacy: target ε = {privacy['epsilon_target']:g} at δ = {privacy['delta']:g}, "
        f"unit: one {unit}, rows clipped to L2 norm {privacy['clip']:g}",
        f"mechanism: {rows}; ridge: {privacy.get('ridge_kind', 'bound')}; class sums: {_class_sums(privacy)}",
        "ε spent per institution: " + ", ".join(f"{k} {v:.4f}" for k, v in spent.items()),
        f"rows: at most {privacy.get('max_rows')} per client; how many each client used or clipped is not "
        "published (an exact count is not covered by the DP guarantee)",
    ]
    for kind in ("gram", "eigen", "sums", "counts"):
        ofkind = [b for b in blocks if b["block"] == kind]
        if not ofkind:
            continue
        stds = [b["noise_std_at_fewest"] for b in ofkind]
        fewest = sorted({b["fewest_survivors"] for b in ofkind})
        lines.append(
            f"noise on {kind} (sensitivity {ofkind[0]['sensitivity']:g}): group-sum std "
            f"{min(stds):.4g}..{max(stds):.4g} at the fewest survivors {fewest}"
        )
    kind = privacy.get("ridge_kind", "bound")
    floor = "used" if privacy["eigenvalue_floor"] else "not needed"
    noise = f"Gram noise std {privacy['gram_noise_std']:.4g} per entry"
    if kind == "bound":
        lines.append(
            f"solve: ridge γ + λ with data-independent λ = {privacy['ridge']:.4g} ({noise}); "
            f"eigenvalue floor {floor}"
        )
    else:
        source = (
            "the noisy Gram (post-processing, no budget)"
            if kind == "adaptive"
            else f"the noised sum of the clients' λ_min (its own ρ share {privacy.get('eigen_share')})"
        )
        lines.append(
            f"solve: ridge γ + λ, adaptive λ = max(0, B − λ̃_min) = {privacy['ridge']:.4g} with the noise "
            f"bound B = {privacy['ridge_noise_bound']:.4g} ({noise}) and λ̃_min = "
            f"{privacy['min_eigenvalue_lower_bound']:.4g} from {source}; eigenvalue floor {floor}"
        )
    if privacy.get("round2_qualified_classes") is not None:
        lines.append(
            f"round 2: classes qualified on noisy federation counts: {privacy['round2_qualified_classes']}"
        )
    return lines


# ----------------------------------------------------------------------------------------------
# A growing federation under DP (secure-afl sim --scenario growing --dp-epsilon E)
# ----------------------------------------------------------------------------------------------


class PrivateGrowth:
    """``--scenario growing``'s session steps under DP (those of
    :class:`secure_afl.sim.growing.PlainGrowth`): one noise plan for the study (its layout does not
    depend on the rows), each session's noisy uploads over the clients' new rows, the chain's solve
    on the accumulated noisy sums (:mod:`secure_afl.privacy.dp_growth`), and the noise-free reference.
    No member commits a row count and an idle member's upload is its own noise: no value is a known
    zero.

    Under the patient unit the cap ``max_images_per_patient`` holds per session (over every client,
    as the simulator knows every patient id): a deployment's institution caps each session's new
    images, so a patient may contribute in several sessions, and the chain's ε composes.
    """

    knows_idle_zeros = False

    def __init__(
        self, data: PreparedData, config: SimConfig, active: Sequence[Sequence[int]], random: RandomSource
    ) -> None:
        from secure_afl.sim.secure import default_threshold

        dp: DpConfig = config.dp  # type: ignore[assignment]  (set: this path runs only with DP)
        self.dp, self.config, self.data, self.active, self.random = dp, config, data, active, random
        self.names = [client_id(k) for k in range(len(active))]
        self.feature_dim = int(data.features.shape[1])
        self.n_classes = int(data.cohort.labels.shape[1])
        self.projection = dp_projection(dp, self.feature_dim)
        n_clients = len(active)
        layout = FederationLayout(
            active={name: active[k] for k, name in enumerate(self.names)},
            n_classes=self.n_classes,
            dim=dp.statistics_dim(self.feature_dim),
            threshold=config.threshold or default_threshold(n_clients),
            min_group_size=config.min_group_size,
            rounds=1,
            masked=config.secure == "mask",  # type: ignore[attr-defined]
            patient_clients=n_clients,  # the split may spread a patient's images (PrivateMechanism)
        )
        self.plan = plan_noise(dp, layout)
        self.chain: ChainNoise | None = None
        self.clean_total: Contributions | None = None

    def _capped(self, session: Sequence[np.ndarray]) -> list[np.ndarray]:
        return _capped_rows(self.data, self.dp, [np.asarray(r, dtype=np.int64) for r in session])

    def uploads(
        self, session: Sequence[np.ndarray], progress: Progress, label: str
    ) -> tuple[dict[str, Contributions], dict[str, Contributions]]:
        """Every client's noisy round-1 upload over its new rows ``session[k]`` (a client without
        any still noises its zeros), and the clean uploads they came from."""
        noisy, clean = {}, {}
        device = self.config.device
        for k, rows in enumerate(self._capped(session)):
            name = self.names[k]
            stats = stages.dp_statistics(
                self.data.features[rows],
                self.data.cohort.labels[rows],
                self.dp,
                projection=self.projection,
                device=device,
                active=self.active[k],
            )
            noisy[name], clean[name] = stages.noised_round1(stats, self.active[k], self.plan, self.random)
        progress(label, len(self.names), len(self.names))
        return noisy, clean

    def solve(
        self, total: Contributions, clean: Mapping[str, Contributions], gram_survivors: int
    ) -> tuple[np.ndarray, dict[str, object]]:
        """The chain's classifier on the accumulated noisy sums ``total`` (this session's last) and
        the privacy record; the session's clean sums join the noise-free reference's."""
        from secure_afl.growth import accumulate_sums

        noise = SessionNoise.of(self.plan, gram_survivors, feature_dim=self.feature_dim)
        self.chain = ChainNoise((noise,)) if self.chain is None else self.chain.extended(noise)
        self.clean_total = accumulate_sums(self.clean_total, sum_contributions(clean.values()))
        model, solve, _ = fit_private(
            total, self.plan, n_classes=self.n_classes, gamma=self.config.gamma,
            gram_survivors=gram_survivors, chain=self.chain,
        )  # fmt: skip
        record = privacy_record(self.plan, solve, None, feature_dim=self.feature_dim, chain=self.chain)
        return lift(model, self.projection).coef_, record

    def reference(self, released: Sequence[np.ndarray]) -> np.ndarray:
        """The noise-free fit of the same clipped (and projected) rows, every released row pooled
        (the clean sums of every session so far)."""
        from secure_afl.privacy.dp_solve import analytic_sums

        assert self.clean_total is not None, "solve() comes first"
        reference = AnalyticClassifier(
            self.n_classes, gamma=self.config.gamma, balance="global", gram="global"
        )
        reference.fit(analytic_sums(self.clean_total, self.n_classes))
        return lift(reference, self.projection).coef_
