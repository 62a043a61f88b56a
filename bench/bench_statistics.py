"""Client statistics against a bare syrk at Table III's widths: ``client_statistics`` on float64
and on float32 features over CPU-seconds of numpy's ``HᵀH`` of the same float64 shape, one BLAS
thread, the median of ``--repeats`` calls, each alternated with a syrk's, one dtype at a time,
``--runs`` times per width (5,889 rows, the embedded data's largest client).
:func:`bench_scale.statistics_ratio` measures each run.

Run from the repository root: ``python bench/bench_statistics.py [--dims 1024,2048,4096]
[--repeats 15] [--runs 3] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from bench_large import cpu_name
from bench_scale import statistics_ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default="1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write every run here")
    args = parser.parse_args()
    report: dict[str, object] = {
        "host": cpu_name(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load": os.getloadavg()[0],
        "repeats": args.repeats,
        "dims": {},
    }
    for dim in (int(d) for d in args.dims.split(",")):
        runs = [statistics_ratio(d=dim, repeats=args.repeats) for _ in range(args.runs)]
        report["dims"][str(dim)] = runs  # type: ignore[index]
        f64 = ", ".join(f"{r['float64_over_syrk']:.3f}" for r in runs)
        f32 = ", ".join(f"{r['float32_over_syrk']:.3f}" for r in runs)
        syrk = runs[0]["syrk_cpu_seconds"]
        print(f"d={dim}: syrk {syrk:.3f} CPU-s; float64 {f64}; float32 {f32}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
