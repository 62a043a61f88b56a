"""The ε sweep (``secure-afl sim --dp-sweep``): BACC and AUC of the private method against ε, each
point one setting of the pipeline (:func:`secure_afl.sim.runner.run_setting`) under
:class:`secure_afl.sim.private.PrivateMechanism`, the clients' clipped statistics made once per
mechanism and missing level."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from secure_afl.privacy.dp import DpConfig, PrivateStatistics, private_rows, pseudo_label_round
from secure_afl.privacy.dp_solve import PrivateSolve, lift, refine_private
from secure_afl.sim.datasets import PreparedData, Progress
from secure_afl.sim.metrics import evaluate
from secure_afl.sim.partial import assign_partial_labels
from secure_afl.sim.private import AFL_DP_1, AFL_DP_2, client_private_statistics, client_rows, dp_projection
from secure_afl.sim.runner import run_setting
from secure_afl.sim.setting import PhaseTimer, SimConfig, no_progress

SWEEP_EPSILONS = (0.5, 1.0, 2.0, 4.0, 8.0, math.inf)

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
                    metrics = noise_free_metrics(data, missing, mech_config, stats)
                else:
                    cfg = replace(mech_config, dp=replace(mechanism, epsilon=eps))
                    setting = run_setting(data, stats, missing, cfg, timer, no_progress)
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


def noise_free_metrics(
    data: PreparedData, missing: int, config: SimConfig, stats: Mapping[str, PrivateStatistics]
) -> dict[str, object]:
    """The sweep's ε = ∞ point: the private method's fit on the same clipped (and projected)
    statistics, summed in the clear, with no noise and no DP ridge (a reference, not a release)."""
    from secure_afl.analytic import AnalyticClassifier, sum_contributions
    from secure_afl.privacy.dp_solve import analytic_sums

    dp: DpConfig = config.dp  # type: ignore[assignment]  (set: this path runs only with DP)
    projection = dp_projection(dp, data.features.shape[1])
    n_classes = data.cohort.labels.shape[1]
    assignment = assign_partial_labels(
        config.n_clients, n_classes, missing, seed=config.seed, missing1=config.missing1
    )
    rows = client_rows(data, dp)
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
