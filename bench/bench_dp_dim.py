"""DP on the embedded data: the projection dimension K and the ridge against today's mechanism.

Run by hand:  python bench/bench_dp_dim.py [--ks none,16,32,64,128,256] [--epsilons 1,4]
              [--missing 1,7] [--ridges bound,adaptive,adassp] [--repeats 3] [--json out.json]
              python bench/bench_dp_dim.py --decompose [--epsilons 1,4] [--ks none,64]

Every point is `secure-afl sim --rounds 1 --dp-epsilon E [--dp-dim K --dp-ridge R]` on the full
embedded data (seed 0, masking protocol, one image protected, δ = 1e-6, clip 32): the simulator's own
`run_setting` under the private mechanism, the exact discrete Gaussian noise, the secure
aggregation.  The noise is
drawn from a seeded stream (`DeterministicRandomSource`, one seed per repeat, the same seeds for
every mechanism), so the table is reproducible; each cell is the mean over the repeats of the macro
BACC and AUC (in %), ± the standard deviation over the repeats.  `ε = ∞` is the same clipped (and
projected) statistics without noise or DP ridge: the ceiling of each K.

With --center C: a diagnostic, not a release.  Every row (training and test) first has the mean of
all training rows subtracted (an oracle: a deployment would need that mean from a public source or
from an extra noised release) and the clip becomes C: what clipping the centred rows would buy.

With --decompose: a diagnostic, not a release.  For each ε and K, round 1 as above (bound ridge), but
the server aggregates uploads where only one kind of block keeps its noise (the others are replaced
by the clean values the client computed them from): which noise costs the utility.  With only the
class sums and counts noised the Gram is exact and the solve uses γ alone (no DP ridge).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.privacy.dp import DpConfig
from secure_afl.sim.datasets import prepare
from secure_afl.sim.dp_sweep import noise_free_metrics
from secure_afl.sim.partial import assign_partial_labels
from secure_afl.sim.private import AFL_DP_1, client_private_statistics
from secure_afl.sim.runner import run_setting
from secure_afl.sim.setting import PhaseTimer, SimConfig


def _parse_k(text: str) -> int | None:
    return None if text.strip().lower() in ("none", "d", "") else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ks", default="none,16,32,64,128,256", help="comma list; none: no projection")
    parser.add_argument("--epsilons", default="1,4", help="comma list; inf: the non-private ceiling")
    parser.add_argument("--missing", default="1,7")
    parser.add_argument("--ridges", default="bound,adaptive,adassp")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="the projection's seed")
    parser.add_argument("--decompose", action="store_true")
    parser.add_argument("--center", type=float, default=None, help="diagnostic: centre the rows, clip C")
    parser.add_argument("--class-sums", default="split", help="comma list: split, positives")
    parser.add_argument("--shares", default=None, help="ρ shares gram,sums,counts (default: DpConfig's)")
    parser.add_argument("--threshold", type=int, default=None, help="masking threshold t (default: n−3)")
    parser.add_argument("--row-centre", action="store_true", help="remove each row's own mean first")
    parser.add_argument("--clip", type=float, default=32.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    ks = [_parse_k(k) for k in args.ks.split(",")]
    epsilons = [math.inf if e.strip() == "inf" else float(e) for e in args.epsilons.split(",")]
    missing = [int(m) for m in args.missing.split(",")]
    ridges = args.ridges.split(",")
    shares = {} if args.shares is None else {"rho_shares": tuple(float(x) for x in args.shares.split(","))}
    dp = DpConfig(epsilon=1.0, clip=args.clip, row_centre=args.row_centre, **shares)
    base = SimConfig(missing=tuple(missing), rounds=1, dp=dp, device="cpu", threshold=args.threshold)
    data = prepare(None, fraction=base.fraction, dim=base.dim, seed=base.seed, n_clients=base.n_clients)
    if args.center is not None:
        train = np.concatenate([np.asarray(r) for r in data.split.clients])
        mean = data.features[train].astype(np.float64).mean(axis=0)
        data = replace(data, features=(data.features - mean).astype(np.float32))
        base = replace(base, dp=replace(base.dp, clip=args.center))
    if args.decompose:
        decompose(data, base, ks, [e for e in epsilons if math.isfinite(e)], missing, args.repeats, args.seed)
        return
    rows = []
    for k, sums in ((k, sums) for sums in args.class_sums.split(",") for k in ks):
        dp_k = replace(base.dp, projection_dim=k, projection_seed=args.seed, class_sums=sums)
        started = time.perf_counter()
        for m in missing:
            active = assign_partial_labels(
                base.n_clients, 8, m, seed=base.seed, missing1=base.missing1
            ).active
            stats = client_private_statistics(data, replace(base, dp=dp_k), active)
            ceiling = noise_free_metrics(data, m, replace(base, dp=dp_k), stats)[AFL_DP_1]
            rows.append(
                _row(k, "-", m, math.inf, [ceiling.macro["bacc"]], [ceiling.macro["auc"]], [None], sums)
            )
            for eps in (e for e in epsilons if math.isfinite(e)):
                for ridge in ridges:
                    bacc, auc, lam = [], [], []
                    for r in range(args.repeats):
                        cfg = replace(base, dp=replace(dp_k, epsilon=eps, ridge=ridge))
                        source = DeterministicRandomSource(f"bench-dp-dim/{m}/{eps}/{r}".encode())
                        setting = run_setting(data, stats, m, cfg, PhaseTimer(), random=source)
                        metric = setting.metrics[AFL_DP_1]
                        bacc.append(metric.macro["bacc"])
                        auc.append(metric.macro["auc"])
                        lam.append(setting.privacy["ridge"])  # type: ignore[index]
                    rows.append(_row(k, ridge, m, eps, bacc, auc, lam, sums))
                    print(_line(rows[-1]), flush=True)
        print(f"# K {k}, class sums {sums}: {time.perf_counter() - started:.0f} s", flush=True)
    print()
    print("| K | class sums | ridge | missing | ε | BACC | AUC | λ |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(_markdown(row))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


def _row(k, ridge, m, eps, bacc, auc, lam, sums="split") -> dict[str, object]:
    return {
        "K": k,
        "class_sums": sums,
        "ridge": ridge,
        "missing": m,
        "epsilon": None if math.isinf(eps) else eps,
        "bacc": [100 * b for b in bacc],
        "auc": [100 * a for a in auc],
        "lambda": lam,
    }


def _stat(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def _line(row) -> str:
    eps = "∞" if row["epsilon"] is None else f"{row['epsilon']:g}"
    return (
        f"K {row['K'] or 'd'} {row['class_sums']} ridge {row['ridge']} missing {row['missing']} ε {eps}: "
        f"BACC {_stat(row['bacc'])} AUC {_stat(row['auc'])}"
    )


def _markdown(row) -> str:
    eps = "∞" if row["epsilon"] is None else f"{row['epsilon']:g}"
    lam = row["lambda"][0]
    lam_text = "" if lam is None else f"{statistics.mean(row['lambda']):.3g}"
    return (
        f"| {row['K'] or 'd = 1024'} | {row['class_sums']} | {row['ridge']} | {row['missing']} | {eps} | "
        f"{_stat(row['bacc'])} | "
        f"{_stat(row['auc'])} | {lam_text} |"
    )


def decompose(data, base: SimConfig, ks, epsilons, missing, repeats: int, seed: int) -> None:
    """Round 1 with the noise of one kind of block only (a diagnostic)."""
    from secure_afl.analytic import AnalyticClassifier
    from secure_afl.privacy.dp import FederationLayout, plan_noise, round1_upload
    from secure_afl.privacy.dp_solve import analytic_sums, fit_private, lift
    from secure_afl.sim import runner
    from secure_afl.sim.metrics import evaluate
    from secure_afl.sim.partial import assign_partial_labels
    from secure_afl.sim.private import dp_projection
    from secure_afl.sim.secure import default_threshold

    test_x, test_y = data.features[data.split.test], data.cohort.labels[data.split.test]
    print("| K | missing | ε | noise on | BACC | AUC |")
    print("|---|---|---|---|---|---|")
    for k in ks:
        dp_k = replace(base.dp, projection_dim=k, projection_seed=seed)
        stats = client_private_statistics(data, replace(base, dp=dp_k))
        projection = dp_projection(dp_k, data.features.shape[1])
        for m in missing:
            assignment = assign_partial_labels(base.n_clients, 8, m, seed=base.seed, missing1=base.missing1)
            clients = list(stats)
            for eps in epsilons:
                dp = replace(dp_k, epsilon=eps, ridge="bound")
                layout = FederationLayout(
                    active={c: assignment.active[i] for i, c in enumerate(clients)},
                    n_classes=8,
                    dim=dp.statistics_dim(data.features.shape[1]),
                    threshold=default_threshold(base.n_clients),
                    patient_clients=base.n_clients,  # as sim/private.py: the split may spread a patient
                )
                plan = plan_noise(dp, layout)
                for keep in ("all", "gram", "sums+counts"):
                    bacc, auc = [], []
                    for r in range(repeats):
                        source = DeterministicRandomSource(f"bench-dp-dim/{m}/{eps}/{r}".encode())
                        uploads = {}
                        for i, c in enumerate(clients):
                            noisy, clean = round1_upload(stats[c], assignment.active[i], plan, source)
                            uploads[c] = {
                                g: {
                                    t: noisy[g][t]
                                    if keep == "all" or (t == "gram") == (keep == "gram")
                                    else v
                                    for t, v in tensors.items()
                                }
                                for g, tensors in clean.items()
                            }
                        agg = runner.aggregate(uploads, replace(base, dp=dp), dropouts={})
                        if keep == "sums+counts":  # an exact Gram needs no DP ridge: γ alone
                            model = AnalyticClassifier(8, gamma=base.gamma, balance="global", gram="global")
                            model.fit(analytic_sums(agg.sums, 8))
                        else:
                            model, _, _ = fit_private(
                                agg.sums,
                                plan,
                                n_classes=8,
                                gamma=base.gamma,
                                gram_survivors=len(agg.survivors["all"]),
                            )
                        metric = evaluate(
                            test_y, lift(model, projection).decision_function(test_x), kind="logits"
                        )
                        bacc.append(100 * metric.macro["bacc"])
                        auc.append(100 * metric.macro["auc"])
                    print(
                        f"| {k or 'd = 1024'} | {m} | {eps:g} | {keep} | {_stat(bacc)} | {_stat(auc)} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
