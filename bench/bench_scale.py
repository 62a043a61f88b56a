"""Growth with the number of institutions (issue 30): one client's protocol seconds, the server's
seconds and one client's exposure-check seconds, per layout.

Layouts (labels from ``assign_partial_labels(n, 8, missing, seed)``, 8 classes, the first seed
from 0 that gives every class at least two labellers):

- ``missing1`` .. ``missing7``: the per-class Gram layout (round 1, ``gram="class"``): per labelled
  class a group ``class/<c>`` with ``gram`` (d×d, sent as its upper triangle) and ``b/<c>``;
- ``global``: the global-Gram layout at missing 1 (``gram="global"``): ``b/<c>`` per class group,
  ``gram`` once, in ``all``.

How it is measured.  ``--session`` runs one full masked session in process
(:func:`secure_afl.aggregation.inprocess.run_in_process`: every client and the server, real wire
encoding, t = floor(2n/3) + 1, groups of at least 2), under the deployment policy except that a
client goes on where its check finds exposure (so that the session finishes and its costs can be
read): ``client_seconds`` is the median over clients of one client's seconds in all rounds (its
exposure checks included), ``server_seconds`` the server's seconds in all rounds.  Without
``--session`` (the default above 200 clients, where a full session of n clients costs n times one
client's work on this machine) the session is not run and those two are null.
``exposure_seconds`` is always measured: the call each client makes before it signs the survivor
set (``client_exposures`` over its groups with every member live and c = n - t colluders), for the
first client, with its verdict (``exposure_verdicts``: safe, exposed or undecided = refused at the
work bound).

Run from the repository root:
``python bench/bench_scale.py --clients N --json FILE [--dim 16] [--session] [--layouts ...] [--micro]``.
``--micro`` adds CPU-seconds of the server's Shamir recovery of n owners at t = floor(2n/3) + 1
(one Lagrange basis, as the server does now, against the per-owner interpolation it did before,
the latter only up to n = 256), and the client statistics (5,889 rows, d = 1024, one thread)
against a bare numpy syrk of the same float64 shape.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime

import numpy as np

from secure_afl.aggregation.backend import MaskingBackend
from secure_afl.aggregation.inprocess import run_in_process
from secure_afl.analytic import ClientStatistics, Contributions, sum_contributions
from secure_afl.core.randomness import DeterministicRandomSource
from secure_afl.privacy import exposure
from secure_afl.privacy.policy import ClientPolicy, active_threshold
from secure_afl.sim.partial import assign_partial_labels

N_CLASSES = 8
LAYOUTS = ("missing1", "missing3", "missing5", "missing7", "global")
SESSION_DEFAULT_MAX = 200


def layout_options(layout: str) -> tuple[int, str]:
    """(missing classes, gram scope) of a layout name."""
    if layout == "global":
        return 1, "global"
    if layout.startswith("missing") and layout[7:].isdigit():
        return int(layout[7:]), "class"
    raise ValueError(f"unknown layout {layout!r}: use one of {', '.join(LAYOUTS)}")


def client_ids(n: int) -> list[str]:
    return [f"site-{k:04d}" for k in range(n)]


def contributions_for(
    n: int, d: int, layout: str, *, rows: int = 24, seed: int = 0
) -> dict[str, Contributions]:
    """Each client's round-1 upload: statistics of ``rows`` random feature rows with labels that
    have a positive and a negative in every class."""
    missing, gram = layout_options(layout)
    for draw in range(100):  # groups of at least 2: redraw a labelling that leaves a class alone
        labels = assign_partial_labels(n, N_CLASSES, missing, seed=seed + draw, missing1="random")
        if min(len(s) for s in labels.coverage()) >= 2:
            break
    else:
        raise ValueError(f"no labelling of {n} clients at missing {missing} gives every class 2 labellers")
    rng = np.random.default_rng(seed)
    out = {}
    for cid, active in zip(client_ids(n), labels.active, strict=True):
        h = rng.exponential(size=(rows, d))
        y = (rng.random((rows, N_CLASSES)) < 0.3).astype(np.float64)
        y[0], y[1] = 1.0, 0.0
        stats = ClientStatistics(
            gram=h.T @ h,
            feat_sum=h.sum(axis=0),
            pos_sum=h.T @ y,
            n=rows,
            n_pos=y.sum(axis=0).astype(np.int64),
        )
        out[cid] = stats.contributions(list(active), gram=gram)
    return out


def groups_of(
    contributions: Mapping[str, Contributions],
) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """group -> (its members, its tensors): what every client sees with no one dropped."""
    members: dict[str, list[str]] = {}
    tensors: dict[str, set[str]] = {}
    for cid, groups in sorted(contributions.items()):
        for group, values in groups.items():
            members.setdefault(group, []).append(cid)
            tensors.setdefault(group, set()).update(values)
    return {g: (tuple(members[g]), tuple(sorted(tensors[g]))) for g in members}


def exposure_check(contributions: Mapping[str, Contributions], cid: str) -> tuple[float, float, str, tuple]:
    """Wall and CPU seconds of ``cid``'s pre-signature check (all members live, c = n - t), its
    verdict and findings."""
    n = len(contributions)
    colluders = ClientPolicy.deployment().colluders(n, active_threshold(n))
    own = exposure.own_value_digests(contributions[cid])
    own_tensors = {t for _, t in own}
    relevant = {g: v for g, v in groups_of(contributions).items() if own_tensors & set(v[1])}
    started, cpu = time.perf_counter(), time.process_time()
    findings = exposure.client_exposures(cid, own, relevant, round_name="R3", colluders=colluders)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    if not findings:
        verdict = "safe"
    elif all(f.undecided for f in findings):
        verdict = "undecided"
    else:
        verdict = "exposed"
    return seconds, cpu, verdict, findings


def session(contributions: Mapping[str, Contributions], *, seed: int = 0):
    """One full in-process masked session; (median client seconds, server seconds, run)."""
    n = len(contributions)
    policy = replace(ClientPolicy.deployment(), refuse_exposure=False)  # go on, so costs are read
    backend = MaskingBackend(threshold=active_threshold(n), client_policy=policy)
    run = run_in_process(
        backend, contributions, min_group_size=2, random=DeterministicRandomSource(f"scale{seed}".encode())
    )
    costs = run.costs
    per_client = [sum(costs.client_seconds[cid].values()) for cid in sorted(contributions)]
    return statistics.median(per_client), costs.total_server_seconds, run


def measure(n: int, d: int, layouts: Sequence[str], *, run_session: bool) -> dict:
    result: dict = {
        "command": f"python bench/bench_scale.py --clients {n} --dim {d}"
        + (" --session" if run_session else "")
        + f" --layouts {','.join(layouts)}",
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "host": f"{platform.machine()}, {platform.python_version()}",
        "clients": n,
        "dim": d,
        "threshold": active_threshold(n),
        "colluders": ClientPolicy.deployment().colluders(n, active_threshold(n)),
        "client_seconds": {},
        "server_seconds": {},
        "exposure_seconds": {},
        "exposure_cpu_seconds": {},
        "exposure_verdicts": {},
        "sums_match_plaintext": {},
    }
    for layout in layouts:
        contributions = contributions_for(n, d, layout)
        first = min(contributions)
        seconds, cpu, verdict, _ = exposure_check(contributions, first)
        result["exposure_seconds"][layout] = seconds
        result["exposure_cpu_seconds"][layout] = cpu
        result["exposure_verdicts"][layout] = verdict
        if run_session:
            client_s, server_s, run = session(contributions)
            plain = sum_contributions(contributions.values())
            result["client_seconds"][layout] = client_s
            result["server_seconds"][layout] = server_s
            result["sums_match_plaintext"][layout] = all(
                np.allclose(run.outcome.sums[g][t], plain[g][t], rtol=1e-9, atol=1e-6)
                for g in plain
                for t in plain[g]
            )
        else:
            result["client_seconds"][layout] = None
            result["server_seconds"][layout] = None
            result["sums_match_plaintext"][layout] = None
    return result


def shamir_recovery(n: int, *, textbook: bool) -> float:
    """Seconds to recover n owners' secrets from the same t = floor(2n/3) + 1 revealers: one Lagrange
    basis for all (the server now), or the textbook interpolation per owner (the server before)."""
    from secure_afl.protocol import shamir

    t = active_threshold(n)
    random = DeterministicRandomSource(b"shamir-bench")
    xs = list(range(1, t + 1))
    ys = [[shamir.random_field_element(random) for _ in xs] for _ in range(n)]
    started = time.process_time()
    if textbook:
        for values in ys:
            shares = [shamir.Share(x, y) for x, y in zip(xs, values, strict=True)]
            total = 0
            for i, share_i in enumerate(shares):
                numerator, denominator = 1, 1
                for j, share_j in enumerate(shares):
                    if i != j:
                        numerator = numerator * (0 - share_j.x) % shamir.PRIME
                        denominator = denominator * (share_i.x - share_j.x) % shamir.PRIME
                total = (total + share_i.y * numerator * pow(denominator, -1, shamir.PRIME)) % shamir.PRIME
    else:
        basis = shamir.lagrange_coefficients(xs)
        for values in ys:
            shamir.combine(basis, values)
    return time.process_time() - started


def statistics_ratio(rows: int = 5889, d: int = 1024, repeats: int = 5) -> dict:
    """client_statistics against a bare numpy syrk of the same float64 shape, one thread, CPU-s
    (median of ``repeats``, interleaved), for float64 and float32 features."""
    import torch

    from secure_afl.analytic import client_statistics

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    h32 = rng.standard_normal((rows, d)).astype(np.float32)
    h64 = h32.astype(np.float64)
    y = (rng.random((rows, N_CLASSES)) < 0.2).astype(np.float64)
    runs: dict[str, list[float]] = {"syrk": [], "stats64": [], "stats32": []}
    for _ in range(repeats):
        for name, run in (
            ("syrk", lambda: h64.T @ h64),
            ("stats64", lambda: client_statistics(h64, y, device="cpu")),
            ("stats32", lambda: client_statistics(h32, y, device="cpu")),
        ):
            started = time.process_time()
            run()
            runs[name].append(time.process_time() - started)
    floor = statistics.median(runs["syrk"])
    return {
        "syrk_cpu_seconds": floor,
        "float64_over_syrk": statistics.median(runs["stats64"]) / floor,
        "float32_over_syrk": statistics.median(runs["stats32"]) / floor,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, required=True)
    parser.add_argument("--json", required=True, help="where to write the figures")
    parser.add_argument("--dim", type=int, default=16, help="feature dimension d (default 16)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    session_flag = parser.add_mutually_exclusive_group()
    session_flag.add_argument("--session", dest="session", action="store_true", default=None)
    session_flag.add_argument("--no-session", dest="session", action="store_false")
    parser.add_argument(
        "--micro",
        action="store_true",
        help="also: Shamir recovery (one basis vs per owner) and client statistics vs a bare syrk",
    )
    args = parser.parse_args()
    layouts = [name for name in args.layouts.split(",") if name]
    for name in layouts:
        layout_options(name)
    run_session = args.clients <= SESSION_DEFAULT_MAX if args.session is None else args.session
    result = measure(args.clients, args.dim, layouts, run_session=run_session)
    if args.micro:
        result["shamir_cpu_seconds"] = {
            f"n={n}": {
                "one_basis": shamir_recovery(n, textbook=False),
                "per_owner": shamir_recovery(n, textbook=True) if n <= 256 else None,
            }
            for n in (128, 256, args.clients)
        }
        result["statistics"] = statistics_ratio()
    with open(args.json, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
