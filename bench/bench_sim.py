"""Seconds per phase of `secure-afl sim --missing 7` on the full embedded dataset.

Run by hand:  python bench/bench_sim.py [--repeats 3] [--missing 7] [--protection none,mask]
              python bench/bench_sim.py --cli [--repeats 5] [--ab]

With --cli: the console script itself, as a user runs it (`secure-afl sim --missing 7` in a
fresh process each time, output discarded): its wall seconds and its CPU seconds (user + sys of
the process and its children), every run listed, on a machine that should be otherwise idle.

With --cli, a calibration follows in a fresh process: FedAvg's rounds alone on the embedded data, on
one thread and on every core. This machine's speed drifts by the hour (the same run has taken
15 s and 19 s on the same day): compare wall times only beside the calibration of the same hour.
`--calibrate` prints the calibration alone.

With --ab (which implies --cli): each repeat runs the committed code and then
`bench/fedavg_last_bits.py` (FedAvg's float32 arithmetic changed in its last bits: the option left
open by the 15 s wall-time target, withdrawn on 2026-12-01), alternately, and compares their
`results.json` value by value (seconds left out).

Prints one markdown row per protection: the median over the repeats of each phase (data,
statistics, aggregation, solve, the wait for the gradient methods, metrics) and of the whole run, as
`run_experiment` times them, the wall seconds of FedAvg's training (beside the AFL phases, on a thread
here: only the console script forks it, see secure_afl/sim/gradient.py), plus the wall time of the
process-level call.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from secure_afl.sim.runner import run_experiment
from secure_afl.sim.setting import SimConfig

PHASES = ("data", "statistics", "aggregation", "solve", "gradient methods (wait)", "metrics")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--missing", default="7", help="comma list of missing levels")
    parser.add_argument(
        "--protection", "--secure", dest="secure", default="none,mask", help="comma list of protections"
    )
    parser.add_argument("--cli", action="store_true", help="time the console script in fresh processes")
    parser.add_argument("--calibrate", action="store_true", help="time FedAvg's rounds alone, then stop")
    parser.add_argument(
        "--ab", action="store_true", help="--cli, alternating with FedAvg's last bits changed, and compare"
    )
    args = parser.parse_args()
    if args.calibrate:
        calibrate()
        return
    if args.cli or args.ab:
        if args.ab:
            compare_last_bits(args.repeats, args.missing)
        else:
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


def console_script() -> str:
    # the console script of this interpreter's environment first (run as .venv/bin/python), then PATH
    beside = Path(sys.executable).parent / "secure-afl"
    script = str(beside) if beside.is_file() else shutil.which("secure-afl")
    if script is None:
        raise SystemExit(
            f"no secure-afl console script beside {sys.executable} or on PATH: run this with the "
            "environment's python after `pip install -e .`, or activate that environment"
        )
    return script


def timed_run(command: list[str], missing: str, out: str) -> tuple[float, float]:
    """Wall and CPU seconds (user + sys, the process and its children) of one fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(
        [*command, "sim", "--missing", missing, "--out", out], check=True, stdout=subprocess.DEVNULL
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def time_console_script(repeats: int, missing: str) -> None:
    script = console_script()
    load = os.getloadavg()[0]
    print(f"secure-afl sim --missing {missing}, {repeats} fresh processes (load average {load:.2f})")
    walls = []
    for run in range(repeats):
        with tempfile.TemporaryDirectory() as out:
            wall, cpu = timed_run([script], missing, out)
        walls.append(wall)
        print(f"run {run + 1}: {wall:.2f} s wall, {cpu:.2f} CPU-seconds")
    print(f"median {statistics.median(walls):.2f} s wall")


def compare_last_bits(repeats: int, missing: str) -> None:
    """The committed code and FedAvg with its last bits changed, alternately; then their results."""
    variants = {
        "committed": [console_script()],
        "last bits": [sys.executable, str(Path(__file__).with_name("fedavg_last_bits.py"))],
    }
    load = os.getloadavg()[0]
    print(f"secure-afl sim --missing {missing}, {repeats} alternating pairs (load average {load:.2f})")
    walls: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as keep:
        for run in range(repeats):
            for name, command in variants.items():
                out = Path(keep, f"{name}-{run}")
                wall, cpu = timed_run(command, missing, str(out))
                walls[name].append(wall)
                print(f"run {run + 1} {name}: {wall:.2f} s wall, {cpu:.2f} CPU-seconds")
        for name, values in walls.items():
            print(
                f"{name}: median {statistics.median(values):.2f} s wall ({min(values):.2f}-{max(values):.2f})"
            )
        results = {name: json.loads(Path(keep, f"{name}-0", "results.json").read_text()) for name in variants}
    differences = list(differing_values(results["committed"], results["last bits"]))
    printed = [(where, a, b) for where, a, b in differences if f"{a:.4f}" != f"{b:.4f}"]
    largest = max((abs(a - b) for _, a, b in differences), default=0.0)
    count = len(differences)
    print(f"results.json: {count} values differ, at most by {largest:.2g}; {len(printed)} at 4 decimals")
    for where, a, b in differences:
        print(f"  {where}: {a!r} -> {b!r}")


def differing_values(a: object, b: object, where: str = "") -> Iterator[tuple[str, float, float]]:
    """The numbers that differ between two JSON documents, seconds left out; any other difference fails."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            raise SystemExit(f"results.json differ in their keys at {where or 'the top'}")
        for key in a:
            if "second" not in key:
                yield from differing_values(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            yield from differing_values(x, y, f"{where}[{i}]")
    elif isinstance(a, float | int) and isinstance(b, float | int) and not isinstance(a, bool):
        if a != b:
            yield where, float(a), float(b)
    elif a != b:
        raise SystemExit(f"results.json differ at {where}: {a!r} against {b!r}")


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
