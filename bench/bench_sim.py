"""Seconds per phase of `secure-afl sim --missing 7` on the full embedded dataset.

Run by hand:  python bench/bench_sim.py [--repeats 3] [--missing 7] [--secure none,mask]
              python bench/bench_sim.py --cli [--repeats 5]

With --cli: the console script itself, as a user runs it (`secure-afl sim --missing 7` in a
fresh process each time, output discarded): its wall seconds and its CPU seconds (user + sys of
the process and its children), every run listed, on a machine that should be otherwise idle.

With --cli, a calibration follows in a fresh process: FedAvg's rounds alone on the embedded data, on
one thread and on every core. This machine's speed drifts by the hour (the same run has taken
15 s and 19 s on the same day): compare wall times only beside the calibration of the same hour.
`--calibrate` prints the calibration alone.

Prints one markdown row per protection: the median over the repeats of each phase (data,
statistics, aggregation, solve, the wait for the gradient methods, metrics) and of the whole run, as
`run_experiment` times them, the wall seconds of FedAvg's training (beside the AFL phases, on a thread
here: only the console script forks it, see secure_afl/sim/gradient.py), plus the wall time of the
process-level call.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from secure_afl.sim.runner import SimConfig, run_experiment

PHASES = ("data", "statistics", "aggregation", "solve", "gradient methods (wait)", "metrics")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--missing", default="7", help="comma list of missing levels")
    parser.add_argument("--secure", default="none,mask", help="comma list of protections")
    parser.add_argument("--cli", action="store_true", help="time the console script in fresh processes")
    parser.add_argument("--calibrate", action="store_true", help="time FedAvg's rounds alone, then stop")
    args = parser.parse_args()
    if args.calibrate:
        calibrate()
        return
    if args.cli:
        time_console_script(args.repeats, args.missing)
        sys.stdout.flush()  # before the calibration's process writes to the same stream
        subprocess.run([sys.executable, __file__, "--calibrate"], check=True)
        return
    missing = tuple(int(m) for m in args.missing.split(","))
    print(f"secure-afl sim --missing {args.missing}: median of {args.repeats} runs, seconds\n")
    print("| protection | " + " | ".join(PHASES) + " | total | FedAvg (own) | wall |")
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


def time_console_script(repeats: int, missing: str) -> None:
    # the console script of this interpreter's environment first (run as .venv/bin/python), then PATH
    beside = Path(sys.executable).parent / "secure-afl"
    script = str(beside) if beside.is_file() else shutil.which("secure-afl")
    if script is None:
        raise SystemExit(
            f"no secure-afl console script beside {sys.executable} or on PATH: run this with the "
            "environment's python after `pip install -e .`, or activate that environment"
        )
    load = os.getloadavg()[0]
    print(f"secure-afl sim --missing {missing}, {repeats} fresh processes (load average {load:.2f})")
    walls = []
    for run in range(repeats):
        with tempfile.TemporaryDirectory() as out:
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            subprocess.run(
                [script, "sim", "--missing", missing, "--out", out], check=True, stdout=subprocess.DEVNULL
            )
            wall = time.perf_counter() - start
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        walls.append(wall)
        print(f"run {run + 1}: {wall:.2f} s wall, {cpu:.2f} CPU-seconds")
    print(f"median {statistics.median(walls):.2f} s wall")


def calibrate(rounds: int = 6) -> None:
    """FedAvg's seconds per round on the embedded data (missing 7), alone, after one warm-up round."""
    import numpy as np
    import torch

    from secure_afl.sim.baselines.engine import stack_clients
    from secure_afl.sim.datasets import prepare
    from secure_afl.sim.fedavg import FedAvgConfig, missing_as_negative, train_fedavg_stacked
    from secure_afl.sim.gradient import available_cores

    data = prepare(None)
    x = stack_clients(data.features, data.split.clients)
    labels = [data.cohort.labels[rows] for rows in data.split.clients]
    y = torch.as_tensor(np.stack([missing_as_negative(labels[k], [k]) for k in range(len(labels))]))
    cores = available_cores()
    print(f"calibration: FedAvg alone on the embedded data, {x.shape[0]} clients of {x.shape[1]} rows")
    for threads in sorted({1, cores}):
        train_fedavg_stacked(x, y, FedAvgConfig(rounds=1), threads=threads)  # warm-up
        start = time.perf_counter()
        train_fedavg_stacked(x, y, FedAvgConfig(rounds=rounds), threads=threads)
        print(f"  {threads} thread(s): {(time.perf_counter() - start) / rounds:.3f} s per round")


if __name__ == "__main__":
    main()
