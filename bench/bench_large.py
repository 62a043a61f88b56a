"""The secure path at Table III's widths: ``sim --missing 7 --fraction 0.2 --fedavg-rounds 1`` at
d = 1024, 2048, 4096, ``--protection none`` and ``mask`` side by side, each run in a child
process.

Per run: wall seconds, the aggregation phase's seconds (from results.json), the child's peak RSS
(``os.wait4``'s ``ru_maxrss``: the child and its own children) and that peak over one packed Gram
triangle's bytes (``8·d(d+1)/2``).  Per d: the masked aggregation's floor, measured here in the
same run: the AES-CTR keystream of every mask over a Gram (each member of a group masks with its
self mask and one pairwise mask per other member, the server removes each self mask), one pass
encoding every Gram copy to fixed point and one add per mask, at the rates this host gives on one
triangle right now.  The other tensors (d-vectors) are left out of the floor (under 1% of words).
Beside it, the floor of the groups as sent (``wire_floor_s``): at missing 7 the class groups
partition the clients and the plan every driver makes sums `all`'s Gram from theirs instead of
sending it (``aggregation/difference.py``), so the protocol's arithmetic is below the method's
floor.  Reported beside it, not in it: the floor with the protocol's digests, one SHA-256 pass per client
over its Gram (the release's value id, which the one-contribution rule needs before R0: a deployed
client's work; the simulator's policy has no such rule and its clients make no release), and the
floor on the threads the masking sessions split a large mask among (``core/workers``: this
process's CPUs, at most 2), each thread on its share of the words.

``--tree PATH`` (repeatable) runs another checkout's code on the same data in the same loop (e.g.
the code before a change, unpacked with ``git archive``), the trees interleaved per d and path;
``--pairs`` repeats each.  Results go to ``--json``.

Run from the repository root: ``python bench/bench_large.py [--dims 1024,2048,4096] [--tree OLD]``.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
N_CLIENTS = 8


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def protection_option(tree: Path) -> str:
    """``sim``'s option naming the protection in ``tree``: ``--protection``, or ``--secure`` in a
    tree from before it (where the new name would be refused)."""
    cli = tree / "secure_afl" / "cli.py"
    return "--protection" if '"--protection"' in cli.read_text() else "--secure"


def run_child(tree: Path, dim: int, secure: str, out: Path) -> dict[str, object]:
    """One ``secure-afl sim`` in a child process with ``tree`` first on the path."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    command = [
        sys.executable,
        "-c",
        "from secure_afl.console import run; run()",
        "sim",
        "--missing",
        "7",
        "--fraction",
        "0.2",
        "--fedavg-rounds",
        "1",
        "--dim",
        str(dim),
        protection_option(tree),
        secure,
        "--out",
        str(out),
    ]
    load = os.getloadavg()[0]
    started = time.perf_counter()
    child = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - started
    stderr = child.stderr.read().decode() if child.stderr else ""
    if status != 0:
        raise SystemExit(
            f"sim --dim {dim} {protection_option(tree)} {secure} in {tree} failed:\n{stderr[-2000:]}"
        )
    phases = json.loads((out / "results.json").read_text())["seconds_per_phase"]
    peak = usage.ru_maxrss * 1024  # kilobytes on Linux
    triangle = 8 * dim * (dim + 1) // 2
    return {
        "wall_s": wall,
        "aggregation_s": phases.get("aggregation", 0.0),
        "solve_s": phases.get("solve", 0.0),
        "statistics_s": phases.get("statistics", 0.0),
        "peak_rss_gib": peak / 2**30,
        "peak_rss_triangles": peak / triangle,
        "load": load,
    }


def gram_group_sizes() -> tuple[list[int], list[int]]:
    """The sizes of the groups summing a Gram at missing 7: the method's (each class group's
    annotators, and `all`: every client), and as sent after ``difference.plan_wire``."""
    from secure_afl.aggregation.difference import plan_wire
    from secure_afl.aggregation.layout import Layout
    from secure_afl.sim.partial import assign_partial_labels

    assignment = assign_partial_labels(N_CLIENTS, 8, 7, seed=0, missing1="permutation")
    clients = [f"client-{k}" for k in range(N_CLIENTS)]
    members = {f"class/{c}": [clients[k] for k in m] for c, m in enumerate(assignment.coverage()) if m}
    members["all"] = clients
    sizes = [len(m) for m in members.values()]
    layout = Layout(
        groups={g: {"gram": 1, **({} if g == "all" else {"b": 1})} for g in members},
        shapes={"gram": (1, 1), "b": (1,)},
        symmetric=frozenset({"gram"}),
    )
    plan = plan_wire(members, layout, min_group_size=1, frac_bits=32)
    if plan is None:
        return sizes, sizes
    wire = plan.wire_layout(layout)
    everyone = {**members, **plan.members}
    return sizes, [len(everyone[g]) for g, tensors in wire.groups.items() if "gram" in tensors]


