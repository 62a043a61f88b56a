"""The simulator under differential privacy: one private method, its ε per institution, the ε sweep.

Under ``--dp-epsilon`` a setting runs only the private method (``balance="global"``,
``gram="global"``, rounds 1 and 2 as asked): summing the other variants' un-noised statistics in
the same session would release them.  Each client clips, rounds and noises its own statistics
(:mod:`secure_afl.privacy.dp`) before they enter the masking protocol; the server solves on the
noisy sums (:mod:`secure_afl.privacy.dp_solve`).  FedAvg, not private, is not run.

With ``--dp-dim K`` every client first projects its rows with the public matrix of
:mod:`secure_afl.privacy.projection` (derived from ``--dp-projection-seed``), the statistics are
``K``-dimensional, the server solves in that space (round 2 scores its pseudo-labels there too) and
the released (and evaluated) classifier holds ``W = P W_K`` for the original features.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from secure_afl.analytic import Contributions, sum_contributions
from secure_afl.core.randomness import OsRandomSource, RandomSource
from secure_afl.privacy.dp import (
    DpConfig,
    FederationLayout,
    NoisePlan,
    PrivateStatistics,
    cap_images_per_patient,
    plan_noise,
    private_rows,
    private_statistics,
    pseudo_label_round,
    pseudo_label_upload,
    round1_upload,
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
from secure_afl.sim.audit import audit_groups
from secure_afl.sim.datasets import PreparedData, Progress
from secure_afl.sim.metrics import evaluate
from secure_afl.sim.partial import assign_partial_labels
from secure_afl.sim.setting import (
    PhaseTimer,
    SettingResult,
    SimConfig,
    aggregate,
    check_coverage,
    client_id,
    dropped_clients,
    upload_bytes,
)

AFL_DP_1 = "AFL DP (1 round)"
AFL_DP_2 = "AFL DP (2 rounds)"
SWEEP_EPSILONS = (0.5, 1.0, 2.0, 4.0, 8.0, math.inf)


def dp_projection(dp: DpConfig, feature_dim: int) -> np.ndarray | None:
    """The public projection of ``--dp-dim`` for ``feature_dim``-dimensional rows (None without)."""
    dp.statistics_dim(feature_dim)  # refuses K > d
    return row_map(feature_dim, dp.projection_dim, dp.projection_seed, centre=dp.row_centre)


def _client_rows(data: PreparedData, dp: DpConfig) -> list[np.ndarray]:
    """Each client's training rows; for the patient unit, at most the cap per patient overall.

    The simulator knows every patient id, so it enforces the cap across clients (a patient whose
    images were split over several clients still contributes at most the cap).  A deployment can
    only enforce it per institution: see SECURITY.md.
    """
    return _capped_rows(data, dp, [np.asarray(r) for r in data.split.clients])


def _capped_rows(data: PreparedData, dp: DpConfig, rows: list[np.ndarray]) -> list[np.ndarray]:
    """``rows`` (one index array per client) with, for the patient unit, at most the cap of each
    patient's images over all of them; unchanged for the image unit."""
    if dp.unit != "patient" or not sum(len(r) for r in rows):
        return rows
    keep = cap_images_per_patient(data.cohort.patient_ids[np.concatenate(rows)], dp.max_images_per_patient)
    out, start = [], 0
    for r in rows:
        out.append(r[keep[start : start + len(r)]])
        start += len(r)
    return out


