"""The classifier check's cost beside the session's (SECURITY.md §5.1, secure_afl/deploy/verify.py).

An in-process federation (the deployment's server and node handler, every node in this process, no
Flower: tests/deploy/helpers.py) of ``--clients`` institutions, ``--classes`` classes (client k
does not label class k), ``--rows`` random non-negative rows each, masking, one round, client
balance, global Gram.  Per width: the seconds of the session (``federation``: every node's
statistics and protocol rounds and the solve), of the classifier's delivery and of the check
(every node's residual terms, masks and signature when the classifier arrives, the one relay and
every node's decision), all nodes' work summed since they share this process; the same as this
process's CPU seconds (every thread: steadier than wall seconds on a loaded host; the session's
from the server's start to its solve); and the largest honest residual/bound any node saw (the
tolerance's margin).

Run from the repository root: ``python bench/bench_verify.py [--dims 1024,2048] [--clients 8]
[--classes 8] [--rows 5889]`` (5,889 rows: a ChestXray14 client of the paper's protocol, as in
bench_secure.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def measure(dim: int, clients: int, classes: int, rows: int) -> dict[str, float]:
    import tests.deploy.helpers as helpers
    from secure_afl.deploy import client
    from secure_afl.deploy.server import FederationServer
    from secure_afl.deploy.verify import ServerCheck

    cpu: dict[str, float] = {}
    wall: dict[str, float] = {}

    def timed(name: str, method):  # wall and the process's CPU seconds (every thread), summed over calls
        def wrapper(*args, **kwargs):
            started, started_cpu = time.perf_counter(), time.process_time()
            try:
                return method(*args, **kwargs)
            finally:
                wall[name] = wall.get(name, 0.0) + time.perf_counter() - started
                cpu[name] = cpu.get(name, 0.0) + time.process_time() - started_cpu

        return wrapper

    helpers.CLASSES = tuple(f"class-{c}" for c in range(classes))
    originals = FederationServer.run, ServerCheck.run, client.begin_check
    FederationServer.run = timed("session", originals[0])
    ServerCheck.run = timed("verify", originals[1])
    client.begin_check = timed("verify", originals[2])  # the nodes' terms, on the classifier's arrival
    try:
        with tempfile.TemporaryDirectory() as tmp:
            federation = helpers.make_federation(Path(tmp), n_clients=clients, dim=dim, rows=rows)
            started = time.perf_counter()
            server, _, _ = helpers.run_server(federation)
            total = time.perf_counter() - started
            ratios = [
                json.loads((n.settings.out_dir / "classifier.verified.json").read_text())[
                    "max_residual_over_bound"
                ]
                for n in federation.nodes.values()
            ]
    finally:
        FederationServer.run, ServerCheck.run, client.begin_check = originals
    seconds = server.report.seconds
    assert len(server.report.verified) == clients, server.report.refusals
    return {
        "dim": dim,
        "session_s": seconds["federation"],
        "deliver_s": seconds["deliver"],
        "verify_s": wall["verify"],
        "total_s": total,
        "verify_over_session": wall["verify"] / seconds["federation"],
        "session_cpu_s": cpu["session"],
        "verify_cpu_s": cpu["verify"],
        "verify_cpu_over_session": cpu["verify"] / cpu["session"],
        "max_residual_over_bound": max(ratios),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", default="1024,2048")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--classes", type=int, default=8)
    parser.add_argument("--rows", type=int, default=5889)
    args = parser.parse_args()
    import io
    from contextlib import redirect_stderr

    for dim in (int(d) for d in args.dims.split(",")):
        with redirect_stderr(io.StringIO()):  # the nodes' log lines
            row = measure(dim, args.clients, args.classes, args.rows)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