def mask_floor(dim: int) -> dict[str, float]:
    """Seconds of the masked aggregation's arithmetic floor at ``dim`` (see the module docstring),
    from this host's rates on one triangle now."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    from secure_afl.core import encoding
    from secure_afl.core.workers import for_this_process

    words = dim * (dim + 1) // 2
    values = np.random.default_rng(0).standard_normal(words)
    chunk = 1 << 15
    zeros = bytearray(8 * chunk)
    out = bytearray(8 * chunk + 15)

    def keystream() -> None:
        stream = Cipher(algorithms.AES(bytes(32)), modes.CTR(bytes(16))).encryptor()
        for _ in range(0, words, chunk):
            stream.update_into(zeros, out)

    acc = np.zeros(words, dtype=np.uint64)
    other = np.ones(words, dtype=np.uint64)

    def best(fn, repeat: int = 3) -> float:
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    t_stream = best(keystream)
    t_encode = best(lambda: encoding.encode(values, tensor="gram", group_size=N_CLIENTS))
    t_add = best(lambda: np.add(acc, other, out=acc))
    # The same work on the threads the masking sessions use (core/workers: this process's CPUs,
    # at most 2), each on its share of the words, as prg.add_masks splits them.
    threads = for_this_process().count
    bounds = [words * i // threads for i in range(threads + 1)]
    shares = list(itertools.pairwise(bounds))

    def on_threads(work) -> float:
        with ThreadPoolExecutor(threads) as pool:
            return best(lambda: list(pool.map(lambda share: work(*share), shares)))

    def keystream_share(lo: int, hi: int) -> None:
        stream = Cipher(algorithms.AES(bytes(32)), modes.CTR(bytes(16))).encryptor()
        zeros_, out_ = bytearray(8 * chunk), bytearray(8 * chunk + 15)
        for _ in range(lo, hi, chunk):
            stream.update_into(zeros_, out_)

    t_stream_threads = on_threads(keystream_share)
    t_encode_threads = on_threads(
        lambda lo, hi: encoding.encode(values[lo:hi], tensor="gram", group_size=N_CLIENTS)
    )
    t_add_threads = on_threads(lambda lo, hi: np.add(acc[lo:hi], other[lo:hi], out=acc[lo:hi]))
    t_digest = best(lambda: hashlib.sha256(values).digest())
    sizes, wire_sizes = gram_group_sizes()
    masks = sum(m * m + m for m in sizes)  # m members × (self + m - 1 pairs), and m self unmasks
    copies = sum(sizes)
    wire_masks = sum(m * m + m for m in wire_sizes)
    wire_copies = sum(wire_sizes)
    return {
        "keystream_s": masks * t_stream,
        "encode_s": copies * t_encode,
        "add_s": (masks + copies) * t_add,
        "floor_s": masks * t_stream + copies * t_encode + (masks + copies) * t_add,
        # Not in the floor: the protocol's digest of each client's Gram (the release's value id,
        # privacy/release.py: one SHA-256 pass per client, whatever the number of its groups),
        # made by a deployed client (the one-contribution rule), not by the simulator's.
        "digest_s": N_CLIENTS * t_digest,
        "floor_with_digest_s": masks * t_stream
        + copies * t_encode
        + (masks + copies) * t_add
        + N_CLIENTS * t_digest,
        # The floor on the sessions' threads (their count in "threads"): what the masking could
        # reach there, against which the aggregation's wall seconds are also reported.
        "threads": threads,
        "floor_threads_s": masks * t_stream_threads
        + copies * t_encode_threads
        + (masks + copies) * t_add_threads,
        "mask_streams": masks,
        "gram_copies": copies,
        # The floor of the Gram groups as sent, after the plan every driver makes (at missing 7 the
        # class groups partition the clients: `all`'s Gram is summed from theirs, not sent).
        "wire_floor_s": wire_masks * t_stream + wire_copies * t_encode + (wire_masks + wire_copies) * t_add,
        "wire_mask_streams": wire_masks,
        "wire_gram_copies": wire_copies,
        "keystream_gb_per_s": 8 * words / t_stream / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default="1024,2048,4096")
    parser.add_argument("--tree", action="append", default=[], help="another checkout to run beside this one")
    parser.add_argument("--pairs", type=int, default=1)
    parser.add_argument("--json", default="bench_large.json")
    args = parser.parse_args()
    trees = {"this": ROOT, **{f"tree{i}:{Path(t).name}": Path(t).resolve() for i, t in enumerate(args.tree)}}
    dims = [int(d) for d in args.dims.split(",")]
    report: dict[str, object] = {
        "host": cpu_name(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "trees": {k: str(v) for k, v in trees.items()},
        "dims": {},
    }
    with tempfile.TemporaryDirectory() as scratch:
        for dim in dims:
            runs: dict[str, dict[str, list[dict[str, object]]]] = {t: {"none": [], "mask": []} for t in trees}
            for i in range(args.pairs):
                order = ("mask", "none") if i % 2 == 0 else ("none", "mask")
                for name, tree in trees.items():
                    for secure in order:
                        out = Path(scratch) / f"{dim}-{secure}-{i}-{len(runs)}"
                        result = run_child(tree, dim, secure, out)
                        runs[name][secure].append(result)
                        print(
                            f"d={dim} {name} {secure}: wall {result['wall_s']:.1f} s, aggregation "
                            f"{result['aggregation_s']:.2f} s, peak {result['peak_rss_gib']:.2f} GiB "
                            f"({result['peak_rss_triangles']:.1f} triangles), load {result['load']:.1f}",
                            flush=True,
                        )
            floor = mask_floor(dim)
            summary = {}
            for name in trees:
                m, n = runs[name]["mask"], runs[name]["none"]
                summary[name] = {
                    "wall_mask_over_none": statistics.median(
                        a["wall_s"] / b["wall_s"] for a, b in zip(m, n, strict=True)
                    ),
                    "aggregation_mask_s": statistics.median(a["aggregation_s"] for a in m),
                    "aggregation_none_s": statistics.median(b["aggregation_s"] for b in n),
                    "aggregation_mask_over_floor": statistics.median(a["aggregation_s"] for a in m)
                    / floor["floor_s"],
                    "aggregation_mask_over_floor_with_digest": statistics.median(
                        a["aggregation_s"] for a in m
                    )
                    / floor["floor_with_digest_s"],
                    "aggregation_mask_over_floor_threads": statistics.median(a["aggregation_s"] for a in m)
                    / floor["floor_threads_s"],
                    "aggregation_mask_over_wire_floor": statistics.median(a["aggregation_s"] for a in m)
                    / floor["wire_floor_s"],
                    "peak_rss_gib": {
                        "mask": max(a["peak_rss_gib"] for a in m),
                        "none": max(b["peak_rss_gib"] for b in n),
                    },
                    "peak_rss_triangles": {
                        "mask": max(a["peak_rss_triangles"] for a in m),
                        "none": max(b["peak_rss_triangles"] for b in n),
                    },
                    "runs": runs[name],
                }
                s = summary[name]
                print(
                    f"d={dim} {name}: wall mask/none {s['wall_mask_over_none']:.2f}; aggregation "
                    f"{s['aggregation_mask_s']:.2f} / {s['aggregation_none_s']:.2f} s "
                    f"({s['aggregation_mask_over_floor']:.2f}× the floor {floor['floor_s']:.2f} s, "
                    f"{s['aggregation_mask_over_floor_with_digest']:.2f}× with the digests "
                    f"{floor['floor_with_digest_s']:.2f} s, "
                    f"{s['aggregation_mask_over_floor_threads']:.2f}× the floor on "
                    f"{floor['threads']} threads {floor['floor_threads_s']:.2f} s, "
                    f"{s['aggregation_mask_over_wire_floor']:.2f}× the floor of the groups as sent "
                    f"{floor['wire_floor_s']:.2f} s); "
                    f"peak {s['peak_rss_gib']['mask']:.2f} / {s['peak_rss_gib']['none']:.2f} GiB",
                    flush=True,
                )
            report["dims"][str(dim)] = {"floor": floor, "trees": summary}  # type: ignore[index]
            Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
