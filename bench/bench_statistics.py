"""Client statistics against a bare syrk at Table III's widths: ``client_statistics`` on float64
and on float32 features over CPU-seconds of numpy's ``HᵀH`` of the same float64 shape, one BLAS
thread, the median of ``--repeats`` calls, each alternated with a syrk's, one dtype at a time,
``--runs`` times per width (5,889 rows, the embedded data's largest client: two batches of the
statistics' 4,096 rows).  :func:`bench_scale.statistics_ratio` measures each run.

Both calls of a pair find their memory in the same state: ``warm`` (each right after an untimed
call of its own kind, as clients computed one after another reuse what the last freed) for
``--runs`` runs, then ``cold`` (each after seconds idle, so what it allocates is memory the
kernel gave back: on a VM with free page reporting the hypervisor maps it in again) for one run
of ``--cold-repeats`` calls.  Kernel seconds are reported beside the CPU-seconds.

Run from the repository root: ``python bench/bench_statistics.py [--dims 1024,2048,4096]
[--repeats 15] [--runs 3] [--cold-repeats 5] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from bench_large import cpu_name
from bench_scale import COLD_IDLE_SECONDS, statistics_ratio


def virtio_balloon_loaded() -> bool:
    """Whether the kernel runs the virtio balloon driver, the one whose free page reporting hands
    freed memory back to a hypervisor (whether reporting is on, the host decides: the cold runs'
    kernel seconds show it)."""
    return Path("/sys/bus/virtio/drivers/virtio_balloon").is_dir()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default="1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cold-repeats", type=int, default=5, help="0: no cold run")
    parser.add_argument("--json", default=None, help="also write every run here")
    args = parser.parse_args()
    report: dict[str, object] = {
        "host": cpu_name(),
        "virtio_balloon": virtio_balloon_loaded(),
        "cold_idle_seconds": COLD_IDLE_SECONDS,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load": os.getloadavg()[0],
        "repeats": args.repeats,
        "cold_repeats": args.cold_repeats,
        "dims": {},
    }
    for dim in (int(d) for d in args.dims.split(",")):
        runs = [statistics_ratio(d=dim, repeats=args.repeats, memory="warm") for _ in range(args.runs)]
        if args.cold_repeats:
            runs.append(statistics_ratio(d=dim, repeats=args.cold_repeats, memory="cold"))
        report["dims"][str(dim)] = runs  # type: ignore[index]
        for memory in ("warm", "cold"):
            chosen = [r for r in runs if r["memory"] == memory]
            if not chosen:
                continue
            f64 = ", ".join(f"{r['float64_over_syrk']:.3f}" for r in chosen)
            f32 = ", ".join(f"{r['float32_over_syrk']:.3f}" for r in chosen)
            first = chosen[0]
            print(
                f"d={dim} {memory}: syrk {first['syrk_cpu_seconds']:.3f} CPU-s "
                f"({first['syrk_kernel_seconds_beside_float64']:.3f} kernel); "
                f"float64 {f64} ({first['float64_kernel_seconds']:.3f} kernel); "
                f"float32 {f32} ({first['float32_kernel_seconds']:.3f} kernel)",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
