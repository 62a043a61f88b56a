"""Secure / plaintext of ``secure-afl sim --missing 1 --fedavg-rounds 1`` in CPU-seconds, paired runs.

On a loaded host wall seconds swing by 2-4x between runs (other processes take the cores), so the
wall ratio of ``bench_secure.py --only e2e`` says little there; this script runs ``run_experiment``
in one process, ``--protection mask`` and ``none`` interleaved (the order alternating), and
reports, after one warm-up run that is not counted, this process's CPU-seconds
(``time.process_time``: every thread of it, not FedAvg's forked trainer) and its wall seconds for
each run, with the load average.  ``--dropout 2`` adds the
bench_secure e2e setting (two clients drop before R2).  Each pair's results must agree: the macro
metrics of every method are compared.

Run from the repository root: ``python bench/bench_e2e_cpu.py [--pairs 4] [--dropout 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--dropout", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    args = parser.parse_args()
    from secure_afl.sim.fedavg import FedAvgConfig
    from secure_afl.sim.runner import run_experiment
    from secure_afl.sim.setting import SimConfig

    options: dict[str, object] = {"missing": (1,), "fedavg": FedAvgConfig(rounds=1)}
    if args.dropout:
        options.update(dropout=args.dropout, dropout_stage="R2")
    cpu: dict[str, list[float]] = {"mask": [], "none": []}
    loads: list[float] = []
    wall: dict[str, list[float]] = {"mask": [], "none": []}
    run_experiment(SimConfig(secure="mask", **options))  # type: ignore[arg-type]  # warm-up: imports, caches
    for i in range(args.pairs):
        metrics = {}
        for secure in ("mask", "none") if i % 2 == 0 else ("none", "mask"):
            load = os.getloadavg()[0]
            loads.append(load)
            c, w = time.process_time(), time.perf_counter()
            result = run_experiment(SimConfig(secure=secure, **options))  # type: ignore[arg-type]
            cpu[secure].append(time.process_time() - c)
            wall[secure].append(time.perf_counter() - w)
            metrics[secure] = {k: v.macro for k, v in result.settings[0].metrics.items()}
            print(
                f"pair {i + 1} {secure}: {cpu[secure][-1]:.2f} CPU-s, {wall[secure][-1]:.2f} s wall, "
                f"load {load:.1f}; aggregation phase {result.seconds.get('aggregation', 0.0):.2f} s wall",
                flush=True,
            )
        assert metrics["mask"] == metrics["none"], "the two paths must give the same metrics"
    cpu_ratios = [m / n for m, n in zip(cpu["mask"], cpu["none"], strict=True)]
    wall_ratios = [m / n for m, n in zip(wall["mask"], wall["none"], strict=True)]
    print(
        f"mask / none: CPU median {statistics.median(cpu_ratios):.3f} "
        f"(pairs {', '.join(f'{r:.3f}' for r in cpu_ratios)}); "
        f"wall median {statistics.median(wall_ratios):.3f} "
        f"(pairs {', '.join(f'{r:.3f}' for r in wall_ratios)}); metrics identical in every pair: yes"
    )
    if args.json is not None:
        report = {
            "command": "bench_e2e_cpu.py",
            "pairs": args.pairs,
            "dropout": args.dropout,
            "cpu_seconds": cpu,
            "wall_seconds": wall,
            "load_average_per_run": loads,
            "cpu_ratios": cpu_ratios,
            "wall_ratios": wall_ratios,
            "cpu_ratio_median": statistics.median(cpu_ratios),
            "wall_ratio_median": statistics.median(wall_ratios),
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
