"""A deployed node at a large width: `secure-afl deploy local --dim D`, its peak RSS and seconds per
round, beside the plaintext statistics it protects (and the same federation at ``--baseline-dim``,
32 by default, run first: what the width adds to each round).

The federation runs as `deploy local` runs it (one SuperLink, one SuperNode per institution with its
SuperExec and one ClientApp process per message, the ServerApp); this script samples every process
of it every 0.1 s (``/proc``: each process's ``VmHWM``, its peak, and ``VmRSS``).  A node is its
SuperNode and the SuperExec and ClientApps that serve its port: per node, the largest single
process and the largest sum of its processes' RSS in one sample (a sample can miss a peak shorter
than 0.1 s).  Seconds per round are the ServerApp's (``report.json``: request to last reply, so
Flower's own start of a ClientApp process per message is in them).

Beside them, the plaintext statistics each node computes and protects, on its own rows of the same
data (``secure_afl.sim.datasets.prepare``, as `deploy local` partitions it): CPU-seconds of
``client_statistics`` (one BLAS thread, best of 3) and the bytes of the statistics held packed (the
Gram's triangle and the per-class and feature sums).  Needs the deploy extra (flwr 1.42).

Run from the repository root:
``python bench/bench_deploy_node.py [--dim 2048] [--baseline-dim 32] [--fraction 0.05] [--clients 5]
[--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROLES = (
    "flower-superlink",
    "flower-supernode",
    "flower-superexec",
    "flwr-clientapp",
    "flwr-serverapp",
    "flwr run",
)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _sample(pid: int) -> tuple[int, int, str] | None:
    """(VmHWM, VmRSS) in bytes and the command line, or None once the process is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    kib = {k: int(fields.get(k, "0 kB").split()[0]) for k in ("VmHWM", "VmRSS")}
    return kib["VmHWM"] * 1024, kib["VmRSS"] * 1024, command


def _role(command: str) -> str:
    return next(
        (role for role in ROLES if role in command), "deploy local" if "deploy" in command else "other"
    )


def _port(command: str) -> str | None:
    """The node port a process belongs to: a SuperNode's --port, its SuperExec's and ClientApps'
    --runtime-api-address."""
    match = re.search(r"--port (\d+)", command) if "flower-supernode" in command else None
    match = match or re.search(r"--runtime-api-address 127\.0\.0\.1:(\d+)", command)
    return match.group(1) if match else None