def run_private_setting(
    data: PreparedData,
    missing: int,
    config: SimConfig,
    timer: PhaseTimer,
    progress: Progress,
    *,
    random: RandomSource | None = None,
    stats: Mapping[str, PrivateStatistics] | None = None,
) -> SettingResult:
    from secure_afl.sim.secure import default_threshold

    dp: DpConfig = config.dp  # type: ignore[assignment]  (set: this path runs only with DP)
    random = OsRandomSource() if random is None else random
    n_classes = data.cohort.labels.shape[1]
    assignment = assign_partial_labels(
        config.n_clients, n_classes, missing, seed=config.seed, missing1=config.missing1
    )
    clients = [client_id(k) for k in range(config.n_clients)]
    dropped = dropped_clients(config)
    dropouts = {config.dropout_stage: dropped} if dropped else {}
    test_x = data.features[data.split.test]
    test_y = data.cohort.labels[data.split.test]
    rows = _client_rows(data, dp)
    feature_dim = data.features.shape[1]
    projection = dp_projection(dp, feature_dim)
    layout = FederationLayout(
        active={name: assignment.active[k] for k, name in enumerate(clients)},
        n_classes=n_classes,
        dim=dp.statistics_dim(feature_dim),
        threshold=config.threshold or default_threshold(config.n_clients),
        min_group_size=config.min_group_size,
        rounds=config.rounds,
        masked=config.secure == "mask",
        # the split may spread a patient's images over clients, each rounding its own values: the
        # plan takes the public bound, every client (plan_noise caps it at the images per patient)
        patient_clients=config.n_clients,
    )
    plan = plan_noise(dp, layout)

    if stats is None or not _stats_fit(stats, dp, assignment.active):
        with timer.phase("statistics"):
            stats = client_private_statistics(data, config, assignment.active)
    with timer.phase("dp noise"):
        round1 = {
            name: round1_upload(stats[name], assignment.active[k], plan, random)[0]
            for k, name in enumerate(clients)
        }
    with timer.phase("aggregation"):
        agg = aggregate(round1, config, dropouts=dropouts)
    check_coverage(agg, n_classes)
    with timer.phase("solve"):
        model, solve, converted = fit_private(
            agg.sums, plan, n_classes=n_classes, gamma=config.gamma, gram_survivors=len(agg.survivors["all"])
        )
    models = {AFL_DP_1: lift(model, projection)}  # the released classifier: original features
    members, survivors, tensors = dict(agg.members), dict(agg.survivors), dict(agg.tensors)
    costs = {"round1": agg.costs} if agg.costs is not None else None
    uploads = {name: dict(groups) for name, groups in round1.items()}
    solve2: PrivateSolve | None = None
    if config.rounds == 2:
        live = [c for c in clients if c not in dropped]
        with timer.phase("statistics"):
            clipped = {
                name: private_rows(data.features[rows[clients.index(name)]], dp.clip, projection)[0]
                for name in live
            }
        with timer.phase("dp noise"):
            round2 = {
                name: pseudo_label_upload(
                    clipped[name],
                    model.coef_,
                    assignment.active[clients.index(name)],
                    plan,
                    random,
                    config.pseudo,
                )[0]
                for name in live
            }
        with timer.phase("aggregation"):
            agg2 = aggregate(round2, config, dropouts={}, round_label="2", arrays={"coef": model.coef_})
        with timer.phase("solve"):
            count_std = pseudo_count_noise_std(plan, {g: len(ids) for g, ids in agg2.survivors.items()})
            refined, solve2 = refine_private(
                model,
                converted,
                agg2.sums,
                solve,
                n_classes=n_classes,
                config=config.pseudo,
                count_noise_std=count_std,
            )
            models[AFL_DP_2] = lift(refined, projection)
        members.update(agg2.members)
        survivors.update(agg2.survivors)
        tensors.update(agg2.tensors)
        for name, groups in round2.items():
            uploads[name].update(groups)
        if costs is not None:
            costs["round2"] = agg2.costs
    with timer.phase("metrics"):
        metrics = {
            name: evaluate(test_y, m.decision_function(test_x), kind="logits") for name, m in models.items()
        }
    audit = audit_groups(
        protection=config.secure, members=members, survivors=survivors, tensors=tensors, contributions=uploads
    )
    sent_bytes = upload_bytes(uploads)
    return SettingResult(
        missing=missing,
        assignment=assignment,
        metrics=metrics,
        dropped=dropped,
        upload_bytes=sent_bytes,
        audit=audit,
        method_audits={AFL_DP_2 if config.rounds == 2 else AFL_DP_1: audit},
        pseudo_labels=(),
        protocol_costs=costs,
        privacy=privacy_summary(plan, stats, solve, solve2, feature_dim=feature_dim),
    )


