"""Seconds per phase of `secure-afl sim --missing 7` on the full embedded dataset.

Run by hand:  python bench/bench_sim.py [--repeats 3] [--missing 7] [--secure none,mask]

Prints one markdown row per protection: the median over the repeats of each phase (data,
statistics, aggregation, solve, the wait for the gradient methods, metrics) and of the whole run, as
`run_experiment` times them, the wall seconds of FedAvg's training on its thread (it runs
beside the AFL phases, see secure_afl/sim/gradient.py), plus the wall time of the process-level call.
"""

from __future__ import annotations

import argparse
import statistics
import time

from secure_afl.sim.runner import SimConfig, run_experiment

PHASES = ("data", "statistics", "aggregation", "solve", "gradient methods (wait)", "metrics")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--missing", default="7", help="comma list of missing levels")
    parser.add_argument("--secure", default="none,mask", help="comma list of protections")
    args = parser.parse_args()
    missing = tuple(int(m) for m in args.missing.split(","))
    print(f"secure-afl sim --missing {args.missing}: median of {args.repeats} runs, seconds\n")
    print("| protection | " + " | ".join(PHASES) + " | total | FedAvg (thread) | wall |")
    print("|---|" + "---|" * (len(PHASES) + 3))
    for secure in args.secure.split(","):
        runs = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            result = run_experiment(SimConfig(missing=missing, secure=secure))  # type: ignore[arg-type]
            fedavg = sum(s.method_seconds.get("FedAvg", 0.0) for s in result.settings)
            runs.append({**result.seconds, "FedAvg": fedavg, "wall": time.perf_counter() - start})
        median = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in (*PHASES, "FedAvg", "wall")}
        total = sum(median[p] for p in PHASES)
        cells = " | ".join(f"{median[p]:.2f}" for p in PHASES)
        print(f"| {secure} | {cells} | {total:.2f} | {median['FedAvg']:.2f} | {median['wall']:.2f} |")


if __name__ == "__main__":
    main()