def run_federation(args: argparse.Namespace, dim: int, out: Path) -> dict[str, object]:
    command = [sys.executable, "-c", "from secure_afl.console import run; run()", "deploy", "local"]
    command += ["--dim", str(dim), "--fraction", str(args.fraction), "--clients", str(args.clients)]
    command += ["--protection", args.secure, "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    load = os.getloadavg()[0]
    started = time.perf_counter()
    child = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    processes: dict[int, dict[str, object]] = {}
    node_sums: dict[str, int] = {}
    while child.poll() is None:
        sums: dict[str, int] = {}
        for pid in _descendants(child.pid):
            sample = _sample(pid)
            if sample is None:
                continue
            hwm, rss, cmd = sample
            entry = processes.setdefault(pid, {"peak_bytes": 0, "cmd": None, "role": "other", "port": None})
            if cmd.strip() and cmd != entry["cmd"]:
                # A fork sampled before its exec shows its parent (its memory too): what it runs now
                # counts, from its new peak (an exec starts VmHWM again); an exited one shows nothing.
                entry.update(cmd=cmd, role=_role(cmd), port=_port(cmd), peak_bytes=0)
            entry["peak_bytes"] = max(int(entry["peak_bytes"]), hwm)  # type: ignore[call-overload]
            if entry["port"] is not None and entry["role"] != "flwr-serverapp":
                sums[str(entry["port"])] = sums.get(str(entry["port"]), 0) + rss
        for port, total in sums.items():
            node_sums[port] = max(node_sums.get(port, 0), total)
        time.sleep(0.1)
    wall = time.perf_counter() - started
    stderr = child.stderr.read().decode() if child.stderr else ""
    if child.returncode != 0:
        raise SystemExit(f"deploy local failed ({child.returncode}):\n{stderr[-2000:]}")
    report = json.loads((out / "report.json").read_text())
    nodes = {}
    for entry in processes.values():
        if entry["role"] == "flower-supernode":
            port = entry["port"]
            mine = [e for e in processes.values() if e["port"] == port]
            nodes[str(port)] = {
                "supernode_peak_gib": int(entry["peak_bytes"]) / 2**30,  # type: ignore[call-overload]
                "largest_process_gib": max(int(e["peak_bytes"]) for e in mine) / 2**30,  # type: ignore[call-overload]
                "largest_clientapp_gib": max(
                    (int(e["peak_bytes"]) for e in mine if e["role"] == "flwr-clientapp"),  # type: ignore[call-overload]
                    default=0,
                )
                / 2**30,
                "sum_of_processes_peak_gib": node_sums.get(str(port), 0) / 2**30,
            }
    by_role: dict[str, float] = {}
    for entry in processes.values():
        role = str(entry["role"])
        by_role[role] = max(by_role.get(role, 0.0), int(entry["peak_bytes"]) / 2**30)  # type: ignore[call-overload]
    return {
        "wall_s": wall,
        "load": load,
        "round_seconds": report["sessions"][0]["round_seconds"],
        "server_seconds": report["seconds"],
        "local_seconds": report["local_seconds"],
        "nodes": nodes,
        "peak_gib_by_role": by_role,
        "clientapp_processes": sum(1 for e in processes.values() if e["role"] == "flwr-clientapp"),
        "processes": sorted(
            (
                {"role": e["role"], "port": e["port"], "peak_gib": int(e["peak_bytes"]) / 2**30}
                for e in processes.values()
            ),  # type: ignore[call-overload]
            key=lambda e: (str(e["role"]), str(e["port"])),
        ),
    }


def plaintext_statistics(args: argparse.Namespace) -> dict[str, object]:
    """Each node's plaintext statistics on its own rows (as `deploy local` partitions the data)."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    from secure_afl.sim.datasets import prepare
    from secure_afl.statistics import client_statistics

    data = prepare(None, fraction=args.fraction, dim=args.dim, seed=0, n_clients=args.clients)
    out = []
    with threadpool_limits(1, user_api="blas"):
        for rows in data.split.clients:
            features, labels = data.features[rows], data.cohort.labels[rows]
            times = []
            for _ in range(3):
                started = time.process_time()
                stats = client_statistics(features, labels, device="cpu")
                times.append(time.process_time() - started)
            packed = stats.packed()
            held = packed.gram.nbytes + packed.feat_sum.nbytes + packed.pos_sum.nbytes + packed.n_pos.nbytes
            out.append(
                {
                    "rows": len(rows),
                    "cpu_seconds": min(times),
                    "gram_triangle_mib": packed.gram.nbytes / 2**20,
                    "statistics_packed_mib": held / 2**20,  # the Gram's triangle, feat_sum, pos_sum, n_pos
                    "features_mib": features.nbytes / 2**20,
                }
            )
            del stats, packed
    return {"nodes": out, "feature_dtype": str(np.asarray(data.features[:1]).dtype)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--fraction", type=float, default=0.05)
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--protection", "--secure", dest="secure", choices=("mask", "ckks"), default="mask")
    parser.add_argument(
        "--baseline-dim", type=int, default=32, help="the same federation at this width first (0: none)"
    )
    parser.add_argument("--json", default="bench_deploy_node.json")
    args = parser.parse_args()
    result: dict[str, object] = {
        "host": cpu_name(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": f"deploy local --dim {args.dim} --fraction {args.fraction} --clients {args.clients} "
        f"--protection {args.secure}",
    }
    with tempfile.TemporaryDirectory() as scratch:
        if args.baseline_dim:
            result["baseline_federation"] = run_federation(args, args.baseline_dim, Path(scratch) / "base")
            result["baseline_dim"] = args.baseline_dim
        result["federation"] = run_federation(args, args.dim, Path(scratch) / "out")
    result["plaintext_statistics"] = plaintext_statistics(args)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