def client_private_statistics(
    data: PreparedData, config: SimConfig, active: Sequence[Sequence[int]] | None = None
) -> dict[str, PrivateStatistics]:
    """Every client's clipped statistics (they depend on the clip bound, the unit and the
    projection, not on ε or the ridge); with ``active`` (each client's classes) also the
    label-normalised positive sums of ``class_sums="positives"``, which depend on those classes."""

    dp: DpConfig = config.dp  # type: ignore[assignment]  (set: this path runs only with DP)
    projection = dp_projection(dp, data.features.shape[1])
    return {
        client_id(k): private_statistics(
            data.features[r],
            data.cohort.labels[r],
            dp.clip,
            projection=projection,
            device=config.device,
            active=None if active is None else active[k],
        )
        for k, r in enumerate(_client_rows(data, dp))
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
    """What the report says about DP: the release's record, plus the rows each client clipped."""
    summary = privacy_record(plan, solve, solve2, feature_dim=feature_dim)
    position = list(summary).index("blocks")
    items = list(summary.items())
    clipping = [
        ("rows_clipped", {k: s.n_clipped for k, s in stats.items()}),  # type: ignore[attr-defined]
        ("rows_used", {k: s.n_rows for k, s in stats.items()}),  # type: ignore[attr-defined]
    ]
    return dict(items[:position] + clipping + items[position:])


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
    clipped = privacy["rows_clipped"]
    used = privacy["rows_used"]
    assert isinstance(clipped, Mapping) and isinstance(used, Mapping)
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
        f"rows clipped: {sum(clipped.values())} of {sum(used.values())} "
        f"({', '.join(f'{k} {v}' for k, v in clipped.items())})",
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
# The ε sweep
# ----------------------------------------------------------------------------------------------


def sweep_mechanisms(dp: DpConfig, baseline_clip: float | None = None) -> dict[str, DpConfig]:
    """The mechanisms the ε sweep puts side by side: today's (``old``: the rows' d dimensions, the
    data-independent ridge, split class sums, no centring, ``baseline_clip`` or ``dp``'s clip) and
    ``dp`` as given (``new``), when it differs."""
    old = replace(
        dp,
        projection_dim=None,
        ridge="bound",
        class_sums="split",
        row_centre=False,
        clip=dp.clip if baseline_clip is None else baseline_clip,
    )
    out = {mechanism_label(old): old}
    if dp != old:
        out[mechanism_label(dp)] = dp
    return out


def mechanism_label(dp: DpConfig) -> str:
    dims = "d dims" if dp.projection_dim is None else f"K = {dp.projection_dim}"
    sums = "" if dp.class_sums == "split" else ", positive sums"
    centre = "centred rows, " if dp.row_centre else ""
    return f"{centre}{dims}, {dp.ridge} ridge{sums}"


def run_dp_sweep(
    config: SimConfig,
    *,
    epsilons: Sequence[float] = SWEEP_EPSILONS,
    progress: Progress | None = None,
    baseline_clip: float | None = None,
) -> dict[str, object]:
    """BACC and AUC of the private method against ε for each missing level of ``config``, for each
    mechanism of :func:`sweep_mechanisms` (today's, and ``config.dp``'s projection and ridge).

    ``ε = ∞`` is the same pipeline (clipped rows, projected under ``--dp-dim``,
    ``balance="global"``, ``gram="global"``) with no noise and no DP ridge: the price of privacy
    alone, not of clipping or of the projection (which the ∞ points of the two mechanisms compare).
    """
    from secure_afl.sim.datasets import prepare

    dp: DpConfig = config.dp  # type: ignore[assignment]  (set: this path runs only with DP)
    data = prepare(
        config.images,
        fraction=config.fraction,
        dim=config.dim,
        seed=config.seed,
        n_clients=config.n_clients,
        split=config.split,
    )
    mechanisms = sweep_mechanisms(dp, baseline_clip)
    points = []
    done, total = 0, len(mechanisms) * len(config.missing) * len(epsilons)
    for label, mechanism in mechanisms.items():
        mech_config = replace(config, dp=mechanism)
        positives = mechanism.class_sums == "positives"
        stats = {} if positives else client_private_statistics(data, mech_config)
        for missing in config.missing:
            if positives:  # the positive sums are normalised over each level's classes
                active = assign_partial_labels(
                    config.n_clients,
                    data.cohort.labels.shape[1],
                    missing,
                    seed=config.seed,
                    missing1=config.missing1,
                ).active
                stats = client_private_statistics(data, mech_config, active)
            for eps in epsilons:
                timer = PhaseTimer()
                ridge = None
                if math.isinf(eps):
                    metrics = _non_private_metrics(data, missing, mech_config, stats)
                else:
                    cfg = replace(mech_config, dp=replace(mechanism, epsilon=eps))
                    setting = run_private_setting(
                        data, missing, cfg, timer, progress or (lambda *a: None), stats=stats
                    )
                    metrics = setting.metrics
                    ridge = setting.privacy["ridge"]  # type: ignore[index]
                done += 1
                if progress is not None:
                    progress("ε sweep", done, total)
                for method, m in metrics.items():
                    points.append(
                        {
                            "missing": missing,
                            "epsilon": None if math.isinf(eps) else eps,
                            "mechanism": label,
                            "projection_dim": mechanism.projection_dim,
                            "ridge_kind": mechanism.ridge,
                            "ridge": ridge,
                            "method": method,
                            "bacc": m.macro["bacc"],
                            "auc": m.macro["auc"],
                            "map": m.macro["map"],
                        }
                    )
    return {
        "delta": dp.delta,
        "clip": dp.clip,
        "unit": dp.unit,
        "rounds": config.rounds,
        "feature_dim": int(data.features.shape[1]),
        "projection_seed": dp.projection_seed,
        "mechanisms": list(mechanisms),
        "clips": {label: m.clip for label, m in mechanisms.items()},
        "points": points,
    }


def _non_private_metrics(
    data: PreparedData, missing: int, config: SimConfig, stats: Mapping[str, PrivateStatistics]
) -> dict[str, object]:
    from secure_afl.analytic import AnalyticClassifier, sum_contributions
    from secure_afl.privacy.dp_solve import analytic_sums

    dp: DpConfig = config.dp  # type: ignore[assignment]  (set: this path runs only with DP)
    projection = dp_projection(dp, data.features.shape[1])
    n_classes = data.cohort.labels.shape[1]
    assignment = assign_partial_labels(
        config.n_clients, n_classes, missing, seed=config.seed, missing1=config.missing1
    )
    rows = _client_rows(data, dp)
    ordered = list(stats.values())
    sums = analytic_sums(
        sum_contributions(
            s.round1(assignment.active[k], class_sums=dp.class_sums) for k, s in enumerate(ordered)
        ),
        n_classes,
    )
    model = AnalyticClassifier(n_classes, gamma=config.gamma, balance="global", gram="global").fit(sums)
    test_x = data.features[data.split.test]
    test_y = data.cohort.labels[data.split.test]
    out = {AFL_DP_1: evaluate(test_y, lift(model, projection).decision_function(test_x), kind="logits")}
    if config.rounds == 2:
        pseudo = sum_contributions(
            pseudo_label_round(
                private_rows(data.features[r], dp.clip, projection)[0],
                model.coef_,
                assignment.active[k],
                config.pseudo,
            )
            for k, r in enumerate(rows)
        )
        solve = PrivateSolve(0.0, 0.0, False)
        refined, _ = refine_private(model, sums, pseudo, solve, n_classes=n_classes, config=config.pseudo)
        out[AFL_DP_2] = evaluate(test_y, lift(refined, projection).decision_function(test_x), kind="logits")
    return out


def write_sweep(sweep: Mapping[str, object], out_dir: Path) -> tuple[Path, Path]:
    """``dp_sweep.json`` and ``dp_sweep.png`` (BACC and AUC against ε: one colour per missing
    level, one line style per mechanism)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "dp_sweep.json"
    json_path.write_text(json.dumps(sweep, indent=2) + "\n")
    points = sweep["points"]
    assert isinstance(points, list)
    finite = sorted({p["epsilon"] for p in points if p["epsilon"] is not None})
    inf_x = (finite[-1] * 2) if finite else 1.0
    mechanisms = list(sweep.get("mechanisms") or sorted({p.get("mechanism", "") for p in points}))
    levels = sorted({p["missing"] for p in points})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, metric, label in zip(axes, ("bacc", "auc"), ("BACC (%)", "ROC AUC (%)"), strict=True):
        keys = sorted({(p["missing"], p.get("mechanism", ""), p["method"]) for p in points})
        for key in keys:
            series = [p for p in points if (p["missing"], p.get("mechanism", ""), p["method"]) == key]
            xs = [inf_x if p["epsilon"] is None else p["epsilon"] for p in series]
            ys = [100 * p[metric] for p in series]
            order = np.argsort(xs)
            colour = colours[levels.index(key[0]) % len(colours)]
            style = styles[mechanisms.index(key[1]) % len(styles)] if key[1] in mechanisms else "-"
            name = f"missing {key[0]}, {key[1]}" + (f", {key[2]}" if "2 rounds" in key[2] else "")
            ax.plot(np.array(xs)[order], np.array(ys)[order], marker="o", ls=style, color=colour, label=name)
        ax.set_xscale("log", base=2)
        ticks = [*finite, inf_x]
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t:g}" for t in finite] + ["∞"])
        ax.set_xlabel(f"ε (δ = {sweep['delta']:g})")
        ax.set_ylabel(label)
        ax.axhline(50, color="grey", lw=0.5, ls=":")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    dim = sweep.get("feature_dim")
    clips = sweep.get("clips") or {"": sweep["clip"]}
    assert isinstance(clips, Mapping)
    clip_text = " / ".join(f"{c:g}" for c in clips.values())
    projected = any("K = " in str(label) for label in clips)
    fig.suptitle(
        f"Privacy–utility, clip {clip_text}, one {sweep['unit']} protected, d = {dim} (synthetic features)"
        + (f"; K: public random projection, seed {sweep.get('projection_seed', 0)}" if projected else ""),
        fontsize=10,
    )
    fig.tight_layout()
    png_path = out_dir / "dp_sweep.png"
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return json_path, png_path


# ----------------------------------------------------------------------------------------------
# A growing federation under DP (secure-afl sim --scenario growing --dp-epsilon E)
# ----------------------------------------------------------------------------------------------


class PrivateGrowth:
    """The DP side of ``--scenario growing``: one noise plan for the study (its layout does not
    depend on the rows), each session's noisy uploads over the clients' new rows, and the chain's
    solve on the accumulated noisy sums (:mod:`secure_afl.privacy.dp_growth`).

    Under the patient unit the cap ``max_images_per_patient`` holds per session (over every client,
    as the simulator knows every patient id): a deployment's institution caps each session's new
    images, so a patient may contribute in several sessions, and the chain's ε composes.
    """

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
            patient_clients=n_clients,  # the split may spread a patient's images (run_private_setting)
        )
        self.plan = plan_noise(dp, layout)
        self.chain: ChainNoise | None = None
        self.clean_total: Contributions | None = None

    def _capped(self, session: Sequence[np.ndarray]) -> list[np.ndarray]:
        return _capped_rows(self.data, self.dp, [np.asarray(r, dtype=np.int64) for r in session])

    def uploads(
        self, session: Sequence[np.ndarray]
    ) -> tuple[dict[str, Contributions], dict[str, Contributions], dict[str, int]]:
        """Every client's noisy round-1 upload over its new rows ``session[k]`` (a client without
        any still noises its zeros), the clean uploads, and the rows each clipped."""
        noisy, clean, clipped = {}, {}, {}
        device = self.config.device  # type: ignore[attr-defined]
        for k, rows in enumerate(self._capped(session)):
            name = self.names[k]
            stats = private_statistics(
                self.data.features[rows],
                self.data.cohort.labels[rows],
                self.dp.clip,
                projection=self.projection,
                device=device,
                active=self.active[k],
            )
            noisy[name], clean[name] = round1_upload(stats, self.active[k], self.plan, self.random)
            clipped[name] = stats.n_clipped
        return noisy, clean, clipped

    def solve(
        self, total: Contributions, clean: Mapping[str, Contributions], gram_survivors: int
    ) -> tuple[np.ndarray, np.ndarray, dict[str, object]]:
        """The chain's classifier on the accumulated noisy sums ``total`` (this session's last),
        the noise-free reference (the same clipped rows' sums, pooled), and the privacy record."""
        from secure_afl.analytic import AnalyticClassifier
        from secure_afl.growth import accumulate_sums
        from secure_afl.privacy.dp_solve import analytic_sums

        noise = SessionNoise.of(self.plan, gram_survivors, feature_dim=self.feature_dim)
        self.chain = ChainNoise((noise,)) if self.chain is None else self.chain.extended(noise)
        self.clean_total = accumulate_sums(self.clean_total, sum_contributions(clean.values()))
        gamma = self.config.gamma  # type: ignore[attr-defined]
        model, solve, _ = fit_private(
            total, self.plan, n_classes=self.n_classes, gamma=gamma, gram_survivors=gram_survivors,
            chain=self.chain,
        )  # fmt: skip
        reference = AnalyticClassifier(self.n_classes, gamma=gamma, balance="global", gram="global")
        reference.fit(analytic_sums(self.clean_total, self.n_classes))
        record = privacy_record(self.plan, solve, None, feature_dim=self.feature_dim, chain=self.chain)
        return lift(model, self.projection).coef_, lift(reference, self.projection).coef_, record
